"""The interpreter runs of the Triton kernels, each a child pytest under `TRITON_INTERPRET=1`
(which must be set before any kernel is JIT-ed).

The children are started as soon as the tests are collected (`tests/conftest.py`) and only
waited for by their test: a run under the interpreter is minutes of one CPU, which the rest of
the suite can use the other CPUs beside.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_children: dict[str, tuple[subprocess.Popen, object]] = {}


def start(test_file: str) -> None:
    """Start `test_file`'s `test_interp_*` cases in a child pytest (once)."""
    key = str(Path(test_file).resolve())
    if key in _children:
        return
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "pytest", key, "-q", "-x", "-p", "no:cacheprovider"]
    log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (it outlives this call: see result)
    proc = subprocess.Popen(
        [*cmd, "-k", "test_interp_"], env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT
    )
    _children[key] = (proc, log)


def result(test_file: str) -> tuple[int, str]:
    """Wait for `test_file`'s child (starting it now if nobody did); its exit code and output."""
    start(test_file)
    proc, log = _children.pop(str(Path(test_file).resolve()))
    code = proc.wait()
    log.seek(0)
    return code, log.read()


def stop_all() -> None:
    for proc, log in _children.values():
        proc.kill()
        proc.wait()
        log.close()
    _children.clear()

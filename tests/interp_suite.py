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


def row_independent_dot(monkeypatch) -> None:
    """Make every row of an interpreted `tl.dot` its own `[1, K] @ [K, N]` product, as a GPU's
    MMA computes each output row alone. The interpreter runs `tl.dot` as one `np.matmul` of the
    whole tile, and BLAS (OpenBLAS on AMD Zen, for one) may sum a row's products in an order set
    by its place in the tile: with this, a bits test checks the kernel's part, that no tile
    shape, padding row, chunking or split mixes one row's sums with another's."""
    import numpy as np
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.data.ndim != 2 or a.dtype.primitive_bitwidth == 8 or b.dtype.primitive_bitwidth == 8:
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        out = np.stack([np.matmul(row[None], b.data, dtype=d.data.dtype)[0] for row in a.data])
        return interpreter.TensorHandle(out + d.data, d.dtype.scalar)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)

"""SIGTERM while `generate` imports torch (the first seconds of a model load): one error line and
exit 75, nothing of torch's. A stop cut short inside `import torch` once left torch's loggers
unset, and the exit hook torch had registered by then (FakeTensor's cache statistics, at INFO)
logged through the job's handler."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from pagedctl.exits import EXIT_TEMPFAIL

ROOT = Path(__file__).resolve().parents[1]

# SIGTERM from inside `import torch`, right after torch's FakeTensor module has run to its end
# (its exit hook registered) and before torch's own logging set-up: the moment a real signal hit.
STOP_IN_IMPORT = """
import os, signal, sys

class StopInTorchImport:
    sent = False

    def find_spec(self, name, path=None, target=None):
        fake = sys.modules.get("torch._subclasses.fake_tensor")
        if not self.sent and name.startswith("torch.") and hasattr(fake, "dump_cache_stats"):
            self.sent = True
            os.kill(os.getpid(), signal.SIGTERM)
        return None

sys.meta_path.insert(0, StopInTorchImport())
sys.argv = ["pagedctl", "generate", sys.argv[1], "-o", sys.argv[2]]
from pagedctl.cli import main
main()
"""


def test_sigterm_inside_the_torch_import_prints_one_line(tmp_path: Path) -> None:
    src = ROOT / "recipes" / "data" / "example.jsonl"
    out = tmp_path / "out.jsonl"
    res = subprocess.run(
        [sys.executable, "-c", STOP_IN_IMPORT, str(src), str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert res.returncode == EXIT_TEMPFAIL, res.stderr
    assert res.stderr.splitlines() == [
        "error: stopped by SIGTERM before the first request: rerun the same command"
    ]
    assert not out.exists()

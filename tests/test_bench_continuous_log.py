"""The hf-continuous peer's log: transformers' notes that psutil is missing stay out of it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

RECIPE = """
name: tiny-cb
model: tiny-llama
device: cpu
dtype: float32
seed: 0
engine: {block_size: 16, max_num_seqs: 4, kv_cache_memory: 8MiB}
workload:
  num_requests: 3
  prompt_len: [8, 16]
  output_len: [4, 8]
  token_ids: [0, 500]
  seed: 0
  temperature: 0
peers:
  hf-continuous: {page_size: 32, num_blocks: 16, max_batch_tokens: 64}
"""

# psutil made unimportable (and invisible to importlib.util.find_spec, as transformers looks for
# it) whether or not this environment has it, then the CLI as `pagedctl` runs it
NO_PSUTIL = "import sys; sys.modules['psutil'] = None; from pagedctl.cli import main; main()"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU memory query")
def test_hf_continuous_without_psutil_logs_no_error(tmp_path: Path) -> None:
    recipe = tmp_path / "tiny-cb.yaml"
    recipe.write_text(RECIPE)
    args = ["bench", "--recipe", recipe, "--peer", "hf-continuous", "--out", tmp_path]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", NO_PSUTIL, *map(str, args)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log
    sides = {r["side"]: r for r in json.loads((tmp_path / "tiny-cb.json").read_text())["sides"]}
    assert sides["hf-continuous"]["status"] == "ok", sides["hf-continuous"]
    assert "hf-continuous: ok" in log
    assert not [line for line in log.splitlines() if "ERROR" in line or "psutil" in line], log

"""`pagedctl capacity --probe`: the CPU-testable parts (formatting, the engine contract), and the
real probe on CUDA (gpu-marked, skipped without a GPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import ClassVar

import pytest
import torch

from pagedctl.capacity import probe

REPO = Path(__file__).resolve().parent.parent
GiB = 2**30


def fake_memory(g: float) -> dict:
    return {
        "weights_bytes": 988_065_536,
        "activation_peak_bytes": int(0.5 * GiB),
        "non_kv_bytes": 988_065_536 + int(0.5 * GiB),
        "kv_cache_bytes": 1000 * 196_608,
        "num_blocks": int(1000 * g),
        "block_size": 16,
        "total_bytes": 140 * GiB,
        "utilization": g,
        "cuda_graph_bytes": 64 * 2**20,
        "cuda_graph_reserve_bytes": int(0.5 * GiB),
    }


class FakeLLM:
    """Stands in for pagedctl.engine.LLM: records how it was built and reconfigured."""

    built: ClassVar[list[dict]] = []

    def __init__(self, model: str, **kw) -> None:
        FakeLLM.built.append({"model": model, **kw})
        self.memory = fake_memory(kw["gpu_memory_utilization"])

    def reconfigure(self, **kw) -> None:
        self.memory = fake_memory(kw["gpu_memory_utilization"])


def test_engine_probe_loads_once_and_reconfigures() -> None:
    FakeLLM.built = []
    rows = probe.probe_engine("qwen2.5-0.5b-instruct", [0.5, 0.9], 16, "bfloat16", 2048, FakeLLM)
    assert [r["num_blocks"] for r in rows] == [500, 900]
    (built,) = FakeLLM.built
    assert built["load_format"] == "dummy" and built["device"] == "cuda"
    assert built["gpu_memory_utilization"] == 0.5 and built["block_size"] == 16
    assert built["cuda_graphs"] is True  # as the estimate counts the graphs' pool by default
    FakeLLM.built = []
    probe.probe_engine("m", [0.9], 16, "bfloat16", 2048, FakeLLM, cuda_graphs=False)
    assert FakeLLM.built[0]["cuda_graphs"] is False


def test_an_engine_without_the_memory_contract_is_a_clear_error() -> None:
    class Old:
        def __init__(self, model: str, **kw) -> None:
            pass

    with pytest.raises(probe.ProbeError, match="does not report `memory`"):
        probe.probe_engine("m", [0.9], 16, "float16", 2048, Old)

    class Partial(Old):
        memory: ClassVar[dict] = {"weights_bytes": 1}

    with pytest.raises(probe.ProbeError, match="lacks"):
        probe.probe_engine("m", [0.9], 16, "float16", 2048, Partial)


def test_probe_rows_put_measured_beside_estimated() -> None:
    estimate = {
        "total_bytes": 140 * GiB,
        "cuda_context_bytes": 256 * 2**20,
        "contiguous_whole_card": 5800,
        "weights_bytes": 988_065_536,
        "activation_peak_bytes": int(0.4 * GiB),
        "graph_reserve_bytes": int(0.4 * GiB),
        "non_kv_bytes": 988_065_536 + int(0.8 * GiB),
        "pools": {0.5: 480},
    }
    contiguous = {
        "total_bytes": 140 * GiB,
        "outside_torch_bytes": 512 * 2**20,
        "reservations": 5742,
    }
    rows = {r["what"]: r for r in probe.probe_rows(estimate, contiguous, [fake_memory(0.5)])}
    card = rows["contiguous max-len reservations, whole card"]
    assert (card["estimate"], card["measured"], card["diff"]) == ("5,800", "5,742", "-1.0%")
    assert rows["activation peak @0.5"]["diff"] == "+25.0%"
    assert rows["CUDA-graph reserve @0.5"]["diff"] == "+25.0%"
    assert rows["KV blocks of 16 @0.5"]["measured"] == "500"
    assert rows["CUDA context and other processes"]["measured"] == "512.00 MiB"
    assert rows["CUDA graphs @0.5 (outside the budget)"]["estimate"] == "-"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a CPU machine")
def test_probe_without_cuda_says_so(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from pagedctl.cli import app

    args = [
        "capacity",
        "--model",
        "tiny-llama",
        "--num-blocks",
        "64",
        "--max-len",
        "64",
        "--probe",
        "--out",
        str(tmp_path),
    ]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 1 and "--probe needs a CUDA device" in r.output
    assert not list(tmp_path.iterdir())


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@gpu
def test_contiguous_probe_counts_and_frees() -> None:
    reservation = 2048 * 12_288
    before = torch.cuda.memory_allocated()
    r = probe.probe_contiguous(reservation, 988_065_536)
    assert r["reservations"] > 0
    assert r["reservations"] * reservation + 988_065_536 <= r["total_bytes"]
    assert r["left_free_bytes"] < reservation + 256 * 2**20  # it stopped: the card was full
    assert torch.cuda.memory_allocated() == before  # everything it took is given back


@pytest.mark.gpu
@gpu
def test_probe_command_on_the_gpu(tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "pagedctl",
        "capacity",
        "--model",
        "qwen2.5-0.5b-instruct",
        "--gpu-mem",
        "0.5,0.85",
        "--max-len",
        "2048",
        "--dist",
        "lognormal:mean=260,median=180",
        "--no-sim",
        "--probe",
        "--out",
        str(tmp_path),
        "--name",
        "probe",
    ]
    env = {**os.environ, "COLUMNS": "160"}
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=900)
    assert p.returncode == 0, p.stderr
    doc = json.loads((tmp_path / "capacity-probe.json").read_text())
    measured = doc["probe"]
    assert measured["contiguous"]["reservations"] > 0
    engine = measured["engine"]
    assert [m["utilization"] for m in engine] == [0.5, 0.85]
    assert engine[1]["num_blocks"] > engine[0]["num_blocks"] > 0
    for m in engine:
        assert m["kv_cache_bytes"] == m["num_blocks"] * 16 * 12_288  # bf16 on an H200
    assert "5. Probe: measured beside estimated" in p.stdout

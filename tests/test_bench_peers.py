"""`pagedctl bench --recipe`: recipes, the nano-bench workload, row checks, the CLI on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedctl.bench import report as bench_report
from pagedctl.bench.peers import SideRun
from pagedctl.bench.recipe import (
    WorkloadSpec,
    load_bench_recipe,
    make_workload,
    parse_peers,
)
from pagedctl.generate.recipe import RecipeError

ROOT = Path(__file__).resolve().parent.parent
RECIPES = ROOT / "recipes"


def _cli(
    *args: str | Path, timeout: float = 300, threads: str | None = None
) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
    if threads is not None:
        env["OMP_NUM_THREADS"] = threads
    cmd = [sys.executable, "-m", "pagedctl", "bench", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "r.yaml"
    path.write_text(text)
    return path


# ------------------------------------------------------------------------- recipes, workload


def test_nano_bench_recipes_draw_the_throughput_workload():
    for name, model, batch in (
        ("nano-bench", "qwen2.5-0.5b-instruct", 256),
        ("nano-bench-qwen3", "qwen3-0.6b", 256),
        ("nano-bench-mistral", "mistral-7b", 64),
        ("nano-bench-gemma2", "gemma-2-2b", 128),
    ):
        r = load_bench_recipe(RECIPES / f"{name}.yaml")
        assert (r.name, r.model, r.load_format, r.device, r.dtype) == (
            name,
            model,
            "dummy",
            "cuda",
            "bfloat16",
        )
        assert r.workload == WorkloadSpec(256, (100, 1024), (100, 1024), (0, 10000), 0, 0.6)
        assert list(r.peers) == ["hf-generate", "hf-static", "hf-continuous"]
        assert r.peers["hf-generate"]["batch_size"] == r.peers["hf-static"]["batch_size"] == batch
        assert r.peers["hf-continuous"]["page_size"] == 256
    cpu = load_bench_recipe(RECIPES / "nano-bench-cpu.yaml")
    assert cpu.model is None and cpu.device == "cpu" and cpu.workload.num_requests == 8


def test_nano_bench_workload_is_deterministic_and_in_range():
    spec = load_bench_recipe(RECIPES / "nano-bench.yaml").workload
    wl = make_workload(spec)
    assert len(wl.prompts) == len(wl.max_tokens) == 256
    assert all(100 <= len(p) <= 1024 for p in wl.prompts)
    assert all(100 <= m <= 1024 for m in wl.max_tokens)
    ids = [t for p in wl.prompts for t in p]
    assert min(ids) >= 0 and max(ids) < 10000
    assert max(ids) > 9900 and min(ids) < 100  # the whole range is used, not a corner of it
    again = make_workload(spec)
    assert again.prompts == wl.prompts and again.max_tokens == wl.max_tokens
    other = make_workload(WorkloadSpec(seed=1))
    assert other.max_tokens != wl.max_tokens
    assert wl.prompt_tokens == sum(map(len, wl.prompts))
    assert wl.output_tokens == sum(wl.max_tokens)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("model: x\nenigne: {}\n", "unknown recipe keys ['enigne']"),
        ("engine: {block_sise: 16}\n", "unknown engine setting 'block_sise'"),
        ("engine: {block_size: sixteen}\n", "block_size must be an integer >= 1, got 'sixteen'"),
        ("dtype: float64\n", "dtype must be one of auto, float32, float16, bfloat16"),
        ("workload: {prompt_len: [10, 5]}\n", "prompt_len must be [low, high]"),
        ("workload: {output_len: [0, 5]}\n", "output_len must be an integer >= 1"),
        ("workload: {token_ids: [7, 7]}\n", "token_ids must be [low, high]"),
        ("workload: {num_requests: 2.5}\n", "num_requests must be an integer"),
        ("workload: {temperature: -1}\n", "temperature must be >= 0"),
        ("peers: {sglang: {}}\n", "unknown peers keys ['sglang']"),
        ("peers: {hf-generate: {page_size: 16}}\n", "unknown peer hf-generate keys"),
        ("peers: [hf-generate]\n", "'peers' must map peer names"),
        ("- 1\n", "must be a mapping"),
        ("model: [unclosed\n", "cannot read recipe"),
    ],
)
def test_bad_recipes_say_what_is_wrong(tmp_path, text, message):
    with pytest.raises(RecipeError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_bench_recipe(_write(tmp_path, text))


def test_parse_peers():
    assert parse_peers("hf-static,hf-generate,hf-static") == ["hf-static", "hf-generate"]
    assert parse_peers("none") == []
    assert parse_peers("vllm,hf-static") == ["vllm", "hf-static"]
    for bad in ("sglang", "", "hf-generate,sglang"):
        with pytest.raises(RecipeError, match="choose from hf-generate, hf-static"):
            parse_peers(bad)


# ---------------------------------------------------------------------- rows, checks, ratios


def _fake(counts_of, wall: float = 2.0):
    def run(recipe, wl, settings):
        counts = counts_of(wl)
        return SideRun({"fake": True}, 0.5, wall, counts, sum(c or 0 for c in counts))

    return run


def test_rows_check_counts_and_ratios(monkeypatch, tmp_path):
    recipe = load_bench_recipe(
        _write(tmp_path, "device: cpu\nworkload: {num_requests: 5, output_len: [3, 9]}\n")
    )
    sides, asked_tokens = bench_report.SIDES, lambda wl: list(wl.max_tokens)
    monkeypatch.setitem(sides, "pagedctl", _fake(asked_tokens, wall=1.0))
    monkeypatch.setitem(sides, "hf-generate", _fake(asked_tokens, wall=4.0))
    monkeypatch.setitem(sides, "hf-static", _fake(lambda wl: [*wl.max_tokens[:-1], 1]))
    monkeypatch.setitem(sides, "hf-continuous", _fake(lambda wl: [*wl.max_tokens[:-2], None, None]))
    doc = bench_report.run_bench(recipe, ["hf-generate", "hf-static", "hf-continuous"], print)
    rows = {r["side"]: r for r in doc["sides"]}
    asked = doc["workload"]["requested_output_tokens"]
    assert rows["pagedctl"]["status"] == "ok" and rows["pagedctl"]["output_tokens"] == asked
    assert rows["pagedctl"]["output_tok_s"] == pytest.approx(asked / 1.0, rel=1e-3)
    assert rows["hf-generate"]["pagedctl_speedup"] == pytest.approx(4.0)
    assert doc["ratios_output_tok_s"]["hf-generate"] == pytest.approx(4.0)
    assert rows["hf-static"]["status"] == "mismatch"
    assert rows["hf-static"]["mismatches"]["count"] == 1
    assert rows["hf-continuous"]["status"] == "partial"
    assert rows["hf-continuous"]["requests_finished"] == 3
    md = bench_report.markdown(doc)
    assert "| hf-generate | ok |" in md and "4.00x" in md and "MISMATCH" in md


def test_a_failing_side_is_a_row_not_a_crash(monkeypatch, tmp_path):
    recipe = load_bench_recipe(_write(tmp_path, "device: cpu\nworkload: {num_requests: 3}\n"))

    def broken(recipe, wl, settings):
        raise RuntimeError("no such API\nsecond line")

    monkeypatch.setitem(bench_report.SIDES, "pagedctl", _fake(lambda wl: list(wl.max_tokens)))
    monkeypatch.setitem(bench_report.SIDES, "hf-continuous", broken)
    doc = bench_report.run_bench(recipe, ["hf-continuous"], print)
    row = doc["sides"][1]
    assert row["status"] == "error" and row["error"] == "RuntimeError: no such API\nsecond line"
    assert "broken" in row["traceback"]
    assert doc["ratios_output_tok_s"] == {}
    assert bench_report.table_rows(doc)[1][:2] == ["hf-continuous", "error"]
    assert "hf-continuous: ERROR RuntimeError: no such API" in bench_report.config_lines(doc)


# ------------------------------------------------------------------------------ the real CLI


def test_no_arguments_print_help_and_subcommands_still_work():
    res = _cli()  # click's convention for a group without arguments: help, exit status 2
    assert res.returncode in (0, 2) and "Usage:" in res.stdout and "Traceback" not in res.stderr
    for word in ("--recipe", "--peer", "scheduler", "transformers", "job-memory"):
        assert word in res.stdout
    sub = _cli("job-memory", "--help")
    assert sub.returncode == 0 and "RSS growth" in sub.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--recipe", "no/such.yaml"), "no recipe 'no/such.yaml'"),
        (("--recipe", RECIPES / "nano-bench-cpu.yaml", "--peer", "sglang"), "unknown peer"),
        (("--recipe", RECIPES / "nano-bench-cpu.yaml", "scheduler"), "give no subcommand"),
        (("--preemption-mode", "bogus"), "give --recipe"),  # a flag alone is never ignored
        (("--block-size", "32"), "give --recipe"),
    ],
)
def test_bad_input_is_one_clear_error(args, message):
    res = _cli(*args)
    assert res.returncode == 64
    assert message in " ".join(res.stderr.split()), res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_cuda_recipe_without_cuda_is_a_clear_error():
    res = _cli("--recipe", RECIPES / "nano-bench.yaml")
    assert res.returncode == 64 and "Traceback" not in res.stderr
    assert "recipes/nano-bench-cpu.yaml" in " ".join(res.stderr.split())


def test_unknown_model_is_a_clear_error(tmp_path):
    res = _cli("--recipe", _write(tmp_path, "model: no-such-model\ndevice: cpu\n"))
    assert res.returncode == 64 and "Traceback" not in res.stderr
    assert "no-such-model" in res.stderr


@pytest.mark.slow
@pytest.mark.skipif(
    torch.cuda.is_available(), reason="the CPU recipe; CUDA machines run nano-bench"
)
def test_cpu_recipe_through_the_cli(tmp_path):
    out = tmp_path / "res.json"
    # One thread per process: four models in a row stay fast even on a busy 2-core machine,
    # where OpenMP threads spinning against other processes can slow each step tenfold.
    recipe_path = RECIPES / "nano-bench-cpu.yaml"
    res = _cli("--recipe", recipe_path, "--output-json", out, "--out", tmp_path, threads="1")
    assert res.returncode == 0, res.stdout + res.stderr
    doc = json.loads(out.read_text())
    recipe = load_bench_recipe(RECIPES / "nano-bench-cpu.yaml")
    asked = make_workload(recipe.workload).output_tokens
    assert doc["workload"]["requested_output_tokens"] == asked
    sides = {r["side"]: r for r in doc["sides"]}
    assert list(sides) == ["pagedctl", "hf-generate", "hf-static", "hf-continuous"]
    for name, row in sides.items():
        assert row["status"] == "ok", (name, row.get("error"))
        assert row["output_tokens"] == row["requested_output_tokens"] == asked, name
        assert row["requests_finished"] == recipe.workload.num_requests
        assert row["output_tok_s"] > 0 and row["wall_s"] > 0 and row["config"]
        assert row["computed_output_tokens"] >= asked
    assert sides["pagedctl"]["config"]["block_size"] == 16
    assert sides["hf-generate"]["config"]["attention"] == "sdpa"
    cb = sides["hf-continuous"]["config"]
    assert cb.get("page_size", cb.get("block_size")) == 32  # renamed in transformers 5.17+
    assert set(doc["ratios_output_tok_s"]) == {"hf-generate", "hf-static", "hf-continuous"}
    assert all(v > 0 for v in doc["ratios_output_tok_s"].values())
    assert doc["environment"]["transformers"] and doc["command"].startswith("pagedctl bench")
    md = (tmp_path / "nano-bench-cpu.md").read_text()
    assert md.count("| ok |") == 4
    assert "hf-continuous" in res.stdout and "pagedctl ÷" in res.stdout

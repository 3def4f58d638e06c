"""Preemption by swap as users see it: the sweep's swap columns over a `preemption_mode` axis, the
`swap` figures of a `generate` summary and its progress line, the host pool of `capacity
--swap-space`, and bad values refused before anything is loaded or written (a tiny random-weight
model on the CPU, pools small enough to preempt)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pagedctl.cli import app
from pagedctl.generate.job import GenerateJob
from pagedctl.generate.recipe import JobSettings
from pagedctl.generate.report import print_summary
from tests.job_utils import read_jsonl, run, write_jsonl
from tests.tiny_models import save_tiny_model

BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # K and V x 2 layers x 2 KV heads x head_dim 16 x fp32
POOL_TOKENS = 256  # 8 sequences of 20 + 100 tokens want 960: every mode preempts


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny") / "llama"
    save_tiny_model("llama", folder)
    return folder


def invoke(*args: str | Path) -> tuple[int, str]:
    r = CliRunner().invoke(app, [*map(str, args)])
    return r.exit_code, r.output + (r.stderr if r.stderr_bytes else "")


def _lines(n: int = 8, max_tokens: int = 100) -> list[dict]:
    return [
        {"custom_id": f"r{i}", "prompt_token_ids": [3 + i] * 20, "max_tokens": max_tokens,
         "ignore_eos": True}
        for i in range(n)
    ]  # fmt: skip


# ---------------------------------------------------------------- sweep


def test_a_sweep_over_preemption_mode_and_block_size_counts_each_swap(model, tmp_path) -> None:
    code, out = invoke(
        "sweep", "--model", model, "--device", "cpu", "--repeats", "1", "--warmup", "off",
        "--num-requests", "8", "--prompt-len", "20", "--output-len", "100",
        "--kv-cache-memory", str(POOL_TOKENS * BYTES_PER_TOKEN), "--swap-space", "0.01",
        "--preemption-mode", "recompute,swap", "--block-size", "16,64", "--out", tmp_path,
    )  # fmt: skip
    assert code == 0, out
    doc = json.loads((tmp_path / "sweep.json").read_text())
    (exp,) = doc["experiments"]
    by = {p["label"]: p for p in exp["points"]}
    assert list(by) == [f"block_size={b} preemption_mode={m}"
                        for b in (16, 64) for m in ("recompute", "swap")]  # fmt: skip
    swap_columns = ["swap_outs", "swapped_blocks", "swap_bytes", "swap_s", "swap_fallbacks"]
    assert [c for c in exp["columns"] if c.startswith("swap")] == swap_columns
    for bs in (16, 64):
        rec = by[f"block_size={bs} preemption_mode=recompute"]
        swap = by[f"block_size={bs} preemption_mode=swap"]
        (r,), (s,) = rec["runs"], swap["runs"]
        assert r["finished"] == s["finished"] == 8
        assert r["output_tokens"] == s["output_tokens"] == 800
        assert r["preemptions"] > 0 and r["recomputed_tokens"] > 0
        assert all(r[k] == 0 for k in (*swap_columns, "swap_ins")), r
        assert rec["memory"]["num_host_blocks"] == 0
        host = swap["memory"]["num_host_blocks"]
        assert host == int(0.01 * 2**30) // (bs * BYTES_PER_TOKEN)
        assert swap["memory"]["swap_space_bytes"] == host * bs * BYTES_PER_TOKEN
        # Every preemption went to the host and came back; nothing was computed twice.
        assert s["swap_outs"] == s["preemptions"] == s["swap_ins"] > 0
        assert s["swap_fallbacks"] == 0 and s["recomputed_tokens"] == 0
        assert s["swapped_blocks"] >= 2 * s["swap_outs"]
        assert s["swap_bytes"] == s["swapped_blocks"] * bs * BYTES_PER_TOKEN
        assert s["swap_s"] > 0
    md = (tmp_path / "sweep.md").read_text()
    assert "| block_size=64 preemption_mode=swap |" in md
    for header in ("host blocks", "swap outs", "swapped blocks", "swap MiB", "swap fallbacks"):
        assert header in md and header in out
    assert "preemptions (" in out and "by swap)" in out  # the per-point progress line
    csv_header = (tmp_path / "sweep.csv").read_text().splitlines()[0].split(",")
    assert {"preemption_mode", "host_blocks", "swap_outs_median", "swap_s_median"} <= set(
        csv_header
    )


def test_a_recipe_may_ask_for_the_swap_columns_and_defaults_stay_as_they_were(tmp_path) -> None:
    from pagedctl import sweep as sw
    from pagedctl.sweep.metrics import DEFAULT_COLUMNS, SWAP_COLUMNS, fmt

    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "experiments:\n"
        "  - name: asked\n"
        "    columns: [preemptions, swap_ins, swap_bytes]\n"
        "    axes: {preemption_mode: [recompute, auto]}\n"
        "  - name: plain\n"
    )
    asked, plain = sw.load_sweep_recipe(recipe).experiments
    assert asked.columns == ("preemptions", "swap_ins", "swap_bytes")
    assert plain.columns == DEFAULT_COLUMNS and not set(SWAP_COLUMNS) & set(DEFAULT_COLUMNS)
    grid = sw.grid_recipe([("engine", "preemption_mode", ["recompute", "auto"])], {}, {}, {})
    assert set(SWAP_COLUMNS) <= set(grid.experiments[0].columns)
    assert fmt("swap_bytes", 3 * 2**20) == "3.0"  # shown in MiB, written in bytes


# ---------------------------------------------------------------- generate


def test_a_job_with_swap_reports_its_swaps_in_the_summary_and_progress(model, tmp_path) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", _lines())
    summary_path = tmp_path / "summary.json"
    res = run(src, "--model", model, "--device", "cpu", "--block-size", "16",
              "--num-blocks", str(POOL_TOKENS // 16), "--preemption-mode", "swap",
              "--swap-space", "0.01", "--temperature", "0",
              "--summary-json", summary_path)  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert len(read_jsonl(tmp_path / "in.out.jsonl")) == 8
    summary = json.loads(summary_path.read_text())
    swap = summary["swap"]
    block_bytes = 16 * BYTES_PER_TOKEN
    assert swap["preemption_mode"] == "swap"
    assert swap["host_blocks"] == int(0.01 * 2**30) // block_bytes
    assert swap["host_bytes"] == swap["host_blocks"] * block_bytes
    assert swap["swap_outs"] == swap["swap_ins"] == summary["preemptions"] > 0
    assert swap["blocks_out"] == swap["blocks_in"] > 0
    assert swap["bytes_moved"] == (swap["blocks_out"] + swap["blocks_in"]) * block_bytes
    assert swap["transfer_s"] >= 0 and swap["fallbacks_to_recompute"] == 0
    assert summary["recomputed_tokens"] == 0 and "costs" not in swap
    assert "swap (swap): out / in," in res.stdout  # the table's row (80 columns: it folds)
    progress = [line for line in res.stderr.splitlines() if line.startswith("info: progress")]
    assert progress and all(" waiting=" in line and " swapped=" in line for line in progress)


def _job(src: Path, **engine) -> GenerateJob:
    settings = JobSettings(
        input=src,
        engine={"model": "tiny-llama", "device": "cpu", "block_size": 16,
                "num_blocks": POOL_TOKENS // 16, **engine},
        sampling={"max_tokens": 100, "temperature": 0.0},
    )  # fmt: skip
    return GenerateJob(settings, force=False, quiet=True, log_format="text")


def test_a_host_pool_too_small_falls_back_and_recompute_adds_nothing(tmp_path, capsys) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", _lines())
    four_blocks = 4 * 16 * BYTES_PER_TOKEN / 2**30  # GiB: room for one or two victims
    summary = _job(src, preemption_mode="swap", swap_space=four_blocks).run().summary
    swap = summary["swap"]
    assert summary["ok"] == 8 and swap["host_blocks"] == 4
    assert swap["swap_outs"] > 0 and swap["fallbacks_to_recompute"] > 0
    # A preemption the host could not take, or a unit dropped from it, is recomputed instead.
    assert swap["fallbacks_to_recompute"] == summary["preemptions"] - swap["swap_ins"]
    assert summary["recomputed_tokens"] > 0  # the fallbacks were computed again
    print_summary(summary, quiet=False, log_format="text")
    assert "swap (swap)" in capsys.readouterr().out

    plain = write_jsonl(tmp_path / "plain.jsonl", _lines())
    summary = _job(plain).run().summary
    assert summary["preemptions"] > 0 and "swap" not in summary
    print_summary(summary, quiet=False, log_format="text")
    assert "swap" not in capsys.readouterr().out


# ---------------------------------------------------------------- capacity


def test_capacity_counts_the_host_pool_apart_from_the_running_capacity(tmp_path) -> None:
    base = ["capacity", "--model", "qwen2.5-0.5b-instruct", "--gpu", "t4", "--max-len", "2048",
            "--dist", "fixed:300", "--block-size", "16,32", "--no-sim",
            "--out", tmp_path]  # fmt: skip
    code, out = invoke(*base, "--name", "plain")
    assert code == 0, out
    code, out = invoke(*base, "--swap-space", "4", "--name", "swap")
    assert code == 0, out
    plain, swap = (json.loads((tmp_path / f"capacity-{n}.json").read_text())
                   for n in ("plain", "swap"))  # fmt: skip
    for key in ("pool", "lengths", "blocks"):  # the running figures do not move
        assert swap["sections"][key] == plain["sections"][key]
    assert "swap" not in plain["sections"]
    rows = swap["sections"]["swap"]
    per_token = plain["sections"]["pool"][0]["bytes_per_token"]  # 12,288 (fp16 on a T4)
    for row, bs in zip(rows, (16, 32), strict=True):
        blocks = 4 * 2**30 // (bs * per_token)
        assert (row["block_size"], row["host_blocks"]) == (bs, blocks)
        assert row["host_tokens"] == blocks * bs
        assert row["mean_blocks"] == -(-300 // bs)  # every sequence 300 tokens
        assert row["preempted_at_mean"] == blocks // -(-300 // bs)
        assert row["preempted_at_max_len"] == blocks // (2048 // bs)
        assert swap["figures"][f"host_blocks@{bs}"] == blocks
    assert rows[0]["host_blocks"] == 21_845  # 4 GiB / 192 KiB
    assert "Host pool for preempted sequences (--swap-space)" in out
    assert "never running ones, so the running capacity above is unchanged" in out
    assert (tmp_path / "capacity-swap-swap.csv").exists()
    code, out = invoke(*base, "--swap-space", "-1")
    assert code != 0 and "--swap-space" in out
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: tiny-llama\ngpu: t4\nswap_space: lots\n")
    code, out = invoke("capacity", "--recipe", recipe, "--out", tmp_path / "none")
    assert code == 64 and "expected a number of GiB" in out and not (tmp_path / "none").exists()


# ---------------------------------------------------------------- bad values


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--preemption-mode", "bogus"], "preemption_mode must be one of recompute, swap, auto"),
        (["--swap-space", "-1"], "swap_space must be a number >= 0"),
    ],
)
def test_bad_swap_flags_are_refused_before_anything_is_loaded_or_written(
    tmp_path, flags, message
) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", _lines(1))
    code, out = invoke("generate", src, "--model", "no-such-model-is-ever-loaded", *flags)
    assert code == 64 and message in out and "Traceback" not in out
    assert [p.name for p in tmp_path.iterdir()] == ["in.jsonl"]
    sweep_flags = [flags[0], "recompute," + flags[1] if "mode" in flags[0] else flags[1]]
    code, out = invoke("sweep", "--model", "no-such-model", *sweep_flags, "--out", tmp_path / "s")
    assert code == 64 and message in " ".join(out.replace("│", " ").split())
    assert not (tmp_path / "s").exists()
    code, out = invoke("bench", "--recipe", "nano-bench-cpu", "--model", "no-such-model", *flags,
                       "--out", tmp_path / "b")  # fmt: skip
    assert code == 64 and message in " ".join(out.replace("│", " ").split())
    assert not (tmp_path / "b").exists()

"""`pagedctl sweep`: the CPU grid through the real CLI, failing points, bad input, the recipe
format, and the GPU recipes run at reduced scale on a tiny random-weight model."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pagedctl import sweep as sw
from pagedctl.bench.recipe import WorkloadSpec, make_workload
from pagedctl.generate.recipe import RecipeError

ROOT = Path(__file__).resolve().parent.parent
RECIPES = ROOT / "recipes"
TINY = ["--model", "tiny-llama", "--device", "cpu", "--repeats", "1"]


def sweep_cli(*args: str | Path, prelude: str = "") -> subprocess.CompletedProcess:
    """`pagedctl sweep ARGS` in a subprocess from the repository root."""
    code = f"{prelude}import sys; from pagedctl.cli import main; sys.argv[0] = 'pagedctl'; main()"
    cmd = [sys.executable, "-c", code, "sweep", *map(str, args)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)


def flat(text: str) -> str:
    """An error message as one line, without the frame Typer draws around it."""
    return " ".join(text.replace("│", " ").split())


@pytest.mark.slow
def test_cpu_grid_on_the_bundled_model_through_the_cli(tmp_path):
    res = sweep_cli("--recipe", "recipes/sweep-cpu.yaml", "--repeats", "1", "--out", tmp_path)
    assert res.returncode == 0, res.stderr
    assert "block size x pool size" in res.stdout and "Traceback" not in res.stderr
    doc = json.loads((tmp_path / "sweep-cpu.json").read_text())
    assert doc["command"] == "pagedctl sweep --recipe recipes/sweep-cpu.yaml --repeats 1 --out " + (
        str(tmp_path)
    )
    assert doc["environment"]["model"] == "SmolLM2-135M-Instruct"
    points = doc["experiments"][0]["points"]
    assert [p["label"] for p in points] == [
        f"block_size={b} num_blocks={n}" for b in (8, 16) for n in (8, 32)
    ]
    recipe = yaml.safe_load((RECIPES / "sweep-cpu.yaml").read_text())["workload"]
    wl = make_workload(
        WorkloadSpec(
            num_requests=recipe["num_requests"],
            prompt_len=tuple(recipe["prompt_len"]),
            output_len=tuple(recipe["output_len"]),
            seed=recipe["seed"],
        )
    )
    for p in points:
        (run,) = p["runs"]
        bs, blocks = p["engine"]["block_size"], p["engine"]["num_gpu_blocks_override"]
        assert p["status"] == "ok" and p["memory"]["num_blocks"] == blocks
        assert run["finished"] == len(wl.prompts) and run["failed"] == 0
        assert run["prompt_tokens"] == wl.prompt_tokens
        assert run["output_tokens"] == wl.output_tokens  # EOS ignored: exactly what was asked
        starved = blocks == 8
        assert (run["preemptions"] > 0) == starved, p["label"]
        assert (run["recomputed_tokens"] > 0) == starved, p["label"]
        # Every token with KV is computed once, plus what preemption made computed again.
        computed = run["prefill_tokens"] + run["decode_tokens"]
        assert (
            computed
            == wl.prompt_tokens + wl.output_tokens - len(wl.prompts) + (run["recomputed_tokens"])
        )
        tails = [-(len(ids) + n - 1) % bs for ids, n in zip(wl.prompts, wl.max_tokens, strict=True)]
        assert run["tail_waste"] == pytest.approx(sum(tails) / len(tails))
        assert 0 < run["mean_kv_usage"] <= run["peak_kv_usage"] <= 1
        assert run["peak_kv_usage"] == 1.0 if starved else run["peak_kv_usage"] < 1.0
        assert 0 < run["waste_share"] < 1
    rows = list(csv.DictReader((tmp_path / "sweep-cpu.csv").open()))
    assert [r["point"] for r in rows] == [p["label"] for p in points]
    assert float(rows[0]["output_tok_s_median"]) == pytest.approx(
        points[0]["summary"]["output_tok_s"]["median"]
    )
    md = (tmp_path / "sweep-cpu.md").read_text()
    assert "Regenerate: `pagedctl sweep --recipe recipes/sweep-cpu.yaml" in md
    assert md.count("| block_size=") == 4


def test_a_failing_point_is_a_row_and_every_failure_exits_1(tmp_path):
    args = [*TINY, "--num-requests", "3", "--prompt-len", "40", "--output-len", "4"]
    args += ["--max-model-len", "64"]
    res = sweep_cli(*args, "--num-blocks", "2,16", "--warmup", "off", "--out", tmp_path)
    assert res.returncode == 0, res.stderr
    points = json.loads((tmp_path / "sweep.json").read_text())["experiments"][0]["points"]
    failed, ok = points
    assert failed["status"] == "failed" and failed["label"] == "num_blocks=2"
    assert "needs 3 KV blocks" in failed["error"] and "the whole pool has 2" in failed["error"]
    assert ok["status"] == "ok" and ok["runs"][0]["finished"] == 3
    assert "failed: RuntimeError: no request finished" in (tmp_path / "sweep.md").read_text()
    res = sweep_cli(*args, "--num-blocks", "2", "--out", tmp_path, "--overwrite")
    assert res.returncode == 1 and "Traceback" not in res.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--block-size", "16,x"], "block_size must be an integer"),
        (["--gpu-mem", "0.5,1.5"], "gpu_memory_utilization must be a number in (0, 1]"),
        (["--axis", "colour=1,2"], "unknown axis 'colour'"),
        (["--recipe", "recipes/sweep-cpu.yaml", "--experiment", "nope"], "no experiment"),
        (["--model", "no-such-model", "--device", "cpu"], "cannot start the engine"),
    ],
)
def test_bad_input_is_one_line_not_a_traceback(args, message):
    res = sweep_cli(*args, "--out", "/nonexistent-never-written")
    assert res.returncode == 64 and "Traceback" not in res.stderr
    assert message in flat(res.stderr), res.stderr


def test_plot_without_matplotlib_says_how_to_install():
    res = sweep_cli("--plot", prelude="import sys; sys.modules['matplotlib'] = None; ")
    assert res.returncode == 64 and "pip install 'pagedctl[plot]'" in flat(res.stderr)


def write(tmp_path: Path, doc: dict) -> Path:
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_recipe_points_grid_inheritance_and_typos(tmp_path):
    doc = {
        "engine": {"block_size": 16, "max_num_seqs": 4},
        "workload": {"kind": "random", "num_requests": 2, "prompt_len": [4, 8]},
        "experiments": [
            {
                "name": "e",
                "engine": {"prefix_caching": "off"},
                "axes": {"gpu_mem": [0.5, 0.9], "output_len": [3]},
                "points": [
                    {"label": "a", "reference": {"wall_s": 1.5}},
                    {
                        "label": "b",
                        "engine": {"block_size": 32},
                        "workload": {"kind": "shared_prefix", "prefix_len": 9, "output_len": 2},
                    },
                ],
                "compare": [
                    {
                        "label": "c",
                        "metric": "wall_s",
                        "num": "b gpu_mem=0.5 output_len=3",
                        "den": "a gpu_mem=0.5 output_len=3",
                    }
                ],
            }
        ],
    }
    recipe = sw.load_sweep_recipe(write(tmp_path, doc))
    points = recipe.experiments[0].points
    assert [p.label for p in points] == [
        f"{x} gpu_mem={g} output_len=3" for x in "ab" for g in (0.5, 0.9)
    ]
    a, b = points[0], points[2]
    assert a.engine == {"block_size": 16, "max_num_seqs": 4, "enable_prefix_caching": False,
                        "gpu_memory_utilization": 0.5}  # fmt: skip
    assert b.engine["block_size"] == 32 and a.reference == {"wall_s": 1.5} and b.reference == {}
    assert a.workload == {"kind": "random", "num_requests": 2, "prompt_len": [4, 8],
                          "output_len": 3}  # fmt: skip
    # A point of another kind does not inherit the random workload's keys.
    assert b.workload == {"kind": "shared_prefix", "prefix_len": 9, "output_len": 3}
    for path, value, message in [
        (("experiments", 0, "points", 0, "engine"), {"blok_size": 8}, "unknown keys ['blok_size']"),
        (("experiments", 0, "compare", 0, "num"), "zz", "'zz' is not a point label"),
        (("experiments", 0, "columns"), ["speed"], "unknown metric 'speed'"),
        (("experiments", 0, "mode"), "parallel", "mode must be one of batch, sequential"),
        (("workload", "kind"), "poisson", "kind must be one of"),
    ]:
        bad = json.loads(json.dumps(doc))
        target = bad
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
        with pytest.raises(RecipeError, match=message.replace("[", r"\[").replace("]", r"\]")):
            sw.load_sweep_recipe(write(tmp_path, bad))


def test_seed_recipes_load_and_scale_keeps_the_oversubscription():
    for name in ("oversubscribed", "shared-prefix", "block-size", "sweep-cpu"):
        recipe = sw.load_sweep_recipe(RECIPES / f"{name}.yaml")
        assert all(e.points for e in recipe.experiments)
    recipe = sw.load_sweep_recipe(RECIPES / "oversubscribed.yaml")

    def oversubscription(points: list[sw.Point]) -> float:
        starved = next(p for p in points if p.label == "starved")
        w = starved.workload
        demand = w["num_requests"] * (w["prompt_len"] + w["output_len"])
        return demand / (starved.engine["num_gpu_blocks_override"] * starved.engine["block_size"])

    before = oversubscription(recipe.experiments[0].points)
    assert before == pytest.approx(200 * 1009 / 77312)
    sw.scale_recipe(recipe, 0.05)
    starved = recipe.experiments[0].points[0]
    assert starved.engine["num_gpu_blocks_override"] == 242 and starved.workload["output_len"] == 50
    assert starved.workload["num_requests"] == 200
    assert oversubscription(recipe.experiments[0].points) == pytest.approx(before, rel=0.05)


@pytest.fixture(scope="module")
def tiny_llm():
    return sw.load_engine(sw.SweepRecipe("t", [], load={"model": "tiny-llama", "device": "cpu"}))


def run_scaled(llm, name: str, scale: float, only: str | None = None) -> sw.SweepResult:
    recipe = sw.load_sweep_recipe(RECIPES / f"{name}.yaml")
    recipe.repeats, recipe.warmup = 1, "off"
    if only:
        recipe.experiments = [e for e in recipe.experiments if e.name == only]
    sw.scale_recipe(recipe, scale)
    return sw.run_sweep(recipe, llm)


def test_oversubscribed_scaled_preempts_finishes_all_and_counts_resumed_lookups(tiny_llm):
    (exp,) = run_scaled(tiny_llm, "oversubscribed", 0.02).experiments
    by = exp.by_label()
    starved, free, cached = (by[k].runs[0] for k in
                             ("starved", "unconstrained", "starved, prefix cache on"))  # fmt: skip
    assert starved["finished"] == free["finished"] == cached["finished"] == 200
    assert starved["preemptions"] > 0 and free["preemptions"] == 0
    assert starved["recomputed_tokens"] > 0 and free["recomputed_tokens"] == 0
    # Each preempted sequence asks, on coming back, for every token it holds: more than it lost.
    assert starved["resumed_queried_tokens"] >= starved["recomputed_tokens"]
    assert 0 <= cached["resumed_hit_tokens"] <= cached["resumed_queried_tokens"]
    assert cached["resumed_queried_tokens"] > 0
    assert starved["resumed_hit_tokens"] == 0  # prefix cache off
    rows = {c["label"].split(" (")[0]: c for c in exp.comparisons()}
    assert rows["every request finished on the starved pool"]["holds"] is True
    kept = rows["throughput kept on the starved pool"]
    assert kept["value"] == pytest.approx(starved["output_tok_s"] / free["output_tok_s"])
    assert kept["reference"] == pytest.approx(0.761)


def test_shared_prefix_scaled_fork_computes_the_prompt_once_and_warm_prefixes_hit(tiny_llm):
    result = run_scaled(tiny_llm, "shared-prefix", 0.1)
    shared, warm_cold, sampling = (e.by_label() for e in result.experiments)
    n8, separate = sampling["n=8, 16 tokens"].runs[0], sampling["8 separate, 16 tokens"].runs[0]
    assert separate["prefill_tokens"] == 8 * n8["prefill_tokens"] == 8 * 145
    assert n8["output_tokens"] == separate["output_tokens"] == 8 * 2
    on, off = shared["on, primed, 1 token"].runs[0], shared["off, 1 token"].runs[0]
    assert on["prefill_tokens"] == 16 * (241 - 240) and off["prefill_tokens"] == 16 * 241
    assert on["prefix_hit_rate"] == pytest.approx(240 / 241)
    longest = warm_cold["4096"].runs[0]  # 410 tokens: the second request finds 25 blocks
    assert longest["prefill_tokens"] == 410 + (410 - 25 * 16)
    assert set(longest) >= {"first_ms", "later_ms"}


def test_input_file_workload_and_plots(tmp_path):
    pytest.importorskip("matplotlib")
    lines = [
        {"custom_id": "a", "prompt_token_ids": list(range(1, 20)), "max_tokens": 5},
        {
            "custom_id": "b",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"prompt": [7, 8, 9, 10], "max_tokens": 3, "n": 2},
        },
        "{not json",
    ]
    src = tmp_path / "in.jsonl"
    src.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    res = sweep_cli(*TINY, "--input", src, "--ignore-eos", "--block-size", "8,16", "--plot",
                    "--name", "grid", "--out", tmp_path)  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "line 3 left out" in res.stderr
    points = json.loads((tmp_path / "grid.json").read_text())["experiments"][0]["points"]
    for p in points:
        (run,) = p["runs"]
        assert run["requests"] == run["finished"] == 2
        assert run["output_tokens"] == 5 + 2 * 3 and run["prompt_tokens"] == 19 + 4
    assert (tmp_path / "grid-grid.png").stat().st_size > 1000


def test_max_tokens_has_a_job_lines_range_and_paths_are_the_current_directorys(tmp_path):
    """A sweep's max_tokens and output_len take the range a job's line does (4.0 is 4, 0 and
    4.5 refused), and a recipe's relative input is the current directory's, as in every recipe."""
    from pagedctl.sweep.settings import check_value, check_workload

    assert check_value("w", "max_tokens", 4.0) == 4
    for key, value, message in [
        ("max_tokens", 0, "max_tokens must be an integer >= 1"),
        ("max_tokens", 4.5, "fractional part"),
        ("output_len", [0, 8], "output_len must be an integer >= 1"),
    ]:
        with pytest.raises(RecipeError, match=message):
            check_value("w", key, value)
    assert check_workload("w", {"kind": "file", "input": "jobs/a.jsonl"})["input"] == (
        "jobs/a.jsonl"
    )

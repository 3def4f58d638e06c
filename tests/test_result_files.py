"""Where `sweep`, `bench` and `capacity` write: a new run folder by default, `--out DIR` never over
an existing file unless `--overwrite`; and their stdout into a pipe: never squeezed, `--format`."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest

from pagedctl.outputs import run_folder

ROOT = Path(__file__).resolve().parents[1]
RUN_NAME = re.compile(r"^(?P<name>.+)-\d{8}-\d{6}(-\d+)?$")

# Tiny and quick: a random-weight 2-layer model, 4 points of 3 requests, one timed run each.
SWEEP = ["sweep", "--model", "tiny-llama", "--device", "cpu", "--repeats", "1", "--warmup", "off",
         "--num-requests", "3", "--prompt-len", "8", "--output-len", "4",
         "--block-size", "8,16", "--max-num-seqs", "2,4"]  # fmt: skip
BENCH_RECIPE = """
name: tiny-bench
model: tiny-llama
device: cpu
dtype: float32
engine: {block_size: 16, max_num_seqs: 4, kv_cache_memory: 8MiB}
workload: {num_requests: 3, prompt_len: [8, 16], output_len: [4, 8], token_ids: [0, 500]}
"""
CAPACITY = ["capacity", "--model", "tiny-llama", "--gpu", "t4", "--requests", "1000",
            "--dist", "lognormal:mean=260,median=180", "--name", "tiny"]  # fmt: skip


def pagedctl(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess:
    """`pagedctl ARGS` in a subprocess in `cwd`, its stdout and stderr pipes (not terminals)."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    env |= {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "pagedctl", *map(str, args)]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def runs(cwd: Path) -> list[Path]:
    return sorted((cwd / "runs").iterdir()) if (cwd / "runs").is_dir() else []


# ------------------------------------------------------------------ where the files go


def test_run_folders_are_named_by_run_and_start_time_and_never_shared(tmp_path):
    started = datetime(2026, 12, 6, 3, 15, 0)
    made = [run_folder("sweep-cpu", started, tmp_path / "runs") for _ in range(3)]
    assert [p.name for p in made] == [
        "sweep-cpu-20261206-031500",
        "sweep-cpu-20261206-031500-2",
        "sweep-cpu-20261206-031500-3",
    ]
    assert all(p.is_dir() and not list(p.iterdir()) for p in made)
    assert run_folder("a b/../c", started, tmp_path / "runs").name == "a-b-..-c-20261206-031500"


def test_sweep_writes_a_new_run_folder_by_default_and_keeps_files_in_out(tmp_path):
    res = pagedctl(*SWEEP, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    (folder,) = runs(tmp_path)
    assert RUN_NAME.match(folder.name)["name"] == "sweep"
    assert {p.name for p in folder.iterdir()} == {"sweep.json", "sweep.csv", "sweep.md"}
    assert f"wrote {Path('runs') / folder.name / 'sweep.md'}" in res.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]

    out = tmp_path / "results"
    out.mkdir()
    (out / "sweep.md").write_text("tracked figures\n")
    # refused before the model is looked up: a model that does not exist is never reached
    res = pagedctl(*SWEEP, "--model", "no-such-model", "--out", out, cwd=tmp_path)
    assert res.returncode == 64, res.stderr
    message = " ".join(res.stderr.split())
    assert f"{out / 'sweep.md'} exists" in message and "pass --overwrite" in message
    assert "another --out" in message and "cannot start the engine" not in message
    assert (out / "sweep.md").read_text() == "tracked figures\n"
    assert sorted(p.name for p in out.iterdir()) == ["sweep.md"]
    res = pagedctl(*SWEEP, "--out", out, "--overwrite", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert (out / "sweep.md").read_text().startswith("# sweep")
    assert "--overwrite" in json.loads((out / "sweep.json").read_text())["command"]
    assert len(runs(tmp_path)) == 1  # --out given: no run folder


def test_bench_refuses_to_replace_its_files_unless_overwrite(tmp_path):
    recipe = tmp_path / "tiny-bench.yaml"
    recipe.write_text(BENCH_RECIPE)
    res = pagedctl("bench", "--recipe", recipe, "--peer", "none", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    (folder,) = runs(tmp_path)
    assert RUN_NAME.match(folder.name)["name"] == "tiny-bench"
    assert {p.name for p in folder.iterdir()} == {"tiny-bench.json", "tiny-bench.md"}

    res = pagedctl("bench", "--recipe", recipe, "--peer", "none", "--out", folder, cwd=tmp_path)
    assert res.returncode == 64 and f"{folder / 'tiny-bench.md'} exists" in res.stderr
    assert "(and 1 more of this run's files)" in res.stderr
    taken = tmp_path / "mine.json"
    taken.write_text("{}")
    res = pagedctl("bench", "--recipe", recipe, "--output-json", taken, cwd=tmp_path)
    assert res.returncode == 64 and f"{taken} exists" in res.stderr
    assert "another --output-json" in res.stderr and taken.read_text() == "{}"
    assert len(runs(tmp_path)) == 1
    res = pagedctl("bench", "--recipe", recipe, "--peer", "none", "--output-json", taken,
                   "--overwrite", cwd=tmp_path)  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert json.loads(taken.read_text())["sides"][0]["side"] == "pagedctl"


def test_capacity_writes_a_run_folder_and_refuses_over_its_files(tmp_path):
    res = pagedctl(*CAPACITY, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    (folder,) = runs(tmp_path)
    assert RUN_NAME.match(folder.name)["name"] == "capacity-tiny"
    written = {p.name for p in folder.iterdir()}
    assert written == {"capacity-tiny.md", "capacity-tiny.json"} | {
        f"capacity-tiny-{k}.csv" for k in ("pool", "lengths", "blocks", "sim")
    }
    assert "--out" not in json.loads((folder / "capacity-tiny.json").read_text())["command"]
    sim = folder / "capacity-tiny-sim.csv"
    sim.write_text("kept\n")
    res = pagedctl(*CAPACITY, "--out", folder, cwd=tmp_path)
    assert res.returncode == 64 and "capacity-tiny.md exists (and 5 more" in res.stderr
    assert sim.read_text() == "kept\n"
    for name in written - {"capacity-tiny-sim.csv"}:
        (folder / name).unlink()
    res = pagedctl(*CAPACITY, "--out", folder, "--no-sim", cwd=tmp_path)  # writes no sim.csv
    assert res.returncode == 0, res.stderr
    assert sim.read_text() == "kept\n"
    res = pagedctl(*CAPACITY, "--out", folder, cwd=tmp_path)
    assert res.returncode == 64 and "capacity-tiny.md exists" in res.stderr
    res = pagedctl(*CAPACITY, "--out", folder, "--overwrite", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert sim.read_text().startswith("allocator,load,")


def test_results_readme_regenerates_in_place_with_overwrite():
    """Every command of results/README.md that writes its files to results/ says --overwrite."""
    text = (ROOT / "results" / "README.md").read_text()
    commands = re.findall(r"`(pagedctl (?:sweep|capacity|bench) --[^`]*)`", text)
    assert len(commands) >= 8, commands
    for command in commands:
        into = "--out results --overwrite" in command
        one_file = "--output-json results/" in command and command.endswith("--overwrite")
        assert into or one_file, command


# ------------------------------------------------------------------ stdout into a pipe


def test_sweep_into_a_pipe_prints_whole_rows_and_lines(tmp_path):
    res = pagedctl(*SWEEP, "--out", tmp_path, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    point = [ln for ln in lines if ln.startswith("[grid] block_size=16 max_num_seqs=4: ")]
    assert len(point) == 1 and point[0].endswith("blocks of 16"), res.stdout  # not wrapped
    header = next(ln for ln in lines if ln.startswith("┃ point"))
    row = next(ln for ln in lines if ln.startswith("│ block_size=16 max_num_seqs=4"))
    assert len(row) > 120 and "…" not in res.stdout, res.stdout
    assert row.count("│") == header.count("┃") > 15, (header, row)  # one line per row


def test_sweep_format_tsv_and_json(tmp_path):
    res = pagedctl(*SWEEP, "--out", tmp_path / "t", "--format", "tsv", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    title, header, *rows = res.stdout.strip("\n").split("\n")
    assert title == "# block_size x max_num_seqs (one run)", res.stdout
    columns = header.split("\t")
    assert columns[:3] == ["point", "blocks", "pool tok"] and "out tok/s" in columns
    assert len(rows) == 4 and all(len(r.split("\t")) == len(columns) for r in rows), rows
    assert rows[0].startswith("block_size=8 max_num_seqs=2\t")
    assert "[grid] block_size=8" in res.stderr and "wrote " in res.stderr  # progress apart
    res = pagedctl(*SWEEP, "--out", tmp_path / "j", "--format", "json", "-q", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc == json.loads((tmp_path / "j" / "sweep.json").read_text())
    assert [p["label"] for p in doc["experiments"][0]["points"]][
        -1
    ] == "block_size=16 max_num_seqs=4"


def test_bench_into_a_pipe_prints_whole_rows_and_reads_as_tsv(tmp_path):
    recipe = tmp_path / "tiny-bench.yaml"
    recipe.write_text(BENCH_RECIPE)
    res = pagedctl("bench", "--recipe", recipe, "--peer", "none", "--out", tmp_path / "a",
                   cwd=tmp_path)  # fmt: skip
    assert res.returncode == 0, res.stderr
    row = next(ln for ln in res.stdout.splitlines() if ln.lstrip().startswith("pagedctl   ok"))
    assert re.search(r"pagedctl +ok +[\d.]+ +[\d.,]+ +[\d.,]+ +[\d.,]+ +[\d.]+ MiB +0 +-", row), row
    assert "…" not in res.stdout and "tiny-bench: 3 requests" in res.stdout
    config = next(ln for ln in res.stdout.splitlines() if ln.startswith("pagedctl: model"))
    assert config.endswith("(not timed)") and len(config) > 200  # one line, not wrapped
    res = pagedctl("bench", "--recipe", recipe, "--peer", "none", "--out", tmp_path / "b",
                   "--format", "tsv", cwd=tmp_path)  # fmt: skip
    assert res.returncode == 0, res.stderr
    title, header, row = res.stdout.strip("\n").split("\n")
    assert title.startswith("# pagedctl bench: tiny-bench: 3 requests")
    assert header.split("\t")[:3] == ["side", "status", "wall s"]
    assert row.split("\t")[:2] == ["pagedctl", "ok"] and len(row.split("\t")) == 9
    assert "pagedctl: model" in res.stderr


def test_capacity_into_a_pipe_and_as_json(tmp_path):
    label = "paged sequences at 2,048 tokens, " * 5  # a figure's label wider than most screens
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"compare:\n  - {{figure: paged@2048, reference: 1, label: '{label}'}}\n")
    res = pagedctl(*CAPACITY, "--recipe", recipe, "--swap-space", "4", "--out", tmp_path / "a",
                   cwd=tmp_path)  # fmt: skip
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    (compared,) = [ln for ln in lines if label.strip() in ln]
    assert re.search(r"│ +1 │ +[\d,]+ │ .+ │ \w+ │$", compared), compared
    header = next(ln for ln in lines if re.match(r"┃ load ┃ +allocator ┃", ln))
    assert "external @refusal" in header and "…" not in res.stdout, res.stdout
    rows = [ln for ln in lines if re.match(r"│ [\d.]+ +│ +paged │", ln)]
    assert rows and all(r.count("│") == header.count("┃") for r in rows)
    host = next(ln for ln in lines if ln.startswith("┃ block ┃ host pool"))
    assert "preempted seqs @max-len" in host
    res = pagedctl(*CAPACITY, "--out", tmp_path / "b", "--format", "json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["sections"]["pool"][0]["num_blocks"] > 0 and doc["command"].endswith("json")
    assert "wrote " in res.stderr


@pytest.mark.parametrize("command", ["sweep", "bench", "capacity"])
def test_help_names_the_run_folder_and_the_formats(command):
    res = subprocess.run([sys.executable, "-m", "pagedctl", command, "--help"],
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, "COLUMNS": "300"})  # fmt: skip
    text = re.sub(r"(?<=-) ", "", " ".join(res.stdout.split()))  # words cut at a hyphen
    assert "runs/NAME-YYYYMMDD-HHMMSS" in text and "--overwrite" in text, text
    assert "--format [table|tsv|json]" in text

"""Every command follows the one exit-code table of docs/jobs.md (`pagedctl.exits`): a flag that
does not parse, a value that cannot be used and a recipe that is not there are usage errors (64)
in `generate`, `sweep`, `capacity` and `bench` alike, with one message and no traceback."""

from __future__ import annotations

import json
import os
import re
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pagedctl.exits import EXIT_CODES, EXIT_USAGE
from pagedctl.generate.runctl import JobLock
from tests.job_utils import handles

ROOT = Path(__file__).resolve().parents[1]


def pagedctl(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pagedctl", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=cwd)


@pytest.mark.parametrize(
    "args",
    [
        ["generate", "in.jsonl", "--bogus"],
        ["generate", "in.jsonl", "--block-size", "sixteen"],
        ["generate", "in.jsonl", "--gpu-memory-utilization", "2"],
        ["generate", "in.jsonl", "--recipe", "no-such-recipe"],
        ["generate"],
        ["sweep", "--bogus"],
        ["sweep", "--block-size", "16,x"],
        ["sweep", "--recipe", "no-such-recipe"],
        ["capacity", "--bogus"],
        ["capacity", "--gpu", "t4"],
        ["capacity", "--model", "tiny-llama", "--gpu", "t4", "--gpu-memory-utilization", "1.5"],
        ["bench", "--bogus"],
        ["bench", "--recipe", "no-such-recipe"],
        ["bench", "scheduler", "--num-seqs", "x"],
        ["models", "list", "--bogus"],
    ],
    ids=lambda a: " ".join(a),
)
def test_usage_errors_exit_64_in_every_command(tmp_path, args):
    (tmp_path / "in.jsonl").write_text('{"custom_id": "a", "prompt": "Hi"}\n')
    before = sorted(p.name for p in tmp_path.iterdir())
    res = pagedctl(*args, cwd=tmp_path)
    assert res.returncode == EXIT_USAGE, (res.returncode, res.stderr)
    assert "Traceback" not in res.stderr and res.stderr.strip()
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written


def test_help_and_no_arguments_are_not_errors(tmp_path):
    for args in ([], ["--help"], ["bench"], ["models"], ["generate", "--help"], ["version"]):
        assert pagedctl(*args, cwd=tmp_path).returncode == 0, args


def test_the_docs_table_is_the_code_table():
    rows = re.findall(r"^\| (\d+) \|", (ROOT / "docs/jobs.md").read_text(), flags=re.M)
    assert sorted(map(int, rows)) == sorted(EXIT_CODES)


# ---------------------------------------------------------------- every code of `generate`

TINY = ["--model", "tiny-llama", "--num-blocks", "64", "--max-num-seqs", "2", "--ignore-eos"]


def _lines(*extra: str, n: int = 2, max_tokens: int = 4) -> str:
    rows = [
        json.dumps({"custom_id": f"r{i}", "prompt_token_ids": [1, 9 + i], "max_tokens": max_tokens})
        for i in range(n)
    ]
    return "\n".join([*rows, *extra]) + "\n"


def _small_file_limit() -> None:  # runs in the child: a file may not grow past 4 KiB
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))


slow = pytest.mark.slow
WALK = {
    0: "every line succeeds",
    1: "the weights file of the model is garbage",
    3: "one line is bad",
    64: "-o names a folder",
    65: "the input does not exist",
    74: "the output outgrows the file size limit (ulimit -f)",
    75: "another run holds the lock",
    130: "SIGINT as soon as the command handles signals",
}


def test_the_walk_covers_the_table():
    assert sorted(WALK) == sorted(EXIT_CODES)


@pytest.mark.parametrize(
    "code",
    [pytest.param(c, marks=slow) if c in (0, 1, 3, 74) else c for c in WALK],
    ids=lambda c: f"{c}: {WALK[c]}",
)
def test_generate_reaches_each_exit_code_and_says_so_in_json(tmp_path, code):
    """The real command, --log-format json: every line on stderr is JSON, and the last is the
    summary (0, 3) or an error event with the exit code; never a traceback without --debug."""
    src = tmp_path / "in.jsonl"
    src.write_text(_lines("{not json") if code == 3 else _lines(n=20, max_tokens=40))
    args = [str(src), *TINY, "--log-format", "json"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "pagedctl", "generate"]
    kw: dict = {}
    lock = None
    if code == 0:  # longer than the pool: the engine logs a warning, which must be JSON too
        args += ["--max-model-len", "2048"]
    elif code == 1:
        model = tmp_path / "model"
        model.mkdir()
        (model / "config.json").write_text(
            (ROOT / "engine/models/presets" / "tiny-llama.json").read_text()
        )
        (model / "model.safetensors").write_bytes(b"not a safetensors file")
        args += ["--model", str(model)]
    elif code == 64:
        (tmp_path / "folder").mkdir()
        args += ["-o", str(tmp_path / "folder")]
    elif code == 65:
        args[0] = str(tmp_path / "absent.jsonl")
    elif code == 74:
        kw["preexec_fn"] = _small_file_limit
    elif code == 75:
        lock = JobLock(tmp_path / "in.out.jsonl")
        lock.acquire()
    if code == 130:
        proc = subprocess.Popen(
            cmd + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        deadline = time.monotonic() + 60
        while not handles(proc.pid, signal.SIGTERM) and proc.poll() is None:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
        returncode = proc.returncode
    else:
        res = subprocess.run(
            cmd + args, capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path, **kw
        )
        stderr, returncode = res.stderr, res.returncode
    if lock is not None:
        lock.release()
    assert returncode == code, stderr
    events = [json.loads(line) for line in stderr.splitlines()]
    assert "Traceback" not in stderr and events, stderr
    last = events[-1]
    if code == 0:
        assert any(e["event"] == "log" and e["level"] == "warning" for e in events), events
    if code in (0, 3):
        assert last["event"] == "summary" and last["errors_total"] == (code == 3)
    else:
        assert last["event"] == "error" and last["exit_code"] == code and last["message"]

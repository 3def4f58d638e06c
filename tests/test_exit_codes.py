"""Every command follows the one exit-code table of docs/jobs.md (`pagedctl.exits`): a flag that
does not parse, a value that cannot be used and a recipe that is not there are usage errors (64)
in `generate`, `sweep`, `capacity` and `bench` alike, with one message and no traceback."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from pagedctl.exits import EXIT_CODES, EXIT_USAGE

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

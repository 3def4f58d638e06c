"""Helpers for the `pagedctl generate` tests: write inputs, run the real CLI, read its outputs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

FAST = ["--max-num-seqs", "16", "--temperature", "0"]


def write_jsonl(path: Path, rows: list) -> Path:
    with path.open("w") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return path


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def cli(*args: str | Path) -> list[str]:
    return [sys.executable, "-m", "pagedctl", "generate", *map(str, args)]


def run(*args: str | Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `pagedctl generate` to the end in a subprocess."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(cli(*args), capture_output=True, text=True, timeout=timeout, env=env)


def start(*args: str | Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        cli(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )


def wait_for_lines(path: Path, n: int, proc: subprocess.Popen, timeout: float = 120) -> int:
    """Wait until `path` holds at least `n` complete lines (or the process ends)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        count = path.read_bytes().count(b"\n") if path.exists() else 0
        if count >= n or proc.poll() is not None:
            return count
        time.sleep(0.05)
    raise TimeoutError(f"{path} did not reach {n} lines")


def kill_midway(src: Path, n: int, *args: str | Path, timeout: float = 240) -> int:
    """Start `pagedctl generate src ...`, SIGKILL it once its output (`src`'s `.out.jsonl`)
    holds `n` records, and return how many it held."""
    proc = start(src, *args)
    seen = wait_for_lines(src.with_suffix(".out.jsonl"), n, proc, timeout=timeout)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    return seen


def by_id(records: list[dict]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for r in records:
        assert r["custom_id"] not in out, f"{r['custom_id']} twice"
        out[r["custom_id"]] = r
    return out


def answer_tokens(path: Path) -> dict[str, list[str]]:
    """custom_id -> the answer's tokens as its logprobs name them ("token_id:<id>" for a model
    without a tokenizer), each custom_id once; the line must have asked for logprobs."""
    out = {}
    for cid, r in by_id(read_jsonl(path)).items():
        answer = r["response"]["body"]["choices"][0]["logprobs"]["tokens"]
        assert len(answer) == r["response"]["body"]["usage"]["completion_tokens"] > 0
        out[cid] = answer
    return out


def check_ok_line(r: dict) -> dict:
    """Assert the OpenAI batch output schema of one success line; return its body."""
    assert set(r) == {"id", "custom_id", "response", "error"} and r["error"] is None
    resp = r["response"]
    assert resp["status_code"] == 200 and isinstance(resp["request_id"], str)
    body = resp["body"]
    assert body["object"] in ("chat.completion", "text_completion")
    usage = body["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    for i, choice in enumerate(body["choices"]):
        assert choice["index"] == i and choice["finish_reason"] in ("stop", "length")
        text = (
            choice["message"]["content"] if body["object"] == "chat.completion" else choice["text"]
        )
        assert isinstance(text, str)
    return body


def completion_text(body: dict, i: int = 0) -> str:
    choice = body["choices"][i]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def handles(pid: int, sig: int) -> bool:
    """Whether process `pid` runs pagedctl and has a handler of its own for `sig` (from /proc)."""
    try:
        if b"pagedctl" not in Path(f"/proc/{pid}/cmdline").read_bytes():
            return False  # not yet exec'd: the handlers are still those of the test
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = next(line for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(int(caught.split()[1], 16) >> (sig - 1) & 1)

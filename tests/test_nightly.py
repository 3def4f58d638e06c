"""The nightly job, night after night: the documented crontab and systemd lines run as cron and
systemd would run them, path templates, the spool folder (a kill -9 and a changed input among
its nights), the time limit, the summary on every ending, and the checks before the model loads.

Real subprocesses, files and signals; the documented lines run the bundled model, the rest the
dummy-weight tiny-llama preset (lines give token ids).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pagedctl.exits import EXIT_DATAERR, EXIT_OK, EXIT_SIGINT, EXIT_TEMPFAIL, EXIT_USAGE
from pagedctl.generate.templates import RunNames, job_date
from tests.job_utils import by_id, check_ok_line, read_jsonl, write_jsonl

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "jobs.md"
TINY = ["--model", "tiny-llama", "--num-blocks", "128", "--max-num-seqs", "4", "--ignore-eos"]
NO_MODEL = ["--model", "no-such-model-is-ever-loaded"]  # a check that passes would load it
ENGINE_UP = "INFO pagedctl.engine: model"


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **extra}


def gen(*args, cwd: Path | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pagedctl", "generate", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env(), cwd=cwd)


def spawn(*args, cwd: Path | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pagedctl", "generate", *map(str, args)]
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=cwd
    )


def token_rows(prefix: str, n: int, max_tokens: int = 6) -> list[dict]:
    return [
        {
            "custom_id": f"{prefix}-{i:03d}",
            "prompt_token_ids": [1, 5 + i % 97, 40 + i % 13],
            "max_tokens": max_tokens,
            "logprobs": True,
        }
        for i in range(n)
    ]


def aged(path: Path, seconds: float = 600) -> Path:
    """Make a spool file look written `seconds` ago (past the recipe's min_age)."""
    t = time.time() - seconds
    os.utime(path, (t, t))
    return path


def answers(path: Path) -> dict[str, list[str]]:
    """custom_id -> the answer's tokens; each custom_id exactly once."""
    out = {}
    for cid, r in by_id(read_jsonl(path)).items():
        check_ok_line(r)
        out[cid] = r["response"]["body"]["choices"][0]["logprobs"]["tokens"]
    return out


def reference(tmp: Path, src: Path) -> dict[str, list[str]]:
    """The answers of one uninterrupted run over `src`."""
    ref = tmp / "ref"
    ref.mkdir(exist_ok=True)
    out = ref / f"{src.name}.{hashlib.sha256(src.read_bytes()).hexdigest()}.out.jsonl"
    res = gen(src, *TINY, "--temperature", "0", "-o", out)
    assert res.returncode == EXIT_OK, res.stderr
    return answers(out)


# ---------------------------------------------------------------- the documented lines


def documented_block(lang: str) -> list[str]:
    """The fenced blocks of docs/jobs.md in `lang`."""
    return re.findall(rf"```{lang}\n(.*?)```", DOCS.read_text(), flags=re.S)


def cron_command(line: str) -> tuple[str, str]:
    """What cron runs for a crontab line: (the command for `sh -c`, its stdin). As cron does, the
    five time fields go, `\\%` is a `%`, and the first bare `%` ends the command (the rest, with
    each further `%` a newline, is its stdin)."""
    command = line.split(None, 5)[5]
    out, stdin, i = [], None, 0
    while i < len(command):
        ch = command[i]
        if ch == "\\" and command[i + 1 : i + 2] == "%":
            out.append("%")
            i += 2
            continue
        if ch == "%":
            stdin = command[i + 1 :].replace("%", "\n")
            break
        out.append(ch)
        i += 1
    return "".join(out), stdin or ""


def test_cron_command_renders_percent_as_cron_does():
    cmd, stdin = cron_command("0 1 * * *  echo a-$(date +\\%F) b%line1%line2")
    assert cmd == "echo a-$(date +%F) b" and stdin == "line1\nline2"


def _batch_folder(tmp_path: Path) -> Path:
    """/srv/batch as the docs set it up: the venv's pagedctl, a copy of the shipped recipe,
    in/ and logs/."""
    batch = tmp_path / "batch"
    (batch / ".venv" / "bin").mkdir(parents=True)
    exe = Path(sys.executable).parent / "pagedctl"
    if not exe.exists():
        exe = Path(shutil.which("pagedctl") or "")
    assert exe.is_file(), "pagedctl is not installed beside this Python"
    (batch / ".venv" / "bin" / "pagedctl").symlink_to(exe)
    shutil.copy(ROOT / "recipes" / "nightly.yaml", batch / "nightly.yaml")
    (batch / "in").mkdir()
    (batch / "logs").mkdir()
    return batch


def _night(batch: Path, command: str) -> subprocess.Popen:
    return subprocess.Popen(
        ["sh", "-c", command],
        cwd="/",
        env=_env(),
        start_new_session=True,
        stdin=subprocess.DEVNULL,
    )


def _outputs(batch: Path, stem: str) -> list[Path]:
    return sorted((batch / "out").glob(f"{stem}.*.out.jsonl"))


def _chat_rows(night: int, n: int) -> list[dict]:
    rows = []
    for i in range(n):
        body = {"max_tokens": 12, "temperature": 0}
        if i % 2:
            body["messages"] = [{"role": "user", "content": f"Night {night}: name a colour ({i})."}]
            url = "/v1/chat/completions"
        else:
            body["prompt"] = f"Night {night}, item {i}: the capital of France is"
            url = "/v1/completions"
        rows.append({"custom_id": f"n{night}-{i}", "method": "POST", "url": url, "body": body})
    return rows


@pytest.mark.slow
def test_the_documented_crontab_line_works_three_nights_with_a_kill(tmp_path):
    """docs/jobs.md's crontab line, rendered as cron renders it, run with sh -c on three nights:
    the same input path gets a new day's file, night 2 is killed (kill -9) and run again, and each
    night's output holds every line once, with the logs in the day's log file."""
    (line,) = [
        ln for ln in documented_block("crontab")[0].splitlines() if ln and not ln.startswith("#")
    ]
    command, stdin = cron_command(line)
    assert stdin == "" and "%" in command  # the date's % were escaped for cron
    batch = _batch_folder(tmp_path)
    command = command.replace("/srv/batch", shlex.quote(str(batch)))
    requests = batch / "in" / "requests.jsonl"
    night_outputs = []
    for night in (1, 2, 3):
        rows = _chat_rows(night, 8 if night == 2 else 3)
        write_jsonl(requests, rows)  # the new day's input, at the same path
        aged(requests)
        if night == 2:  # killed once records are coming, then run again by the next cron tick
            proc = _night(batch, command)
            deadline = time.monotonic() + 240
            while time.monotonic() < deadline and proc.poll() is None:
                done = _outputs(batch, "requests")
                new = [p for p in done if p not in night_outputs]
                if new and new[0].read_bytes().count(b"\n") >= 2:
                    break
                time.sleep(0.05)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
            (partial,) = [p for p in _outputs(batch, "requests") if p not in night_outputs]
            kept = partial.read_bytes()
            assert 2 <= kept.count(b"\n") < len(rows)
        proc = _night(batch, command)
        assert proc.wait(timeout=300) == EXIT_OK, (batch / "logs").glob("*.log")
        (out,) = [p for p in _outputs(batch, "requests") if p not in night_outputs]
        night_outputs.append(out)
        records = by_id(read_jsonl(out))
        assert sorted(records) == sorted(r["custom_id"] for r in rows)
        for r in records.values():
            assert check_ok_line(r)["usage"]["completion_tokens"] > 0
        if night == 2:
            assert out.read_bytes().startswith(kept)  # what the killed run wrote is kept
        summary = out.with_name(out.name.replace(".out.jsonl", ".summary.json"))
        assert summary.read_text().endswith("}\n")
        assert json.loads(summary.read_text())["job"]["complete"] is True
    # Every night's output is still there and whole; the day's log has the summaries.
    for out in night_outputs:
        assert len(read_jsonl(out)) in (3, 8)
    (log,) = (batch / "logs").glob("nightly-*.log")
    assert log.name == f"nightly-{time.strftime('%Y-%m-%d')}.log"
    assert "pagedctl generate" in log.read_text() and "Traceback" not in log.read_text()
    assert not list((batch / "out").glob("*.lock"))


def _unit(text: str) -> dict[str, str]:
    return dict(
        ln.split("=", 1) for ln in text.splitlines() if "=" in ln and not ln.startswith("#")
    )


@pytest.mark.slow
def test_the_documented_systemd_service_runs_twice(tmp_path):
    """The service's ExecStart, split as systemd splits it, in its WorkingDirectory, on two
    nights' inputs; the exit codes its Success/RestartPrevent lines name are the table's."""
    service = _unit(next(b for b in documented_block("ini") if "[Service]" in b))
    batch = _batch_folder(tmp_path)
    argv = shlex.split(service["ExecStart"].replace("/srv/batch", str(batch)))
    cwd = Path(service["WorkingDirectory"].replace("/srv/batch", str(batch)))
    assert service["SuccessExitStatus"] == "3"
    assert set(service["RestartPreventExitStatus"].split()) == {"64", "65", "75"}
    for night in (1, 2):
        src = aged(write_jsonl(batch / "in" / f"night-{night}.jsonl", _chat_rows(night, 2)))
        res = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, env=_env(), timeout=300)
        assert res.returncode == EXIT_OK, res.stderr
        events = [json.loads(ln) for ln in res.stderr.splitlines()]  # every line JSON
        summaries = [e for e in events if e["event"] == "summary"]
        assert all({"ts", "level"} <= e.keys() for e in events)
        assert [s["ok"] for s in summaries] == [2]  # the earlier night's input is done: skipped
        files = [e for e in events if e["event"] == "spool_file"]
        assert [(f["input"], f["status"]) for f in files][-1] == (src.name, "complete")


# ---------------------------------------------------------------- the spool folder


@pytest.mark.slow
def test_the_spool_folder_over_three_days_with_a_kill_and_a_changed_input(tmp_path):
    spool, out = tmp_path / "in", tmp_path / "out"
    spool.mkdir()
    args = ["--input-dir", spool, "--output-dir", out, *TINY, "--temperature", "0"]
    # Day 1.
    day1 = aged(write_jsonl(spool / "day1.jsonl", token_rows("d1", 5)), 3000)
    ref1 = reference(tmp_path, day1)
    res = gen(*args)
    assert res.returncode == EXIT_OK, res.stderr
    (out1,) = out.glob("day1.*.out.jsonl")
    assert answers(out1) == ref1
    # Day 2: a long input, killed with SIGKILL part way, and the next run finishes it.
    day2 = aged(write_jsonl(spool / "day2.jsonl", token_rows("d2", 120, max_tokens=24)), 2000)
    proc = spawn(*args)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        found = list(out.glob("day2.*.out.jsonl"))
        if found and found[0].read_bytes().count(b"\n") >= 10:
            break
        time.sleep(0.05)
    proc.kill()
    proc.communicate(timeout=60)
    (out2,) = out.glob("day2.*.out.jsonl")
    assert 10 <= len(read_jsonl(out2)) < 120
    res = gen(*args)
    assert res.returncode == EXIT_OK, res.stderr
    assert answers(out2) == reference(tmp_path, day2)
    assert "day1.jsonl" in res.stderr or "day1.jsonl" in res.stdout  # listed as complete
    # Day 3: day1.jsonl is replaced by new bytes (a new job, new files), day3 arrives, and a
    # file still being written waits.
    write_jsonl(spool / "day1.jsonl", token_rows("d1b", 4))
    aged(spool / "day1.jsonl", 1000)
    aged(write_jsonl(spool / "day3.jsonl", token_rows("d3", 3)), 900)
    write_jsonl(spool / "day4.jsonl.part", token_rows("d4", 2))
    res = gen(*args)
    assert res.returncode == EXIT_OK, res.stderr
    assert res.stderr.count(ENGINE_UP) == 1  # two inputs, one model load
    outs1 = sorted(out.glob("day1.*.out.jsonl"))
    assert len(outs1) == 2 and out1 in outs1
    assert answers(out1) == ref1  # the first day1's results are untouched
    (new1,) = [p for p in outs1 if p != out1]
    assert answers(new1) == reference(tmp_path, spool / "day1.jsonl")
    (out3,) = out.glob("day3.*.out.jsonl")
    assert answers(out3) == reference(tmp_path, spool / "day3.jsonl")
    assert not list(out.glob("day4*"))
    for summary in out.glob("*.summary.json"):
        assert json.loads(summary.read_text())["job"]["complete"] is True
    # Night after: nothing to do, found without loading a model (this one could not load).
    start = time.monotonic()
    res = gen("--input-dir", spool, "--output-dir", out, *NO_MODEL, "-q")
    assert res.returncode == EXIT_OK and res.stdout == "" and res.stderr == "", res.stderr
    assert time.monotonic() - start < 30


def test_spool_files_being_written_wait_and_bad_spool_settings_are_refused(tmp_path):
    spool, out = tmp_path / "in", tmp_path / "out"
    spool.mkdir()
    write_jsonl(spool / "fresh.jsonl", token_rows("f", 1))  # changed just now
    write_jsonl(spool / "late.jsonl.part", token_rows("p", 1))
    (spool / "notes.txt").write_text("not an input\n")
    res = gen("--input-dir", spool, "--output-dir", out, *NO_MODEL, "--log-format", "json")
    assert res.returncode == EXIT_OK, res.stderr
    status = {
        e["input"]: e["status"]
        for e in map(json.loads, res.stderr.splitlines())
        if e["event"] == "spool_file"
    }
    assert status["fresh.jsonl"].startswith("not ready: changed")
    assert status["late.jsonl.part"] == "not ready: still being written"
    assert status["notes.txt"].startswith("ignored")
    bad = [
        (["--input-dir", spool], "needs --output-dir"),
        (["--input-dir", spool, "--output-dir", spool], "another folder"),
        (["--input-dir", tmp_path / "nope", "--output-dir", out], "is not a folder"),
        (["--input-dir", spool, "--output-dir", out, "-o", "all.out.jsonl"], "{input_stem}"),
        (["--input-dir", spool, "--output-dir", out, "--min-age", "soon"], "not a duration"),
    ]
    for flags, message in bad:
        res = gen(*flags, *NO_MODEL)
        assert res.returncode in (EXIT_USAGE, EXIT_DATAERR), (flags, res.stderr)
        assert message in res.stderr and ENGINE_UP not in res.stderr, res.stderr
    # One run holds the folder at a time.
    aged(spool / "fresh.jsonl")
    lock = out / ".pagedctl-spool.lock"
    with open(lock, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        res = gen("--input-dir", spool, "--output-dir", out, *NO_MODEL)
    assert res.returncode == EXIT_TEMPFAIL and "holds the spool folder" in res.stderr


def test_a_spool_input_that_fails_alone_does_not_stop_the_others(tmp_path):
    spool, out = tmp_path / "in", tmp_path / "out"
    spool.mkdir()
    aged(write_jsonl(spool / "a-empty.jsonl", []), 900)
    aged(write_jsonl(spool / "b-good.jsonl", token_rows("b", 2)), 800)
    res = gen("--input-dir", spool, "--output-dir", out, *TINY, "--min-age", "0")
    assert res.returncode == EXIT_DATAERR, res.stderr
    assert "a-empty.jsonl" in res.stderr and "is empty" in res.stderr
    (good,) = out.glob("b-good.*.out.jsonl")
    assert len(read_jsonl(good)) == 2


def test_every_spool_input_gets_its_logprob_tokens_from_the_tokenizer(tmp_path):
    """The engine starts with the first input; the second, run on the same engine, still
    shows its tokens as text, not as `token_id:N` (the bundled model has a tokenizer)."""
    spool, out = tmp_path / "in", tmp_path / "out"
    spool.mkdir()
    for name, age in (("a", 900), ("b", 800)):
        rows = [{"custom_id": f"{name}-0", "prompt": "The sky is", "max_tokens": 3, "logprobs": 1}]
        aged(write_jsonl(spool / f"{name}.jsonl", rows), age)
    res = gen("--input-dir", spool, "--output-dir", out, "--temperature", "0", "--min-age", "0")
    assert res.returncode == EXIT_OK, res.stderr
    tokens = {}
    for name in ("a", "b"):
        (found,) = out.glob(f"{name}.*.out.jsonl")
        (record,) = read_jsonl(found)
        tokens[name] = record["response"]["body"]["choices"][0]["logprobs"]["tokens"]
    assert tokens["a"] == tokens["b"] and len(tokens["a"]) == 3, tokens
    assert not any(t.startswith("token_id:") for t in tokens["b"]), tokens


# ---------------------------------------------------------------- templates and recipes


def test_templates_name_each_input_and_date_follows_the_job(tmp_path):
    src = write_jsonl(tmp_path / "batch.jsonl", token_rows("t", 3))
    template = str(tmp_path / "out" / "{input_stem}-{date}-{input_sha}.out.jsonl")
    res = gen(src, *TINY, "-o", template, "--summary-json", tmp_path / "out" / "{date}.json")
    assert res.returncode == EXIT_OK, res.stderr
    (out,) = (tmp_path / "out").glob("batch-*.out.jsonl")
    today = time.strftime("%Y-%m-%d")
    manifest = json.loads(Path(f"{out}.manifest.json").read_text())
    assert out.name == f"batch-{today}-{manifest['input_sha256'][:12]}.out.jsonl"
    assert manifest["date"] == today and manifest["complete"] is True
    assert (tmp_path / "out" / f"{today}.json").read_text().endswith("}\n")
    # The job started "yesterday": a rerun after midnight finds its files by its manifest.
    old = Path(str(out).replace(today, "2000-01-01"))
    for suffix in ("", ".manifest.json"):
        Path(f"{out}{suffix}").rename(f"{old}{suffix}")
    err = out.with_name(out.name.replace(".out.", ".errors."))
    err.rename(Path(str(err).replace(today, "2000-01-01")))
    manifest["date"] = "2000-01-01"
    Path(f"{old}.manifest.json").write_text(json.dumps(manifest))
    names = RunNames("batch", manifest["input_sha256"], today)
    assert job_date(template, names) == "2000-01-01"
    res = gen(src, *TINY, "-o", template)
    assert res.returncode == EXIT_OK, res.stderr
    assert sorted(p.name for p in (tmp_path / "out").glob("batch-*.out.jsonl")) == [old.name]
    # Another input's bytes are another job: today's date, their own files.
    other = write_jsonl(tmp_path / "batch.jsonl", token_rows("u", 2))
    res = gen(other, *TINY, "-o", template)
    assert res.returncode == EXIT_OK, res.stderr
    assert len(list((tmp_path / "out").glob(f"batch-{today}-*.out.jsonl"))) == 1


def test_a_named_recipe_writes_where_the_command_runs(tmp_path):
    """`--recipe nightly` and `--recipe nightly.yaml` (no such file here) are the shipped recipe;
    its relative paths are the current directory's, never the package's."""
    (tmp_path / "in").mkdir()
    aged(write_jsonl(tmp_path / "in" / "x.jsonl", token_rows("x", 2)))
    shipped = ROOT / "recipes"
    before = sorted(p.name for p in shipped.iterdir())
    for name in ("nightly", "nightly.yaml"):
        res = gen("--recipe", name, *TINY, "-q", cwd=tmp_path)
        assert res.returncode == EXIT_OK, res.stderr
    (out,) = (tmp_path / "out").glob("x.*.out.jsonl")
    assert len(read_jsonl(out)) == 2
    assert sorted(p.name for p in shipped.iterdir()) == before
    res = gen("--recipe", "./nightly.yaml", *NO_MODEL, cwd=tmp_path)
    assert res.returncode == EXIT_USAGE and "no recipe" in res.stderr


# ---------------------------------------------------------------- the time limit and summaries


@pytest.mark.slow
def test_the_time_limit_stops_writes_the_summary_and_the_next_run_resumes(tmp_path):
    # 90,000 tokens: some 17 s at the tiny model's fastest seen (5,300 tok/s), past the limit
    src = write_jsonl(tmp_path / "in.jsonl", token_rows("r", 300, max_tokens=300))
    summary = tmp_path / "s.json"
    res = gen(src, *TINY, "--time-limit", "6s", "--summary-json", summary)
    assert res.returncode == EXIT_TEMPFAIL, res.stderr
    assert "the time limit (6 s) was reached" in res.stderr
    first = json.loads(summary.read_text())
    assert first["interrupted_by"] == "time_limit" and first["job"]["complete"] is False
    # (0 results when a loaded machine took the whole limit to load the model)
    assert first["ok"] < 300 and first["job"]["results"] == first["ok"]
    assert "time_limit" in res.stdout  # the table says it too
    res = gen(src, *TINY, "--summary-json", summary)
    assert res.returncode == EXIT_OK, res.stderr
    second = json.loads(summary.read_text())
    assert second["job"]["results_earlier"] == first["ok"]
    assert second["ok"] == 300 - first["ok"] and second["job"]["results"] == 300
    assert second["interrupted_by"] is None and second["job"]["complete"] is True
    assert sorted(by_id(read_jsonl(tmp_path / "in.out.jsonl"))) == [
        r["custom_id"] for r in token_rows("r", 300)
    ]


@pytest.mark.slow
def test_a_signal_writes_the_summary_with_the_job_totals(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", token_rows("r", 200, max_tokens=60))
    summary = tmp_path / "s.json"
    # While the model loads: the paths are known, nothing ran.
    proc = spawn(src, *TINY, "--summary-json", summary)
    lock = tmp_path / "in.out.jsonl.lock"
    deadline = time.monotonic() + 60
    while not (lock.exists() and lock.read_text().strip() == str(proc.pid)):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=60)
    assert proc.returncode == EXIT_SIGINT
    stopped = json.loads(summary.read_text())
    assert stopped["interrupted_by"] == "SIGINT" and stopped["requests"] == 0
    # Once records are coming.
    proc = spawn(src, *TINY, "--summary-json", summary)
    out = tmp_path / "in.out.jsonl"
    while not (out.exists() and out.read_bytes().count(b"\n") >= 5):
        assert proc.poll() is None
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    stdout, _ = proc.communicate(timeout=60)
    assert proc.returncode == EXIT_TEMPFAIL
    first = json.loads(summary.read_text())
    assert first["interrupted_by"] == "SIGTERM" and first["ok"] >= 5
    assert "SIGTERM" in stdout and "job (all runs)" in stdout
    assert not lock.exists()  # the run removed its lock file


def test_checks_that_fail_end_before_the_model_loads(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", token_rows("r", 2))
    # An empty input (blank lines only).
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n")
    res = gen(empty, *NO_MODEL)
    assert res.returncode == EXIT_DATAERR and "is empty" in res.stderr
    # Bad templates and durations.
    for flags, message in [
        (["-o", tmp_path / "{nope}.jsonl"], "unknown field {nope}"),
        (["--summary-json", tmp_path / "{date"], "literal brace"),
        (["--time-limit", "2 hours"], "not a duration"),
        (["--time-limit", "0"], "above 0"),
    ]:
        res = gen(src, *flags, *NO_MODEL)
        assert res.returncode == EXIT_USAGE and message in res.stderr, (flags, res.stderr)
    bad = tmp_path / "bad.yaml"
    bad.write_text("job:\n  time_limit: soon\n")
    res = gen(src, "--recipe", bad, *NO_MODEL)
    assert res.returncode == EXIT_USAGE and "job.time_limit must be a duration" in res.stderr
    bad.write_text("sampling:\n  max_tokens: 4.5\n")  # 4.0 would be 4, as on a line
    res = gen(src, "--recipe", bad, *NO_MODEL)
    assert res.returncode == EXIT_USAGE and "fractional part" in res.stderr
    # A manifest that differs: refused before the model is loaded.
    res = gen(src, *TINY, "--temperature", "0")
    assert res.returncode == EXIT_OK, res.stderr
    res = gen(src, *NO_MODEL, "--ignore-eos", "--temperature", "0.5")
    assert res.returncode == EXIT_USAGE and "sampling_defaults.temperature" in res.stderr
    assert ENGINE_UP not in res.stderr and "cannot start the engine" not in res.stderr
    # A finished job: recognised without a model; one record taken out runs again.
    res = gen(src, *NO_MODEL, "--ignore-eos", "--temperature", "0")
    assert res.returncode == EXIT_OK and "complete" in res.stdout, res.stderr
    out = tmp_path / "in.out.jsonl"
    out.write_text(out.read_text().splitlines(keepends=True)[0])
    res = gen(src, *TINY, "--temperature", "0")
    assert res.returncode == EXIT_OK and len(read_jsonl(out)) == 2, res.stderr
    # A held lock.
    with open(tmp_path / "in.out.jsonl.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        res = gen(src, *NO_MODEL, "--ignore-eos", "--temperature", "0")
    assert res.returncode == EXIT_TEMPFAIL and "locked" in res.stderr
    # A model that cannot load leaves no lock file, no manifest, no output.
    fresh = write_jsonl(tmp_path / "fresh.jsonl", token_rows("f", 1))
    res = gen(fresh, *NO_MODEL)
    assert res.returncode == EXIT_USAGE and "cannot start the engine" in res.stderr
    assert [p.name for p in tmp_path.glob("fresh.*")] == ["fresh.jsonl"]


def test_progress_counts_requests_and_their_sequences_apart(tmp_path):
    from pagedctl.engine import LLM, SamplingParams

    llm = LLM("tiny-llama", device="cpu", num_blocks=64, max_num_seqs=8)
    params = SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=1, ignore_eos=True)
    llm.add_request(0, {"prompt_token_ids": [1, 5, 9]}, params)
    llm.step()
    snap = llm.snapshot()
    assert (snap["running_requests"], snap["running"]) == (1, 3)
    # The job's lines carry both, and the JSON summary event its ts and level.
    src = write_jsonl(tmp_path / "in.jsonl", token_rows("r", 2))
    res = gen(src, *TINY, "--log-format", "json")
    assert res.returncode == EXIT_OK, res.stderr
    events = [json.loads(ln) for ln in res.stderr.splitlines()]
    (progress, *_) = [e for e in events if e["event"] == "progress"]
    assert {"running", "running_seqs", "waiting"} <= progress.keys()
    (summary,) = [e for e in events if e["event"] == "summary"]
    assert summary["level"] == "info" and isinstance(summary["ts"], float)

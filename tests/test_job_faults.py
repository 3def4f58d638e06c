"""`pagedctl generate` on hostile files, disks and signals: the real CLI in a subprocess ends with
one `error:` line (a JSON `error` event in JSON mode) and the exit code of the table, keeps every
record it wrote, and changes no file that is not its own.

The model is the dummy-weight tiny-llama preset (lines give token ids), so most of the cost is
the start-up; the checks that end before the model loads cost well under a second each.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from pagedctl.exits import (
    EXIT_DATAERR,
    EXIT_OK,
    EXIT_PARTIAL,
    EXIT_SIGINT,
    EXIT_TEMPFAIL,
    EXIT_USAGE,
)
from pagedctl.generate.job import GenerateJob, JobExit, JobStopped
from pagedctl.generate.recipe import JobSettings
from tests.job_utils import by_id, handles, read_jsonl, write_jsonl

TINY = ["--model", "tiny-llama", "--num-blocks", "64", "--max-num-seqs", "2", "--ignore-eos"]
NO_MODEL = ["--model", "no-such-model-is-ever-loaded"]  # a check that passes would load it


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **extra}


def gen(
    *args, prefix: list[str] = (), env: dict | None = None, **kw
) -> subprocess.CompletedProcess:
    cmd = [*prefix, sys.executable, "-m", "pagedctl", "generate", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env or _env(), **kw)


def spawn(*args, stderr=subprocess.PIPE) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pagedctl", "generate", *map(str, args)]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=stderr, text=True, env=_env())


def rows(n: int, max_tokens: int = 4) -> list[dict]:
    return [
        {"custom_id": f"r{i:02d}", "prompt_token_ids": [1, 7 + i, 30 + i], "max_tokens": max_tokens}
        for i in range(n)
    ]


def assert_clean_failure(res, code: int, *needles: str, json_logs: bool = False) -> str:
    """The exit code, no traceback, and a last line that says what happened; returns it."""
    assert res.returncode == code, (res.returncode, res.stderr)
    assert "Traceback" not in res.stderr, res.stderr
    lines = res.stderr.strip().splitlines()
    if json_logs:
        events = [json.loads(line) for line in lines]  # every line is JSON
        assert events[-1]["event"] == "error" and events[-1]["exit_code"] == code, events[-1]
        last = events[-1]["message"]
    else:
        assert lines and lines[-1].startswith("error: "), res.stderr
        last = lines[-1]
    for needle in needles:
        assert needle in last, (needle, last)
    return last


def listing(folder: Path) -> dict[str, bytes | None]:
    return {
        str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else None)
        for p in sorted(folder.rglob("*"))
    }


def without_root_powers() -> list[str] | None:
    """A command prefix under which file modes bind (as they do for any user but root), or None.

    As root: root without the capabilities that override file modes (setpriv, util-linux)."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return None
    prefix = [setpriv, "--bounding-set=-dac_override,-dac_read_search"]
    with tempfile.TemporaryDirectory() as d:
        secret = Path(d) / "secret"
        secret.write_text("x")
        secret.chmod(0o000)
        code = f"""
try:
    open({str(secret)!r}).read()
except PermissionError:
    raise SystemExit(42)
"""
        probe = subprocess.run([*prefix, sys.executable, "-c", code], timeout=30)
    return prefix if probe.returncode == 42 else None


def wait_until(cond, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert proc.poll() is None, f"ended first: {proc.returncode}"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


# ---------------------------------------------------------------- before the model loads


def test_outputs_that_cannot_be_written_are_refused_before_the_model_loads(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", rows(1))
    (tmp_path / "folder").mkdir()
    (tmp_path / "a-file").write_text("x\n")
    before = listing(tmp_path)
    cases = [
        (["-o", tmp_path / "folder"], "output", "is a folder"),
        (["--summary-json", tmp_path / "folder"], "summary", "is a folder"),
        (["--errors", tmp_path / "a-file" / "e.jsonl"], "errors file", "is not a folder"),
        (["-o", tmp_path / "a-file" / "deeper" / "o.jsonl"], "output", "is not a folder"),
    ]
    for flags, what, why in cases:
        res = gen(src, *flags, *NO_MODEL)
        assert_clean_failure(res, EXIT_USAGE, f"cannot write the {what}", why)
        assert len(res.stderr.splitlines()) == 1, res.stderr
    res = gen(src, "-o", tmp_path / "folder", *NO_MODEL, "--log-format", "json")
    assert_clean_failure(res, EXIT_USAGE, "is a folder", json_logs=True)
    assert listing(tmp_path) == before  # not even a lock file


def test_a_read_only_folder_and_an_unreadable_input(tmp_path):
    prefix = without_root_powers()
    if prefix is None:
        pytest.skip("running as root without setpriv: file modes do not bind root")
    ro = tmp_path / "ro"
    ro.mkdir()
    src = write_jsonl(ro / "in.jsonl", rows(1))
    ro.chmod(0o555)
    secret = write_jsonl(tmp_path / "secret.jsonl", rows(1))
    secret.chmod(0o000)
    try:
        res = gen(src, *NO_MODEL, prefix=prefix)
        assert_clean_failure(res, EXIT_USAGE, "cannot write the output", "is not writable")
        res = gen(src, "-o", tmp_path / "x.out.jsonl", "--errors", ro / "e.jsonl", prefix=prefix)
        assert_clean_failure(res, EXIT_USAGE, "cannot write the errors file")
        assert sorted(p.name for p in ro.iterdir()) == ["in.jsonl"]
        res = gen(secret, *NO_MODEL, prefix=prefix)
        assert_clean_failure(res, EXIT_DATAERR, "cannot read input", "Permission denied")
    finally:
        ro.chmod(0o755)
        secret.chmod(0o644)


def test_a_file_that_is_not_a_results_file_is_left_as_it_is(tmp_path):
    """Named as the output or the errors file, a file of notes is refused (64: the path is wrong)
    byte for byte as it was, torn-looking last line and all; a results file damaged in the middle
    is refused (65) with its own torn tail left uncut."""
    src = write_jsonl(tmp_path / "in.jsonl", rows(1))
    notes = tmp_path / "notes.txt"
    notes.write_bytes(b"shopping list\n\nmilk, eggs\nlast line without a newline")
    before = listing(tmp_path)
    res = gen(src, "-o", notes, *NO_MODEL)
    assert_clean_failure(res, EXIT_USAGE, "notes.txt is not a results file", "with -o")
    res = gen(src, "--errors", notes, *NO_MODEL, "--log-format", "json")
    assert_clean_failure(res, EXIT_USAGE, "is not a results file", "--errors", json_logs=True)
    assert listing(tmp_path) == before  # no .torn file, no lock, nothing created
    damaged = tmp_path / "damaged.out.jsonl"
    record = b'{"id":"batch_req_1","custom_id":"x","response":null,"error":null}\n'
    damaged.write_bytes(record + b"edited by hand\n" + record + b'{"id":"batch_req_2","cus')
    content = damaged.read_bytes()
    res = gen(src, "-o", damaged, *NO_MODEL)
    assert_clean_failure(res, EXIT_DATAERR, "line 2", "fix or delete that line")
    assert damaged.read_bytes() == content and not (tmp_path / "damaged.out.jsonl.torn").exists()


def test_ascii_terminal_and_a_non_ascii_path(tmp_path):
    env = _env(PYTHONIOENCODING="ascii", LANG="C", LC_ALL="C")
    src = write_jsonl(tmp_path / "données.jsonl", rows(2))
    res = gen(src, *TINY, "--summary-json", tmp_path / "résumé.json", env=env)
    assert res.returncode == EXIT_OK and "Traceback" not in res.stderr, res.stderr
    assert "donn\\xe9es.out.jsonl" in res.stdout  # the summary table, escaped
    assert json.loads((tmp_path / "résumé.json").read_text())["ok"] == 2
    res = gen(tmp_path / "absente-ô.jsonl", env=env)
    assert_clean_failure(res, EXIT_DATAERR, "absente-\\xf4.jsonl")


# ---------------------------------------------------------------- a full disk

# The real CLI with os.write failing as a full disk does, after FAIL_AFTER writes to the output:
# half of the record reaches the file, then ENOSPC.
FULL_DISK = """
import errno, os, sys
real_write, writes = os.write, [0]
limit = int(os.environ["FAIL_AFTER"])

def write(fd, data):
    if os.readlink(f"/proc/self/fd/{fd}").endswith(".out.jsonl"):
        writes[0] += 1
        if writes[0] > limit:
            real_write(fd, bytes(data[: len(data) // 2]))
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return real_write(fd, data)

os.write = write
sys.argv[0] = "pagedctl"
from pagedctl.cli import main
main()
"""


@pytest.mark.slow
@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_full_disk_keeps_every_record_and_a_rerun_resumes(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [*rows(8), "{not json"])
    out = tmp_path / "in.out.jsonl"
    cmd = [sys.executable, "-c", FULL_DISK, "generate", str(src), *TINY, "--log-format", "json"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=_env(FAIL_AFTER="3"))
    assert_clean_failure(res, EXIT_TEMPFAIL, "the disk is full", "rerun", json_logs=True)
    assert out.read_bytes().endswith(b"\n") and len(read_jsonl(out)) == 3  # the half line is cut
    # The rerun finishes the job, but its summary file is on a full disk (a real one: /dev/full).
    (tmp_path / "summary.json").symlink_to("/dev/full")
    res = gen(src, *TINY, "--summary-json", tmp_path / "summary.json")
    assert_clean_failure(res, EXIT_TEMPFAIL, "the disk is full", "summary", "every record")
    assert "results / errors" in res.stdout  # the summary was printed before
    records = read_jsonl(out) + read_jsonl(tmp_path / "in.errors.jsonl")
    ids = [r["custom_id"] for r in records]
    assert sorted(i for i in ids if i) == [r["custom_id"] for r in rows(8)] and ids.count(None) == 1
    assert not list(tmp_path.glob("*.torn"))


# ---------------------------------------------------------------- signals


@pytest.mark.slow
def test_a_signal_at_any_phase_stops_cleanly_and_a_rerun_resumes(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", rows(40, max_tokens=40))
    out = tmp_path / "in.out.jsonl"
    # As soon as the process handles SIGTERM at all: the commands are still being imported.
    proc = spawn(src, *TINY)
    wait_until(lambda: handles(proc.pid, signal.SIGTERM), proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == EXIT_TEMPFAIL and "stopped by SIGTERM" in err, err
    assert "Traceback" not in err and not out.exists()
    # While the model loads: the lock names the process, and the engine is being imported.
    lock = tmp_path / "in.out.jsonl.lock"
    proc = spawn(src, *TINY)
    wait_until(lambda: lock.exists() and lock.read_text().strip() == str(proc.pid), proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == EXIT_SIGINT and "stopped by SIGINT" in err, err
    assert "Traceback" not in err and not out.exists()
    # Once the stream starts.
    proc = spawn(src, *TINY)
    for line in proc.stderr:
        if line.startswith("info: start"):
            break
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == EXIT_TEMPFAIL and "stopped by SIGTERM" in err, err
    assert "Traceback" not in err and len(read_jsonl(out)) < 40
    res = gen(src, *TINY)
    assert res.returncode == EXIT_OK, res.stderr
    assert sorted(by_id(read_jsonl(out))) == [r["custom_id"] for r in rows(40)]
    assert read_jsonl(tmp_path / "in.errors.jsonl") == [] and not list(tmp_path.glob("*.torn"))


def test_a_signal_before_the_first_request_or_after_the_last(tmp_path):
    """The two ends of a run, without a model: a signal before the stream raises (a model load
    cannot look at a flag); one while the summary prints ends the run with the same exit."""
    job = GenerateJob(
        JobSettings(input=write_jsonl(tmp_path / "in.jsonl", rows(1))),
        force=False,
        quiet=True,
        log_format="text",
    )
    before = signal.getsignal(signal.SIGINT)  # default_int_handler, or SIG_IGN if inherited
    with job.signals():
        with pytest.raises(JobStopped, match="stopped by SIGTERM") as stopped:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)
        assert stopped.value.code == EXIT_TEMPFAIL
        job.stop.signum, job.stop.graceful = None, True  # the stream and after it
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.01)
        end = job.stopped()
    assert isinstance(end, JobExit) and end.code == EXIT_SIGINT
    assert "every record is written" in str(end)
    assert signal.getsignal(signal.SIGINT) is before  # restored


# ---------------------------------------------------------------- an edited input and --force


@pytest.mark.slow
def test_force_on_an_edited_input_gives_each_line_one_record(tmp_path):
    def line(cid, **kw):
        return {"custom_id": cid, "prompt_token_ids": [1, 5, 9], "max_tokens": 2, **kw}

    src = write_jsonl(
        tmp_path / "in.jsonl",
        [line("a"), "{not json", line("b", max_tokens=0), line("a"), line("c")],
    )
    assert gen(src, *TINY).returncode == EXIT_PARTIAL
    # Old errors at lines 2, 3, 4; now new bad lines sit there, and the old ones moved down.
    write_jsonl(
        src,
        [
            line("a"),
            line("d", max_tokens=0),  # new, at the line of the old invalid_json
            line("e", max_tokens=0),  # new, at the line of b's old error
            line("a"),  # the same duplicate as before
            line("c"),
            line("b", max_tokens=0),  # b's bad line, moved from 3 to 6
            "{not json",  # moved from 2 to 7
            line("a"),  # a second duplicate
            line("f"),
        ],
    )
    res = gen(src, *TINY, "--force")
    assert res.returncode == EXIT_PARTIAL, res.stderr
    ok = read_jsonl(tmp_path / "in.out.jsonl")
    errors = read_jsonl(tmp_path / "in.errors.jsonl")
    own = [r for r in ok + errors if (r["error"] or {}).get("code") != "duplicate_custom_id"]
    ids = [r["custom_id"] for r in own if r["custom_id"] is not None]
    assert sorted(ids) == ["a", "b", "c", "d", "e", "f"]  # one record each
    assert {r["custom_id"] for r in ok} == {"a", "c", "f"}
    dups = [r for r in errors if r["error"]["code"] == "duplicate_custom_id"]
    assert sorted(r["error"]["line"] for r in dups) == [4, 8]  # one per duplicate line
    # the bad line that moved to 7 has its own record (that of old line 2 stays)
    assert sorted(r["error"]["line"] for r in errors if r["custom_id"] is None) == [2, 7]


# ---------------------------------------------------------------- the unexpected


@pytest.mark.slow
def test_an_unexpected_error_is_named_and_json_logs_stay_json(tmp_path):
    model = tmp_path / "damaged-model"
    model.mkdir()
    root = Path(__file__).resolve().parents[1]
    shutil.copy(root / "engine/models/presets/tiny-llama.json", model / "config.json")
    (model / "model.safetensors").write_bytes(b"these bytes are not a safetensors file")
    src = write_jsonl(tmp_path / "in.jsonl", rows(1))
    res = gen(src, "--model", model, "--log-format", "json", "--debug")
    events = [json.loads(line) for line in res.stderr.splitlines()]  # every line JSON
    assert res.returncode == 1 and events[-1]["event"] == "error", res.stderr
    assert events[-1]["exit_code"] == 1 and "unexpected" in events[-1]["message"]
    assert any(e["event"] == "traceback" and "Traceback" in e["traceback"] for e in events)


def test_enospc_and_other_errors_are_told_apart():
    job = GenerateJob(
        JobSettings(input=Path("in.jsonl")), force=False, quiet=True, log_format="text"
    )
    full = job._output_failed(OSError(errno.ENOSPC, "No space left on device", "o.jsonl"))
    assert full.code == EXIT_TEMPFAIL and "the disk is full" in str(full)
    assert job._output_failed(OSError(errno.EACCES, "Permission denied", "o")).code == EXIT_USAGE
    job.stop.graceful = True  # once records are being written
    assert job._output_failed(OSError(errno.EIO, "Input/output error", "o")).code == 74

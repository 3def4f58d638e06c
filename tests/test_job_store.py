"""Result store, lock and manifest of a batch job, on real files and real (killed) processes."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pagedctl.generate import store as store_mod
from pagedctl.generate.records import error_record
from pagedctl.generate.runctl import (
    JobLock,
    LockHeld,
    ManifestMismatch,
    check_manifest,
    input_sha256,
    lock_path,
    manifest_path,
)
from pagedctl.generate.store import (
    CorruptResults,
    NotResults,
    OutputError,
    ResultStore,
    repair_tail,
)

ROOT = Path(__file__).resolve().parents[1]


def rec(cid: str | None, text: str = "hi") -> dict:
    body = {"object": "chat.completion", "choices": [{"text": text}]}
    return {"id": f"b_{cid}", "custom_id": cid, "response": {"body": body}, "error": None}


def read_jsonl(path: Path) -> list[dict]:
    """Every line complete and valid JSON, or fail."""
    data = path.read_bytes()
    assert data == b"" or data.endswith(b"\n"), f"{path} ends in a half line"
    return [json.loads(line) for line in data.splitlines()]


def make_store(tmp_path: Path, **kw: float) -> ResultStore:
    return ResultStore(tmp_path / "out.jsonl", tmp_path / "errors.jsonl", **kw)


def run_py(code: str, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-c", textwrap.dedent(code), *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


# ---------------------------------------------------------------- append, resume, repair


def test_append_and_reopen(tmp_path: Path) -> None:
    with make_store(tmp_path) as s:
        assert (s.done, s.num_ok_before, s.num_errors_before) == (set(), 0, 0)
        for cid in ("a", "b", "c"):
            s.write(rec(cid), ok=True)
        s.write(error_record("d", "prompt_too_long", "too long", 5), ok=False)
        s.write(error_record(None, "invalid_json", "not JSON", 7), ok=False)
        assert (s.num_ok, s.num_errors) == (3, 2)
        assert s.done == {"a", "b", "c", "d"}
    s = make_store(tmp_path)
    s.open()
    assert s.done == {"a", "b", "c", "d"}
    assert s.done_anonymous == {(7, "invalid_json")}
    assert s.has_error_record(5, "d", "prompt_too_long") and s.has_error_record(
        7, None, "invalid_json"
    )
    assert not s.has_error_record(5, None, "invalid_json")  # line 5's record is d's, by its id
    assert (s.num_ok_before, s.num_errors_before, s.num_ok, s.num_errors) == (3, 2, 0, 0)
    s.write(rec("e"), ok=True)
    with pytest.raises(ValueError, match="custom_id must be a string"):
        s.write(rec(None), ok=True)  # would make out.jsonl unreadable on the next open
    with pytest.raises(ValueError, match="custom_id must be a string"):
        s.write(error_record(7, "c", "m", 1), ok=False)
    with pytest.raises(RuntimeError, match="twice"):
        s.open()
    s.close()
    s.close()  # twice is fine
    with pytest.raises(RuntimeError, match="before open"):
        s.write(rec("f"), ok=True)
    assert [r["custom_id"] for r in read_jsonl(tmp_path / "out.jsonl")] == ["a", "b", "c", "e"]
    assert [r["custom_id"] for r in read_jsonl(tmp_path / "errors.jsonl")] == ["d", None]


def test_torn_tail_is_cut_and_kept(tmp_path: Path) -> None:
    out, err = tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
    good = b"".join(json.dumps(rec(c)).encode() + b"\n" for c in "abc")
    half_out, half_err = b'{"id":"b_x","custom_id":"x","resp', b'{"id":"e","custom_id"'
    out.write_bytes(good + half_out)
    err.write_bytes(half_err)  # a file that is one half line
    with make_store(tmp_path) as s:
        assert s.done == {"a", "b", "c"} and s.torn_bytes == len(half_out) + len(half_err)
        s.write(rec("x"), ok=True)
        s.write(error_record("y", "c", "m", 1), ok=False)
    assert out.read_bytes().startswith(good)
    assert [r["custom_id"] for r in read_jsonl(out)] == ["a", "b", "c", "x"]
    assert [r["custom_id"] for r in read_jsonl(err)] == ["y"]
    assert (tmp_path / "out.jsonl.torn").read_bytes() == half_out + b"\n"
    assert (tmp_path / "errors.jsonl.torn").read_bytes() == half_err + b"\n"
    with open(out, "ab") as f:  # a second tear is appended to the same .torn file
        f.write(b"\x00\x00")
    assert repair_tail(out) == 2 and repair_tail(out) == 0
    assert (tmp_path / "out.jsonl.torn").read_bytes().endswith(b'"resp\n\x00\x00\n')
    assert repair_tail(tmp_path / "absent.jsonl") == 0


def test_long_torn_tail(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    out.write_bytes(b'{"custom_id":"a"}\n' + b"z" * 200_000)  # longer than one backward read
    assert repair_tail(out) == 200_000
    assert out.read_bytes() == b'{"custom_id":"a"}\n'


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (b'{"custom_id":"a"}\n{"custom_id": oops}\n{"custom_id":"c"}\n', "line 2, is not valid"),
        (b'{"custom_id":"a"}\n\n[1, 2]\n', "line 3, is not a batch result record"),
    ],
)
def test_bad_line_in_the_middle_fails_clearly(tmp_path: Path, content: bytes, match: str) -> None:
    (tmp_path / "out.jsonl").write_bytes(content)
    with pytest.raises(CorruptResults, match=match) as e:
        make_store(tmp_path).open()
    assert str(tmp_path / "out.jsonl") in str(e.value)


NOT_OURS = [
    b"shopping list\n\nmilk\nlast line, no newline",
    b"one line, no newline",
    b'\n\n{"custom_id": "a"}, not quite\n{"id":"batch_req_x","custom_id":"b"}\n{"id":"b',
]


@pytest.mark.parametrize(
    ("which", "content"),
    [
        ("out.jsonl", b'{"custom_id":null}\n'),  # a null id is only for the errors file
        *[(which, c) for which in ("out.jsonl", "errors.jsonl") for c in NOT_OURS],
    ],
)
def test_a_file_that_is_not_ours_is_refused_untouched(
    tmp_path: Path, content: bytes, which: str
) -> None:
    """Both files are read before either is repaired: the other file's torn tail stays too."""
    other = "errors.jsonl" if which == "out.jsonl" else "out.jsonl"
    (tmp_path / which).write_bytes(content)
    torn_other = json.dumps(rec("a")).encode() + b"\n" + b'{"id":"batch_req_'
    (tmp_path / other).write_bytes(torn_other)
    for check in ("check_ours", "open"):
        with pytest.raises(NotResults, match="is not a results file") as e:
            getattr(make_store(tmp_path), check)()
        assert e.value.path == tmp_path / which
    assert (tmp_path / which).read_bytes() == content
    assert (tmp_path / other).read_bytes() == torn_other
    assert sorted(p.name for p in tmp_path.iterdir()) == ["errors.jsonl", "out.jsonl"]


def test_a_damaged_file_is_refused_before_any_repair(tmp_path: Path) -> None:
    good = json.dumps(rec("a")).encode() + b"\n"
    content = good + b"edited\n" + good + b'{"id":"batch_req_'
    (tmp_path / "out.jsonl").write_bytes(content)
    with pytest.raises(CorruptResults, match="line 2, is not valid JSON") as e:
        make_store(tmp_path).open()
    assert not isinstance(e.value, NotResults)
    assert (tmp_path / "out.jsonl").read_bytes() == content
    assert not (tmp_path / "out.jsonl.torn").exists()


def test_zeros_after_a_power_loss_are_a_torn_tail(tmp_path: Path) -> None:
    (tmp_path / "errors.jsonl").write_bytes(b"\x00" * 4096)
    with make_store(tmp_path) as s:
        assert s.torn_bytes == 4096
    assert (tmp_path / "errors.jsonl").read_bytes() == b""


def test_error_records_match_lines_by_id_then_by_line(tmp_path: Path) -> None:
    """How a bad line of a rerun (an edited input, --force) finds its earlier record."""
    dup = "duplicate_custom_id"
    with make_store(tmp_path) as s:
        s.write(rec("a"), ok=True)
        s.write(error_record("b", "invalid_field", "m", 3), ok=False)
        s.write(error_record("a", dup, "m", 4), ok=False)  # a duplicate carries its own id
        s.write(error_record(None, dup, "m", 6), ok=False)  # as older runs wrote duplicates
        s.write(error_record(None, "invalid_json", "m", 2), ok=False)
        assert s.done == {"a", "b"}
    s = make_store(tmp_path)
    s.open()
    assert s.has_error_record(9, "b", "invalid_field")  # b's line moved from 3 to 9
    assert not s.has_error_record(3, "c", "invalid_field")  # a new bad line where b's was
    assert s.has_error_record(5, "a", dup)  # the duplicate moved from 4 to 5
    assert not s.has_error_record(8, "a", dup)  # a second duplicate: one record covers one line
    assert s.has_error_record(6, "a", dup)  # the old record without an id, by its line
    assert s.has_error_record(2, None, "invalid_json")
    assert not s.has_error_record(2, None, "missing_custom_id")  # another bad line now
    assert not s.has_error_record(7, None, "invalid_json")
    s.write(error_record("x", dup, "m", 10), ok=False)  # this run's own records count for none
    assert not s.has_error_record(11, "x", dup)
    s.close()


def test_write_errors_name_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s = make_store(tmp_path)
    s.open()

    def fail(fd: int, data: bytes) -> int:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(store_mod.os, "write", fail)
    with pytest.raises(OutputError) as e:
        s.write(error_record(None, "c", "m", 1), ok=False)
    assert e.value.errno == errno.EIO and e.value.filename == str(tmp_path / "errors.jsonl")
    monkeypatch.undo()
    s.close()
    (tmp_path / "folder").mkdir()
    with pytest.raises(OutputError, match="folder"):
        ResultStore(tmp_path / "folder", tmp_path / "e.jsonl").open()


def test_failed_write_leaves_no_half_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s = make_store(tmp_path)
    s.open()
    s.write(rec("a"), ok=True)
    real_write = os.write

    def half_then_full(fd: int, data: bytes) -> int:
        real_write(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store_mod.os, "write", half_then_full)
    with pytest.raises(OSError, match="No space"):
        s.write(rec("b", "x" * 1000), ok=True)
    monkeypatch.setattr(store_mod.os, "write", real_write)
    s.write(rec("c"), ok=True)
    s.close()
    assert [r["custom_id"] for r in read_jsonl(tmp_path / "out.jsonl")] == ["a", "c"]


def test_fsync_grouping(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[str] = []
    clock = [100.0]
    monkeypatch.setattr(store_mod.os, "fsync", lambda fd: synced.append(_fd_name(fd)))
    monkeypatch.setattr(store_mod, "_now", lambda: clock[0])
    s = make_store(tmp_path, fsync_every=3, fsync_interval_s=10.0)
    s.open()
    assert synced == [tmp_path.name, tmp_path.name]  # both files created: their directory
    synced.clear()
    s.write(rec("a"), ok=True)
    s.write(rec("b"), ok=True)
    assert synced == []
    s.write(error_record("c", "x", "m", 3), ok=False)  # third record: both dirty files
    assert synced == ["out.jsonl", "errors.jsonl"]
    s.write(rec("d"), ok=True)
    clock[0] += 9.9
    s.write(rec("e"), ok=True)
    assert synced == ["out.jsonl", "errors.jsonl"]
    clock[0] += 0.1  # interval reached with 3 pending, only out.jsonl dirty
    s.write(rec("f"), ok=True)
    assert synced[2:] == ["out.jsonl"]
    s.write(rec("g"), ok=True)
    s.sync()
    assert synced[3:] == ["out.jsonl"]
    s.sync()  # nothing dirty
    assert len(synced) == 4
    s.close()
    assert synced[4:] == ["out.jsonl", "errors.jsonl", tmp_path.name]


def _fd_name(fd: int) -> str:
    return Path(os.readlink(f"/proc/self/fd/{fd}")).name


WRITER = """
    import sys
    from pathlib import Path
    from pagedctl.generate.records import error_record
    from pagedctl.generate.store import ResultStore

    d, n = Path(sys.argv[1]), int(sys.argv[2])
    s = ResultStore(d / "out.jsonl", d / "errors.jsonl", fsync_every=8)
    s.open()
    for i in range(n):
        cid = f"r{i}"
        if cid in s.done:
            continue
        pad = "é" * (i * 7919 % (60_000 if i % 10 == 0 else 300))  # some lines of many pages
        if i % 5 == 4:
            s.write(error_record(cid, "bad", pad, i + 1), ok=False)
        else:
            s.write({"id": f"b{i}", "custom_id": cid, "response": {"t": pad}, "error": None}, True)
    s.close()
    print("done", flush=True)
"""


def _kill_at(proc: subprocess.Popen, paths: tuple[Path, ...], target: int) -> None:
    """SIGKILL `proc` as soon as the files hold `target` bytes (or it ends)."""
    deadline = time.monotonic() + 20
    while proc.poll() is None and time.monotonic() < deadline:
        if sum(p.stat().st_size for p in paths if p.exists()) >= target:
            break
        time.sleep(0.0005)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()


def test_sigkill_at_random_moments_then_resume(tmp_path: Path) -> None:
    n, rng, paths = 3000, random.Random(1234), make_store(tmp_path).paths
    for round_ in range(9):
        size = sum(p.stat().st_size for p in paths if p.exists())
        proc = run_py(WRITER, str(tmp_path), str(n))
        if round_ % 3 == 2:  # early: during start-up, open and repair
            time.sleep(rng.uniform(0.0, 0.1))
            _kill_at(proc, paths, 0)
        else:  # mid-run, a random number of bytes later
            _kill_at(proc, paths, size + rng.randrange(1 << 20))
        s = make_store(tmp_path)
        s.open()  # repairs
        s.close()
        ids = [r["custom_id"] for p in paths if p.exists() for r in read_jsonl(p)]
        assert len(ids) == len(set(ids)) == len(s.done) < n
    proc = run_py(WRITER, str(tmp_path), str(n))
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0 and stdout == "done\n", stderr
    ok = [r["custom_id"] for r in read_jsonl(tmp_path / "out.jsonl")]
    errors = [r["custom_id"] for r in read_jsonl(tmp_path / "errors.jsonl")]
    assert sorted(ok + errors) == sorted(f"r{i}" for i in range(n))
    assert len(errors) == n // 5 and all(int(c[1:]) % 5 == 4 for c in errors)


# ---------------------------------------------------------------- lock

LOCKER = """
    import sys, time
    from pathlib import Path
    from pagedctl.generate.runctl import JobLock, LockHeld

    try:
        lock = JobLock(Path(sys.argv[1]))
        lock.acquire()
    except LockHeld as e:
        print(e, flush=True)
        sys.exit(75)
    print("locked", flush=True)
    if sys.argv[2] == "hold":
        time.sleep(60)
"""


def test_lock_in_another_process(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    holder = run_py(LOCKER, str(out), "hold")
    try:
        assert holder.stdout.readline() == "locked\n"
        assert lock_path(out).read_text() == f"{holder.pid}\n"
        t0 = time.monotonic()
        second = run_py(LOCKER, str(out), "try")
        stdout, _ = second.communicate(timeout=30)
        assert second.returncode == 75 and time.monotonic() - t0 < 10
        assert str(lock_path(out)) in stdout and f"pid {holder.pid}" in stdout
        with pytest.raises(LockHeld, match="locked"):
            JobLock(out).acquire()  # a second open file in this process conflicts too
    finally:
        holder.kill()
        holder.communicate()
    third = run_py(LOCKER, str(out), "try")
    assert third.communicate(timeout=30)[0] == "locked\n" and third.returncode == 0
    with JobLock(out):
        assert lock_path(out).read_text() == f"{os.getpid()}\n"
    assert not lock_path(out).exists()  # released: the run removed its lock file


CONTENDER = """
    import os, sys, time
    from pathlib import Path
    from pagedctl.generate.runctl import JobLock, LockHeld

    out, inside = Path(sys.argv[1]), Path(sys.argv[2])
    held = 0
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        try:
            with JobLock(out):
                fd = os.open(inside, os.O_CREAT | os.O_EXCL | os.O_WRONLY)  # fails if shared
                held += 1
                os.close(fd)
                os.unlink(inside)
        except LockHeld:
            pass
    print(held, flush=True)
"""


def test_a_removed_lock_file_never_lets_two_runs_in(tmp_path: Path) -> None:
    """Runs that take and release (remove) the lock as fast as they can: at no moment do two
    hold it, as a file created exclusively inside the lock shows."""
    out, inside = tmp_path / "out.jsonl", tmp_path / "inside"
    procs = [run_py(CONTENDER, str(out), str(inside)) for _ in range(4)]
    results = [p.communicate(timeout=60) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in results]
    assert sum(int(stdout) for stdout, _ in results) > 20


# ---------------------------------------------------------------- manifest


def _settings(**over: object) -> dict:
    base = {
        "input_sha256": "ab" * 32,
        "model": "smollm2",
        "engine": {"block_size": 16, "dtype": "float32", "prefix_caching": True},
        "pagedctl_version": "0.1.0",
        "stop": ("\n\n",),
    }
    return {**base, **over}


def test_manifest_write_and_match(tmp_path: Path) -> None:
    path = manifest_path(tmp_path / "out.jsonl")
    assert path.name == "out.jsonl.manifest.json"
    check_manifest(path, _settings(), force=False)
    first = json.loads(path.read_text())
    assert first["engine"]["block_size"] == 16 and first["stop"] == ["\n\n"]
    assert first["created"] == first["updated"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # no temp file left
    path.write_text(json.dumps({**first, "created": "2000-01-01T00:00:00Z", "updated": "x"}))
    check_manifest(path, _settings(), force=False)  # tuples vs lists: equal
    again = json.loads(path.read_text())
    assert again["created"] == "2000-01-01T00:00:00Z" and again["updated"] not in ("x", None)


def test_manifest_mismatch_lists_keys(tmp_path: Path) -> None:
    path = manifest_path(tmp_path / "out.jsonl")
    check_manifest(path, _settings(), force=False)
    before = path.read_text()
    engine = {"block_size": 32, "dtype": "float32", "prefix_caching": 1}
    new = _settings(model="qwen", engine=engine, seed=0)
    with pytest.raises(ManifestMismatch) as e:
        check_manifest(path, new, force=False)
    msg = str(e.value)
    assert 'model: recorded "smollm2", now "qwen"' in msg
    assert "engine.block_size: recorded 16, now 32" in msg
    assert "engine.prefix_caching: recorded true, now 1" in msg
    assert "seed: recorded (absent), now 0" in msg
    assert "input_sha256" not in msg and "dtype" not in msg and "--force" in msg
    assert str(path) in msg
    assert path.read_text() == before


def test_manifest_force_rewrites_with_forced_from(tmp_path: Path) -> None:
    path = manifest_path(tmp_path / "out.jsonl")
    check_manifest(path, _settings(), force=False)
    old = json.loads(path.read_text())
    check_manifest(path, _settings(model="qwen"), force=True)
    now = json.loads(path.read_text())
    assert now["model"] == "qwen" and now["created"] == old["created"]
    assert now["forced_from"] == old
    check_manifest(path, _settings(model="qwen"), force=False)  # new settings now match
    assert json.loads(path.read_text())["forced_from"] == old
    with pytest.raises(ManifestMismatch, match="model"):
        check_manifest(path, _settings(), force=False)


def test_unreadable_manifest(tmp_path: Path) -> None:
    path = manifest_path(tmp_path / "out.jsonl")
    path.write_text("{half")
    with pytest.raises(ManifestMismatch, match=r"cannot read the run manifest.*--force"):
        check_manifest(path, _settings(), force=False)
    check_manifest(path, _settings(), force=True)
    assert json.loads(path.read_text())["forced_from"] == {}


def test_input_sha256_streams(tmp_path: Path) -> None:
    data = random.Random(0).randbytes(3 * (1 << 20) + 17)
    (tmp_path / "in.jsonl").write_bytes(data)
    assert input_sha256(tmp_path / "in.jsonl") == hashlib.sha256(data).hexdigest()

"""Run control of a batch job: the run manifest, which a resume must match, and the run lock.

Both live next to the output: `<out>.manifest.json` records the settings that decide what a run
writes, so that a resume with other settings is refused (or, with --force, recorded); `<out>.lock`
is held by the one run that may write the output.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pagedctl.generate.store import OutputError, fsync_dir

# Manifest keys that are not compared on resume: bookkeeping ("date" is the day the job's first run
# started, which a `{date}` output path was made from; "complete" is set once every line has its
# record), and "capacity" (settings that change how fast a job runs, not what it writes: batch
# sizes, pool size, block size, device).
_RESERVED = ("created", "updated", "forced_from", "capacity", "date", "complete", "records")
_ABSENT = "(absent)"


class LockHeld(RuntimeError):
    """Another run holds the output's lock (exit code 75: retry later)."""


class ManifestMismatch(ValueError):
    """The output was started with different settings than this run's."""


def lock_path(out_path: Path) -> Path:
    """`<out>.lock`, the file `JobLock` locks."""
    return out_path.with_name(out_path.name + ".lock")


def manifest_path(out_path: Path) -> Path:
    """`<out>.manifest.json`, the run manifest next to the output."""
    return out_path.with_name(out_path.name + ".manifest.json")


class JobLock:
    """An exclusive, non-blocking `flock` on `<out>.lock`, held for the life of a run.

    The kernel drops the lock when the process dies, so a crashed run never leaves a stale lock;
    a run that ends removes the file while it still holds the lock. A run that finds the file
    it locked already removed (its holder ended between the open and the lock) opens it again,
    so two runs can never hold locks on two files of one name.
    """

    def __init__(self, out_path: Path) -> None:
        self.path = lock_path(Path(out_path))
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock and record this pid in it; raise LockHeld at once if it is taken."""
        if self._fd is not None:
            return
        while True:
            fd = self._open_locked()
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # unlinked by the run that held it: lock the file of that name now
        self._fd = fd
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as e:
            self.release()
            raise OutputError(e.errno, e.strerror or str(e), str(self.path)) from None

    def _open_locked(self) -> int:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise OutputError(e.errno, e.strerror or str(e), str(self.path)) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            os.close(fd)
            holder = f" (pid {pid})" if pid.isdigit() else ""
            raise LockHeld(
                f"another run is writing this output: {self.path} is locked{holder}. Wait for it "
                "to finish or stop it, then rerun; a lock dies with its process."
            ) from None
        except BaseException:
            os.close(fd)
            raise
        return fd

    def release(self) -> None:
        """Remove the lock file, then drop the lock (in that order: see the class)."""
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> JobLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def input_sha256(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _diff(old: dict, new: dict) -> list[tuple[str, str, str]]:
    """(key, recorded, now) for each differing setting; nested keys dotted, values as JSON."""
    a, b = _flatten(old), _flatten(new)

    def show(d: dict, k: str) -> str:
        return json.dumps(d[k], ensure_ascii=False) if k in d else _ABSENT

    rows = [(k, show(a, k), show(b, k)) for k in sorted(a.keys() | b.keys())]
    return [row for row in rows if row[1] != row[2]]


def _settings(manifest: dict) -> dict:
    return {k: v for k, v in manifest.items() if k not in _RESERVED}


def write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except OSError as e:
        raise OutputError(e.errno, e.strerror or str(e), str(path)) from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def _read_manifest(path: Path, force: bool) -> dict:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise OutputError(e.errno, e.strerror or str(e), str(path)) from None
    try:
        old = json.loads(text)
        if not isinstance(old, dict):
            raise ValueError("not a JSON object")
        return old
    except ValueError as e:
        if force:
            return {}
        raise ManifestMismatch(
            f"cannot read the run manifest {path} ({e}); pass --force to replace it, or write "
            "to a new output path"
        ) from None


def read_manifest(path: Path) -> dict | None:
    """The manifest at `path` as recorded, or None when there is none or it cannot be read."""
    try:
        old = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return old if isinstance(old, dict) else None


def precheck_manifest(path: Path, known: dict, force: bool) -> None:
    """Before the model loads: ManifestMismatch if a recorded setting among `known` (those a run
    knows without its engine: the input, the sampling defaults, the seed, the version) differs.
    The whole manifest is checked once the engine is up (`check_manifest`)."""
    if force or not path.exists():
        return
    old = _settings(_read_manifest(path, force))
    new = _settings(json.loads(json.dumps(known)))
    diffs = [row for row in _diff(old, new) if row[0].split(".")[0] in new]
    if diffs:
        raise ManifestMismatch(_mismatch_message(path, diffs))


def _mismatch_message(path: Path, diffs: list[tuple[str, str, str]]) -> str:
    lines = "\n".join(f"  {k}: recorded {a}, now {b}" for k, a, b in diffs)
    return (
        f"this output was started with different settings ({path}):\n{lines}\n"
        "Rerun with the recorded settings to resume, write to a new output path, or pass "
        "--force to resume with the new settings."
    )


def mark_complete(path: Path, records: int) -> None:
    """Record in the manifest that every line of the input has its record, `records` in all."""
    old = read_manifest(path)
    if old is not None and (old.get("complete"), old.get("records")) != (True, records):
        write_json_atomic(path, {**old, "complete": True, "records": records})


def is_complete(manifest: dict | None, records: int) -> bool:
    """Whether a manifest says its job is done and its files still hold every record (one
    taken out, to be run again, makes the job incomplete)."""
    return bool(manifest and manifest.get("complete") and manifest.get("records") == records)


def check_manifest(path: Path, manifest: dict, force: bool, date: str | None = None) -> None:
    """Record this run's settings at `path`, or check them against the recorded ones.

    Absent: write it (with `date`, the day the job started). Equal on every setting: refresh
    "updated". Different: ManifestMismatch listing each key, unless `force`, which rewrites it
    with the old values under "forced_from".
    """
    stamp = datetime.now(timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")
    new = _settings(json.loads(json.dumps(manifest)))  # as it will read back from JSON
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        first = {"date": date} if date is not None else {}
        write_json_atomic(path, {**new, **first, "created": stamp, "updated": stamp})
        return
    old = _read_manifest(path, force)
    diffs = _diff(_settings(old), new)
    if not diffs:
        write_json_atomic(path, {**old, "updated": stamp})
        return
    if not force:
        raise ManifestMismatch(_mismatch_message(path, diffs))
    forced_from = {k: v for k, v in old.items() if k != "forced_from"}
    kept = {k: old[k] for k in ("date",) if k in old}
    created = old.get("created", stamp)
    write_json_atomic(
        path, {**new, **kept, "created": created, "updated": stamp, "forced_from": forced_from}
    )

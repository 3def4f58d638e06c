"""Durable results of a batch job: append-only out/errors files, torn-tail repair and resume.

Each record is one `write()` of a whole line on an `O_APPEND` descriptor, so a killed process loses
nothing it wrote; `fsync` runs in groups, so a power loss loses at most one group. A torn last line
(power loss, a disk that filled up) is cut off on the next `open()` and kept in `<file>.torn`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from pagedctl.generate.records import dumps

_now = time.monotonic  # the store's clock; tests replace it


class CorruptResults(ValueError):
    """A line in the middle of a result file is not a JSON record (edited or damaged by hand)."""


def fsync_dir(path: Path) -> None:
    """fsync a directory, so that the files created or renamed in it survive a power loss."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _complete_size(f: BinaryIO, size: int) -> int:
    """Byte length of the file up to and including its last newline."""
    pos = size
    while pos > 0:
        start = max(0, pos - (1 << 16))
        f.seek(start)
        i = f.read(pos - start).rfind(b"\n")
        if i >= 0:
            return start + i + 1
        pos = start
    return 0


def repair_tail(path: Path) -> int:
    """Cut a torn last line off `path`, appending the cut bytes (and a newline) to `<path>.torn`.

    Returns the number of bytes cut; 0 when the file is absent or ends with a newline.
    """
    if not path.exists():
        return 0
    with open(path, "r+b") as f:
        size = f.seek(0, os.SEEK_END)
        keep = _complete_size(f, size)
        if keep == size:
            return 0
        with open(path.with_name(path.name + ".torn"), "ab") as torn:
            f.seek(keep)
            shutil.copyfileobj(f, torn)
            torn.write(b"\n")
            torn.flush()
            os.fsync(torn.fileno())
        f.truncate(keep)
        f.flush()
        os.fsync(f.fileno())
    return size - keep


def _records(path: Path, allow_null_id: bool) -> Iterator[dict]:
    """Stream the records of a result file, failing loudly on a line that is not one."""
    if not path.exists():
        return
    with open(path, "rb") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError as e:
                raise CorruptResults(
                    f"{path}, line {line_no}, is not valid JSON ({e}); the file was edited or "
                    "damaged: fix or delete that line, then rerun"
                ) from None
            cid = rec.get("custom_id", 0) if isinstance(rec, dict) else 0
            if not (isinstance(cid, str) or (cid is None and allow_null_id)):
                raise CorruptResults(
                    f"{path}, line {line_no}, is not a batch result record (no string custom_id); "
                    "is this the right output file?"
                )
            yield rec


class ResultStore:
    """The out.jsonl / errors.jsonl pair of one job: resumable, append-only, crash-safe."""

    def __init__(
        self,
        out_path: Path,
        errors_path: Path,
        *,
        fsync_every: int = 64,
        fsync_interval_s: float = 2.0,
    ) -> None:
        if fsync_every < 1:
            raise ValueError(f"fsync_every must be at least 1, got {fsync_every}")
        if Path(out_path).resolve() == Path(errors_path).resolve():
            raise ValueError(f"the output and error files must differ, both are {out_path}")
        self.paths = (Path(out_path), Path(errors_path))
        self.fsync_every = fsync_every
        self.fsync_interval_s = fsync_interval_s
        self.done: set[str] = set()  # custom_ids present in either file
        self.done_error_lines: set[int] = set()  # input line numbers of the error records
        self.num_ok_before = self.num_errors_before = 0
        self.num_ok = self.num_errors = 0  # written by this run
        self.torn_bytes = 0  # cut off torn last lines by open()
        self._fds: list[int] = []
        self._sizes: list[int] = []
        self._dirty = [False, False]
        self._pending = 0
        self._last_sync = 0.0

    def open(self) -> None:
        """Repair torn tails, collect what is already done, and open both files for appending."""
        if self._fds:
            raise RuntimeError("ResultStore.open called twice")
        for path in self.paths:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.torn_bytes += repair_tail(path)
        self.num_ok_before = self._scan(self.paths[0], allow_null_id=False)
        self.num_errors_before = self._scan(self.paths[1], allow_null_id=True)
        for path in self.paths:
            created = not path.exists()
            flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
            fd = os.open(path, flags, 0o644)
            self._fds.append(fd)
            self._sizes.append(os.fstat(fd).st_size)
            if created:
                fsync_dir(path.parent)
        self._last_sync = _now()

    def _scan(self, path: Path, allow_null_id: bool) -> int:
        n = 0
        for rec in _records(path, allow_null_id):
            self._note(rec)
            n += 1
        return n

    def _note(self, rec: dict) -> None:
        error = rec.get("error")
        duplicate = isinstance(error, dict) and error.get("code") == "duplicate_custom_id"
        if rec.get("custom_id") is not None and not duplicate:  # a repeat does not finish the id
            self.done.add(rec["custom_id"])
        if isinstance(error, dict) and isinstance(error.get("line"), int):
            self.done_error_lines.add(error["line"])

    def write(self, record: dict, ok: bool) -> None:
        """Append one record to out (ok) or errors; the kernel has it when this returns."""
        if not self._fds:
            raise RuntimeError("ResultStore.write before open() or after close()")
        cid = record.get("custom_id")
        if not (isinstance(cid, str) or (cid is None and not ok)):
            raise ValueError(f"custom_id must be a string (null only for errors), got {cid!r}")
        i = 0 if ok else 1
        data = memoryview(dumps(record).encode("utf-8"))
        try:
            written = 0
            while written < len(data):  # one write() unless the disk fills up or a signal hits
                written += os.write(self._fds[i], data[written:])
        except BaseException:
            with contextlib.suppress(OSError):  # leave no half line for the records after it
                os.ftruncate(self._fds[i], self._sizes[i])
            raise
        self._sizes[i] += len(data)
        self._note(record)
        self.num_ok += ok
        self.num_errors += not ok
        self._dirty[i] = True
        self._pending += 1
        if self._pending >= self.fsync_every or _now() - self._last_sync >= self.fsync_interval_s:
            self.sync()

    def sync(self) -> None:
        """fsync the files written since the last sync (for power loss; a kill loses nothing)."""
        for i, fd in enumerate(self._fds):
            if self._dirty[i]:
                os.fsync(fd)
                self._dirty[i] = False
        self._pending = 0
        self._last_sync = _now()

    def close(self) -> None:
        """fsync and close both files, then fsync their directory. Safe to call twice."""
        if not self._fds:
            return
        try:
            for fd in self._fds:
                os.fsync(fd)
        finally:
            for fd in self._fds:
                os.close(fd)
            self._fds = []
        for d in dict.fromkeys(p.parent for p in self.paths):
            fsync_dir(d)

    def __enter__(self) -> ResultStore:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

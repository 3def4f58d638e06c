"""Durable results of a batch job: append-only out/errors files, torn-tail repair and resume.

Each record is one `write()` of a whole line on an `O_APPEND` descriptor, so a killed process loses
nothing it wrote; `fsync` runs in groups, so a power loss loses at most one group. A torn last line
(power loss, a disk that filled up) is cut off on the next `open()` and kept in `<file>.torn`, but
only once every complete line of the file has been read as a record: a file that is not a results
file is refused as it is, never cut.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from collections import Counter
from pathlib import Path
from typing import BinaryIO

from pagedctl.generate.records import dumps

_now = time.monotonic  # the store's clock; tests replace it


DUPLICATE = "duplicate_custom_id"  # the error code of a line that repeats an earlier line's id
_RECORD_START = b'{"id":"'  # how every line this store writes begins (records.dumps)


class CorruptResults(ValueError):
    """A line in the middle of a result file is not a JSON record (edited or damaged by hand)."""

    def __init__(self, message: str, path: Path | None = None) -> None:
        super().__init__(message)
        self.path = path


class NotResults(CorruptResults):
    """The file holds no batch result record at all: another file was named as an output. It is
    refused before anything in it is changed."""


class OutputError(OSError):
    """An output file could not be written (or read back); `filename` names it."""


def _output_error(e: OSError, path: Path) -> OutputError:
    return OutputError(e.errno, e.strerror or str(e), str(path))


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


def _looks_torn(tail: bytes) -> bool:
    """Whether a last line without a newline can be the start of a record of ours (or the zeros a
    power loss leaves past the end of what reached the disk)."""
    if not tail.strip(b"\x00"):
        return True
    return tail.startswith(_RECORD_START) or _RECORD_START.startswith(tail)


def _scan_records(
    path: Path, allow_null_id: bool, note, first_only: bool = False
) -> tuple[int, int]:
    """Read every complete line of `path` as a record (`note` sees each) before anything in the
    file is changed; returns (records, bytes of a torn last line that is ours to cut).

    A file whose first record is not one is NotResults; a bad line after a good one is
    CorruptResults. The file itself is only read; `first_only` stops after the first record.
    """
    if not path.exists():
        return 0, 0
    n = 0
    with open(path, "rb") as f:
        for line_no, line in enumerate(f, 1):
            torn = not line.endswith(b"\n")
            if torn and (n > 0 or _looks_torn(line)):
                return n, len(line)
            if not line.strip() and not torn:
                continue
            rec, why = (None, "is cut off") if torn else _parse_record(line, allow_null_id)
            if why is not None and n == 0:
                raise NotResults(
                    f"{path} is not a results file: its line {line_no} is not a batch result "
                    "record; it was left as it is",
                    path,
                )
            if why is not None:
                raise CorruptResults(
                    f"{path}, line {line_no}, {why}; the file was edited or damaged: fix or "
                    "delete that line, then rerun",
                    path,
                )
            note(rec)
            n += 1
            if first_only:
                break
    return n, 0


def _parse_record(line: bytes, allow_null_id: bool) -> tuple[dict | None, str | None]:
    """(the record, None), or (None, why the complete line is not one)."""
    try:
        rec = json.loads(line)
    except ValueError as e:
        return None, f"is not valid JSON ({e})"
    cid = rec.get("custom_id", 0) if isinstance(rec, dict) else 0
    if not (isinstance(cid, str) or (cid is None and allow_null_id)):
        return None, "is not a batch result record (no string custom_id)"
    return rec, None


class ResultStore:
    """The out.jsonl / errors.jsonl pair of one job: resumable, append-only, crash-safe.

    `scan()` reads both files (and cuts a torn tail) without creating anything; `open()` scans if
    that was not done, then opens both files for appending. An OSError on either file is an
    OutputError naming it.
    """

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
        self.done: set[str] = set()  # custom_ids with a record (a duplicate's record aside)
        # What the error records of earlier runs cover, for the lines that `done` cannot match:
        # per custom_id, how many duplicate_custom_id records it has; and (line, code) of the
        # records without a custom_id (a line with no readable id, or an older duplicate's).
        self.done_duplicates: Counter[str] = Counter()
        self.done_anonymous: set[tuple[int, str]] = set()
        self.num_ok_before = self.num_errors_before = 0
        self.num_ok = self.num_errors = 0  # written by this run
        self.torn_bytes = 0  # cut off torn last lines by open()
        self._scanned = False
        self._fds: list[int] = []
        self._sizes: list[int] = []
        self._dirty = [False, False]
        self._pending = 0
        self._last_sync = 0.0

    def check_ours(self) -> None:
        """NotResults if either file exists and does not start as a results file: cheap (the
        first record only), and it creates and changes nothing, so it may run before the lock."""
        for i, path in enumerate(self.paths):
            try:
                _scan_records(path, i == 1, lambda rec: None, first_only=True)
            except OSError as e:
                raise _output_error(e, path) from None

    def scan(self) -> None:
        """Collect what is already done, then cut torn tails: both files are read whole first,
        so a file that is not a results file is refused before either file is touched."""
        if self._scanned:
            return
        torn = []
        for i, path in enumerate(self.paths):
            try:
                n, tail = _scan_records(path, i == 1, self._note_before)
            except OSError as e:
                raise _output_error(e, path) from None
            if i == 0:
                self.num_ok_before = n
            else:
                self.num_errors_before = n
            torn.append(tail)
        for path, tail in zip(self.paths, torn, strict=True):
            if tail:
                try:
                    self.torn_bytes += repair_tail(path)
                except OSError as e:
                    raise _output_error(e, path) from None
        self._scanned = True

    def open(self) -> None:
        """Scan (once), then create or open both files for appending."""
        if self._fds:
            raise RuntimeError("ResultStore.open called twice")
        self.scan()
        for path in self.paths:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                created = not path.exists()
                flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
                fd = os.open(path, flags, 0o644)
                self._fds.append(fd)
                self._sizes.append(os.fstat(fd).st_size)
                if created:
                    fsync_dir(path.parent)
            except OSError as e:
                self._close_fds()
                raise _output_error(e, path) from None
        self._last_sync = _now()

    def _note_before(self, rec: dict) -> None:
        self._note(rec)
        error, cid = rec.get("error"), rec.get("custom_id")
        if not isinstance(error, dict):
            return
        if cid is not None and error.get("code") == DUPLICATE:
            self.done_duplicates[cid] += 1
        elif cid is None and isinstance(error.get("line"), int):
            self.done_anonymous.add((error["line"], str(error.get("code"))))

    def _note(self, rec: dict) -> None:
        error = rec.get("error")
        duplicate = isinstance(error, dict) and error.get("code") == DUPLICATE
        if rec.get("custom_id") is not None and not duplicate:  # a repeat does not finish the id
            self.done.add(rec["custom_id"])

    def has_error_record(self, line_no: int, custom_id: str | None, code: str) -> bool:
        """Whether an earlier run wrote the record of this bad input line, so it needs none.

        By custom_id where the line has one: lines move when an input is edited (and rerun with
        --force), ids do not. A duplicate's id is the first line's, so each earlier duplicate
        record of that id covers one duplicate line. By (line, code) only for a line with no
        readable id, and for duplicate records written without their id.
        """
        if custom_id is not None and code != DUPLICATE:
            return custom_id in self.done
        if custom_id is not None and self.done_duplicates[custom_id] > 0:
            self.done_duplicates[custom_id] -= 1
            return True
        return (line_no, code) in self.done_anonymous

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
        except BaseException as e:
            with contextlib.suppress(OSError):  # leave no half line for the records after it
                os.ftruncate(self._fds[i], self._sizes[i])
            if isinstance(e, OSError):
                raise _output_error(e, self.paths[i]) from None
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
                try:
                    os.fsync(fd)
                except OSError as e:
                    raise _output_error(e, self.paths[i]) from None
                self._dirty[i] = False
        self._pending = 0
        self._last_sync = _now()

    def close(self) -> None:
        """fsync and close both files, then fsync their directory. Safe to call twice; the files
        are closed even when an fsync fails (that failure is raised after)."""
        if not self._fds:
            return
        try:
            for path, fd in zip(self.paths, self._fds, strict=True):
                try:
                    os.fsync(fd)
                except OSError as e:
                    raise _output_error(e, path) from None
        finally:
            self._close_fds()
        for d in dict.fromkeys(p.parent for p in self.paths):
            try:
                fsync_dir(d)
            except OSError as e:
                raise _output_error(e, d) from None

    def _close_fds(self) -> None:
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds, self._sizes = [], []

    def __enter__(self) -> ResultStore:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

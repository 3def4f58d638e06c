"""A spool folder: `pagedctl generate --input-dir in/ --output-dir out/` runs every input of `in/`
that has no complete output, oldest first, on one model load, each with its own output, errors
and summary. Cron then runs one fixed command forever.

An input is ready when its name ends in `.jsonl` (or `.jsonl.gz`, `.bz2`, `.xz`), is not hidden
and has not changed for `min_age` seconds (a file still being written, or one named `.part`, is
left for the next run). Its outputs are named by templates (templates.py) under the output
folder, by default `{input_stem}.{input_sha}.out.jsonl`: an input replaced by new bytes under the
same name is a new job with new files. A finished job's manifest says `complete`, so a run finds
it done without opening its files; the input's hash is kept in `.pagedctl-spool.json` beside
them, keyed by its size and modification time, so a done input is not read again either. One
run at a time holds the folder (`.pagedctl-spool.lock`).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pagedctl.exits import EXIT_DATAERR, EXIT_OK, EXIT_PARTIAL, EXIT_TEMPFAIL, EXIT_USAGE
from pagedctl.generate.deadline import Deadline
from pagedctl.generate.engine import EngineSlot
from pagedctl.generate.errors import JobExit, JobStopped, StopSignals, stop_code
from pagedctl.generate.job import GenerateJob
from pagedctl.generate.paths import base_name, identity
from pagedctl.generate.recipe import JobSettings
from pagedctl.generate.runctl import (
    JobLock,
    LockHeld,
    input_sha256,
    is_complete,
    manifest_path,
    read_manifest,
    write_json_atomic,
)
from pagedctl.generate.store import OutputError
from pagedctl.generate.templates import RunNames, fields_of, job_date, today

INPUT_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.bz2", ".jsonl.xz")
BEING_WRITTEN = (".part", ".tmp", ".partial", ".crdownload", "~")
OUTPUT = "{input_stem}.{input_sha}.out.jsonl"
INDEX = ".pagedctl-spool.json"
LOCK = ".pagedctl-spool"  # JobLock adds .lock
# A file's failure that leaves the others runnable: its input, its settings, its own lock.
FILE_CODES = (EXIT_USAGE, EXIT_DATAERR)


@dataclass
class SpoolOutcome:
    """What a spool run did: a row per input (`input`, `status`, `exit`, ...), its exit code, and
    the line that says why for a code other than 0 and 3."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    code: int = EXIT_OK
    message: str | None = None


def spool_templates(s: JobSettings) -> dict[str, str]:
    """The output, errors and summary templates of each input, under the output folder."""
    out = str(s.output) if s.output is not None else OUTPUT
    if not fields_of(out) & {"input_stem", "input_sha"}:
        raise JobExit(
            EXIT_USAGE,
            f"--output {out!r} names one file for every input of --input-dir: put "
            "{input_stem} or {input_sha} in it",
        )
    stem = out.removesuffix(".jsonl").removesuffix(".out")
    names = {
        "output": out,
        "errors": str(s.errors) if s.errors is not None else f"{stem}.errors.jsonl",
        "summary_json": str(s.summary_json) if s.summary_json else f"{stem}.summary.json",
    }
    return {k: str(s.output_dir / v) for k, v in names.items()}


def check_folders(s: JobSettings) -> None:
    """The spool and output folders: usable, and not one folder (outputs would be inputs)."""
    if s.input is not None:
        raise JobExit(EXIT_USAGE, "give an input file or --input-dir, not both")
    if s.output_dir is None:
        raise JobExit(EXIT_USAGE, "--input-dir needs --output-dir (job.output_dir): a folder apart")
    if not s.input_dir.is_dir():
        raise JobExit(EXIT_DATAERR, f"--input-dir {s.input_dir} is not a folder")
    if s.output_dir.exists() and not s.output_dir.is_dir():
        raise JobExit(EXIT_USAGE, f"--output-dir {s.output_dir} is not a folder")
    if identity(s.output_dir) == identity(s.input_dir):
        raise JobExit(EXIT_USAGE, "--output-dir must be another folder than --input-dir")
    s.output_dir.mkdir(parents=True, exist_ok=True)


def candidates(folder: Path, min_age_s: float) -> tuple[list[Path], list[dict[str, Any]]]:
    """The ready inputs, oldest first; and a row for each file left out, with why."""
    ready, left = [], []
    now = time.time()
    entries = sorted(folder.iterdir(), key=lambda p: p.name)
    for path in entries:
        name = path.name
        if name.startswith(".") or not path.is_file():
            continue
        if name.endswith(BEING_WRITTEN):
            left.append({"input": name, "status": "not ready: still being written"})
        elif not name.endswith(INPUT_SUFFIXES):
            left.append({"input": name, "status": "ignored: not a .jsonl file"})
        elif now - path.stat().st_mtime < min_age_s:
            left.append({"input": name, "status": f"not ready: changed < {min_age_s:g} s ago"})
        else:
            ready.append(path)
    ready.sort(key=lambda p: (p.stat().st_mtime, p.name))
    return ready, left


class HashIndex:
    """Input hashes keyed by (size, mtime_ns), so that a done input is not read again."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / INDEX
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            data = {}
        self.entries: dict[str, Any] = data if isinstance(data, dict) else {}
        self.changed = False

    def sha256(self, path: Path) -> str:
        st = path.stat()
        key = [st.st_size, st.st_mtime_ns]
        entry = self.entries.get(path.name)
        if isinstance(entry, dict) and entry.get("stat") == key:
            return entry["sha256"]
        digest = input_sha256(path)
        self.entries[path.name] = {"stat": key, "sha256": digest}
        self.changed = True
        return digest

    def save(self) -> None:
        if self.changed:
            write_json_atomic(self.path, self.entries)


def run_spool(
    s: JobSettings,
    deadline: Deadline,
    *,
    force: bool,
    quiet: bool,
    log_format: str,
    report: Callable[[GenerateJob, dict[str, Any], int], None],
) -> SpoolOutcome:
    """Run every ready input of `s.input_dir`; `report` prints and writes each one's summary."""
    check_folders(s)
    templates = spool_templates(s)
    try:
        with JobLock(s.output_dir / LOCK):
            return _run_locked(s, templates, deadline, force, quiet, log_format, report)
    except LockHeld as e:
        raise JobExit(EXIT_TEMPFAIL, f"another run holds the spool folder: {e}") from None
    except OutputError as e:
        raise JobExit(EXIT_USAGE, f"cannot write in {s.output_dir}: {e.strerror}") from None


def _run_locked(s, templates, deadline, force, quiet, log_format, report) -> SpoolOutcome:
    ready, left = candidates(s.input_dir, s.min_age_s)
    outcome = SpoolOutcome()
    index = HashIndex(s.output_dir)
    # One engine for every file, started by the first that needs it, closed after the last.
    stop, engine, failures = StopSignals(), EngineSlot(s), []
    try:
        with stop.handled():
            for path in ready:
                if outcome.message is not None or stop.signum is not None:
                    outcome.rows.append({"input": path.name, "status": "not started"})
                    continue
                if deadline.reached():
                    outcome.rows.append({"input": path.name, "status": "not started: time limit"})
                    _stop_at(outcome, EXIT_TEMPFAIL, "the time limit was reached")
                    continue
                if _complete(path, templates, index):
                    outcome.rows.append({"input": path.name, "status": "complete"})
                    continue
                job = GenerateJob(
                    replace(s, input=path, input_dir=None, output_dir=None, **templates),
                    force=force,
                    quiet=quiet,
                    log_format=log_format,
                    deadline=deadline,
                    engine=engine,
                    stop=stop,
                )
                outcome.rows.append(_run_file(job, report, outcome, failures))
    finally:
        index.save()
        engine.close()
    outcome.rows += left
    if outcome.message is None and stop.signum is not None:  # between two inputs
        _stop_at(outcome, stop_code(stop.signum), f"stopped by {stop.name}: rerun to go on")
    if outcome.message is None and failures:
        code, _ = failures[0]
        names = ", ".join(name for _, name in failures)
        outcome.code, outcome.message = code, f"{len(failures)} inputs failed ({names}): see above"
    elif outcome.message is None and any(r.get("exit") == EXIT_PARTIAL for r in outcome.rows):
        outcome.code = EXIT_PARTIAL
    return outcome


def _complete(path: Path, templates: dict[str, str], index: HashIndex) -> bool:
    names = RunNames(base_name(path.name), index.sha256(path), today())
    date = job_date(templates["output"], names)
    out = names.render(templates["output"], date)
    errors = names.render(templates["errors"], date)
    manifest = read_manifest(manifest_path(Path(out)))
    if not manifest or not manifest.get("complete"):
        return False
    if manifest.get("input_sha256") != names.input_sha256:
        return False
    return is_complete(manifest, _records(Path(out)) + _records(Path(errors)))


def _records(path: Path) -> int:
    """Lines in a results file, counted by their newlines (no parse: a done file is not read
    as records, only counted)."""
    try:
        with open(path, "rb") as f:
            return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))
    except FileNotFoundError:
        return 0


def _run_file(job: GenerateJob, report, outcome: SpoolOutcome, failures: list) -> dict[str, Any]:
    """Run one input's job; a failure of that input alone is its row, the others run on."""
    name = job.settings.input.name
    try:
        result = job.run()
    except JobStopped as e:
        summary = job.stopped_summary()
        if summary is not None:
            report(job, summary, e.code)
        _stop_at(outcome, e.code, str(e))
        return {"input": name, "status": "stopped", "exit": e.code}
    except JobExit as e:
        if e.code not in FILE_CODES:  # the engine, the disk, a signal: the rest cannot run
            _stop_at(outcome, e.code, f"{name}: {e}")
        else:
            failures.append((e.code, name))
            _error_line(job, f"{name}: {e}")
        return {"input": name, "status": "failed", "exit": e.code, "message": str(e)}
    report(job, result.summary, result.code)
    if result.message is not None:
        _stop_at(outcome, result.code, f"{name}: {result.message}")
    job_total = result.summary["job"]
    return {
        "input": name,
        "status": "complete" if job_total["complete"] else "stopped",
        "exit": result.code,
        "results": job_total["results"],
        "errors": job_total["errors"],
        "output": str(job.out_path),
    }


def _stop_at(outcome: SpoolOutcome, code: int, message: str) -> None:
    if outcome.message is None:
        outcome.code, outcome.message = code, message


def _error_line(job: GenerateJob, message: str) -> None:
    if job.log_format == "json":
        line = {"ts": round(time.time(), 3), "level": "error", "event": "spool_error"}
        print(json.dumps({**line, "message": message}), flush=True, file=sys.stderr)
    else:
        print(f"error: {message}", flush=True, file=sys.stderr)

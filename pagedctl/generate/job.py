"""`pagedctl generate`: a JSONL batch job that survives cron, crashes and bad lines.

One run: take the output's lock, check the run manifest, reopen the output files (repairing a torn
last line and collecting the custom_ids already done), then stream the input through the engine,
appending each result as its request finishes. Bad lines and refused requests become error records;
the job goes on. SIGTERM / SIGINT stop admission, keep what finished, and exit so the next run
resumes.

Everything that can be refused is refused before the model loads: the input, each path the run
will write, and output files that are not this job's. A file that cannot be written later ends
the run with what it wrote kept (75 for a full disk, 74 for another I/O error).
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pagedctl import __version__
from pagedctl.engine import Engine
from pagedctl.exits import (
    EXIT_DATAERR,
    EXIT_FAILED,
    EXIT_IOERR,
    EXIT_OK,
    EXIT_PARTIAL,
    EXIT_TEMPFAIL,
    EXIT_USAGE,
)
from pagedctl.generate.deadline import Deadline
from pagedctl.generate.engine import EngineSlot
from pagedctl.generate.errors import (
    FULL_ERRNOS,
    PATH_ERRNOS,
    JobExit,
    JobStopped,
    StopSignals,
    stop_code,
)
from pagedctl.generate.paths import base_name, check_writable, output_paths
from pagedctl.generate.progress import Reporter
from pagedctl.generate.reader import (
    InputError,
    JobRequest,
    LineError,
    ReaderLimits,
    count_lines,
    input_kind,
    open_input,
    read_requests,
)
from pagedctl.generate.recipe import JobSettings
from pagedctl.generate.records import error_record, ok_record
from pagedctl.generate.runctl import (
    JobLock,
    LockHeld,
    ManifestMismatch,
    check_manifest,
    input_sha256,
    is_complete,
    lock_path,
    manifest_path,
    mark_complete,
    precheck_manifest,
    read_manifest,
)
from pagedctl.generate.store import CorruptResults, NotResults, OutputError, ResultStore
from pagedctl.generate.summary import replica_progress, run_summary
from pagedctl.generate.templates import RunNames, TemplateError, job_date, today
from pagedctl.generate.validate import FieldError, engine_params

ENGINE_BROKEN_AFTER = 8  # engine failures in a row, no success between, that stop a job


@dataclass
class JobCounts:
    ok: int = 0
    failed: int = 0
    skipped: int = 0
    valid_lines: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    pending: dict[str, tuple[int, str, str, str | None]] = field(
        default_factory=dict
    )  # custom_id -> (line, endpoint, the answer's role, its echo form)


@dataclass
class JobResult:
    """How a run ended: its summary (always, an interrupted run's too), its exit code and, for a
    code other than 0 and 3, the one line that says why."""

    summary: dict[str, Any]
    code: int
    message: str | None = None


class GenerateJob:
    """One run of `pagedctl generate` over an input file.

    `engine` is the slot of the engine the runs of one command share (a spool folder's, which
    closes it); without one the job makes its own and closes the engine at its end. `deadline`
    is the command's time limit; `stop` the signal state the runs of one command share.
    """

    def __init__(
        self,
        settings: JobSettings,
        *,
        force: bool,
        quiet: bool,
        log_format: str,
        deadline: Deadline | None = None,
        engine: EngineSlot | None = None,
        stop: StopSignals | None = None,
    ):
        if settings.input is None:
            raise JobExit(
                EXIT_USAGE,
                "no input: give IN.jsonl, --input-dir DIR, or job.input or job.input_dir in the "
                "recipe",
            )
        self.settings = settings
        self.force = force
        self.quiet, self.log_format = quiet, log_format
        self.deadline = deadline or Deadline(None)
        self.out_path: Path | None = None  # resolved by `prepare` (templates need the input)
        self.err_path: Path | None = None
        self.summary_path: Path | None = None
        self.input_sha256: str | None = None
        self.date: str | None = None
        self.cut_by_limit = False  # the time limit stopped the reading of the input
        self.report: Reporter | None = None
        self.total_lines = 0
        self._held: list[tuple[Any, int]] = []  # engine failures not yet written (see _hold)
        self.counts = JobCounts()
        self.stop = stop or StopSignals()
        self.owns_engine = engine is None  # whoever made the slot closes its engine
        self.slot = engine or EngineSlot(settings)
        self.store: ResultStore | None = None

    def prepare(self) -> None:
        """Everything checked before the model loads: the input (readable, not empty), the
        output paths (templates rendered, each writable), the files already there (ours), the
        recorded manifest's settings that do not need the engine. JobExit when one fails."""
        if self.out_path is not None:
            return
        self._check_input()
        self._resolve_paths()
        self._check_outputs()
        self.store = ResultStore(
            self.out_path, self.err_path, fsync_every=self.settings.fsync_every
        )
        try:
            self._check_results(self.store.check_ours)  # before even the lock is created
            precheck_manifest(manifest_path(self.out_path), self._known_settings(), self.force)
        except ManifestMismatch as e:
            raise JobExit(EXIT_USAGE, str(e)) from None
        except OutputError as e:
            raise self._output_failed(e) from None

    def run(self) -> JobResult:
        """Run the job: a JobResult for every ending that has a summary (success, error records,
        a signal or the time limit once requests ran). Raises JobExit for the others, and
        JobStopped for a signal before the first request."""
        with self.signals():
            self.prepare()
            try:
                with JobLock(self.out_path):
                    return self._run_locked()
            except LockHeld as e:
                raise JobExit(EXIT_TEMPFAIL, str(e)) from None
            except OutputError as e:
                raise self._output_failed(e) from None

    def _resolve_paths(self) -> None:
        """Render `{input_stem}`, `{input_sha}` and `{date}` in the paths the run writes."""
        s = self.settings
        templates = {k: getattr(s, k) for k in ("output", "errors", "summary_json")}
        if s.output_dir is not None:  # relative names go in the output folder
            templates["output"] = templates["output"] or Path("{input_stem}.out.jsonl")
            templates = {
                k: s.output_dir / v if v is not None and not v.is_absolute() else v
                for k, v in templates.items()
            }
        names = RunNames(base_name(s.input.name), self.input_sha256, today())
        try:
            out = templates["output"]
            self.date = job_date(str(out), names) if out is not None else names.today
            rendered = {
                k: Path(names.render(str(v), self.date)) if v is not None else None
                for k, v in templates.items()
            }
        except TemplateError as e:
            raise JobExit(EXIT_USAGE, str(e)) from None
        self.out_path, self.err_path = output_paths(replace(s, **rendered))
        self.summary_path = rendered["summary_json"]

    def _check_outputs(self) -> None:
        """Refuse a path this run cannot write now, before the model loads, not after."""
        out = self.out_path
        check_writable([
            ("output", out, True),
            ("errors file", self.err_path, True),
            ("summary", self.summary_path, False),  # /dev/stdout will do
            ("lock", lock_path(out), True),
            ("manifest", manifest_path(out), True),
        ])  # fmt: skip

    def _output_failed(self, e: OSError) -> JobExit:
        """The exit of a file that could not be written: whatever was written is kept."""
        store = self.store
        kept = store.num_ok_before + store.num_errors_before if store else 0
        kept += store.num_ok + store.num_errors if store else 0
        where = f"{e.filename}: {e.strerror}" if e.filename else str(e)
        if e.errno in FULL_ERRNOS:
            return JobExit(
                EXIT_TEMPFAIL,
                f"the disk is full ({where}); the {kept} records written are kept: free some "
                "space, then rerun the same command to resume",
            )
        if e.errno in PATH_ERRNOS and not self.stop.graceful:
            return JobExit(EXIT_USAGE, f"cannot write {where}; give a path that can be written")
        return JobExit(
            EXIT_IOERR,
            f"cannot write {where}; the {kept} records written are kept: rerun the same command "
            "to resume once the file can be written",
        )

    def _check_input(self) -> None:
        src = self.settings.input
        if not src.is_file():
            raise JobExit(EXIT_DATAERR, f"input {src} is not a file")
        try:
            with src.open("rb") as f:
                f.read(1)
            input_kind(src)
            # A whole read, before the model loads: a compressed input's damage shows here.
            self.total_lines = count_lines(src)
            empty = not _has_content(src)
            self.input_sha256 = input_sha256(src)
        except OSError as e:
            raise JobExit(EXIT_DATAERR, f"cannot read input {src}: {e.strerror or e}") from None
        except InputError as e:
            raise JobExit(EXIT_DATAERR, str(e)) from None
        if empty:
            raise JobExit(EXIT_DATAERR, f"input {src} is empty: it holds no request line")

    def _check_results(self, check) -> None:
        try:
            check()
        except NotResults as e:
            flag = "-o" if e.path == self.out_path else "--errors"
            msg = f"{e}: name a new file (or this job's own) with {flag}"
            raise JobExit(EXIT_USAGE, msg) from None
        except CorruptResults as e:
            raise JobExit(EXIT_DATAERR, f"cannot resume: {e}") from None

    def _run_locked(self) -> JobResult:
        store = self.store
        self._check_results(store.scan)  # before the model loads, and before a file is touched
        recorded = read_manifest(manifest_path(self.out_path))
        done = store.num_ok_before + store.num_errors_before
        if is_complete(recorded, done) and not self.force:  # nothing left to run
            self.counts.skipped = done
            summary = self._summary(None, store, 0.0)
            summary["job"]["complete"] = True
            return JobResult(summary, exit_code_for(summary))
        engine = self.start_engine()
        try:
            manifest = manifest_path(self.out_path)
            check_manifest(manifest, self._manifest(engine), self.force, date=self.date)
        except ManifestMismatch as e:
            raise JobExit(EXIT_USAGE, str(e)) from None
        self.stop.graceful = True  # a signal from here on stops admission, keeps every record
        if self.stop.signum is not None:  # one that the engine's start-up caught and went on
            raise JobStopped(self.stop.signum)
        store.open()
        limits = ReaderLimits(
            max_line_bytes=self.settings.max_line_bytes,
            max_tokens_limit=engine.max_model_len,
            default_max_tokens=int(self.settings.sampling.get("max_tokens", 256)),
            models=None if self.settings.accept_any_model else self._model_names(engine),
        )
        total = self.total_lines
        self.report = Reporter(total, quiet=self.quiet, log_format=self.log_format)
        self.report.event(
            "start",
            input=str(self.settings.input),
            output=str(self.out_path),
            resumed=len(store.done),
            lines=total,
        )
        t0 = time.perf_counter()
        failed = True
        try:
            feed, stop = self._feed(store, limits), self._must_drop
            for out in engine.stream(feed, should_stop=stop, max_requests=total):
                self._record(store, out)
                if self.report.due():
                    self._progress(engine, t0)
            self._progress(engine, t0)  # the bar's last figures (a log line only if one is due)
            self._write_held(store)  # fewer than ENGINE_BROKEN_AFTER: failures of their own
            failed = False
        except InputError as e:  # a compressed input damaged part way: what came before is kept
            engine.abort_all()
            msg = f"{e}; the results so far are kept: rerun to resume once it is whole"
            raise JobExit(EXIT_DATAERR, msg) from None
        finally:
            self.report.close()
            if failed:  # the first error is the one to report
                with contextlib.suppress(OSError):
                    store.close()
            else:
                store.close()
        summary = self._summary(engine, store, time.perf_counter() - t0)
        if self.owns_engine:
            self.slot.close()
        code, message = self._ending(summary)
        if summary["job"]["complete"]:
            mark_complete(manifest, summary["job"]["results"] + summary["job"]["errors"])
        return JobResult(summary, code, message)

    @property
    def engine(self) -> Engine | None:
        return self.slot.engine

    def start_engine(self) -> Engine:
        """The slot's engine, started here if no run started it before: the model loaded and
        the KV pool sized, or the replicas up (`run` calls this; a caller may, earlier)."""
        return self.slot.start(self.stop)

    def _known_settings(self) -> dict[str, Any]:
        """The manifest's settings that are known before the engine starts."""
        deterministic = {"deterministic": True} if self.settings.engine.get("deterministic") else {}
        chat: dict[str, str] = {}  # only when set: a manifest of before them still matches
        if self.settings.chat_template is not None:
            digest = hashlib.sha256(self.settings.chat_template.encode()).hexdigest()
            chat["chat_template_sha256"] = digest
        if self.settings.reasoning_parser is not None:
            chat["reasoning_parser"] = self.settings.reasoning_parser
        return {
            **deterministic,
            "input_sha256": self.input_sha256,
            "seed": self.settings.engine.get("seed", 0),
            "sampling_defaults": {
                k: self.settings.sampling[k] for k in sorted(self.settings.sampling)
            },
            "pagedctl": __version__,
            **chat,
        }

    def _manifest(self, engine: Engine) -> dict[str, Any]:
        """What a resume must share with the run that started the output (capacity excepted)."""
        capacity = {
            k: str(v)
            for k, v in sorted(self.settings.engine.items())
            if k not in ("dtype", "seed", "deterministic")
        }
        # Bits, not speed: a deterministic job resumed without it would lose what it promised.
        known = self._known_settings()
        return {
            **{k: known.pop(k) for k in ("deterministic", "input_sha256") if k in known},
            "model": engine.model_name,
            "dtype": str(engine.dtype).removeprefix("torch."),
            "max_model_len": engine.max_model_len,
            **known,
            "capacity": {**capacity, "device": str(engine.device)},
        }

    # ------------------------------------------------------------------ the stream

    def _feed(self, store: ResultStore, limits: ReaderLimits) -> Iterator[dict]:
        """Engine inputs from the file; bad lines go straight to the errors file."""
        c, defaults = (
            self.counts,
            {k: v for k, v in self.settings.sampling.items() if k != "max_tokens"},
        )
        for item in read_requests(self.settings.input, limits):
            if self._stopping():
                return
            if self.deadline.reached():
                self.cut_by_limit = True
                return
            if isinstance(item, LineError):
                if store.has_error_record(item.line_no, item.custom_id, item.code):
                    c.skipped += 1
                    continue
                store.write(
                    error_record(item.custom_id, item.code, item.message, item.line_no), ok=False
                )
                c.failed += 1
                continue
            c.valid_lines += 1
            if item.custom_id in store.done:
                c.skipped += 1
                continue
            try:
                request = engine_input(item, defaults, self.settings.chat_template)
            except FieldError as e:  # the line and the job's defaults together (beam search)
                record = error_record(item.custom_id, e.code, e.message, item.line_no)
                store.write(record, ok=False)
                c.failed += 1
                continue
            c.pending[item.custom_id] = (item.line_no, item.endpoint, answer_role(item), item.echo)
            yield request

    def _record(self, store: ResultStore, out) -> None:
        c = self.counts
        line_no, endpoint, role, echo = c.pending.pop(out.request_id)
        if out.ok:
            try:
                record = ok_record(
                    out.request_id,
                    endpoint,
                    self.engine.model_name,
                    out,
                    self.slot.token_bytes,
                    role=role,
                    reasoning_parser=self.settings.reasoning_parser,
                    echo=echo,
                )
            except ValueError as e:  # a bug of ours: report it on the line, keep the job going
                record, out = None, replace(out, error=str(e), error_code="internal_error")
            if record is not None:
                self._write_held(store)
                store.write(record, ok=True)
                c.ok += 1
                c.prompt_tokens += len(out.prompt_token_ids)
                c.output_tokens += sum(len(o.token_ids) for o in out.outputs)
                return
        code = out.error_code or "request_failed"
        if code == "internal_error":
            self._hold(out, line_no)
            return
        store.write(error_record(out.request_id, code, out.error, line_no), ok=False)
        c.failed += 1

    def _hold(self, out, line_no: int) -> None:
        """Keep an engine failure back until a success shows the engine works: then it is the
        request's own failure and gets its record. `ENGINE_BROKEN_AFTER` of them in a row with
        no success between is a broken engine (a device that fails every step): the job stops
        with none of them recorded, so that a rerun runs them again, rather than turning the
        rest of the input into error records."""
        self._held.append((out, line_no))
        if len(self._held) >= ENGINE_BROKEN_AFTER:
            self.engine.abort_all()
            raise JobExit(
                EXIT_FAILED,
                f"the engine failed on {len(self._held)} requests in a row, none in between "
                f"succeeding (the last: {out.error}); stopped with those unrecorded, so that "
                "a rerun retries them once the engine or device is fixed",
            )

    def _write_held(self, store: ResultStore) -> None:
        for out, line_no in self._held:
            store.write(error_record(out.request_id, "internal_error", out.error, line_no), False)
            self.counts.failed += 1
        self._held.clear()

    def _model_names(self, engine: Engine) -> frozenset[str]:
        """The names a line's `model` may give: the served name; without one given, also the
        model as named on the command line and its folder's name (as vLLM serves a model)."""
        names = {engine.model_name}
        given = self.settings.engine.get("model")
        if self.settings.engine.get("served_model_name") is None and given is not None:
            names |= {str(given), Path(str(given)).name, engine.source.name}
        return frozenset(names)

    def _progress(self, engine: Engine, t0: float) -> None:
        c = self.counts
        elapsed = max(time.perf_counter() - t0, 1e-9)
        snaps = engine.snapshots()
        # Swapped-out sequences are neither running nor waiting: counted apart where a mode
        # can swap (under recompute the line stays as it was).
        swapped = {"swapped": sum(s["swapped"] for s in snaps)}
        if self.settings.engine.get("preemption_mode", "recompute") == "recompute":
            swapped = {}
        self.report.update(
            c.ok + c.failed + c.skipped,
            ok=c.ok,
            failed=c.failed,
            out_tok_s=round(c.output_tokens / elapsed, 1),
            running=sum(s.get("running_requests", s["running"]) for s in snaps),
            running_seqs=sum(s["running"] for s in snaps),
            waiting=sum(s["waiting"] for s in snaps),
            **swapped,
            kv_usage=round(sum(s["kv_usage"] for s in snaps) / max(len(snaps), 1), 3),
            preemptions=sum(s["stats"]["scheduler"]["num_preemptions"] for s in snaps),
            **replica_progress(engine.replicas),
        )

    # ------------------------------------------------------------------ signals

    def signals(self) -> contextlib.AbstractContextManager[None]:
        """SIGTERM and SIGINT handled by the job inside the block (nested blocks share one): the
        command holds it from before the model loads to its last line printed."""
        return self.stop.handled()

    def stopped(self) -> JobExit | None:
        """The exit of a signal that came after the last request (while the summary printed)."""
        if self.stop.signum is None:
            return None
        return JobExit(
            stop_code(self.stop.signum),
            f"stopped by {self.stop.name} after the last request: every record is written; "
            "rerun the same command to finish",
        )

    def _stopping(self) -> bool:
        return self.stop.signum is not None

    def _must_drop(self) -> bool:
        """Whether what runs in the engine is dropped now: a signal, or the time limit's drain
        allowance spent."""
        return self._stopping() or (self.cut_by_limit and self.deadline.overrun())

    def interrupted_by(self) -> str | None:
        """SIGTERM, SIGINT, `time_limit`, or None for a run that was not cut short."""
        return self.stop.name or ("time_limit" if self.cut_by_limit else None)

    # ------------------------------------------------------------------ the end

    def _summary(
        self, engine: Engine | None, store: ResultStore | None, wall: float
    ) -> dict[str, Any]:
        """This run's figures, and the job's over every run so far (`job`); `engine` None for
        a run stopped before its engine started."""
        c = self.counts
        ok_before = store.num_ok_before if store else 0
        errors_before = store.num_errors_before if store else 0
        ok_total = ok_before + (store.num_ok if store else 0)
        errors_total = errors_before + (store.num_errors if store else 0)
        stopped = self.interrupted_by() is not None or bool(c.pending)
        figures = run_summary(engine, c, wall) if engine is not None else {}
        return {
            "requests": c.ok + c.failed + c.skipped,
            "ok": c.ok,
            "failed": c.failed,
            "skipped_resumed": c.skipped,
            "in_flight_abandoned": len(c.pending),
            "errors_total": errors_total,
            "job": {
                "lines": self.total_lines,
                "results": ok_total,
                "errors": errors_total,
                "results_earlier": ok_before,
                "errors_earlier": errors_before,
                "complete": engine is not None and not stopped,
            },
            **figures,
            "output": str(self.out_path),
            "errors": str(self.err_path),
            "interrupted_by": self.interrupted_by(),
        }

    def stopped_summary(self) -> dict[str, Any] | None:
        """The summary of a run stopped before its first request (while the model loaded), once
        its output paths are known; None before that."""
        if self.out_path is None:
            return None
        store = self.store if self.store is not None and self.store._scanned else None
        return self._summary(None, store, 0.0)

    def _ending(self, summary: dict[str, Any]) -> tuple[int, str | None]:
        """The exit code of a run that ran its requests, and the line that says why."""
        kept = f"{summary['ok'] + summary['failed']} results kept"
        if self.stop.signum is not None:
            return stop_code(self.stop.signum), (
                f"stopped by {summary['interrupted_by']}: rerun the same command to resume ({kept})"
            )
        if self.cut_by_limit or self.counts.pending:
            if self.cut_by_limit:
                why = f"the time limit ({_duration(self.deadline.limit_s)}) was reached"
            else:  # only a scaled-out job can end with requests unreturned
                why = f"{len(self.counts.pending)} requests came back from no replica"
            return EXIT_TEMPFAIL, f"{why}; {kept}: rerun the same command to resume"
        if self.counts.valid_lines == 0:
            return EXIT_DATAERR, f"no valid request in {self.settings.input}; see {self.err_path}"
        return exit_code_for(summary), None


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "none"
    if seconds >= 3600 and seconds % 60 == 0:
        return f"{seconds / 3600:g} h"
    return f"{seconds / 60:g} min" if seconds >= 60 else f"{seconds:g} s"


def _has_content(path: Path) -> bool:
    """Whether the input holds a byte other than whitespace (a line to read)."""
    with open_input(path) as f:
        while chunk := f.read(1 << 20):
            if chunk.strip():
                return True
    return False


def exit_code_for(summary: dict[str, Any]) -> int:
    """0 when no line of the job has an error record (this run or earlier ones), else 3."""
    return EXIT_PARTIAL if summary["errors_total"] else EXIT_OK


def engine_input(
    req: JobRequest, defaults: dict[str, Any], chat_template: str | None = None
) -> dict[str, Any]:
    """A validated request as the engine's prompt dict (its sampling defaults filled in; a beam
    search's BeamSearchParams; a chat's template options under "chat", `chat_template` the
    job's template unless the line gives its own). Raises FieldError for a line its defaults
    make impossible (a beam search under default stop strings)."""
    params = engine_params(req.sampling, defaults)
    item: dict[str, Any] = {"request_id": req.custom_id, "sampling_params": params}
    if req.messages is not None:
        item["messages"] = req.messages
        chat = {"chat_template": chat_template} if chat_template is not None else {}
        chat.update(req.chat or {})
        if chat:
            item["chat"] = chat
    elif req.prompt is not None:
        item["prompt"] = req.prompt
    else:
        item["prompt_token_ids"] = req.prompt_token_ids
    return item


def answer_role(req: JobRequest) -> str:
    """The role of a chat line's answer as vLLM names it: "assistant", or without a generation
    prompt the last message's role (the message the model continues)."""
    if req.messages is None or (req.chat or {}).get("add_generation_prompt", True):
        return "assistant"
    return req.messages[-1]["role"]

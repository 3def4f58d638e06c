"""`pagedctl generate`: flags and recipe in, a `GenerateJob`, a summary and an exit code out."""

from __future__ import annotations

import errno
import functools
import importlib.util
import json
import logging
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text
from typer.exceptions import TyperException

from pagedctl.engine.config import ConfigError, EngineConfig
from pagedctl.engine.kv_sizing import format_bytes
from pagedctl.engine.sampling_params import SamplingParams
from pagedctl.exits import (
    EXIT_CODES,
    EXIT_FAILED,
    EXIT_IOERR,
    EXIT_SIGINT,
    EXIT_TEMPFAIL,
    EXIT_USAGE,
)
from pagedctl.generate.deadline import Deadline
from pagedctl.generate.job import GenerateJob, JobExit, JobStopped
from pagedctl.generate.recipe import JobSettings, load_recipe, merge
from pagedctl.generate.spool import run_spool
from pagedctl.options import engine_flags, with_default
from pagedctl.recipe_file import RecipeError, find_recipe

_EXIT_HELP = "; ".join(f"{code} {text}" for code, text in EXIT_CODES.items())


def _failures_end_cleanly(command: Callable) -> Callable:
    """An exception nobody expected still ends in one `error:` line (a JSON `error` event) and
    exit 1; its traceback is shown only with --debug."""

    @functools.wraps(command)
    def wrapper(**kwargs: Any) -> Any:
        try:
            return command(**kwargs)
        except (typer.Exit, typer.Abort, TyperException):  # click's own, shown by the group
            raise
        except Exception as e:
            debug = bool((kwargs.get("engine") or {}).get("debug"))
            _unexpected(e, debug, kwargs.get("log_format", "text"))

    return wrapper


# Paths are checked by the job, which says what is wrong with one and exits with the code of the
# table (click's own check would make an unreadable input a usage error).
@engine_flags()
@_failures_end_cleanly
def generate(
    input: Path | None = typer.Argument(
        None, help="Input JSONL (OpenAI batch lines or simple lines).", readable=False
    ),
    output: Path | None = typer.Option(
        None,
        "-o",
        "--output",
        help=with_default(
            "Results file; may hold {input_stem}, {input_sha} and {date}.", "IN.out.jsonl"
        ),
        show_default=False,
        readable=False,
    ),
    errors: Path | None = typer.Option(
        None,
        "--errors",
        help=with_default("Error records (templates as --output).", "IN.errors.jsonl"),
        show_default=False,
        readable=False,
    ),
    input_dir: Path | None = typer.Option(
        None,
        "--input-dir",
        help="A spool folder: run every input in it that has no complete output, oldest first, "
        "on one model load.",
        show_default=False,
        readable=False,
    ),
    output_dir: Path | None = typer.Option(
        None,
        "--output-dir",
        help=with_default("Where a spool folder's outputs go.", "the --input-dir"),
        show_default=False,
        readable=False,
    ),
    min_age: str | None = typer.Option(
        None,
        "--min-age",
        help=with_default(
            "Leave a spool file changed less than this long ago (still being written) for "
            "the next run: 90, 30s, 5m.",
            "60s",
        ),
        show_default=False,
    ),
    time_limit: str | None = typer.Option(
        None,
        "--time-limit",
        help="Stop admitting lines after this long (45m, 2h, 1h30m), finish what runs, write "
        "the summary and exit 75: the next run resumes.",
        show_default=False,
    ),
    recipe: str | None = typer.Option(
        None, "--recipe", help="YAML recipe file, or a shipped recipe's name; flags override it."
    ),
    max_tokens: int | None = typer.Option(
        None,
        help=with_default("Default max_tokens of a line that gives none.", "256"),
        show_default=False,
    ),
    temperature: float | None = typer.Option(
        None, help=with_default("Default temperature (0 is greedy).", "1.0"), show_default=False
    ),
    top_p: float | None = typer.Option(
        None, help=with_default("Default top_p.", "1.0"), show_default=False
    ),
    top_k: int | None = typer.Option(
        None, help=with_default("Default top_k (0 is off).", "0"), show_default=False
    ),
    min_p: float | None = typer.Option(
        None, help=with_default("Default min_p.", "0.0"), show_default=False
    ),
    stop: list[str] | None = typer.Option(None, "--stop", help="Default stop string (repeatable)."),
    ignore_eos: bool | None = typer.Option(
        None, "--ignore-eos", help="Default: keep going past EOS."
    ),
    summary_json: Path | None = typer.Option(
        None,
        "--summary-json",
        help="Write the summary here (templates as --output).",
        readable=False,
    ),
    log_format: str = typer.Option("text", help="text or json (JSON lines on stderr)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print nothing on success."),
    force: bool = typer.Option(False, "--force", help="Resume even if the settings changed."),
    accept_any_model: bool | None = typer.Option(
        None,
        "--accept-any-model",
        help="Run lines whose body.model names another model (default: refuse them).",
        show_default=False,
    ),
    max_line_bytes: int | None = typer.Option(
        None, min=1, help=with_default("Longest input line in bytes.", "4 MiB"), show_default=False
    ),
    replicas: int | None = typer.Option(
        None,
        "--replicas",
        min=1,
        help="Run N engines on a Ray cluster, one GPU each (CPUs shared where there is no "
        "GPU); needs pagedctl[ray].",
        show_default=False,
    ),
    ray_address: str | None = typer.Option(
        None,
        "--ray-address",
        help=with_default("The Ray cluster for --replicas: auto or HOST:PORT.", "a local one"),
        show_default=False,
    ),
    engine: dict[str, Any] | None = None,
) -> None:
    """Run a JSONL batch job: one request per line, results appended as they finish.

    Lines are OpenAI batch requests (/v1/chat/completions, /v1/completions) or simple objects
    {custom_id, prompt | messages | prompt_token_ids, sampling fields}. Results go to OUT in
    completion order (join on custom_id); bad lines and refused requests to the errors file with
    a code. Rerunning the same command resumes where the last run stopped.
    """
    started = time.monotonic()
    if log_format not in ("text", "json"):
        raise typer.BadParameter("--log-format is text or json")
    _configure_logging(quiet, log_format)
    try:
        recipe = find_recipe(recipe) if recipe else None
        doc = load_recipe(recipe) if recipe else {}
        EngineConfig.from_mapping({**doc.get("engine", {}), **(engine or {})})
    except (RecipeError, ConfigError) as e:
        _fail(EXIT_USAGE, str(e), log_format)
    flags = {
        "input": input,
        "output": output,
        "errors": errors,
        "input_dir": input_dir,
        "output_dir": output_dir,
        "min_age": min_age,
        "time_limit": time_limit,
        "summary_json": summary_json,
        "max_line_bytes": max_line_bytes,
        "sampling_max_tokens": max_tokens,
        "sampling_temperature": temperature,
        "sampling_top_p": top_p,
        "sampling_top_k": top_k,
        "sampling_min_p": min_p,
        "sampling_stop": list(stop) if stop else None,
        "sampling_ignore_eos": ignore_eos,
        "accept_any_model": accept_any_model,
        "replicas": replicas,
        "ray_address": ray_address,
    }
    try:
        settings = merge(doc, flags, engine or {})
    except ValueError as e:  # a duration or a path template
        _fail(EXIT_USAGE, str(e), log_format)
    if settings.ray_address is not None and settings.replicas is None:
        _fail(EXIT_USAGE, "--ray-address needs --replicas N", log_format)
    if settings.replicas is not None and importlib.util.find_spec("ray") is None:
        _fail(EXIT_USAGE, "--replicas needs Ray: pip install 'pagedctl[ray]'", log_format)
    try:  # the sampling defaults every line inherits, checked before anything is written
        SamplingParams(**settings.sampling)
    except (TypeError, ValueError) as e:
        _fail(EXIT_USAGE, f"sampling defaults: {e}", log_format)
    deadline = Deadline(settings.time_limit_s, start=started)
    try:
        if settings.input_dir is not None:
            code = _run_spool(settings, deadline, force, quiet, log_format)
        else:
            code = _run_one(settings, deadline, force, quiet, log_format)
    except (JobExit, JobStopped) as e:
        _fail(e.code, str(e), log_format)
    except KeyboardInterrupt:
        _fail(EXIT_SIGINT, "interrupted twice: stopped at once; rerun to resume", log_format)
    except Exception as e:
        _unexpected(e, bool(settings.engine.get("debug")), log_format)
    raise typer.Exit(code)


def _run_one(
    settings: JobSettings, deadline: Deadline, force: bool, quiet: bool, log_format: str
) -> int:
    """One input: its summary printed and written however the run ends once its paths are
    known (a signal during the model load included); JobExit for a code with a reason."""
    job = GenerateJob(settings, force=force, quiet=quiet, log_format=log_format, deadline=deadline)
    with job.signals():  # from before the model loads to the last line of the summary
        try:
            result = job.run()
        except JobStopped as e:
            summary = job.stopped_summary()
            if summary is not None:
                _report(summary, job.summary_path, False, log_format)
            raise JobExit(e.code, str(e)) from None
        _report(result.summary, job.summary_path, quiet and result.code == 0, log_format)
        if result.message is not None:
            raise JobExit(result.code, result.message)
        stopped = job.stopped()
        if stopped is not None:
            raise stopped
    return result.code


def _run_spool(
    settings: JobSettings, deadline: Deadline, force: bool, quiet: bool, log_format: str
) -> int:
    """Every ready input of a spool folder, each with its own files and summary."""

    def report(job: GenerateJob, summary: dict, code: int) -> None:
        _report(summary, job.summary_path, quiet and code == 0, log_format)

    outcome = run_spool(
        settings, deadline, force=force, quiet=quiet, log_format=log_format, report=report
    )
    if not quiet or outcome.code not in (0, 3):
        _print_spool(outcome.rows, log_format)
    if outcome.message is not None:
        raise JobExit(outcome.code, outcome.message)
    return outcome.code


generate.__doc__ += f"\n\n    Exit codes: {_EXIT_HELP}."


def _configure_logging(quiet: bool, log_format: str) -> None:
    """Engine log lines as text, or in JSON mode as `log` events (warnings and up, Python's
    warnings included), so that every line on stderr is one JSON object."""
    if log_format != "json":
        level = logging.WARNING if quiet else logging.INFO
        logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonLogFormatter())
    logging.basicConfig(level=logging.WARNING, handlers=[handler])
    logging.captureWarnings(True)


class _JsonLogFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "event": "log",
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            line["traceback"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def _event(event: str, **fields: Any) -> None:
    line = {"ts": round(time.time(), 3), "level": "error", "event": event, **fields}
    print(json.dumps(line, default=str), file=sys.stderr, flush=True)


def _fail(code: int, message: str, log_format: str = "text") -> None:
    """One line on stderr, verbatim (a JSON `error` event with the exit code in JSON mode)."""
    if log_format == "json":
        _event("error", exit_code=code, message=message)
    else:
        print(f"error: {message}", file=sys.stderr, flush=True)
    raise typer.Exit(code)


def _unexpected(e: Exception, debug: bool, log_format: str) -> None:
    """A failure of ours or of a library (a damaged model file, say): exit 1, named."""
    if debug:
        text = "".join(traceback.format_exception(e))
        if log_format == "json":
            _event("traceback", traceback=text)
        else:
            print(text, end="", file=sys.stderr)
    hint = "" if debug else "; rerun with --debug for the traceback"
    detail = f": {e}" if str(e) else ""
    _fail(EXIT_FAILED, f"unexpected {type(e).__name__}{detail}{hint}", log_format)


def _write_summary(summary: dict, path: Path) -> None:
    """Non-atomically, to the path as given (`/dev/stdout` included); records are all written."""
    try:
        path.write_text(json.dumps(summary, indent=2) + "\n")
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise JobExit(
                EXIT_TEMPFAIL,
                f"the disk is full: cannot write the summary {path} ({e.strerror}); every record "
                "is written: free some space, then rerun the same command to write it",
            ) from None
        raise JobExit(
            EXIT_IOERR,
            f"cannot write the summary {path}: {e.strerror or e}; every record is written",
        ) from None


def _report(summary: dict, path: Path | None, quiet: bool, log_format: str) -> None:
    """Print the summary, then write it to `path`: a summary file that cannot be written still
    leaves the summary in the log."""
    _print_summary(summary, quiet, log_format)
    if path is not None:
        _write_summary(summary, path)


def _print_summary(summary: dict, quiet: bool, log_format: str) -> None:
    if log_format == "json":
        line = {"ts": round(time.time(), 3), "level": "info", "event": "summary", **summary}
        print(json.dumps(line, default=str), file=sys.stderr, flush=True)
        return
    if quiet:
        return
    table = Table(title="pagedctl generate")
    table.add_column("", style="bold")
    table.add_column("this run", justify="right", overflow="fold")  # a path folds, never "…"
    table.add_column("job (all runs)", justify="right", overflow="fold")
    for name, value, total in summary_rows(summary):
        table.add_row(name, Text(value), Text(total))  # verbatim: a path may hold "[/b]"
    _stdout().print(table)


def _stdout() -> Console:
    """Stdout's console; a log or a pipe gets whole rows, not rows folded to 80 columns."""
    console = Console()
    return console if console.is_terminal else Console(width=1000)


def summary_rows(summary: dict) -> list[tuple[str, str, str]]:
    """(what, this run, the job over all its runs) for each row of the summary table."""
    job = summary["job"]
    state = "complete" if job["complete"] else "not complete"
    rows = [
        (
            "requests (ok / failed / skipped)",
            "{requests} ({ok} / {failed} / {skipped_resumed})".format(**summary),
            "",
        ),
        (
            "records: results / errors",
            f"{summary['ok']:,} / {summary['failed']:,}",
            f"{job['results']:,} / {job['errors']:,} of {job['lines']:,} lines, {state}",
        ),
        ("  from earlier runs", "", f"{job['results_earlier']:,} / {job['errors_earlier']:,}"),
    ]
    if summary.get("interrupted_by"):
        rows.append(("interrupted by", summary["interrupted_by"], ""))
    if "wall_s" not in summary:  # stopped before the engine ran
        rows.append(("results / errors", f"{summary['output']} / {summary['errors']}", ""))
        return rows
    run = [
        ("prompt / output tokens", f"{summary['prompt_tokens']:,} / {summary['output_tokens']:,}"),
        ("wall time", f"{summary['wall_s']:.1f} s"),
        ("requests/s", f"{summary['requests_per_s']:.2f}"),
        (
            "output tok/s / total tok/s",
            f"{summary['output_tok_per_s']:.1f} / {summary['total_tok_per_s']:.1f}",
        ),
        (
            "preemptions / recomputed tokens",
            f"{summary['preemptions']} / {summary['recomputed_tokens']:,}",
        ),
        ("prefix-cache hit rate", f"{summary['prefix_cache_hit_rate']:.1%}"),
        ("peak KV usage", f"{summary['peak_kv_usage']:.1%}"),
    ]
    if beams := summary.get("beam_search"):  # only when beam searches ran
        run.append(
            (
                "beam searches: peak blocks (unshared, saved) / copies",
                "{requests}: {peak_blocks:,} ({peak_blocks_unshared:,}, {shared_saving:.1%}) / "
                "{cow_copies:,}".format(**beams),
            )
        )
    if swap := summary.get("swap"):  # only when preemption may swap: under the preemptions
        moved = swap["blocks_out"] + swap["blocks_in"]
        at = 1 + next(i for i, (name, _) in enumerate(run) if name.startswith("preemptions"))
        run.insert(
            at,
            (
                f"swap ({swap['preemption_mode']}): out / in, blocks, time, fallbacks",
                f"{swap['swap_outs']:,} / {swap['swap_ins']:,}, {moved:,} "
                f"({format_bytes(swap['bytes_moved'])}), {swap['transfer_s']:.3f} s, "
                f"{swap['fallbacks_to_recompute']:,}",
            ),
        )
    if startup := summary.get("startup"):
        run.insert(2, ("start-up", startup_line(startup)))
    rows += [(name, value, "") for name, value in run]
    rows.append(("results / errors", f"{summary['output']} / {summary['errors']}", ""))
    return rows


def _print_spool(rows: list[dict], log_format: str) -> None:
    """One line per input of a spool folder: what this run did with it."""
    if log_format == "json":
        for row in rows:
            line = {"ts": round(time.time(), 3), "level": "info", "event": "spool_file", **row}
            print(json.dumps(line, default=str), file=sys.stderr, flush=True)
        return
    table = Table(title="pagedctl generate: spool")
    for name in ("input", "status", "exit", "results", "errors", "output"):
        table.add_column(name, overflow="fold")
    for row in rows:
        table.add_row(*(Text(str(row.get(k, ""))) for k in ("input", "status", "exit")),
                      Text(str(row.get("results", ""))), Text(str(row.get("errors", ""))),
                      Text(str(row.get("output", ""))))  # fmt: skip
    _stdout().print(table)


def startup_line(startup: dict) -> str:
    """`12.3 s: import 3.1, load 1.0, ... (kernel JIT 4.2 s, 21 kernel variants)`: a summary's
    start-up phases, those under 0.05 s left out."""
    phases = [
        (k.removesuffix("_s"), v)
        for k, v in startup.items()
        if k.endswith("_s") and isinstance(v, int | float)
    ]
    phases = [(k, v) for k, v in phases if k not in ("engine", "compile")]
    total = sum(v for _, v in phases)
    phases = [(k, v) for k, v in phases if v >= 0.05] or phases[:1]  # the ones that cost
    line = f"{total:.1f} s: " + ", ".join(f"{k} {v:.1f}" for k, v in phases)
    if startup.get("kernels_compiled"):
        line += (
            f" (kernel JIT {startup['compile_s']:.1f} s, "
            f"{startup['kernels_compiled']} kernel variants)"
        )
    return line

"""`pagedctl generate`: flags and recipe in, a `GenerateJob`, a summary and an exit code out."""

from __future__ import annotations

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
from typer.exceptions import TyperException

from pagedctl.engine import ConfigError, EngineConfig, SamplingParams
from pagedctl.exits import (
    EXIT_CODES,
    EXIT_FAILED,
    EXIT_SIGINT,
    EXIT_USAGE,
)
from pagedctl.generate.deadline import Deadline
from pagedctl.generate.job import GenerateJob, JobExit, JobStopped
from pagedctl.generate.recipe import JobSettings, load_recipe, merge
from pagedctl.generate.records import REASONING_PARSERS
from pagedctl.generate.report import print_spool, report
from pagedctl.generate.spool import run_spool
from pagedctl.options import engine_flags, sampling_flags, with_default
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
@sampling_flags()
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
    chat_template: Path | None = typer.Option(
        None,
        "--chat-template",
        help=with_default(
            "A Jinja chat template file for the chat lines; a line's chat_template wins.",
            "the model's",
        ),
        show_default=False,
        readable=False,
    ),
    reasoning_parser: str | None = typer.Option(
        None,
        "--reasoning-parser",
        help=f"{' or '.join(REASONING_PARSERS)}: split each chat answer's <think> block into "
        "message.reasoning_content, the rest into message.content (vLLM's parsers).",
        show_default=False,
    ),
    sampling: dict[str, Any] | None = None,
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
        "accept_any_model": accept_any_model,
        "replicas": replicas,
        "ray_address": ray_address,
        "chat_template": chat_template,
        "reasoning_parser": reasoning_parser,
    }
    try:
        settings = merge(doc, flags, engine or {}, sampling or {})
    except ValueError as e:  # a duration, a path template, the chat template, the parser
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
                report(summary, job.summary_path, False, log_format)
            raise JobExit(e.code, str(e)) from None
        report(result.summary, job.summary_path, quiet and result.code == 0, log_format)
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

    def report_file(job: GenerateJob, summary: dict, code: int) -> None:
        report(summary, job.summary_path, quiet and code == 0, log_format)

    outcome = run_spool(
        settings, deadline, force=force, quiet=quiet, log_format=log_format, report=report_file
    )
    if not quiet or outcome.code not in (0, 3):
        print_spool(outcome.rows, log_format)
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

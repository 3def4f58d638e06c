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
from pagedctl.generate.job import GenerateJob, JobExit, JobStopped, exit_code_for
from pagedctl.generate.recipe import load_recipe, merge
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
        help=with_default("Results file.", "IN.out.jsonl"),
        show_default=False,
        readable=False,
    ),
    errors: Path | None = typer.Option(
        None,
        "--errors",
        help=with_default("Error records.", "IN.errors.jsonl"),
        show_default=False,
        readable=False,
    ),
    recipe: Path | None = typer.Option(None, "--recipe", help="YAML recipe; flags override it."),
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
        None, "--summary-json", help="Write the summary here.", readable=False
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
    settings = merge(doc, flags, engine or {}, base=recipe.parent if recipe else None)
    if settings.ray_address is not None and settings.replicas is None:
        _fail(EXIT_USAGE, "--ray-address needs --replicas N", log_format)
    if settings.replicas is not None and importlib.util.find_spec("ray") is None:
        _fail(EXIT_USAGE, "--replicas needs Ray: pip install 'pagedctl[ray]'", log_format)
    try:  # the sampling defaults every line inherits, checked before anything is written
        SamplingParams(**settings.sampling)
    except (TypeError, ValueError) as e:
        _fail(EXIT_USAGE, f"sampling defaults: {e}", log_format)
    try:
        job = GenerateJob(settings, force=force, quiet=quiet, log_format=log_format)
        with job.signals():  # from before the model loads to the last line of the summary
            summary = job.run()
            code = exit_code_for(summary)
            _report(summary, settings.summary_json, quiet and code == 0, log_format)
            stopped = job.stopped()
            if stopped is not None:
                raise stopped
    except (JobExit, JobStopped) as e:
        _fail(e.code, str(e), log_format)
    except KeyboardInterrupt:
        _fail(EXIT_SIGINT, "interrupted twice: stopped at once; rerun to resume", log_format)
    except Exception as e:
        _unexpected(e, bool(settings.engine.get("debug")), log_format)
    raise typer.Exit(code)


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
        print(json.dumps({"event": "summary", **summary}), file=sys.stderr, flush=True)
        return
    if quiet:
        return
    table = Table(title="pagedctl generate", show_header=False)
    table.add_column("", style="bold")
    table.add_column("", justify="right", overflow="fold")  # a long path folds, never "…"
    rows = [
        (
            "requests (ok / failed / skipped)",
            "{requests} ({ok} / {failed} / {skipped_resumed})".format(**summary),
        ),
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
        ("results / errors", f"{summary['output']} / {summary['errors']}"),
    ]
    if beams := summary.get("beam_search"):  # only when beam searches ran
        rows.insert(
            -1,
            (
                "beam searches: peak blocks (unshared, saved) / copies",
                "{requests}: {peak_blocks:,} ({peak_blocks_unshared:,}, {shared_saving:.1%}) / "
                "{cow_copies:,}".format(**beams),
            ),
        )
    if swap := summary.get("swap"):  # only when preemption may swap: under the preemptions
        moved = swap["blocks_out"] + swap["blocks_in"]
        at = 1 + next(i for i, (name, _) in enumerate(rows) if name.startswith("preemptions"))
        rows.insert(
            at,
            (
                f"swap ({swap['preemption_mode']}): out / in, blocks, time, fallbacks",
                f"{swap['swap_outs']:,} / {swap['swap_ins']:,}, {moved:,} "
                f"({format_bytes(swap['bytes_moved'])}), {swap['transfer_s']:.3f} s, "
                f"{swap['fallbacks_to_recompute']:,}",
            ),
        )
    if startup := summary.get("startup"):
        rows.insert(3, ("start-up", startup_line(startup)))
    for name, value in rows:
        table.add_row(name, Text(value))  # verbatim: a path may hold "[/b]"
    Console().print(table)


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

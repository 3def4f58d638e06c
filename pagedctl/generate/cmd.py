"""`pagedctl generate`: flags and recipe in, a `GenerateJob`, a summary and an exit code out."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from pagedctl.engine.config import ConfigError, EngineConfig
from pagedctl.engine.sampling_params import SamplingParams
from pagedctl.exits import EXIT_CODES, EXIT_SIGINT, EXIT_USAGE
from pagedctl.generate.job import GenerateJob, JobExit, exit_code_for
from pagedctl.generate.recipe import load_recipe, merge
from pagedctl.options import engine_flags
from pagedctl.recipe_file import RecipeError, find_recipe

_EXIT_HELP = "; ".join(f"{code} {text}" for code, text in EXIT_CODES.items())


@engine_flags()
def generate(
    input: Path | None = typer.Argument(
        None, help="Input JSONL (OpenAI batch lines or simple lines)."
    ),
    output: Path | None = typer.Option(
        None, "-o", "--output", help="Results file.", show_default="IN.out.jsonl"
    ),
    errors: Path | None = typer.Option(
        None, "--errors", help="Error records.", show_default="IN.errors.jsonl"
    ),
    recipe: Path | None = typer.Option(None, "--recipe", help="YAML recipe; flags override it."),
    max_tokens: int | None = typer.Option(
        None, help="Default max_tokens of a line that gives none.", show_default="256"
    ),
    temperature: float | None = typer.Option(
        None, help="Default temperature (0 is greedy).", show_default="1.0"
    ),
    top_p: float | None = typer.Option(None, help="Default top_p.", show_default="1.0"),
    top_k: int | None = typer.Option(None, help="Default top_k (0 is off).", show_default="0"),
    min_p: float | None = typer.Option(None, help="Default min_p.", show_default="0.0"),
    stop: list[str] | None = typer.Option(None, "--stop", help="Default stop string (repeatable)."),
    ignore_eos: bool | None = typer.Option(
        None, "--ignore-eos", help="Default: keep going past EOS."
    ),
    summary_json: Path | None = typer.Option(
        None, "--summary-json", help="Write the summary here."
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
        None, min=1, help="Longest input line in bytes.", show_default="4 MiB"
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
    }
    settings = merge(doc, flags, engine or {}, base=recipe.parent if recipe else None)
    try:  # the sampling defaults every line inherits, checked before anything is written
        SamplingParams(**settings.sampling)
    except (TypeError, ValueError) as e:
        _fail(EXIT_USAGE, f"sampling defaults: {e}", log_format)
    try:
        job = GenerateJob(settings, force=force, quiet=quiet, log_format=log_format)
        summary = job.run()
    except JobExit as e:
        _fail(e.code, str(e), log_format)
    except KeyboardInterrupt:
        _fail(EXIT_SIGINT, "interrupted twice: stopped at once; rerun to resume", log_format)
    code = exit_code_for(summary)
    _report(summary, settings.summary_json, quiet and code == 0, log_format)
    raise typer.Exit(code)


generate.__doc__ += f"\n\n    Exit codes: {_EXIT_HELP}."


def _configure_logging(quiet: bool, log_format: str) -> None:
    level = logging.WARNING if quiet or log_format == "json" else logging.INFO
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")


def _fail(code: int, message: str, log_format: str = "text") -> None:
    """One line on stderr, verbatim (a JSON `error` event with the exit code in JSON mode)."""
    if log_format == "json":
        print(
            json.dumps({"event": "error", "exit_code": code, "message": message}), file=sys.stderr
        )
    else:
        print(f"error: {message}", file=sys.stderr)
    raise typer.Exit(code)


def _report(summary: dict, path: Path | None, quiet: bool, log_format: str) -> None:
    if path is not None:
        path.write_text(json.dumps(summary, indent=2) + "\n")
    if log_format == "json":
        print(json.dumps({"event": "summary", **summary}), file=sys.stderr)
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
    for name, value in rows:
        table.add_row(name, Text(value))  # verbatim: a path may hold "[/b]"
    Console().print(table)

"""`pagedctl sweep`: flags and recipe in; tables and files (JSON, CSV, Markdown, PNG) out."""

from __future__ import annotations

import dataclasses
import logging
import shlex
import sys
from pathlib import Path
from typing import Any

import typer
from rich.console import Console

from pagedctl.console import (
    FORMAT_HELP,
    Format,
    print_json,
    print_tsv,
    progress_console,
    stdout_console,
)
from pagedctl.exits import EXIT_USAGE
from pagedctl.options import axis_flags, engine_flags, flag_of
from pagedctl.outputs import OVERWRITE_HELP, ResultFolder, out_help
from pagedctl.recipe_file import RecipeError, find_recipe
from pagedctl.sweep.recipe import (
    SweepRecipe,
    add_axes,
    grid_recipe,
    load_sweep_recipe,
    scale_recipe,
)
from pagedctl.sweep.report import (
    comparison_rows,
    comparisons_title,
    file_names,
    rich_comparisons,
    rich_table,
    table,
    title,
    to_doc,
    write_outputs,
)
from pagedctl.sweep.run import PointResult, SweepError, engine_info, load_engine, run_sweep
from pagedctl.sweep.settings import (
    ENGINE_KEYS,
    LOAD_KEYS,
    check_value,
    check_warmup,
    merge_workload,
    parse_axes,
)

PLOT_HINT = "--plot needs matplotlib: pip install 'pagedctl[plot]' (or pip install matplotlib)"


def _axis(flag: str, key: str, text: str | None) -> list[tuple[str, str, list[Any]]]:
    """A comma-separated axis flag as one axis, values typed like the recipe's."""
    if text is None:
        return []
    values: list[Any] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        values.append(_typed(part))
    if not values:
        raise typer.BadParameter(f"{flag} needs at least one value, got {text!r}")
    try:
        return parse_axes(flag, {key: values})
    except RecipeError as e:
        raise typer.BadParameter(str(e)) from None


def _typed(text: str) -> Any:
    """'16' -> 16, '0.5' -> 0.5, '64-256' -> [64, 256], anything else stays text."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    low, sep, high = text.partition("-")
    if sep and low.isdigit() and high.isdigit():
        return [int(low), int(high)]
    return text


def _generic_axes(specs: list[str] | None) -> list[tuple[str, str, list[Any]]]:
    axes = []
    for spec in specs or []:
        key, sep, values = spec.partition("=")
        if not sep or not key.strip():
            raise typer.BadParameter(f"--axis takes KEY=V1,V2,...; got {spec!r}")
        axes += _axis("--axis", key.strip(), values)
    return axes


def _length_flag(flag: str, text: str | None) -> Any:
    if text is None:
        return None
    value = _typed(text.strip())
    try:
        check_value(flag, "prompt_len", value)
    except RecipeError as e:
        raise typer.BadParameter(str(e)) from None
    return value


@axis_flags(ENGINE_KEYS)
@engine_flags(LOAD_KEYS)
def sweep(
    recipe: str | None = typer.Option(
        None,
        "--recipe",
        help="Sweep recipe: a shipped one's name (block-size, oversubscribed, shared-prefix, "
        "sweep-cpu) or a YAML file.",
    ),
    input: Path | None = typer.Option(
        None, "--input", help="Workload from a JSONL file (the formats of `generate`)."
    ),
    axis: list[str] | None = typer.Option(
        None, "--axis", help="Any other axis, KEY=V1,V2: an engine setting or a workload key."
    ),
    num_requests: int | None = typer.Option(
        None, min=1, help="Synthetic workload: requests (default: 64)."
    ),
    prompt_len: str | None = typer.Option(
        None, help="Synthetic workload: prompt tokens, N or LOW-HIGH (uniform) (default: 64-256)."
    ),
    output_len: str | None = typer.Option(
        None,
        help="Synthetic workload: output tokens (EOS ignored), N or LOW-HIGH (default: 64-256).",
    ),
    max_tokens: int | None = typer.Option(
        None, min=1, help="--input: max_tokens of a line that gives none (default: 256)."
    ),
    ignore_eos: bool | None = typer.Option(
        None, "--ignore-eos/--honour-eos", help="--input: run every line to its max_tokens."
    ),
    repeats: int | None = typer.Option(
        None, min=1, help="Timed runs per point: min / median / max (default: recipe's, else 3)."
    ),
    warmup: str | None = typer.Option(
        None,
        "--warmup",
        help="Untimed run per point first: short (answers cut to 8 tokens), full (the timed run "
        "itself) or off (default: recipe's, else short).",
    ),
    scale: float = typer.Option(
        1.0,
        min=0.0001,
        help="Scale token counts (lengths, pools) by this factor: --scale 0.05 runs a GPU "
        "recipe on a CPU; its reference figures then no longer apply.",
    ),
    experiment: list[str] | None = typer.Option(
        None, "--experiment", help="Run only this experiment of the recipe (repeatable)."
    ),
    out: Path | None = typer.Option(None, "--out", help=out_help(), show_default=False),
    overwrite: bool = typer.Option(False, "--overwrite", help=OVERWRITE_HELP),
    name: str | None = typer.Option(
        None, "--name", help="File stem of the results (default: recipe's name, else 'sweep')."
    ),
    plot: bool = typer.Option(False, "--plot", help="Also write PNG plots (needs matplotlib)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print only the final tables."),
    fmt: Format = typer.Option(Format.table, "--format", help=FORMAT_HELP, show_default=False),
    engine: dict[str, Any] | None = None,
    axes: dict[str, str] | None = None,
) -> None:
    """Run one workload under every combination of engine settings; tables and files out.

    The model is loaded once; per point the KV pool and scheduler are rebuilt, a short untimed
    warm-up runs, then --repeats timed runs (prefix cache emptied before each). Per point:
    requests/s, output and total tok/s, wall time, preemptions, recomputed tokens, prefix-cache
    hit rate, peak and mean KV usage, internal waste and steps (and, where a point swaps, swap
    outs, blocks and bytes moved, transfer time and fallbacks), as min / median / max over the
    repeats. A point that fails (a block size the kernel does not take, an impossible pool) is
    a row with its reason. Writes <name>.md, .csv and .json (and with --plot .png) to --out, by
    default to a new folder runs/<name>-YYYYMMDD-HHMMSS. Exit status 0, or 1 when every point
    failed; 64 on a bad flag or recipe, or a result file in --out that exists (--overwrite).
    """
    if plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise typer.BadParameter(PLOT_HINT) from None
    grid = [a for key, text in (axes or {}).items() for a in _axis(flag_of(key), key, text)]
    grid += _generic_axes(axis)
    fixed = {k: v[0] for s, k, v in grid if s == "engine" and len(v) == 1}  # one value: no axis
    grid = [a for a in grid if not (a[0] == "engine" and len(a[2]) == 1)]
    workload: dict[str, Any] = {}
    if input is not None:
        workload = {"kind": "file", "input": str(input)}
        workload.update({k: v for k, v in (("max_tokens", max_tokens), ("ignore_eos", ignore_eos))
                         if v is not None})  # fmt: skip
    synthetic = {
        "num_requests": num_requests,
        "prompt_len": _length_flag("--prompt-len", prompt_len),
        "output_len": _length_flag("--output-len", output_len),
    }
    synthetic = {k: v for k, v in synthetic.items() if v is not None}
    if input is not None and synthetic:
        raise typer.BadParameter("--input takes its requests from the file; drop " + ", ".join(
            "--" + k.replace("_", "-") for k in synthetic))  # fmt: skip
    if warmup is not None:
        try:
            warmup = check_warmup("--warmup", warmup)
        except RecipeError as e:
            raise typer.BadParameter(str(e)) from None
    top = {k: v for k, v in (("repeats", repeats), ("warmup", warmup)) if v is not None}
    try:
        path = find_recipe(recipe) if recipe else None
        spec = _recipe(path, grid, {**workload, **synthetic}, engine or {}, fixed, top, experiment)
        scale_recipe(spec, scale)
    except RecipeError as e:
        raise typer.BadParameter(str(e)) from None
    if name is not None:
        spec.name = name
    folder = ResultFolder(out, spec.name, overwrite)
    folder.refuse_existing(file_names(spec.name, [e.name for e in spec.experiments], plot))
    _run(spec, folder, plot, quiet, fmt)


def _recipe(
    path: Path | None,
    axes: list,
    workload: dict[str, Any],
    load: dict[str, Any],
    fixed: dict[str, Any],
    top: dict[str, Any],
    only: list[str] | None,
) -> SweepRecipe:
    if path is None:
        if only:
            raise RecipeError("--experiment needs --recipe")
        return grid_recipe(axes, workload, fixed, load, **top)
    spec = load_sweep_recipe(path)
    if only:
        known = [e.name for e in spec.experiments]
        missing = sorted(set(only) - set(known))
        if missing:
            raise RecipeError(f"no experiment {missing} in {path}; it has {', '.join(known)}")
        spec.experiments = [e for e in spec.experiments if e.name in only]
    for key, value in top.items():
        setattr(spec, key, value)
    spec.load = {**spec.load, **load}
    for exp in spec.experiments:
        exp.points = [
            dataclasses.replace(
                p, engine={**p.engine, **fixed}, workload=merge_workload(p.workload, workload)
            )
            for p in exp.points
        ]
    add_axes(spec, axes)
    return spec


def _run(spec: SweepRecipe, folder: ResultFolder, plot: bool, quiet: bool, fmt: Format) -> None:
    from pagedctl.envinfo import environment

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    total = sum(len(e.points) for e in spec.experiments)
    log = progress_console(fmt)

    def say(text: str) -> None:
        if not quiet:
            log.print(text, markup=False, highlight=False)

    say(f"sweep {spec.name}: {total} points x {spec.repeats} repeats; loading the model ...")
    try:
        llm = load_engine(spec)
    except SweepError as e:
        Console(stderr=True).print(f"error: {e}", markup=False, highlight=False)
        raise typer.Exit(EXIT_USAGE) from None
    info = engine_info(llm)
    where = info.get("gpu") or info["device"]
    say(f"{info['model']} ({info['load_format']}, {info['dtype']}) on {where}")

    def progress(exp: str, r: PointResult) -> None:
        say(f"[{exp}] {r.point.label or 'default'}: " + _progress(r))

    try:
        result = run_sweep(spec, llm, progress)
    except RecipeError as e:  # a workload that cannot be drawn or read
        Console(stderr=True).print(f"error: {e}", markup=False, highlight=False)
        raise typer.Exit(EXIT_USAGE) from None
    command = "pagedctl " + shlex.join(sys.argv[1:])
    doc = to_doc(result, command, {**environment(), **result.engine_info})
    _print_tables(doc, fmt)
    for path in write_outputs(doc, folder.path(), spec.name, plot):
        say(f"wrote {path}")
    if all(p["status"] != "ok" for e in doc["experiments"] for p in e["points"]):
        raise typer.Exit(1)


def _print_tables(doc: dict, fmt: Format) -> None:
    """Each experiment's table (and its comparisons) on stdout, in the `--format` asked for."""
    if fmt is Format.json:
        print_json(doc)
    elif fmt is Format.tsv:
        tables = []
        for exp in doc["experiments"]:
            tables.append((title(exp, doc), *table(exp, doc)))
            if exp["comparisons"]:
                tables.append((comparisons_title(exp), *comparison_rows(exp)))
        print_tsv(tables)
    else:
        console = stdout_console()
        for exp in doc["experiments"]:
            console.print(rich_table(exp, doc))
            if exp["comparisons"]:
                console.print(rich_comparisons(exp))


def _progress(r: PointResult) -> str:
    if r.status != "ok":
        return f"failed: {r.error}"
    s = r.summary()
    parts = [f"{s['output_tok_s']['median']:,.0f} out tok/s"]
    spread = r.spread("output_tok_s")
    if spread is not None and len(r.runs) > 1:
        parts[-1] += f" (spread {spread:.1%})"
    parts.append(f"{s['wall_s']['median']:.2f} s")
    parts.append(f"{s['preemptions']['median']:,.0f} preemptions")
    if s["swap_outs"]["median"]:
        parts[-1] += f" ({s['swap_outs']['median']:,.0f} by swap)"
    parts.append(f"{r.memory['num_blocks']:,} blocks of {r.memory['block_size']}")
    return ", ".join(parts)

"""`pagedctl sweep`: flags and recipe in; tables and files (JSON, CSV, Markdown, PNG) out.

Everything written is rendered from one JSON-ready document (`to_doc`), so the files agree.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import logging
import shlex
import sys
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from pagedctl import sweep as sw
from pagedctl.recipes import RecipeError

console = Console()
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
        return sw.parse_axes(flag, {key: values})
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
        sw.check_value(flag, "prompt_len", value)
    except RecipeError as e:
        raise typer.BadParameter(str(e)) from None
    return value


def sweep(
    recipe: Path | None = typer.Option(
        None, "--recipe", help="Sweep recipe (YAML), e.g. recipes/seed-block-size.yaml."
    ),
    input: Path | None = typer.Option(
        None, "--input", help="Workload from a JSONL file (the formats of `generate`)."
    ),
    block_size: str | None = typer.Option(
        None, "--block-size", help="Axis: KV block sizes in tokens, e.g. 16,32,64."
    ),
    gpu_mem: str | None = typer.Option(
        None, "--gpu-mem", help="Axis (CUDA): fractions of total device memory, e.g. 0.5,0.9."
    ),
    num_blocks: str | None = typer.Option(
        None, "--num-blocks", help="Axis: exact KV pool sizes in blocks (preemption studies)."
    ),
    max_num_seqs: str | None = typer.Option(
        None, "--max-num-seqs", help="Axis: most sequences running at once."
    ),
    max_num_batched_tokens: str | None = typer.Option(
        None, "--max-num-batched-tokens", help="Axis: token budget of one step."
    ),
    prefix_caching: str | None = typer.Option(
        None, "--prefix-caching", help="Axis: prefix cache on,off."
    ),
    kv_cache_memory: str | None = typer.Option(
        None, "--kv-cache-memory", help="Axis: KV cache sizes, e.g. 1GiB,2GiB."
    ),
    axis: list[str] | None = typer.Option(
        None, "--axis", help="Any other axis, KEY=V1,V2: an engine setting or a workload key."
    ),
    model: str | None = typer.Option(
        None, "--model", help="Model (default: recipe's, else bundled SmolLM2-135M-Instruct)."
    ),
    load_format: str | None = typer.Option(
        None, help="auto or dummy (random weights) (default: auto)."
    ),
    dtype: str | None = typer.Option(
        None, help="auto, float32, float16 or bfloat16 (default: auto)."
    ),
    device: str | None = typer.Option(None, help="auto, cpu or cuda[:N] (default: auto)."),
    max_model_len: int | None = typer.Option(None, min=1, help="Longest sequence in tokens."),
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
        help="Scale token counts (lengths, pools) by this factor: --scale 0.05 runs a seed "
        "recipe on a CPU; figures are then not the seed's.",
    ),
    experiment: list[str] | None = typer.Option(
        None, "--experiment", help="Run only this experiment of the recipe (repeatable)."
    ),
    out: Path = typer.Option(Path("results"), "--out", help="Folder for the result files."),
    name: str | None = typer.Option(
        None, "--name", help="File stem of the results (default: recipe's name, else 'sweep')."
    ),
    plot: bool = typer.Option(False, "--plot", help="Also write PNG plots (needs matplotlib)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print only the final tables."),
) -> None:
    """Run one workload under every combination of engine settings; tables and files out.

    The model is loaded once; per point the KV pool and scheduler are rebuilt, a short untimed
    warm-up runs, then --repeats timed runs (prefix cache emptied before each). Per point:
    requests/s, output and total tok/s, wall time, preemptions, recomputed tokens, prefix-cache
    hit rate, peak and mean KV usage, internal waste and steps, as min / median / max over the
    repeats. A point that fails (a block size the kernel does not take, an impossible pool) is
    a row with its reason. Writes <name>.md, .csv and .json (and with --plot .png) to --out.
    Exit status 0, or 1 when every point failed.
    """
    if plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise typer.BadParameter(PLOT_HINT) from None
    axes = (
        _axis("--block-size", "block_size", block_size)
        + _axis("--gpu-mem", "gpu_mem", gpu_mem)
        + _axis("--num-blocks", "num_blocks", num_blocks)
        + _axis("--max-num-seqs", "max_num_seqs", max_num_seqs)
        + _axis("--max-num-batched-tokens", "max_num_batched_tokens", max_num_batched_tokens)
        + _axis("--prefix-caching", "prefix_caching", prefix_caching)
        + _axis("--kv-cache-memory", "kv_cache_memory", kv_cache_memory)
        + _generic_axes(axis)
    )
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
            warmup = sw.check_warmup("--warmup", warmup)
        except RecipeError as e:
            raise typer.BadParameter(str(e)) from None
    top = {
        "model": model,
        "load_format": load_format,
        "dtype": dtype,
        "device": device,
        "repeats": repeats,
        "warmup": warmup,
    }
    top = {k: v for k, v in top.items() if v is not None}
    engine = {} if max_model_len is None else {"max_model_len": max_model_len}
    try:
        spec = _recipe(recipe, axes, {**workload, **synthetic}, engine, top, experiment)
        sw.scale_recipe(spec, scale)
    except RecipeError as e:
        raise typer.BadParameter(str(e)) from None
    if name is not None:
        spec.name = name
    _run(spec, out, plot, quiet)


def _recipe(
    path: Path | None,
    axes: list,
    workload: dict[str, Any],
    engine: dict[str, Any],
    top: dict[str, Any],
    only: list[str] | None,
) -> sw.SweepRecipe:
    if path is None:
        if only:
            raise RecipeError("--experiment needs --recipe")
        return sw.grid_recipe(axes, workload, engine, name="sweep", **top)
    spec = sw.load_sweep_recipe(path)
    if only:
        known = [e.name for e in spec.experiments]
        missing = sorted(set(only) - set(known))
        if missing:
            raise RecipeError(f"no experiment {missing} in {path}; it has {', '.join(known)}")
        spec.experiments = [e for e in spec.experiments if e.name in only]
    for key, value in top.items():
        setattr(spec, key, value)
    for exp in spec.experiments:
        exp.points = [
            dataclasses.replace(
                p,
                engine={**p.engine, **engine},
                workload=sw.merge_workload(p.workload, workload),
            )
            for p in exp.points
        ]
    sw.add_axes(spec, axes)
    return spec


def _run(spec: sw.SweepRecipe, out: Path, plot: bool, quiet: bool) -> None:
    from pagedctl.envinfo import environment

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    total = sum(len(e.points) for e in spec.experiments)
    say = (lambda *_: None) if quiet else (lambda text: console.print(text, highlight=False))
    say(f"sweep {spec.name}: {total} points x {spec.repeats} repeats; loading the model ...")
    try:
        llm = sw.load_engine(spec)
    except sw.SweepError as e:
        Console(stderr=True).print(f"error: {e}", highlight=False)
        raise typer.Exit(2) from None
    info = sw.engine_info(llm)
    where = info.get("gpu") or info["device"]
    say(f"{info['model']} ({info['load_format']}, {info['dtype']}) on {where}")

    def progress(exp: str, r: sw.PointResult) -> None:
        say(f"[{exp}] {r.point.label or 'default'}: " + _progress(r))

    try:
        result = sw.run_sweep(spec, llm, progress)
    except RecipeError as e:  # a workload that cannot be drawn or read
        Console(stderr=True).print(f"error: {e}", highlight=False)
        raise typer.Exit(2) from None
    command = "pagedctl " + shlex.join(sys.argv[1:])
    doc = to_doc(result, command, {**environment(), **result.engine_info})
    for exp in doc["experiments"]:
        _print_wide(rich_table(exp, doc))
        if exp["comparisons"]:
            _print_wide(rich_comparisons(exp))
    for path in write_outputs(doc, out, spec.name, plot):
        say(f"wrote {path}")
    if all(p["status"] != "ok" for e in doc["experiments"] for p in e["points"]):
        raise typer.Exit(1)


def _print_wide(t: Table) -> None:
    """A table; into a pipe or a file at its natural width rather than squeezed into 80 columns."""
    if console.is_terminal:
        console.print(t)
    else:
        natural = console.measure(t, options=console.options.update_width(10_000)).maximum
        Console(width=max(console.width, natural)).print(t)


def _progress(r: sw.PointResult) -> str:
    if r.status != "ok":
        return f"failed: {r.error}"
    s = r.summary()
    parts = [f"{s['output_tok_s']['median']:,.0f} out tok/s"]
    spread = r.spread("output_tok_s")
    if spread is not None and len(r.runs) > 1:
        parts[-1] += f" (spread {spread:.1%})"
    parts.append(f"{s['wall_s']['median']:.2f} s")
    parts.append(f"{s['preemptions']['median']:,.0f} preemptions")
    parts.append(f"{r.memory['num_blocks']:,} blocks of {r.memory['block_size']}")
    return ", ".join(parts)


# ------------------------------------------------------------------------------------ document


def to_doc(result: sw.SweepResult, command: str, environment: dict) -> dict[str, Any]:
    """The sweep as one JSON-ready document: what every output file is rendered from."""
    recipe = result.recipe
    experiments = []
    for er in result.experiments:
        exp = er.experiment
        points = [
            {
                "label": r.point.label,
                "status": r.status,
                "error": r.error,
                "engine": {k: v for k, v in r.point.engine.items() if v is not None},
                "workload": r.point.workload,
                "memory": r.memory,
                "seed": r.point.seed,
                "summary": r.summary(),
                "runs": r.runs,
            }
            for r in er.points
        ]
        experiments.append(
            {
                "name": exp.name,
                "title": exp.title,
                "mode": exp.mode,
                "note": exp.note,
                "why": exp.why,
                "columns": list(exp.columns),
                "primary": exp.primary,
                "varying": _varying(exp.points),
                "points": points,
                "comparisons": er.comparisons(),
            }
        )
    return {
        "sweep": recipe.name,
        "description": recipe.description,
        "command": command,
        "scale": recipe.scale,
        "repeats": recipe.repeats,
        "warmup": recipe.warmup,
        "environment": environment,
        "metrics": {k: m.doc for k, m in sw.METRICS.items()},
        "experiments": experiments,
    }


def _varying(points: list[sw.Point]) -> list[list[str]]:
    """[section, key] of the settings whose values differ between the points, in order."""
    out = []
    for section in ("engine", "workload"):
        keys = dict.fromkeys(k for p in points for k in getattr(p, section))
        for key in keys:
            values = {json.dumps(getattr(p, section).get(key), sort_keys=True) for p in points}
            if len(values) > 1:
                out.append([section, key])
    return out


def table(exp: dict, doc: dict) -> tuple[list[str], list[list[str]]]:
    """Headers and rows of an experiment's table (shared by the terminal and Markdown)."""
    points, primary = exp["points"], exp["primary"]
    multi = doc["repeats"] > 1
    seeds = {m for p in points for m in p["seed"]}
    failed = any(p["status"] != "ok" for p in points)
    # Settings that vary get a column, unless the labels already say them (grid points).
    varying = [
        (section, key)
        for section, key in exp["varying"]
        if not all(f"{sw.SHORT.get(key, key)}=" in p["label"] for p in points)
    ]
    headers = ["point"] + [sw.SHORT.get(k, k) for _, k in varying]
    headers += ["blocks", "pool tok"]
    base = next((p for p in points if p["status"] == "ok"), None)
    for m in exp["columns"]:
        headers.append(sw.METRICS[m].header)
        if m == primary and multi:
            headers.append("spread")
        if m == primary and len(points) > 1 and exp["mode"] == "batch":
            headers.append("vs first")
        if m in seeds:
            headers.append(f"seed {sw.METRICS[m].header}")
    if failed:
        headers.append("status")
    rows = []
    for p in points:
        row = [p["label"] or "default"]
        row += [sw.show_value(p[section].get(key)) for section, key in varying]
        mem = p["memory"]
        row += [f"{mem['num_blocks']:,}" if mem else "–", f"{mem['pool_tokens']:,}" if mem else "–"]
        for m in exp["columns"]:
            med = p["summary"].get(m, {}).get("median")
            row.append(sw.fmt(m, med))
            if m == primary and multi:
                row.append(_spread(p["summary"].get(m)))
            if m == primary and len(points) > 1 and exp["mode"] == "batch":
                ref = base["summary"].get(m, {}).get("median") if base else None
                row.append(f"{med / ref - 1:+.1%}" if med is not None and ref else "–")
            if m in seeds:
                row.append(sw.fmt(m, p["seed"].get(m)))
        if failed:
            row.append("ok" if p["status"] == "ok" else f"failed: {p['error']}")
        rows.append(row)
    return headers, rows


def _spread(s: dict | None) -> str:
    if not s or not s["median"]:
        return "–"
    return f"{(s['max'] - s['min']) / abs(s['median']):.1%}"


def comparison_rows(exp: dict) -> tuple[list[str], list[list[str]]]:
    headers = ["comparison", "ours", "over repeats", "seed", "expected", "holds"]
    fixed = {"finished", "preemptions", "requests"}  # counts: shown as they are
    rows = []
    for c in exp["comparisons"]:
        ratio = c["den"] is not None

        def show(v: float | None, ratio: bool = ratio, metric: str = c["metric"]) -> str:
            if v is None:
                return "–"
            if ratio:
                return f"{v:,.3g}x"
            return f"{v:,.0f}" if metric in fixed else sw.fmt(metric, v)

        expected = []
        if c["expect_min"] is not None:
            expected.append(f">= {show(c['expect_min'])}")
        if c["expect_max"] is not None:
            expected.append(f"<= {show(c['expect_max'])}")
        if c["expect"] == "within_spread":
            expected.append(f"within the spread ({c.get('spread', 0):.1%})")
        span = "–" if c["low"] is None else f"{show(c['low'])} – {show(c['high'])}"
        holds = {True: "yes", False: "no", None: "–"}[c["holds"]]
        rows.append(
            [c["label"], show(c["value"]), span, show(c["seed"]), ", ".join(expected) or "–", holds]
        )
    return headers, rows


def rich_table(exp: dict, doc: dict) -> Table:
    headers, rows = table(exp, doc)
    t = Table(title=f"{exp['title']} ({_repeats_note(doc)})", title_justify="left")
    for i, h in enumerate(headers):
        t.add_column(h, justify="left" if i == 0 or h == "status" else "right")
    for row in rows:
        t.add_row(*row)
    return t


def rich_comparisons(exp: dict) -> Table:
    headers, rows = comparison_rows(exp)
    t = Table(title=f"{exp['title']}: comparisons", title_justify="left")
    for i, h in enumerate(headers):
        t.add_column(h, justify="left" if i == 0 else "right")
    for row in rows:
        t.add_row(*row)
    return t


def _repeats_note(doc: dict) -> str:
    n = doc["repeats"]
    return f"median of {n} runs" if n > 1 else "one run"


def _warmup_note(doc: dict) -> str:
    return {
        "short": "after an untimed short run (answers cut to 8 tokens)",
        "full": "after one untimed run of the same requests",
        "off": "no warm-up",
    }[doc["warmup"]]


def markdown(doc: dict) -> str:
    env = doc["environment"]
    lines = [f"# {doc['sweep']}", ""]
    if doc["description"]:
        lines += [doc["description"].strip(), ""]
    lines += [
        f"Regenerate: `{doc['command']}`",
        "",
        f"Ran on {env.get('gpu') or env.get('cpu')} ({env.get('device')}), model "
        f"{env.get('model')} ({env.get('load_format')} weights, {env.get('dtype')}); "
        f"torch {env.get('torch')}, triton {env.get('triton')}, transformers "
        f"{env.get('transformers')}; pagedctl {env.get('pagedctl')} commit {env.get('commit')}; "
        f"{env.get('date')}. {_repeats_note(doc).capitalize()} per point, {_warmup_note(doc)}; "
        "spread = (max - min) / median over the repeats; vs first = the difference from the "
        "first point that ran.",
        "",
    ]
    if doc["scale"] != 1.0:
        lines += [
            f"**Scaled by {doc['scale']}** (lengths and pools): a reduced check, not comparable "
            "with the seed's figures.",
            "",
        ]
    for exp in doc["experiments"]:
        lines += [f"## {exp['title']}", ""]
        if exp["note"]:
            lines += [exp["note"], ""]
        lines += _md_table(*table(exp, doc)) + [""]
        if exp["comparisons"]:
            lines += _md_table(*comparison_rows(exp)) + [""]
        if exp["why"]:
            lines += [exp["why"], ""]
    return "\n".join(lines)


def _md_table(headers: list[str], rows: list[list[str]]) -> list[str]:
    def cell(text: str) -> str:
        return str(text).replace("|", "\\|")

    out = ["| " + " | ".join(map(cell, headers)) + " |"]
    out.append("|" + "|".join("---" if i == 0 else "---:" for i in range(len(headers))) + "|")
    out += ["| " + " | ".join(map(cell, row)) + " |" for row in rows]
    return out


def csv_rows(doc: dict) -> list[dict[str, Any]]:
    """One row per point: settings, pool, then min / median / max of every metric."""
    rows = []
    for exp in doc["experiments"]:
        for p in exp["points"]:
            row: dict[str, Any] = {
                "experiment": exp["name"],
                "point": p["label"],
                "status": p["status"],
                "error": p["error"] or "",
            }
            row.update({k: p["engine"].get(k, "") for k in sw.ENGINE_KEYS})
            row["workload"] = json.dumps(p["workload"], sort_keys=True)
            row["pool_blocks"] = p["memory"].get("num_blocks", "")
            row["pool_tokens"] = p["memory"].get("pool_tokens", "")
            row["repeats"] = len(p["runs"])
            for m in sw.METRICS:
                s = p["summary"].get(m, {})
                for stat in ("median", "min", "max"):
                    row[f"{m}_{stat}"] = s.get(stat, "")
                row[f"seed_{m}"] = p["seed"].get(m, "")
            rows.append(row)
    return rows


def write_outputs(doc: dict, out: Path, stem: str, plot: bool) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{stem}.json", out / f"{stem}.csv", out / f"{stem}.md"]
    paths[0].write_text(json.dumps(doc, indent=1) + "\n")
    rows = csv_rows(doc)
    with paths[1].open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["experiment"])
        writer.writeheader()
        writer.writerows(rows)
    paths[2].write_text(markdown(doc))
    if plot:
        paths += write_plots(doc, out, stem)
    return paths


def write_plots(doc: dict, out: Path, stem: str) -> list[Path]:
    """Per batch experiment: the primary metric (median, min-max bars) and preemptions against
    the first varying setting, one line per combination of the others."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for exp in doc["experiments"]:
        ok = [p for p in exp["points"] if p["status"] == "ok"]
        if exp["mode"] != "batch" or len(ok) < 2:
            continue
        varying = exp["varying"] or [["point", "label"]]
        (xs_sec, xs_key), rest = varying[0], varying[1:]

        def value(p: dict, section: str, key: str) -> str:
            return p["label"] if section == "point" else sw.show_value(p[section].get(key))

        xs = list(dict.fromkeys(value(p, xs_sec, xs_key) for p in exp["points"]))
        series: dict[str, list[dict]] = {}
        for p in ok:
            name = " ".join(f"{sw.SHORT.get(k, k)}={value(p, s, k)}" for s, k in rest)
            series.setdefault(name, []).append(p)
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
        for name, ps in series.items():
            pos = [xs.index(value(p, xs_sec, xs_key)) for p in ps]
            s = [p["summary"][exp["primary"]] for p in ps]
            med = [v["median"] for v in s]
            low = [m - v["min"] for m, v in zip(med, s, strict=True)]
            high = [v["max"] - m for m, v in zip(med, s, strict=True)]
            err = [low, high]
            ax1.errorbar(pos, med, yerr=err, marker="o", capsize=3, label=name or None)
            pre = [p["summary"]["preemptions"]["median"] for p in ps]
            ax2.plot(pos, pre, marker="o", label=name or None)
        metric = sw.METRICS[exp["primary"]].header
        for ax, title in ((ax1, metric), (ax2, "preemptions")):
            ax.set_xticks(range(len(xs)), xs)
            ax.set_xlabel(sw.SHORT.get(xs_key, xs_key))
            ax.set_title(title)
            ax.grid(alpha=0.3)
            if any(series):
                ax.legend(fontsize=7)
        fig.suptitle(f"{doc['sweep']}: {exp['title']}")
        fig.tight_layout()
        path = out / f"{stem}-{exp['name']}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths

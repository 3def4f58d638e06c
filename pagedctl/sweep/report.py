"""A sweep's results as one JSON-ready document, and its tables and files (JSON, CSV, Markdown).

Everything written is rendered from one document (`to_doc`), so the files agree.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from rich.table import Table

from pagedctl.sweep.metrics import METRICS, fmt
from pagedctl.sweep.plot import write_plots
from pagedctl.sweep.recipe import Point
from pagedctl.sweep.run import SweepResult
from pagedctl.sweep.settings import ENGINE_KEYS, SHORT, show_value


def to_doc(result: SweepResult, command: str, environment: dict) -> dict[str, Any]:
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
                "reference": r.point.reference,
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
        "metrics": {k: m.doc for k, m in METRICS.items()},
        "experiments": experiments,
    }


def _varying(points: list[Point]) -> list[list[str]]:
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
    refs = {m for p in points for m in p["reference"]}
    failed = any(p["status"] != "ok" for p in points)
    # Settings that vary get a column, unless the labels already say them (grid points).
    varying = [
        (section, key)
        for section, key in exp["varying"]
        if not all(f"{SHORT.get(key, key)}=" in p["label"] for p in points)
    ]
    headers = ["point"] + [SHORT.get(k, k) for _, k in varying]
    headers += ["blocks", "pool tok"]
    host = any(p["memory"].get("num_host_blocks") for p in points)  # a swap pool somewhere
    if host:
        headers.append("host blocks")
    base = next((p for p in points if p["status"] == "ok"), None)
    for m in exp["columns"]:
        headers.append(METRICS[m].header)
        if m == primary and multi:
            headers.append("spread")
        if m == primary and len(points) > 1 and exp["mode"] == "batch":
            headers.append("vs first")
        if m in refs:
            headers.append(f"ref {METRICS[m].header}")
    if failed:
        headers.append("status")
    rows = []
    for p in points:
        row = [p["label"] or "default"]
        row += [show_value(p[section].get(key)) for section, key in varying]
        mem = p["memory"]
        row += [f"{mem['num_blocks']:,}" if mem else "–", f"{mem['pool_tokens']:,}" if mem else "–"]
        if host:
            row.append(f"{mem['num_host_blocks']:,}" if mem else "–")
        for m in exp["columns"]:
            med = p["summary"].get(m, {}).get("median")
            row.append(fmt(m, med))
            if m == primary and multi:
                row.append(_spread(p["summary"].get(m)))
            if m == primary and len(points) > 1 and exp["mode"] == "batch":
                ref = base["summary"].get(m, {}).get("median") if base else None
                row.append(f"{med / ref - 1:+.1%}" if med is not None and ref else "–")
            if m in refs:
                row.append(fmt(m, p["reference"].get(m)))
        if failed:
            row.append("ok" if p["status"] == "ok" else f"failed: {p['error']}")
        rows.append(row)
    return headers, rows


def _spread(s: dict | None) -> str:
    if not s or not s["median"]:
        return "–"
    return f"{(s['max'] - s['min']) / abs(s['median']):.1%}"


def comparison_rows(exp: dict) -> tuple[list[str], list[list[str]]]:
    headers = ["comparison", "ours", "over repeats", "reference", "expected", "holds"]
    fixed = {"finished", "preemptions", "requests"}  # counts: shown as they are
    rows = []
    for c in exp["comparisons"]:
        ratio = c["den"] is not None

        def show(v: float | None, ratio: bool = ratio, metric: str = c["metric"]) -> str:
            if v is None:
                return "–"
            if ratio:
                return f"{v:,.3g}x"
            return f"{v:,.0f}" if metric in fixed else fmt(metric, v)

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
            [
                c["label"],
                show(c["value"]),
                span,
                show(c["reference"]),
                ", ".join(expected) or "–",
                holds,
            ]
        )
    return headers, rows


def title(exp: dict, doc: dict) -> str:
    """The title of an experiment's table."""
    return f"{exp['title']} ({_repeats_note(doc)})"


def rich_table(exp: dict, doc: dict) -> Table:
    headers, rows = table(exp, doc)
    t = Table(title=title(exp, doc), title_justify="left")
    for i, h in enumerate(headers):
        t.add_column(h, justify="left" if i == 0 or h == "status" else "right")
    for row in rows:
        t.add_row(*row)
    return t


def comparisons_title(exp: dict) -> str:
    return f"{exp['title']}: comparisons"


def rich_comparisons(exp: dict) -> Table:
    headers, rows = comparison_rows(exp)
    t = Table(title=comparisons_title(exp), title_justify="left")
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
            "with the reference figures.",
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
            row.update({k: p["engine"].get(k, "") for k in ENGINE_KEYS})
            row["workload"] = json.dumps(p["workload"], sort_keys=True)
            row["pool_blocks"] = p["memory"].get("num_blocks", "")
            row["pool_tokens"] = p["memory"].get("pool_tokens", "")
            row["host_blocks"] = p["memory"].get("num_host_blocks", "")
            row["repeats"] = len(p["runs"])
            for m in METRICS:
                s = p["summary"].get(m, {})
                for stat in ("median", "min", "max"):
                    row[f"{m}_{stat}"] = s.get(stat, "")
                row[f"reference_{m}"] = p["reference"].get(m, "")
            rows.append(row)
    return rows


def file_names(stem: str, experiments: list[str], plot: bool) -> list[str]:
    """The files a sweep may write: JSON, CSV, Markdown, and with `plot` a PNG per experiment
    (`plot.write_plots`'s names)."""
    names = [f"{stem}.json", f"{stem}.csv", f"{stem}.md"]
    return names + ([f"{stem}-{e}.png" for e in experiments] if plot else [])


def write_outputs(doc: dict, out: Path, stem: str, plot: bool) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / name for name in file_names(stem, [], plot=False)]
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

"""Sweep recipes: points, experiments and comparisons read from YAML and checked.

A recipe holds experiments. Each experiment is a list of points (explicit `points`, a grid of
`axes`, or every point under every grid combination), a run mode (`batch`: all requests at once;
`sequential`: one request after another, each timed), the columns of its table, reference
figures beside ours (another system's, e.g. vLLM's on a T4) and comparisons (ratios between
points, the reference ratio, the expected range). The
command line's axis flags make a one-experiment recipe of their own (`grid_recipe`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pagedctl.recipe_file import read_recipe
from pagedctl.sweep.metrics import DEFAULT_COLUMNS, METRICS, with_swap_columns
from pagedctl.sweep.settings import (
    DEFAULT_WORKLOAD,
    LENGTH_KEYS,
    LOAD_KEYS,
    POOL_KEYS,
    SHORT,
    check_engine,
    check_keys,
    check_value,
    check_warmup,
    check_workload,
    fail,
    merge_workload,
    parse_axes,
    show_value,
)

# fmt: off
MODES = ("batch", "sequential")
TOP_KEYS = ("name", "description", "repeats", "warmup", "engine", "workload", "experiments",
            *LOAD_KEYS)
EXPERIMENT_KEYS = ("name", "title", "note", "why", "mode", "engine", "workload", "axes", "points",
                   "columns", "primary", "compare")
POINT_KEYS = ("label", "engine", "workload", "reference")
COMPARE_KEYS = ("label", "metric", "num", "den", "den_metric", "reference", "expect_min",
                "expect_max", "expect")
# fmt: on


@dataclass(frozen=True)
class Point:
    """One configuration: complete engine settings (recipe < experiment < point < grid) and the
    workload, with reference figures for it (metric -> value)."""

    label: str
    engine: dict[str, Any]
    workload: dict[str, Any]
    reference: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Compare:
    """A comparison row: `metric` of point `num` divided by `den_metric` (default: `metric`) of
    point `den`, or `num`'s value alone when there is no `den`.

    `expect` may be "within_spread": the ratio is within the repeats' spread of 1.
    """

    label: str
    metric: str
    num: str
    den: str | None = None
    den_metric: str | None = None
    reference: float | None = None
    expect_min: float | None = None
    expect_max: float | None = None
    expect: str | None = None


@dataclass
class Experiment:
    """A table: its points, how they run, what it shows and compares."""

    name: str
    title: str
    points: list[Point]
    mode: str = "batch"
    columns: tuple[str, ...] = DEFAULT_COLUMNS
    primary: str = "output_tok_s"
    compare: list[Compare] = field(default_factory=list)
    note: str = ""
    why: str = ""


@dataclass
class SweepRecipe:
    """A checked sweep recipe (or the one the command line's axes make)."""

    name: str
    experiments: list[Experiment]
    description: str = ""
    load: dict[str, Any] = field(default_factory=dict)  # settings that need the model loaded anew
    repeats: int = 3
    warmup: str = "short"  # see WARMUPS and `run_point`
    scale: float = 1.0


def load_sweep_recipe(path: Path) -> SweepRecipe:
    """Read and check a sweep recipe: a typo is an error, not a silent default."""
    doc = read_recipe(path)
    where = f"recipe {path}"
    doc = check_keys(where, doc, TOP_KEYS)
    engine = check_engine(f"{where}, engine", doc.get("engine"))
    workload = check_workload(f"{where}, workload", doc.get("workload"))
    raw = doc.get("experiments") or [{"name": "grid"}]
    if not isinstance(raw, list):
        raise fail(where, "experiments must be a list")
    experiments = [
        _experiment(f"{where}, experiment {i + 1}", e, engine, workload) for i, e in enumerate(raw)
    ]
    names = [e.name for e in experiments]
    if len(set(names)) < len(names):
        raise fail(where, f"experiment names must differ: {names}")
    recipe = SweepRecipe(
        name=str(doc.get("name") or path.stem),
        experiments=experiments,
        description=str(doc.get("description") or ""),
        load={k: check_value(where, k, doc[k]) for k in LOAD_KEYS if doc.get(k) is not None},
        repeats=doc.get("repeats", 3),
        warmup=check_warmup(where, doc.get("warmup", "short")),
    )
    if (
        isinstance(recipe.repeats, bool)
        or not isinstance(recipe.repeats, int)
        or (recipe.repeats < 1)
    ):
        raise fail(where, f"repeats must be an integer >= 1, got {recipe.repeats!r}")
    return recipe


def _experiment(where: str, doc: Any, engine: dict, workload: dict) -> Experiment:
    doc = check_keys(where, doc, EXPERIMENT_KEYS)
    name = str(doc.get("name") or "grid")
    where = f"{where.rsplit(',', 1)[0]}, experiment {name!r}"
    engine = {**engine, **check_engine(f"{where}, engine", doc.get("engine"))}
    workload = merge_workload(workload, check_workload(f"{where}, workload", doc.get("workload")))
    raw_points = doc.get("points") or [{"label": ""}]
    if not isinstance(raw_points, list):
        raise fail(where, "points must be a list")
    points = [
        _point(f"{where}, point {i + 1}", p, engine, workload) for i, p in enumerate(raw_points)
    ]
    points = expand_axes(points, parse_axes(where, doc.get("axes")))
    _check_labels(where, points)
    mode = doc.get("mode", "batch")
    if mode not in MODES:
        raise fail(where, f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    columns = tuple(doc.get("columns") or default_columns(points))
    primary = doc.get("primary") or ("later_ms" if mode == "sequential" else "output_tok_s")
    for metric in (*columns, primary):
        if metric not in METRICS:
            raise fail(where, f"unknown metric {metric!r}; known: {', '.join(METRICS)}")
    labels = {p.label for p in points}
    compare = [_compare(f"{where}, compare {i + 1}", c, labels)
               for i, c in enumerate(doc.get("compare") or [])]  # fmt: skip
    return Experiment(
        name=name,
        title=str(doc.get("title") or name),
        points=points,
        mode=mode,
        columns=columns,
        primary=primary,
        compare=compare,
        note=str(doc.get("note") or "").strip(),
        why=str(doc.get("why") or "").strip(),
    )


def _point(where: str, doc: Any, engine: dict, workload: dict) -> Point:
    doc = check_keys(where, doc, POINT_KEYS)
    reference = check_keys(f"{where}, reference", doc.get("reference"), tuple(METRICS))
    for key, value in reference.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise fail(where, f"reference figure {key} must be a number, got {value!r}")
    return Point(
        label=str(doc.get("label") or ""),
        engine={**engine, **check_engine(f"{where}, engine", doc.get("engine"))},
        workload=merge_workload(
            workload, check_workload(f"{where}, workload", doc.get("workload"))
        ),
        reference={k: float(v) for k, v in reference.items()},
    )


def expand_axes(points: list[Point], axes: list[tuple[str, str, list[Any]]]) -> list[Point]:
    """Every point under every combination of the axes, labelled with the axis values."""
    if not axes:
        return points
    out = []
    for point in points:
        for combo in itertools.product(*(values for _, _, values in axes)):
            engine, workload = dict(point.engine), dict(point.workload)
            parts = [point.label] if point.label else []
            for (section, key, _), value in zip(axes, combo, strict=True):
                if section == "engine":
                    engine[key] = value
                else:
                    workload = merge_workload(workload, {key: value})
                parts.append(f"{SHORT.get(key, key)}={show_value(value)}")
            out.append(replace(point, label=" ".join(parts), engine=engine, workload=workload))
    return out


def default_columns(points: list[Point]) -> tuple[str, ...]:
    """The columns of an experiment that names none: the swap columns too where a point swaps."""
    swaps = any(p.engine.get("preemption_mode", "recompute") != "recompute" for p in points)
    return with_swap_columns(DEFAULT_COLUMNS) if swaps else DEFAULT_COLUMNS


def _check_labels(where: str, points: list[Point]) -> None:
    labels = [p.label for p in points]
    if len(points) > 1 and (len(set(labels)) < len(labels) or "" in labels):
        raise fail(where, f"points need distinct, non-empty labels: {labels}")


def _compare(where: str, doc: Any, labels: set[str]) -> Compare:
    doc = check_keys(where, doc, COMPARE_KEYS)
    for key in ("label", "metric", "num"):
        if key not in doc:
            raise fail(where, f"needs {key}")
    for key in ("metric", "den_metric"):
        if doc.get(key) is not None and doc[key] not in METRICS:
            raise fail(where, f"unknown {key} {doc[key]!r}; known: {', '.join(METRICS)}")
    for key in ("num", "den"):
        if doc.get(key) is not None and str(doc[key]) not in labels:
            raise fail(where, f"{key} {doc[key]!r} is not a point label ({sorted(labels)})")
    if doc.get("expect") not in (None, "within_spread"):
        raise fail(where, "expect may only be within_spread (use expect_min / expect_max)")
    nums = {k: doc.get(k) for k in ("reference", "expect_min", "expect_max")}
    for key, value in nums.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise fail(where, f"{key} must be a number, got {value!r}")
    return Compare(
        label=str(doc["label"]),
        metric=doc["metric"],
        num=str(doc["num"]),
        den=None if doc.get("den") is None else str(doc["den"]),
        den_metric=doc.get("den_metric"),
        expect=doc.get("expect"),
        **{k: None if v is None else float(v) for k, v in nums.items()},
    )


def grid_recipe(
    axes: list[tuple[str, str, list[Any]]],
    workload: dict[str, Any],
    engine: dict[str, Any],
    load: dict[str, Any],
    name: str = "sweep",
    **top: Any,
) -> SweepRecipe:
    """The one-experiment recipe of `pagedctl sweep --block-size 16,32 ...` without --recipe."""
    point = Point("", dict(engine), merge_workload(DEFAULT_WORKLOAD, workload))
    points = expand_axes([point], axes)
    title = " x ".join(SHORT.get(key, key) for _, key, _ in axes) or "one point"
    experiment = Experiment("grid", title, points, columns=default_columns(points))
    return SweepRecipe(name, [experiment], load=load, **top)


def add_axes(recipe: SweepRecipe, axes: list[tuple[str, str, list[Any]]]) -> None:
    """Lay command-line axes over every experiment of a recipe (points x the new grid); an
    experiment on the default columns gets the swap columns where a point now swaps."""
    for exp in recipe.experiments:
        exp.points = expand_axes(exp.points, axes)
        if exp.columns == DEFAULT_COLUMNS:
            exp.columns = default_columns(exp.points)


def scale_recipe(recipe: SweepRecipe, factor: float) -> None:
    """Scale token quantities by `factor`: lengths, pools and max_model_len; counts stay.

    Requests and pools shrink together, so a pool oversubscribed 2.6x stays so.
    """
    if factor == 1.0:
        return
    from pagedctl.engine import parse_bytes

    def scaled(value: Any, low: int = 1) -> Any:
        if isinstance(value, list | tuple):
            return [scaled(v, low) for v in value]
        return max(low, round(value * factor))

    for exp in recipe.experiments:
        for i, p in enumerate(exp.points):
            engine, workload = dict(p.engine), dict(p.workload)
            for key in POOL_KEYS:
                if engine.get(key) is not None:
                    value = engine[key]
                    engine[key] = scaled(
                        parse_bytes(value) if key == "kv_cache_memory_bytes" else value
                    )
            for key in LENGTH_KEYS:
                if workload.get(key) is not None:
                    workload[key] = scaled(workload[key], 0 if key == "suffix_len" else 1)
            exp.points[i] = replace(p, engine=engine, workload=workload)
    recipe.scale = factor

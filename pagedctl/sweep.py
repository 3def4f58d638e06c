"""`pagedctl sweep`: one workload under many engine settings, and experiments written as recipes.

The model is loaded once. For each point the KV pool, scheduler and runner are rebuilt
(`LLM.reconfigure`); an untimed warm-up runs (JIT compilation, first-use allocations); then
`repeats` timed runs, each starting from an empty prefix cache. A run is measured from the engine's
own counters (`LLM.stats` after minus before) and from one look at the pool after every step.

A recipe holds experiments. Each experiment is a list of points (explicit `points`, a grid of
`axes`, or every point under every grid combination), a run mode (`batch`: all requests at once;
`sequential`: one request after another, each timed), the columns of its table, the seed's figures
beside ours and comparisons (ratios between points, the seed's ratio, the expected range). The
command line's axis flags make a one-experiment recipe of their own (`grid_recipe`).
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import logging
import math
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from pagedctl.recipes import RecipeError

logger = logging.getLogger("pagedctl.sweep")

# fmt: off
ENGINE_KEYS = ("block_size", "num_blocks", "kv_cache_memory", "gpu_memory_utilization",
               "max_num_seqs", "max_num_batched_tokens", "max_model_len", "enable_prefix_caching",
               "cuda_graphs", "num_scheduler_steps")
ALIASES = {"gpu_mem": "gpu_memory_utilization", "prefix_caching": "enable_prefix_caching"}
SHORT = {v: k for k, v in ALIASES.items()}  # names shown in labels and tables
_INT_KEYS = {"block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
             "num_scheduler_steps"}
_BOOL_KEYS = {"enable_prefix_caching", "cuda_graphs", "prime", "ignore_eos"}
WORKLOAD_KINDS: dict[str, tuple[str, ...]] = {
    "random": ("num_requests", "prompt_len", "output_len", "token_ids", "seed", "temperature", "n"),
    "shared_prefix": ("num_requests", "prefix_len", "suffix_len", "output_len", "token_ids", "seed",
                      "temperature", "n", "prime"),
    "file": ("input", "max_tokens", "temperature", "ignore_eos"),
}
WORKLOAD_KEYS = tuple(dict.fromkeys(k for keys in WORKLOAD_KINDS.values() for k in keys))
LENGTH_KEYS = ("prompt_len", "output_len", "prefix_len", "suffix_len")  # scaled by --scale
POOL_KEYS = ("num_blocks", "max_model_len", "kv_cache_memory")  # scaled by --scale too
MODES = ("batch", "sequential")
WARMUPS = ("short", "full", "off")
TOP_KEYS = ("name", "description", "model", "load_format", "dtype", "device", "seed", "repeats",
            "warmup", "engine", "workload", "experiments")
EXPERIMENT_KEYS = ("name", "title", "note", "why", "mode", "engine", "workload", "axes", "points",
                   "columns", "primary", "compare")
POINT_KEYS = ("label", "engine", "workload", "seed")
COMPARE_KEYS = ("label", "metric", "num", "den", "den_metric", "seed", "expect_min", "expect_max",
                "expect")
DEFAULT_WORKLOAD = {"kind": "random", "num_requests": 64, "prompt_len": [64, 256],
                    "output_len": [64, 256]}
# fmt: on
WARMUP_REQUESTS, WARMUP_TOKENS = 256, 8


@dataclass(frozen=True)
class Metric:
    """One measured quantity: its table header, format and meaning."""

    header: str
    fmt: str
    doc: str


METRICS: dict[str, Metric] = {
    "requests": Metric("requests", ",.0f", "requests in the run"),
    "finished": Metric("finished", ",.0f", "requests that finished without an error"),
    "failed": Metric("failed", ",.0f", "requests refused or failed"),
    "prompt_tokens": Metric("prompt tok", ",.0f", "prompt tokens of the finished requests"),
    "output_tokens": Metric("output tok", ",.0f", "tokens generated, all samples"),
    "wall_s": Metric("wall s", ",.3f", "wall time of the run"),
    "requests_per_s": Metric("req/s", ",.2f", "finished requests per second"),
    "output_tok_s": Metric("out tok/s", ",.0f", "generated tokens per second"),
    "total_tok_s": Metric("total tok/s", ",.0f", "prompt + generated tokens per second"),
    "preemptions": Metric("preemptions", ",.0f", "sequences put back (recompute)"),
    "recomputed_tokens": Metric("recomputed", ",.0f", "tokens computed again after preemption"),
    "recomputed_share": Metric("recomp. %", ".1%", "recomputed / all computed tokens"),
    "prefill_tokens": Metric("prefill tok", ",.0f", "tokens computed in prefill (and recompute)"),
    "decode_tokens": Metric("decode tok", ",.0f", "tokens computed one at a time"),
    "prefix_hit_rate": Metric("prefix hit %", ".1%", "prefix-cache hits / tokens looked up"),
    "resumed_queried_tokens": Metric(
        "resumed asked", ",.0f", "tokens that preempted sequences looked up on coming back"
    ),
    "resumed_hit_tokens": Metric(
        "resumed cached", ",.0f", "of those, tokens found still in the prefix cache"
    ),
    "resumed_hit_share": Metric("resumed cached %", ".1%", "resumed cached / resumed asked"),
    "peak_kv_usage": Metric("peak KV %", ".1%", "most blocks held, sampled after each step"),
    "mean_kv_usage": Metric("mean KV %", ".1%", "blocks held, mean over steps"),
    "waste_slots": Metric(
        "waste slots", ",.0f", "allocated slots holding no token, mean over steps"
    ),
    "waste_share": Metric("waste %", ".1%", "waste slots / allocated slots, over all steps"),
    "tail_waste": Metric("tail waste tok", ",.1f", "empty slots of the last block, per sequence"),
    "steps": Metric("steps", ",.0f", "engine steps"),
    "first_ms": Metric("first ms", ",.1f", "sequential: the first request's latency (cold)"),
    "later_ms": Metric("again ms", ",.1f", "sequential: median latency of the later ones (warm)"),
}
DEFAULT_COLUMNS = (
    "output_tok_s",
    "total_tok_s",
    "requests_per_s",
    "wall_s",
    "preemptions",
    "recomputed_tokens",
    "recomputed_share",
    "prefix_hit_rate",
    "peak_kv_usage",
    "mean_kv_usage",
    "waste_share",
    "steps",
    "finished",
)


# ---------------------------------------------------------------------------------------- recipe


@dataclass(frozen=True)
class Point:
    """One configuration: complete engine settings (recipe < experiment < point < grid) and the
    workload, with the seed's figures for it (metric -> value)."""

    label: str
    engine: dict[str, Any]
    workload: dict[str, Any]
    seed: dict[str, float] = field(default_factory=dict)


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
    seed: float | None = None
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
    model: str | None = None
    load_format: str = "auto"
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    repeats: int = 3
    warmup: str = "short"  # see WARMUPS and `run_point`
    scale: float = 1.0


def _fail(where: str, message: str) -> RecipeError:
    return RecipeError(f"{where}: {message}")


def _keys(where: str, doc: Any, known: tuple[str, ...]) -> dict:
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise _fail(where, f"must be a mapping, got {doc!r}")
    unknown = sorted(map(str, set(doc) - set(known)))
    if unknown:
        raise _fail(where, f"unknown keys {unknown}; known: {', '.join(known)}")
    return dict(doc)


def check_engine(where: str, doc: Any) -> dict[str, Any]:
    """Engine settings with aliases resolved and each value's type checked."""
    doc = _keys(where, doc, ENGINE_KEYS + tuple(ALIASES))
    out = {}
    for key, value in doc.items():
        key = ALIASES.get(key, key)
        out[key] = check_value(where, key, value)
    return out


def check_value(where: str, key: str, value: Any) -> Any:
    """One engine or workload value, type-checked; None means 'the engine's default'."""
    if value is None:
        return None
    if key in _BOOL_KEYS:
        if isinstance(value, str) and value.lower() in ("on", "off", "true", "false"):
            return value.lower() in ("on", "true")
        if not isinstance(value, bool):
            raise _fail(where, f"{key} must be on/off (true/false), got {value!r}")
    elif key in _INT_KEYS or key in ("num_requests", "n", "seed", "max_tokens"):
        low = 0 if key == "seed" else 1
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise _fail(where, f"{key} must be an integer >= {low}, got {value!r}")
    elif key in ("gpu_memory_utilization", "temperature"):
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise _fail(where, f"{key} must be a number >= 0, got {value!r}")
        value = float(value)
        if key == "gpu_memory_utilization" and not 0 < value <= 1:
            raise _fail(where, f"gpu_mem is a fraction of the device's memory in (0, 1]: {value}")
    elif key in LENGTH_KEYS or key == "token_ids":
        _length(where, key, value)
    elif key == "kv_cache_memory":
        from engine.kv_sizing import parse_bytes

        try:
            parse_bytes(value)
        except (ValueError, TypeError) as e:
            raise _fail(where, f"kv_cache_memory: {e}") from None
    return value


def _length(where: str, key: str, value: Any) -> tuple[int, int]:
    """A length: one integer or an inclusive [low, high] range (token_ids: half-open)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value, value
    ok = isinstance(value, list | tuple) and len(value) == 2
    ok = ok and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    if ok and 0 <= value[0] <= value[1]:
        return int(value[0]), int(value[1])
    raise _fail(where, f"{key} must be an integer or [low, high] with 0 <= low <= high: {value!r}")


def check_workload(where: str, doc: Any, base: Path | None = None) -> dict[str, Any]:
    """Workload keys (any kind's; the kind's own set is checked when the workload is drawn).

    A relative `input` is taken relative to `base` (the recipe's folder).
    """
    doc = _keys(where, doc, ("kind", *WORKLOAD_KEYS))
    if "kind" in doc and doc["kind"] not in WORKLOAD_KINDS:
        raise _fail(where, f"kind must be one of {', '.join(WORKLOAD_KINDS)}, got {doc['kind']!r}")
    out = {k: v if k in ("kind", "input") else check_value(where, k, v) for k, v in doc.items()}
    if out.get("input") is not None:
        path = Path(str(out["input"]))
        out["input"] = str(path if path.is_absolute() or base is None else base / path)
    return out


def merge_workload(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` laid on `base`; a workload of another kind replaces `base` whole."""
    if "kind" in over and over["kind"] != base.get("kind", "random"):
        return dict(over)
    return {**base, **over}


def load_sweep_recipe(path: Path) -> SweepRecipe:
    """Read and check a sweep recipe: a typo is an error, not a silent default."""
    try:
        doc = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise RecipeError(f"cannot read recipe {path}: {e}") from None
    where = f"recipe {path}"
    doc = _keys(where, doc, TOP_KEYS)
    base = path.parent
    engine = check_engine(f"{where}, engine", doc.get("engine"))
    workload = check_workload(f"{where}, workload", doc.get("workload"), base)
    raw = doc.get("experiments") or [{"name": "grid"}]
    if not isinstance(raw, list):
        raise _fail(where, "experiments must be a list")
    experiments = [
        _experiment(f"{where}, experiment {i + 1}", e, engine, workload, base)
        for i, e in enumerate(raw)
    ]
    names = [e.name for e in experiments]
    if len(set(names)) < len(names):
        raise _fail(where, f"experiment names must differ: {names}")
    recipe = SweepRecipe(
        name=str(doc.get("name") or path.stem),
        experiments=experiments,
        description=str(doc.get("description") or ""),
        model=doc.get("model"),
        load_format=str(doc.get("load_format", "auto")),
        dtype=str(doc.get("dtype", "auto")),
        device=str(doc.get("device", "auto")),
        seed=check_value(where, "seed", doc.get("seed", 0)),
        repeats=doc.get("repeats", 3),
        warmup=check_warmup(where, doc.get("warmup", "short")),
    )
    if (
        isinstance(recipe.repeats, bool)
        or not isinstance(recipe.repeats, int)
        or (recipe.repeats < 1)
    ):
        raise _fail(where, f"repeats must be an integer >= 1, got {recipe.repeats!r}")
    return recipe


def check_warmup(where: str, value: Any) -> str:
    """short (the default), full or off; true / false mean short / off."""
    if isinstance(value, bool):
        return "short" if value else "off"
    if value not in WARMUPS:
        raise _fail(where, f"warmup must be one of {', '.join(WARMUPS)}, got {value!r}")
    return value


def _experiment(where: str, doc: Any, engine: dict, workload: dict, base: Path) -> Experiment:
    doc = _keys(where, doc, EXPERIMENT_KEYS)
    name = str(doc.get("name") or "grid")
    where = f"{where.rsplit(',', 1)[0]}, experiment {name!r}"
    engine = {**engine, **check_engine(f"{where}, engine", doc.get("engine"))}
    workload = merge_workload(
        workload, check_workload(f"{where}, workload", doc.get("workload"), base)
    )
    raw_points = doc.get("points") or [{"label": ""}]
    if not isinstance(raw_points, list):
        raise _fail(where, "points must be a list")
    points = [
        _point(f"{where}, point {i + 1}", p, engine, workload, base)
        for i, p in enumerate(raw_points)
    ]
    points = expand_axes(points, parse_axes(where, doc.get("axes")))
    _check_labels(where, points)
    mode = doc.get("mode", "batch")
    if mode not in MODES:
        raise _fail(where, f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    columns = tuple(doc.get("columns") or DEFAULT_COLUMNS)
    primary = doc.get("primary") or ("later_ms" if mode == "sequential" else "output_tok_s")
    for metric in (*columns, primary):
        if metric not in METRICS:
            raise _fail(where, f"unknown metric {metric!r}; known: {', '.join(METRICS)}")
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


def _point(where: str, doc: Any, engine: dict, workload: dict, base: Path) -> Point:
    doc = _keys(where, doc, POINT_KEYS)
    seed = _keys(f"{where}, seed", doc.get("seed"), tuple(METRICS))
    for key, value in seed.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _fail(where, f"seed figure {key} must be a number, got {value!r}")
    return Point(
        label=str(doc.get("label") or ""),
        engine={**engine, **check_engine(f"{where}, engine", doc.get("engine"))},
        workload=merge_workload(
            workload, check_workload(f"{where}, workload", doc.get("workload"), base)
        ),
        seed={k: float(v) for k, v in seed.items()},
    )


def parse_axes(where: str, doc: Any) -> list[tuple[str, str, list[Any]]]:
    """Axes as (section, key, values); a key is an engine setting (or alias) or a workload key."""
    doc = doc or {}
    if not isinstance(doc, dict):
        raise _fail(where, "axes must map a setting to a list of values")
    axes = []
    for name, values in doc.items():
        key = ALIASES.get(name, name)
        section = "engine" if key in ENGINE_KEYS else "workload" if key in WORKLOAD_KEYS else None
        if section is None:
            raise _fail(where, f"unknown axis {name!r}; use an engine setting or a workload key")
        if not isinstance(values, list) or not values:
            raise _fail(where, f"axis {name} must be a non-empty list of values")
        axes.append((section, key, [check_value(f"{where}, axis {name}", key, v) for v in values]))
    return axes


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


def show_value(value: Any) -> str:
    """A setting as labels and tables show it (on/off, low-high, – for the engine's default)."""
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, list | tuple):
        return "-".join(map(str, value))
    return str(value)


def _check_labels(where: str, points: list[Point]) -> None:
    labels = [p.label for p in points]
    if len(points) > 1 and (len(set(labels)) < len(labels) or "" in labels):
        raise _fail(where, f"points need distinct, non-empty labels: {labels}")


def _compare(where: str, doc: Any, labels: set[str]) -> Compare:
    doc = _keys(where, doc, COMPARE_KEYS)
    for key in ("label", "metric", "num"):
        if key not in doc:
            raise _fail(where, f"needs {key}")
    for key in ("metric", "den_metric"):
        if doc.get(key) is not None and doc[key] not in METRICS:
            raise _fail(where, f"unknown {key} {doc[key]!r}; known: {', '.join(METRICS)}")
    for key in ("num", "den"):
        if doc.get(key) is not None and str(doc[key]) not in labels:
            raise _fail(where, f"{key} {doc[key]!r} is not a point label ({sorted(labels)})")
    if doc.get("expect") not in (None, "within_spread"):
        raise _fail(where, "expect may only be within_spread (use expect_min / expect_max)")
    nums = {k: doc.get(k) for k in ("seed", "expect_min", "expect_max")}
    for key, value in nums.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise _fail(where, f"{key} must be a number, got {value!r}")
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
    **top: Any,
) -> SweepRecipe:
    """The one-experiment recipe of `pagedctl sweep --block-size 16,32 ...` without --recipe."""
    point = Point("", dict(engine), merge_workload(DEFAULT_WORKLOAD, workload))
    points = expand_axes([point], axes)
    title = " x ".join(SHORT.get(key, key) for _, key, _ in axes) or "one point"
    return SweepRecipe(experiments=[Experiment("grid", title, points)], **top)


def add_axes(recipe: SweepRecipe, axes: list[tuple[str, str, list[Any]]]) -> None:
    """Lay command-line axes over every experiment of a recipe (points x the new grid)."""
    for exp in recipe.experiments:
        exp.points = expand_axes(exp.points, axes)


def scale_recipe(recipe: SweepRecipe, factor: float) -> None:
    """Scale token quantities by `factor`: lengths, pools and max_model_len; counts stay.

    Requests and pools shrink together, so a pool oversubscribed 2.6x stays so.
    """
    if factor == 1.0:
        return
    from engine.kv_sizing import parse_bytes

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
                    engine[key] = scaled(parse_bytes(value) if key == "kv_cache_memory" else value)
            for key in LENGTH_KEYS:
                if workload.get(key) is not None:
                    workload[key] = scaled(workload[key], 0 if key == "suffix_len" else 1)
            exp.points[i] = replace(p, engine=engine, workload=workload)
    recipe.scale = factor


# ---------------------------------------------------------------------------------------- workload


@dataclass
class Workload:
    """Engine inputs of one run, and the ones run untimed before it (`prime`)."""

    requests: list[dict]
    prime: list[dict] = field(default_factory=list)
    skipped_lines: int = 0

    def warmup(self) -> list[dict]:
        """The requests (the first 256), answers cut to 8 tokens: the run's batch widths, prompt
        lengths and prefix hits, so that compilation and first-use allocations happen untimed."""
        out = []
        for i, req in enumerate(self.requests[:WARMUP_REQUESTS]):
            params = req["sampling_params"]
            params = replace(params, max_tokens=min(params.max_tokens, WARMUP_TOKENS))
            out.append({**req, "request_id": f"warmup-{i}", "sampling_params": params})
        return out


def build_workload(spec: dict[str, Any], vocab_size: int, cache: dict | None = None) -> Workload:
    """Draw (or read) the requests that `spec` describes; `cache` keeps read files."""
    kind = spec.get("kind", "random")
    if kind == "random":
        spec = {**DEFAULT_WORKLOAD, **spec}
    unknown = sorted(k for k in spec if k != "kind" and k not in WORKLOAD_KINDS[kind])
    if unknown:
        raise RecipeError(f"workload keys {unknown} do not apply to a {kind} workload")
    if kind == "file":
        return _file_workload(spec, cache if cache is not None else {})
    lo, hi = _length("workload", "token_ids", spec.get("token_ids") or [0, 10000])
    token_ids = (lo, max(lo + 1, min(hi, vocab_size)))
    if kind == "random":
        return _random_workload(spec, token_ids)
    return _shared_prefix_workload(spec, token_ids)


def _params(spec: dict, max_tokens: int):
    from engine import SamplingParams

    temperature = spec.get("temperature")
    return SamplingParams(
        n=int(spec.get("n") or 1),
        temperature=0.6 if temperature is None else float(temperature),  # W1's
        max_tokens=max_tokens,
        ignore_eos=True,
    )


def _random_workload(spec: dict, token_ids: tuple[int, int]) -> Workload:
    """W1's generator (shared with `pagedctl bench`): prompts first, then output lengths."""
    from pagedctl.bench_recipe import WorkloadSpec, make_workload

    wl = make_workload(
        WorkloadSpec(
            num_requests=int(spec.get("num_requests") or 1),
            prompt_len=_length("workload", "prompt_len", spec["prompt_len"]),
            output_len=_length("workload", "output_len", spec["output_len"]),
            token_ids=token_ids,
            seed=int(spec.get("seed") or 0),
        )
    )
    requests = [
        {"request_id": f"r{i}", "prompt_token_ids": ids, "sampling_params": _params(spec, mt)}
        for i, (ids, mt) in enumerate(zip(wl.prompts, wl.max_tokens, strict=True))
    ]
    return Workload(requests)


def _shared_prefix_workload(spec: dict, token_ids: tuple[int, int]) -> Workload:
    """Requests that begin with one random prefix, each with its own random suffix (maybe none).

    `prime`: one request of the prefix alone runs untimed first, so the prefix is already in the
    pool when the timed requests arrive (with the prefix cache on).
    """
    rng = random.Random(int(spec.get("seed") or 0))
    lo, hi = token_ids
    if "prefix_len" not in spec or "output_len" not in spec:
        raise RecipeError("a shared_prefix workload needs prefix_len and output_len")
    prefix = [rng.randrange(lo, hi) for _ in range(_length("workload", "prefix_len",
                                                           spec["prefix_len"])[0])]  # fmt: skip
    suffix_len = _length("workload", "suffix_len", spec.get("suffix_len") or 0)[0]
    out_lo, out_hi = _length("workload", "output_len", spec["output_len"])
    requests = []
    for i in range(int(spec.get("num_requests") or 1)):
        ids = prefix + [rng.randrange(lo, hi) for _ in range(suffix_len)]
        params = _params(spec, rng.randint(out_lo, out_hi))
        requests.append({"request_id": f"r{i}", "prompt_token_ids": ids, "sampling_params": params})
    prime = []
    if spec.get("prime"):
        params = replace(_params(spec, 1), n=1)
        prime = [{"request_id": "prime", "prompt_token_ids": prefix, "sampling_params": params}]
    return Workload(requests, prime)


def _file_workload(spec: dict, cache: dict) -> Workload:
    """A `generate` input file (both line formats); bad lines are counted and left out."""
    from engine import SamplingParams
    from pagedctl.generate import engine_input
    from pagedctl.jobs.reader import LineError, ReaderLimits, read_requests

    key = (spec["input"], spec.get("max_tokens"), spec.get("temperature"), spec.get("ignore_eos"))
    if key in cache:
        return cache[key]
    path = Path(spec["input"])
    if not path.is_file():
        raise RecipeError(f"input {path} is not a file")
    limits = ReaderLimits(max_tokens_limit=2**30, default_max_tokens=spec.get("max_tokens") or 256)
    defaults = {k: spec[k] for k in ("temperature", "ignore_eos") if spec.get(k) is not None}
    requests, skipped = [], 0
    for item in read_requests(path, limits):
        if isinstance(item, LineError):
            skipped += 1
            logger.warning("%s line %d left out: %s", path, item.line_no, item.message)
            continue
        req = engine_input(item, defaults)
        if spec.get("ignore_eos") is not None:  # the flag wins over the line
            req["sampling_params"] = replace(req["sampling_params"], ignore_eos=spec["ignore_eos"])
        assert isinstance(req["sampling_params"], SamplingParams)
        requests.append(req)
    if not requests:
        raise RecipeError(f"no valid request in {path} ({skipped} bad lines)")
    cache[key] = Workload(requests, skipped_lines=skipped)
    return cache[key]


# ---------------------------------------------------------------------------------------- running


class _StepProbe:
    """Given to `LLM.stream` as `should_stop`: looks at the pool once after every step.

    Also follows preempted sequences (they wait at the front of the queue) to count, when each
    is admitted again, the tokens it looked up and those the prefix cache still held.
    """

    def __init__(self, llm) -> None:
        self.sched = llm.scheduler
        self.num_blocks, self.block_size = self.sched.kv.num_blocks, self.sched.block_size
        self.last_step = self.sched.stats.num_steps
        self.last_waste = self.sched.stats.waste_slot_steps
        self.samples = 0
        self.usage_sum = self.peak_usage = 0.0
        self.used_slots = self.waste = 0
        self.resumed_queried = self.resumed_hit = 0
        self._waiting: list[tuple[Any, int, int]] = []  # (seq, cached tokens, tokens) when seen

    def __call__(self) -> bool:
        stats = self.sched.stats
        if stats.num_steps != self.last_step:
            usage = self.sched.kv.usage
            self.samples += stats.num_steps - self.last_step
            self.usage_sum += usage
            self.peak_usage = max(self.peak_usage, usage)
            self.used_slots += round(usage * self.num_blocks) * self.block_size
            self.waste += stats.waste_slot_steps - self.last_waste
            self.last_step, self.last_waste = stats.num_steps, stats.waste_slot_steps
        self._follow_preempted()
        return False

    def _follow_preempted(self) -> None:
        from engine.sequence import SequenceStatus

        preempted = SequenceStatus.PREEMPTED
        for seq, cached, tokens in self._waiting:
            # Admitted again since the last look (finished in that step, perhaps), not dropped.
            if seq.status != preempted and seq.num_computed_tokens > 0:
                self.resumed_queried += tokens
                self.resumed_hit += seq.num_cached_tokens - cached
        self._waiting = [
            (s, s.num_cached_tokens, s.num_tokens)
            for s in itertools.takewhile(lambda s: s.status == preempted, self.sched.waiting)
        ]


def _run_once(llm, requests: list[dict], mode: str) -> dict[str, float]:
    """Run the requests (all at once, or one after another) and measure the run."""
    before = llm.stats
    probe = _StepProbe(llm)
    outputs, latencies = [], []
    t0 = time.perf_counter()
    if mode == "batch":
        outputs = list(llm.stream(requests, should_stop=probe))
    else:
        for req in requests:
            t = time.perf_counter()
            outputs.extend(llm.stream([req], should_stop=probe))
            latencies.append(time.perf_counter() - t)
    wall = time.perf_counter() - t0
    probe()
    return _metrics(before, llm.stats, probe, outputs, wall, latencies)


def _metrics(before: dict, after: dict, probe: _StepProbe, outputs, wall, latencies) -> dict:
    def diff(section: str, key: str) -> int:
        return after[section][key] - before[section][key]

    ok = [o for o in outputs if o.ok]
    prompt = sum(len(o.prompt_token_ids) for o in ok)
    samples = [(len(o.prompt_token_ids), c) for o in ok for c in o.outputs]
    output = sum(len(c.token_ids) for _, c in samples)
    bs = after["block_size"]
    tails = [-(p + len(c.token_ids) - 1) % bs for p, c in samples if c.finish_reason != "error"]
    computed = diff("scheduler", "num_prefill_tokens") + diff("scheduler", "num_decode_tokens")
    queried = diff("prefix_cache", "queried_tokens")
    steps = diff("scheduler", "num_steps")
    m = {
        "requests": len(outputs),
        "finished": len(ok),
        "failed": len(outputs) - len(ok),
        "prompt_tokens": prompt,
        "output_tokens": output,
        "wall_s": wall,
        "requests_per_s": len(ok) / wall,
        "output_tok_s": output / wall,
        "total_tok_s": (prompt + output) / wall,
        "preemptions": diff("scheduler", "num_preemptions"),
        "recomputed_tokens": diff("scheduler", "num_recomputed_tokens"),
        "recomputed_share": diff("scheduler", "num_recomputed_tokens") / computed
        if computed
        else 0.0,
        "prefill_tokens": diff("scheduler", "num_prefill_tokens"),
        "decode_tokens": diff("scheduler", "num_decode_tokens"),
        "prefix_hit_rate": diff("prefix_cache", "hit_tokens") / queried if queried else 0.0,
        "resumed_queried_tokens": probe.resumed_queried,
        "resumed_hit_tokens": probe.resumed_hit,
        "resumed_hit_share": probe.resumed_hit / probe.resumed_queried
        if probe.resumed_queried
        else 0.0,
        "peak_kv_usage": probe.peak_usage,
        "mean_kv_usage": probe.usage_sum / probe.samples if probe.samples else 0.0,
        "waste_slots": probe.waste / probe.samples if probe.samples else 0.0,
        "waste_share": probe.waste / probe.used_slots if probe.used_slots else 0.0,
        "tail_waste": statistics.fmean(tails) if tails else 0.0,
        "steps": steps,
    }
    if latencies:
        m["first_ms"] = latencies[0] * 1000
        if len(latencies) > 1:
            m["later_ms"] = statistics.median(latencies[1:]) * 1000
    if not ok and outputs:
        m["error"] = outputs[0].error
    return m


@dataclass
class PointResult:
    """What one point did: its status, the pool it got and the metrics of each timed run."""

    point: Point
    status: str  # "ok" or "failed"
    error: str | None = None
    memory: dict[str, Any] = field(default_factory=dict)
    runs: list[dict[str, float]] = field(default_factory=list)

    def summary(self) -> dict[str, dict[str, float]]:
        """metric -> {min, median, max} over the timed runs."""
        out = {}
        for key in METRICS:
            values = [r[key] for r in self.runs if key in r]
            if values:
                out[key] = {
                    "min": min(values),
                    "median": statistics.median(values),
                    "max": max(values),
                }
        return out

    def spread(self, metric: str) -> float | None:
        """(max - min) / median over the repeats."""
        s = self.summary().get(metric)
        if s is None or not s["median"]:
            return None
        return (s["max"] - s["min"]) / abs(s["median"])


@dataclass
class ExperimentResult:
    experiment: Experiment
    points: list[PointResult]

    def by_label(self) -> dict[str, PointResult]:
        return {r.point.label: r for r in self.points}

    def comparisons(self) -> list[dict[str, Any]]:
        return [evaluate(c, self.by_label()) for c in self.experiment.compare]


def evaluate(c: Compare, results: dict[str, PointResult]) -> dict[str, Any]:
    """A comparison's value (ratio of medians), its range over the repeats and its verdict."""
    den_metric = c.den_metric or c.metric
    row: dict[str, Any] = {"label": c.label, "metric": c.metric, "num": c.num, "den": c.den}
    row["den_metric"] = den_metric
    row.update(seed=c.seed, expect_min=c.expect_min, expect_max=c.expect_max, expect=c.expect)
    num, den = results[c.num], results[c.den] if c.den else None
    a = num.summary().get(c.metric)
    b = den.summary().get(den_metric) if den else {"min": 1.0, "median": 1.0, "max": 1.0}
    if a is None or b is None or 0 in (b["min"], b["median"]):
        return {**row, "value": None, "low": None, "high": None, "holds": None}
    value = a["median"] / b["median"]
    low, high = a["min"] / b["max"], a["max"] / b["min"]
    holds = None
    if c.expect == "within_spread":
        spreads = [s for s in (num.spread(c.metric), den.spread(den_metric) if den else 0) if s]
        row["spread"] = max(spreads, default=0.0)
        holds = abs(value - 1) <= row["spread"]
    if c.expect_min is not None or c.expect_max is not None:
        holds = (c.expect_min is None or value >= c.expect_min) and (
            c.expect_max is None or value <= c.expect_max
        )
    return {**row, "value": value, "low": low, "high": high, "holds": holds}


@dataclass
class SweepResult:
    recipe: SweepRecipe
    experiments: list[ExperimentResult]
    engine_info: dict[str, Any]


class SweepError(Exception):
    """The sweep cannot start (model not found, bad workload); the message says what to do."""


def engine_defaults() -> dict[str, Any]:
    """The engine's own default for every setting a point may change."""
    from engine.llm import LLM

    params = inspect.signature(LLM.__init__).parameters
    return {k: params[k].default for k in ENGINE_KEYS}


def load_engine(recipe: SweepRecipe):
    """Load the model once, on a one-block pool that the first point replaces."""
    from engine.llm import LLM
    from engine.weights import ModelNotFoundError, UnsupportedModelError

    try:
        return LLM(
            recipe.model,
            load_format=recipe.load_format,
            dtype=recipe.dtype,
            device=recipe.device,
            seed=recipe.seed,
            num_blocks=1,
            cuda_graphs=False,
        )
    except (ModelNotFoundError, UnsupportedModelError, ValueError) as e:
        raise SweepError(f"cannot start the engine: {e}") from None


def run_sweep(
    recipe: SweepRecipe, llm=None, on_point: Callable[[str, PointResult], None] | None = None
) -> SweepResult:
    """Run every point of every experiment; a point that fails is a result, not an exception."""
    llm = llm or load_engine(recipe)
    defaults = engine_defaults()
    cache: dict = {}
    results = []
    for exp in recipe.experiments:
        points = []
        for point in exp.points:
            settings = {**defaults, **point.engine}
            result = run_point(llm, point, settings, exp.mode, recipe, cache)
            points.append(result)
            if on_point is not None:
                on_point(exp.name, result)
        results.append(ExperimentResult(exp, points))
    return SweepResult(recipe, results, engine_info(llm))


def run_point(llm, point: Point, settings: dict, mode: str, recipe: SweepRecipe, cache: dict):
    """Rebuild the engine for `point`, warm it up, then time `recipe.repeats` runs.

    The warm-up is the timed run itself, untimed (`full`), or with answers cut to 8 tokens and at
    most 256 requests (`short`), in the same mode and after the same primer; or none (`off`).
    """
    result = PointResult(point, "ok")
    try:
        llm.reconfigure(**settings)
        result.memory = {
            "num_blocks": llm.memory["num_blocks"],
            "block_size": llm.memory["block_size"],
            "pool_tokens": llm.memory["num_blocks"] * llm.memory["block_size"],
            "kv_cache_bytes": llm.memory["kv_cache_bytes"],
            "max_model_len": llm.max_model_len,
        }
        workload = build_workload(point.workload, llm.model.vocab_size, cache)
        if recipe.warmup != "off":
            _prime(llm, workload)
            short = recipe.warmup == "short"
            _run_once(llm, workload.warmup() if short else workload.requests, mode)
        for _ in range(recipe.repeats):
            _prime(llm, workload)
            result.runs.append(_run_once(llm, workload.requests, mode))
            if not result.runs[-1]["finished"]:
                raise RuntimeError(f"no request finished: {result.runs[-1].get('error')}")
    except RecipeError:
        raise
    except Exception as e:  # a point that fails is a row with its reason
        logger.debug("point %r failed", point.label, exc_info=True)
        result.status, result.error = "failed", _reason(e)
        _recover(llm)
    return result


def _prime(llm, workload: Workload) -> None:
    """Empty the prefix cache (nothing is in flight between runs), then run the primer if any."""
    if not llm.reset_prefix_cache():
        raise RuntimeError("the prefix cache could not be reset: blocks are still in use")
    if workload.prime:
        list(llm.stream(workload.prime))


def _recover(llm) -> None:
    with contextlib.suppress(Exception):
        if llm.runner is not None:
            llm.abort_all()


def _reason(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    name = type(e).__name__
    text = f"{name}: {text}" if text else name
    return text if len(text) <= 300 else text[:297] + "..."


def engine_info(llm) -> dict[str, Any]:
    """The model, dtype and device the sweep ran on."""
    import torch

    info = {
        "model": llm.source.name,
        "load_format": llm.source.load_format,
        "dtype": str(llm.dtype).removeprefix("torch."),
        "device": str(llm.device),
        "weights_bytes": llm.memory.get("weights_bytes"),
    }
    if llm.device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(llm.device)
        info["gpu_total_bytes"] = torch.cuda.get_device_properties(llm.device).total_memory
    return info


def fmt(metric: str, value: float | None) -> str:
    """A metric's value as its table shows it."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return format(value, METRICS[metric].fmt)

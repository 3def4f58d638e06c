"""Running a sweep: every point of every experiment, and what each did.

The model is loaded once. For each point the KV pool, scheduler and runner are rebuilt
(`LLM.reconfigure`); an untimed warm-up runs (JIT compilation, first-use allocations); then
`repeats` timed runs, each starting from an empty prefix cache (`measure.run_once`).
"""

from __future__ import annotations

import contextlib
import logging
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagedctl.engine import ENGINE_DEFAULTS
from pagedctl.recipe_file import RecipeError
from pagedctl.sweep.measure import run_once
from pagedctl.sweep.metrics import METRICS
from pagedctl.sweep.recipe import Compare, Experiment, Point, SweepRecipe
from pagedctl.sweep.settings import ENGINE_KEYS
from pagedctl.sweep.workload import Workload, build_workload

logger = logging.getLogger("pagedctl.sweep")  # one logger, one name, for the whole package


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
    row.update(
        reference=c.reference, expect_min=c.expect_min, expect_max=c.expect_max, expect=c.expect
    )
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
    return {k: ENGINE_DEFAULTS[k] for k in ENGINE_KEYS}


def load_engine(recipe: SweepRecipe):
    """Load the model once, on a one-block pool that the first point replaces."""
    from pagedctl.engine import LLM
    from pagedctl.models.bundled import engine_settings

    try:
        return LLM(**engine_settings(recipe.load), num_gpu_blocks_override=1, cuda_graphs=False)
    except ValueError as e:  # ModelNotFoundError, UnsupportedModelError, ConfigError
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
            "num_host_blocks": llm.memory["num_host_blocks"],
            "swap_space_bytes": llm.memory["swap_space_bytes"],
            "preemption_costs": llm.stats["swap"]["costs"],  # what `auto` decides by
        }
        workload = build_workload(point.workload, llm.model.vocab_size, cache)
        if recipe.warmup != "off":
            llm.capture_graphs()  # every step graph, outside the timed runs
            _prime(llm, workload)
            short = recipe.warmup == "short"
            run_once(llm, workload.warmup() if short else workload.requests, mode)
        for _ in range(recipe.repeats):
            _prime(llm, workload)
            result.runs.append(run_once(llm, workload.requests, mode))
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
        "model": llm.model_name,
        "load_format": llm.source.load_format,
        "dtype": str(llm.dtype).removeprefix("torch."),
        "device": str(llm.device),
        "weights_bytes": llm.memory.get("weights_bytes"),
    }
    if llm.device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(llm.device)
        info["gpu_total_bytes"] = torch.cuda.get_device_properties(llm.device).total_memory
    return info

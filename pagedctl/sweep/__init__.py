"""`pagedctl sweep`: one workload under many engine settings, and experiments written as recipes.

The model is loaded once. For each point the KV pool, scheduler and runner are rebuilt
(`LLM.reconfigure`); an untimed warm-up runs (JIT compilation, first-use allocations); then
`repeats` timed runs, each starting from an empty prefix cache. A run is measured from the engine's
own counters (`LLM.stats` after minus before) and from one look at the pool after every step.

A recipe holds experiments. Each experiment is a list of points (explicit `points`, a grid of
`axes`, or every point under every grid combination), a run mode (`batch`: all requests at once;
`sequential`: one request after another, each timed), the columns of its table, reference
figures beside ours (another system's, e.g. vLLM's on a T4) and comparisons (ratios between
points, the reference ratio, the expected range). The
command line's axis flags make a one-experiment recipe of their own (`grid_recipe`).

- `metrics`: what a run measures: each metric's header, format and meaning;
- `settings`: the engine settings and workload keys a point may set, each value checked and shown;
- `recipe`: points, experiments and comparisons read from YAML; the flags' grid; `--scale`;
- `workload`: the requests of a point (random, one shared prefix, a `generate` input file);
- `measure`: one timed run and its counts, from the engine's counters and the pool;
- `run`: every point rebuilt, warmed up and timed; the results and their comparisons;
- `report`, `plot`, `cmd`: the document and its files and tables, charts, and the command.

This package re-exports the recipe, workload and run API below, so `from pagedctl import sweep`
reaches it without the command's dependencies (Typer, Rich).
"""

from pagedctl.sweep.metrics import METRICS, Metric
from pagedctl.sweep.recipe import (
    Compare,
    Experiment,
    Point,
    SweepRecipe,
    add_axes,
    expand_axes,
    grid_recipe,
    load_sweep_recipe,
    scale_recipe,
)
from pagedctl.sweep.run import (
    ExperimentResult,
    PointResult,
    SweepError,
    SweepResult,
    engine_defaults,
    engine_info,
    evaluate,
    load_engine,
    run_point,
    run_sweep,
)
from pagedctl.sweep.settings import parse_axes
from pagedctl.sweep.workload import Workload, build_workload

__all__ = [
    "METRICS",
    "Compare",
    "Experiment",
    "ExperimentResult",
    "Metric",
    "Point",
    "PointResult",
    "SweepError",
    "SweepRecipe",
    "SweepResult",
    "Workload",
    "add_axes",
    "build_workload",
    "engine_defaults",
    "engine_info",
    "evaluate",
    "expand_axes",
    "grid_recipe",
    "load_engine",
    "load_sweep_recipe",
    "parse_axes",
    "run_point",
    "run_sweep",
    "scale_recipe",
]

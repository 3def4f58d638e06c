"""Recipes: YAML files that give a job its model, engine settings, sampling defaults and paths.

Precedence: built-in defaults < recipe < command-line flags.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from pagedctl.engine.config import ConfigError, canonical
from pagedctl.recipe_file import RecipeError, read_recipe

SAMPLING_KEYS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "ignore_eos",
)
JOB_KEYS = (
    "input",
    "output",
    "errors",
    "max_line_bytes",
    "fsync_every",
    "summary_json",
    "accept_any_model",
    "replicas",
    "ray_address",
)


@dataclass
class JobSettings:
    """Everything a `generate` run needs, after merging the recipe and the flags."""

    input: Path | None = None
    output: Path | None = None
    errors: Path | None = None
    engine: dict[str, Any] = field(default_factory=dict)
    sampling: dict[str, Any] = field(default_factory=lambda: {"max_tokens": 256})
    max_line_bytes: int = 4 * 2**20
    fsync_every: int = 64
    summary_json: Path | None = None
    accept_any_model: bool = False
    replicas: int | None = None  # engines on a Ray cluster; None: this process's own
    ray_address: str | None = None  # the cluster to join; None: a local one (or RAY_ADDRESS)


def load_recipe(path: Path) -> dict[str, Any]:
    """Read and check a recipe: known sections and keys only, so a typo is an error, not a no-op."""
    doc = read_recipe(path)
    allowed = {"model": None, "engine": None, "sampling": SAMPLING_KEYS, "job": JOB_KEYS}
    for key, value in doc.items():
        if key not in allowed:
            raise RecipeError(f"recipe {path}: unknown section {key!r}; use {', '.join(allowed)}")
        if key == "model":
            continue
        if not isinstance(value, dict):
            raise RecipeError(f"recipe {path}: section {key!r} must be a mapping")
        if key == "engine":
            try:
                doc["engine"] = canonical(value, f"recipe {path}, engine")
            except ConfigError as e:
                raise RecipeError(str(e)) from None
            continue
        keys = allowed[key]
        unknown = sorted(set(value) - set(keys))
        if unknown:
            raise RecipeError(
                f"recipe {path}: unknown {key} keys {unknown}; known: {', '.join(keys)}"
            )
    for key, value in (doc.get("job") or {}).items():
        if value is not None and not _JOB_TYPES[key](value):
            raise RecipeError(f"recipe {path}: job.{key} must be {_JOB_WANTS[key]}, got {value!r}")
    return doc


def _positive_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


_JOB_TYPES = {
    "input": lambda v: isinstance(v, str) and bool(v),
    "output": lambda v: isinstance(v, str) and bool(v),
    "errors": lambda v: isinstance(v, str) and bool(v),
    "summary_json": lambda v: isinstance(v, str) and bool(v),
    "max_line_bytes": _positive_int,
    "fsync_every": _positive_int,
    "accept_any_model": lambda v: isinstance(v, bool),
    "replicas": _positive_int,
    "ray_address": lambda v: isinstance(v, str) and bool(v),
}
_JOB_WANTS = {
    **dict.fromkeys(("input", "output", "errors", "summary_json"), "a path"),
    "max_line_bytes": "an integer >= 1",
    "fsync_every": "an integer >= 1",
    "accept_any_model": "true or false",
    "replicas": "an integer >= 1",
    "ray_address": "auto or HOST:PORT",
}


def merge(
    recipe: dict[str, Any],
    flags: dict[str, Any],
    engine: dict[str, Any],
    base: Path | None = None,
) -> JobSettings:
    """Settings from a checked recipe, then the flags that were given (None means not given)
    and the engine flags that were given (by setting name).

    Relative paths in a recipe are taken relative to the recipe's folder (`base`).
    """
    s = JobSettings()
    if recipe.get("model") is not None:
        s.engine["model"] = str(recipe["model"])
    s.engine.update(recipe.get("engine") or {})
    s.engine.update(engine)
    s.sampling.update(recipe.get("sampling") or {})
    job = recipe.get("job") or {}
    for key in ("input", "output", "errors", "summary_json"):
        if job.get(key) is not None:
            p = Path(job[key])
            setattr(s, key, p if p.is_absolute() or base is None else base / p)
    for key in ("max_line_bytes", "fsync_every", "replicas"):
        if job.get(key) is not None:
            setattr(s, key, int(job[key]))
    if job.get("accept_any_model") is not None:
        s.accept_any_model = job["accept_any_model"]
    if job.get("ray_address") is not None:
        s.ray_address = job["ray_address"]
    for key, value in flags.items():
        if value is None:
            continue
        if key.startswith("sampling_"):
            s.sampling[key.removeprefix("sampling_")] = value
        elif key in {f.name for f in fields(JobSettings)}:
            setattr(s, key, value)
        else:
            raise AssertionError(f"unmapped flag {key}")
    return s

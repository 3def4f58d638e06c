"""Recipes: YAML files that give a job its model, engine settings, sampling defaults and paths.

Precedence: built-in defaults < recipe < command-line flags. A relative path in a recipe is taken
from the current directory, as a flag's is: the same recipe, copied anywhere or run by its shipped
name, reads and writes where the command runs, never beside the recipe (and never inside the
installed package).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedctl.engine import SAMPLING_FIELDS, ConfigError, canonical_settings
from pagedctl.generate.deadline import parse_duration
from pagedctl.generate.records import REASONING_PARSERS
from pagedctl.generate.templates import fields_of
from pagedctl.generate.validate import FieldError, check_max_tokens
from pagedctl.recipe_file import RecipeError, read_recipe

# The sampling fields a job's defaults may set (`SamplingField.job`).
SAMPLING_KEYS = tuple(name for name, spec in SAMPLING_FIELDS.items() if spec.job)
JOB_KEYS = (
    "input",
    "input_dir",
    "output_dir",
    "min_age",
    "time_limit",
    "output",
    "errors",
    "max_line_bytes",
    "fsync_every",
    "summary_json",
    "accept_any_model",
    "replicas",
    "ray_address",
    "chat_template",
    "reasoning_parser",
)


@dataclass
class JobSettings:
    """Everything a `generate` run needs, after merging the recipe and the flags."""

    input: Path | None = None
    output: Path | None = None  # a path template (templates.py) until a run renders it
    errors: Path | None = None
    input_dir: Path | None = None  # a spool folder (spool.py); then `input` is each file of it
    output_dir: Path | None = None
    min_age_s: float = 60.0  # a spool file changed more recently is still being written
    time_limit_s: float | None = None
    engine: dict[str, Any] = field(default_factory=dict)
    sampling: dict[str, Any] = field(
        default_factory=lambda: {"max_tokens": SAMPLING_FIELDS["max_tokens"].default}
    )
    max_line_bytes: int = 4 * 2**20
    fsync_every: int = 64
    summary_json: Path | None = None
    accept_any_model: bool = False
    replicas: int | None = None  # engines on a Ray cluster; None: this process's own
    ray_address: str | None = None  # the cluster to join; None: a local one (or RAY_ADDRESS)
    chat_template: str | None = None  # the text of the chat lines' template; None: the model's
    reasoning_parser: str | None = None  # splits chat answers' <think> blocks (records.py)


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
                doc["engine"] = canonical_settings(value, f"recipe {path}, engine")
            except ConfigError as e:
                raise RecipeError(str(e)) from None
            continue
        keys = allowed[key]
        unknown = sorted(set(value) - set(keys))
        if unknown:
            raise RecipeError(
                f"recipe {path}: unknown {key} keys {unknown}; known: {', '.join(keys)}"
            )
        if key == "sampling" and value.get("max_tokens") is not None:
            try:  # the range of a line's max_tokens (4.0 is 4)
                value["max_tokens"] = check_max_tokens(value["max_tokens"])
            except FieldError as e:
                raise RecipeError(f"recipe {path}: sampling.{e.message}") from None
    for key, value in (doc.get("job") or {}).items():
        if value is not None and not _JOB_TYPES[key](value):
            raise RecipeError(f"recipe {path}: job.{key} must be {_JOB_WANTS[key]}, got {value!r}")
    return doc


def _duration(v: Any, allow_zero: bool = False) -> bool:
    if isinstance(v, bool):
        return False
    try:
        parse_duration(v, allow_zero)
    except ValueError:
        return False
    return True


def _positive_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


_JOB_TYPES = {
    "input": lambda v: isinstance(v, str) and bool(v),
    "input_dir": lambda v: isinstance(v, str) and bool(v),
    "output_dir": lambda v: isinstance(v, str) and bool(v),
    "min_age": lambda v: _duration(v, allow_zero=True),
    "time_limit": _duration,
    "output": lambda v: isinstance(v, str) and bool(v),
    "errors": lambda v: isinstance(v, str) and bool(v),
    "summary_json": lambda v: isinstance(v, str) and bool(v),
    "max_line_bytes": _positive_int,
    "fsync_every": _positive_int,
    "accept_any_model": lambda v: isinstance(v, bool),
    "replicas": _positive_int,
    "ray_address": lambda v: isinstance(v, str) and bool(v),
    "chat_template": lambda v: isinstance(v, str) and bool(v),
    "reasoning_parser": lambda v: v in REASONING_PARSERS,
}
_JOB_WANTS = {
    **dict.fromkeys(("input", "output", "errors", "summary_json"), "a path"),
    **dict.fromkeys(("input_dir", "output_dir"), "a folder"),
    "min_age": "a duration (0, 90, 30s, 5m)",
    "time_limit": "a duration (90, 45m, 2h, 1h30m)",
    "max_line_bytes": "an integer >= 1",
    "fsync_every": "an integer >= 1",
    "accept_any_model": "true or false",
    "replicas": "an integer >= 1",
    "ray_address": "auto or HOST:PORT",
    "chat_template": "the path of a Jinja template file",
    "reasoning_parser": " or ".join(REASONING_PARSERS),
}


PATH_KEYS = ("input", "output", "errors", "summary_json", "input_dir", "output_dir")
TEMPLATE_KEYS = ("output", "errors", "summary_json")


def merge(
    recipe: dict[str, Any], flags: dict[str, Any], engine: dict[str, Any], sampling: dict[str, Any]
) -> JobSettings:
    """Settings from a checked recipe, then the flags that were given (None means not given),
    the engine flags and the sampling flags that were given (by field name). ValueError for a
    duration or a path template that cannot be used, a chat template file that cannot be read,
    or an unknown reasoning parser."""
    s = JobSettings()
    if recipe.get("model") is not None:
        s.engine["model"] = str(recipe["model"])
    s.engine.update(recipe.get("engine") or {})
    s.engine.update(engine)
    s.sampling.update(recipe.get("sampling") or {})
    s.sampling.update(sampling)
    given = {k: v for k, v in (recipe.get("job") or {}).items() if v is not None}
    job_flags = {k: v for k, v in flags.items() if v is not None}
    for one, other in (("input", "input_dir"), ("input_dir", "input")):
        if one in job_flags:  # an input named on the command line replaces the recipe's
            given.pop(other, None)
    given.update(job_flags)
    for key, value in given.items():
        if key in PATH_KEYS:
            setattr(s, key, Path(str(value)).expanduser())
        elif key == "time_limit":
            s.time_limit_s = parse_duration(value)
        elif key == "min_age":
            s.min_age_s = parse_duration(value, allow_zero=True)
        elif key in ("max_line_bytes", "fsync_every", "replicas"):
            setattr(s, key, int(value))
        elif key in ("accept_any_model", "ray_address"):
            setattr(s, key, value)
        elif key == "chat_template":
            s.chat_template = read_chat_template(Path(str(value)).expanduser())
        elif key == "reasoning_parser":
            if value not in REASONING_PARSERS:
                raise ValueError(
                    f"--reasoning-parser must be {' or '.join(REASONING_PARSERS)}, got {value!r}"
                )
            s.reasoning_parser = value
        else:
            raise AssertionError(f"unmapped setting {key}")
    for key in TEMPLATE_KEYS:
        if getattr(s, key) is not None:
            fields_of(str(getattr(s, key)))  # a TemplateError (ValueError) before anything runs
    return s


def read_chat_template(path: Path) -> str:
    """The text of a chat template file; ValueError for one that is missing, unreadable, not
    UTF-8 or empty."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise ValueError(f"cannot read the chat template {path}: {why}") from None
    if not text.strip():
        raise ValueError(f"the chat template {path} is empty")
    return text

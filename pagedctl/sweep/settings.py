"""The settings a point may set: engine settings (and their short names) and workload keys.

Each value is checked here (its type, its range) the same way wherever it comes from: a recipe, an
axis or a flag; and shown here the way labels and tables show it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pagedctl.engine import (
    RUNTIME_SETTING_NAMES,
    SETTING_ALIASES,
    SETTING_NAMES,
    SETTINGS,
    ConfigError,
    coerce_setting,
    setting_short_name,
)
from pagedctl.generate.validate import FieldError, check_max_tokens
from pagedctl.recipe_file import RecipeError

# fmt: off
ENGINE_KEYS = RUNTIME_SETTING_NAMES  # what a point or an axis may set: all but the model's
LOAD_KEYS = tuple(n for n in SETTING_NAMES if SETTINGS[n].load)  # the recipe's own: one model
ALIASES = SETTING_ALIASES
SHORT = {n: setting_short_name(n) for n in SETTING_NAMES if setting_short_name(n) != n}  # labels
WORKLOAD_KINDS: dict[str, tuple[str, ...]] = {
    "random": ("num_requests", "prompt_len", "output_len", "token_ids", "seed", "temperature", "n"),
    "shared_prefix": ("num_requests", "prefix_len", "suffix_len", "output_len", "token_ids", "seed",
                      "temperature", "n", "prime"),
    "file": ("input", "max_tokens", "temperature", "ignore_eos"),
}
WORKLOAD_KEYS = tuple(dict.fromkeys(k for keys in WORKLOAD_KINDS.values() for k in keys))
LENGTH_KEYS = ("prompt_len", "output_len", "prefix_len", "suffix_len")  # scaled by --scale
POOL_KEYS = ("num_gpu_blocks_override", "max_model_len", "kv_cache_memory_bytes")  # scaled too
WARMUPS = ("short", "full", "off")
DEFAULT_WORKLOAD = {"kind": "random", "num_requests": 64, "prompt_len": [64, 256],
                    "output_len": [64, 256]}
# fmt: on


def fail(where: str, message: str) -> RecipeError:
    """The error to raise about `where` (a recipe's part, an axis, a flag)."""
    return RecipeError(f"{where}: {message}")


def check_keys(where: str, doc: Any, known: tuple[str, ...]) -> dict:
    """`doc` as a dict (None: empty) whose keys are all `known`: a typo is an error."""
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise fail(where, f"must be a mapping, got {doc!r}")
    unknown = sorted(map(str, set(doc) - set(known)))
    if unknown:
        raise fail(where, f"unknown keys {unknown}; known: {', '.join(known)}")
    return dict(doc)


def check_engine(where: str, doc: Any) -> dict[str, Any]:
    """Engine settings with aliases resolved and each value's type checked."""
    doc = check_keys(
        where, doc, ENGINE_KEYS + tuple(a for a in ALIASES if ALIASES[a] in ENGINE_KEYS)
    )
    out = {}
    for key, value in doc.items():
        key = ALIASES.get(key, key)
        out[key] = check_value(where, key, value)
    return out


def check_value(where: str, key: str, value: Any) -> Any:
    """One engine or workload value, type-checked; None means 'the engine's default'."""
    if value is None:
        return None
    if key in SETTINGS:
        try:
            return coerce_setting(key, value, where)
        except ConfigError as e:
            raise RecipeError(str(e)) from None
    if key in ("prime", "ignore_eos"):
        if isinstance(value, str) and value.lower() in ("on", "off", "true", "false"):
            return value.lower() in ("on", "true")
        if not isinstance(value, bool):
            raise fail(where, f"{key} must be on/off (true/false), got {value!r}")
    elif key == "max_tokens":  # the range of a job line's max_tokens (4.0 is 4)
        try:
            value = check_max_tokens(value)
        except FieldError as e:
            raise fail(where, e.message) from None
    elif key in ("num_requests", "n", "seed"):
        low = 0 if key == "seed" else 1
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise fail(where, f"{key} must be an integer >= {low}, got {value!r}")
    elif key == "temperature":
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise fail(where, f"{key} must be a number >= 0, got {value!r}")
        value = float(value)
    elif key in LENGTH_KEYS or key == "token_ids":
        low, _ = parse_length(where, key, value)
        if key == "output_len":  # each request's max_tokens
            try:
                check_max_tokens(low, key="output_len")
            except FieldError as e:
                raise fail(where, e.message) from None
    return value


def parse_length(where: str, key: str, value: Any) -> tuple[int, int]:
    """A length: one integer or an inclusive [low, high] range (token_ids: half-open)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value, value
    ok = isinstance(value, list | tuple) and len(value) == 2
    ok = ok and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    if ok and 0 <= value[0] <= value[1]:
        return int(value[0]), int(value[1])
    raise fail(where, f"{key} must be an integer or [low, high] with 0 <= low <= high: {value!r}")


def check_workload(where: str, doc: Any) -> dict[str, Any]:
    """Workload keys (any kind's; the kind's own set is checked when the workload is drawn).

    A relative `input` is the current directory's, as in every recipe (never the recipe's
    folder's: a shipped recipe run by name would read inside the package).
    """
    doc = check_keys(where, doc, ("kind", *WORKLOAD_KEYS))
    if "kind" in doc and doc["kind"] not in WORKLOAD_KINDS:
        raise fail(where, f"kind must be one of {', '.join(WORKLOAD_KINDS)}, got {doc['kind']!r}")
    out = {k: v if k in ("kind", "input") else check_value(where, k, v) for k, v in doc.items()}
    if out.get("input") is not None:
        out["input"] = str(Path(str(out["input"])).expanduser())
    return out


def merge_workload(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` laid on `base`; a workload of another kind replaces `base` whole."""
    if "kind" in over and over["kind"] != base.get("kind", "random"):
        return dict(over)
    return {**base, **over}


def check_warmup(where: str, value: Any) -> str:
    """short (the default), full or off; true / false mean short / off."""
    if isinstance(value, bool):
        return "short" if value else "off"
    if value not in WARMUPS:
        raise fail(where, f"warmup must be one of {', '.join(WARMUPS)}, got {value!r}")
    return value


def parse_axes(where: str, doc: Any) -> list[tuple[str, str, list[Any]]]:
    """Axes as (section, key, values); a key is an engine setting (or alias) or a workload key."""
    doc = doc or {}
    if not isinstance(doc, dict):
        raise fail(where, "axes must map a setting to a list of values")
    axes = []
    for name, values in doc.items():
        key = ALIASES.get(name, name)
        section = "engine" if key in ENGINE_KEYS else "workload" if key in WORKLOAD_KEYS else None
        if section is None:
            raise fail(where, f"unknown axis {name!r}; use an engine setting or a workload key")
        if not isinstance(values, list) or not values:
            raise fail(where, f"axis {name} must be a non-empty list of values")
        axes.append((section, key, [check_value(f"{where}, axis {name}", key, v) for v in values]))
    return axes


def show_value(value: Any) -> str:
    """A setting as labels and tables show it (on/off, low-high, – for the engine's default)."""
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, list | tuple):
        return "-".join(map(str, value))
    return str(value)

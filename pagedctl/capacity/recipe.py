"""Capacity recipes: YAML files whose keys are the command's flags (flags override them), plus
`compare`, reference figures printed beside ours (an entry's `reference` is the other system's
value), and `notes`, how to read them.

    name: t4                         # output files capacity-t4*
    model: qwen2.5-0.5b-instruct
    device_memory: 14.6GiB
    gpu_mem: [0.85, 0.70]
    block_size: [16, 32, 64]
    dist: lognormal:mean=260,median=180
    compare:
      - {figure: kv_tokens@0.85, reference: 929024, tol: 2%, label: cache tokens at 85%}
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pagedctl.recipe_file import RecipeError, read_recipe

KEYS = (
    "name",
    "model",
    "device_memory",
    "gpu",
    "gpu_mem",
    "non_kv_memory",
    "num_blocks",
    "dtype",
    "quantization",
    "block_size",
    "max_len",
    "lengths",
    "outputs",
    "dist",
    "shared_prefix",
    "loads",
    "requests",
    "seed",
    "cuda_context",
    "cuda_graphs",
    "swap_space",
    "compare",
    "compare_source",
    "notes",
)
PATH_KEYS = ("lengths", "outputs")
_COMPARE_KEYS = {"figure", "reference", "tol", "label"}


class CapacityRecipeError(RecipeError):
    """A capacity recipe that cannot be used as written."""


def load_capacity_recipe(path: Path) -> dict[str, Any]:
    """Read and check a recipe; a relative file path is the current directory's, as in every
    recipe."""
    try:
        doc = read_recipe(path)
    except RecipeError as e:
        raise CapacityRecipeError(str(e)) from None
    unknown = sorted(set(doc) - set(KEYS))
    if unknown:
        raise CapacityRecipeError(
            f"recipe {path}: unknown keys {unknown}; known: {', '.join(KEYS)}"
        )
    for key in PATH_KEYS:
        if doc.get(key) is not None:
            doc[key] = str(Path(doc[key]).expanduser())
    for i, entry in enumerate(doc.get("compare") or []):
        if (
            not isinstance(entry, dict)
            or not {"figure", "reference"} <= set(entry) <= _COMPARE_KEYS
        ):
            raise CapacityRecipeError(
                f"recipe {path}: compare[{i}] must be a mapping with figure, reference and "
                "optionally tol, label"
            )
        _tolerance(entry.get("tol"))
    return doc


def as_list(value: Any) -> list:
    """A recipe value or flag that may be one item, a list, or comma-separated text."""
    if value is None:
        return []
    if isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()]
    return list(value) if isinstance(value, list | tuple) else [value]


def _tolerance(tol: Any) -> tuple[str, float]:
    """'2%' -> relative, 0.03 -> absolute, '>=' / '<=' -> one-sided; None -> 2% relative."""
    if tol is None:
        return "rel", 0.02
    text = str(tol).strip()
    try:
        if text in (">=", "<="):
            return text, 0.0
        if text.endswith("%"):
            return "rel", float(text[:-1]) / 100
        return "abs", float(text)
    except ValueError:
        raise CapacityRecipeError(f"tolerance {tol!r}: use 2%, 0.03, >= or <=") from None


def compare_rows(figures: dict[str, float], entries: list[dict]) -> list[dict]:
    """One row per reference figure: its value, ours, the difference and the verdict."""
    rows = []
    for e in entries:
        ref = float(e["reference"])
        ours = figures.get(e["figure"])
        kind, tol = _tolerance(e.get("tol"))
        row = {
            "figure": e["figure"],
            "label": e.get("label", e["figure"]),
            "reference": ref,
            "ours": ours,
            "tol": str(e.get("tol", "2%")),
        }
        if ours is None:
            rows.append({**row, "diff": "n/a", "ok": "n/a"})
            continue
        if kind == "rel":
            rel = (ours - ref) / ref if ref else float("inf") if ours else 0.0
            diff, ok = f"{100 * rel:+.2f}%", abs(rel) <= tol + 1e-12
        else:
            d = ours - ref
            diff = f"{d:+,.0f}" if abs(d) >= 100 else f"{d:+.3g}" if abs(d) >= 1 else f"{d:+.4f}"
            ok = {"abs": abs(ours - ref) <= tol + 1e-12, ">=": ours >= ref, "<=": ours <= ref}[kind]
        rows.append({**row, "diff": diff, "ok": "yes" if ok else "NO"})
    return rows

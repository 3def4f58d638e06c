"""Recipe files: YAML found by path or by name among the recipes pagedctl ships.

`--recipe nano-bench` finds `nano-bench.yaml` in the installed recipes; `--recipe ./mine.yaml`
(anything that names a file) is read as it is.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path
from typing import Any

import yaml


class RecipeError(ValueError):
    """A recipe that cannot be used as written."""


def shipped_recipes() -> dict[str, Path]:
    """Name -> file of every recipe that comes with pagedctl."""
    folder = Path(str(files("pagedctl.recipes")))
    return {p.stem: p for p in sorted(folder.glob("*.yaml"))}


def find_recipe(name_or_path: Path | str) -> Path:
    """The file a `--recipe` value names: an existing path, else a shipped recipe's name
    (`nano-bench`, or `nano-bench.yaml` where no such file is here), also as the repository
    spells it (`recipes/nano-bench.yaml`). A path with a folder that names no file
    (`./mine.yaml`) is an error, never quietly a shipped recipe of that name."""
    text = str(name_or_path)
    path = Path(text).expanduser()
    if path.is_file():
        return path
    shipped = shipped_recipes()
    name = text.removeprefix("recipes/").removesuffix(".yaml")
    is_name = "/" not in text and not text.endswith(".yml")
    if (is_name or text.startswith("recipes/")) and name in shipped:
        return shipped[name]
    raise RecipeError(
        f"no recipe {text!r}: not a file, and not one of the shipped recipes ({', '.join(shipped)})"
    )


def read_recipe(path: Path) -> dict[str, Any]:
    """A recipe file's top-level mapping."""
    try:
        doc = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise RecipeError(f"cannot read recipe {path}: {e}") from None
    if not isinstance(doc, dict):
        raise RecipeError(f"recipe {path} must be a mapping of sections")
    return doc

"""Finding a model by name, offline: a folder, a GGUF file, a config, a preset or a cached id."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ..core.config import LOAD_FORMATS
from .cache import cache_dir, convert_gguf_cached
from .weights import (
    ModelNotFoundError,
    ModelSource,
    hf_snapshot,
    load_config,
    source_from_folder,
)

PRESETS_DIR = Path(__file__).resolve().parent / "presets"  # model configs for dummy-weight runs


def resolve_model(model: str, load_format: str = "auto") -> ModelSource:
    """Find a model by name, offline.

    Tried in order: an existing folder with config.json; a `.gguf` file (converted once into
    the cache); a `.json` config file (dummy); a preset name from `preset_dirs()` (dummy); a
    Hugging Face id in the local cache. `load_format="dummy"` keeps the config (and tokenizer)
    of any of these and drops the weights.

    Raises:
        ModelNotFoundError: nothing matched; the message names everything that was tried.
        UnsupportedModelError: the architecture (or checkpoint format) is not supported.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(
            f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {load_format!r}"
        )
    source = _find(model, load_format)
    if load_format == "dummy":
        return replace(source, load_format="dummy", weights_dir=None)
    if load_format == "safetensors" and source.load_format == "dummy":
        raise ModelNotFoundError(
            f"{source.name!r} is a config without weights; use load_format 'dummy' (random weights)"
        )
    return source


def _find(model: str | None, load_format: str) -> ModelSource:
    path = Path(model).expanduser()
    if path.is_dir():
        return source_from_folder(model, path, weights=load_format != "dummy")
    if path.is_file() and path.suffix == ".gguf":
        return replace(source_from_folder(model, convert_gguf_cached(path)), gguf_file=path)
    if path.is_file() and path.suffix == ".json":
        return ModelSource(model, load_config(path), "dummy", None, None)
    if path.is_file():
        raise ModelNotFoundError(
            f"{path} is a file; pass the folder that holds config.json, a .gguf file or a .json "
            "config"
        )
    presets = list_presets()
    if model in presets:
        return ModelSource(model, load_config(presets[model]), "dummy", None, None)
    snapshot = hf_snapshot(model)
    if snapshot is not None:
        return source_from_folder(model, snapshot, weights=load_format != "dummy")
    from huggingface_hub import constants

    tried = [
        f"a folder or a .gguf/.json file at {path.absolute()} (nothing there)",
        f"a preset in {' or '.join(map(str, preset_dirs()))} (known: {', '.join(sorted(presets))})",
        f"the Hugging Face cache {constants.HF_HUB_CACHE} (offline; no snapshot of {model!r})",
    ]
    raise ModelNotFoundError(f"model {model!r} not found. Looked for: {'; '.join(tried)}. ")


def preset_dirs() -> list[Path]:
    """Folders searched for presets: the repository's, then `$PAGEDCTL_HOME/models/presets`."""
    return [PRESETS_DIR, cache_dir() / "models" / "presets"]


def list_presets() -> dict[str, Path]:
    """Preset name (file stem) -> config file. A user preset replaces a bundled one of its name."""
    found: dict[str, Path] = {}
    for folder in preset_dirs():
        if folder.is_dir():
            found.update({p.stem: p for p in sorted(folder.glob("*.json"))})
    return found

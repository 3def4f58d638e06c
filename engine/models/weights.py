"""Model folders: configs, safetensors weights, tokenizers, the local Hugging Face cache.

Weights are read memory-mapped from safetensors only; pickle checkpoints are refused. Finding a
model by name (a folder, a GGUF file, a preset, a cached id) is `model_source.resolve_model`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .config import ModelConfig
from .registry import UnsupportedModelError, family_of

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


class ModelNotFoundError(ValueError):
    """No model matched the name; the message lists every place that was looked at."""


class PickleCheckpointError(UnsupportedModelError):
    """The folder holds only pickle checkpoints (`.bin`/`.pt`), which can run code when loaded."""


@dataclass(frozen=True)
class ModelSource:
    """Where one model comes from.

    Attributes:
        name: what the user asked for (a path, a preset, a Hugging Face id, the default's name).
        hf_config: the model's config.json (`ModelConfig`: attributes as on a transformers
            config, without importing transformers; `to_transformers()` makes one).
        load_format: "safetensors" (read `weights_dir`) or "dummy" (the model class makes random
            weights).
        weights_dir: folder holding the `*.safetensors` files; None for dummy.
        tokenizer_dir: folder with tokenizer files; None when there are none (a preset).
        gguf_file: the GGUF file the folder was converted from, where it is at hand: its
            quantized tensors load as they are stored (`quantization`).
    """

    name: str
    hf_config: ModelConfig
    load_format: str
    weights_dir: Path | None
    tokenizer_dir: Path | None
    gguf_file: Path | None = None


@dataclass(frozen=True)
class CachedModel:
    """A model with a supported architecture found in the local Hugging Face cache."""

    repo_id: str
    snapshot: Path
    size_bytes: int


def source_from_folder(name: str, folder: Path, weights: bool = True) -> ModelSource:
    """The source of a folder holding config.json (and, unless `weights` is False, safetensors)."""
    config = load_config(folder / "config.json")
    if weights:
        weight_files(folder)  # fail here, with the reason, rather than at load time
    has_tokenizer = any((folder / f).is_file() for f in _TOKENIZER_FILES)
    load_format = "safetensors" if weights else "dummy"
    return ModelSource(
        name,
        config,
        load_format,
        folder if weights else None,
        folder if has_tokenizer else None,
        _kept_gguf(folder) if weights else None,
    )


def _kept_gguf(folder: Path) -> Path | None:
    """The GGUF a converted folder keeps beside its safetensors (the manifest names it)."""
    manifest = folder / "pagedctl-manifest.json"
    if not manifest.is_file():
        return None
    name = json.loads(manifest.read_text()).get("source", {}).get("gguf")
    return folder / name if name and (folder / name).is_file() else None


def load_config(config_file: Path) -> ModelConfig:
    """Read a `config.json`-style file, checking the architecture (transformers is not needed)."""
    if not config_file.is_file():
        raise ModelNotFoundError(f"{config_file.parent} has no config.json")
    config = ModelConfig.from_file(config_file)
    try:
        family_of(config)
    except UnsupportedModelError as e:
        raise UnsupportedModelError(f"{config_file}: {e}") from None
    return config


def weight_files(folder: Path) -> list[Path]:
    """A folder's safetensors files: the shards its index names if it has one, else `*.safetensors`.

    Raises:
        ModelNotFoundError: no weights, or shards named by the index are missing.
        PickleCheckpointError: only pickle checkpoints are there.
    """
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise ModelNotFoundError(f"{index} names shards that are missing: {', '.join(missing)}")
        return [folder / s for s in shards]
    files = sorted(folder.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix in _PICKLE_SUFFIXES)
    if pickles:
        raise PickleCheckpointError(
            f"{folder} holds only pickle checkpoints ({', '.join(pickles)}); pagedctl does not "
            "load pickle files (loading one can run code). Convert to safetensors, e.g. "
            "`AutoModelForCausalLM.from_pretrained(src).save_pretrained(dst)` if you trust the "
            "file, or use load_format 'dummy' for random weights"
        )
    raise ModelNotFoundError(
        f"{folder} has config.json but no *.safetensors weights; use load_format 'dummy' to run "
        "it with random weights"
    )


def iter_weights(source: ModelSource) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(Hugging Face parameter name, tensor)` from the memory-mapped safetensors files."""
    from safetensors import safe_open

    if source.load_format == "dummy" or source.weights_dir is None:
        raise ValueError(
            f"{source.name!r} has load_format 'dummy': the model makes its own weights"
        )
    for file in weight_files(source.weights_dir):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f.get_tensor(name)


def load_tokenizer(source: ModelSource) -> PreTrainedTokenizerBase:
    """Load the source's tokenizer from its folder (offline)."""
    from transformers import AutoTokenizer

    if source.tokenizer_dir is None:
        raise ModelNotFoundError(
            f"{source.name!r} has no tokenizer files; pass token ids, or use a model folder that "
            "has tokenizer.json"
        )
    return AutoTokenizer.from_pretrained(str(source.tokenizer_dir), local_files_only=True)


def hf_snapshot(repo_id: str) -> Path | None:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        path = snapshot_download(repo_id, local_files_only=True, cache_dir=constants.HF_HUB_CACHE)
    except (LocalEntryNotFoundError, HFValidationError):
        return None
    return Path(path)


def cached_hf_models() -> list[CachedModel]:
    """Models in the local Hugging Face cache whose config names a supported architecture."""
    from huggingface_hub import constants, scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        repos = scan_cache_dir(constants.HF_HUB_CACHE).repos
    except CacheNotFound:
        return []
    found = []
    for repo in sorted(repos, key=lambda r: r.repo_id):
        snapshot = hf_snapshot(repo.repo_id) if repo.repo_type == "model" else None
        if snapshot is None or not (snapshot / "config.json").is_file():
            continue
        try:
            load_config(snapshot / "config.json")
        except ValueError:  # unsupported architecture or unreadable config
            continue
        found.append(CachedModel(repo.repo_id, snapshot, repo.size_on_disk))
    return found

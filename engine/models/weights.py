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

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")

_ARCH_BY_MODEL_TYPE = dict(zip(("llama", "qwen2", "qwen3"), SUPPORTED_ARCHITECTURES, strict=True))
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


class ModelNotFoundError(ValueError):
    """No model matched the name; the message lists every place that was looked at."""


class UnsupportedModelError(ValueError):
    """The model exists, but the engine cannot run it (architecture or checkpoint format)."""


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
    """

    name: str
    hf_config: ModelConfig
    load_format: str
    weights_dir: Path | None
    tokenizer_dir: Path | None


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
        name, config, load_format, folder if weights else None, folder if has_tokenizer else None
    )


def load_config(config_file: Path) -> ModelConfig:
    """Read a `config.json`-style file, checking the architecture (transformers is not needed)."""
    if not config_file.is_file():
        raise ModelNotFoundError(f"{config_file.parent} has no config.json")
    raw = json.loads(config_file.read_text())
    model_type = raw.get("model_type")
    arch = (raw.get("architectures") or [_ARCH_BY_MODEL_TYPE.get(model_type)])[0]
    if arch not in SUPPORTED_ARCHITECTURES or model_type not in _ARCH_BY_MODEL_TYPE:
        raise UnsupportedModelError(
            f"{config_file}: architecture {arch or model_type!r} is not supported; "
            f"pagedctl runs {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return ModelConfig(raw)


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


def expected_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter a Llama / Qwen2 / Qwen3 checkpoint of this config holds, with its shape."""
    h, v, inter = config.hidden_size, config.vocab_size, config.intermediate_size
    nh, nkv = config.num_attention_heads, config.num_key_value_heads
    hd = getattr(config, "head_dim", None) or h // nh
    attn_bias = bool(getattr(config, "attention_bias", False))
    qkv_bias = attn_bias or config.model_type == "qwen2"  # Qwen2 always has q/k/v biases
    layer: dict[str, tuple[int, ...]] = {
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (nh * hd, h),
        "self_attn.k_proj.weight": (nkv * hd, h),
        "self_attn.v_proj.weight": (nkv * hd, h),
        "self_attn.o_proj.weight": (h, nh * hd),
        "mlp.gate_proj.weight": (inter, h),
        "mlp.up_proj.weight": (inter, h),
        "mlp.down_proj.weight": (h, inter),
    }
    if qkv_bias:
        layer |= {
            f"self_attn.{p}_proj.bias": layer[f"self_attn.{p}_proj.weight"][:1] for p in "qkv"
        }
    if attn_bias:
        layer["self_attn.o_proj.bias"] = (h,)
    if config.model_type == "qwen3":
        layer |= {"self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,)}
    if getattr(config, "mlp_bias", False):
        layer |= {
            "mlp.gate_proj.bias": (inter,),
            "mlp.up_proj.bias": (inter,),
            "mlp.down_proj.bias": (h,),
        }
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    for i in range(config.num_hidden_layers):
        shapes |= {f"model.layers.{i}.{k}": s for k, s in layer.items()}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    return shapes

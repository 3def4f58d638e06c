"""GGUF files into Hugging Face folders: read, dequantize, write, verify.

`convert_gguf` turns a GGUF file of a family the registry converts (its `gguf_arch`: Llama,
Qwen2, Qwen3, Gemma 2 and 3) into a folder transformers and pagedctl both load: config.json, float16
model.safetensors, generation config, the tokenizer with the GGUF's chat template, and a manifest
saying where it came from.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from datetime import datetime, timezone
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .registry import Family, UnsupportedModelError, gguf_family

if TYPE_CHECKING:
    from gguf import GGUFReader
    from transformers import PretrainedConfig

MANIFEST = "pagedctl-manifest.json"
_FP16_MAX = 65504.0
_SPECIAL_IDS = {  # role -> GGUF key under tokenizer.ggml.
    "bos": "bos_token_id",
    "eos": "eos_token_id",
    "pad": "padding_token_id",
    "unk": "unknown_token_id",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


class GGUFConversionError(RuntimeError):
    """Converting or verifying a model folder failed; the message says what went wrong."""


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Dequantize a GGUF file into a Hugging Face folder in `out_dir`.

    Writes config.json, model.safetensors (float16), generation_config.json, the tokenizer
    (tokenizer.json, tokenizer_config.json with the GGUF's chat template) and a manifest.
    """
    from gguf import GGUFReader
    from transformers import GenerationConfig

    reader = GGUFReader(gguf_path)
    meta = _metadata(reader)
    shapes = {t.name: tuple(reversed(t.shape.tolist())) for t in reader.tensors}
    family = gguf_family(meta.get("general.architecture"))
    rope_freqs = next((t.data for t in reader.tensors if t.name == ROPE_FREQS), None)
    config = _config_from_gguf(family, meta, shapes, rope_freqs)
    out_dir.mkdir(parents=True, exist_ok=True)
    kinds = _write_weights(reader, family, config, out_dir / "model.safetensors")
    config.save_pretrained(out_dir)
    saved = json.loads((out_dir / "config.json").read_text())
    rope = saved["rope_parameters"]
    rope = rope.get("full_attention", rope)  # Gemma 3's: one mapping per layer type
    saved.setdefault("rope_theta", rope["rope_theta"])  # transformers < 5
    (out_dir / "config.json").write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
    ids = {k: getattr(config, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    GenerationConfig(**ids).save_pretrained(out_dir)
    if "tokenizer.ggml.model" in meta:
        _write_tokenizer(gguf_path, meta, config, out_dir)
    conversion = {
        "by": "pagedctl.engine.models.gguf.convert_gguf",
        "dtype": "float16",
        "gguf_tensor_types": kinds,
        "unpermuted_qk": family.gguf_unpermute_qk,
        "versions": {p: version(p) for p in ("gguf", "transformers", "torch", "safetensors")},
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    source = {"gguf": gguf_path.name, "gguf_sha256": sha256_file(gguf_path)}
    name = meta.get("general.name", gguf_path.stem)
    update_manifest(out_dir, model=name, source=source, conversion=conversion)
    return out_dir


def _metadata(reader: GGUFReader) -> dict[str, Any]:
    """The GGUF's scalar and string fields (arrays such as the vocabulary are left out)."""
    from gguf import GGUFValueType

    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        kind = field.types[0] if field.types else GGUFValueType.ARRAY
        if kind == GGUFValueType.STRING:
            meta[key] = bytes(field.parts[field.data[0]]).decode("utf-8")
        elif kind != GGUFValueType.ARRAY:
            meta[key] = field.parts[field.data[0]].tolist()[0]
    return meta


def _config_from_gguf(
    family: Family,
    meta: dict[str, Any],
    shapes: dict[str, tuple[int, ...]],
    rope_freqs: np.ndarray | None = None,
) -> PretrainedConfig:
    from transformers import AutoConfig

    arch = family.gguf_arch
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise UnsupportedModelError(
            f"this GGUF uses RoPE scaling ({scaling}), which pagedctl does not convert (it "
            "converts linear scaling); use the model's Hugging Face safetensors folder instead"
        )

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    heads, hidden = get("attention.head_count"), get("embedding_length")
    kwargs: dict[str, Any] = {
        "architectures": [family.architectures[0]],
        "vocab_size": shapes["token_embd.weight"][0],
        "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "max_position_embeddings": get("context_length"),
        # GGUF stores eps as float32; 7 significant digits give back the decimal that was written.
        "rms_norm_eps": float(f"{get('attention.layer_norm_rms_epsilon', 1e-6):.7g}"),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in shapes,
        "dtype": "float16",
    }
    head_dim = get("attention.key_length", hidden // heads)
    if head_dim != (family.config_defaults["head_dim"] or hidden // heads):
        kwargs["head_dim"] = head_dim  # only where the config class would assume another
    for role, key in _SPECIAL_IDS.items():
        if role != "unk":
            kwargs[f"{role}_token_id"] = meta.get(f"tokenizer.ggml.{key}")
    if family.qkv_bias is None:  # the config's attention_bias says: read it off the tensors
        kwargs["attention_bias"] = "blk.0.attn_q.bias" in shapes
    if scaling == "linear":
        factor = float(meta[f"{arch}.rope.scaling.factor"])
        kwargs["rope_scaling"] = {"rope_type": "linear", "factor": factor}
    if family.gemma:
        kwargs |= _gemma_config(family, get, hidden // heads, head_dim)
    if rope_freqs is not None:
        kwargs["rope_scaling"] = llama3_rope_from_freqs(
            np.asarray(rope_freqs, dtype=np.float32).reshape(-1), kwargs["rope_theta"], head_dim
        )
        kwargs["rope_parameters"] = {**kwargs["rope_scaling"], "rope_theta": kwargs["rope_theta"]}
    return AutoConfig.for_model(family.model_type, **kwargs)


# llama.cpp's Gemma 27B models (Gemma 2: 46 blocks, Gemma 3: 62) scale q by hidden / heads
# rather than by head_dim; its GGUFs do not store `query_pre_attn_scalar`.
_GEMMA_27B_BLOCKS = {"gemma2": 46, "gemma3": 62}


def _gemma_config(family: Family, get: Any, hidden_per_head: int, head_dim: int) -> dict:
    """A Gemma GGUF's config fields beyond Llama's: the window, Gemma 2's soft caps, and the
    query scale llama.cpp derives as it does (Gemma 3's local RoPE base is llama.cpp's fixed
    10,000, the config's default; its window pattern, 6, likewise)."""
    arch = family.gguf_arch
    big = get("block_count") == _GEMMA_27B_BLOCKS.get(arch)
    fields = {
        "sliding_window": get("attention.sliding_window", family.config_defaults["sliding_window"]),
        "query_pre_attn_scalar": hidden_per_head if big else head_dim,
        "head_dim": head_dim,
    }
    if arch == "gemma2":
        fields["attn_logit_softcapping"] = get("attn_logit_softcapping")
        fields["final_logit_softcapping"] = get("final_logit_softcapping")
    return fields


ROPE_FREQS = "rope_freqs.weight"
# Llama 3.1's RoPE band (Meta's configs for 3.1, 3.2 and 3.3 all hold these).
LLAMA3_BAND = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}  # fmt: skip


def llama3_rope_from_freqs(rope_freqs: np.ndarray, theta: float, head_dim: int) -> dict[str, Any]:
    """The Hugging Face `rope_scaling` behind a Llama 3 GGUF's `rope_freqs` (the divisor of each
    rotary frequency, as llama.cpp's converter writes them from it): Llama 3.1's band with the
    largest divisor as `factor`, accepted only where recomputing the divisors from it gives the
    file's to float32 precision; any other set of divisors is refused."""
    factor = float(rope_freqs.max()) if rope_freqs.size else 0.0
    band = LLAMA3_BAND
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    low = band["original_max_position_embeddings"] / band["low_freq_factor"]
    high = band["original_max_position_embeddings"] / band["high_freq_factor"]
    wavelen = 2 * np.pi / freqs
    smooth = (band["original_max_position_embeddings"] / wavelen - band["low_freq_factor"]) / (
        band["high_freq_factor"] - band["low_freq_factor"]
    )
    with np.errstate(divide="ignore"):
        blended = 1 / ((1 - smooth) / max(factor, 1e-30) + smooth)
    want = np.where(wavelen < high, 1.0, np.where(wavelen > low, factor, blended))
    if rope_freqs.shape != want.shape or not np.allclose(rope_freqs, want, rtol=1e-6, atol=0):
        raise UnsupportedModelError(
            f"this GGUF's {ROPE_FREQS} ({rope_freqs.size} divisors, largest {factor:g}) are not "
            "Llama 3's RoPE scaling over 8192 tokens, which is the RoPE scaling pagedctl "
            "converts; use the model's Hugging Face safetensors folder instead"
        )
    return {"rope_type": "llama3", "factor": factor, **band}


def hf_tensor_name(gguf_name: str, family: Family | None = None) -> str | None:
    """The Hugging Face name of a GGUF tensor (`blk.3.attn_q.weight` -> `model.layers.3....`),
    in `family`'s names where they are its own (`Family.gguf_names`)."""
    stem, _, suffix = gguf_name.rpartition(".")
    if stem.startswith("blk."):
        _, layer, part = stem.split(".", 2)
        mapped = (family.gguf_names if family else {}).get(part) or _LAYER_NAMES.get(part)
        return f"model.layers.{layer}.{mapped}.{suffix}" if mapped else None
    mapped = _TOP_NAMES.get(stem)
    return f"{mapped}.{suffix}" if mapped else None


def gguf_norm_offset(family: Family, gguf_name: str) -> float:
    """What llama.cpp's converter added to a tensor: 1 to each of Gemma's RMSNorm weights (its
    kernel scales by the weight, Gemma's by 1 + weight); transformers' GGUF loader takes it off."""
    return 1.0 if family.gemma and gguf_name.endswith("norm.weight") else 0.0


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order for the families that have it (`gguf_unpermute_qk`).

    Per head, llama.cpp's converter interleaves the two rotary halves (row i next to row
    i + head_dim/2) for its RoPE kernel; Hugging Face keeps the halves apart (rotate_half).
    """
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_weights(
    reader: GGUFReader, family: Family, config: PretrainedConfig, path: Path
) -> dict[str, int]:
    """Dequantize every tensor into float16 safetensors; return how many of each GGUF type.

    float16 rather than float32: half the disk and memory, and the reference T4 computes in fp16
    anyway. It loses nothing that matters: Q4_1/Q8_0 values carry at most ~11 significant bits
    (an fp16 scale times a small integer, plus an fp16 offset), so fp16 rounding is far below the
    quantization error. bf16 would drop 3 of those bits. Values above fp16's max are refused.
    """
    from gguf.quants import dequantize
    from safetensors.torch import save_file

    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    tensors: dict[str, torch.Tensor] = {}
    kinds: Counter[str] = Counter()
    for t in reader.tensors:
        name = hf_tensor_name(t.name, family)
        if t.name == ROPE_FREQS:
            continue  # in config.json's rope_scaling
        if name is None:
            raise UnsupportedModelError(f"GGUF tensor {t.name!r} has no Hugging Face counterpart")
        w = dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
        offset = gguf_norm_offset(family, t.name)
        if offset:
            w = w - np.float32(offset)
        part = t.name.split(".")[2] if t.name.startswith("blk.") else ""
        if family.gguf_unpermute_qk and part in heads:
            w = unpermute_qk(w, heads[part])
        peak = float(np.abs(w).max())
        if not peak <= _FP16_MAX:  # also catches NaN
            raise GGUFConversionError(f"GGUF tensor {t.name}: max |value| {peak} overflows float16")
        tensors[name] = torch.from_numpy(w.astype(np.float16))
        kinds[t.tensor_type.name] += 1
    save_file(tensors, str(path), metadata={"format": "pt"})
    return dict(kinds)


def _write_tokenizer(gguf_path: Path, meta: dict[str, Any], config: Any, out_dir: Path) -> None:
    """Build the tokenizer transformers makes from the GGUF metadata; keep template and specials."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    for role, key in _SPECIAL_IDS.items():
        token_id = meta.get(f"tokenizer.ggml.{key}")
        if token_id is not None:
            setattr(tok, f"{role}_token", tok.convert_ids_to_tokens(token_id))
    if "tokenizer.chat_template" in meta:
        tok.chat_template = meta["tokenizer.chat_template"]
    tok.model_max_length = config.max_position_embeddings
    # The template goes into tokenizer_config.json, where every transformers version looks.
    tok.save_pretrained(str(out_dir), save_jinja_files=False)
    path = out_dir / "tokenizer_config.json"
    saved = json.loads(path.read_text())
    for key in ("is_local", "local_files_only", "backend"):  # facts about this load, not the model
        saved.pop(key, None)
    saved["tokenizer_class"] = "PreTrainedTokenizerFast"  # the name every version knows
    path.write_text(json.dumps(saved, indent=2, ensure_ascii=False) + "\n")


def update_manifest(folder: Path, **sections: Any) -> None:
    """Merge `sections` into the folder's manifest (dicts key by key), creating it if missing."""
    path = folder / MANIFEST
    manifest = json.loads(path.read_text()) if path.is_file() else {}
    for key, value in sections.items():
        manifest[key] = manifest.get(key, {}) | value if isinstance(value, dict) else value
    path.write_text(json.dumps(manifest, indent=2) + "\n")


def sha256_file(path: Path) -> str:
    """The file's sha256 as hex, read in 4 MiB chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()

"""A model's `config.json` read without transformers: the engine's own view of a Hugging Face
config, with the defaults transformers gives Llama, Qwen2 and Qwen3 configs.

Importing transformers costs seconds (it pulls in much of torch.distributed, and scikit-learn
or sympy where they are installed); a job of token ids on a preset needs none of it. The
engine reads a config's fields as attributes, as it would a transformers config; the
benchmark peers, which do need one, call `to_transformers()`.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

# Each family's defaults for the fields the engine reads, as transformers' config classes set
# them when config.json leaves them out. None means "derived" (see `__getattr__`).
_COMMON: dict[str, Any] = {
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "attention_bias": False,
    "mlp_bias": False,
    "use_sliding_window": False,
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
    "head_dim": None,
}
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {
        **_COMMON,
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": None,
        "max_position_embeddings": 2048,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "qwen2": {
        **_COMMON,
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 22016,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "max_position_embeddings": 32768,
    },
}
_DEFAULTS["qwen3"] = {**_DEFAULTS["qwen2"], "head_dim": 128}


class ModelConfig:
    """The fields of one config.json as attributes, with its family's defaults.

    `model_type` must be one of llama, qwen2, qwen3 (checked by the caller); an unknown
    field that config.json does not hold raises AttributeError, so `getattr(cfg, name,
    default)` behaves as it does on a transformers config.
    """

    def __init__(self, raw: dict[str, Any]) -> None:
        self._raw = dict(raw)
        self._defaults = _DEFAULTS.get(raw.get("model_type"), _COMMON)

    @classmethod
    def from_file(cls, path: Path) -> ModelConfig:
        return cls(json.loads(path.read_text()))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        raw, defaults = self._raw, self._defaults
        if name in raw and not (name == "num_key_value_heads" and raw[name] is None):
            return raw[name]
        if name == "num_key_value_heads" and defaults.get(name) is None:
            return self.num_attention_heads  # Llama: as many KV heads as query heads
        if name == "head_dim" and defaults.get(name) is None:
            return self.hidden_size // self.num_attention_heads
        if name == "rope_parameters":  # transformers 5's one dict of rope_theta and rope_scaling
            params = dict(self.rope_scaling or {})
            params["rope_type"] = params.pop("type", None) or params.get("rope_type", "default")
            return {**params, "rope_theta": float(self.rope_theta)}
        if name in defaults:
            return defaults[name]
        raise AttributeError(f"the model's config has no {name!r}")

    def __deepcopy__(self, memo: dict) -> ModelConfig:
        return ModelConfig(copy.deepcopy(self._raw, memo))

    def __repr__(self) -> str:
        return f"ModelConfig({self._raw.get('model_type')!r}, {len(self._raw)} fields)"

    def to_dict(self) -> dict[str, Any]:
        """config.json's own fields (no defaults added)."""
        return dict(self._raw)

    def to_transformers(self) -> Any:
        """The transformers config of the same fields (imports transformers)."""
        from transformers import CONFIG_MAPPING

        return CONFIG_MAPPING[self._raw["model_type"]].from_dict(copy.deepcopy(self._raw))

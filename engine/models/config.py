"""A model's `config.json` read without transformers: the engine's own view of a Hugging Face
config, with the defaults transformers gives its family's configs (`registry.FAMILIES`).

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

from .registry import FAMILIES


class ModelConfig:
    """The fields of one config.json as attributes, with its family's defaults.

    A field that config.json does not hold and its family has no default for (every field, for
    a model_type the registry does not know) raises AttributeError, so `getattr(cfg, name,
    default)` behaves as it does on a transformers config.
    """

    def __init__(self, raw: dict[str, Any]) -> None:
        self._raw = dict(raw)
        family = FAMILIES.get(raw.get("model_type"))
        self._defaults = family.config_defaults if family else {}
        self._local_rope = family.local_rope_theta_field if family else None

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
            partial = raw.get("partial_rotary_factor", defaults.get("partial_rotary_factor"))
            if partial is not None:  # Phi-3 keeps it among the RoPE parameters
                params.setdefault("partial_rotary_factor", partial)
            params = {**params, "rope_theta": float(self.rope_theta)}
            if self._local_rope:  # Gemma 3: one mapping per layer type, as transformers 5 has
                theta = float(getattr(self, self._local_rope))
                local = {"rope_type": "default", "rope_theta": theta}
                return {"full_attention": params, "sliding_attention": local}
            return params
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

"""Rotary position embeddings: a config's RoPE settings, their frequencies (transformers' own
`ROPE_INIT_FUNCTIONS` for every scaled type) and the cos/sin table the attention layers read."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from .registry import UnsupportedModelError

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding settings, already validated.

    Attributes:
        rope_type: one of ROPE_TYPES.
        theta: base wavelength.
        factor: frequency divisor of "linear", "dynamic", "llama3" and "yarn".
        low_freq_factor, high_freq_factor, original_max_position: "llama3" smoothing band
            (original_max_position: also yarn's and LongRoPE's original length).
        parameters: the config's whole RoPE mapping, as items (yarn's beta_fast, mscale, ...).
        max_position_embeddings: the config's, which transformers' RoPE functions read.
    """

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    parameters: tuple[tuple[str, object], ...] = field(default=(), compare=False)
    max_position_embeddings: int = field(default=0, compare=False)


def rope_config(hf_config: object, layer_type: str = "full_attention") -> RopeConfig:
    """Read RoPE settings from `rope_parameters` (transformers 5) or `rope_theta`/`rope_scaling`;
    where `rope_parameters` holds one mapping per layer type (Gemma 3), `layer_type`'s."""
    params = getattr(hf_config, "rope_parameters", None)
    if params is None:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
    if per_layer_rope(params):
        params = params[layer_type]
    theta = float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type")) or "default"
    if rope_type not in ROPE_TYPES:
        raise UnsupportedModelError(
            f"RoPE type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError("partial rotary embeddings are not supported")
    if rope_type == "default":
        return RopeConfig(theta=theta)
    max_positions = int(getattr(hf_config, "max_position_embeddings", 0) or 0)
    items = tuple(sorted((k, v) for k, v in params.items() if k not in ("type", "rope_type")))
    extra = dict(parameters=items, max_position_embeddings=max_positions)
    if rope_type in ("linear", "dynamic"):
        return RopeConfig(rope_type, theta, float(params["factor"]), **extra)
    original = (
        params.get("original_max_position_embeddings")
        or getattr(hf_config, "original_max_position_embeddings", None)  # Phi-3's own field
        or max_positions
    )
    if rope_type in ("yarn", "longrope"):
        factor = float(params.get("factor") or 1.0)  # LongRoPE's: from the two lengths if absent
        return RopeConfig(rope_type, theta, factor, original_max_position=int(original), **extra)
    return RopeConfig(
        "llama3",
        theta,
        float(params["factor"]),
        float(params["low_freq_factor"]),
        float(params["high_freq_factor"]),
        int(original),
        **extra,
    )


def per_layer_rope(params: object) -> bool:
    """Whether a `rope_parameters` mapping has one entry per layer type (Gemma 3's)."""
    return isinstance(params, dict) and isinstance(params.get("sliding_attention"), dict)


def rope_frequencies(head_dim: int, rope: RopeConfig, long: bool = False) -> tuple[Tensor, float]:
    """Inverse frequencies `[head_dim // 2]` (float32, on the CPU) and the factor cos and sin
    are scaled by (yarn's and LongRoPE's attention factor; 1 for the others).

    The default RoPE is computed here; every scaled type by transformers' own
    `ROPE_INIT_FUNCTIONS` (imported only for them), on a config of the same RoPE fields.
    Dynamic NTK is asked for the model's own length, where its frequencies are the unscaled
    ones (transformers scales them only past `max_position_embeddings`, which no sequence
    here reaches); LongRoPE for its short factors, or with `long` its long ones.
    """
    if rope.rope_type == "default":
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float()
        return 1.0 / (rope.theta ** (exponents / head_dim)), 1.0
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = dict(rope.parameters)
    if rope.rope_type != "longrope":  # LongRoPE's factor, when absent, comes from the lengths
        params.setdefault("factor", rope.factor)
    if rope.rope_type == "llama3":
        params.setdefault("low_freq_factor", rope.low_freq_factor)
        params.setdefault("high_freq_factor", rope.high_freq_factor)
    if rope.rope_type in ("llama3", "yarn", "longrope"):
        params.setdefault("original_max_position_embeddings", rope.original_max_position)
    params = {**params, "rope_type": rope.rope_type, "rope_theta": rope.theta}
    config = LlamaConfig(
        hidden_size=head_dim,
        num_attention_heads=1,
        head_dim=head_dim,
        max_position_embeddings=rope.max_position_embeddings or rope.original_max_position,
        rope_theta=rope.theta,
        rope_parameters=params,
        rope_scaling=params,  # transformers 4's name of the same mapping
    )
    seq_len = rope.original_max_position + 1 if long else None  # LongRoPE's switch
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope.rope_type](config, torch.device("cpu"), seq_len)
    return inv_freq.float().cpu(), float(scaling)


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (rotate halves): a cos/sin table looked up by position.

    The table is computed on the CPU in float32, then stored in the model's dtype and device:
    the values Hugging Face computes on every call.

    LongRoPE has two tables. Transformers switches from the short factors to the long ones
    once a sequence passes the original length, and keys already cached keep the rotation they
    were given: a paged cache shared between requests cannot follow that. The engine takes one
    table for all its sequences instead, as vLLM does: the long one when its `max_model_len`
    exceeds the original length (`fit`), the short one otherwise. Outputs then equal
    transformers' for every sequence within the original length (short) or whose prompt
    passes it (long).
    """

    def __init__(self, head_dim: int, max_positions: int, rope: RopeConfig) -> None:
        super().__init__()
        self.head_dim, self.max_positions, self.rope = head_dim, max_positions, rope
        device, dtype = torch.get_default_device(), torch.get_default_dtype()
        self.long = False
        cos, sin = self._table(long=False)
        self.register_buffer("cos", cos.to(device, dtype), persistent=False)
        self.register_buffer("sin", sin.to(device, dtype), persistent=False)

    def _table(self, long: bool) -> tuple[Tensor, Tensor]:
        positions = torch.arange(self.max_positions, dtype=torch.float32, device="cpu")
        inv_freq, scaling = rope_frequencies(self.head_dim, self.rope, long)
        freqs = torch.outer(positions, inv_freq)
        return freqs.cos() * scaling, freqs.sin() * scaling

    def fit(self, max_model_len: int) -> None:
        """Take the table for an engine whose sequences reach `max_model_len` tokens (only
        LongRoPE has a choice). Call before CUDA graphs are captured: they read the table."""
        long = self.rope.rope_type == "longrope" and max_model_len > self.rope.original_max_position
        if long != self.long:
            cos, sin = self._table(long)
            self.cos = cos.to(self.cos.device, self.cos.dtype)
            self.sin = sin.to(self.sin.device, self.sin.dtype)
            self.long = long

    def forward(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos and sin `[T, 1, head_dim // 2]` for the tokens' `positions` `[T]`."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the two halves of `x` `[T, heads, head_dim]` by the angles behind `cos`/`sin`."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

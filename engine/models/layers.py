"""Building blocks of a Llama-family decoder and the config switches that choose them.

`model_spec` reads a Hugging Face config into a `ModelSpec`, its family's switches from the
registry (rejecting what we do not run); the modules are linear, embedding, RMSNorm, gated MLP
and rotary embedding.

Parameters are created uninitialised (`torch.empty`) in the current default dtype and device;
`load_weights` or `init_dummy_weights` fills them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...kernels import (
    QuantizedWeight,
    invariant_linear,
    pack_linear_weight,
    packed_linear,
    prepare_quantized,
    quantized_embedding,
    quantized_linear,
    rms_norm,
    silu_and_mul,
)
from .registry import Family, UnsupportedModelError, common_window, family_of


class Linear(nn.Module):
    """`y = x @ W^T (+ b)` with uninitialised parameters (no costly init on construction).

    A quantized layer (`quantized=True`) has no float weight until one is loaded: `set_weight`
    takes either a float tensor or a `QuantizedWeight` (kept as `quant`; `pack` prepares it for
    the device's quantized matmul).
    """

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, quantized: bool = False
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        weight = None if quantized else nn.Parameter(torch.empty(out_features, in_features))
        self.weight = weight
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.quant: QuantizedWeight | None = None  # the integer weight, where quantized
        self.packed: object | None = None  # see `pack`
        self.batch_invariant = False  # rows computed alike whatever the batch (`deterministic`)

    def set_weight(
        self, weight: Tensor | QuantizedWeight, device: torch.device, dtype: torch.dtype
    ) -> None:
        """Load a quantized layer's weight: a float tensor (cast to `dtype`) or a
        `QuantizedWeight` (moved to `device`)."""
        if isinstance(weight, QuantizedWeight):
            self.quant, self.weight = weight.to(device), None
        else:
            self.weight = nn.Parameter(weight.to(device, dtype), requires_grad=False)
            self.quant = None

    def pack(self) -> int:
        """Prepare the weight for the device's fastest matmul with it: a quantized weight for
        `quantized_linear` (its prepared form replaces `quant`), a float one packed where the
        kernels have a faster matmul with the same bits (bfloat16 on the CPU). Returns the bytes
        of a packed copy kept beside a float weight. Call after the weight changes."""
        if self.weight is None:
            if self.quant is not None:  # the integers give way to their prepared form
                self.packed, self.quant = prepare_quantized(self.quant), None
            return 0
        self.packed = pack_linear_weight(self.weight)
        return 0 if self.packed is None else self.packed.nbytes

    def forward(self, x: Tensor) -> Tensor:
        """Apply the projection to the rows `[T, in_features]` of `x`."""
        if self.weight is None:
            if self.packed is None:
                self.pack()
            return quantized_linear(x, self.packed, self.bias, self.batch_invariant)
        if self.batch_invariant:
            return invariant_linear(x, self.weight, self.packed, self.bias)
        if self.packed is not None:
            return packed_linear(x, self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)


class Embedding(nn.Module):
    """Token embedding table with an uninitialised weight `[vocab, hidden]`, or a quantized one
    (`quant`, rows dequantized on lookup)."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.weight: nn.Parameter | None = nn.Parameter(torch.empty(num_embeddings, embedding_dim))
        self.quant: QuantizedWeight | None = None
        self.dtype = self.weight.dtype  # of the rows a lookup returns

    def set_quantized(self, weight: QuantizedWeight, device: torch.device) -> None:
        """Keep the table as integers (`kernels.quant`) instead of floats."""
        self.quant, self.weight = weight.to(device), None

    def forward(self, ids: Tensor) -> Tensor:
        """Look up the rows of `ids`."""
        if self.quant is not None:
            return quantized_embedding(ids, self.quant, self.dtype)
        return F.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last axis, computed in float32 (as Hugging Face does)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """Normalise `x` and scale by the learned weight; keeps `x`'s dtype.

        With `residual`, normalises `x + residual` and returns it too (the residual stream),
        in one fused kernel on the GPU.
        """
        return rms_norm(x, self.weight, self.eps, residual)


# a config's activation name -> the gated MLP's
MLP_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


class GatedMLP(nn.Module):
    """Gated MLP with gate and up projections fused into one matmul: `down(act(gate) * up)`,
    `act` SiLU (SwiGLU, the fused kernel) or tanh-approximated GELU (GeGLU, Gemma)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        quantized: bool = False,
        activation: str = "silu",
    ) -> None:
        super().__init__()
        self.activation = activation
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, quantized=quantized)
        self.down_proj = Linear(intermediate_size, hidden_size, quantized=quantized)
        self.batch_invariant = False  # rows computed alike whatever the batch (`deterministic`)

    def forward(self, x: Tensor) -> Tensor:
        """Apply the MLP to `[tokens, hidden]`."""
        gate_up = self.gate_up_proj(x)
        if self.activation == "gelu_tanh":
            gate, up = gate_up.chunk(2, dim=-1)
            return self.down_proj(F.gelu(gate, approximate="tanh") * up)
        act = silu_and_mul(gate_up, batch_invariant=self.batch_invariant)
        return self.down_proj(act)


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


@dataclass(frozen=True)
class ModelSpec:
    """Shape and family switches of a decoder, read from a Hugging Face config.

    `layer_windows` has one entry a layer: the keys a query attends to are the last `window`
    positions up to its own (transformers' sliding window), or all of them (None)."""

    family: Family
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_positions: int
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    rope: RopeConfig
    layer_windows: tuple[int | None, ...] = ()  # per layer: its sliding window, None: full
    local_rope: RopeConfig | None = None  # the windowed layers' own (Gemma 3); None: `rope`
    activation: str = "silu"  # the gated MLP's: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    gemma: bool = False  # (1 + w) norms, scaled embedding, norms around attention and MLP
    attn_scale: float | None = None  # of q.k; None: head_dim ** -0.5
    attn_softcap: float | None = None  # attention logits through cap * tanh(s / cap)
    final_softcap: float | None = None  # output logits likewise
    quantized: bool = False  # projections built without float weights (integers load later)

    @property
    def kv_window(self) -> int | None:
        """The window every layer attends within, so that the KV cache may drop a sequence's
        blocks before it; None where some layer sees the whole history."""
        return common_window(self.layer_windows)


def model_spec(cfg: object) -> ModelSpec:
    """Validate a config of a family the engine runs and read the switches it implies."""
    family = family_of(cfg)
    act = family.read(cfg, family.activation_field)
    if act not in MLP_ACTIVATIONS:
        raise UnsupportedModelError(
            f"{family.activation_field}={act!r} is not supported; pagedctl runs "
            f"{', '.join(MLP_ACTIVATIONS)}"
        )
    if family.read(cfg, "mlp_bias"):
        raise UnsupportedModelError(f"mlp_bias={cfg.mlp_bias!r} is not supported")
    gemma = family.gemma
    head_dim = family.read(cfg, "head_dim") or cfg.hidden_size // cfg.num_attention_heads
    heads = cfg.num_attention_heads
    qkv_bias, o_bias = family.attention_biases(cfg)
    return ModelSpec(
        family=family,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_layers=cfg.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=family.read(cfg, "num_key_value_heads") or heads,
        head_dim=head_dim,
        rms_norm_eps=cfg.rms_norm_eps,
        max_positions=cfg.max_position_embeddings,
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        qk_norm=family.qk_norm,
        tie_word_embeddings=bool(family.read(cfg, "tie_word_embeddings")),
        rope=rope_config(cfg),
        layer_windows=family.layer_windows(cfg),
        local_rope=(
            rope_config(cfg, "sliding_attention")
            if per_layer_rope(getattr(cfg, "rope_parameters", None))
            else None
        ),
        activation=MLP_ACTIVATIONS[act],
        gemma=gemma,
        attn_scale=(family.read(cfg, "query_pre_attn_scalar") if gemma else head_dim) ** -0.5,
        attn_softcap=family.read(cfg, "attn_logit_softcapping") if gemma else None,
        final_softcap=family.read(cfg, "final_logit_softcapping") if gemma else None,
    )


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

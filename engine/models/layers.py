"""Building blocks of a Llama-family decoder and the config switches that choose them.

`model_spec` reads a Hugging Face config into a `ModelSpec`, its family's switches from the
registry (rejecting what we do not run); the modules are linear, embedding, RMSNorm, gated MLP
and rotary embedding (`rope`).

Parameters are created uninitialised (`torch.empty`) in the current default dtype and device;
`load_weights` or `init_dummy_weights` fills them.
"""

from __future__ import annotations

from dataclasses import dataclass

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
from .rope import RopeConfig, per_layer_rope, rope_config


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

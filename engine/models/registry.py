"""The model families pagedctl knows, one frozen spec each: the only place a family is described.

A family's spec says how its Hugging Face configs read (architecture names, `model_type`, the
defaults transformers assumes), which switches of the shared Llama-style layers it turns on, how
its checkpoint tensors are named and which of them the model fuses, how llama.cpp names it in
GGUF files, and which model class runs it. Config parsing (`config.py`), weight loading
(`weights.py`, `llama.py`), GGUF conversion (`gguf.py`), the model builder (`build_model`) and
capacity planning read it here, so adding a family is a spec in `FAMILIES` plus its layer code.

Torch-free: capacity planning and config parsing read it without loading torch.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn


# A Llama-style layer's fused projections and the checkpoint tensors each holds, in row order.
_LLAMA_FUSED: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
)


class UnsupportedModelError(ValueError):
    """The model exists, but the engine cannot run it (architecture, RoPE variant, checkpoint
    format...); the message says what it runs instead."""


@dataclass(frozen=True, eq=False, repr=False)  # one object per family, compared by identity
class Family:
    """One model family: how its configs, checkpoints and GGUF files read, and what runs it.

    Attributes:
        model_type: the Hugging Face config's `model_type`, the family's key.
        architectures: the `architectures` names of its causal-LM checkpoints.
        model_class: "module.Class" under engine/models that runs it; None: the engine does not
            run the family (capacity planning still counts its checkpoints).
        config_defaults: what transformers' config class assumes for a field that config.json
            leaves out; None means derived (`num_key_value_heads`: every attention head,
            `head_dim`: hidden_size / heads).
        qkv_bias, o_bias: whether the q/k/v and the output projections carry biases; None: the
            config's `attention_bias` says.
        qk_norm: a per-head RMSNorm of q and k before RoPE.
        sliding_window_switch: the config field that turns `sliding_window` on; None: a set
            `sliding_window` is always on.
        window_from_layer: the config field naming the first layer the window applies to
            (Qwen2's `max_window_layers`); None: every layer, unless `layer_types` says.
        global_every: where `layer_types` is absent, every this-many-th layer attends to the
            whole history and the others to the window (Gemma 2: 2); None: the rules above.
        global_every_field: the config field that sets `global_every` where present (Gemma 3's
            `sliding_window_pattern`).
        local_rope_theta_field: the config field of the windowed layers' own RoPE base (Gemma
            3's `rope_local_base_freq`: default RoPE, no scaling); None: one RoPE for all.
        activation_field: the config field naming the MLP's activation.
        gemma: Gemma's switches: RMSNorm scaling by (1 + weight), the embedding scaled by
            sqrt(hidden_size), norms after attention and before and after the MLP,
            `query_pre_attn_scalar`, attention and final logit soft-capping.
        gguf_arch: llama.cpp's `general.architecture` for the family; None: no GGUF conversion.
        gguf_unpermute_qk: llama.cpp's converter interleaved each head's rotary halves in the q/k
            rows (its Llama convention); conversion puts them back.
        gguf_names: GGUF layer tensor names -> Hugging Face modules where the family's differ
            from Llama's (Gemma's four norms). llama.cpp also writes Gemma's norms as 1 + weight,
            which conversion takes back (`gemma`).
        fused: a fused projection of the model -> the checkpoint tensors it holds, in row order
            (itself alone: the checkpoint stores it fused, as Phi-3's do).
        unused_weights: name endings of checkpoint tensors the model computes itself.
    """

    model_type: str
    architectures: tuple[str, ...]
    model_class: str | None
    config_defaults: Mapping[str, Any]
    qkv_bias: bool | None = None
    o_bias: bool | None = None
    qk_norm: bool = False
    sliding_window_switch: str | None = "use_sliding_window"
    window_from_layer: str | None = None
    global_every: int | None = None
    global_every_field: str | None = None
    local_rope_theta_field: str | None = None
    activation_field: str = "hidden_act"
    gemma: bool = False
    gguf_arch: str | None = None
    gguf_unpermute_qk: bool = False
    gguf_names: Mapping[str, str] = field(default_factory=dict)
    fused: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: _LLAMA_FUSED)
    unused_weights: tuple[str, ...] = ("rotary_emb.inv_freq",)

    def __repr__(self) -> str:
        return f"Family({self.model_type!r})"

    def attention_biases(self, config: object) -> tuple[bool, bool]:
        """(q/k/v bias, output bias) of a config of this family."""
        bias = bool(self.read(config, "attention_bias"))
        return (
            bias if self.qkv_bias is None else self.qkv_bias,
            bias if self.o_bias is None else self.o_bias,
        )

    def sliding_window(self, config: object) -> int | None:
        """The sliding window a config of this family attends over; None: full attention."""
        switch = self.sliding_window_switch
        if switch is not None and not self.read(config, switch):
            return None
        return self.read(config, "sliding_window") or None

    def layer_windows(self, config: object) -> tuple[int | None, ...]:
        """The window each layer attends over (None: full attention), as transformers reads the
        config: a `layer_types` list where the config has one ("sliding_attention" layers take
        the window), else the family's `window_from_layer` rule, else the one window for all."""
        window = self.sliding_window(config)
        num_layers = config.num_hidden_layers
        kinds = getattr(config, "layer_types", None)  # derived by transformers, no default
        if window is None:
            return (None,) * num_layers
        if kinds:
            if len(kinds) != num_layers:
                raise UnsupportedModelError(
                    f"layer_types lists {len(kinds)} layers, the model has {num_layers}"
                )
            unknown = set(kinds) - {"sliding_attention", "full_attention"}
            if unknown:
                raise UnsupportedModelError(
                    f"layer type {sorted(unknown)[0]!r} is not supported; pagedctl runs "
                    "sliding_attention and full_attention layers"
                )
            return tuple(window if k == "sliding_attention" else None for k in kinds)
        every = self.read(config, self.global_every_field) if self.global_every_field else None
        every = every or self.global_every
        if every:
            return tuple(None if (i + 1) % every == 0 else window for i in range(num_layers))
        first = self.read(config, self.window_from_layer) if self.window_from_layer else 0
        return tuple(window if i >= (first or 0) else None for i in range(num_layers))

    def kv_window(self, config: object) -> int | None:
        """The window every layer attends within, so that a sequence's blocks before it may be
        given back; None where some layer sees the whole history."""
        return common_window(self.layer_windows(config))

    def read(self, config: object, name: str) -> Any:
        """A field of a config of this family (any object with the fields as attributes): the
        family's default where the config lacks it, as transformers' config class reads it."""
        return getattr(config, name, self.config_defaults.get(name))


def common_window(layer_windows: tuple[int | None, ...]) -> int | None:
    """The one sliding window of every layer, or None (a layer of full attention, or layers of
    different windows)."""
    windows = set(layer_windows)
    return next(iter(windows)) if len(windows) == 1 else None


# The defaults transformers' Llama, Qwen2, Qwen3 and Mistral configs share, for the fields the
# engine reads.
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
_QWEN2_DEFAULTS = {
    **_COMMON,
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 22016,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "max_position_embeddings": 32768,
    "max_window_layers": 28,
}
_LLAMA_DECODER = "llama.LlamaForCausalLM"

_LLAMA = Family(
    model_type="llama",
    architectures=("LlamaForCausalLM",),
    model_class=_LLAMA_DECODER,
    config_defaults=MappingProxyType(
        {
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
        }
    ),
    gguf_arch="llama",
    gguf_unpermute_qk=True,
)
_QWEN2 = Family(
    model_type="qwen2",
    architectures=("Qwen2ForCausalLM",),
    model_class=_LLAMA_DECODER,
    config_defaults=MappingProxyType(_QWEN2_DEFAULTS),
    qkv_bias=True,
    o_bias=False,
    window_from_layer="max_window_layers",
    gguf_arch="qwen2",
)
_QWEN3 = Family(
    model_type="qwen3",
    architectures=("Qwen3ForCausalLM",),
    model_class=_LLAMA_DECODER,
    config_defaults=MappingProxyType({**_QWEN2_DEFAULTS, "head_dim": 128}),
    qk_norm=True,
    window_from_layer="max_window_layers",
    gguf_arch="qwen3",
)
# A Llama with a sliding window on every layer whenever `sliding_window` is set (Mistral-7B
# v0.1: 4096; v0.2 and later: null, full attention). llama.cpp writes its GGUFs as "llama".
_MISTRAL = Family(
    model_type="mistral",
    architectures=("MistralForCausalLM",),
    model_class=_LLAMA_DECODER,
    config_defaults=MappingProxyType(
        {
            **_COMMON,
            "vocab_size": 32000,
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "max_position_embeddings": 4096 * 32,
            "sliding_window": 4096,
            "bos_token_id": 1,
            "eos_token_id": 2,
        }
    ),
    sliding_window_switch=None,
)

_GEMMA_GGUF_NAMES: Mapping[str, str] = MappingProxyType(
    {
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    }
)

# Gemma 2: local (sliding) and global layers in turn, Gemma's norms and soft-capping.
_GEMMA2 = Family(
    model_type="gemma2",
    architectures=("Gemma2ForCausalLM",),
    model_class=_LLAMA_DECODER,
    config_defaults=MappingProxyType(
        {
            **_COMMON,
            "vocab_size": 256000,
            "hidden_size": 2304,
            "intermediate_size": 9216,
            "num_hidden_layers": 26,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "hidden_activation": "gelu_pytorch_tanh",
            "max_position_embeddings": 8192,
            "tie_word_embeddings": True,
            "query_pre_attn_scalar": 256,
            "sliding_window": 4096,
            "final_logit_softcapping": 30.0,
            "attn_logit_softcapping": 50.0,
            "bos_token_id": 2,
            "eos_token_id": 1,
            "pad_token_id": 0,
        }
    ),
    sliding_window_switch=None,
    global_every=2,
    activation_field="hidden_activation",
    gemma=True,
    gguf_arch="gemma2",
    gguf_names=_GEMMA_GGUF_NAMES,
)

# Gemma 3 (text): Gemma 2's layers with q/k norms, no soft-capping, five local layers to a global
# one, and the local layers' own RoPE base (10K; the global layers' is 1M, maybe scaled).
_GEMMA3 = replace(
    _GEMMA2,
    model_type="gemma3_text",
    architectures=("Gemma3ForCausalLM",),
    config_defaults=MappingProxyType(
        {
            **_GEMMA2.config_defaults,
            "vocab_size": 262208,
            "max_position_embeddings": 131072,
            "rope_theta": 1_000_000.0,
            "rope_local_base_freq": 10_000.0,
            "sliding_window_pattern": 6,
            "final_logit_softcapping": None,
            "attn_logit_softcapping": None,
        }
    ),
    qk_norm=True,
    global_every=None,  # from its config's sliding_window_pattern (default 6)
    global_every_field="sliding_window_pattern",
    local_rope_theta_field="rope_local_base_freq",
    gguf_arch="gemma3",
)

# Phi-3: a Llama whose checkpoints store q/k/v and gate/up fused, in the engine's row order
# (loaded as they are stored); a sliding window wherever `sliding_window` is set (the 4K
# models: 2047).
_PHI3 = Family(
    model_type="phi3",
    architectures=("Phi3ForCausalLM",),
    model_class=_LLAMA_DECODER,
    config_defaults=MappingProxyType(
        {
            **_COMMON,
            "vocab_size": 32064,
            "hidden_size": 3072,
            "intermediate_size": 8192,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": None,
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-5,
            "sliding_window": None,
            "partial_rotary_factor": 1.0,
            "bos_token_id": 1,
            "eos_token_id": 32000,
            "pad_token_id": 32000,
        }
    ),
    sliding_window_switch=None,
    fused=MappingProxyType({leaf: (leaf,) for leaf in _LLAMA_FUSED}),
)

# model_type -> its family: every family pagedctl knows, run (a `model_class`) or only planned.
FAMILIES: Mapping[str, Family] = MappingProxyType(
    {f.model_type: f for f in (_LLAMA, _QWEN2, _QWEN3, _MISTRAL, _GEMMA2, _GEMMA3, _PHI3)}
)


def family_of(config: object) -> Family:
    """The family the engine runs a config with: its `model_type`'s, where `architectures` (when
    given) names one that runs.

    Raises:
        UnsupportedModelError: naming the architecture and what pagedctl runs.
    """
    archs = list(getattr(config, "architectures", None) or [])
    model_type = getattr(config, "model_type", None)
    family = FAMILIES.get(model_type)
    runs = [a for f in FAMILIES.values() if f.model_class for a in f.architectures]
    if archs and not set(archs) & set(runs):
        raise UnsupportedModelError(
            f"architecture {archs[0]!r} is not supported; pagedctl runs {', '.join(runs)}"
        )
    if family is None or family.model_class is None:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; pagedctl runs {', '.join(runs)}"
        )
    return family


def planning_family(model_type: object) -> Family:
    """The family capacity planning counts a config of `model_type` as: its own, run or not, and
    a Llama's where the registry does not know it."""
    return FAMILIES.get(model_type) or _LLAMA


def gguf_family(arch: object) -> Family:
    """The family of a GGUF file's `general.architecture`.

    Raises:
        UnsupportedModelError: naming the GGUF architectures pagedctl converts.
    """
    by_arch = {f.gguf_arch: f for f in FAMILIES.values() if f.gguf_arch and f.model_class}
    if arch not in by_arch:
        names = ", ".join(f.architectures[0] for f in by_arch.values())
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not supported; pagedctl converts "
            f"{', '.join(by_arch)} ({names})"
        )
    return by_arch[arch]


def build_model(
    hf_config: object, dtype: torch.dtype, device: torch.device | str, quantized: bool = False
) -> nn.Module:
    """The decoder that runs `hf_config`'s family, its weights uninitialised (imports torch);
    `quantized`: its projections wait for integer weights (no float copy is allocated)."""
    module, _, name = family_of(hf_config).model_class.rpartition(".")
    model_class = getattr(importlib.import_module(f"{__package__}.{module}"), name)
    return model_class(hf_config, dtype, device, quantized=quantized)


def expected_weight_shapes(
    config: object, family: Family | None = None
) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of this config holds, by its Hugging Face name, with its shape.

    `family` defaults to the config's own (`family_of`); capacity planning passes its
    `planning_family`.
    """
    family = family or family_of(config)
    h, v, inter = config.hidden_size, config.vocab_size, config.intermediate_size
    nh = config.num_attention_heads
    nkv = family.read(config, "num_key_value_heads") or nh
    hd = family.read(config, "head_dim") or h // nh
    qkv_bias, o_bias = family.attention_biases(config)
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
    if o_bias:
        layer["self_attn.o_proj.bias"] = (h,)
    if family.qk_norm:
        layer |= {"self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,)}
    if family.gemma:
        layer |= {
            "pre_feedforward_layernorm.weight": (h,),
            "post_feedforward_layernorm.weight": (h,),
        }
    if family.read(config, "mlp_bias"):
        layer |= {
            "mlp.gate_proj.bias": (inter,),
            "mlp.up_proj.bias": (inter,),
            "mlp.down_proj.bias": (h,),
        }
    for leaf, parts in _LLAMA_FUSED.items():
        if family.fused.get(leaf) == (leaf,):  # the checkpoint stores the parts as one tensor
            module = "self_attn" if leaf == "qkv_proj" else "mlp"
            for kind in ("weight", "bias"):
                names = [f"{module}.{p}.{kind}" for p in parts]
                if names[0] in layer:
                    split = [layer.pop(n) for n in names]
                    layer[f"{module}.{leaf}.{kind}"] = (sum(t[0] for t in split), *split[0][1:])
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    for i in range(config.num_hidden_layers):
        shapes |= {f"model.layers.{i}.{k}": s for k, s in layer.items()}
    if not family.read(config, "tie_word_embeddings"):
        shapes["lm_head.weight"] = (v, h)
    return shapes

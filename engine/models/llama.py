"""One Llama-style decoder for the families whose spec names it (Llama, Qwen2, Qwen3, Mistral,
Gemma 2 and 3, Phi-3), on a paged KV cache.

The families differ only by switches: their spec's (q/k/v bias, per-head q/k RMSNorm before
RoPE, Gemma's norms, GeGLU, scaled embedding and soft-capping) and the config's (sliding windows,
RoPE scaling, an explicit head_dim, tied embeddings). Projections are fused as the spec says
(q/k/v, gate/up); `load_weights` splits Hugging Face names onto them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import replace

import torch
from torch import Tensor, nn

from ...kernels.quant import QuantizedWeight, concat_rows, dequantize
from .attention import AttentionMetadata, KVCache, PagedAttention
from .layers import (
    Embedding,
    GatedMLP,
    Linear,
    ModelSpec,
    RMSNorm,
    model_spec,
)
from .registry import expected_weight_shapes
from .rope import RotaryEmbedding


class WeightLoadError(ValueError):
    """A checkpoint does not match the model: unknown, missing or misshapen tensors."""


class SelfAttention(nn.Module):
    """Fused q/k/v projection, optional q/k norm, RoPE, paged attention, output projection."""

    def __init__(self, spec: ModelSpec, window: int | None = None) -> None:
        super().__init__()
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        self.head_dim = spec.head_dim
        q = spec.quantized
        self.qkv_proj = Linear(spec.hidden_size, self.q_size + 2 * self.kv_size, spec.qkv_bias, q)
        self.o_proj = Linear(self.q_size, spec.hidden_size, spec.o_bias, q)
        self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        scale = spec.attn_scale or spec.head_dim**-0.5
        self.attn = PagedAttention(
            spec.num_heads, spec.num_kv_heads, spec.head_dim, scale, window, spec.attn_softcap
        )

    def forward(
        self,
        x: Tensor,
        positions: Tensor,
        rope: RotaryEmbedding,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> Tensor:
        """`[T, hidden]` -> `[T, hidden]`; writes this step's K/V into `kv_cache`."""
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.q_size // self.head_dim, self.head_dim)
        k = k.view(-1, self.kv_size // self.head_dim, self.head_dim)
        v = v.view(-1, self.kv_size // self.head_dim, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return self.o_proj(self.attn(q, k, v, kv_cache, meta, rope, positions).flatten(1))


class DecoderLayer(nn.Module):
    """Pre-norm residual block: attention then gated MLP."""

    def __init__(self, spec: ModelSpec, window: int | None = None) -> None:
        super().__init__()
        self.self_attn = SelfAttention(spec, window)
        self.mlp = GatedMLP(
            spec.hidden_size, spec.intermediate_size, spec.quantized, spec.activation
        )
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.gemma = spec.gemma
        if spec.gemma:  # norms on the attention's output and around the MLP
            self.pre_feedforward_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(
        self,
        x: Tensor,
        residual: Tensor | None,
        positions: Tensor,
        rope: RotaryEmbedding,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[Tensor, Tensor]:
        """One decoder layer over the flat batch `[T, hidden]`.

        Carries the residual stream separately (`x` is the previous block's output, `residual`
        the sum so far) so that each add fuses into the norm that follows it; the sums are the
        same additions in the same order as `x + attn(norm(x))`, `x + mlp(norm(x))`.
        """
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, rope, kv_cache, meta)
        if self.gemma:  # x + post(attn(in(x))), then that + post_ff(mlp(pre_ff(that)))
            x, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(x), residual)
            return self.post_feedforward_layernorm(self.mlp(x)), residual
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm (HF's `model.` prefix)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.embed_tokens = Embedding(spec.vocab_size, spec.hidden_size)
        self.rotary = RotaryEmbedding(spec.head_dim, spec.max_positions, spec.rope)
        self.rotary_local = None  # the windowed layers' own table (Gemma 3)
        if spec.local_rope is not None and spec.local_rope != spec.rope:
            self.rotary_local = RotaryEmbedding(spec.head_dim, spec.max_positions, spec.local_rope)
        self.layers = nn.ModuleList(DecoderLayer(spec, w) for w in spec.layer_windows)
        self.layer_ropes = [  # each layer's table (a plain list: the modules are registered above)
            self.rotary if w is None or self.rotary_local is None else self.rotary_local
            for w in spec.layer_windows
        ]
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """A Llama-style decoder whose attention reads and writes a paged KV cache."""

    def __init__(
        self,
        hf_config: object,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        quantized: bool = False,
    ) -> None:
        super().__init__()
        spec = replace(model_spec(hf_config), quantized=quantized)
        self.spec = spec
        self._checkpoint = expected_weight_shapes(hf_config, spec.family)  # HF name -> shape
        self.num_layers, self.num_kv_heads = spec.num_layers, spec.num_kv_heads
        self.head_dim, self.vocab_size = spec.head_dim, spec.vocab_size
        self.dtype = dtype
        with _default_dtype(dtype), torch.device(device):
            self.model = LlamaModel(spec)
        with _default_dtype(dtype), torch.device("meta" if spec.tie_word_embeddings else device):
            self.lm_head = Linear(spec.hidden_size, spec.vocab_size, quantized=quantized)
        if spec.tie_word_embeddings and not quantized:  # no memory of its own when tied
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> Tensor:
        """Hidden states `[num_tokens, hidden]` of a flat varlen batch (int64 ids and positions)."""
        x, residual = self.model.embed_tokens(input_ids), None
        if self.spec.gemma:  # Gemma scales the embedding by sqrt(hidden), rounded to the dtype
            # (a Python number: a CUDA graph captures no host-to-device copy)
            x = x * torch.tensor(self.spec.hidden_size**0.5, dtype=x.dtype).item()
        layers = zip(self.model.layers, self.model.layer_ropes, kv_caches, strict=True)
        for layer, rope, kv_cache in layers:
            x, residual = layer(x, residual, positions, rope, kv_cache, meta)
        return self.model.norm(x, residual)[0]

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """Logits `[rows, vocab]` of the rows that sample, in the model's dtype: the sampler
        reads them as they are (argmax, the fused temperature kernel) or upcasts to float32."""
        logits = self.lm_head(hidden)
        cap = self.spec.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def fit_max_model_len(self, max_model_len: int) -> None:
        """Take the RoPE tables for sequences of up to `max_model_len` tokens (LongRoPE's short
        or long factors, `RotaryEmbedding.fit`); before the step graphs are captured."""
        for rotary in (self.model.rotary, self.model.rotary_local):
            if rotary is not None:
                rotary.fit(max_model_len)

    def pack_weights(self) -> int:
        """Pack every projection's weight (the output layer's too) for the faster matmul the
        kernels have on this device and dtype, if any (`Linear.pack`): a second copy of those
        weights, whose bytes this returns. Call once the weights are loaded."""
        return sum(m.pack() for m in self.modules() if isinstance(m, Linear))

    def set_batch_invariant(self, on: bool) -> None:
        """Run every projection, attention layer and SwiGLU through the batch-invariant ops (or
        back): each row's bits then depend on its own sequence alone (`deterministic`)."""
        for m in self.modules():
            if isinstance(m, Linear | PagedAttention | GatedMLP):
                m.batch_invariant = on

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """Copy Hugging Face-named tensors in, cast to the model's dtype and device.

        The family's `unused_weights` (`rotary_emb.inv_freq`) are ignored; `lm_head.weight` is
        optional (the embedding is reused when it is absent or the config ties them). Raises
        `WeightLoadError` listing unknown, missing or misshapen names.
        """
        if self.spec.quantized:
            self._load_quantized(weights)
            return
        slots = self._hf_slots()
        unused = self.spec.family.unused_weights
        loaded: set[str] = set()
        unknown: list[str] = []
        for name, tensor in weights:
            if name.endswith(unused) or (
                name == "lm_head.weight" and name not in slots  # tied: the embedding serves
            ):
                continue
            slot = slots.get(name)
            if slot is None:
                unknown.append(name)
            elif slot.shape != tensor.shape:
                raise WeightLoadError(
                    f"{name}: checkpoint shape {tuple(tensor.shape)} != model shape "
                    f"{tuple(slot.shape)}; does config.json belong to these weights?"
                )
            else:
                slot.copy_(tensor)
                loaded.add(name)
        missing = sorted(slots.keys() - loaded)
        if missing == ["lm_head.weight"]:
            self.lm_head.weight = self.model.embed_tokens.weight
            missing = []
        if unknown or missing:
            raise WeightLoadError(
                f"checkpoint does not match the model: unknown {_short(unknown)}, "
                f"missing {_short(missing)}; check that config.json belongs to these weights"
            )
        self._fold_norm_offsets()

    def _load_quantized(self, weights: Iterable[tuple[str, Tensor | QuantizedWeight]]) -> None:
        """`load_weights` of a model built `quantized`: each projection takes its checkpoint
        tensors whole, float or integer (`QuantizedWeight`), the parts of a fused one joined
        once all have come (`concat_rows`); the embedding may be integers too. A tied output
        layer reuses the embedding's table, integers included."""
        linears = self._linear_targets()
        slots = self._hf_slots()
        unused = self.spec.family.unused_weights
        device = self.model.norm.weight.device
        tied = self.spec.tie_word_embeddings
        pending: dict[str, list] = {}
        loaded: set[str] = set()
        unknown: list[str] = []
        for name, w in weights:
            if name.endswith(unused) or (name == "lm_head.weight" and tied):
                continue
            if name not in linears and name not in slots:
                unknown.append(name)
                continue
            want = self._checkpoint[name]
            if tuple(w.shape) != want:
                kind = "quantized weight of float shape" if isinstance(w, QuantizedWeight) else ""
                raise WeightLoadError(
                    f"{name}: checkpoint {kind or 'shape'} {tuple(w.shape)} != model shape {want}"
                    "; does config.json belong to these weights?"
                )
            loaded.add(name)
            if name in linears:
                module, index, count = linears[name]
                parts = pending.setdefault(module, [None] * count)
                parts[index] = w
                if all(p is not None for p in parts):
                    layer = self.get_submodule(module)
                    layer.set_weight(_join(parts, self.dtype), device, self.dtype)
                    del pending[module]
            elif isinstance(w, QuantizedWeight) and name == "model.embed_tokens.weight":
                self.model.embed_tokens.set_quantized(w, device)
            else:
                slots[name].copy_(dequantize(w) if isinstance(w, QuantizedWeight) else w)
        embed = self.model.embed_tokens
        if "lm_head.weight" not in loaded and "lm_head.weight" in linears:
            head = embed.quant if embed.quant is not None else embed.weight.detach()
            self.lm_head.set_weight(head, device, self.dtype)
            if embed.quant is None:
                self.lm_head.weight = embed.weight  # one table, not a copy
            loaded.add("lm_head.weight")
        missing = sorted((linears.keys() | slots.keys()) - loaded)
        if unknown or missing:
            raise WeightLoadError(
                f"checkpoint does not match the model: unknown {_short(unknown)}, "
                f"missing {_short(missing)}; check that config.json belongs to these weights"
            )
        self._fold_norm_offsets()

    def _fold_norm_offsets(self) -> None:
        """Gemma's RMSNorm scales by (1 + weight): the 1 is added to the loaded weights once
        (in float32 the same product; in 16 bits the sum is rounded once, at load)."""
        if self.spec.gemma:
            with torch.no_grad():
                for m in self.modules():
                    if isinstance(m, RMSNorm):
                        m.weight.add_(1.0)

    def _linear_targets(self) -> dict[str, tuple[str, int, int]]:
        """HF weight name -> (projection module, its part, parts) of every projection built
        without a float weight (`quantized`)."""
        fused = self.spec.family.fused
        targets = {}
        for name, module in self.named_modules():
            if isinstance(module, Linear) and module.weight is None:
                prefix, _, leaf = name.rpartition(".")
                parts = fused.get(leaf, (leaf,))
                for i, hf_leaf in enumerate(parts):
                    targets[".".join(filter(None, (prefix, hf_leaf, "weight")))] = (
                        name,
                        i,
                        len(parts),
                    )
        return targets

    def dummy_weights(self, seed: int = 0) -> Iterator[tuple[str, Tensor]]:
        """Random checkpoint tensors by Hugging Face name, made on the model's device (values as
        `init_dummy_weights`'): for a model built `quantized`, to quantize as they load."""
        device = self.model.norm.weight.device
        gen = torch.Generator(device=device).manual_seed(seed)
        for name, shape in self._checkpoint.items():
            if name.endswith(self.spec.family.unused_weights):
                continue
            if name.endswith("norm.weight"):
                yield name, torch.ones(shape, dtype=self.dtype, device=device)
            elif name.endswith(".bias"):
                yield name, torch.zeros(shape, dtype=self.dtype, device=device)
            else:
                w = torch.empty(shape, dtype=self.dtype, device=device)
                yield name, w.normal_(0.0, 0.02, generator=gen)

    def weights_bytes(self) -> int:
        """Bytes the weights take on the device: float parameters once each (a tied table once),
        integer tables and the prepared forms of quantized projections."""
        total = sum(p.nbytes for p in self.parameters())
        embed = self.model.embed_tokens.quant
        seen = set()
        if embed is not None:
            total += embed.nbytes
            seen.add(embed.qdata.data_ptr())
        for m in self.modules():
            if isinstance(m, Linear) and m.weight is not None and m.packed is not None:
                total += m.packed.nbytes  # a float weight's packed copy, kept beside it
            elif isinstance(m, Linear) and m.weight is None:
                form = m.packed if m.packed is not None else m.quant
                ptr = getattr(getattr(form, "qdata", None), "data_ptr", lambda: None)()
                if form is not None and ptr not in seen:
                    total += form.nbytes
        return total

    def init_dummy_weights(self, seed: int = 0) -> None:
        """Random weights for benchmarks: normal(0, 0.02) matrices, zero biases, unit norms."""
        device = self.model.embed_tokens.weight.device
        gen = torch.Generator(device=device).manual_seed(seed)
        with torch.no_grad():
            for name, param in self.named_parameters():
                if name.endswith("norm.weight"):
                    param.fill_(1.0)
                elif name.endswith(".bias"):
                    param.zero_()
                else:
                    param.normal_(0.0, 0.02, generator=gen)

    def _hf_slots(self) -> dict[str, Tensor]:
        """HF tensor name -> the parameter, or the rows of a fused one (the family's `fused`, in
        its order, each as many rows as the checkpoint's tensor), that it fills."""
        fused = self.spec.family.fused
        slots = {}
        for name, param in self.named_parameters():
            module, _, kind = name.rpartition(".")
            prefix, _, leaf = module.rpartition(".")
            offset = 0
            for hf_leaf in fused.get(leaf, ()):
                hf_name = f"{prefix}.{hf_leaf}.{kind}"
                rows = self._checkpoint[hf_name][0]
                slots[hf_name] = param.detach().narrow(0, offset, rows)
                offset += rows
            if leaf not in fused:
                slots[name] = param.detach()
        return slots


def _join(parts: list[Tensor | QuantizedWeight], dtype: torch.dtype) -> Tensor | QuantizedWeight:
    """The parts of a fused projection as one weight: integers if all are (`concat_rows`),
    else floats (a part stored as floats makes the whole projection float)."""
    if len(parts) == 1:
        return parts[0]
    if all(isinstance(p, QuantizedWeight) for p in parts):
        return concat_rows(parts)
    return torch.cat([dequantize(p, dtype) if isinstance(p, QuantizedWeight) else p for p in parts])


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Temporarily make `dtype` the default so parameters are created in it directly."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _short(names: list[str], limit: int = 8) -> str:
    """At most `limit` names, then a count of the rest."""
    more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
    return f"[{', '.join(names[:limit])}]{more}"

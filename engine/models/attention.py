"""Per-step attention metadata and the attention layer that runs on the paged KV cache."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor, nn

from ...kernels import PagedBatch, paged_attention, rotary_write_kv
from .rope import RotaryEmbedding

KVCache = tuple[Tensor, Tensor]  # one layer's K and V, each [num_blocks, block_size, Hkv, D]


@dataclass
class AttentionMetadata:
    """Where this step's tokens go in the KV cache and what each sequence attends to.

    Built by the model runner once per step and shared by every layer.

    Attributes:
        slot_mapping: int64 `[num_tokens]`, cache slot of each new token
            (`block_id * block_size + offset`), < 0 for padding (skipped).
        batch: the step's sequences, their block tables and lengths, as the attention op reads
            them (`PagedBatch`).
        num_splits: programs per query block and KV head sharing its history (split-KV), for a
            graph whose few sequences may have long histories; None: the kernel's choice.
        plan_cache: scratch space the attention op may memoise per-step work in (the CPU
            reference's gather indices, computed once instead of once per layer). A metadata
            object whose tensors are changed in place must have it cleared.
    """

    slot_mapping: Tensor
    batch: PagedBatch
    num_splits: int | None = None
    plan_cache: dict = field(default_factory=dict)  # per-step memo of the ops (see `kernels`)


class PagedAttention(nn.Module):
    """Rotate the new tokens' q and k (RoPE) and write their K/V into the cache (one launch on the
    GPU), then attend over the cache through block tables.

    History (earlier chunks, prefix-cache hits, decode context) is read from the cache only, so
    one code path serves prefill, chunked prefill, prefix hits and decode.
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        window: int | None,
        softcap: float | None = None,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads "
                f"({num_kv_heads})"
            )
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.window = window  # the last `window` positions up to a query's own; None: all
        self.softcap = softcap  # logits through softcap * tanh(s / softcap) (Gemma 2); None: off
        self.batch_invariant = False  # each row's bits set by its own sequence (`deterministic`)

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        rope: RotaryEmbedding,
        positions: Tensor,
    ) -> Tensor:
        """q `[T, H, D]`, k/v `[T, Hkv, D]` (q and k rotated in place: they may be views of the
        qkv output) -> attention output `[T, H, D]`."""
        k_cache, v_cache = kv_cache
        rotary_write_kv(q, k, v, rope.cos, rope.sin, positions, k_cache, v_cache, meta.slot_mapping)
        return paged_attention(
            q,
            k_cache,
            v_cache,
            meta.batch,
            self.scale,
            plan_cache=meta.plan_cache,
            num_splits=meta.num_splits,
            batch_invariant=self.batch_invariant,
            window=self.window,
            softcap=self.softcap,
        )

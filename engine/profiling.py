"""Measure what a forward pass costs on a CUDA device, to size the KV cache from what is left."""

from __future__ import annotations

import torch

from engine.models.attention import AttentionMetadata


@torch.inference_mode()
def profile_peak_bytes(
    model: torch.nn.Module,
    device: torch.device,
    dtype: torch.dtype,
    num_tokens: int,
    num_logit_rows: int = 256,
    block_size: int = 16,
) -> int:
    """Peak bytes this process holds (weights included) while running one step of `num_tokens`.

    The step is a single prefill of `num_tokens` tokens (the worst case for attention
    activations) through a temporary KV cache, whose own size is left out of the figure.
    """
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    num_blocks = -(-num_tokens // block_size)
    shape = (num_blocks, block_size, model.num_kv_heads, model.head_dim)
    caches = [
        (
            torch.empty(shape, dtype=dtype, device=device),
            torch.empty(shape, dtype=dtype, device=device),
        )
        for _ in range(model.num_layers)
    ]
    cache_bytes = sum(k.nbytes + v.nbytes for k, v in caches)
    positions = torch.arange(num_tokens, device=device)
    meta = AttentionMetadata(
        slot_mapping=positions.clone(),
        block_tables=torch.arange(num_blocks, dtype=torch.int32, device=device)[None],
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=device),
        cu_seqlens_q=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
        max_seqlen_q=num_tokens,
        max_seqlen_k=num_tokens,
    )
    ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    hidden = model(ids, positions, caches, meta)
    model.compute_logits(hidden[: min(num_logit_rows, num_tokens)])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - cache_bytes
    del caches, hidden
    torch.cuda.empty_cache()
    return int(peak)

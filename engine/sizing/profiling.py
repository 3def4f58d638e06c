"""Measure what a forward pass costs: on a CUDA device, to size the KV cache from what is left;
on any device, to weigh swap against recompute for `auto` preemption (`calibrate_preemption`)."""

from __future__ import annotations

import logging
import time

import torch
from torch import Tensor

from ...kernels import PagedBatch, empty_kv_cache
from ..core.config import DEFAULTS
from ..core.swap import PreemptionCosts, fitted
from ..core.units import cdiv, format_bytes
from ..models.attention import AttentionMetadata
from ..runner.host_kv import HostKVCache

logger = logging.getLogger("pagedctl.engine")


def cuda_kv_budget(
    model: torch.nn.Module,
    device: torch.device,
    dtype: torch.dtype,
    utilization: float,
    batched_tokens: int,
    max_num_seqs: int,
    weights: int,
    reserve_graphs: bool,
) -> tuple[int, dict]:
    """Bytes for the KV cache: total x utilization, less a profiled step's peak (weights
    included) and, with step graphs, their pool; and the figures behind it (for `LLM.memory`).

    The profile step is the largest batch the scheduler can form: `batched_tokens` tokens of
    prefill and `max_num_seqs` rows of logits. Only this process's allocations count
    (`max_memory_allocated`), so other processes on the card do not shrink the estimate; they
    only shrink what is really free, which is checked.
    """
    total = torch.cuda.get_device_properties(device).total_memory
    peak = profile_peak_bytes(model, device, dtype, batched_tokens, num_logit_rows=max_num_seqs)
    activations = max(peak - weights, 0)
    # The step graphs keep a private pool about as large as the largest step's activations.
    graphs = activations if reserve_graphs else 0
    budget = int(total * utilization) - peak - graphs
    free, _ = torch.cuda.mem_get_info(device)
    usable = free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    logger.info(
        "CUDA memory: %s total x %.2f = %s; weights %s, activation peak %s "
        "(%d tokens, %d logit rows), graph reserve %s -> %s for the KV cache",
        format_bytes(total),
        utilization,
        format_bytes(total * utilization),
        format_bytes(weights),
        format_bytes(activations),
        batched_tokens,
        max_num_seqs,
        format_bytes(graphs),
        format_bytes(max(budget, 0)),
    )
    if budget <= 0:
        raise ValueError(
            f"no memory left for the KV cache: {format_bytes(total)} x {utilization} is used "
            f"up by weights and activations ({format_bytes(peak + graphs)}); raise "
            "gpu_memory_utilization or lower max_num_batched_tokens"
        )
    if budget > usable:
        raise ValueError(
            f"the KV cache would need {format_bytes(budget)} but only {format_bytes(usable)} "
            "is free on the device (other processes hold the rest); lower "
            "gpu_memory_utilization or set kv_cache_memory"
        )
    figures = {
        "utilization": utilization,
        "activation_peak_bytes": activations,
        "cuda_graph_reserve_bytes": graphs,
        "non_kv_bytes": peak + graphs,
    }
    return budget, figures


@torch.inference_mode()
def profile_peak_bytes(
    model: torch.nn.Module,
    device: torch.device,
    dtype: torch.dtype,
    num_tokens: int,
    num_logit_rows: int = 256,
    block_size: int = DEFAULTS["block_size"],
) -> int:
    """Peak bytes this process holds (weights included) while running one step of `num_tokens`.

    The step is a single prefill of `num_tokens` tokens (the worst case for attention
    activations) through a temporary KV cache, whose own size is left out of the figure.
    """
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    seq_len = min(num_tokens, model.spec.max_positions)
    num_blocks = cdiv(num_tokens, seq_len) * cdiv(seq_len, block_size)  # as prefill_forward
    kv = empty_kv_cache(
        model.num_layers, num_blocks, block_size, model.num_kv_heads, model.head_dim, dtype, device
    )  # as the runner lays it out
    caches = [(layer[0], layer[1]) for layer in kv]
    cache_bytes = kv.numel() * kv.element_size()
    hidden = prefill_forward(model, caches, num_tokens, block_size, device)
    model.compute_logits(hidden[: min(num_logit_rows, num_tokens)]).float()  # as sampling may
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - cache_bytes
    del caches, kv, hidden
    torch.cuda.empty_cache()
    return int(peak)


def prefill_forward(
    model: torch.nn.Module,
    caches: list,
    num_tokens: int,
    block_size: int,
    device: torch.device,
) -> torch.Tensor:
    """A prefill of `num_tokens` dummy tokens through `caches` (their KV written to the first
    blocks): one sequence, or as many as the model's positions need (each at most
    `spec.max_positions` long: its RoPE table ends there); the hidden states."""
    seq_len = min(num_tokens, model.spec.max_positions)
    num_seqs = cdiv(num_tokens, seq_len)
    per_seq = cdiv(seq_len, block_size)
    starts = torch.arange(num_seqs + 1, device=device) * seq_len
    cu = starts.clamp(max=num_tokens).to(torch.int32)
    tokens = torch.arange(num_tokens, device=device)
    positions = tokens % seq_len
    tables = torch.arange(num_seqs * per_seq, dtype=torch.int32, device=device)
    # each sequence's blocks in a row of its own, its slots inside them
    slot_mapping = (tokens // seq_len) * (per_seq * block_size) + positions
    meta = AttentionMetadata(
        slot_mapping=slot_mapping,
        batch=PagedBatch(
            block_tables=tables.view(num_seqs, per_seq),
            seq_lens=(cu[1:] - cu[:-1]).to(torch.int32),
            cu_seqlens_q=cu,
            max_seqlen_q=seq_len,
            max_seqlen_k=seq_len,
        ),
    )
    ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    return model(ids, positions, caches, meta)


@torch.inference_mode()
def calibrate_preemption(
    model: torch.nn.Module,
    kv_caches: list[tuple[Tensor, Tensor]],
    host: HostKVCache,
    block_size: int,
    device: torch.device,
    max_prefill_tokens: int,
) -> PreemptionCosts:
    """Time what `auto` preemption weighs, before any sequence holds a block: a swap's transfer
    at two sizes (the copies' time, as `HostKVCache` counts it) and a prefill at two lengths,
    each the fastest of three runs. Writes into the pool's first blocks, which hold nothing yet."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def fastest(fn) -> float:
        times = []
        for _ in range(4):  # the first warms up
            sync()
            start = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - start)
        return min(times[1:])

    num_blocks = kv_caches[0][0].shape[0]
    sizes = (1, max(2, min(64, num_blocks, host.num_blocks)))
    rounds = []
    for n in sizes:  # the copies' own time on the stream: a swap is never waited for
        ids, times = list(range(n)), []
        for _ in range(4):  # the first warms up
            host.reset_seconds()
            host.swap_out(ids, ids)
            host.swap_in(ids, ids)
            times.append(host.seconds)
        rounds.append(min(times[1:]))
    host.reset_seconds()  # the timed copies are not the run's
    transfer = fitted(sizes, (rounds[0] / 2, rounds[1] / 2))
    long = max(2, min(max_prefill_tokens, 1024, num_blocks * block_size))
    lengths = (max(1, long // 4), long)
    prefill = [
        fastest(lambda t=t: prefill_forward(model, kv_caches, t, block_size, device))
        for t in lengths
    ]
    return PreemptionCosts(*transfer, *fitted(lengths, tuple(prefill)))

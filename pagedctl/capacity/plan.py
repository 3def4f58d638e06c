"""Sections 1-3 of `pagedctl capacity`: the pool, sequences that fit, block-size waste; and the
host pool of `--swap-space`.

Pure arithmetic over a model's footprint, a card and a length source; every function returns
rows (dicts) that the report prints and writes as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pagedctl.capacity.card import Card, Pool, scheduler_budget, size_pool
from pagedctl.capacity.lengths import Lengths
from pagedctl.capacity.model import ModelFootprint, activation_peak_bytes
from pagedctl.engine import KVLayout, cdiv, host_blocks, max_concurrency, sequences_in_pool


@dataclass(frozen=True)
class PlanInputs:
    """Everything sections 1-3 depend on, after flags and recipe are merged and checked."""

    footprint: ModelFootprint
    dtype: str
    dtype_bytes: int
    card: Card | None
    gpu_mems: tuple[float, ...]
    block_sizes: tuple[int, ...]
    max_len: int
    non_kv_bytes: int | None = None
    num_blocks: int | None = None
    cuda_context_bytes: int = 256 * 2**20
    shared_prefix: int = 0
    cuda_graphs: bool = True
    swap_space_bytes: int | None = None  # host pool for preempted sequences (--swap-space)
    quantization: str = "none"  # how the weights load: a QuantPlan method ("none", "gguf", ...)

    @property
    def layout(self) -> KVLayout:
        return self.footprint.layout(self.dtype_bytes)


@dataclass(frozen=True)
class Memory:
    """What is not KV cache, as the engine would count it (estimated or given)."""

    weights_bytes: int
    activation_peak_bytes: int | None
    batched_tokens: int | None
    logit_rows: int | None
    non_kv_bytes: int
    given: bool
    graph_reserve_bytes: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def memory(inputs: PlanInputs) -> Memory:
    """Weights (params x dtype) + the estimated activation peak of the engine's profile step +
    the pool its step graphs keep (with CUDA graphs on, the engine's default: as large as that
    peak, as `engine.profiling.cuda_kv_budget` reserves it), unless `--non-kv-memory` gave the
    figure."""
    weights = inputs.footprint.weights_bytes(inputs.dtype_bytes, inputs.quantization)
    total = inputs.card.total_bytes if inputs.card else 0
    tokens, rows = scheduler_budget(total)
    act = activation_peak_bytes(inputs.footprint.config, inputs.dtype_bytes, tokens, rows)
    if inputs.non_kv_bytes is not None:
        return Memory(weights, act, tokens, rows, inputs.non_kv_bytes, True)
    graphs = act if inputs.cuda_graphs else 0
    return Memory(weights, act, tokens, rows, weights + act + graphs, False, graphs)


def pools(inputs: PlanInputs, mem: Memory) -> dict[tuple[float | None, int], Pool]:
    """Every (memory fraction, block size) pool. A given `num_blocks` is the first block size's
    count; other block sizes get the same bytes."""
    layout = inputs.layout
    out: dict[tuple[float | None, int], Pool] = {}
    if inputs.num_blocks is not None:
        first = inputs.block_sizes[0]
        for bs in inputs.block_sizes:
            blocks = inputs.num_blocks * first // bs
            out[(None, bs)] = size_pool(
                layout, bs, total_bytes=0, utilization=None, non_kv_bytes=0, num_blocks=blocks
            )
        return out
    assert inputs.card is not None
    for g in inputs.gpu_mems:
        for bs in inputs.block_sizes:
            out[(g, bs)] = size_pool(
                layout,
                bs,
                total_bytes=inputs.card.total_bytes,
                utilization=g,
                non_kv_bytes=mem.non_kv_bytes,
            )
    return out


def primary(inputs: PlanInputs, all_pools: dict) -> Pool:
    """The pool sections 2-4 describe: the first memory fraction and the first block size."""
    g = None if inputs.num_blocks is not None else inputs.gpu_mems[0]
    return all_pools[(g, inputs.block_sizes[0])]


def vllm_line(pool: Pool, max_len: int) -> str:
    """The start-up line vLLM prints for this pool, for a side-by-side check."""
    conc = max_concurrency(pool.num_blocks, pool.block_size, max_len)
    return (
        f"GPU KV cache size: {pool.tokens:,} tokens, Maximum concurrency for {max_len:,} "
        f"tokens per request: {conc:.2f}x"
    )


def pool_rows(inputs: PlanInputs, all_pools: dict) -> list[dict]:
    """Section 1: bytes per token, budget, blocks, tokens and vLLM's concurrency line."""
    rows = []
    for (g, bs), pool in all_pools.items():
        rows.append(
            {
                "gpu_mem": g,
                "block_size": bs,
                "bytes_per_token": pool.layout.bytes_per_token,
                "bytes_per_block": pool.layout.bytes_per_block(bs),
                "kv_budget_bytes": pool.budget_bytes,
                "num_blocks": pool.num_blocks,
                "pool_tokens": pool.tokens,
                "max_concurrency": max_concurrency(pool.num_blocks, bs, inputs.max_len),
                "vllm_line": vllm_line(pool, inputs.max_len),
            }
        )
    return rows


def seq_lengths(max_len: int) -> list[int]:
    """128, 256, 512, ... below `max_len`, then `max_len` itself."""
    out, n = [], 128
    while n < max_len:
        out.append(n)
        n *= 2
    return [*out, max_len]


def contiguous_whole_card(inputs: PlanInputs, mem: Memory) -> int | None:
    """Max-length reservations that fit beside the weights and the CUDA context (an upper bound:
    nothing is left for activations)."""
    if inputs.card is None:
        return None
    free = inputs.card.total_bytes - mem.weights_bytes - inputs.cuda_context_bytes
    return max(free, 0) // (reserved_tokens(inputs) * inputs.layout.bytes_per_token)


def reserved_tokens(inputs: PlanInputs) -> int:
    """The tokens a contiguous cache reserves a sequence: `max_len`, or with a sliding window on
    every layer a ring buffer of the window (Mistral's reference cache), if shorter."""
    window = inputs.footprint.kv_window
    return min(inputs.max_len, window) if window else inputs.max_len


def capacity_rows(inputs: PlanInputs, pool: Pool, mem: Memory) -> list[dict]:
    """Section 2: sequences of each length the paged pool holds, against max-length reservations
    on the same budget and on the whole card."""
    reservation = reserved_tokens(inputs) * inputs.layout.bytes_per_token
    same_budget = max(pool.budget_bytes, 0) // reservation
    card = contiguous_whole_card(inputs, mem)
    window = inputs.footprint.kv_window
    rows = []
    for n in seq_lengths(inputs.max_len):
        paged = sequences_in_pool(pool.num_blocks, pool.block_size, n, inputs.shared_prefix, window)
        rows.append(
            {
                "seq_len": n,
                "paged": paged,
                "contiguous_same_budget": same_budget,
                "contiguous_whole_card": card,
                "ratio_same_budget": paged / same_budget if same_budget else None,
                "ratio_whole_card": paged / card if card else None,
            }
        )
    return rows


def block_rows(inputs: PlanInputs, lengths: Lengths, all_pools: dict) -> list[dict]:
    """Section 3: the unfinished last block of each sequence, per block size, over the lengths."""
    pmf = lengths.pmf()
    n = np.arange(len(pmf))
    mean_len = float((pmf * n).sum())
    g = None if inputs.num_blocks is not None else inputs.gpu_mems[0]
    rows = []
    for bs in inputs.block_sizes:
        pool = all_pools[(g, bs)]
        blocks = np.array([cdiv(int(k), bs) for k in n], dtype=np.float64)
        shared = np.minimum(inputs.shared_prefix // bs, np.maximum(n - 1, 0) // bs)
        held = float((pmf * blocks).sum()) * bs
        own = float((pmf * (blocks - shared)).sum())
        shared_blocks = inputs.shared_prefix // bs
        rows.append(
            {
                "block_size": bs,
                "mean_len": mean_len,
                "mean_held_tokens": held,
                "waste_tokens": held - mean_len,
                "waste_share": (held - mean_len) / held,
                "pool_tokens": pool.tokens,
                "sequences_held": int(max(pool.num_blocks - shared_blocks, 0) // own),
            }
        )
    return rows


def host_rows(inputs: PlanInputs, lengths: Lengths | None) -> list[dict]:
    """The `--swap-space` host pool per block size: its blocks at the model's bytes per block,
    and the preempted sequences it holds at the lengths' mean blocks and at --max-len. Running
    capacity is the device pool's alone: a host block holds a swapped-out sequence's KV."""
    assert inputs.swap_space_bytes is not None
    pmf = lengths.pmf() if lengths is not None else None
    rows = []
    for bs in inputs.block_sizes:
        per_block = inputs.layout.bytes_per_block(bs)
        blocks = host_blocks(inputs.swap_space_bytes, per_block)
        row = {
            "block_size": bs,
            "swap_space_bytes": inputs.swap_space_bytes,
            "bytes_per_block": per_block,
            "host_blocks": blocks,
            "host_tokens": blocks * bs,
            "mean_blocks": None,
            "preempted_at_mean": None,
            "preempted_at_max_len": blocks // cdiv(inputs.max_len, bs),
        }
        if pmf is not None:
            need = np.array([cdiv(int(k), bs) for k in range(len(pmf))], dtype=np.float64)
            row["mean_blocks"] = float((pmf * need).sum())
            row["preempted_at_mean"] = int(blocks // row["mean_blocks"])
        rows.append(row)
    return rows

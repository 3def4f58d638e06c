"""The card: its total memory (a size, a preset or the GPU present) and the engine's KV budget."""

from __future__ import annotations

from dataclasses import dataclass

from pagedctl.engine import KVLayout, default_step_limits, kv_budget_bytes, parse_bytes

GiB = 2**30
# Total memory as CUDA reports it (torch `total_memory`, the "total capacity" of an out-of-memory
# message), not the marketing size; it varies by about 1% with the driver and ECC (a T4 reports
# 14.56 GiB on most clouds and 14.74 GiB on some).
GPU_PRESETS: dict[str, int] = {
    "t4": int(14.56 * GiB),
    "l4": int(22.03 * GiB),
    "a10g": int(22.06 * GiB),
    "a100-40g": int(39.49 * GiB),
    "a100-80g": int(79.15 * GiB),
    "h100": int(79.18 * GiB),
    "h200": int(139.80 * GiB),
}
# What the engine's scheduler may put in one step on CUDA (engine.llm.LLM.reconfigure): cards of
# 70 GiB or more get 16,384 tokens and 1,024 sequences, smaller ones 8,192 and 256.


class CardError(ValueError):
    """The card's memory cannot be determined from what was given."""


@dataclass(frozen=True)
class Card:
    """A device's total memory and where the figure came from."""

    total_bytes: int
    source: str


def resolve_card(device_memory: str | None, gpu: str | None) -> Card:
    """`--device-memory`, else `--gpu` preset, else the CUDA device present."""
    if device_memory is not None and gpu is not None:
        raise CardError("give --device-memory or --gpu, not both")
    if device_memory is not None:
        try:
            return Card(parse_bytes(device_memory), f"--device-memory {device_memory}")
        except ValueError as e:
            raise CardError(str(e)) from None
    if gpu is not None:
        key = gpu.lower()
        if key not in GPU_PRESETS:
            raise CardError(f"unknown --gpu {gpu!r}; presets: {', '.join(GPU_PRESETS)}")
        return Card(GPU_PRESETS[key], f"preset {key}")
    import torch

    if not torch.cuda.is_available():
        raise CardError(
            "no CUDA device here: give --device-memory (e.g. 14.6GiB) or --gpu "
            f"({'|'.join(GPU_PRESETS)})"
        )
    props = torch.cuda.get_device_properties(0)
    return Card(props.total_memory, f"this machine's {props.name}")


def scheduler_budget(total_bytes: int) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) the engine picks on a CUDA card of this size."""
    return default_step_limits("cuda", total_bytes)


@dataclass(frozen=True)
class Pool:
    """One KV pool: a memory fraction and a block size on a card, or a block count given."""

    utilization: float | None
    block_size: int
    budget_bytes: int
    num_blocks: int
    layout: KVLayout

    @property
    def tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def pool_bytes(self) -> int:
        return self.num_blocks * self.layout.bytes_per_block(self.block_size)


def size_pool(
    layout: KVLayout,
    block_size: int,
    *,
    total_bytes: int,
    utilization: float | None,
    non_kv_bytes: int,
    num_blocks: int | None = None,
) -> Pool:
    """The engine's pool: `num_blocks` if given, else what the budget at `utilization` buys."""
    if num_blocks is not None:
        budget = num_blocks * layout.bytes_per_block(block_size)
        return Pool(None, block_size, budget, num_blocks, layout)
    assert utilization is not None
    budget = kv_budget_bytes(total_bytes, utilization, non_kv_bytes)
    blocks = max(budget, 0) // layout.bytes_per_block(block_size)
    return Pool(utilization, block_size, budget, blocks, layout)

"""How many KV blocks the engine's pool gets, and the longest sequence it then admits.

The pool is `num_blocks` when given; else `kv_cache_memory` bytes; else, on CUDA, what a profiled
step leaves of `gpu_memory_utilization` of the card (`engine.profiling.cuda_kv_budget`); else, on
the CPU, what the requests could ever use, capped by a share of the machine's memory.
"""

from __future__ import annotations

import logging

import torch

from ..core.config import ConfigError
from ..core.units import format_bytes, parse_bytes
from .device import default_cpu_kv_bytes
from .kv import KVLayout

logger = logging.getLogger("pagedctl.engine")


def kv_cache_blocks(
    model: torch.nn.Module,
    layout: KVLayout,
    device: torch.device,
    dtype: torch.dtype,
    block_size: int,
    *,
    num_blocks: int | None,
    kv_cache_memory: str | int | None,
    utilization: float,
    useful_tokens: int,
    batched_tokens: int,
    max_num_seqs: int,
    weights_bytes: int,
    reserve_graphs: bool,
) -> tuple[int, dict]:
    """Blocks of the pool, and the memory figures measured to size it (CUDA profiling only)."""
    if num_blocks is not None:
        return num_blocks, {}
    figures: dict = {}
    if kv_cache_memory is not None:
        budget = parse_bytes(kv_cache_memory)
    elif device.type == "cuda":
        from .profiling import cuda_kv_budget

        budget, figures = cuda_kv_budget(
            model,
            device,
            dtype,
            utilization,
            batched_tokens,
            max_num_seqs,
            weights_bytes,
            reserve_graphs=reserve_graphs,
        )
    else:  # no more than the requests could ever use
        budget = min(default_cpu_kv_bytes(), useful_tokens * layout.bytes_per_token)
    blocks = layout.blocks_for_bytes(budget, block_size)
    if blocks < 1:
        raise ValueError(
            f"the KV cache budget {format_bytes(budget)} holds no block of {block_size} tokens "
            f"({format_bytes(layout.bytes_per_block(block_size))}); give more memory"
        )
    return blocks, figures


def model_max_len(hf_config) -> int:
    """The model's own longest sequence (its config's; 4,096 when it gives none)."""
    return int(getattr(hf_config, "max_position_embeddings", 0) or 4096)


def check_max_model_len(asked: int | None, hf_config) -> None:
    """Refuse a `max_model_len` past the model's positions (its RoPE table ends there, and
    transformers' own scaling, where a config has one, is what extends a model's length)."""
    limit = model_max_len(hf_config)
    if asked is not None and asked > limit:
        raise ConfigError(
            f"max_model_len={asked} exceeds the model's {limit} positions "
            f"(max_position_embeddings); ask for {limit} or fewer"
        )


def resolve_max_model_len(asked: int | None, config_len: int, pool_tokens: int) -> int:
    """The longest sequence: as asked (a warning if the pool is shorter: such sequences stop
    with finish reason 'length'), else the model's own limit cut to the pool."""
    limit = asked or config_len
    if limit > pool_tokens:
        if asked:
            logger.warning(
                "max_model_len=%d exceeds the KV pool (%d tokens): longer sequences stop "
                "with finish reason 'length'",
                asked,
                pool_tokens,
            )
        else:
            limit = pool_tokens
    return limit

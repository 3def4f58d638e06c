"""Engine configuration: one frozen dataclass per layer."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CacheConfig:
    """Shape and policy of the paged KV cache.

    Attributes:
        block_size: tokens per KV block.
        num_blocks: blocks in the pool (the runner sizes it from memory when it builds the config).
        enable_prefix_caching: reuse full blocks across sequences through chained block hashes.
        hash_seed: root of the hash chain; fixed so that results are reproducible run to run.
    """

    block_size: int = 16
    num_blocks: int = 1024
    enable_prefix_caching: bool = True
    hash_seed: int = 0

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one scheduler step.

    Attributes:
        max_num_batched_tokens: token budget of one step (prefill chunks and decodes together).
        max_num_seqs: most sequences running at once.
        max_model_len: longest sequence (prompt + output) in tokens.
        debug: check the allocator invariants after every step (cheap, but not free).
    """

    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    max_model_len: int = 4096
    debug: bool = False

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


BIG_CARD_BYTES = 70 * 2**30  # a card this large gets a serving engine's step limits


def default_step_limits(device_type: str, total_bytes: int = 0) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) when the user gives neither: vLLM's defaults for a
    large card (16,384 / 1,024), 8,192 / 256 on smaller CUDA cards (a T4), 2,048 / 256 on the CPU.
    """
    if device_type != "cuda":
        return 2048, 256
    return (16384, 1024) if total_bytes >= BIG_CARD_BYTES else (8192, 256)

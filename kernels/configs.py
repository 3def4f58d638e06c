"""Launch configurations of the Triton attention kernels, one small table per architecture family.

Chosen offline (no autotuning at run time). Families: `sm75` (Turing: no sm_80+ features, FMA
dots, no software pipelining, 64 KB shared memory per program), `sm80` (Ampere/Ada) and `sm90`
(Hopper and newer). sm90 decode comes from `python -m kernels.sweep` on an H200; the other
entries are the design notes' starting points (no sm_80 or sm_75 card has been lent to measure).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

SM75_SHARED_LIMIT = 64 * 1024  # bytes of shared memory one program may use on Turing


@dataclass(frozen=True)
class AttentionConfig:
    """Tile shape and launch parameters of one kernel variant.

    Attributes:
        block_m: query rows per program (query tokens x the GQA group, padded to a power of 2);
            decode uses one token and `max(min_rows, next_pow2(group))` rows instead.
        tile_n: KV positions per loop iteration (may span several cache blocks).
        num_warps, num_stages: Triton launch parameters.
        min_rows: smallest row count of a decode program (tensor-core GPUs pad to 16 anyway).
        fused_combine: split-KV decode merges its partials in the last split program to finish
            (an atomic counter per sequence and KV head) instead of a second kernel launch.
            Off in every shipped config until the H200 A/B (`kernels.bench --fused-combine`).
    """

    block_m: int
    tile_n: int
    num_warps: int
    num_stages: int
    min_rows: int = 16
    fused_combine: bool = False


# (family, phase) -> config for head_dim <= 128; head_dim > 128 halves the tiles (see `lookup`).
CONFIGS: dict[tuple[str, str], AttentionConfig] = {
    ("sm75", "decode"): AttentionConfig(
        block_m=16, tile_n=32, num_warps=4, num_stages=1, min_rows=1
    ),
    ("sm75", "prefill"): AttentionConfig(block_m=64, tile_n=32, num_warps=4, num_stages=1),
    ("sm80", "decode"): AttentionConfig(block_m=16, tile_n=64, num_warps=4, num_stages=2),
    ("sm80", "prefill"): AttentionConfig(block_m=64, tile_n=64, num_warps=4, num_stages=2),
    # H200 sweep (results/kernels-sweep-h200.json): tile 128 / 4 warps / 2 stages wins the
    # geometric mean over decode shapes by ~12% (it loses ~7% at batch 256 with 3 KV heads).
    ("sm90", "decode"): AttentionConfig(block_m=16, tile_n=128, num_warps=4, num_stages=2),
    ("sm90", "prefill"): AttentionConfig(block_m=128, tile_n=64, num_warps=8, num_stages=2),
}

# The interpreter runs numpy per tile: larger tiles mean fewer (slow) iterations.
INTERPRETER_CONFIGS: dict[str, AttentionConfig] = {
    "decode": AttentionConfig(block_m=16, tile_n=64, num_warps=4, num_stages=1, min_rows=1),
    "prefill": AttentionConfig(block_m=64, tile_n=64, num_warps=4, num_stages=1),
}


def family(capability: tuple[int, int]) -> str:
    """Architecture family of a CUDA compute capability, e.g. `(7, 5)` -> `"sm75"`."""
    if capability[0] < 8:
        return "sm75"
    return "sm80" if capability[0] == 8 else "sm90"


def lookup(capability: tuple[int, int] | None, phase: str, head_dim: int) -> AttentionConfig:
    """The shipped config for a device (`None` = the CPU interpreter), phase and head size."""
    cfg = INTERPRETER_CONFIGS[phase] if capability is None else CONFIGS[family(capability), phase]
    if head_dim > 128:
        tile_n = max(16, cfg.tile_n // 2)
        block_m = max(16, cfg.block_m // 2)
        return replace(cfg, block_m=block_m, tile_n=tile_n)
    return cfg

"""Launch configurations of the Triton attention and batch-invariant matmul kernels, one small
table per architecture family.

Chosen offline (no autotuning at run time). Families: `sm75` (Turing: no sm_80+ features, FMA
dots, no software pipelining, 64 KB shared memory per program), `sm80` (Ampere/Ada) and `sm90`
(Hopper and newer). Phases: `prefill`, `decode`, and `decode_wide` for decode grids of more than
`WIDE_PROGRAMS_PER_SM` (sequence, KV head) programs per SM (where a family has no entry of its
own, `decode` serves). sm90 was chosen by a launch-config sweep on an H200; sm80 carries its
choices over (3 stages is what gives the K/V loads two buffers on any cp.async GPU), and sm75 is
the design notes' starting point (no sm_80 or sm_75 card has been lent to measure).
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
        pdl: decode launches as a programmatic dependent launch on sm_90+ (see
            `triton_attention._attn_fwd`): its programs start while the kernel before it (the
            engine's `rotary_write_kv`, or `write_kv`) runs and read the tables and lengths, then
            wait for it. Off in every shipped config: on the H200 it hid 0.4-0.6 us on short
            calls and cost 2.5-3.7 us behind `write_kv` at batch 64 x 8K (measured before the
            engine fused the KV write into its rotary kernel).
    """

    block_m: int
    tile_n: int
    num_warps: int
    num_stages: int
    min_rows: int = 16
    fused_combine: bool = False
    pdl: bool = False


# Decode grids of more (sequence, KV head) programs per SM than this use "decode_wide".
WIDE_PROGRAMS_PER_SM = 4

# (family, phase) -> config for head_dim <= 128; head_dim > 128 halves the tiles (see `lookup`).
CONFIGS: dict[tuple[str, str], AttentionConfig] = {
    ("sm75", "decode"): AttentionConfig(
        block_m=16, tile_n=32, num_warps=4, num_stages=1, min_rows=1
    ),
    ("sm75", "prefill"): AttentionConfig(block_m=64, tile_n=32, num_warps=4, num_stages=1),
    ("sm80", "decode"): AttentionConfig(16, 64, 4, 3, fused_combine=True),
    ("sm80", "decode_wide"): AttentionConfig(16, 128, 4, 3),
    ("sm80", "prefill"): AttentionConfig(block_m=128, tile_n=64, num_warps=8, num_stages=3),
    # On an H200, tile 64 / 4 warps / 3 stages
    # with the fused combine wins the geometric mean over decode shapes; at batch 256 with
    # 3 KV heads (768 programs) it loses ~30% to tile 128, which "decode_wide" takes.
    ("sm90", "decode"): AttentionConfig(16, 64, 4, 3, fused_combine=True),
    ("sm90", "decode_wide"): AttentionConfig(16, 128, 4, 3),
    ("sm90", "prefill"): AttentionConfig(block_m=128, tile_n=64, num_warps=8, num_stages=3),
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


def phase_of(decode: bool, num_seqs: int, num_kv_heads: int, num_sms: int) -> str:
    """The config phase of an attention call: "prefill", or "decode" / "decode_wide" by how many
    (sequence, KV head) programs its grid has per SM."""
    if not decode:
        return "prefill"
    return "decode_wide" if num_seqs * num_kv_heads > WIDE_PROGRAMS_PER_SM * num_sms else "decode"


def pdl_capable(capability: tuple[int, int] | None) -> bool:
    """Whether a device (`None` = the CPU interpreter) has grid dependency control: sm_90+."""
    return capability is not None and capability[0] >= 9


def uses_pdl(capability: tuple[int, int] | None) -> bool:
    """Whether a shipped decode config of this device launches programmatically."""
    if not pdl_capable(capability):
        return False
    fam = family(capability)
    return any(c.pdl for (f, phase), c in CONFIGS.items() if f == fam and phase != "prefill")


def lookup(capability: tuple[int, int] | None, phase: str, head_dim: int) -> AttentionConfig:
    """The shipped config for a device (`None` = the CPU interpreter), phase and head size."""
    if capability is None:
        cfg = INTERPRETER_CONFIGS["prefill" if phase == "prefill" else "decode"]
    else:
        fam = family(capability)
        cfg = CONFIGS.get((fam, phase)) or CONFIGS[fam, "decode"]
    if head_dim > 128:
        tile_n = max(16, cfg.tile_n // 2)
        block_m = max(16, cfg.block_m // 2)
        return replace(cfg, block_m=block_m, tile_n=tile_n)
    return cfg


# The `deterministic` setting: one attention config serves decode and prefill alike, so a row's
# tile shape, warp layout and therefore its reduction order do not depend on the phase of the
# step it runs in (see `triton_attention.paged_attention(batch_invariant=True)`). 64 rows is the
# smallest tile Hopper's warp-group MMA takes; decode programs pad their GQA group to it.
INVARIANT_CONFIGS: dict[str, AttentionConfig] = {
    "sm75": AttentionConfig(block_m=64, tile_n=32, num_warps=4, num_stages=1),
    "sm80": AttentionConfig(block_m=64, tile_n=64, num_warps=4, num_stages=3),
    "sm90": AttentionConfig(block_m=64, tile_n=64, num_warps=4, num_stages=3),
}
INTERPRETER_INVARIANT = AttentionConfig(block_m=64, tile_n=64, num_warps=4, num_stages=1)


def lookup_invariant(capability: tuple[int, int] | None, head_dim: int) -> AttentionConfig:
    """The one attention config of the `deterministic` setting for a device (`None` = the CPU
    interpreter) and head size."""
    cfg = INTERPRETER_INVARIANT if capability is None else INVARIANT_CONFIGS[family(capability)]
    if head_dim > 128:
        return replace(cfg, tile_n=max(16, cfg.tile_n // 2))
    return cfg


@dataclass(frozen=True)
class MatmulConfig:
    """Tile shape of the batch-invariant matmul (`triton_matmul`) of one family.

    Attributes:
        block_m: rows per program; every call's rows are cut into tiles of exactly this many.
        block_n: widest output columns per program; a weight with too few column tiles to give
            every SM one takes narrower ones, down to `min_block_n` (`matmul_block_n`).
        block_k: input features per step of the reduction.
        num_warps, num_stages: Triton launch parameters.
    """

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    min_block_n: int = 32


MATMUL_CONFIGS: dict[str, MatmulConfig] = {
    "sm75": MatmulConfig(block_m=32, block_n=64, block_k=32, num_warps=4, num_stages=1),
    "sm80": MatmulConfig(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=3),
    "sm90": MatmulConfig(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=4),
}
# The interpreter runs numpy per program: the fewer programs and steps, the faster.
INTERPRETER_MATMUL = MatmulConfig(64, 128, 128, num_warps=4, num_stages=1, min_block_n=128)


def lookup_matmul(capability: tuple[int, int] | None) -> MatmulConfig:
    """The batch-invariant matmul config of a device (`None` = the CPU interpreter)."""
    return INTERPRETER_MATMUL if capability is None else MATMUL_CONFIGS[family(capability)]


def matmul_block_n(cfg: MatmulConfig, out_features: int, num_sms: int) -> int:
    """Output columns per program for a weight of `out_features` rows: the config's width,
    halved while the weight would have fewer column tiles than half the SMs (a decode step's few
    rows then still stream the weight on most of the GPU). Set by the weight and the device
    alone, never by the call's row count."""
    block_n = cfg.block_n
    while block_n > cfg.min_block_n and -(-out_features // block_n) < num_sms // 2:
        block_n //= 2
    return block_n

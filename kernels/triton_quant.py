"""Weight-only quantized matmul in Triton (W4A16, W8A16) for `kernels.quant.QuantizedWeight`.

`prepare(weight)` once at load, then `linear(x, prepared, bias)`: `x @ dequantize(weight).T
(+ bias)` in `x`'s dtype, the contract of `kernels.quant.reference_linear`.

Each program computes one output tile transposed, `[BLOCK_N features, BLOCK_M rows]` =
`W[BLOCK_N, K] @ x[BLOCK_M, K]^T`: the weight is the matrix instruction's A operand, so once
dequantized in registers it feeds the tensor cores from there (Hopper's warp-group MMA takes A
from registers and B, here `x`, from shared memory), and a decode step's few rows are the MMA's
narrow side (8 to 16 columns) instead of padding a 64-row operand.

Per step of `BLOCK_K` input features a program loads its rows' bytes of `qdata` (4 bits: two
features a byte, unpacked with a join that keeps each pair in one thread), turns the integers
into float32 exactly without a conversion instruction (the integer ORed into the mantissa of
2^23, then 2^23 subtracted: integer/float conversions run at a fraction of the FP32 rate,
which would bound a decode step's dequantization below the memory's speed), applies the group's
scale and offset in float32 (one fused multiply-add) and rounds once to the dot's dtype; the dot
accumulates in float32. Per-channel weights without offsets (`group_size == in_features`)
skip the scale in the loop: the dot takes the integers themselves (exact in float16 and
bfloat16) and the epilogue multiplies by the row's scale once. (With offsets they dequantize in
the loop as groups do: folding the offset in after the loop as `offset * sum(x)` needs each
row's sum of `x` beside the dot, which Triton 3.6 got wrong on an H100.)

The dot runs in `x`'s dtype: float16 on tensor cores (FMA dots on sm_75, where Triton issues no
MMA), bfloat16 from sm_80 (not on sm_75: `linear` refuses it), and float32 `x` as TF32 on sm_80+
(float32 range, float16's 10-bit mantissa; IEEE float32 on sm_75 and in the interpreter).

Split-K (`SPLIT_K > 1`, calls whose tiles leave SMs idle: decode steps, narrow weights): each
split stores its float32 partial tile, and the last split of a tile to arrive (an atomic
counter per tile, left zero for the next call) sums all partials in split order, so the result
does not depend on the arrival order. `batch_invariant=True` runs one config per weight and
never splits: a row's bits do not depend on the other rows of the call (the engine's
`deterministic` setting).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from . import triton_dequant
from .configs import MatmulConfig, family, matmul_block_n
from .quant import QuantizedWeight
from .triton_attention import _device_info
from .triton_splits import _split_counters

# Per family, (most rows, config) by increasing row count: a call takes the first entry whose
# bound holds. Decode-sized calls take 16-column tiles (the MMA's narrow side) and long steps
# (a weight tile of 64 rows x 128 features is 4 KB at 4 bits), prefill the compute-bound shape.
# sm90's decode tile: of 12 (32/64/128 rows x 128/256 features x 3/4 stages) timed on an H100 at
# 1 row, 128 x 256 was 17% faster on Llama-3-8B's o_proj and 1.9x slower on Qwen2.5-0.5B's, 64 x
# 128 within 2% of the best there. sm80 carries sm90's tiles over and sm75 (FMA dots, no
# software pipelining, 64 KB of shared memory a program, decode tiles as narrow as the rows) is
# the design's starting point: no sm_80 or sm_75 card was lent to measure them. On sm_75 the FMA
# dot holds its operands in registers: with 4 warps the 16- and 64-row tiles spilled (255
# registers, 250-1,100 bytes, ptxas), with 8 none do (`benchmarks.quant_compile`).
CONFIGS: dict[str, list[tuple[int | None, MatmulConfig]]] = {
    "sm75": [
        (4, MatmulConfig(block_m=4, block_n=64, block_k=64, num_warps=4, num_stages=1)),
        (16, MatmulConfig(block_m=16, block_n=64, block_k=64, num_warps=8, num_stages=1)),
        (None, MatmulConfig(block_m=64, block_n=64, block_k=32, num_warps=8, num_stages=1)),
    ],
    "sm80": [
        (16, MatmulConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4)),
        (64, MatmulConfig(block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=3)),
        (None, MatmulConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)),
    ],
    "sm90": [
        (16, MatmulConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4)),
        (64, MatmulConfig(block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=4)),
        (None, MatmulConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)),
    ],
}
# The `deterministic` setting: one config per family; narrow weights take narrower column tiles
# (`configs.matmul_block_n`: set by the weight and the device, never by the call's rows).
INVARIANT_CONFIGS: dict[str, MatmulConfig] = {
    "sm75": MatmulConfig(block_m=64, block_n=64, block_k=32, num_warps=8, num_stages=1),
    "sm80": MatmulConfig(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=3),
    "sm90": MatmulConfig(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=4),
}
# The interpreter runs numpy per program and step: few, large tiles.
INTERPRETER_CONFIGS: list[tuple[int | None, MatmulConfig]] = [
    (16, MatmulConfig(block_m=16, block_n=64, block_k=64, num_warps=4, num_stages=1)),
    (None, MatmulConfig(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=1)),
]
INTERPRETER_INVARIANT = MatmulConfig(64, 64, 64, num_warps=4, num_stages=1, min_block_n=64)

# Split-K: up to this many splits, filling the SMs up to this many programs each, each split at
# least this many steps long. On an H100 at 1 row (4 bits, groups of 128), 8 splits of Llama-3-8B's
# o_proj (512 programs) and 7 one-step splits of Qwen2.5-0.5B's (98) were within 2% of the fastest
# forced count; 2 programs an SM and 2 steps a split (4 and 3 splits) were 14% and 36% slower.
MAX_SPLIT_K = 16
SPLIT_PROGRAMS_PER_SM = 4
MIN_SPLIT_STEPS = 1


@dataclass(frozen=True)
class TritonQuantWeight:
    """A `QuantizedWeight` laid out for `linear`: `qdata` as given (contiguous: a program reads
    each of its rows' bytes of a step as one run), `scales` and `offsets` transposed to
    `[in // group_size, out]` (a step's scales of consecutive rows are consecutive), in the
    dtype the loader chose.

    Attributes:
        bits: 4 or 8.
        group_size: input features per scale.
        qdata: uint8 `[out, in // 2]` (4 bits) or int8 `[out, in]` (8 bits).
        scales: `[in // group_size, out]`.
        offsets: like `scales`, or None for zero.
    """

    bits: int
    group_size: int
    qdata: Tensor
    scales: Tensor
    offsets: Tensor | None

    @property
    def shape(self) -> tuple[int, int]:
        """`(out_features, in_features)` of the float weight."""
        out, width = self.qdata.shape
        return out, width * 2 if self.bits == 4 else width

    @property
    def nbytes(self) -> int:
        """Bytes of integers, scales and offsets."""
        extra = 0 if self.offsets is None else self.offsets.nbytes
        return self.qdata.nbytes + self.scales.nbytes + extra


def prepare(weight: QuantizedWeight) -> TritonQuantWeight:
    """`weight` in `linear`'s layout, on its device (once, at load). Groups of a power of 2 or
    of a multiple of 16 features, or one group a row."""
    group, in_features = weight.group_size, weight.shape[1]
    if group != in_features and group & (group - 1) and (group & -group) < 16:
        raise ValueError(
            f"group_size {group} is neither a power of 2, a multiple of 16 nor in_features "
            f"({in_features}): the Triton kernels cannot run it; dequantize the weight instead"
        )
    offsets = None if weight.offsets is None else weight.offsets.t().contiguous()
    return TritonQuantWeight(
        weight.bits,
        weight.group_size,
        weight.qdata.contiguous(),
        weight.scales.t().contiguous(),
        offsets,
    )


class Plan(NamedTuple):
    """How `linear` launches one call: tile config, reduction step, splits and their length."""

    config: MatmulConfig
    block_k: int
    split_k: int
    steps_per_split: int


def plan(
    rows: int,
    weight: TritonQuantWeight,
    capability: tuple[int, int] | None,
    num_sms: int,
    batch_invariant: bool = False,
    config: MatmulConfig | None = None,
    split_k: int | None = None,
) -> Plan:
    """The launch of a call of `rows` rows on a device (`capability` None: the interpreter).

    The config: the family's entry for `rows` (`config` overrides it). The reduction step:
    the config's, shorter where `_block_k` says. Split-K only where the call's tiles leave SMs
    idle: as many splits as fill them up to SPLIT_PROGRAMS_PER_SM programs each, none shorter
    than MIN_SPLIT_STEPS steps (`split_k` overrides the count); never an empty split.
    Batch-invariant calls take the family's one config (its column tile narrowed for narrow
    weights) and no split.
    """
    out_features, in_features = weight.shape
    if config is not None:
        cfg = config
    elif batch_invariant:
        cfg = INVARIANT_CONFIGS[family(capability)] if capability else INTERPRETER_INVARIANT
        cfg = replace(cfg, block_n=matmul_block_n(cfg, out_features, num_sms))
    else:
        table = CONFIGS[family(capability)] if capability else INTERPRETER_CONFIGS
        cfg = next(c for most, c in table if most is None or rows <= most)
    block_k = _block_k(cfg.block_k, in_features, weight.group_size)
    steps = triton.cdiv(in_features, block_k)
    tiles = triton.cdiv(rows, cfg.block_m) * triton.cdiv(out_features, cfg.block_n)
    if batch_invariant:
        split = 1
    elif split_k is not None:
        split = max(1, min(split_k, steps))
    elif tiles < num_sms:
        wanted = SPLIT_PROGRAMS_PER_SM * num_sms // tiles
        split = max(1, min(MAX_SPLIT_K, wanted, steps // MIN_SPLIT_STEPS))
    else:
        split = 1
    per_split = triton.cdiv(steps, split)
    return Plan(cfg, block_k, triton.cdiv(steps, per_split), per_split)  # no split left empty


def dequantizes(
    rows: int, device: torch.device, capability: tuple[int, int] | None, batch_invariant: bool
) -> bool:
    """Whether a call of `rows` rows dequantizes the weight and runs cuBLAS
    (`kernels.triton_dequant`): a CUDA device, at least its family's `DEQUANT_ROWS`, not
    batch-invariant, not inside a CUDA graph capture."""
    if capability is None or batch_invariant:
        return False
    if rows < triton_dequant.DEQUANT_ROWS[family(capability)]:
        return False
    return device.type != "cuda" or not torch.cuda.is_current_stream_capturing()


def _block_k(widest: int, in_features: int, group: int) -> int:
    """Input features a reduction step takes: at most `widest`, no more than the power of 2 at
    or above `in_features`; for groups of no power of 2, a power of 2 that divides the group
    (so that every step lies in one group)."""
    if group != in_features and group & (group - 1):
        return min(widest, group & -group)
    return min(widest, triton.next_power_of_2(in_features))


def linear(
    x: Tensor,
    weight: TritonQuantWeight,
    bias: Tensor | None = None,
    batch_invariant: bool = False,
    *,
    config: MatmulConfig | None = None,
    split_k: int | None = None,
) -> Tensor:
    """`x @ dequantize(weight).T (+ bias)` of `x [M, in]` (float16, bfloat16 or float32; any
    strides) in `x`'s dtype, accumulated in float32; contract of `kernels.quant.reference_linear`.

    On a GPU, a call of at least its family's `triton_dequant.DEQUANT_ROWS` rows (a prefill
    chunk) dequantizes the weight once and runs cuBLAS (`dequantizes`).
    `batch_invariant`: each row's bits depend on that row alone (one config per weight, no
    split-K, never dequantized). `config` and `split_k` override the shipped choice (tests,
    tuning) and keep the in-register kernel; `split_k` is clamped so that no split is empty.
    """
    out_features, in_features = weight.shape
    if x.dim() != 2 or x.shape[1] != in_features:
        raise ValueError(f"x must be [rows, {in_features}], got {tuple(x.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    capability, num_sms = _device_info(x.device)
    if x.dtype == torch.bfloat16 and capability is not None and capability < (8, 0):
        raise ValueError(
            "bfloat16 needs compute capability 8.0 or newer (e.g. not a T4); use float16"
        )
    if x.stride(1) != 1:
        x = x.contiguous()
    rows = x.shape[0]
    if (
        config is None
        and split_k is None
        and dequantizes(rows, x.device, capability, batch_invariant)
    ):
        return F.linear(x, triton_dequant.dequantize(weight, x.dtype), bias)
    out = torch.empty((rows, out_features), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    cfg, block_k, split, per_split = plan(
        rows, weight, capability, num_sms, batch_invariant, config=config, split_k=split_k
    )
    grid = (triton.cdiv(rows, cfg.block_m), triton.cdiv(out_features, cfg.block_n), split)
    tiles = grid[0] * grid[1]
    if split > 1:
        ws = torch.empty((tiles, split, cfg.block_n * cfg.block_m), device=x.device)
        counters = _split_counters(x.device, tiles)
    else:
        ws = counters = out  # never touched
    tf32 = x.dtype == torch.float32 and capability is not None and capability >= (8, 0)
    _quant_matmul[grid](
        x, weight.qdata, weight.scales, weight.offsets, bias, out, ws, counters,
        rows, x.stride(0),
        N=out_features, K=in_features, GROUP=weight.group_size, BITS=weight.bits,
        HAS_OFFSETS=weight.offsets is not None, HAS_BIAS=bias is not None,
        DOT_PREC="tf32" if tf32 else "ieee", SPLIT_K=split, STEPS_PER_SPLIT=per_split,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out


@triton.jit
def _integers(qv, BITS: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
    """A tile of `qdata` (`[ROWS, COLS * BITS // 8]` bytes) as float32 integers `[ROWS, COLS]`:
    each integer ORed into the mantissa of 2^23 (plus 128 for signed 8 bits), then that
    subtracted, exact and without a conversion instruction."""
    if BITS == 4:
        b = qv.to(tl.int32)  # zero-extended
        low = ((b & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)
        high = ((b >> 4) | 0x4B000000).to(tl.float32, bitcast=True)
        return tl.reshape(tl.join(low, high), (ROWS, COLS)) - 8388608.0
    else:
        return (qv.to(tl.int32) + 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0


@triton.jit
def _store_tile(out_ptr, b_ptr, acc, rows, cols, num_rows, N: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Add the bias and store a transposed tile `acc [features, rows]` of `out [rows, N]`."""
    col_ok = cols < N
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[:, None]
    out_at = out_ptr + rows[None, :].to(tl.int64) * N + cols[:, None]
    mask = col_ok[:, None] & (rows < num_rows)[None, :]
    tl.store(out_at, acc.to(out_ptr.dtype.element_ty), mask=mask)


def meta_weight(
    out_features: int, in_features: int, bits: int, group: int, offsets: bool
) -> TritonQuantWeight:
    """A `TritonQuantWeight` of meta tensors: a layout alone, to plan or compile for."""
    width = in_features // 2 if bits == 4 else in_features
    qtype = torch.uint8 if bits == 4 else torch.int8
    qdata = torch.empty(out_features, width, dtype=qtype, device="meta")
    scales = torch.empty(in_features // group, out_features, dtype=torch.float16, device="meta")
    return TritonQuantWeight(bits, group, qdata, scales, scales if offsets else None)


def cross_compile(
    cc: int,
    launch: Plan,
    weight: TritonQuantWeight,
    x_dtype: str = "fp16",
    bias: bool = False,
):
    """`_quant_matmul` compiled for compute capability `cc` (75 for sm_75) without a device, as
    `linear` launches `launch` on `weight` with `x` of `x_dtype` ("fp16", "bf16", "fp32"): the
    same constants and the 16-byte alignment of the pointers and of x's row stride that the JIT
    sees (the alignment sets the loads' vector width, hence the pipelining and shared memory).
    `weight` may hold meta tensors (`meta_weight`): only its layout is read. Returns Triton's
    compiled kernel (`.metadata.shared`, `.asm["ptx"]`, `.asm["cubin"]`)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    out_features, in_features = weight.shape
    cfg = launch.config
    ptrs = {name: f"*{x_dtype}" for name in ("x_ptr", "b_ptr", "out_ptr")}
    ptrs.update(q_ptr="*u8" if weight.bits == 4 else "*i8", s_ptr="*fp16", o_ptr="*fp16")
    ptrs.update(ws_ptr="*fp32", counter_ptr="*i32")
    consts = dict(N=out_features, K=in_features, GROUP=weight.group_size, BITS=weight.bits)
    tf32 = x_dtype == "fp32" and cc >= 80
    consts.update(HAS_OFFSETS=weight.offsets is not None, HAS_BIAS=bias)
    consts.update(DOT_PREC="tf32" if tf32 else "ieee", SPLIT_K=launch.split_k)
    consts.update(STEPS_PER_SPLIT=launch.steps_per_split, BLOCK_M=cfg.block_m)
    consts.update(BLOCK_N=cfg.block_n, BLOCK_K=launch.block_k)
    sig, attrs = {}, {}
    for i, name in enumerate(_quant_matmul.arg_names):
        sig[name] = "constexpr" if name in consts else ptrs.get(name, "i32")
        if name in ptrs or name == "stride_xm":
            attrs[(i,)] = [["tt.divisibility", 16]]
    target = GPUTarget("cuda", cc, 32)
    options = triton.compiler.make_backend(target).parse_options(
        {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    )
    source = ASTSource(_quant_matmul, sig, consts, attrs)
    return triton.compile(source, target=target, options=options.__dict__)


@triton.jit(do_not_specialize=["num_rows"])
def _quant_matmul(
    x_ptr, q_ptr, s_ptr, o_ptr, b_ptr, out_ptr, ws_ptr, counter_ptr,
    num_rows, stride_xm,
    N: tl.constexpr, K: tl.constexpr, GROUP: tl.constexpr, BITS: tl.constexpr,
    HAS_OFFSETS: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PREC: tl.constexpr,
    SPLIT_K: tl.constexpr, STEPS_PER_SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    SCALE_AFTER: tl.constexpr = GROUP == K and not HAS_OFFSETS  # the dot takes the integers
    PACK: tl.constexpr = 8 // BITS  # integers a byte
    EVEN_K: tl.constexpr = K % BLOCK_K == 0
    NSUB: tl.constexpr = max(1, BLOCK_K // GROUP)  # groups a step spans
    SUB: tl.constexpr = BLOCK_K // NSUB  # features a step has of each of its groups
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    # Loads wrap past the last row and column (duplicates, never stored): no masks on them.
    x_at = x_ptr + (rows % num_rows).to(tl.int64)[None, :] * stride_xm  # [1, BLOCK_M]
    q_at = q_ptr + (cols % N).to(tl.int64)[:, None] * (K // PACK)  # [BLOCK_N, 1]
    col = (cols % N)[:, None]  # of the scales and offsets, [K // GROUP, N]
    kk = tl.arange(0, BLOCK_K)
    kq = tl.arange(0, BLOCK_K // PACK)
    sub = tl.arange(0, NSUB)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    k_begin = split * STEPS_PER_SPLIT * BLOCK_K
    k_end = tl.minimum(k_begin + STEPS_PER_SPLIT * BLOCK_K, K)
    for k0 in range(k_begin, k_end, BLOCK_K):
        if EVEN_K:
            xt = tl.load(x_at + (k0 + kk)[:, None])  # [BLOCK_K, BLOCK_M]
            qv = tl.load(q_at + (k0 // PACK + kq)[None, :])
        else:  # features past K load as zeros, their groups' scales and offsets too
            k_ok = (k0 + kk < K)[:, None]
            xt = tl.load(x_at + (k0 + kk)[:, None], mask=k_ok, other=0.0)
            q_ok = (k0 + kq * PACK < K)[None, :]
            qv = tl.load(q_at + (k0 // PACK + kq)[None, :], mask=q_ok, other=0)
        w = _integers(qv, BITS, BLOCK_N, BLOCK_K)
        if not SCALE_AFTER:
            g = k0 // GROUP + sub
            g_ok = (g < K // GROUP)[None, :]  # all true where EVEN_K
            scale = tl.load(s_ptr + col + g[None, :] * N, mask=g_ok, other=0.0)  # [BLOCK_N, NSUB]
            scale = scale.to(tl.float32)[:, :, None]
            w = tl.reshape(w, (BLOCK_N, NSUB, SUB))
            if HAS_OFFSETS:
                offset = tl.load(o_ptr + col + g[None, :] * N, mask=g_ok, other=0.0)
                w = tl.fma(w, scale, offset.to(tl.float32)[:, :, None])
            else:
                w *= scale
            w = tl.reshape(w, (BLOCK_N, BLOCK_K))
        acc = tl.dot(w.to(xt.dtype), xt, acc, input_precision=DOT_PREC)
    if SCALE_AFTER:
        acc *= tl.load(s_ptr + col).to(tl.float32)
    if SPLIT_K == 1:
        _store_tile(out_ptr, b_ptr, acc, rows, cols, num_rows, N, HAS_BIAS)
    else:
        tile = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        part = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
        ws_at = ws_ptr + tile.to(tl.int64) * SPLIT_K * BLOCK_N * BLOCK_M + part
        tl.store(ws_at + split * BLOCK_N * BLOCK_M, acc)
        # Every thread's stores are issued (barrier), then one acq_rel atomic at GPU scope
        # publishes them and tells this program whether it came last.
        tl.debug_barrier()
        counter = counter_ptr + tile
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1:
            tl.store(counter, 0)  # ready for the next call
            total = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
            for s in tl.static_range(SPLIT_K):  # in split order, whoever arrived last
                total += tl.load(ws_at + s * BLOCK_N * BLOCK_M, cache_modifier=".cg")
            _store_tile(out_ptr, b_ptr, total, rows, cols, num_rows, N, HAS_BIAS)

"""A packed weight dequantized to a float weight in Triton, for the calls of many rows.

A weight-only matmul is worth its in-register dequantization where the call reads the weight
once for few rows (a decode step): it reads a quarter or half of the bytes. A prefill chunk of
hundreds or thousands of rows is bound by the tensor cores instead, and there cuBLAS on a float
weight beats a Triton tile that dequantizes in its inner loop (2.8x float16 `F.linear` at 256
rows on an H100, `results/quant-kernels-h100.md`; on sm_75 Triton issues no MMA at all). So a
call of at least `DEQUANT_ROWS[family]` rows writes the whole float weight once (`dequantize`:
`out * in` elements, two bytes each for float16/bfloat16) and runs `F.linear` on it; the buffer
lives for the call only.

The value of every element is the reference's (`kernels.quant.dequantize`): the integer times
its group's scale plus its offset in float32 (a GPU may fuse the two into one multiply-add),
rounded once to the weight's dtype. The product then differs from the in-register kernel only
by cuBLAS's order of summation. `batch_invariant` calls never take this path (their rows' bits
must not depend on how many rows came), nor do calls inside a CUDA graph capture (the decode
graphs: a buffer of the largest weight in every graph's pool, for calls the in-register kernel
serves better).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

# Per family, the fewest rows a call must have to dequantize and run cuBLAS. sm90: on an H100 at
# Llama-3-8B's layers (results/quant-kernels-llama-h100.md) it took 0.71-0.78x the in-register
# kernel's time at 1,024 rows, and at 256 rows 0.62-0.75x on q/k/v and o but 1.26-1.30x on
# gate/up (whose dequantized write then costs more than the tile's MMA loss); sm80 takes sm90's
# choice. sm75: Triton's dot runs on FMA units there, cuBLAS float16 on the tensor cores (no T4
# was lent to time it).
DEQUANT_ROWS: dict[str, int] = {"sm75": 32, "sm80": 512, "sm90": 512}
BLOCK_N, BLOCK_K = 32, 128  # float features a program writes: 32 x 128 (8 KB in float16)


def dequantize(weight, dtype: torch.dtype) -> Tensor:
    """The float weight `[out, in]` of a `triton_quant.TritonQuantWeight` in `dtype`."""
    out_features, in_features = weight.shape
    w = torch.empty((out_features, in_features), dtype=dtype, device=weight.qdata.device)
    grid = (triton.cdiv(out_features, BLOCK_N), triton.cdiv(in_features, BLOCK_K))
    _dequant[grid](
        weight.qdata, weight.scales, weight.offsets, w,
        N=out_features, K=in_features, GROUP=weight.group_size, BITS=weight.bits,
        HAS_OFFSETS=weight.offsets is not None, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )  # fmt: skip
    return w


@triton.jit
def _dequant(
    q_ptr, s_ptr, o_ptr, w_ptr,
    N: tl.constexpr, K: tl.constexpr, GROUP: tl.constexpr, BITS: tl.constexpr,
    HAS_OFFSETS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    PACK: tl.constexpr = 8 // BITS
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # output features (weight rows)
    kq = tl.program_id(1) * (BLOCK_K // PACK) + tl.arange(0, BLOCK_K // PACK)
    ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    col_ok = (cols < N)[:, None]
    q_at = q_ptr + cols.to(tl.int64)[:, None] * (K // PACK) + kq[None, :]
    qv = tl.load(q_at, mask=col_ok & (kq < K // PACK)[None, :], other=0)
    if BITS == 4:
        b = qv.to(tl.int32)
        w = tl.reshape(tl.join(b & 0xF, b >> 4), (BLOCK_N, BLOCK_K)).to(tl.float32)
    else:
        w = qv.to(tl.float32)
    ok = col_ok & (ks < K)[None, :]
    g_at = (ks // GROUP)[None, :] * N + cols[:, None]  # scales and offsets are [K // GROUP, N]
    scale = tl.load(s_ptr + g_at, mask=ok, other=0.0).to(tl.float32)
    if HAS_OFFSETS:
        w = w * scale + tl.load(o_ptr + g_at, mask=ok, other=0.0).to(tl.float32)
    else:
        w = w * scale
    w_at = w_ptr + cols.to(tl.int64)[:, None] * K + ks[None, :]
    tl.store(w_at, w.to(w_ptr.dtype.element_ty), mask=ok)

"""Skinny projections of decode batches, with the RMSNorm before them and the SwiGLU after them
fused in.

A decode step multiplies a few rows (one per sequence) by each weight matrix, so a projection's
time is the read of its weight; cuBLAS covers such shapes with a GEMM kernel of its own, a
split-K reduction for the tall ones, and separate norm and activation kernels around them. Here
one program computes `BLOCK_N` output columns of every row: it streams its `BLOCK_N` weight rows
through the reduction axis `BLOCK_K` at a time (`tl.dot` on rows padded to 16), and
- with `NORM`, first normalises its input rows itself (RMSNorm of `x`, or of `x + residual`,
  whose sum the first program also stores as the new residual stream), rounding where the
  separate `rms_norm` kernel rounds;
- with `SWIGLU`, reads the gate and the up rows of a fused gate/up weight and stores
  `silu(gate) * up`, rounding the projections to the output's dtype first, as the separate
  `silu_and_mul` reads them.
There is no split-K: each output's reduction order depends on the weight's shape alone.
Same contract as the composition of `rms_norm`, `F.linear` and `silu_and_mul`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .configs import LinearConfig
from .triton_attention import _device_info


@triton.jit
def _input_tile(
    x_ptr, res_ptr, rows, row_ok, k, k_ok, stride_xt, stride_rt, RESIDUAL: tl.constexpr
):  # fmt: skip
    """Rows `rows` x columns `k` of the input, `x` or `x + residual` rounded to x's dtype."""
    mask = row_ok[:, None] & k_ok[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_xt + k[None, :], mask=mask, other=0.0)
    if RESIDUAL:
        r = tl.load(res_ptr + rows[:, None] * stride_rt + k[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
    return x


@triton.jit(do_not_specialize=["num_rows"])
def _skinny_linear(
    x_ptr, res_ptr, sum_ptr, nw_ptr, w_ptr, b_ptr, out_ptr,
    num_rows, stride_xt, stride_rt, stride_st, stride_wn, stride_ot, eps,
    N: tl.constexpr, K: tl.constexpr, NORM: tl.constexpr, RESIDUAL: tl.constexpr,
    BIAS: tl.constexpr, SWIGLU: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M).to(tl.int64)
    row_ok = rows < num_rows
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    kk = tl.arange(0, BLOCK_K)
    dtype = x_ptr.dtype.element_ty
    inv_rms = tl.zeros([BLOCK_M], tl.float32)
    if NORM:
        sum_sq = tl.zeros([BLOCK_M], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + kk
            k_ok = k < K
            x = _input_tile(x_ptr, res_ptr, rows, row_ok, k, k_ok, stride_xt, stride_rt, RESIDUAL)
            if RESIDUAL and pid == 0:  # the new residual stream, stored once
                s_at = sum_ptr + rows[:, None] * stride_st + k[None, :]
                tl.store(s_at, x, mask=row_ok[:, None] & k_ok[None, :])
            xf = x.to(tl.float32)
            sum_sq += tl.sum(xf * xf, axis=1)
        inv_rms = tl.math.rsqrt(sum_sq / K + eps)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kk
        k_ok = k < K
        x = _input_tile(x_ptr, res_ptr, rows, row_ok, k, k_ok, stride_xt, stride_rt, RESIDUAL)
        if NORM:
            nw = tl.load(nw_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
            normed = (x.to(tl.float32) * inv_rms[:, None]).to(dtype).to(tl.float32)
            x = (normed * nw[None, :]).to(dtype)
        w_mask = col_ok[:, None] & k_ok[None, :]
        w = tl.load(w_rows + k[None, :], mask=w_mask, other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
        if SWIGLU:
            w_up = tl.load(w_rows + N * stride_wn + k[None, :], mask=w_mask, other=0.0)
            acc_up = tl.dot(x, tl.trans(w_up), acc_up)
    if BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out_ty = out_ptr.dtype.element_ty
    if SWIGLU:
        gate = acc.to(out_ty).to(tl.float32)
        up = acc_up.to(out_ty).to(tl.float32)
        acc = gate / (1.0 + tl.exp(-gate)) * up
    out_at = out_ptr + rows[:, None] * stride_ot + cols[None, :]
    tl.store(out_at, acc.to(out_ty), mask=row_ok[:, None] & col_ok[None, :])


def block_n(n: int, num_sms: int) -> int:
    """Output columns per program: the widest of 64, 32, 16 that still gives every SM a program
    (a narrow weight gets 16 and fewer programs than SMs)."""
    for width in (64, 32):
        if triton.cdiv(n, width) >= num_sms:
            return width
    return 16


def skinny_linear(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    cfg: LinearConfig,
    norm_weight: Tensor | None = None,
    eps: float = 0.0,
    residual: Tensor | None = None,
    swiglu: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """`x @ weight.T (+ bias)` of `[T, K]` rows, `T <= cfg.max_rows`; with `norm_weight`, of
    `rms_norm(x (+ residual))` instead; with `swiglu`, `silu_and_mul` of the result (`weight` is
    a fused `[2I, K]` gate/up). Returns (output, the residual stream `x + residual`, or None
    without a residual)."""
    num_rows, k = x.shape
    n = weight.shape[0] // 2 if swiglu else weight.shape[0]
    assert num_rows <= cfg.max_rows and weight.shape[1] == k and weight.stride(1) == 1
    assert x.stride(1) == 1 and (residual is None or norm_weight is not None)
    out = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    summed = None
    if residual is not None:
        assert residual.shape == x.shape and residual.stride(1) == 1
        summed = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out, summed
    width = block_n(n, _device_info(x.device)[1])
    _skinny_linear[(triton.cdiv(n, width),)](
        x, residual, summed, norm_weight, weight, bias, out,
        num_rows, x.stride(0), 0 if residual is None else residual.stride(0), k,
        weight.stride(0), out.stride(0), eps,
        N=n, K=k, NORM=norm_weight is not None, RESIDUAL=residual is not None,
        BIAS=bias is not None, SWIGLU=swiglu,
        BLOCK_M=max(16, triton.next_power_of_2(num_rows)), BLOCK_N=width, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out, summed

"""Batch-invariant Triton matmul: the projections of the `deterministic` setting on the GPU.

cuBLAS picks its kernel, its tile shape and its split of the reduction axis by the shape of the
whole call, so a row's bits change with the number of rows beside it (a decode step of 3
sequences and one of 200 run different kernels, and a prefill chunk yet another). Here every call
with one weight runs one kernel variant: rows in tiles of exactly `block_m`, output columns in
tiles of a width set by the weight and the device (`configs.matmul_block_n`), and each output the
sum over the input features `block_k` at a time, in order, into one float32 accumulator (a
`tl.dot` of fixed shape per step). There is no split-K, so nothing is summed across programs.
Rows past the call's end (the last tile's padding) load as zeros and are never stored; they touch
no other row. Same contract as `F.linear`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .configs import MatmulConfig, lookup_matmul, matmul_block_n
from .triton_attention import _device_info


@triton.jit(do_not_specialize=["num_rows"])
def _matmul(
    x_ptr, w_ptr, b_ptr, out_ptr,
    num_rows, stride_xt, stride_xk, stride_wn, stride_wk, stride_ot,
    N: tl.constexpr, K: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < num_rows
    col_ok = cols < N
    kk = tl.arange(0, BLOCK_K)
    x_at = x_ptr + rows[:, None] * stride_xt + kk[None, :] * stride_xk
    w_at = w_ptr + cols[None, :].to(tl.int64) * stride_wn + kk[:, None] * stride_wk  # [K, N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if K % BLOCK_K == 0:
            x = tl.load(x_at, mask=row_ok[:, None], other=0.0)
            w = tl.load(w_at, mask=col_ok[None, :], other=0.0)
        else:
            k_ok = k0 + kk < K
            x = tl.load(x_at, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_at, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(x, w, acc, input_precision=DOT_PREC)
        x_at += BLOCK_K * stride_xk
        w_at += BLOCK_K * stride_wk
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out_at = out_ptr + rows[:, None] * stride_ot + cols[None, :]
    tl.store(out_at, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def launch(weight: Tensor, config: MatmulConfig | None = None) -> dict[str, int | str]:
    """The constexprs and launch parameters of `_matmul` for a weight `[out, in]` on its device:
    the same for every call with that weight, whatever its row count."""
    capability, num_sms = _device_info(weight.device)
    cfg = config or lookup_matmul(capability)
    n, k = weight.shape
    return dict(
        N=n, K=k, DOT_PREC="ieee" if weight.dtype == torch.float32 else "tf32",
        BLOCK_M=cfg.block_m, BLOCK_N=matmul_block_n(cfg, n, num_sms), BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip


def linear(
    x: Tensor, weight: Tensor, bias: Tensor | None = None, config: MatmulConfig | None = None
) -> Tensor:
    """`x @ weight.T (+ bias)` of `[T, in]` rows, each row's bits independent of the others
    (`config` overrides the shipped table)."""
    assert x.dim() == 2 and x.shape[1] == weight.shape[1] and x.dtype == weight.dtype
    out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
    if x.shape[0] == 0:
        return out
    meta = launch(weight, config)
    grid = (triton.cdiv(x.shape[0], meta["BLOCK_M"]), triton.cdiv(weight.shape[0], meta["BLOCK_N"]))
    _matmul[grid](
        x, weight, bias, out, x.shape[0], *x.stride(), *weight.stride(), out.stride(0),
        HAS_BIAS=bias is not None, **meta,
    )  # fmt: skip
    return out

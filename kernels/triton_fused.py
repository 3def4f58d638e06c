"""Fused Triton elementwise ops of the decoder: RMSNorm (+ residual add), rotary (+ the KV write),
SiLU-and-mul.

Same contracts as `kernels.reference.rms_norm`, `rotary`, `rotary_write_kv` and `silu_and_mul`;
each is one kernel launch where PyTorch runs 3 to 8 (which matters inside a replayed decode graph
at batch 256). `rotary_write_kv` also stores the new tokens' rotated K and their V rows in the
paged cache, so the engine's layers launch no `write_kv` of their own.
Arithmetic is in float32. `rms_norm` rounds where the reference rounds (the residual sum and the
normalised value to the input dtype, the weighted product to the output dtype), so it differs from
the reference only by the order of the mean's summation and the `rsqrt` approximation. `rotary`
and `silu_and_mul` round once, at the end, where the reference rounds every intermediate product
in the tensors' dtype: for float16/bfloat16 they differ from the reference by those intermediate
roundings (a few units in the last place of the products), for float32 by float32 noise.

Launch arguments are the pointers plus the strides that can vary; sizes are constexpr (one
compiled variant per model shape). Offsets along the token axis are int64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import gdc_launch_dependents

from . import configs
from .triton_attention import _device_info

MAX_TILE = 1024  # elements per program tile (per operand) before a kernel loops or splits


@triton.jit(do_not_specialize=["num_rows"])
def _rms_norm(
    x_ptr, w_ptr, out_ptr, res_ptr, sum_ptr,
    num_rows, stride_xt, stride_xn, stride_rt,
    EPS: tl.constexpr, HEADS: tl.constexpr, SIZE: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_H)
    mask = (rows < num_rows)[:, None] & (cols < SIZE)[None, :]
    token, head = rows // HEADS, rows % HEADS
    x_at = (token * stride_xt + head * stride_xn)[:, None] + cols
    x = tl.load(x_ptr + x_at, mask=mask, other=0)
    out_at = rows[:, None] * SIZE + cols  # outputs are new contiguous tensors
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + (token * stride_rt)[:, None] + cols, mask=mask, other=0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(sum_ptr + out_at, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = tl.math.rsqrt(tl.sum(xf * xf, axis=1) / SIZE + EPS)
    normed = (xf * inv_rms[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < SIZE).to(tl.float32)
    tl.store(out_ptr + out_at, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotate_heads(
    base_ptr, stride_h, cos, sin, cache_ptr, stride_ch, cached,
    HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, HALF_PAD: tl.constexpr,
    WRITE: tl.constexpr,
):  # fmt: skip
    """Rotate the two halves of `HEADS` heads of one token, `BLOCK_H` heads at a time; with
    `WRITE`, also store the first `cached` rotated heads (all or none) at `cache_ptr`, heads
    `stride_ch` apart."""
    d = tl.arange(0, HALF_PAD)[None, :]
    for h0 in tl.static_range(0, HEADS, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)[:, None]
        mask = (h < HEADS) & (d < HALF)
        at = base_ptr + h * stride_h + d
        x1 = tl.load(at, mask=mask).to(tl.float32)
        x2 = tl.load(at + HALF, mask=mask).to(tl.float32)
        if not WRITE:
            tl.store(at, (x1 * cos - x2 * sin).to(base_ptr.dtype.element_ty), mask=mask)
            tl.store(at + HALF, (x2 * cos + x1 * sin).to(base_ptr.dtype.element_ty), mask=mask)
        else:  # the rotated row as stored, then in the cache's dtype (rotary, then write_kv)
            y1 = (x1 * cos - x2 * sin).to(base_ptr.dtype.element_ty)
            y2 = (x2 * cos + x1 * sin).to(base_ptr.dtype.element_ty)
            tl.store(at, y1, mask=mask)
            tl.store(at + HALF, y2, mask=mask)
            c_at = cache_ptr + h * stride_ch + d
            c_mask = (h < cached) & (d < HALF)
            tl.store(c_at, y1.to(cache_ptr.dtype.element_ty), mask=c_mask)
            tl.store(c_at + HALF, y2.to(cache_ptr.dtype.element_ty), mask=c_mask)


@triton.jit
def _copy_heads(
    src_ptr, stride_h, dst_ptr, stride_dh, cached,
    HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, HALF_PAD: tl.constexpr,
):  # fmt: skip
    """Store the first `cached` of `HEADS` heads of one token at `dst_ptr`, in its dtype, two
    halves at a time."""
    d = tl.arange(0, HALF_PAD)[None, :]
    for h0 in tl.static_range(0, HEADS, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)[:, None]
        mask = (h < cached) & (d < HALF)
        at = src_ptr + h * stride_h + d
        to = dst_ptr + h * stride_dh + d
        tl.store(to, tl.load(at, mask=mask).to(dst_ptr.dtype.element_ty), mask=mask)
        tl.store(to + HALF, tl.load(at + HALF, mask=mask).to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_token_q(
    q_ptr, cos_ptr, sin_ptr, pos_ptr, stride_qt, stride_qh,
    Q_HEADS: tl.constexpr, HALF: tl.constexpr, Q_BLOCK_H: tl.constexpr, HALF_PAD: tl.constexpr,
):  # fmt: skip
    """This program's token: its q heads rotated in place; returns (token, cos, sin), the cos
    and sin rows `[1, HALF_PAD]` (float32) of its position, for its k heads."""
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    d = tl.arange(0, HALF_PAD)
    cos = tl.load(cos_ptr + pos * HALF + d, mask=d < HALF).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + pos * HALF + d, mask=d < HALF).to(tl.float32)[None, :]
    q_row = q_ptr + token * stride_qt
    _rotate_heads(
        q_row, stride_qh, cos, sin, q_row, 0, 0, Q_HEADS, HALF, Q_BLOCK_H, HALF_PAD, False
    )  # fmt: skip
    return token, cos, sin


@triton.jit
def _rotary(
    q_ptr, k_ptr, cos_ptr, sin_ptr, pos_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh,
    Q_HEADS: tl.constexpr, K_HEADS: tl.constexpr, HALF: tl.constexpr,
    Q_BLOCK_H: tl.constexpr, K_BLOCK_H: tl.constexpr, HALF_PAD: tl.constexpr,
):  # fmt: skip
    token, cos, sin = _rotary_token_q(
        q_ptr, cos_ptr, sin_ptr, pos_ptr, stride_qt, stride_qh, Q_HEADS, HALF, Q_BLOCK_H, HALF_PAD
    )  # fmt: skip
    k_row = k_ptr + token * stride_kt
    _rotate_heads(
        k_row, stride_kh, cos, sin, k_row, 0, 0, K_HEADS, HALF, K_BLOCK_H, HALF_PAD, False
    )  # fmt: skip


@triton.jit
def _rotary_write_kv(
    q_ptr, k_ptr, cos_ptr, sin_ptr, pos_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kco, stride_kch, stride_vcb, stride_vco, stride_vch,
    Q_HEADS: tl.constexpr, K_HEADS: tl.constexpr, HALF: tl.constexpr,
    Q_BLOCK_H: tl.constexpr, K_BLOCK_H: tl.constexpr, HALF_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TRIGGER: tl.constexpr,
):  # fmt: skip
    if TRIGGER:  # sm_90+: a programmatically launched attention may start its prologue now
        gdc_launch_dependents()
    token, cos, sin = _rotary_token_q(
        q_ptr, cos_ptr, sin_ptr, pos_ptr, stride_qt, stride_qh, Q_HEADS, HALF, Q_BLOCK_H, HALF_PAD
    )  # fmt: skip
    slot = tl.load(slot_ptr + token).to(tl.int64)
    cached = tl.where(slot >= 0, K_HEADS, 0)  # a slot < 0 is padding: stored nowhere
    block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    k_at = k_cache_ptr + block * stride_kcb + offset * stride_kco
    _rotate_heads(
        k_ptr + token * stride_kt, stride_kh, cos, sin, k_at, stride_kch, cached, K_HEADS, HALF,
        K_BLOCK_H, HALF_PAD, True,
    )  # fmt: skip
    v_at = v_cache_ptr + block * stride_vcb + offset * stride_vco
    _copy_heads(
        v_ptr + token * stride_vt, stride_vh, v_at, stride_vch, cached, K_HEADS, HALF, K_BLOCK_H,
        HALF_PAD,
    )  # fmt: skip


@triton.jit
def _silu_and_mul(x_ptr, out_ptr, stride_xt, SIZE: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < SIZE
    gate = tl.load(x_ptr + token * stride_xt + cols, mask=mask).to(tl.float32)
    up = tl.load(x_ptr + token * stride_xt + SIZE + cols, mask=mask).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + token * SIZE + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _warps(tile: int, most: int) -> int:
    """Warps for a program of `tile` elements: about 8 per thread, between 1 and `most`."""
    return max(1, min(most, tile // 256))


def rms_norm_launch(size: int, heads: int = 1) -> dict[str, int]:
    """Constexpr sizes and `num_warps` of `_rms_norm` for rows of `size` (`heads` rows a token).

    Rows shorter than `MAX_TILE` share a program (Qwen3's per-head norm: 8 or 16 rows).
    """
    block_h = triton.next_power_of_2(size)
    block_r = max(1, MAX_TILE // block_h)
    meta = dict(HEADS=heads, SIZE=size, BLOCK_R=block_r, BLOCK_H=block_h)
    return {**meta, "num_warps": _warps(block_r * block_h, 8)}


def rotary_launch(q_heads: int, k_heads: int, head_dim: int) -> dict[str, int]:
    """Constexpr sizes and `num_warps` of `_rotary` (heads per loop step: a tile of `MAX_TILE`)."""
    half = head_dim // 2
    half_pad = triton.next_power_of_2(half)
    cap = max(1, MAX_TILE // half_pad)
    q_block = min(triton.next_power_of_2(q_heads), cap)
    k_block = min(triton.next_power_of_2(k_heads), cap)
    meta = dict(Q_HEADS=q_heads, K_HEADS=k_heads, HALF=half, HALF_PAD=half_pad)
    meta.update(Q_BLOCK_H=q_block, K_BLOCK_H=k_block)
    return {**meta, "num_warps": _warps(2 * q_block * half_pad, 4)}


def silu_and_mul_launch(size: int) -> dict[str, int]:
    """Constexpr sizes and `num_warps` of `_silu_and_mul` for an intermediate size `size`."""
    block = min(triton.next_power_of_2(size), MAX_TILE)
    return {"SIZE": size, "BLOCK": block, "num_warps": _warps(2 * block, 4)}


def rms_norm(
    x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None
) -> Tensor | tuple[Tensor, Tensor]:
    """RMSNorm (optionally of `x + residual`) into new tensors; see the reference op.

    `x` is `[T, H]` or `[T, heads, H]` with a contiguous last axis and any other strides; the
    outputs are contiguous. One program normalises one row, or several rows shorter than 1024.
    """
    assert x.dim() in (2, 3) and x.stride(-1) == 1, "x must be [T, H] or [T, heads, H] rows"
    assert weight.shape == x.shape[-1:] and weight.is_contiguous()
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    heads = x.shape[1] if x.dim() == 3 else 1
    stride_xn = x.stride(1) if x.dim() == 3 else 0
    meta = rms_norm_launch(x.shape[-1], heads)
    num_rows = x.shape[0] * heads
    grid = (triton.cdiv(num_rows, meta["BLOCK_R"]),)
    if residual is None:
        if num_rows > 0:
            _rms_norm[grid](
                x, weight, out, None, None, num_rows, x.stride(0), stride_xn, 0,
                EPS=eps, HAS_RESIDUAL=False, **meta,
            )  # fmt: skip
        return out
    assert x.dim() == 2 and residual.shape == x.shape and residual.dtype == x.dtype
    assert residual.stride(-1) == 1
    summed = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if num_rows > 0:
        _rms_norm[grid](
            x, weight, out, residual, summed, num_rows, x.stride(0), 0, residual.stride(0),
            EPS=eps, HAS_RESIDUAL=True, **meta,
        )  # fmt: skip
    return out, summed


def rotary(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, positions: Tensor) -> None:
    """Neox rotary embedding in place on q `[T, Hq, D]` and k `[T, Hk, D]`; see the reference op.

    One program per token rotates all its q and k heads; float32 arithmetic rounded once, so
    each output differs from the reference (which rounds every product and sum in the tensors'
    dtype) by at most those intermediate roundings. q and k may be strided views (last axis
    contiguous); cos and sin are contiguous `[max_positions, D // 2]` tables.
    """
    num_tokens, q_heads, head_dim = _check_rotary(q, k, cos, sin)
    if num_tokens == 0:
        return
    meta = rotary_launch(q_heads, k.shape[1], head_dim)
    _rotary[(num_tokens,)](
        q, k, cos, sin, positions, q.stride(0), q.stride(1), k.stride(0), k.stride(1), **meta
    )


def rotary_write_kv(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cos: Tensor,
    sin: Tensor,
    positions: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
    release_dependents: bool | None = None,
) -> None:
    """`rotary` of q and k, and each token's rotated K and its V row stored at its cache slot
    (`slot < 0`: nowhere), in one launch; see the reference op. The caches may be strided views
    (`[num_blocks, block_size, Hkv, D]`, last axis contiguous: head-major storage is a view).

    `release_dependents` (sm_90+ only; default: whether the shipped decode configs use a
    programmatic launch) lets a programmatically launched kernel after this one start at once.
    """
    assert v.shape == k.shape and v.stride(-1) == 1
    assert k_cache.shape[2:] == k.shape[1:] and v_cache.shape == k_cache.shape
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    capability = _device_info(k_cache.device)[0]
    if release_dependents is None:
        release_dependents = configs.uses_pdl(capability)
    release = release_dependents and configs.pdl_capable(capability)
    num_tokens, q_heads, head_dim = _check_rotary(q, k, cos, sin)
    if num_tokens == 0:
        return
    meta = rotary_launch(q_heads, k.shape[1], head_dim)
    _rotary_write_kv[(num_tokens,)](
        q, k, cos, sin, positions, v, k_cache, v_cache, slot_mapping,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), *v.stride()[:2],
        *k_cache.stride()[:3], *v_cache.stride()[:3],
        BLOCK_SIZE=k_cache.shape[1], TRIGGER=release, **meta,
    )  # fmt: skip


def _check_rotary(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[int, int, int]:
    """(tokens, q heads, head_dim) of a rotary call, its operands checked."""
    num_tokens, q_heads, head_dim = q.shape
    assert k.shape[0] == num_tokens and k.shape[2] == head_dim and head_dim % 2 == 0
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and q.dtype == k.dtype
    assert cos.shape[-1] == head_dim // 2 and cos.is_contiguous() and sin.is_contiguous()
    return num_tokens, q_heads, head_dim


def silu_and_mul(x: Tensor) -> Tensor:
    """`silu(x[:, :I]) * x[:, I:]` of `[T, 2I]` rows (last axis contiguous) into a new `[T, I]`.

    float32 arithmetic rounded once (the reference rounds `silu` before the product).
    """
    assert x.dim() == 2 and x.shape[1] % 2 == 0 and x.stride(1) == 1
    size = x.shape[1] // 2
    out = torch.empty((x.shape[0], size), dtype=x.dtype, device=x.device)
    if x.shape[0] == 0:
        return out
    meta = silu_and_mul_launch(size)
    _silu_and_mul[(x.shape[0], triton.cdiv(size, meta["BLOCK"]))](x, out, x.stride(0), **meta)
    return out

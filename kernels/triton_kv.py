"""Triton KV write: each new token's K and V rows into its cache slot (`slot < 0` is skipped).

Where decode attention is launched programmatically (`AttentionConfig.pdl`, sm_90+), it lets that
kernel start at once; attention waits for this one before it reads the cache.

Same contract as `kernels.reference.write_kv`; the caches may be strided views (for example two
halves of one `[num_blocks, 2, block_size, Hkv, D]` tensor).
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import gdc_launch_dependents

from . import configs
from .triton_attention import _device_info


@triton.jit
def _write_kv(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kco, stride_kch, stride_kcd,
    stride_vcb, stride_vco, stride_vch, stride_vcd,
    BLOCK_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    H_PAD: tl.constexpr, D_PAD: tl.constexpr, TRIGGER: tl.constexpr,
):  # fmt: skip
    if TRIGGER:  # sm_90+: a programmatically launched attention may start its prologue now
        gdc_launch_dependents()
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    h = tl.arange(0, H_PAD)[:, None]
    d = tl.arange(0, D_PAD)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    k = tl.load(key_ptr + token * stride_kt + h * stride_kh + d * stride_kd, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + h * stride_vh + d * stride_vd, mask=mask)
    k_at = block * stride_kcb + offset * stride_kco + h * stride_kch + d * stride_kcd
    v_at = block * stride_vcb + offset * stride_vco + h * stride_vch + d * stride_vcd
    tl.store(k_cache_ptr + k_at, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + v_at, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    key: Tensor,
    value: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
    release_dependents: bool | None = None,
) -> None:
    """Store each new token's K/V row at its slot (see the reference op); one program a token.

    `release_dependents` (sm_90+ only; default: whether the shipped decode configs use a
    programmatic launch) lets a programmatically launched kernel after this one start at once.
    """
    capability = _device_info(k_cache.device)[0]
    if release_dependents is None:
        release_dependents = configs.uses_pdl(capability)
    release = release_dependents and configs.pdl_capable(capability)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _write_kv[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        *key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride(),
        BLOCK_SIZE=k_cache.shape[1], NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        H_PAD=triton.next_power_of_2(num_kv_heads), D_PAD=triton.next_power_of_2(head_dim),
        TRIGGER=release, num_warps=1,
    )  # fmt: skip

"""The reference ops against a naive per-sequence attention on contiguous K/V."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from pagedctl.kernels import PagedBatch, paged_attention, write_kv

GARBAGE_BLOCK = 10**9  # table padding: indexing the cache with it would raise


def test_write_kv_places_rows_at_exact_slots_and_skips_padding() -> None:
    k_cache, v_cache = torch.zeros(6, 4, 2, 8), torch.zeros(6, 4, 2, 8)
    key, value = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    slots = torch.tensor([0, 7, -1, 23, 9])
    write_kv(key, value, k_cache, v_cache, slots)
    expected_k, expected_v = torch.zeros(24, 2, 8), torch.zeros(24, 2, 8)
    for row, slot in [(0, 0), (1, 7), (3, 23), (4, 9)]:
        expected_k[slot], expected_v[slot] = key[row], value[row]
    assert torch.equal(k_cache.view(24, 2, 8), expected_k)
    assert torch.equal(v_cache.view(24, 2, 8), expected_v)


def test_write_kv_into_views_of_one_kv_tensor() -> None:
    kv = torch.zeros(40000, 2, 16, 1, 4, dtype=torch.float16)
    k_cache, v_cache = kv.unbind(1)
    key, value = torch.randn(3, 1, 4).half(), torch.randn(3, 1, 4).half()
    slots = torch.tensor([39999 * 16 + 15, 5, 32768 * 16 + 3])
    write_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(kv[39999, 0, 15], key[0]) and torch.equal(kv[39999, 1, 15], value[0])
    assert torch.equal(kv[0, 0, 5], key[1]) and torch.equal(kv[32768, 1, 3], value[2])
    assert int((kv != 0).any(-1).sum()) == 6


def naive_attention(q: Tensor, ks: list[Tensor], vs: list[Tensor], q_lens: list[int]) -> Tensor:
    """Per-sequence float64 attention with an explicit causal mask on contiguous K/V."""
    outs, start = [], 0
    for k, v, q_len in zip(ks, vs, q_lens, strict=True):
        qi = q[start : start + q_len].double()
        start += q_len
        group = qi.shape[1] // k.shape[1]
        kk, vv = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", qi, kk) * qi.shape[-1] ** -0.5
        q_pos = torch.arange(k.shape[0] - q_len, k.shape[0])
        causal = torch.arange(k.shape[0])[None, :] <= q_pos[:, None]
        scores = scores.masked_fill(~causal, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv))
    return torch.cat(outs)


def run_case(
    specs: list[tuple[int, int]],
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int = 16,
    dtype: torch.dtype = torch.float32,
    num_blocks: int = 0,
    seed: int = 0,
) -> tuple[Tensor, Tensor]:
    """Build a paged batch of `(q_len, context_len)` sequences; return (paged, naive) outputs.

    Blocks are handed out from a shuffled pool (the last ones when the pool is large), unused
    cache rows hold NaN and table padding holds an out-of-range id.
    """
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [q + c for q, c in specs]
    needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = max(num_blocks, sum(needed) + 3)
    pool = (num_blocks - 1 - torch.randperm(sum(needed) + 3, generator=gen)).tolist()
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    table = torch.full((len(specs), max(needed) + 2), GARBAGE_BLOCK, dtype=torch.int32)
    ks, vs = [], []
    for i, n in enumerate(seq_lens):
        blocks = [pool.pop() for _ in range(needed[i])]
        table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        k = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        pos = torch.arange(n)
        ids = torch.tensor(blocks)[pos // block_size]
        k_cache[ids, pos % block_size], v_cache[ids, pos % block_size] = k, v
        ks.append(k)
        vs.append(v)
    q_lens = [q for q, _ in specs]
    q = (3 * torch.randn(sum(q_lens), num_heads, head_dim, generator=gen)).to(dtype)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    batch = PagedBatch(table, lens, cu, max(q_lens), max(seq_lens))
    out = paged_attention(q, k_cache, v_cache, batch, head_dim**-0.5)
    assert out.dtype == dtype and out.shape == q.shape
    return out, naive_attention(q, ks, vs, q_lens)


MIXED = [(37, 0), (5, 20), (1, 40), (1, 1), (12, 3), (1, 17), (3, 0)]


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("group", [1, 3, 7])
def test_mixed_batch_fp32_matches_naive(block_size: int, group: int) -> None:
    out, ref = run_case(MIXED, block_size, num_heads=2 * group, num_kv_heads=2)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "specs",
    [
        [(1, n) for n in (0, 1, 15, 16, 17, 63, 200, 5)],  # decode only, skewed lengths
        [(50, 0)],  # one prompt, no history
        [(9, 31), (16, 16)],  # chunked prefill only
        [(300, 0), (1, 5), (600, 20)],  # prompts longer than one query chunk
    ],
)
def test_decode_only_prefill_only_and_chunked_batches(specs: list[tuple[int, int]]) -> None:
    out, ref = run_case(specs, block_size=16, num_heads=9, num_kv_heads=3, seed=1)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float16, 2e-3), (torch.bfloat16, 1.6e-2)])
@pytest.mark.parametrize("group", [1, 7])
def test_half_precision_matches_naive(dtype: torch.dtype, tol: float, group: int) -> None:
    out, ref = run_case(MIXED, 16, num_heads=2 * group, num_kv_heads=2, dtype=dtype, seed=2)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


def test_large_pool_block_ids_near_the_end() -> None:
    specs = [(1, 70), (6, 30), (1, 3)]
    out, ref = run_case(specs, 16, num_heads=3, num_kv_heads=1, head_dim=4, num_blocks=40000)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)

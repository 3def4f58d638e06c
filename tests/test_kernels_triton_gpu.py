"""Triton kernels on a CUDA device against the PyTorch reference op: real sizes, bf16, contexts
to 32K, a pool of more than 2^31 elements, and CUDA-graph capture and replay with changing
lengths. Marked `gpu`; skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from pagedctl import kernels
from pagedctl.kernels import PagedBatch, reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

GARBAGE_BLOCK = 2**31 - 1
TOL = {torch.float16: (5e-3, 5e-3), torch.bfloat16: (1.5e-2, 1e-2)}


def dtypes() -> list[torch.dtype]:
    """fp16 everywhere; bf16 only where the GPU has it in hardware (compute capability >= 8)."""
    ok = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8
    return [torch.float16, torch.bfloat16] if ok else [torch.float16]


def build(
    specs: list[tuple[int, int]],
    block_size: int,
    heads: tuple[int, int],
    dtype: torch.dtype,
    head_dim: int = 64,
    num_blocks: int = 0,
    seed: int = 0,
) -> tuple[Tensor, ...]:
    """A paged batch of `(q_len, context_len)` on the GPU: blocks from the end of a shuffled
    pool, NaN in every unused slot, an out-of-range id as table padding.

    Returns (q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q).
    """
    torch.manual_seed(seed)
    dev = torch.device("cuda")
    num_heads, num_kv_heads = heads
    seq_lens = [q + c for q, c in specs]
    needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = max(num_blocks, sum(needed) + 8)
    ids = num_blocks - 1 - torch.randperm(sum(needed) + 8, device=dev)[: sum(needed)]
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=dev)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=dev)
    table = torch.full((len(specs), max(needed) + 2), GARBAGE_BLOCK, dtype=torch.int32, device=dev)
    for i, (blocks, n) in enumerate(zip(ids.split(needed), seq_lens, strict=True)):
        table[i, : len(blocks)] = blocks.int()
        pos = torch.arange(n, device=dev)
        slots = blocks[pos // block_size] * block_size + pos % block_size
        k_cache.view(-1, num_kv_heads, head_dim)[slots] = torch.randn(
            n, num_kv_heads, head_dim, device=dev
        ).to(dtype)
        v_cache.view(-1, num_kv_heads, head_dim)[slots] = torch.randn(
            n, num_kv_heads, head_dim, device=dev
        ).to(dtype)
    q_lens = torch.tensor([q for q, _ in specs], device=dev)
    q = (2 * torch.randn(int(q_lens.sum()), num_heads, head_dim, device=dev)).to(dtype)
    cu = torch.zeros(len(specs) + 1, dtype=torch.int32, device=dev)
    cu[1:] = q_lens.cumsum(0)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
    return q, k_cache, v_cache, table, lens, cu


def compare(batch: tuple[Tensor, ...], num_splits: int | None = None, **options) -> Tensor:
    """Triton output == reference output within the dtype's tolerance; no NaN anywhere.
    `options`: the ops' `window` and `softcap`. Returns the Triton output."""
    from pagedctl.kernels.triton_attention import paged_attention

    q, k_cache, v_cache, table, lens, cu = batch
    paged = PagedBatch(table, lens, cu, int((cu[1:] - cu[:-1]).max()), int(lens.max()))
    args = (q, k_cache, v_cache, paged, q.shape[-1] ** -0.5)
    out = paged_attention(*args, num_splits=num_splits, **options)
    ref = reference.paged_attention(*args, **options)
    assert torch.isfinite(out).all()
    atol, rtol = TOL[q.dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)
    return out


MIXED = [(512, 0), (300, 1000), (1, 8191), (1, 4096), (7, 33), (1, 1), (64, 2047)]


@pytest.mark.parametrize("dtype", dtypes())
@pytest.mark.parametrize("heads", [(14, 2), (9, 3), (4, 4)])
@pytest.mark.parametrize("block_size", [16, 32, 64])
def test_mixed_batch_matches_reference(
    block_size: int, heads: tuple[int, int], dtype: torch.dtype
) -> None:
    compare(build(MIXED, block_size, heads, dtype, seed=block_size))


@pytest.mark.parametrize("dtype", dtypes())
@pytest.mark.parametrize("splits", [None, 1, 7, 32])
@pytest.mark.parametrize("batch", [1, 8, 64])
def test_decode_to_32k_contexts(batch: int, splits: int | None, dtype: torch.dtype) -> None:
    lengths = torch.randint(1, 32768, (batch,), generator=torch.Generator().manual_seed(batch))
    specs = [(1, 32767)] + [(1, int(n)) for n in lengths[1:]]
    compare(build(specs, 16, (14, 2), dtype, seed=batch), num_splits=splits)


@pytest.mark.parametrize("dtype", dtypes())
@pytest.mark.parametrize("splits", [4, 16])
def test_prefill_splits_match_reference(splits: int, dtype: torch.dtype) -> None:
    """Split-KV on the prefill path (the few-sequence step graphs): prefix hits of a few tokens
    after long histories, a chunk after 8K, a decode row at 30K."""
    specs = [(16, 4096), (5, 12000), (300, 8000), (1, 30000)]
    compare(build(specs, 16, (14, 2), dtype, seed=splits), num_splits=splits)


@pytest.mark.parametrize("splits", [2, 7, 32])
@pytest.mark.parametrize("batch", [1, 64, 256])
def test_fused_combine_matches_the_combine_kernel(batch: int, splits: int) -> None:
    """The last-split merge (atomic arrival counters, concurrent programs) gives the combine
    kernel's output, call after call and from a CUDA graph replayed with changing lengths."""
    from dataclasses import replace

    from pagedctl.kernels.configs import lookup
    from pagedctl.kernels.triton_attention import paged_attention
    from pagedctl.kernels.triton_splits import _COUNTERS

    lengths = torch.randint(1, 8192, (batch,), generator=torch.Generator().manual_seed(batch))
    q, k, v, table, lens, cu = build([(1, int(n)) for n in lengths], 16, (14, 2), dtypes()[-1])
    cfg = replace(lookup(torch.cuda.get_device_capability(), "decode", 64), fused_combine=True)
    unfused = replace(cfg, fused_combine=False)
    args = (q, k, v, PagedBatch(table, lens, cu, 1, 8192), 0.125)
    want = paged_attention(*args, num_splits=splits, config=unfused)
    for _ in range(3):
        got = paged_attention(*args, num_splits=splits, config=cfg)
        torch.testing.assert_close(got, want, atol=2e-2, rtol=1e-2)
    assert int(_COUNTERS[q.device].count_nonzero()) == 0
    static_lens = lens.clone()
    static = (q, k, v, PagedBatch(table, static_lens, cu, 1, 8192), 0.125)
    graph = torch.cuda.CUDAGraph()
    paged_attention(*static, num_splits=splits, config=cfg)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        out = paged_attention(*static, num_splits=splits, config=cfg)
    for shrink in (0, 5, 300):
        static_lens.copy_((lens - shrink).clamp_min(1))
        graph.replay()
        now = PagedBatch(table, static_lens.clone(), cu, 1, 8192)
        ref = paged_attention(q, k, v, now, 0.125, num_splits=splits, config=unfused)
        torch.testing.assert_close(out, ref, atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("head_dim", [128])
def test_head_dim_128_decode_and_prefill(head_dim: int) -> None:
    compare(build(MIXED, 32, (16, 8), torch.float16, head_dim=head_dim))
    compare(build([(1, 5000), (1, 17)], 32, (16, 8), torch.float16, head_dim=head_dim))


# Mistral-7B's and Gemma-2-2B's heads: (32, 8) x 128 with a 4,096 window; (8, 4) x 256 with a
# 4,096 window and logits capped at 50.
WINDOWED = [((32, 8), 128, 4096, None), ((8, 4), 256, 4096, 50.0)]


@pytest.mark.parametrize("dtype", dtypes())
@pytest.mark.parametrize(("heads", "head_dim", "window", "softcap"), WINDOWED)
def test_sliding_window_and_softcap_match_reference(
    heads: tuple[int, int], head_dim: int, window: int, softcap: float | None, dtype: torch.dtype
) -> None:
    """Real shapes and windows: decode rows below, at and far past the window (to 32K, split
    and not), prefill chunks straddling its edge, a mixed batch; and the same with every block
    the window has passed freed (NaN, its table entry stale, 0 or out of range): the same bits."""
    from tests.test_kernels_reference import free_outside_window

    options = {"window": window, "softcap": softcap}
    decode = [(1, 100), (1, window - 1), (1, window), (1, window + 17), (1, 20000), (1, 32767)]
    prefill = [(512, window - 200), (300, 3 * window), (64, 0), (1, 9000)]
    for specs, block in ((decode, 16), (prefill, 32), (MIXED, 16)):
        for splits in (None, 1, 7) if specs is decode else (None, 4):
            compare(build(specs, block, heads, dtype, head_dim), splits, **options)
    from pagedctl.kernels.triton_attention import paged_attention

    for specs, block in ((decode, 16), (prefill, 32)):
        want = compare(build(specs, block, heads, dtype, head_dim, seed=3), **options)
        q, k, v, table, lens, cu = build(specs, block, heads, dtype, head_dim, seed=3)
        q_lens = (cu[1:] - cu[:-1]).tolist()
        assert free_outside_window(k, v, table, lens.tolist(), q_lens, window, GARBAGE_BLOCK)
        paged = PagedBatch(table, lens, cu, max(q_lens), int(lens.max()))
        got = paged_attention(q, k, v, paged, head_dim**-0.5, **options)
        assert torch.equal(got, want)


def test_pool_of_more_than_2_pow_31_elements() -> None:
    num_blocks = 2**31 // (16 * 2 * 64) + 64  # > 2^31 elements per cache
    batch = build([(1, 3000), (9, 100), (1, 40)], 16, (14, 2), torch.float16, num_blocks=num_blocks)
    assert batch[1].numel() > 2**31 and int(batch[3][0, 0]) > num_blocks - 300
    compare(batch)
    del batch
    decode = build([(1, 3000), (1, 40)], 16, (14, 2), torch.float16, num_blocks=num_blocks)
    compare(decode, num_splits=4)


@pytest.mark.parametrize("fused", [False, True])
def test_write_kv_matches_reference(fused: bool) -> None:
    dev = torch.device("cuda")
    kv = torch.zeros(1000, 2, 16, 2, 64, dtype=torch.float16, device=dev)
    caches = kv.unbind(1) if fused else (kv[:, 0].contiguous(), kv[:, 1].contiguous())
    expected = [c.clone() for c in caches]
    key, value = torch.randn(2, 300, 2, 64, device=dev)
    slots = torch.randperm(16000, device=dev)[:300]
    slots[::7] = -1
    kernels.write_kv(key, value, *caches, slots)
    reference.write_kv(key, value, *expected, slots)
    for got, want in zip(caches, expected, strict=True):
        assert torch.equal(got, want)


def test_cuda_graph_capture_and_replay_with_changing_lengths() -> None:
    dev, dtype, batch, block_size, max_ctx = torch.device("cuda"), dtypes()[-1], 8, 16, 4096
    num_heads, num_kv_heads, head_dim = 14, 2, 64
    per_seq = max_ctx // block_size
    table = torch.randperm(batch * per_seq + 8, device=dev)[: batch * per_seq]
    table = table.view(batch, per_seq).int()
    k_cache = torch.randn(batch * per_seq + 8, block_size, num_kv_heads, head_dim, device=dev)
    k_cache, v_cache = k_cache.to(dtype), torch.randn_like(k_cache).to(dtype)
    q = torch.zeros(batch, num_heads, head_dim, dtype=dtype, device=dev)
    new_k, new_v = torch.zeros(2, batch, num_kv_heads, head_dim, dtype=dtype, device=dev)
    slots = torch.zeros(batch, dtype=torch.int64, device=dev)
    lens = torch.ones(batch, dtype=torch.int32, device=dev)
    cu = torch.arange(batch + 1, dtype=torch.int32, device=dev)
    paged = PagedBatch(table, lens, cu, 1, max_ctx)

    def step() -> Tensor:
        kernels.write_kv(new_k, new_v, k_cache, v_cache, slots)
        return kernels.paged_attention(q, k_cache, v_cache, paged, 0.125)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for trial in range(4):
        lens.copy_(torch.randint(1, max_ctx + 1, (batch,), device=dev, dtype=torch.int32))
        lens[trial % batch] = max_ctx if trial else 1
        last = lens.long() - 1
        slots.copy_(table.long().gather(1, (last // block_size)[:, None])[:, 0] * block_size)
        slots.add_(last % block_size)
        q.copy_(torch.randn_like(q, dtype=torch.float32))
        new_k.copy_(torch.randn_like(new_k, dtype=torch.float32))
        new_v.copy_(torch.randn_like(new_v, dtype=torch.float32))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(k_cache.view(-1, num_kv_heads, head_dim)[slots], new_k)
        ref = reference.paged_attention(q, k_cache, v_cache, paged, 0.125)
        atol, rtol = TOL[dtype]
        torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", dtypes() + [torch.float32])
def test_fused_sampler_matches_reference_at_vocabulary_scale(dtype: torch.dtype) -> None:
    """The fused temperature sampler on a 256 x 151,936 batch picks the reference's tokens
    (a mismatch needs a uniform within rounding of a CDF step: at most one row in 256)."""
    from pagedctl.kernels.triton_sample import sample_temperature

    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(256, 151936, device="cuda", generator=gen) * 4).to(dtype)
    logits[7, :150000] = float("-inf")
    u = torch.rand(256, device="cuda", generator=gen)
    for t in (0.6, 1.0):
        got = sample_temperature(logits, t, u)
        want = reference.sample_temperature(logits, t, u)
        assert int((got != want).sum()) <= 1
        assert torch.isfinite(logits[torch.arange(256), got]).all()
        assert int(got[7]) >= 150000


def test_fused_sampler_frequencies_on_cuda() -> None:
    """Over an even grid of uniforms the sampled frequencies equal softmax(logits / t)."""
    from pagedctl.kernels.triton_sample import sample_temperature

    logits = torch.full((1, 151936), -20.0, device="cuda")
    logits[0, [5, 70000, 151935]] = torch.tensor([1.0, 2.0, 0.5], device="cuda")
    n, t = 20000, 0.7
    u = ((torch.arange(n, device="cuda", dtype=torch.float64) + 0.5) / n).float()
    got = sample_temperature(logits.expand(n, -1), t, u)
    freq = torch.bincount(got, minlength=151936).double() / n
    probs = torch.softmax(logits[0].double() / t, dim=-1)
    assert float((freq - probs).abs().max()) < 2 / n + 1e-6


@pytest.mark.parametrize("splits", [1, 3])
def test_programmatic_dependent_launch_waits_for_write_kv(splits: int) -> None:
    """Decode attention launched as a programmatic dependent launch (`AttentionConfig.pdl`, on
    sm_90+) right behind the `write_kv` that stores its newest token and releases it at once,
    layer after layer in one CUDA graph: every layer's output includes that token (attention
    waited for the write before it read the cache)."""
    from dataclasses import replace

    from pagedctl.kernels.configs import lookup
    from pagedctl.kernels.triton_attention import paged_attention
    from pagedctl.kernels.triton_kv import write_kv

    dev, dtype, batch, block_size, ctx, layers = torch.device("cuda"), dtypes()[-1], 64, 16, 2048, 6
    num_heads, num_kv_heads, head_dim = 14, 2, 64
    cfg = replace(lookup(torch.cuda.get_device_capability(), "decode", head_dim), pdl=True)
    per_seq = ctx // block_size
    table = torch.randperm(batch * per_seq, device=dev).view(batch, per_seq).int()
    caches = [
        tuple(torch.randn(batch * per_seq, block_size, num_kv_heads, head_dim, device=dev).to(dtype)
              for _ in range(2))
        for _ in range(layers)
    ]  # fmt: skip
    q = torch.randn(batch, num_heads, head_dim, device=dev).to(dtype)
    new = torch.zeros(layers, 2, batch, num_kv_heads, head_dim, dtype=dtype, device=dev)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    cu = torch.arange(batch + 1, dtype=torch.int32, device=dev)
    last = lens.long() - 1
    slots = table.long().gather(1, (last // block_size)[:, None])[:, 0] * block_size
    slots += last % block_size
    paged = PagedBatch(table, lens, cu, 1, ctx)

    def stack() -> list[Tensor]:
        outs = []
        for (k, v), (nk, nv) in zip(caches, new, strict=True):
            write_kv(nk, nv, k, v, slots, release_dependents=True)  # attention may start now
            outs.append(paged_attention(q, k, v, paged, 0.125, num_splits=splits, config=cfg))
        return outs

    stack()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = stack()
    for _ in range(3):
        new.copy_(10 * torch.randn_like(new, dtype=torch.float32))  # large: a stale read shows
        graph.replay()
        torch.cuda.synchronize()
        for (k, v), (nk, _), out in zip(caches, new, outs, strict=True):
            assert torch.equal(k.view(-1, num_kv_heads, head_dim)[slots], nk)
            ref = reference.paged_attention(q, k, v, paged, 0.125)
            atol, rtol = TOL[dtype]
            torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)

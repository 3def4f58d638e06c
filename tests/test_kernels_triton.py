"""Triton attention and KV-write kernels: CPU interpreter runs against a naive float64 attention,
cross-compilation of every shipped config for sm_75/sm_80/sm_90, and backend dispatch.

`TRITON_INTERPRET=1` must be set before the kernels are first JIT-ed, so the interpreter cases
(`test_interp_*`) run in one child pytest process started by `test_interpreter_suite`; they are
skipped in a process without the variable.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
from torch import Tensor

from tests import interp_suite
from tests.test_kernels_reference import free_outside_window, naive_attention

triton = pytest.importorskip("triton")

from pagedctl.kernels import PagedBatch, configs, reference, triton_kv, triton_sample  # noqa: E402
from pagedctl.kernels import triton_attention as ta  # noqa: E402
from pagedctl.kernels import triton_splits as splits_mod  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interp = pytest.mark.skipif(not INTERPRETED, reason="runs in the interpreter child process")
compiled = pytest.mark.skipif(INTERPRETED, reason="cross-compilation runs in the parent process")
GARBAGE_BLOCK = 2**31 - 1  # table padding past each sequence: reading it would fault or raise
HEADS = [(14, 2), (9, 3), (4, 4)]
TOL = {torch.float32: 2e-5, torch.float16: 4e-3}


def run_interpreter_suite(test_file: str) -> None:
    """A test file's `test_interp_*` cases, run in a child pytest under `TRITON_INTERPRET=1`
    (started at collection, see tests/interp_suite.py); every one must run and pass."""
    code, output = interp_suite.result(test_file)
    assert code == 0, output[-9000:]
    assert " passed" in output and "skipped" not in output.strip().splitlines()[-1]


@compiled
def test_interpreter_suite() -> None:
    run_interpreter_suite(__file__)


@dataclass
class Batch:
    """A paged varlen batch plus each sequence's contiguous K/V for the naive attention."""

    q: Tensor
    k_cache: Tensor
    v_cache: Tensor
    table: Tensor
    seq_lens: Tensor
    cu_q: Tensor
    q_lens: list[int]
    ks: list[Tensor]
    vs: list[Tensor]

    @property
    def paged(self) -> PagedBatch:
        """The kernels' description of this batch."""
        max_k = int(self.seq_lens.max())
        return PagedBatch(self.table, self.seq_lens, self.cu_q, max(self.q_lens), max_k)

    def run(self, **kwargs: object) -> Tensor:
        """The Triton kernel's output for this batch."""
        scale = self.q.shape[-1] ** -0.5
        return ta.paged_attention(self.q, self.k_cache, self.v_cache, self.paged, scale, **kwargs)

    def check(self, **kwargs: object) -> Tensor:
        """Assert the kernel matches the naive attention (`window` and `softcap` included) and
        never lets NaN through; return its output."""
        out = self.run(**kwargs)
        assert out.dtype == self.q.dtype and out.shape == self.q.shape
        assert torch.isfinite(out).all()
        options = {k: kwargs[k] for k in ("window", "softcap") if k in kwargs}
        ref = naive_attention(self.q, self.ks, self.vs, self.q_lens, **options)  # type: ignore[arg-type]
        tol = TOL[self.q.dtype]
        torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
        return out

    def free_outside(self, window: int) -> int:
        """Free (in place) the blocks the window has passed: `free_outside_window`."""
        lens = self.seq_lens.tolist()
        return free_outside_window(
            self.k_cache, self.v_cache, self.table, lens, self.q_lens, window, GARBAGE_BLOCK
        )


def make_batch(
    specs: list[tuple[int, int]],
    block_size: int,
    heads: tuple[int, int],
    head_dim: int = 64,
    dtype: torch.dtype = torch.float32,
    shared_blocks: int = 0,
    fused_kv: bool = False,
    seed: int = 0,
    head_major: bool = False,
) -> Batch:
    """`(q_len, context_len)` sequences on shuffled blocks; unused slots hold NaN.

    The first `shared_blocks` blocks of every sequence are the same physical blocks (a shared
    prefix); `fused_kv` makes K and V strided halves of one `[N, 2, B, Hkv, D]` tensor.
    """
    num_heads, num_kv_heads = heads
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [q + c for q, c in specs]
    needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(needed) + 4
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    shape = (num_blocks, 2, block_size, num_kv_heads, head_dim)
    if head_major:
        stored = torch.full((num_blocks, 2, num_kv_heads, block_size, head_dim), float("nan"))
        k_cache, v_cache = stored.to(dtype).transpose(2, 3).unbind(1)
    else:
        k_cache, v_cache = torch.full(shape, float("nan"), dtype=dtype).unbind(1)
    if not fused_kv and not head_major:
        k_cache, v_cache = k_cache.contiguous(), v_cache.contiguous()
    prefix = [pool.pop() for _ in range(shared_blocks)]
    shared = torch.randn(2, shared_blocks * block_size, num_kv_heads, head_dim, generator=gen)
    table = torch.full((len(specs), max(needed) + 2), GARBAGE_BLOCK, dtype=torch.int32)
    ks, vs = [], []
    for i, n in enumerate(seq_lens):
        blocks = prefix + [pool.pop() for _ in range(needed[i] - shared_blocks)]
        table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        own = torch.randn(2, n - shared.shape[1], num_kv_heads, head_dim, generator=gen)
        k, v = torch.cat([shared, own], dim=1).to(dtype)
        pos = torch.arange(n)
        ids = torch.tensor(blocks)[pos // block_size]
        k_cache[ids, pos % block_size], v_cache[ids, pos % block_size] = k, v
        ks.append(k)
        vs.append(v)
    q_lens = [q for q, _ in specs]
    q = (3 * torch.randn(sum(q_lens), num_heads + 1, head_dim, generator=gen)).to(dtype)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    # q is a non-contiguous view (one extra head sliced off).
    return Batch(q[:, 1:], k_cache, v_cache, table, lens, cu, q_lens, ks, vs)


def mixed(bs: int) -> list[tuple[int, int]]:
    """Prefill without history, chunked prefill and decodes around block boundaries."""
    return [(37, 0), (5, bs - 5), (1, bs - 1), (1, 0), (12, 2 * bs + 3 - 12), (1, bs), (3, 1)]


def decodes(bs: int) -> list[tuple[int, int]]:
    """Decode rows whose lengths sit around block boundaries, plus one long context."""
    return [(1, n) for n in (0, bs - 2, bs - 1, bs, 2 * bs + 2, 300)]


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("block_size", [16, 32, 64])
def test_interp_mixed_batch(block_size: int, heads: tuple[int, int], dtype: torch.dtype) -> None:
    make_batch(mixed(block_size), block_size, heads, dtype=dtype, seed=block_size).check()


@interp
@pytest.mark.parametrize("splits", [1, 2, 5, 12])  # 12 > tiles of every sequence
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("block_size", [16, 64])
def test_interp_decode_splits(block_size: int, heads: tuple[int, int], splits: int) -> None:
    make_batch(decodes(block_size), block_size, heads, seed=splits).check(num_splits=splits)


@interp
@pytest.mark.parametrize("splits", [None, 2, 3])
@pytest.mark.parametrize("tile_n", [32, 64])
def test_interp_prefill_whole_tiles_then_the_diagonal(tile_n: int, splits: int | None) -> None:
    """Prefill query blocks read the tiles below their first query unmasked, then the diagonal
    masked: histories ending just before, at and after a tile boundary, query blocks starting on
    either side of one, splits whose first diagonal tile is any of theirs."""
    cfg = configs.AttentionConfig(block_m=32, tile_n=tile_n, num_warps=4, num_stages=1)
    t = tile_n
    specs = [(40, t - 1), (40, t), (33, t + 1), (70, 2 * t - 5), (9, 3 * t), (5, 0), (1, 4 * t)]
    specs += [(12, t - 2), (10, 2 * t - 3), (6, t - 6), (3, t - 1)]  # first query just below
    make_batch(specs, 16, (14, 2), seed=tile_n).check(config=cfg, num_splits=splits)
    make_batch(specs, 32, (4, 4), dtype=torch.float16, seed=3).check(config=cfg, num_splits=splits)


@interp
@pytest.mark.parametrize("splits", [2, 5, 16])  # 16 > tiles of every sequence
@pytest.mark.parametrize("heads", [(14, 2), (9, 3)])
@pytest.mark.parametrize("block_size", [16, 64])
def test_interp_prefill_splits(
    monkeypatch: pytest.MonkeyPatch, block_size: int, heads: tuple[int, int], splits: int
) -> None:
    """Forced splits of every query-block program of a prefill batch (chunked prefill, prefix
    hits, decode rows among them): each split sees a causal slice of the history; the merge
    gives the unsplit result, with the combine kernel or merged in the last split."""
    grids, combine = [], ta._combine_splits

    class Counted:
        def __getitem__(self, grid: tuple[int, int]) -> object:
            grids.append(grid)
            return combine[grid]

    monkeypatch.setattr(ta, "_combine_splits", Counted())
    specs = [(7, 300), (40, 0), (1, 90), (3, 2 * block_size), (25, 61)]
    make_batch(specs, block_size, heads, seed=splits).check(num_splits=splits)
    assert grids, "the prefill batch was not split"
    make_batch(mixed(block_size), block_size, heads, seed=splits).check(num_splits=splits)
    cfg = configs.lookup(None, "prefill", 64)
    fused = configs.AttentionConfig(64, 32, 4, 1, fused_combine=True)
    assert not cfg.fused_combine
    make_batch(specs, block_size, heads, seed=splits + 1).check(num_splits=splits, config=fused)


@interp
@pytest.mark.parametrize("splits", [1, 3])
def test_interp_decode_graph_padding_rows_read_nothing(splits: int) -> None:
    """A decode graph pads its batch with rows of length 0 (int64 lengths, as the runner packs
    them): their table entries (garbage) are never dereferenced, and they come out as zeros; real
    rows are unchanged. The reference op follows the same contract."""
    b = make_batch(decodes(16), 16, (9, 3), seed=7)
    pad = 3
    n = len(b.q_lens)
    q = torch.cat([b.q, torch.randn(pad, *b.q.shape[1:])])
    table = torch.cat(
        [b.table, torch.full((pad, b.table.shape[1]), GARBAGE_BLOCK, dtype=torch.int32)]
    )
    lens = torch.cat([b.seq_lens, torch.zeros(pad, dtype=torch.int32)]).to(torch.int64)
    cu = torch.arange(n + pad + 1, dtype=torch.int64)
    args = (q, b.k_cache, b.v_cache, PagedBatch(table, lens, cu, 1, 300), q.shape[-1] ** -0.5)
    out = ta.paged_attention(*args, num_splits=splits)
    assert torch.equal(out[n:], torch.zeros_like(out[n:]))
    want = naive_attention(b.q, b.ks, b.vs, b.q_lens)
    torch.testing.assert_close(out[:n].double(), want, atol=2e-5, rtol=2e-5)
    ref = reference.paged_attention(*args)
    assert torch.equal(ref[n:], torch.zeros_like(ref[n:]))


@interp
@pytest.mark.parametrize("fused", [False, True])
def test_interp_fp16_split_partials_do_not_overflow(fused: bool) -> None:
    """Split partials are stored in the output's dtype, so they must be normalised: with values
    near 1,000 and uniform weights, a split's unnormalised sum over ~100 keys (~100,000) would
    overflow fp16 (65,504), while its normalised output stays near 1,000."""
    batch = make_batch(decodes(16), 16, (14, 2), dtype=torch.float16, seed=8)
    batch.q.zero_()  # every key weighs the same
    batch.v_cache.mul_(10).add_(1000)  # NaN in unused slots stays NaN
    batch.vs = [v * 10 + 1000 for v in batch.vs]
    cfg = replace(configs.INTERPRETER_CONFIGS["decode"], fused_combine=fused)
    batch.check(num_splits=3, config=cfg)


@interp
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("splits", [None, 1, 3])
def test_interp_sequences_without_queries_write_nothing(splits: int | None, fused: bool) -> None:
    """Sequences with no query token among one-token queries: the one-query-block path takes no
    early exit on the query length (it would hold back the first loads), so such a program runs
    with no keys instead. It must write no row: its first output row is its neighbour's."""
    specs = [(1, 40), (0, 70), (1, 15), (0, 1), (1, 33), (0, 5)]
    cfg = configs.AttentionConfig(16, 32, 4, 1, min_rows=1, fused_combine=fused)
    make_batch(specs, 16, (9, 3), seed=21).check(num_splits=splits, config=cfg)


@interp
@pytest.mark.parametrize("block_size", [16, 32, 64])
def test_interp_decode_fp16_auto_splits(block_size: int) -> None:
    rows = [(1, block_size - 1), (1, 300)]
    batch = make_batch(rows, block_size, (14, 2), dtype=torch.float16)
    assert ta.choose_num_splits(2, 2, 300, 8, 64) == 2  # the interpreter's SM count and tile
    batch.check()


@interp
@pytest.mark.parametrize(
    ("block_size", "tile_n", "block_m"), [(64, 16, 16), (16, 64, 16), (32, 32, 32)]
)
@pytest.mark.parametrize("heads", [(14, 2), (9, 3)])
def test_interp_tiles_inside_and_across_blocks(
    block_size: int, tile_n: int, block_m: int, heads: tuple[int, int]
) -> None:
    cfg = configs.AttentionConfig(block_m, tile_n, num_warps=4, num_stages=1, min_rows=1)
    batch = make_batch(mixed(block_size), block_size, heads, seed=tile_n)
    batch.check(config=cfg)
    decode = make_batch(decodes(block_size), block_size, heads, seed=tile_n)
    decode.check(config=cfg, num_splits=3)


@interp
@pytest.mark.parametrize("splits", [None, 3])
def test_interp_prefill_one_token_query_blocks(splits: int | None) -> None:
    """A GQA group as large as a program's rows gives prefill query blocks of one token: the
    decode-shaped path (visibility by length, row sums after the loop) then serves prefill,
    chunked prefill and prefix hits, each block seeing the keys up to its own token."""
    cfg = configs.AttentionConfig(block_m=16, tile_n=32, num_warps=4, num_stages=1)
    assert ta.tile_shape(16, False, cfg) == (1, 16)
    make_batch(mixed(16), 16, (16, 1), seed=5).check(config=cfg, num_splits=splits)


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_interp_shared_prefix_blocks_and_fused_kv_views(dtype: torch.dtype) -> None:
    specs = [(1, 40), (7, 33), (1, 32), (20, 60)]
    make_batch(specs, 16, (14, 2), dtype=dtype, shared_blocks=2, fused_kv=True).check()
    decode = [(1, 40), (1, 70), (1, 32)]
    batch = make_batch(decode, 16, (9, 3), dtype=dtype, shared_blocks=2, fused_kv=True)
    batch.check(num_splits=4)


@interp
@pytest.mark.parametrize("block_size", [16, 64])
def test_interp_head_major_cache_views(block_size: int) -> None:
    """Caches stored `[block, head, token, dim]` and passed as permuted views (strides only)."""
    make_batch(mixed(block_size), block_size, (14, 2), head_major=True).check()
    batch = make_batch(decodes(block_size), block_size, (9, 3), head_major=True)
    batch.check(num_splits=3)
    assert not batch.k_cache.is_contiguous() and batch.k_cache.stride(2) == block_size * 64


@interp
@pytest.mark.parametrize("head_dim", [24, 128])
def test_interp_head_dims_padded_or_large(head_dim: int) -> None:
    make_batch(mixed(16), 16, (9, 3), head_dim=head_dim).check()
    make_batch(decodes(16), 16, (14, 2), head_dim=head_dim).check(num_splits=2)


@interp
@pytest.mark.parametrize("splits", [2, 5, 12])  # 12 > tiles of every sequence
@pytest.mark.parametrize("heads", [(14, 2), (9, 3)])
def test_interp_fused_combine_merges_in_the_last_split(
    monkeypatch: pytest.MonkeyPatch, heads: tuple[int, int], splits: int
) -> None:
    """With `fused_combine` no combine kernel is launched; the last split to arrive merges, the
    output matches, padding rows of length 0 come out as zeros, and the counters are left zero
    for the next call."""

    class NoLaunch:
        def __getitem__(self, grid: object) -> None:
            raise AssertionError("combine kernel launched with fused_combine")

    monkeypatch.setattr(ta, "_combine_splits", NoLaunch())
    cfg = configs.lookup(None, "decode", 64)
    cfg = configs.AttentionConfig(cfg.block_m, 32, 4, 1, cfg.min_rows, fused_combine=True)
    b = make_batch(decodes(16), 16, heads, seed=splits)
    b.check(num_splits=splits, config=cfg)
    b.check(num_splits=splits, config=cfg)  # again: the counters were reset
    assert int(splits_mod._COUNTERS[torch.device("cpu")].count_nonzero()) == 0
    n, pad = len(b.q_lens), 2
    q = torch.cat([b.q, torch.randn(pad, *b.q.shape[1:])])
    table = torch.cat([b.table, torch.full((pad, b.table.shape[1]), GARBAGE_BLOCK).int()])
    lens = torch.cat([b.seq_lens, torch.zeros(pad, dtype=torch.int32)])
    cu = torch.arange(n + pad + 1, dtype=torch.int32)
    batch = PagedBatch(table, lens, cu, 1, 300)
    out = ta.paged_attention(q, b.k_cache, b.v_cache, batch, 0.125, num_splits=splits, config=cfg)
    assert torch.equal(out[n:], torch.zeros_like(out[n:]))


@interp
def test_interp_single_split_launches_no_combine(monkeypatch: pytest.MonkeyPatch) -> None:
    class NoLaunch:
        def __getitem__(self, grid: object) -> None:
            raise AssertionError("combine kernel launched for one split")

    monkeypatch.setattr(ta, "_combine_splits", NoLaunch())
    make_batch(decodes(16), 16, (14, 2)).check(num_splits=1)
    make_batch(mixed(16), 16, (14, 2)).check()


@interp
def test_interp_dispatch_through_kernels_package(monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedctl import kernels

    monkeypatch.setenv("PAGEDCTL_KERNELS", "triton")
    b = make_batch(mixed(32), 32, (14, 2), seed=7)
    args = (b.q, b.k_cache, b.v_cache, b.paged, 0.125)
    torch.testing.assert_close(kernels.paged_attention(*args), b.run(), atol=0, rtol=0)
    k_cache, v_cache = torch.zeros(4, 16, 2, 8), torch.zeros(4, 16, 2, 8)
    kernels.write_kv(
        torch.ones(2, 2, 8), torch.ones(2, 2, 8), k_cache, v_cache, torch.tensor([3, -1])
    )
    assert int(k_cache.count_nonzero()) == 16 and float(k_cache[0, 3].sum()) == 16


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("fused_kv", [False, True])
def test_interp_write_kv_matches_reference(dtype: torch.dtype, fused_kv: bool) -> None:
    gen = torch.Generator().manual_seed(3)
    kv = torch.full((6, 2, 16, 3, 40), float("nan"), dtype=dtype)
    caches = kv.unbind(1) if fused_kv else (kv[:, 0].contiguous(), kv[:, 1].contiguous())
    expected = [c.clone() for c in caches]
    # float32 rows (K a strided view) into a cache of any dtype
    key, value = torch.randn(2, 7, 5, 40, generator=gen)[:, :, 1:4]
    slots = torch.tensor([0, 95, -1, 17, -1, 40, 63])
    triton_kv.write_kv(key, value.contiguous(), caches[0], caches[1], slots)
    reference.write_kv(key, value, expected[0], expected[1], slots)
    for got, want in zip(caches, expected, strict=True):
        torch.testing.assert_close(got, want, atol=0, rtol=0, equal_nan=True)
    assert int(torch.isnan(caches[0]).all(-1).all(-1).logical_not().sum()) == 5


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("vocab", [1000, 1024, 3001])
def test_interp_sample_temperature_matches_reference(dtype: torch.dtype, vocab: int) -> None:
    """The fused sampler picks the reference's token (float64 CDF in vocabulary order), also
    at u = 0 and u just under 1, past whole chunks of -inf and a row with one live token."""
    gen = torch.Generator().manual_seed(5)
    logits = (torch.randn(12, vocab, generator=gen) * 3).to(dtype)
    logits[3, : vocab - 9] = float("-inf")  # whole chunks without mass before the live tail
    logits[5, 100:] = float("-inf")
    logits[6] = float("-inf")
    logits[6, vocab // 2] = 0.0  # one live token
    u = torch.rand(12, generator=gen)
    u[0], u[1], u[3] = 0.0, 1 - 2**-24, 1 - 2**-24
    for t in (0.6, 1.0, 2.5):
        got = triton_sample.sample_temperature(logits, t, u)
        torch.testing.assert_close(got, reference.sample_temperature(logits, t, u), rtol=0, atol=0)
        assert torch.isfinite(logits[torch.arange(12), got]).all()  # never a zero probability
        assert int(got[6]) == vocab // 2
    dead = torch.full((2, vocab), float("-inf"), dtype=dtype)
    dead[1, 7] = float("nan")
    got = triton_sample.sample_temperature(dead, 1.0, torch.tensor([0.3, 0.9]))
    assert ((got >= 0) & (got < vocab)).all()  # no mass: still an id inside the vocabulary


@interp
def test_interp_sample_temperature_frequencies() -> None:
    """Drawn over many uniforms, the fused sampler's tokens follow softmax(logits / t)."""
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0, float("-inf")] + [-30.0] * 1100])
    t, n = 0.8, 4000
    u = (torch.arange(n, dtype=torch.float64) + 0.5) / n  # an even grid of uniforms
    got = triton_sample.sample_temperature(logits.expand(n, -1), t, u.float())
    freq = torch.bincount(got, minlength=logits.shape[1]).double() / n
    probs = torch.softmax(logits[0].double() / t, dim=-1)
    assert float((freq - probs).abs().max()) < 2 / n + 1e-9
    assert int(freq[4]) == 0


@interp
@pytest.mark.parametrize("key", sorted(configs.CONFIGS))
def test_interp_shipped_gpu_configs_match_reference(key: tuple[str, str]) -> None:
    """The tile shapes the GPUs run (128-row prefill blocks, 128-token decode tiles, the fused
    merge) are interpreted too, bounds-checked, against the naive attention: a mixed batch and a
    decode batch with garbage table padding, split 3 ways."""
    cfg = configs.CONFIGS[key]
    make_batch(mixed(16), 16, (9, 3), seed=11).check(config=cfg)
    make_batch(decodes(32), 32, (14, 2), seed=12).check(config=cfg, num_splits=3)


@interp
def test_interp_bounds_check_catches_a_stray_address() -> None:
    """The interpreter runs with `tests/interp_bounds.py` installed: an access past every
    argument's storage raises, one the mask excludes does not."""
    import triton
    import triton.language as tl

    from tests.interp_bounds import OutOfBounds

    @triton.jit
    def _copy(x_ptr, y_ptr, n, stride):
        i = tl.arange(0, 8)
        tl.store(y_ptr + i, tl.load(x_ptr + i * stride, mask=i < n, other=0.0), mask=i < 8)

    x, y = torch.arange(8.0), torch.zeros(8)
    _copy[(1,)](x, y, 8, 1)
    assert torch.equal(y, x)
    _copy[(1,)](x, y, 1, 1 << 40)  # only i = 0 is read
    with pytest.raises(Exception) as caught:
        _copy[(1,)](x, y, 8, 1 << 40)
    assert isinstance(caught.value.__cause__, OutOfBounds) or "outside every" in str(caught.value)


@interp
def test_interp_engine_steps_on_the_kernels_match_the_reference_path(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The whole engine on the Triton kernels (interpreted), through its step graphs (emulated:
    decode, mixed and few-sequence ones, whose attention splits each query block's history
    16 ways), gives the greedy tokens of the eager reference path: a batch, then a prefix hit
    of a few tokens after a 200-token history, two samples of one prompt (a copy-on-write).
    Every access of every kernel, the graphs'
    warm-up runs included, is bounds-checked (their input buffers are shared between keys:
    stale -1 slots of one key once became another's positions, a read before the rotary
    tables that killed a CUDA context)."""
    from pagedctl.engine import SamplingParams
    from pagedctl.engine.llm import LLM
    from tests.tiny_models import save_tiny_model

    save_tiny_model("qwen2", tmp_path)
    rng = __import__("random").Random(4)
    batch = [[rng.randrange(256) for _ in range(rng.randint(3, 30))] for _ in range(5)]
    history = [rng.randrange(256) for _ in range(200)]
    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    runs = {}
    for backend, graphs in (("triton", "emulate"), ("reference", False)):
        monkeypatch.setenv("PAGEDCTL_KERNELS", backend)
        llm = LLM(
            str(tmp_path), device="cpu", dtype="float32", max_num_seqs=8,
            max_num_batched_tokens=512, cuda_graphs=graphs,  # two mixed and two few keys
        )  # fmt: skip
        tokens = [o.outputs[0].token_ids for o in llm.generate(batch, greedy)]
        for prompt in (history, history + [7, 8, 9]):  # the second one hits the first's blocks
            tokens += [llm.generate([prompt], greedy)[0].outputs[0].token_ids]
        # two samples of a 37-token prompt share its partly filled last block until each
        # writes into it: a copy-on-write of the (head-major, on the kernels' path) cache
        pair = llm.generate([history[:37]], replace(greedy, n=2, max_tokens=6))[0].outputs
        tokens += [o.token_ids for o in pair]
        runs[backend] = tokens
        if graphs:
            assert {"decode", "mixed", "few"} <= set(llm.runner.step_counts), llm.runner.step_counts
            assert llm.stats["prefix_cache"]["hit_tokens"] >= 192
        if backend == "triton":
            assert not llm.runner._kv.is_contiguous()  # stored head-major
    assert runs["triton"] == runs["reference"]


# --- sliding window and soft cap (interpreted) -----------------------------------------------


@pytest.fixture
def row_independent_dot(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every row of an interpreted `tl.dot` as its own product (`interp_suite`)."""
    interp_suite.row_independent_dot(monkeypatch)


@interp
@pytest.mark.parametrize(
    ("window", "softcap", "fused"),
    [(1, None, False), (20, 5.0, True), (100, None, True), (64, 2.0, False)],
)
def test_interp_decode_window_and_softcap_split(
    window: int, softcap: float | None, fused: bool
) -> None:
    """Decode rows around block boundaries and one of 301 keys: the split programs share out
    the window's tiles alone (window 20 runs 1, 3 and 12 splits, more than it has tiles; the
    others 5), merged by the combine kernel or in the last split."""
    cfg = replace(configs.INTERPRETER_CONFIGS["decode"], tile_n=32, fused_combine=fused)
    batch = make_batch(decodes(16), 16, (9, 3), seed=window)
    for splits in (1, 3, 12) if window == 20 else (5,):
        batch.check(num_splits=splits, window=window, softcap=softcap, config=cfg)


@interp
@pytest.mark.parametrize(
    ("block_size", "window", "dtype"),
    [(16, 7, torch.float32), (16, 40, torch.float16), (64, 70, torch.float32)],
)
def test_interp_mixed_batch_window(block_size: int, window: int, dtype: torch.dtype) -> None:
    batch = make_batch(mixed(block_size), block_size, (14, 2), dtype=dtype, seed=window)
    batch.check(window=window)
    batch.check(window=window, softcap=3.0)


@interp
@pytest.mark.parametrize(("window", "splits"), [(5, 3), (45, None), (100, 3)])
def test_interp_prefill_window_edge_whole_tiles_and_diagonal(
    window: int, splits: int | None
) -> None:
    """32-token query blocks over 32-key tiles: a block's walk starts at the tile of its first
    query's first key, masks the tiles at the window's lower edge, reads those every row's
    window holds whole unmasked, then masks the diagonal; a split's tiles run through all
    three passes. Windows smaller than a block, than a tile plus a block and larger."""
    cfg = configs.AttentionConfig(block_m=32, tile_n=32, num_warps=4, num_stages=1)
    specs = [(40, 200), (40, 31), (33, 97), (9, 150), (1, 130), (35, 0)]
    make_batch(specs, 16, (2, 2), seed=window).check(config=cfg, num_splits=splits, window=window)
    batch = make_batch(specs[:3], 32, (14, 2), dtype=torch.float16, seed=window)
    batch.check(config=cfg, num_splits=splits, window=window, softcap=4.0)


@interp
def test_interp_prefill_one_token_query_blocks_window() -> None:
    cfg = configs.AttentionConfig(block_m=16, tile_n=32, num_warps=4, num_stages=1)
    make_batch(mixed(16), 16, (16, 1), seed=5).check(config=cfg, window=9, num_splits=3)


@interp
@pytest.mark.parametrize("fused", [False, True])
def test_interp_one_query_block_a_program_and_sequences_without_queries_window(fused: bool) -> None:
    """A batch whose every sequence fits one query block (one program each, no early exit on
    the query length), some without a query: those read and write nothing."""
    cfg = configs.AttentionConfig(32, 32, 4, 1, min_rows=1, fused_combine=fused)
    specs = [(4, 100), (0, 70), (2, 40), (1, 65), (0, 5)]
    make_batch(specs, 16, (14, 2), seed=9).check(config=cfg, num_splits=3, window=30, softcap=8.0)


@interp
def test_interp_blocks_the_window_has_passed_are_never_read() -> None:
    """The engine frees a sequence's blocks once its window has passed them: filled with NaN,
    their table entries out of range (every access is bounds-checked), 0 or stale, the output
    is the same bits, in decode (split) and prefill."""
    cfg = configs.AttentionConfig(block_m=32, tile_n=64, num_warps=4, num_stages=1, min_rows=1)
    cases = ((decodes(16), 3, 3), (decodes(16), 33, None), (mixed(16) + [(40, 130)], 33, None))
    for specs, window, splits in cases:
        clean = make_batch(specs, 16, (9, 3), seed=window)
        want = clean.check(window=window, softcap=5.0, num_splits=splits, config=cfg)
        freed = make_batch(specs, 16, (9, 3), seed=window)
        assert freed.free_outside(window) > 0
        got = freed.run(window=window, softcap=5.0, num_splits=splits, config=cfg)
        assert torch.isfinite(got).all()
        assert torch.equal(got, want)


@interp
def test_interp_shipped_gpu_configs_with_softcap_and_window() -> None:
    """The GPUs' tile shapes with a soft cap alone, a window alone and both."""
    for key, window in ((("sm75", "prefill"), None), (("sm90", "prefill"), 40)):
        cfg = configs.CONFIGS[key]
        make_batch(mixed(16), 16, (9, 3), seed=11).check(config=cfg, window=window, softcap=6.0)
    decode = make_batch(decodes(32), 32, (14, 2), seed=12)
    decode.check(config=configs.CONFIGS["sm90", "decode"], num_splits=3, window=40)


@interp
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_interp_batch_invariant_window_row_alone_chunked_or_decoded(
    row_independent_dot: None, softcap: float | None
) -> None:
    """`batch_invariant=True` with a window: a row's bits are its own sequence's, whatever its
    query block starts at (its walk starts at its own window's tile of the global grid), as a
    decode row alone or among others."""
    window = 70
    gen = torch.Generator().manual_seed(2)
    k_cache = torch.randn(40, 16, 2, 64, generator=gen).half()
    v_cache = torch.randn(40, 16, 2, 64, generator=gen).half()
    tables = torch.randperm(40, generator=gen)[:33].view(3, 11).int()
    q = torch.randn(3, 170, 14, 64, generator=gen).half()

    def run(parts: list[tuple[int, int, int]]) -> Tensor:
        """`(sequence, first row, last row + 1)` parts, each over keys up to its last row."""
        qs = torch.cat([q[s, a:b] for s, a, b in parts])
        q_lens = [b - a for _, a, b in parts]
        cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        lens = torch.tensor([b for _, _, b in parts], dtype=torch.int32)
        batch = PagedBatch(tables[[s for s, _, _ in parts]], lens, cu, max(q_lens), 170)
        return ta.paged_attention(
            qs, k_cache, v_cache, batch, 0.125, batch_invariant=True, window=window,
            softcap=softcap,
        )  # fmt: skip

    whole = run([(0, 0, 170)])
    pos = torch.arange(170)
    ks = [k_cache[tables[0][pos // 16].long(), pos % 16]]
    vs = [v_cache[tables[0][pos // 16].long(), pos % 16]]
    want = naive_attention(q[0], ks, vs, [170], window=window, softcap=softcap)
    torch.testing.assert_close(whole.double(), want, atol=4e-3, rtol=4e-3)
    assert torch.equal(run([(1, 0, 30), (0, 97, 170)])[30:], whole[97:])
    for p in (63, 100, 169):
        alone = run([(0, p, p + 1)])
        assert torch.equal(alone, whole[p : p + 1]), p
        assert torch.equal(run([(1, 120, 121), (0, p, p + 1), (2, 6, 7)])[1:2], alone), p


# --- no interpreter: split policy, dispatch, cross-compilation -------------------------------


@compiled
def test_split_count_follows_sms_batch_and_context() -> None:
    assert ta.choose_num_splits(1, 2, 8192, 132, 64) == splits_mod.MAX_SPLITS
    assert ta.choose_num_splits(1, 2, 600, 132, 64) == 10  # no split without a whole tile
    assert ta.choose_num_splits(1, 3, 100, 40, 64) == 2
    # up to 3 programs an SM: 64 pairs -> 6 splits (4096 positions leave 16 tiles each)
    assert ta.choose_num_splits(32, 2, 4096, 132, 64) == 6
    assert ta.choose_num_splits(64, 2, 2048, 132, 64) == 3  # 384 programs
    assert ta.choose_num_splits(64, 3, 2048, 132, 64) == 2  # 384 programs
    # more programs than SMs: at least 4 tiles a split (32 tiles), else only as many as SMs
    assert ta.choose_num_splits(8, 2, 2048, 132, 64) == 8
    assert ta.choose_num_splits(8, 2, 512, 132, 64) == 8  # 128 programs: one tile each
    assert ta.choose_num_splits(8, 2, 32768, 132, 64) == 24
    assert ta.choose_num_splits(256, 2, 32768, 132, 64) == 1


@compiled
@pytest.mark.parametrize("sms", [8, 40, 132])
@pytest.mark.parametrize("tile_n", [32, 64, 128])
def test_split_count_keeps_its_bounds_everywhere(sms: int, tile_n: int) -> None:
    """Over batches, KV heads and lengths: at least one split, never a split without a tile or
    past MAX_SPLITS; more than one only while the programs fit 3 an SM, and where they
    outnumber the SMs, every split has at least 4 tiles; and a longer context of the same batch
    never gets fewer splits."""
    for seqs in (1, 2, 3, 8, 31, 64, 100, 256):
        for heads in (1, 2, 3, 8):
            pairs = seqs * heads
            last = 1
            for ctx in (1, 15, 16, 63, 64, 65, 300, 512, 2048, 8191, 32768, 131072):
                n = ta.choose_num_splits(seqs, heads, ctx, sms, tile_n)
                tiles = -(-ctx // tile_n)
                assert 1 <= n <= max(1, min(tiles, splits_mod.MAX_SPLITS))
                if n > 1:
                    assert pairs * n <= splits_mod.PROGRAMS_PER_SM * sms
                    assert pairs * n <= sms or tiles // n >= splits_mod.MIN_TILES_PER_SPLIT
                assert n >= last, (seqs, heads, ctx)
                last = n


@compiled
@pytest.mark.parametrize(("forced", "on_cuda", "backend"), [
    ("", False, "reference"), ("", True, "triton"), ("reference", True, "reference"),
    ("triton", False, "triton"),
])  # fmt: skip
def test_dispatch_rule(
    monkeypatch: pytest.MonkeyPatch, forced: str, on_cuda: bool, backend: str
) -> None:
    from pagedctl import kernels

    class Probe:
        is_cuda = on_cuda

    monkeypatch.setenv("PAGEDCTL_KERNELS", forced)
    assert kernels._use_triton(Probe()) == (backend == "triton")  # type: ignore[arg-type]


@compiled
@pytest.mark.parametrize("forced", ["", "triton"])
def test_kv_cache_storage_follows_the_backend(monkeypatch: pytest.MonkeyPatch, forced: str) -> None:
    """The reference keeps token-major storage; where the Triton kernels serve a device, each
    block is stored head-major behind a view of the same logical shape, and a write through the
    view lands in one contiguous run per (block, head)."""
    from pagedctl import kernels

    monkeypatch.setenv("PAGEDCTL_KERNELS", forced)
    kv = kernels.empty_kv_cache(3, 5, 16, 2, 8, torch.float32, "cpu")
    assert kv.shape == (3, 2, 5, 16, 2, 8)
    if not forced:
        assert kv.is_contiguous()
        return
    assert not kv.is_contiguous() and kv.stride()[2:] == (2 * 16 * 8, 8, 16 * 8, 1)
    k = kv[1, 0]  # layer 1's K, [blocks, block_size, heads, dim]
    k.zero_()
    k[3, :, 1] = 1.0  # block 3, every token, head 1
    storage = kv.transpose(3, 4).contiguous()[1, 0, 3]  # [heads, block_size, dim]
    assert storage[1].eq(1).all() and storage[0].eq(0).all()


@compiled
def test_dispatch_passes_the_split_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedctl import kernels

    seen: dict = {}
    monkeypatch.setattr(ta, "paged_attention", lambda *a, **k: seen.update(k) or "out")
    monkeypatch.setenv("PAGEDCTL_KERNELS", "triton")
    assert kernels.paged_attention(*[None] * 4, 1.0, num_splits=16) == "out"
    off = {"window": None, "softcap": None}
    assert seen == {"num_splits": 16, "batch_invariant": False, **off}
    kernels.paged_attention(*[None] * 4, 1.0, batch_invariant=True)
    assert seen == {"num_splits": None, "batch_invariant": True, **off}
    kernels.paged_attention(*[None] * 4, 1.0, window=4096, softcap=50.0)
    assert seen == {"num_splits": None, "batch_invariant": False, "window": 4096, "softcap": 50.0}


def _compile(fn: object, pointers: dict[str, str], consts: dict[str, object], cc: int, cfg: dict):
    """Cross-compile a `@triton.jit` function for `GPUTarget("cuda", cc, 32)` without a GPU."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    defaults = {p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}  # type: ignore[attr-defined]
    consts = {**defaults, **consts}  # e.g. WINDOW=0, SOFTCAP=0.0: the variant without them
    sig = {}
    for name in fn.arg_names:  # type: ignore[attr-defined]
        sig[name] = "constexpr" if name in consts else pointers.get(name, "i32")
    sig.update({k: "fp32" for k in sig if k in ("qk_scale", "temperature")})
    target = GPUTarget("cuda", cc, 32)
    options = triton.compiler.make_backend(target).parse_options(cfg)
    return triton.compile(ASTSource(fn, sig, consts), target=target, options=options.__dict__)


def _attention_pointers(dtype: str, lengths: str = "i32") -> dict[str, str]:
    names = ["q_ptr", "k_ptr", "v_ptr", "out_ptr"]
    ptrs = {n: f"*{dtype}" for n in names}
    ptrs["bt_ptr"] = "*i32"
    ptrs.update({n: f"*{lengths}" for n in ["seq_lens_ptr", "cu_q_ptr"]})
    ptrs.update({n: "*fp32" for n in ["acc_ws_ptr", "m_ws_ptr", "l_ws_ptr"]})
    ptrs["counter_ptr"] = "*i32"
    return ptrs


TARGETS = {"sm75": 75, "sm80": 80, "sm90": 90}


@compiled
@pytest.mark.parametrize("key", sorted(configs.CONFIGS))
def test_shipped_configs_compile_for_their_architecture(key: tuple[str, str]) -> None:
    fam, phase = key
    decode = phase.startswith("decode")
    dtypes = ["fp16"] if fam == "sm75" else ["fp16", "bf16"]
    for i, (group, head_dim) in enumerate([(7, 64), (3, 128), (1, 64)]):
        dtype = dtypes[i % len(dtypes)]
        cfg = configs.lookup((TARGETS[fam] // 10, TARGETS[fam] % 10), phase, head_dim)
        block_q, block_m = ta.tile_shape(group, decode, cfg)
        consts = dict(GROUP=group, HEAD_DIM=head_dim, D_PAD=head_dim, BLOCK_SIZE=16)
        consts.update(BLOCK_Q=block_q, BLOCK_M=block_m, TILE_N=cfg.tile_n)
        consts.update(ONE_QBLOCK=decode, DOT_PREC="tf32", PDL=cfg.pdl and decode)
        consts.update(COLUMN_SUMS=decode)
        launch = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
        # int64 lengths and offsets: how the engine's step graphs pack them
        ptrs = _attention_pointers(dtype, lengths=["i32", "i64"][i % 2])
        for splits, fused in [(1, False), (4, False), (4, True)]:  # prefill splits: graphs
            variant = {**consts, "NUM_SPLITS": splits, "FUSED_COMBINE": fused}
            kernel = _compile(ta._attn_fwd, ptrs, variant, TARGETS[fam], launch)
            if fam == "sm75":
                assert kernel.metadata.shared <= configs.SM75_SHARED_LIMIT
                assert "mma" not in kernel.asm["ptx"]  # Turing: FMA dots only
        del consts["BLOCK_SIZE"], consts["DOT_PREC"], consts["PDL"], consts["COLUMN_SUMS"]
        _compile(ta._combine_splits, ptrs, {**consts, "NUM_SPLITS": 4}, TARGETS[fam], {})


@compiled
@pytest.mark.parametrize("cc", [75, 90])
def test_fp32_test_path_and_write_kv_compile(cc: int) -> None:
    cfg = configs.lookup((cc // 10, cc % 10), "prefill", 64)
    consts = dict(GROUP=3, HEAD_DIM=64, D_PAD=64, BLOCK_SIZE=32, BLOCK_Q=21, BLOCK_M=64)
    consts.update(TILE_N=cfg.tile_n, NUM_SPLITS=1, ONE_QBLOCK=False, DOT_PREC="ieee")
    consts.update(FUSED_COMBINE=False, PDL=False, COLUMN_SUMS=False)
    launch = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    kernel = _compile(ta._attn_fwd, _attention_pointers("fp32"), consts, cc, launch)
    assert cc != 75 or kernel.metadata.shared <= configs.SM75_SHARED_LIMIT
    ptrs = {n: "*fp16" for n in ["key_ptr", "value_ptr", "k_cache_ptr", "v_cache_ptr"]}
    ptrs["slot_ptr"] = "*i64"
    consts = dict(BLOCK_SIZE=16, NUM_KV_HEADS=3, HEAD_DIM=64, H_PAD=4, D_PAD=64)
    kernel = _compile(triton_kv._write_kv, ptrs, {**consts, "TRIGGER": cc >= 90}, cc, {})
    assert ("griddepcontrol.launch_dependents" in kernel.asm["ptx"]) == (cc >= 90)


@compiled
def test_programmatic_dependent_launch_compiles_for_hopper() -> None:
    """With `AttentionConfig.pdl`, sm_90 decode waits on the grid before it (after reading the
    tables and lengths) and lets the next one launch after its loop; no other family gets it."""
    consts = dict(GROUP=7, HEAD_DIM=64, D_PAD=64, BLOCK_SIZE=16, BLOCK_Q=1, BLOCK_M=16)
    consts.update(TILE_N=64, NUM_SPLITS=3, ONE_QBLOCK=True, DOT_PREC="tf32")
    consts.update(FUSED_COMBINE=True, PDL=True, COLUMN_SUMS=True)
    kernel = _compile(ta._attn_fwd, _attention_pointers("bf16"), consts, 90, {"num_warps": 4})
    ptx = kernel.asm["ptx"]
    assert ptx.index("griddepcontrol.wait") < ptx.index("griddepcontrol.launch_dependents")
    assert not any(c.pdl for (fam, _), c in configs.CONFIGS.items() if fam != "sm90")


@compiled
def test_write_kv_releases_its_dependents_only_where_decode_launches_programmatically(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`write_kv` lets the next grid start early exactly where a shipped decode config of the
    device uses `pdl`, and never before sm_90 or on the CPU, even when asked."""
    assert not configs.uses_pdl((9, 0)) and not configs.uses_pdl(None)
    sm90 = configs.CONFIGS["sm90", "decode"]
    monkeypatch.setitem(configs.CONFIGS, ("sm90", "decode"), replace(sm90, pdl=True))
    monkeypatch.setitem(configs.CONFIGS, ("sm80", "decode"), replace(sm90, pdl=True))
    assert configs.uses_pdl((9, 0)) and configs.uses_pdl((10, 0))
    assert not configs.uses_pdl((8, 0)) and not configs.uses_pdl(None)

    seen = []

    class Launch:
        def __getitem__(self, grid: object) -> object:
            return lambda *args, **kw: seen.append(kw["TRIGGER"])

    monkeypatch.setattr(triton_kv, "_write_kv", Launch())
    rows, cache, slots = torch.zeros(2, 3, 64), torch.zeros(4, 16, 3, 64), torch.zeros(2).long()
    for capability in [(9, 0), (8, 0), None]:
        monkeypatch.setattr(triton_kv, "_device_info", lambda _, c=capability: (c, 132))
        for asked in (None, True, False):
            triton_kv.write_kv(rows, rows, cache, cache, slots, release_dependents=asked)
    assert seen == [True, True, False, False, False, False, False, False, False]


@compiled
@pytest.mark.parametrize("cc", [75, 90])
@pytest.mark.parametrize("dtype", ["fp16", "fp32", "bf16"])
def test_sampling_kernels_compile(cc: int, dtype: str) -> None:
    if cc == 75 and dtype == "bf16":
        pytest.skip("no bfloat16 on Turing")
    ptrs = {"logits_ptr": f"*{dtype}", "max_ptr": "*fp32", "sum_ptr": "*fp64"}
    consts = {"CHUNK": triton_sample.CHUNK}
    _compile(triton_sample._chunk_stats, ptrs, consts, cc, {"num_warps": 4})
    ptrs.update(u_ptr="*fp32", out_ptr="*i64")
    consts["CHUNKS_PAD"] = 256
    _compile(triton_sample._pick, ptrs, consts, cc, {"num_warps": 8})


@compiled
@pytest.mark.parametrize("fam", ["sm75", "sm90"])
def test_window_and_softcap_variants_compile(fam: str) -> None:
    """`WINDOW` and `SOFTCAP` on, as Gemma 2's local layers run them: decode (split, fused),
    prefill and the batch-invariant config; on Turing within 64 KB of shared memory and with
    FMA dots only (its `tanh` from `exp2`)."""
    cc = TARGETS[fam]
    capability = (cc // 10, cc % 10)
    window = dict(WINDOW=4096, SOFTCAP=50.0)
    ptrs = _attention_pointers("fp16")
    for phase, invariant, splits, fused in [
        ("decode", False, 4, True), ("prefill", False, 1, False), ("prefill", True, 1, False),
    ]:  # fmt: skip
        decode = phase == "decode"
        if invariant:
            cfg = configs.lookup_invariant(capability, 64)
        else:
            cfg = configs.lookup(capability, phase, 64)
        block_q, block_m = ta.tile_shape(7, decode, cfg, invariant)
        consts = dict(GROUP=7, HEAD_DIM=64, D_PAD=64, BLOCK_SIZE=16, BLOCK_Q=block_q)
        consts.update(BLOCK_M=block_m, TILE_N=cfg.tile_n, NUM_SPLITS=splits, ONE_QBLOCK=decode)
        consts.update(DOT_PREC="tf32", FUSED_COMBINE=fused, PDL=False)
        consts.update(COLUMN_SUMS=decode and not invariant, **window)
        launch = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
        launch["enable_fp_fusion"] = not invariant
        kernel = _compile(ta._attn_fwd, ptrs, consts, cc, launch)
        if fam == "sm75":
            assert kernel.metadata.shared <= configs.SM75_SHARED_LIMIT
            assert "mma" not in kernel.asm["ptx"]
    merge = dict(GROUP=7, HEAD_DIM=64, D_PAD=64, BLOCK_Q=1, BLOCK_M=16, TILE_N=64)
    merge.update(NUM_SPLITS=4, ONE_QBLOCK=True, WINDOW=4096)
    _compile(ta._combine_splits, ptrs, merge, cc, {})


@compiled
def test_decode_splits_share_out_only_the_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """The split count of a windowed decode batch is chosen for the window's tiles (at most
    `window + tile_n - 1` positions), not for the whole history."""
    grids = []

    class Launch:
        def __getitem__(self, grid: tuple[int, int, int]) -> object:
            grids.append(grid)
            return lambda *args, **kwargs: None

    monkeypatch.setattr(ta, "_attn_fwd", Launch())
    monkeypatch.setattr(ta, "_combine_splits", Launch())
    q, cache = torch.zeros(1, 2, 64), torch.zeros(600, 16, 1, 64)
    table = torch.zeros(1, 600, dtype=torch.int32)
    batch = PagedBatch(table, torch.tensor([9000]), torch.tensor([0, 1]), 1, 9000)
    tile_n = configs.lookup(None, "decode", 64).tile_n
    for window, span in ((None, 9000), (4096, 4096 + tile_n - 1), (100, 100 + tile_n - 1)):
        grids.clear()
        ta.paged_attention(q, cache, cache, batch, 0.125, window=window)
        assert grids[0][2] == ta.choose_num_splits(1, 1, span, 8, tile_n), window
    assert grids[0][2] < ta.choose_num_splits(1, 1, 9000, 8, tile_n)

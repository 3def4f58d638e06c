"""The reference ops against a naive per-sequence attention on contiguous K/V."""

from __future__ import annotations

from dataclasses import dataclass, replace

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


def naive_attention(
    q: Tensor,
    ks: list[Tensor],
    vs: list[Tensor],
    q_lens: list[int],
    *,
    window: int | None = None,
    softcap: float | None = None,
) -> Tensor:
    """Per-sequence float64 attention with an explicit causal (and window) mask on contiguous
    K/V; `softcap` caps the scaled scores before the mask, as Hugging Face's Gemma 2 does."""
    outs, start = [], 0
    for k, v, q_len in zip(ks, vs, q_lens, strict=True):
        qi = q[start : start + q_len].double()
        start += q_len
        group = qi.shape[1] // k.shape[1]
        kk, vv = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", qi, kk) * qi.shape[-1] ** -0.5
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(k.shape[0] - q_len, k.shape[0])
        causal = torch.arange(k.shape[0])[None, :] <= q_pos[:, None]
        if window is not None:
            causal &= torch.arange(k.shape[0])[None, :] > q_pos[:, None] - window
        scores = scores.masked_fill(~causal, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv))
    return torch.cat(outs)


def looped_attention(
    q: Tensor,
    ks: list[Tensor],
    vs: list[Tensor],
    q_lens: list[int],
    window: int | None = None,
    softcap: float | None = None,
) -> Tensor:
    """The same in float64 one query at a time, over exactly the keys of its window (no mask):
    the positions `max(0, p - window + 1) ... p` of a query at position `p`."""
    rows, start = [], 0
    for k, v, q_len in zip(ks, vs, q_lens, strict=True):
        group = q.shape[1] // k.shape[1]
        for j in range(q_len):
            p = k.shape[0] - q_len + j
            lo = 0 if window is None else max(0, p - window + 1)
            row = []
            for h in range(q.shape[1]):
                scores = k[lo : p + 1, h // group].double() @ q[start + j, h].double()
                scores = scores * q.shape[-1] ** -0.5
                if softcap is not None:
                    scores = softcap * torch.tanh(scores / softcap)
                row.append(scores.softmax(0) @ v[lo : p + 1, h // group].double())
            rows.append(torch.stack(row))
        start += q_len
    return torch.stack(rows)


def free_outside_window(
    k_cache: Tensor,
    v_cache: Tensor,
    table: Tensor,
    seq_lens: list[int],
    q_lens: list[int],
    window: int,
    placeholder: int,
) -> int:
    """Do to a batch what the engine may do once a sequence's window has passed some of its
    blocks: every block whose positions all lie at or below `first query position - window` is
    filled with NaN (as if handed to another sequence) and its table entry replaced, in turn,
    by `placeholder`, 0 and left as it was (a stale id). Returns how many blocks were freed."""
    block_size, freed = k_cache.shape[1], 0
    for i, (n, q_len) in enumerate(zip(seq_lens, q_lens, strict=True)):
        dead = (n - q_len - window + 1) // block_size  # blocks wholly below the first query's
        for col in range(max(0, dead)):
            block = int(table[i, col])
            k_cache[block], v_cache[block] = float("nan"), float("nan")
            table[i, col] = (placeholder, 0, block)[freed % 3]
            freed += 1
    return freed


@dataclass
class Case:
    """A paged batch and each sequence's contiguous K/V (for the naive attentions)."""

    q: Tensor
    k_cache: Tensor
    v_cache: Tensor
    batch: PagedBatch
    ks: list[Tensor]
    vs: list[Tensor]
    q_lens: list[int]

    def run(self, **options: object) -> Tensor:
        """`paged_attention` of the batch (`options`: its keywords)."""
        args = (self.q, self.k_cache, self.v_cache, self.batch, self.q.shape[-1] ** -0.5)
        out = paged_attention(*args, **options)
        assert out.dtype == self.q.dtype and out.shape == self.q.shape
        return out

    def naive(self, **options: object) -> Tensor:
        return naive_attention(self.q, self.ks, self.vs, self.q_lens, **options)

    def freed(self, window: int) -> Case:
        """A copy with the blocks the window has passed freed (`free_outside_window`)."""
        k_cache, v_cache = self.k_cache.clone(), self.v_cache.clone()
        table, lens = self.batch.block_tables.clone(), self.batch.seq_lens.tolist()
        assert free_outside_window(
            k_cache, v_cache, table, lens, self.q_lens, window, placeholder=GARBAGE_BLOCK
        )
        batch = replace(self.batch, block_tables=table)
        return replace(self, k_cache=k_cache, v_cache=v_cache, batch=batch)


def make_case(
    specs: list[tuple[int, int]],
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int = 16,
    dtype: torch.dtype = torch.float32,
    num_blocks: int = 0,
    seed: int = 0,
) -> Case:
    """A paged batch of `(q_len, context_len)` sequences.

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
    return Case(q, k_cache, v_cache, batch, ks, vs, q_lens)


def run_case(*args: object, **kwargs: object) -> tuple[Tensor, Tensor]:
    """`make_case(*args, **kwargs)`'s (paged, naive) outputs."""
    case = make_case(*args, **kwargs)  # type: ignore[arg-type]
    return case.run(), case.naive()


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


# --- sliding window and soft cap -------------------------------------------------------------

# prefill, chunked prefill (queries from mid-sequence), decode rows: lengths below, at and past
# the windows tested and the block boundaries
WINDOWED = [(37, 0), (5, 20), (1, 40), (1, 1), (12, 3), (1, 17), (3, 0), (9, 60), (1, 16)]
LONG = [(300, 0), (1, 5), (40, 270), (1, 290)]  # prompts of two query chunks, long decodes


@pytest.mark.parametrize("invariant", [False, True])
@pytest.mark.parametrize("window", [1, 5, 16, 17, 40, 61, 1000])
def test_window_matches_a_loop_over_each_querys_window(window: int, invariant: bool) -> None:
    """Windows of one key, below, at and past a block (16), past every sequence; GQA."""
    case = make_case(WINDOWED, 16, num_heads=6, num_kv_heads=2, seed=window)
    got = case.run(window=window, batch_invariant=invariant)
    want = looped_attention(case.q, case.ks, case.vs, case.q_lens, window=window)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(case.naive(window=window), want, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("invariant", [False, True])
@pytest.mark.parametrize(("block_size", "window"), [(1, 7), (32, 100), (16, 129), (16, 260)])
def test_window_over_long_prompts_and_other_block_sizes(
    block_size: int, window: int, invariant: bool
) -> None:
    """Prompts of more than one query chunk (each chunk's keys start at its own first row's
    window), windows across the batch-invariant op's 128-key tiles."""
    case = make_case(LONG, block_size, num_heads=3, num_kv_heads=1, head_dim=8, seed=block_size)
    got = case.run(window=window, batch_invariant=invariant)
    torch.testing.assert_close(got.double(), case.naive(window=window), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("invariant", [False, True])
@pytest.mark.parametrize(("softcap", "window"), [(1.0, None), (30.0, None), (2.5, 9)])
def test_softcap_matches_the_formula(softcap: float, window: int | None, invariant: bool) -> None:
    """`softcap * tanh(scores / softcap)` of the scaled scores, then the masks: a cap below the
    scores' spread (most scores capped), one above it (almost none)."""
    case = make_case(WINDOWED, 16, num_heads=6, num_kv_heads=2, seed=3)
    got = case.run(softcap=softcap, window=window, batch_invariant=invariant)
    want = looped_attention(case.q, case.ks, case.vs, case.q_lens, window, softcap)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    uncapped = looped_attention(case.q, case.ks, case.vs, case.q_lens, window)
    assert softcap > 10 or not torch.allclose(want, uncapped, atol=1e-2)  # the cap matters


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float16, 2e-3), (torch.bfloat16, 1.6e-2)])
@pytest.mark.parametrize("invariant", [False, True])
def test_window_and_softcap_in_half_precision(
    dtype: torch.dtype, tol: float, invariant: bool
) -> None:
    case = make_case(WINDOWED, 16, num_heads=14, num_kv_heads=2, dtype=dtype, seed=4)
    got = case.run(window=13, softcap=4.0, batch_invariant=invariant)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), case.naive(window=13, softcap=4.0), atol=tol, rtol=tol)


@pytest.mark.parametrize("invariant", [False, True])
@pytest.mark.parametrize(("specs", "window"), [(WINDOWED, 5), (WINDOWED, 17), (LONG, 50)])
def test_blocks_the_window_has_passed_are_never_read(
    specs: list[tuple[int, int]], window: int, invariant: bool
) -> None:
    """The engine frees a sequence's blocks once its window has passed them: filled with NaN
    (reused), their table entries out of range, 0 or stale, the output is the same bits."""
    case = make_case(specs, 16, num_heads=6, num_kv_heads=2, seed=window)
    for softcap in (None, 3.0):
        options = dict(window=window, softcap=softcap, batch_invariant=invariant)
        clean = case.run(**options)
        freed = case.freed(window).run(**options)
        assert torch.isfinite(freed).all()
        assert torch.equal(freed, clean)


@pytest.mark.parametrize("invariant", [False, True])
def test_a_window_past_every_sequence_is_full_attention(invariant: bool) -> None:
    case = make_case(WINDOWED + LONG, 16, num_heads=6, num_kv_heads=2, seed=5)
    for softcap in (None, 2.0):
        full = case.run(softcap=softcap, batch_invariant=invariant)
        assert torch.equal(case.run(window=400, softcap=softcap, batch_invariant=invariant), full)


@pytest.mark.parametrize("invariant", [False, True])
def test_layers_of_different_windows_share_one_plan_cache(invariant: bool) -> None:
    """A forward pass of local and global layers (Gemma 2, 3) passes one plan cache to all of
    them: each window gets its own plan."""
    case = make_case(WINDOWED, 16, num_heads=6, num_kv_heads=2, seed=6)
    plan_cache: dict = {}
    for window in (None, 16, 7, None, 16):
        shared = case.run(window=window, plan_cache=plan_cache, batch_invariant=invariant)
        assert torch.equal(shared, case.run(window=window, batch_invariant=invariant)), window
    assert len(plan_cache) == 3


@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("window", [50, 130])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_windowed_row_has_the_same_bits_alone_chunked_or_decoded(
    dtype: torch.dtype, window: int, softcap: float | None
) -> None:
    """The batch-invariant op with a window: a row's bits are those of its own sequence,
    whatever its query chunk starts at (its group's keys start at another 128-key tile of the
    grid), whatever runs beside it, prefill or decode."""
    gen = torch.Generator().manual_seed(window)
    k_cache = torch.randn(64, 16, 2, 32, generator=gen).to(dtype)
    v_cache = torch.randn(64, 16, 2, 32, generator=gen).to(dtype)
    tables = torch.randperm(64, generator=gen)[:60].view(3, 20).int()
    q = torch.randn(3, 300, 6, 32, generator=gen).to(dtype)

    def run(parts: list[tuple[int, int, int]]) -> Tensor:
        """`(sequence, first row, last row + 1)` parts, each over keys up to its last row."""
        qs = torch.cat([q[s, a:b] for s, a, b in parts])
        q_lens = [b - a for _, a, b in parts]
        cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        lens = torch.tensor([b for _, _, b in parts], dtype=torch.int32)
        batch = PagedBatch(tables[[s for s, _, _ in parts]], lens, cu, max(q_lens), 300)
        return paged_attention(
            qs, k_cache, v_cache, batch, 32**-0.5, batch_invariant=True, window=window,
            softcap=softcap,
        )  # fmt: skip

    whole = run([(0, 0, 300)])  # a 300-token prefill alone: two query chunks
    assert torch.equal(run([(1, 0, 30), (0, 140, 300)])[30:], whole[140:])
    assert torch.equal(run([(0, 200, 213), (2, 0, 5), (0, 0, 3)])[:13], whole[200:213])
    for p in (0, 127, 128 + window, 200, 299):  # a decode row alone and among others
        alone = run([(0, p, p + 1)])
        assert torch.equal(alone, whole[p : p + 1]), p
        assert torch.equal(run([(1, 120, 121), (0, p, p + 1), (2, 6, 7)])[1:2], alone), p


@pytest.mark.parametrize("invariant", [False, True])
def test_window_and_softcap_must_be_positive(invariant: bool) -> None:
    case = make_case([(3, 4)], 16, num_heads=2, num_kv_heads=1)
    for bad in (dict(window=0), dict(window=-3), dict(window=2.5), dict(softcap=0.0)):
        with pytest.raises(ValueError, match=r"^(window|softcap) must be"):
            case.run(batch_invariant=invariant, **bad)

"""Temperature sampling by inverse CDF in two Triton launches, reading the logits once.

Same contract as `kernels.reference.sample_temperature`: row r's token is where the CDF of
`softmax(logits[r] / temperature)`, in vocabulary order, passes `u[r]` times its total; never a
token of zero probability. PyTorch needs ~15 kernels for this (a softmax written out in float32,
block sums, scans, gathers): on a 256 x 152k batch that is ~0.7 ms of an H200 per step, more than
a quarter of a decode step. Here:

1. `_chunk_stats`, grid (rows, chunks): each program reads `CHUNK` logits of one row and stores
   their maximum and `sum(exp(x - max))` (a softmax partial; exp in float32, summed in float64).
2. `_pick`, grid (rows,): combines the partials into each chunk's probability mass in float64,
   scans them to find the chunk where the CDF passes the target, then scans that chunk's terms
   (recomputed from the logits exactly as pass 1 computed them, accumulated in float64).

The float64 accumulation matters: in float32 a token deep in a flat 152k vocabulary would be
chosen depending on the summation order. Tokens can differ from the reference only where `u`
falls within rounding of a CDF step (the reference sums in another order): vanishingly rare.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

CHUNK = 1024  # vocabulary entries per program of the first pass (and per scan of the second)


@triton.jit
def _chunk_stats(
    logits_ptr, max_ptr, sum_ptr, stride_r, vocab, temperature, num_chunks,
    CHUNK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(logits_ptr + row * stride_r + cols, mask=cols < vocab, other=float("-inf"))
    x = x.to(tl.float32) / temperature
    m = tl.max(x, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)  # a chunk of -inf logits has no mass
    s = tl.sum(tl.exp(x - m_safe).to(tl.float64), 0)
    tl.store(max_ptr + row * num_chunks + chunk, m)
    tl.store(sum_ptr + row * num_chunks + chunk, s)


@triton.jit
def _pick(
    logits_ptr, max_ptr, sum_ptr, u_ptr, out_ptr, stride_r, vocab, temperature, num_chunks,
    CHUNK: tl.constexpr, CHUNKS_PAD: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    ci = tl.arange(0, CHUNKS_PAD)
    c_ok = ci < num_chunks
    m = tl.load(max_ptr + row * num_chunks + ci, mask=c_ok, other=float("-inf"))
    s = tl.load(sum_ptr + row * num_chunks + ci, mask=c_ok, other=0.0)
    row_max = tl.max(m, 0)
    live = m > float("-inf")
    scale = tl.exp(tl.where(live, m - row_max, 0.0)).to(tl.float64)  # chunk max -> row max
    mass = tl.where(live, s * scale, 0.0)
    csum = tl.cumsum(mass, 0)
    total = tl.sum(mass, 0)
    target = tl.load(u_ptr + row).to(tl.float64) * total
    # The chunk where the CDF passes the target: the number of chunks whose end lies at or
    # below it (a target equal to the total, u ~ 1 after rounding, stays in the last chunk).
    chosen = tl.minimum(tl.sum((csum <= target).to(tl.int32), 0), num_chunks - 1)
    before = tl.sum(tl.where(ci < chosen, mass, 0.0), 0)
    k = tl.arange(0, CHUNK)
    cols = chosen * CHUNK + k
    x = tl.load(logits_ptr + row * stride_r + cols, mask=cols < vocab, other=float("-inf"))
    # The chunk's terms exactly as `_chunk_stats` summed them, so its scan ends at its mass.
    chunk_max = tl.sum(tl.where(ci == chosen, m, 0.0), 0)
    chunk_scale = tl.sum(tl.where(ci == chosen, scale, 0.0), 0)
    p = tl.exp(x.to(tl.float32) / temperature - chunk_max)  # -inf -> 0
    inner = tl.cumsum(p.to(tl.float64), 0) * chunk_scale + before
    idx = tl.sum((inner <= target).to(tl.int32), 0)
    # Rounding (the chunk sums and `before` are summed in other orders than `inner`) can leave
    # the target past the chunk's last partial sum, or before its first: then take its last,
    # or first, token of nonzero probability (its mass is positive, so one exists).
    last_nonzero = tl.max(tl.where(p > 0, k, -1), 0)
    first_nonzero = tl.min(tl.where(p > 0, k, CHUNK), 0)
    p_idx = tl.sum(tl.where(k == idx, p, 0.0), 0)
    idx = tl.where(idx >= CHUNK, last_nonzero, tl.where(p_idx > 0, idx, first_nonzero))
    # A row without mass (all -inf, or NaN) has no token to pick: it still gets an id inside
    # the vocabulary, never one that would index past the embedding.
    token = tl.minimum(tl.maximum(chosen * CHUNK + idx, 0), vocab - 1)
    tl.store(out_ptr + row, token.to(tl.int64))


def sample_temperature(logits: Tensor, temperature: float, u: Tensor) -> Tensor:
    """Token ids (int64, on the logits' device) sampled from `softmax(logits / temperature)`
    by inverse CDF at the uniforms `u` (one per row); no host synchronisation."""
    assert logits.dim() == 2 and u.shape == (logits.shape[0],) and temperature > 0
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    num_chunks = triton.cdiv(vocab, CHUNK)
    maxes = torch.empty(rows, num_chunks, dtype=torch.float32, device=logits.device)
    sums = torch.empty(rows, num_chunks, dtype=torch.float64, device=logits.device)
    t = float(temperature)
    _chunk_stats[(rows, num_chunks)](
        logits, maxes, sums, logits.stride(0), vocab, t, num_chunks, CHUNK=CHUNK, num_warps=4
    )
    _pick[(rows,)](
        logits, maxes, sums, u.to(torch.float32).contiguous(), out, logits.stride(0), vocab, t,
        num_chunks, CHUNK=CHUNK, CHUNKS_PAD=triton.next_power_of_2(num_chunks), num_warps=8,
    )  # fmt: skip
    return out


_PENALTY_BLOCK = 2048  # vocabulary entries a program penalizes


def apply_penalties(
    logits: Tensor,
    rows: Tensor,
    pool: Tensor,
    counts: Tensor,
    prompt: Tensor,
    repetition: Tensor,
    frequency: Tensor,
    presence: Tensor,
) -> None:
    """`kernels.reference.apply_penalties` in one pass over the rows' logits, counts and prompt
    masks (each element read once, the logit written once)."""
    n, vocab = rows.shape[0], logits.shape[1]
    if not n:
        return
    grid = (n, triton.cdiv(vocab, _PENALTY_BLOCK))
    _penalize[grid](
        logits, rows, pool, counts, prompt.view(torch.uint8), repetition, frequency, presence,
        logits.stride(0), counts.stride(0), prompt.stride(0), vocab, BLOCK=_PENALTY_BLOCK,
    )  # fmt: skip


@triton.jit
def _penalize(
    x_ptr, rows_ptr, pool_ptr, c_ptr, p_ptr, rep_ptr, freq_ptr, pres_ptr,
    stride_x, stride_c, stride_p, vocab, BLOCK: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < vocab
    row = tl.load(rows_ptr + i).to(tl.int64)
    slot = tl.load(pool_ptr + i).to(tl.int64)
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    c = tl.load(c_ptr + slot * stride_c + cols, mask=ok, other=0)
    seen = (c > 0) | (tl.load(p_ptr + slot * stride_p + cols, mask=ok, other=0) != 0)
    rep = tl.load(rep_ptr + i)
    x = tl.where(seen, tl.where(x > 0, x / rep, x * rep), x)
    x = (
        x
        - tl.load(freq_ptr + i) * c.to(tl.float32)
        - tl.load(pres_ptr + i) * (c > 0).to(tl.float32)
    )
    tl.store(x_ptr + row * stride_x + cols, x, mask=ok)

"""Pure-PyTorch reference ops: the contract the Triton kernels follow, and the CPU path.

KV cache per layer: `k_cache` and `v_cache`, each `[num_blocks, block_size, num_kv_heads, head_dim]`
(views are fine). Block ids are int32 in tables and int64 in address arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .paged_batch import PagedBatch

Q_CHUNK = 256  # query rows per score matrix: bounds memory at num_heads * Q_CHUNK * seq_len floats


def write_kv(
    key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor
) -> None:
    """Store each new token's K/V row at its slot (`block_id * block_size + offset`).

    Args:
        key, value: `[num_tokens, num_kv_heads, head_dim]`.
        k_cache, v_cache: `[num_blocks, block_size, num_kv_heads, head_dim]`, written in place.
        slot_mapping: int64 `[num_tokens]`; a slot < 0 is padding and is skipped.
    """
    slots = slot_mapping.to(torch.int64)
    keep = slots >= 0
    if not bool(keep.all()):
        slots, key, value = slots[keep], key[keep], value[keep]
    if k_cache.is_contiguous() and v_cache.is_contiguous():
        k_cache.flatten(0, 1).index_copy_(0, slots, key.to(k_cache.dtype))
        v_cache.flatten(0, 1).index_copy_(0, slots, value.to(v_cache.dtype))
        return
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = key.to(k_cache.dtype)
    v_cache[blocks, offsets] = value.to(v_cache.dtype)


def paged_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    batch: PagedBatch,
    softmax_scale: float,
    *,
    plan_cache: dict | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> Tensor:
    """Causal attention of a flat varlen batch of queries over a paged KV cache.

    Decode rows (`q_len == 1`) are batched together; other sequences go one at a time, `Q_CHUNK`
    query rows at a time. Softmax and accumulation are in float32.

    Scores are `s = (q . k) * softmax_scale`; with `softcap`, `s = softcap * tanh(s / softcap)`
    (Gemma 2); then the causal (and window) mask and the softmax, as Hugging Face's eager
    attention orders them.

    With `window`, a query at position `p` attends to keys at positions `k` with
    `p - window < k <= p` (the `window` most recent, its own included: Hugging Face's sliding
    window). A sequence's cache blocks whose positions all lie at or below `p0 - window`, `p0`
    its first query's position in this call, are never read and cannot touch the result: the
    engine frees such blocks and may hand them to other sequences, their table entries left
    holding stale ids (or 0).

    Args:
        q: `[num_tokens, num_heads, head_dim]`; `num_heads % num_kv_heads == 0` (GQA).
        k_cache, v_cache: `[num_blocks, block_size, num_kv_heads, head_dim]`.
        batch: the sequences of `q`'s rows and their block tables (`PagedBatch`: what each row
            attends to); its two maxima are unused here.
        softmax_scale: multiplier of `q @ k^T`, usually `head_dim ** -0.5`.
        plan_cache: a dict that lives for one step (one forward pass), shared by its layers: the
            gather indices and masks, the same for every layer of one window, are computed once
            and kept there (keyed by block size and window).
        window: sliding-window length in positions (>= 1), or None for full causal attention.
        softcap: logit soft-capping value (> 0), or None for none.

    Returns:
        `[num_tokens, num_heads, head_dim]` in `q`'s dtype.
    """
    assert q.shape[1] % k_cache.shape[2] == 0, "num_heads must be a multiple of num_kv_heads"
    check_options(window, softcap)
    key = ("paged_attention", k_cache.shape[1], window)
    plan = None if plan_cache is None else plan_cache.get(key)
    if plan is None:
        tables, lens, cu = batch.block_tables, batch.seq_lens, batch.cu_seqlens_q
        plan = _plan(tables, lens, cu, k_cache.shape[1], window)
        if plan_cache is not None:
            plan_cache[key] = plan
    out = torch.empty_like(q)
    if plan.empty_rows is not None:
        out[plan.empty_rows] = 0
    k_flat, v_flat = k_cache.flatten(0, 1), v_cache.flatten(0, 1)
    for g in plan.groups:
        shape = (*g.shape, *k_cache.shape[2:])
        # index_select on the flattened cache is far faster than 2-D advanced indexing on the CPU.
        k = k_flat.index_select(0, g.slots).view(shape).transpose(1, 2)  # [S, Hkv, L, D]
        v = v_flat.index_select(0, g.slots).view(shape).transpose(1, 2)
        rows = q[g.q_rows].unsqueeze(1 if g.decode else 0)  # [S, Q, H, D]
        if softcap is None:
            o = F.scaled_dot_product_attention(
                rows.float().transpose(1, 2),
                k.float(),
                v.float(),
                attn_mask=g.mask,
                scale=softmax_scale,
                enable_gqa=True,
            ).transpose(1, 2)
        else:
            o = _capped(rows.float(), k.float(), v.float(), g.mask, softmax_scale, softcap)
        out[g.q_rows] = (o[:, 0] if g.decode else o[0]).to(q.dtype)
    return out


def check_options(window: int | None, softcap: float | None) -> None:
    """Raise ValueError unless `window` is None or a positive int and `softcap` None or > 0."""
    if window is not None and (isinstance(window, bool) or int(window) != window or window < 1):
        raise ValueError(f"window must be None or an integer >= 1, not {window!r}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be None or > 0, not {softcap!r}")


def _capped(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float, softcap: float) -> Tensor:
    """SDPA with soft-capped scores, in float32: q `[S, Q, H, D]`, k/v `[S, Hkv, L, D]`, mask
    bool `[S, 1, Q, L]` -> `[S, Q, H, D]`. Masked positions get probability 0 exactly (their
    values are finite: the gather reads only slots the sequence wrote and may read)."""
    num_seqs, q_len, num_heads, head_dim = q.shape
    num_kv_heads, kv_len = k.shape[1], k.shape[2]
    group = num_heads // num_kv_heads
    # query head h reads KV head h // group: [S, Hkv, group * Q, D], rows (head in group, query)
    qg = q.permute(0, 2, 1, 3).reshape(num_seqs, num_kv_heads, group * q_len, head_dim)
    scores = torch.matmul(qg, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.view(num_seqs, num_kv_heads, group, q_len, kv_len)
    scores = scores.masked_fill(~mask[:, :, None], float("-inf"))
    probs = scores.softmax(-1).view(num_seqs, num_kv_heads, group * q_len, kv_len)
    o = torch.matmul(probs, v).view(num_seqs, num_heads, q_len, head_dim)
    return o.transpose(1, 2)


@dataclass
class _Group:
    """One fused attention call: sequences with the same query length and their gathered KV.

    Attributes:
        q_rows: rows of `q` (and of the output) it computes: a tensor of indices for a decode
            group, a slice for one prefill chunk.
        slots: int64 `[S * L]`, the cache slot of each gathered position (a sequence's `L`
            positions start at the first key its first query sees).
        shape: `(S, L)`.
        mask: bool `[S, 1, Q, L]`, causal (and the window), hiding positions past each
            sequence's length.
        decode: one query per sequence (the rows are stacked as sequences).
    """

    q_rows: Tensor | slice
    slots: Tensor
    shape: tuple[int, int]
    mask: Tensor
    decode: bool


@dataclass
class _Plan:
    empty_rows: Tensor | None
    groups: list[_Group]


def _plan(
    block_tables: Tensor,
    seq_lens: Tensor,
    cu_seqlens_q: Tensor,
    block_size: int,
    window: int | None,
) -> _Plan:
    """What to gather and mask for a step: the same for every layer of one window, so computed
    once a step when the caller passes a `plan_cache`."""
    starts = cu_seqlens_q[:-1].to(torch.int64)
    q_lens = cu_seqlens_q[1:].to(torch.int64) - starts
    empty = (q_lens == 1) & (seq_lens <= 0)  # padding rows of a decode graph: attend to nothing
    groups = []
    decode = ((q_lens == 1) & ~empty).nonzero().flatten()
    if decode.numel() > 0:
        tables, lens = block_tables[decode], seq_lens[decode]
        groups.append(_group(starts[decode], tables, lens, 1, True, block_size, window))
    for i in (q_lens > 1).nonzero().flatten().tolist():
        start, end, seq_len = int(starts[i]), int(cu_seqlens_q[i + 1]), int(seq_lens[i])
        for lo in range(start, end, Q_CHUNK):
            hi = min(lo + Q_CHUNK, end)
            visible = seq_lens.new_tensor([seq_len - (end - hi)])  # keys of the chunk's last row
            table = block_tables[i : i + 1]
            chunk = _group(slice(lo, hi), table, visible, hi - lo, False, block_size, window)
            groups.append(chunk)
    return _Plan(starts[empty] if bool(empty.any()) else None, groups)


def _group(
    q_rows,
    block_tables: Tensor,
    seq_lens: Tensor,
    q_len: int,
    decode: bool,
    block_size: int,
    window: int | None,
) -> _Group:
    """Each sequence's keys from the first its first query sees (0, or with a window
    `first query position - window + 1`) to its end. Positions past a sequence's end read its own
    last slot: the mask hides them, and reading only slots the sequence has written (and, with a
    window, may still read) keeps stale data of other sequences (even NaN, where 0 * NaN would
    leak through the mask) out, and table padding and freed blocks' entries unread."""
    seq_lens = seq_lens.to(torch.int64)
    device = seq_lens.device
    q_pos = seq_lens[:, None] - q_len + torch.arange(q_len, device=device)  # [S, Q]
    if window is None:
        lo = torch.zeros_like(seq_lens)
    else:
        lo = (seq_lens - q_len - window + 1).clamp_(min=0)  # first key the first query sees
    kv_len = int((seq_lens - lo).max())
    keys = lo[:, None] + torch.arange(kv_len, device=device)[None, :]  # [S, L] positions
    pos = torch.minimum(keys, seq_lens[:, None] - 1)
    slots = block_tables.to(torch.int64).gather(1, pos // block_size) * block_size
    slots = (slots + pos % block_size).flatten()
    mask = keys[:, None, :] <= q_pos[:, :, None]  # [S, Q, L]
    if window is not None:
        mask &= keys[:, None, :] > q_pos[:, :, None] - window
    return _Group(q_rows, slots, tuple(pos.shape), mask[:, None], decode)


def rms_norm(
    x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None
) -> Tensor | tuple[Tensor, Tensor]:
    """RMSNorm over the last axis in float32, as Hugging Face computes it; optional residual add.

    Without `residual`: `weight * (xf * rsqrt(mean(xf^2) + eps)).to(x.dtype)` with `xf = x.float()`.
    With `residual`: `s = x + residual` (rounded to `x.dtype`), returns `(rms_norm(s), s)`, the
    normalised input of the next sublayer and the updated residual stream.

    Args:
        x: `[T, H]` or `[T, heads, H]` (Qwen3's per-head q/k norm), last axis contiguous.
        weight: `[H]`.
        eps: added to the mean square.
        residual: same shape and dtype as a 2-D `x`, or None.

    Returns:
        The normalised tensor in `result_type(weight, x)` (and `s` in `x.dtype` with a residual).
    """
    if residual is not None:
        s = x + residual
        return rms_norm(s, weight, eps), s
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rotary(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, positions: Tensor) -> None:
    """Neox-style rotary embedding (rotate the two halves of each head), in place on q and k.

    Computed in the tensors' dtype: each product and sum rounded as PyTorch rounds it.

    Args:
        q: `[T, Hq, D]`, k: `[T, Hk, D]`; views with a contiguous last axis (e.g. slices of a
            fused qkv projection), rotated in place.
        cos, sin: the model's tables `[max_positions, D // 2]`, in q's dtype.
        positions: int64 `[T]`, each token's position (row of the tables).
    """
    cos_t, sin_t = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    for x in (q, k):
        x1, x2 = x.chunk(2, dim=-1)
        x.copy_(torch.cat((x1 * cos_t - x2 * sin_t, x2 * cos_t + x1 * sin_t), dim=-1))


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
) -> None:
    """`rotary` of q and k in place, then `write_kv` of the rotated k and of v: what a decoder
    layer does with a step's new K/V before attention (the Triton op does both in one launch)."""
    rotary(q, k, cos, sin, positions)
    write_kv(k, v, k_cache, v_cache, slot_mapping)


def silu_and_mul(x: Tensor) -> Tensor:
    """SwiGLU activation of a fused gate/up projection: `[T, 2I]` -> `silu(x[:, :I]) * x[:, I:]`.

    Computed in `x.dtype` (`silu` rounded, then the product rounded), as `F.silu(gate) * up`.
    """
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def sample_temperature(logits: Tensor, temperature: float, u: Tensor) -> Tensor:
    """Token ids sampled from `softmax(logits / temperature)` by inverse CDF at uniforms `u`.

    Row r's token is the first (in vocabulary order) where the CDF, accumulated in float64,
    exceeds `u[r]` times the row's total; never a token of zero probability.
    """
    probs = torch.softmax(logits.float() / temperature, dim=-1).double()
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    target = torch.minimum(u[:, None].double() * total, torch.nextafter(total, total.new_zeros(())))
    return torch.searchsorted(cdf, target, right=True).squeeze(1)


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
    """In place on float32 `logits` `[R, V]`: row `rows[i]` penalized by pool row `pool[i]` of
    `counts` (int32 `[pool, V]`, the output's token counts) and `prompt` (bool `[pool, V]`):
    where the prompt or the output holds a token, a positive logit is divided by
    `repetition[i]` and a negative one multiplied by it; then `frequency[i] * count` and
    `presence[i] * (count > 0)` are subtracted (vLLM's rule)."""
    c = counts.index_select(0, pool)
    held = c > 0
    seen = held | prompt.index_select(0, pool)
    x = logits.index_select(0, rows)
    rep = repetition[:, None]
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    x = x - frequency[:, None] * c - presence[:, None] * held
    logits.index_copy_(0, rows, x)

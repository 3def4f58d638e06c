"""Split-KV (flash-decoding) pieces of the Triton paged attention: how many splits a decode batch
gets, the arrival counters of the fused combine, and the merge of the splits' partial softmax
states (each split program stores its running max, its row sums and its output normalised by
them; the merge weights the outputs by their sums rescaled to a common max and divides once).
Used by `kernels.triton_attention`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

MAX_SPLITS = 32  # upper bound of KV splits per sequence
PROGRAMS_PER_SM = 3  # a decode grid fills the SMs up to this many programs each
MIN_TILES_PER_SPLIT = 4  # once programs outnumber SMs, a split streams at least this many tiles
# The merge folds the splits in order, this many partial rows a pass, unrolled so that a pass's
# loads issue together: 16-row decode partials go 16 splits a pass (a 32-split merge unrolled
# whole took ~7 s to compile for sm_90; 8 a pass cost 1-2 us a call at batch 1 on the H200),
# 128-row prefill partials 2 a pass (more spill).
MERGE_UNROLL_ROWS = tl.constexpr(256)


@triton.jit
def _merge_one(
    m_run, total, acc, m_ws_ptr, l_ws_ptr, acc_ws_ptr, at, s, active, row_ok,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    """Fold split `s`'s partial (rows `at ...` of the workspace: running max, row sum and the
    normalised output; nothing if `s >= active`) into a running (max, sum, sum-weighted output)."""
    rows = at + tl.arange(0, BLOCK_M)
    d = tl.arange(0, D_PAD)
    live_rows = (tl.full([BLOCK_M], s, tl.int32) < active) & row_ok
    m_s = tl.load(m_ws_ptr + rows, mask=live_rows, other=float("-inf"), cache_modifier=".cg")
    l_s = tl.load(l_ws_ptr + rows, mask=live_rows, other=0.0, cache_modifier=".cg")
    part_ok = live_rows[:, None] & (d < HEAD_DIM)[None, :]
    part_at = acc_ws_ptr + rows[:, None] * HEAD_DIM + d[None, :]
    part = tl.load(part_at, mask=part_ok, other=0.0, cache_modifier=".cg").to(tl.float32)
    m_new = tl.maximum(m_run, m_s)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    w_run = tl.exp2(m_run - m_safe)
    w_s = tl.exp2(m_s - m_safe) * l_s
    return m_new, total * w_run + w_s, acc * w_run[:, None] + part * w_s[:, None]


@triton.jit
def _merge_splits(
    out_ptr, acc_ws_ptr, m_ws_ptr, l_ws_ptr, pid, kvh, num_kv_heads, q_begin, qb_start, q_len,
    active, stride_ot, stride_oh, stride_od,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, NUM_SPLITS: tl.constexpr,
):  # fmt: skip
    """Merge the first `active` splits' partial softmax states of one (query-block program, KV
    head) and store its output rows (tokens `qb_start ...` of the sequence). Partials are read
    at L2 (`.cg`): in the fused path other programs wrote them during this launch."""
    rows = tl.arange(0, BLOCK_M)
    d = tl.arange(0, D_PAD)
    tok = qb_start + rows // GROUP
    head = kvh * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (tok < q_len)
    base = (pid.to(tl.int64) * num_kv_heads + kvh) * NUM_SPLITS * BLOCK_M
    m_run = tl.full([BLOCK_M], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    UNROLL: tl.constexpr = max(1, min(NUM_SPLITS, MERGE_UNROLL_ROWS // BLOCK_M))
    for s0 in range(0, active, UNROLL):
        for i in tl.static_range(UNROLL):
            m_run, total, acc = _merge_one(
                m_run, total, acc, m_ws_ptr, l_ws_ptr, acc_ws_ptr, base + (s0 + i) * BLOCK_M,
                s0 + i, active, row_ok, HEAD_DIM, D_PAD, BLOCK_M,
            )  # fmt: skip
    out = acc / tl.where(total == 0.0, 1.0, total)[:, None]
    o_rows = (q_begin + tok).to(tl.int64)
    o_off = o_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :] * stride_od
    mask = row_ok[:, None] & (d < HEAD_DIM)[None, :]
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=mask)


_COUNTERS: dict[torch.device, Tensor] = {}
_PINNED: list[Tensor] = []  # counter buffers a captured graph may point at: never freed


def _split_counters(device: torch.device, n: int) -> Tensor:
    """Zeroed int32 arrival counters, one per (sequence, KV head), for the fused combine.

    Each call leaves them zero again (the merging program resets its counter), so one buffer per
    device serves every call. It grows outside CUDA-graph capture only; a capture that needs
    more gets a fresh zeroed buffer of its own (the zero-fill is then part of the graph). A graph
    replays into whatever buffer it captured, so no buffer that may have been captured is ever
    freed: a freed one would be handed to other tensors while the graph still counts into it.
    """
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            own = torch.zeros(n, dtype=torch.int32, device=device)
            _PINNED.append(own)
            return own
        if buf is not None:
            _PINNED.append(buf)
        buf = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
        _COUNTERS[device] = buf
    return buf


def choose_num_splits(
    num_seqs: int, num_kv_heads: int, max_seqlen_k: int, num_sms: int, tile_n: int
) -> int:
    """KV splits per sequence for a decode batch (flash-decoding) of `tile_n`-position tiles.

    As many as fill the SMs with up to PROGRAMS_PER_SM (sequence, KV head, split) programs each,
    with no split shorter than one tile; and once the programs outnumber the SMs, none with fewer
    than MIN_TILES_PER_SPLIT tiles, since a split's fixed cost (its start, its partial, the
    merge) needs that much streaming behind it. On the H200 this picks, within 2%, the fastest
    forced count of every batch-1, 8 and 64 shape timed.

    Depends only on host integers (never on tensor values), so a CUDA graph captured for a batch
    bucket with the bucket's largest `max_seqlen_k` keeps one fixed grid.
    """
    pairs = max(1, num_seqs * num_kv_heads)
    tiles = -(-max_seqlen_k // tile_n)
    most = min(MAX_SPLITS, tiles, PROGRAMS_PER_SM * num_sms // pairs)
    return max(1, min(most, max(num_sms // pairs, tiles // MIN_TILES_PER_SPLIT)))

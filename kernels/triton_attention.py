"""Triton paged attention: one kernel for prefill, chunked prefill, prefix hits and decode.

A program handles `BLOCK_Q` query tokens of one sequence times all `GROUP` query heads of one KV
head (rows `m -> (token m // GROUP, head m % GROUP)`), so each K/V tile is loaded once per group.
It walks the sequence's KV positions `TILE_N` at a time through the block table (a tile may span
several cache blocks), with an online softmax in float32. Decode batches may split each
sequence's KV tiles over `NUM_SPLITS` programs, dealt round robin (flash-decoding); a small
combine kernel merges the partial results (or, with `AttentionConfig.fused_combine`, the last
split of each sequence and KV head to finish merges them in the same launch, counted by an
atomic counter). A program reads the block ids of its next tile while it computes the current
one, so its K/V loads never wait on the table within an iteration. A prefill query block reads
the tiles below its first query unmasked and masks only the diagonal ones after them.

A sliding window (`WINDOW`) starts a program's walk at the tile of the global `TILE_N` grid
that holds the first key its first query sees, and masks the tiles at the window's lower edge
(no position below that key is loaded: its block may be freed and reused); split-KV deals only
the tiles from there on. A soft cap (`SOFTCAP`) passes the scores through `tanh` (by `exp2`)
before the masks. Both are compile-time constants, 0 for off, which compiles the kernel as it
is without them. Same contract as `kernels.reference.paged_attention`.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .configs import AttentionConfig, lookup, lookup_invariant, pdl_capable, phase_of
from .paged_batch import PagedBatch
from .reference import check_options
from .triton_splits import _merge_splits, _split_counters, choose_num_splits

LOG2E = 1.4426950408889634
_LOG2E = tl.constexpr(LOG2E)


@triton.jit
def _tanh(x):
    """tanh from `exp2` (no libdevice call: the same on sm_75, newer GPUs and the
    interpreter): `sign(x) * (1 - e) / (1 + e)` with `e = exp(-2|x|)` in (0, 1], so nothing
    overflows; absolute error a few float32 ulps of 1."""
    e = tl.exp2(tl.abs(x) * (-2.0 * _LOG2E))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _find_seq(cu_q_ptr, qblock, num_seqs, BLOCK_Q: tl.constexpr):
    """Largest sequence index i whose first q-block (`cu_q[i] // BLOCK_Q + i`) is <= qblock."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(cu_q_ptr + mid) // BLOCK_Q + mid <= qblock:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _query_block(cu_q_ptr, pid, num_seqs, BLOCK_Q: tl.constexpr, ONE_QBLOCK: tl.constexpr):
    """(sequence, first query token) of query-block program `pid`. Sequence i's programs start
    at `cu_q[i] // BLOCK_Q + i`, enough for its query blocks; a program past the end of its
    sequence's queries returns at once."""
    if ONE_QBLOCK:
        seq = pid
        qb_start = 0
    else:
        seq = _find_seq(cu_q_ptr, pid, num_seqs, BLOCK_Q)
        qb_start = (pid - (tl.load(cu_q_ptr + seq) // BLOCK_Q + seq)) * BLOCK_Q
    return seq, qb_start


@triton.jit
def _tile(
    j, q, q_pos, limit, win_lo, m_i, l_acc, acc, blk_next, bt_row, bt_cols, k_head, v_head, d,
    d_ok, qk_scale, stride_kb, stride_ko, stride_kd, stride_vb, stride_vo, stride_vd,
    BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, DOT_PREC: tl.constexpr, MASKED: tl.constexpr,
    COLUMN_SUMS: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
):  # fmt: skip
    """One KV tile `j` (positions `j * TILE_N ...`, block ids `blk_next`) folded into the online
    softmax state (m_i, l_acc, acc); returns it with the block ids of this split's next tile.
    `MASKED=False` only for tiles every row sees whole (below `limit` and below every query,
    and with a window at or above every query's first key). With a window, masked tiles load
    nothing below `win_lo` (the first key the program's first query sees)."""
    pos = j * TILE_N + tl.arange(0, TILE_N)
    pos_ok = pos < limit
    if WINDOW > 0:
        pos_ok = pos_ok & (pos >= win_lo)
    blk = blk_next.to(tl.int64)
    # Masked by the table's width, not the sequence's length, so the load waits on nothing but
    # its address (the pipeliner peels the first iterations' into the prologue, where the length
    # may not have arrived yet); entries past the length only feed masked K/V loads.
    col_next = (pos + NUM_SPLITS * TILE_N) // BLOCK_SIZE
    blk_next = tl.load(bt_row + col_next, mask=col_next < bt_cols, other=0)
    off = pos % BLOCK_SIZE
    k_off = blk[None, :] * stride_kb + off[None, :] * stride_ko + d[:, None] * stride_kd
    v_off = blk[:, None] * stride_vb + off[:, None] * stride_vo + d[None, :] * stride_vd
    if MASKED:
        k = tl.load(k_head + k_off, mask=d_ok[:, None] & pos_ok[None, :], other=0.0)
    else:
        k = tl.load(k_head + k_off, mask=d_ok[:, None], other=0.0)
    if SOFTCAP > 0:  # qk_scale is softmax_scale / SOFTCAP: tanh's argument
        s = _tanh(tl.dot(q, k, input_precision=DOT_PREC) * qk_scale) * (SOFTCAP * _LOG2E)
    else:
        s = tl.dot(q, k, input_precision=DOT_PREC) * qk_scale  # log2 domain
    if not MASKED:
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every row sees the whole tile
        m_safe = m_new
    elif BLOCK_Q == 1:  # decode: exactly the keys in [win_lo, limit), its window
        s = tl.where(pos_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: a tile has a key in the window
        m_safe = m_new
    else:
        visible = (pos[None, :] <= q_pos[:, None]) & pos_ok[None, :]
        if WINDOW > 0:
            visible = visible & (pos[None, :] > q_pos[:, None] - WINDOW)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that saw no key yet
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    if COLUMN_SUMS:
        l_acc = l_acc * alpha[:, None] + p
    else:
        l_acc = l_acc * alpha[:, None] + tl.sum(p, 1, keep_dims=True)
    if MASKED:
        v = tl.load(v_head + v_off, mask=pos_ok[:, None] & d_ok[None, :], other=0.0)
    else:
        v = tl.load(v_head + v_off, mask=d_ok[None, :], other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return m_new, l_acc, acc, blk_next


@triton.jit
def _attn_fwd(
    q_ptr, k_ptr, v_ptr, out_ptr, bt_ptr, seq_lens_ptr, cu_q_ptr,
    acc_ws_ptr, m_ws_ptr, l_ws_ptr, counter_ptr,
    num_seqs, qk_scale,
    stride_qt, stride_qh, stride_qd, stride_ot, stride_oh, stride_od,
    stride_kb, stride_ko, stride_kh, stride_kd, stride_vb, stride_vo, stride_vh, stride_vd,
    stride_bt, bt_cols,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr, NUM_SPLITS: tl.constexpr, ONE_QBLOCK: tl.constexpr,
    DOT_PREC: tl.constexpr, FUSED_COMBINE: tl.constexpr, PDL: tl.constexpr,
    COLUMN_SUMS: tl.constexpr, WINDOW: tl.constexpr = 0, SOFTCAP: tl.constexpr = 0.0,
):  # fmt: skip
    """`WINDOW`: sliding-window length (0: none). `SOFTCAP`: logit soft cap (0: none); then
    `qk_scale` is `softmax_scale / SOFTCAP`, else `softmax_scale * log2(e)`."""
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq, qb_start = _query_block(cu_q_ptr, pid, num_seqs, BLOCK_Q, ONE_QBLOCK)
    # Tiles are dealt to splits round robin (split s takes tiles s, s + S, ...), so a program's
    # first tile is known before the sequence's length: its block ids load alongside the
    # lengths (the row's unused entries are in bounds and only ever feed masked K/V loads).
    # With a window the first tile is the window's, known once the length is (below).
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    if WINDOW == 0:
        first = (split * TILE_N + tl.arange(0, TILE_N)) // BLOCK_SIZE
        blk_next = tl.load(bt_row + first, mask=first < bt_cols, other=0)
    q_begin = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_begin
    seq_len = tl.load(seq_lens_ptr + seq)
    # (a one-block program's sequence without queries gets no keys below instead; the constexpr
    # test stays a branch of its own, so no runtime test is compiled for it)
    if not ONE_QBLOCK:  # noqa: SIM102
        if qb_start >= q_len:
            return
    context = seq_len - q_len
    if PDL:
        # A programmatic dependent launch starts while the kernel before it still runs. Only
        # the tables and lengths are read above: the kernels that write them finished before
        # that one (the engine's `rotary_write_kv`, which writes the new K/V rows) started. The
        # queries and the cache are read below, once it has finished and its writes are visible.
        gdc_wait()
    rows = tl.arange(0, BLOCK_M)
    tok = qb_start + rows // GROUP
    head = kvh * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (tok < q_len)
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    q_rows = (q_begin + tok).to(tl.int64)
    q_off = q_rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :] * stride_qd
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    q = q.to(k_ptr.dtype.element_ty)
    q_pos = context + tok
    limit = context + tl.minimum(qb_start + BLOCK_Q, q_len)  # keys [0, limit) are visible
    if ONE_QBLOCK:
        # No early return on the query length above: the compiler sinks the table, length and
        # query loads past such a branch, so each program would wait one more memory round trip
        # before its first K/V load. A sequence without queries sees no keys instead.
        limit = tl.where(q_len > 0, limit, 0)
    num_tiles = tl.cdiv(limit, TILE_N)
    # tiles [tile_lo, num_tiles) hold the keys any row sees; keys below win_lo are never read
    win_lo = 0
    tile_lo = 0
    if WINDOW > 0:
        win_lo = tl.maximum(context + qb_start - WINDOW + 1, 0)  # the first query's first key
        tile_lo = tl.minimum(win_lo // TILE_N, num_tiles)
        first = ((tile_lo + split) * TILE_N + tl.arange(0, TILE_N)) // BLOCK_SIZE
        blk_next = tl.load(bt_row + first, mask=first < bt_cols, other=0)
    if NUM_SPLITS > 1:
        if FUSED_COMBINE and num_tiles - tile_lo == 0 and split == 0:
            # A length-0 row (a decode graph's padding) has no split to merge: zeros, as the
            # combine kernel writes them.
            o_off = q_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :] * stride_od
            zero = tl.zeros([BLOCK_M, D_PAD], tl.float32).to(out_ptr.dtype.element_ty)
            tl.store(out_ptr + o_off, zero, mask=row_ok[:, None] & d_ok[None, :])
        if split >= num_tiles - tile_lo:
            return
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    # One-token query blocks (decode) keep their row sums per column and sum them once after
    # the loop (`COLUMN_SUMS`): a row's columns span every warp, so a sum per tile is a
    # shared-memory reduction and barrier each time (prefill's 128-row blocks would not keep
    # the registers). Batch-invariant calls sum per tile in decode too, as prefill rows do.
    if COLUMN_SUMS:
        l_acc = tl.zeros([BLOCK_M, TILE_N], tl.float32)
    else:
        l_acc = tl.zeros([BLOCK_M, 1], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    k_head = k_ptr + kvh * stride_kh
    v_head = v_ptr + kvh * stride_vh
    # The block ids of a program's next tile are read during its current one, so no K/V address
    # waits on the table inside an iteration (the pipeliner keeps K/V tiles in flight).
    # Two passes over one tile body: the tiles below the block's first query position, which
    # every row sees whole (no causal or length mask; prefill only), then the rest, masked.
    # Decode (one query token a program) has only the masked pass, from its split on. A window
    # adds a masked pass before them, over the tiles at its lower edge.
    full = tl.minimum((context + qb_start + 1) // TILE_N, num_tiles)
    if WINDOW == 0:
        for masked in tl.static_range(BLOCK_Q == 1, 2):
            lo = split
            hi = full
            if masked:
                hi = num_tiles
                if BLOCK_Q > 1:
                    # this split's first tile from `full` on (the block ids loaded last are its)
                    lo = full + (split - full % NUM_SPLITS + NUM_SPLITS) % NUM_SPLITS
            for j in range(lo, hi, NUM_SPLITS):
                m_i, l_acc, acc, blk_next = _tile(
                    j, q, q_pos, limit, win_lo, m_i, l_acc, acc, blk_next, bt_row, bt_cols,
                    k_head, v_head, d, d_ok, qk_scale, stride_kb, stride_ko, stride_kd,
                    stride_vb, stride_vo, stride_vd, BLOCK_SIZE, BLOCK_Q, TILE_N, NUM_SPLITS,
                    DOT_PREC, masked == 1, COLUMN_SUMS, WINDOW, SOFTCAP,
                )  # fmt: skip
    else:
        # Three passes in key order over this split's tiles (tile_lo + split, + S, ...): the
        # window's lower edge (masked), the tiles every row sees whole (from the first at or
        # above the last query's first key, `limit - WINDOW`, up to `full`), the diagonal
        # (masked). Decode has the one masked pass.
        whole = tl.minimum(tl.cdiv(tl.maximum(limit - WINDOW, 0), TILE_N), full)
        phase = (tile_lo + split) % NUM_SPLITS
        for part in tl.static_range(2 * (BLOCK_Q == 1), 3):
            if part == 0:
                lo = tile_lo
                hi = whole
            elif part == 1:
                lo = whole
                hi = full
            else:
                lo = tile_lo if BLOCK_Q == 1 else full
                hi = num_tiles
            # this split's first tile from `lo` on (the block ids loaded last are its)
            lo = lo + (phase - lo % NUM_SPLITS + NUM_SPLITS) % NUM_SPLITS
            for j in range(lo, hi, NUM_SPLITS):
                m_i, l_acc, acc, blk_next = _tile(
                    j, q, q_pos, limit, win_lo, m_i, l_acc, acc, blk_next, bt_row, bt_cols,
                    k_head, v_head, d, d_ok, qk_scale, stride_kb, stride_ko, stride_kd,
                    stride_vb, stride_vo, stride_vd, BLOCK_SIZE, BLOCK_Q, TILE_N, NUM_SPLITS,
                    DOT_PREC, part != 1, COLUMN_SUMS, WINDOW, SOFTCAP,
                )  # fmt: skip
    if PDL:
        gdc_launch_dependents()  # the next kernel may start its own prologue during the merge
    l_i = tl.sum(l_acc, 1)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # this program's output, normalised
    o_mask = row_ok[:, None] & d_ok[None, :]
    if NUM_SPLITS == 1:
        o_off = q_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :] * stride_od
        tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        # One partial per (query-block program, KV head, split): decode programs are sequences.
        # Its output rows are stored normalised, in the output's dtype (bounded by the values'
        # magnitude, so no overflow), and only the rows that are queries: a decode partial is
        # GROUP rows of the BLOCK_M the dots pad to.
        ws = ((pid.to(tl.int64) * tl.num_programs(1) + kvh) * NUM_SPLITS + split) * BLOCK_M
        tl.store(m_ws_ptr + ws + rows, m_i, mask=row_ok)
        tl.store(l_ws_ptr + ws + rows, l_i, mask=row_ok)
        part_off = (ws + rows)[:, None] * HEAD_DIM + d[None, :]
        tl.store(acc_ws_ptr + part_off, out.to(acc_ws_ptr.dtype.element_ty), mask=o_mask)
        if FUSED_COMBINE:
            # The last split of this (sequence, KV head) to finish merges all of them, so no
            # second launch: every thread's stores are issued (barrier), then one acq_rel atomic
            # at GPU scope publishes them and tells this program whether it came last.
            tl.debug_barrier()
            active = tl.minimum(num_tiles - tile_lo, NUM_SPLITS)
            counter = counter_ptr + pid * tl.num_programs(1) + kvh
            if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == active - 1:
                tl.store(counter, 0)  # ready for the next call (the next layer, the next step)
                _merge_splits(
                    out_ptr, acc_ws_ptr, m_ws_ptr, l_ws_ptr, pid, kvh, tl.num_programs(1),
                    q_begin, qb_start, q_len, active, stride_ot, stride_oh, stride_od,
                    GROUP, HEAD_DIM, D_PAD, BLOCK_Q, BLOCK_M, NUM_SPLITS,
                )  # fmt: skip


@triton.jit
def _combine_splits(
    out_ptr, seq_lens_ptr, cu_q_ptr, acc_ws_ptr, m_ws_ptr, l_ws_ptr, num_seqs,
    stride_ot, stride_oh, stride_od,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, ONE_QBLOCK: tl.constexpr, WINDOW: tl.constexpr = 0,
):  # fmt: skip
    pid = tl.program_id(0)  # the query-block program of `_attn_fwd` whose splits this merges
    kvh = tl.program_id(1)
    seq, qb_start = _query_block(cu_q_ptr, pid, num_seqs, BLOCK_Q, ONE_QBLOCK)
    q_begin = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_begin
    if qb_start >= q_len:
        return
    # The splits that had work, recomputed exactly as `_attn_fwd` chose them.
    # (a length-0 row, a decode graph's padding, has none and comes out as zeros)
    context = tl.load(seq_lens_ptr + seq) - q_len
    limit = context + tl.minimum(qb_start + BLOCK_Q, q_len)
    num_tiles = tl.cdiv(limit, TILE_N)
    if WINDOW > 0:  # the tiles from the window's first on
        num_tiles -= tl.minimum(tl.maximum(context + qb_start - WINDOW + 1, 0) // TILE_N, num_tiles)
    active = tl.minimum(num_tiles, NUM_SPLITS)
    _merge_splits(
        out_ptr, acc_ws_ptr, m_ws_ptr, l_ws_ptr, pid, kvh, tl.num_programs(1), q_begin,
        qb_start, q_len, active, stride_ot, stride_oh, stride_od, GROUP, HEAD_DIM, D_PAD,
        BLOCK_Q, BLOCK_M, NUM_SPLITS,
    )  # fmt: skip


@functools.cache
def _device_info(device: torch.device) -> tuple[tuple[int, int] | None, int]:
    """(compute capability, SM count) of a CUDA device; (None, 8) for the CPU interpreter."""
    if device.type != "cuda":
        return None, 8
    props = torch.cuda.get_device_properties(device)
    return (props.major, props.minor), props.multi_processor_count


def tile_shape(
    group: int, decode: bool, cfg: AttentionConfig, batch_invariant: bool = False
) -> tuple[int, int]:
    """(BLOCK_Q query tokens, BLOCK_M rows) of one program for a GQA group size. Batch-invariant
    decode programs take prefill's row count, so both run the same tile shape."""
    block_q = max(1, cfg.block_m // group)
    block_m = max(16, triton.next_power_of_2(block_q * group))
    if decode:
        return 1, block_m if batch_invariant else max(cfg.min_rows, triton.next_power_of_2(group))
    return block_q, block_m


def paged_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    batch: PagedBatch,
    softmax_scale: float,
    *,
    num_splits: int | None = None,
    config: AttentionConfig | None = None,
    batch_invariant: bool = False,
    window: int | None = None,
    softcap: float | None = None,
) -> Tensor:
    """Causal attention of a flat varlen batch over a paged KV cache (see the reference op,
    whose `window` and `softcap` these are: each a compile-time constant of the kernel).

    `batch.max_seqlen_q` picks the decode path and the grid; `batch.max_seqlen_k` only sizes
    the split count. `num_splits` forces the split count: of a decode batch
    (`max_seqlen_q <= 1`, else chosen by `choose_num_splits`) or of every query-block program
    of a prefill batch (else one: a prefill batch usually has programs enough). `config`
    overrides the shipped tile table.

    `batch_invariant`: each row's bits depend on its own sequence alone. Decode and prefill run
    one config (`configs.lookup_invariant`) with one tile shape and per-tile row sums, and
    nothing is split (`num_splits` is ignored): a row's keys are summed one tile at a time in
    key order by one program, and the tiles a prefill block reads past a row's position are
    masked whole, which leaves its softmax state unchanged bit for bit. Nor does the compiler
    contract a multiply and an add into one rounding (`enable_fp_fusion`): it would in the tiles
    every row of a prefill block sees whole (`s * scale - m`) but not in the masked ones, so a
    key tile's bits would depend on where the row's query block starts. With a window, the
    tiles are those of the global `TILE_N` grid wherever a block starts, and the ones a block
    reads below a row's window (for its earlier rows) come before the row's first and leave its
    state as it started, bit for bit: a row's bits still depend on its own sequence alone.
    """
    check_options(window, softcap)
    block_tables, seq_lens, cu_seqlens_q = batch.block_tables, batch.seq_lens, batch.cu_seqlens_q
    max_seqlen_q, max_seqlen_k = batch.max_seqlen_q, batch.max_seqlen_k
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
    group, num_seqs = num_heads // num_kv_heads, seq_lens.shape[0]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    capability, num_sms = _device_info(q.device)
    decode = max_seqlen_q <= 1
    if batch_invariant:
        cfg = config or lookup_invariant(capability, head_dim)
    else:
        phase = phase_of(decode, num_seqs, num_kv_heads, num_sms)
        cfg = config or lookup(capability, phase, head_dim)
    block_q, block_m = tile_shape(group, decode, cfg, batch_invariant)
    one_qblock = max_seqlen_q <= block_q
    if batch_invariant:
        splits = 1
    elif decode:
        # with a window, only its tiles are shared out: at most `window + tile_n - 1` positions
        span = max_seqlen_k if window is None else min(max_seqlen_k, window + cfg.tile_n - 1)
        splits = num_splits or choose_num_splits(num_seqs, num_kv_heads, span, num_sms, cfg.tile_n)
    else:  # prefill programs split only when asked (a graph of few sequences and long contexts)
        splits = num_splits or 1
    d_pad = max(16, triton.next_power_of_2(head_dim))
    grid0 = num_seqs if one_qblock else num_tokens // block_q + num_seqs
    fused = splits > 1 and cfg.fused_combine
    pdl = cfg.pdl and decode and pdl_capable(capability) and not batch_invariant
    if splits > 1:
        ws = (grid0, num_kv_heads, splits, block_m)
        acc_ws = torch.empty((*ws, head_dim), dtype=q.dtype, device=q.device)
        m_ws = torch.empty(ws, dtype=torch.float32, device=q.device)
        l_ws = torch.empty(ws, dtype=torch.float32, device=q.device)
    else:
        acc_ws = m_ws = l_ws = out  # never touched
    counters = _split_counters(q.device, grid0 * num_kv_heads) if fused else out
    consts = dict(GROUP=group, HEAD_DIM=head_dim, D_PAD=d_pad, BLOCK_Q=block_q, BLOCK_M=block_m)
    consts.update(TILE_N=cfg.tile_n, NUM_SPLITS=splits, WINDOW=int(window or 0))
    qk_scale = softmax_scale * LOG2E if softcap is None else softmax_scale / softcap
    _attn_fwd[(grid0, num_kv_heads, splits)](
        q, k_cache, v_cache, out, block_tables, seq_lens, cu_seqlens_q, acc_ws, m_ws, l_ws,
        counters, num_seqs, qk_scale, *q.stride(), *out.stride(), *k_cache.stride(),
        *v_cache.stride(), block_tables.stride(0), block_tables.shape[1],
        BLOCK_SIZE=block_size, ONE_QBLOCK=one_qblock, FUSED_COMBINE=fused, PDL=pdl,
        launch_pdl=pdl, COLUMN_SUMS=block_q == 1 and not batch_invariant,
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **consts,
        SOFTCAP=float(softcap or 0.0), enable_fp_fusion=not batch_invariant,
    )  # fmt: skip
    if splits > 1 and not fused:
        _combine_splits[(grid0, num_kv_heads)](
            out, seq_lens, cu_seqlens_q, acc_ws, m_ws, l_ws, num_seqs, *out.stride(),
            ONE_QBLOCK=one_qblock, num_warps=8 if block_m >= 64 else 4, **consts,
        )  # fmt: skip
    return out

"""What each part of a decode call costs: `python3 scripts/device/variants.py [OUT.txt [NAME ...]
[FIELD=N ...] [splits=N]]` (the named copies only; config fields and a forced split count for every
kernel timed, the shipped one included).

Times kernels/triton_attention.py against copies of it with one part removed or changed (made here
by textual edits, as `timeline.py` makes its instrumented copy; the shipped kernel is untouched),
in the layer-stack CUDA graphs the benches time, through an identity block table (so a copy that
computes its block ids instead of reading them reads the same bytes). Order shipped, copies...,
copies reversed, shipped; means of two. Copies that drop work give wrong outputs: they say what
that work costs, nothing more. Each line gives the largest difference from the shipped output.

  arith_table   block ids computed (sequence i owns blocks i * width ...), never read from the
                table: what the table's loads and their round trip before the first K/V load cost
  no_merge      the fused combine's atomic and merge dropped (partials stored only)
  relaxed       the fused combine's atomic without its release and acquire (no fence before
                it, no L1 invalidation after; the merge may read a partial not yet visible)
  no_atomic     partials stored, no atomic and no merge: what the atomic's round trip costs
  no_partials   atomic and merge kept, no partial stored (the merge reads stale workspace; the
                compiler then drops the whole loop: a check that a copy still computes)
  no_ml         the partial's outputs stored, its maxima and row sums not
  acc_to_out    the partial's outputs stored to `out` (where no_epilogue stores them), its maxima
                and row sums to the workspace, atomic and merge kept
  ws_only       partials stored, no barrier, atomic or merge
  no_epilogue_bar  no_epilogue with the barrier the fused combine puts before its atomic
  persistent_ws the shipped kernel with one workspace kept per shape, made outside the graph
                (shipped: `torch.empty` each call, from the graph's pool when captured)
  ws_acc_only   each split stores its output rows to its own workspace rows, nothing else
  ws_shared     as ws_acc_only, every split of a sequence and KV head to the same rows
  out_split0    as no_epilogue, split 0 alone storing
  ml_full       the shipped kernel storing its maxima and row sums for all BLOCK_M rows (whole
                32-byte sectors) instead of the GROUP query rows (28 bytes of a sector for Qwen)
  acc_only_fma  ws_acc_only with 40 dependent multiply-adds on the output before its store (320
                more instructions after the loop, no more memory operations)
  one_ws        the shipped kernel with its three workspaces (outputs, maxima, row sums) as views
                of one allocation per call (one memory page instead of three, where it fits)
  one_buf       as one_ws, kept across calls, with the arrival counters in the same buffer
  l_only        the shipped kernel without the maxima's store (the merge reads stale maxima)
  ml_pad        the maxima and row sums of each split in a 128-byte line of their own (two
                splits shared one; the merge reads the old places: a cost only)
  counter_pad   each arrival counter in a line of its own (32 sequences' counters shared one)
  pad_both      both: is the epilogue's cost programs on different SMs writing the same lines?
  ml_line       the maxima and row sums interleaved and stored for all BLOCK_M rows: one whole
                128-byte line a split, one store (the merge reads the old places: a cost only)
  xchg          the arrival counter's reset as an atomic exchange instead of a 4-byte store
  ml_line_xchg  both
  no_ml_xchg    no_ml with the reset as an exchange
  acc_plus_word ws_acc_only with one more store a split: a single 4-byte word
  acc_plus_line ws_acc_only with one more store a split: a whole 128-byte line
                (session 10: is it stores of part of a line that cost ~1 us at 64 x 2K, as
                the timeline's stamps, the maxima, the row sums and the counter's reset all are?)
  acc_plus_m    ws_acc_only with the maxima stored too (values the loop computed; the word of
                acc_plus_word is a constant)
  acc_plus_l    ws_acc_only with the row sums stored too (session 12)
  one_store     ws_acc_only with the maxima and row sums put in the output rows' first two
                columns, so one store after the loop carries a split's whole state (wrong
                outputs; session 12, compiled offline only)
  one_store_atomic  one_store with the barrier and the atomic (no merge after it)
  one_store_merge   one_store with the barrier, the atomic and the fused merge
  one_store_reset   one_store_merge whose last split only resets its counter (no merge)
  ticket_no_merge, ticket_merge_one, ticket_merge_all
                an epilogue where each split takes an arrival ticket first and then stores
                once: its packed partial, or, the last (once the others have stored), its
                merge of no, one or every other partial into the output rows (offline
                sketches, wrong outputs; session 12)
  one_store_zero_merge  one_store_merge whose last split stores zeros to its output rows
                instead of merging (no loads; offline only)
  ptxas_O1, ptxas_cta4, ptxas_cta5, ptxas_cta6
                the shipped kernel assembled by ptxas at --opt-level=1, or with
                --minnctapersm=4, 5 or 6 (session 12)
  pdl_combine   one_store's split kernel without a merge, then the combine kernel launched
                programmatically (PDL), its programs waiting for the split kernel to end;
                time with fused_combine=0 (wrong outputs: a cost; session 12)
  separate_merge    one_store whose merge runs in programs of its own at the grid's last z
                index, each polling its counter until its splits have arrived (wrong
                outputs: what the structure costs; session 12)
  reload        the shipped kernel re-reading the sequence's query start, query length and
                length after the loop (volatile loads) and recomputing what its epilogue needs
                from them, so nothing of the prologue lives across the loop (session 12)
  acc_plus_outsum  ws_acc_only with each output row's sum stored where the maxima go: a value
                computed after the loop from its outputs, not the maxima (session 12)
  ml_after      the shipped kernel with the maxima and row sums stored after the output rows
  ws_only_after ws_only with the maxima and row sums stored after the output rows
  m_in_loop     the shipped kernel storing its maxima inside the loop after every tile (the last
                store is the final maximum), so none is live after the loop (correct)
  m_in_acc      decode splits repeat the group's query rows in the dots' padding rows and keep
                the running maxima in those rows of the output accumulator, where the split
                stores them from: the maxima are dead after the loop (correct)
  unroll2       the shipped kernel with its tile loop unrolled twice (`tl.range(...,
                loop_unroll_factor=2)`): another schedule of the same code (correct)
  reg80, reg72  the shipped kernel with at most 80 or 72 registers a thread (`maxnreg`)
  merge_noinline the shipped kernel with the fused merge a function Triton does not inline
                (the whole epilogue cannot be one: Triton passes only scalars to a function it
                does not inline, and the epilogue takes the loop's tensors)
  no_epilogue   every split stores its output straight to `out` (no partials, no merge)
  dot_acc       the rescaled accumulator as the P@V dot's accumulator input (correct)
  fma_scale     unscaled scores, maxima scaled once a row, each weight's exponent one
                multiply-add (correct; rounds once where the shipped kernel rounds twice)
  l_after       the row sums' update after the P@V dot (correct)
  fma_dot, l_after_dot, fma_dot_l_after  combinations of the three
  lazy_only     decode rescales a row only when a tile's maximum exceeds its reference by more
                than 8 (log2 domain): weights below 2^8, the accumulator rescaled rarely (correct)
  lazy_ref      lazy_only with the reference stored inside the loop where it moved (a store
                predicated off on most tiles), none after it (correct)
  heads2, heads4  decode without splits, each (sequence, KV head) as 2 or 4 programs sharing its
                query heads, each reading the whole history (the repeats from L2) (correct)
  single_site   decode splits whose epilogue has one tile store site: the query heads repeat in
                the dots' padding rows, so rows GROUP.. carry each row's log-sum-exp (two 16-bit
                halves) and a split's partial is one tile; the store sits in a loop that runs
                twice for the last split to arrive, whose second pass stores the merged rows
                (correct; session 13, offline)
  dup_acc_only  ws_acc_only with the query heads repeated in the padding rows (session 13)
  site_nodup    single_site's epilogue without the repeated rows (a cost only; session 13)
  xchg_zero_merge, atomload_merge
                one_store_zero_merge with the zeros written by atomic exchanges, or read by
                atomic ORs of zero and written back by exchanges: do atomics in place of the
                merge's loads and store keep the fast loop? (cost only; session 13, offline)

(`lse`, each split storing one log-sum-exp a row instead of its maximum and row sum, with a merge of
its own, was timed in session 10 and not kept: -1.9..+1.0% against the shipped kernel, run 11 of
results/kernels-variants-h200.txt; it carried a copy of the merge, since these edits reach only
kernels/triton_attention.py. A fourth copy, run once in session 8 and not kept, had the last split
skip a round trip: every split stored its partial, then read its counter with acquire; one that
found every other split arrived merged at once from its registers and their partials, the others
published as before. It was 0-5% slower everywhere it split: results/kernels-variants-h200.txt. A
fifth, block ids read two of a split's tiles ahead instead of one, was dropped before it ran: with
that second-order loop-carried chain Triton 3.6's pipeliner gives up on cp.async (no LDGSTS in the
sm_90 loop, K/V loaded straight to registers), so it would have timed the pipeliner's absence, not
the lookahead.)
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pathlib
import sys

import pagedctl.kernels.sweep as sw
import torch
from kernel_copy import SRC, edited_copy  # (scripts/device, the script's own folder)
from pagedctl.kernels.bench_timing import _table, per_call_ms

_NO_MERGE_PATH = [  # partials stored, no barrier, atomic or merge
    ("            tl.debug_barrier()\n", ""),
    (
        'if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == active - 1:',
        "if NUM_SPLITS < 0:",
    ),
]
_ML_DROP = [  # partials of the output rows only: no maxima, row sums, barrier, atomic
    ("        tl.store(m_ws_ptr + ws + rows, m_i, mask=row_ok)\n", ""),
    ("        tl.store(l_ws_ptr + ws + rows, l_i, mask=row_ok)\n", ""),
    *_NO_MERGE_PATH,
]

# one allocation for the split workspace (and, kept, zeroed counters at its end), as views
_ONE_BUFFER = """_KEPT = {}


def _one_buffer(ws, head_dim, dtype, device, n_counters, keep):
    import math
    acc_n = math.prod(ws) * head_dim * torch.finfo(dtype).bits // 8
    ml_n = math.prod(ws) * 4
    total = acc_n + 2 * ml_n + 4 * n_counters
    key = (ws, head_dim, dtype, device, n_counters)
    if keep and key in _KEPT:
        buf = _KEPT[key]
    else:
        make = torch.zeros if keep else torch.empty  # (kept: the counters start at zero)
        buf = make(total, dtype=torch.uint8, device=device)
        if keep:
            _KEPT[key] = buf
    acc = buf[:acc_n].view(dtype).view(*ws, head_dim)
    m = buf[acc_n : acc_n + ml_n].view(torch.float32).view(ws)
    l = buf[acc_n + ml_n : acc_n + 2 * ml_n].view(torch.float32).view(ws)
    cnt = buf[acc_n + 2 * ml_n :].view(torch.int32)
    return acc, m, l, cnt


"""

# One 128-byte line per program for what a split writes that is smaller than a line: its maxima
# and row sums (16 floats: 64 bytes, so two splits shared a line) and its arrival counter (4 bytes:
# 32 sequences' counters shared a line). The merge (in triton_splits, not edited) then reads the
# maxima and row sums from the old places: wrong output, a cost only.
_ML_PAD = [
    (
        "        tl.store(m_ws_ptr + ws + rows, m_i, mask=row_ok)\n"
        "        tl.store(l_ws_ptr + ws + rows, l_i, mask=row_ok)\n",
        "        tl.store(m_ws_ptr + 2 * ws + rows, m_i, mask=row_ok)\n"
        "        tl.store(l_ws_ptr + 2 * ws + rows, l_i, mask=row_ok)\n",
    ),
    (
        "        m_ws = torch.empty(ws, dtype=torch.float32, device=q.device)\n"
        "        l_ws = torch.empty(ws, dtype=torch.float32, device=q.device)\n",
        "        wide = (*ws[:-1], 2 * block_m)\n"
        "        m_ws = torch.empty(wide, dtype=torch.float32, device=q.device)\n"
        "        l_ws = torch.empty(wide, dtype=torch.float32, device=q.device)\n",
    ),
]
_COUNTER_PAD = [
    (
        "            counter = counter_ptr + pid * tl.num_programs(1) + kvh\n",
        "            counter = counter_ptr + (pid * tl.num_programs(1) + kvh) * 32\n",
    ),
    (
        "    counters = _split_counters(q.device, grid0 * num_kv_heads) if fused else out\n",
        "    counters = _split_counters(q.device, grid0 * num_kv_heads * 32) if fused else out\n",
    ),
]

_ML_STORES = (
    "        tl.store(m_ws_ptr + ws + rows, m_i, mask=row_ok)\n"
    "        tl.store(l_ws_ptr + ws + rows, l_i, mask=row_ok)\n"
)
_ML_LINE = [  # maxima and row sums interleaved, all BLOCK_M rows: one whole 128-byte line a split
    (
        _ML_STORES,
        "        ml_off = (ws + rows)[:, None] * 2 + tl.arange(0, 2)[None, :]\n"
        "        tl.store(m_ws_ptr + ml_off, tl.join(m_i, l_i))\n",
    ),
    (
        "        m_ws = torch.empty(ws, dtype=torch.float32, device=q.device)\n",
        "        m_ws = torch.empty((*ws, 2), dtype=torch.float32, device=q.device)\n",
    ),
]
_XCHG = [  # the counter's reset as an atomic exchange, not a 4-byte store
    (
        "                tl.store(counter, 0)  # ready",
        '                tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # ready',
    )
]
# ws_acc_only with one more store a split: a 4-byte word, or a whole 128-byte line
_ACC_PLUS_WORD = [
    *_ML_DROP,
    ("        part_off = (ws", "        tl.store(m_ws_ptr + ws, 1.0)\n        part_off = (ws"),
]
_ACC_PLUS_LINE = [
    *_ML_DROP,
    (
        "        part_off = (ws",
        "        tl.store(m_ws_ptr + ws * 2 + tl.arange(0, 2 * BLOCK_M), 1.0)\n"
        "        part_off = (ws",
    ),
    _ML_LINE[1],
]

_ACC_STORE = (
    "        tl.store(acc_ws_ptr + part_off, out.to(acc_ws_ptr.dtype.element_ty), mask=o_mask)\n"
)
# the maxima and row sums stored after the output rows instead of before them
_ML_AFTER = [(_ML_STORES, ""), (_ACC_STORE, _ACC_STORE + _ML_STORES)]
# ws_acc_only with the maxima alone stored (a value the loop computed, where a constant is free)
_ACC_PLUS_M = _ML_DROP[1:]
# session 12: the shipped kernel re-reading after the loop what its epilogue needs of the
# sequence (query start and length, length: volatile loads, so they are not the values read
# before the loop) and recomputing the rows, the limit and the tile count from them, so no value
# of the prologue but the loop's own state lives across the loop (80 registers on sm_90 against
# 86: `ws_acc_only`'s count; correct: a candidate)
_RELOAD = [
    (
        "    l_i = tl.sum(l_acc, 1)\n",
        "    q_begin = tl.load(cu_q_ptr + seq, volatile=True)\n"
        "    q_len = tl.load(cu_q_ptr + seq + 1, volatile=True) - q_begin\n"
        "    seq_len = tl.load(seq_lens_ptr + seq, volatile=True)\n"
        "    tok = qb_start + rows // GROUP\n"
        "    head = kvh * GROUP + rows % GROUP\n"
        "    row_ok = (rows < BLOCK_Q * GROUP) & (tok < q_len)\n"
        "    q_rows = (q_begin + tok).to(tl.int64)\n"
        "    limit = seq_len - q_len + tl.minimum(qb_start + BLOCK_Q, q_len)\n"
        "    if ONE_QBLOCK:\n"
        "        limit = tl.where(q_len > 0, limit, 0)\n"
        "    num_tiles = tl.cdiv(limit, TILE_N)\n"
        "    l_i = tl.sum(l_acc, 1)\n",
    )
]
# session 12 (offline, `scripts/sass_probe.py`): one store after the loop carrying the maxima and
# row sums in the output rows' first two columns (wrong outputs: what ptxas makes of the loop
# when a split's whole state leaves in a single store), alone, with the barrier and atomic, or
# with the fused merge after it
_ONE_STORE = (
    "        part_off = (ws + rows)[:, None] * HEAD_DIM + d[None, :]\n",
    "        part_off = (ws + rows)[:, None] * HEAD_DIM + d[None, :]\n"
    "        out = tl.where(d[None, :] == 1, l_i[:, None], out)\n"
    "        out = tl.where(d[None, :] == 0, m_i[:, None], out)\n",
)
_ONE_STORE_MERGE = [*_ML_DROP[:2], _ONE_STORE]
_ONE_STORE_ATOMIC = [
    *_ONE_STORE_MERGE,
    (
        "                tl.store(counter, 0)  # ready for the next call (the next layer, the next"
        " step)\n",
        "                return\n",
    ),
]
# session 12: `one_store` with the merge moved out of the split programs into programs of its own,
# one a (sequence, KV head), at the grid's last z index (dispatched after every split program):
# each waits for its splits' arrivals (polling the counter with acquire) and merges; a split
# program ends with one store and a release increment. Wrong outputs (one_store's packing; the
# merge reads stale maxima and row sums): what the structure costs, nothing more.
_SEPARATE_MERGE = [
    *_ML_DROP[:2],
    _ONE_STORE,
    (
        "    context = seq_len - q_len\n",
        "    context = seq_len - q_len\n"
        "    if FUSED_COMBINE and split == NUM_SPLITS:\n"
        "        cnt = counter_ptr + pid * tl.num_programs(1) + kvh\n"
        "        lim = context + tl.minimum(qb_start + BLOCK_Q, q_len)\n"
        "        act = tl.minimum(tl.cdiv(lim, TILE_N), NUM_SPLITS)\n"
        '        while tl.atomic_add(cnt, 0, sem="acquire", scope="gpu") < act:\n'
        "            pass\n"
        "        tl.store(cnt, 0)\n"
        "        _merge_splits(\n"
        "            out_ptr, acc_ws_ptr, m_ws_ptr, l_ws_ptr, pid, kvh, tl.num_programs(1),\n"
        "            q_begin, qb_start, q_len, act, stride_ot, stride_oh, stride_od,\n"
        "            GROUP, HEAD_DIM, D_PAD, BLOCK_Q, BLOCK_M, NUM_SPLITS,\n"
        "        )\n"
        "        return\n",
    ),
    (
        'if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == active - 1:',
        'tl.atomic_add(counter, 1, sem="release", scope="gpu")\n            if NUM_SPLITS < 0:',
    ),
    (
        "    _attn_fwd[(grid0, num_kv_heads, splits)](",
        "    _attn_fwd[(grid0, num_kv_heads, splits + fused)](",
    ),
]


# session 12 (offline): one_store_merge with the merge reduced to the counter's reset (no output
# store), or to a store of zeros to the output rows (no loads)
_MERGE_CALL = (
    "                _merge_splits(\n"
    "                    out_ptr, acc_ws_ptr, m_ws_ptr, l_ws_ptr, pid, kvh, tl.num_programs(1),\n"
)
_ZERO_MERGE_DEF = """@triton.jit
def _zero_merge(out_ptr, q_begin, kvh, stride_ot, stride_oh, stride_od, GROUP: tl.constexpr,
                HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    rows = tl.arange(0, BLOCK_M)
    d = tl.arange(0, D_PAD)
    head = kvh * GROUP + rows % GROUP
    off = q_begin.to(tl.int64) * stride_ot + head[:, None] * stride_oh + d[None, :] * stride_od
    mask = (rows < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    tl.store(out_ptr + off, tl.zeros([BLOCK_M, D_PAD], out_ptr.dtype.element_ty), mask=mask)


"""
_NEVER_MERGE = (_MERGE_CALL, "                if NUM_SPLITS < 0:\n    " + _MERGE_CALL)
_ONE_STORE_RESET = [*_ONE_STORE_MERGE, _NEVER_MERGE]
_ONE_STORE_ZERO_MERGE = [
    *_ONE_STORE_MERGE,
    (
        _MERGE_CALL,
        "                _zero_merge(\n"
        "                    out_ptr, q_begin, kvh, stride_ot, stride_oh, stride_od, GROUP,\n"
        "                    HEAD_DIM, D_PAD, BLOCK_M,\n"
        "                )\n"
        "                if NUM_SPLITS < 0:\n    " + _MERGE_CALL,
    ),
    ("@triton.jit\ndef _attn_fwd(\n", _ZERO_MERGE_DEF + "@triton.jit\ndef _attn_fwd(\n"),
]


# session 12 (offline sketches, cost-only; maxima and row sums packed as in one_store): the
# epilogue from the shipped kernel's workspace index on, replaced by one in which each split first
# takes an arrival ticket, then stores exactly once: a split not last its packed partial, the last
# (after the others have stored) its merge of 0, 1 or all other partials into the output rows
_EPILOGUE_FROM = (
    "        ws = ((pid.to(tl.int64) * tl.num_programs(1) + kvh) * NUM_SPLITS + split) * BLOCK_M\n"
)
_EPILOGUE_TO = "                )  # fmt: skip\n\n\n@triton.jit\ndef _combine_splits("
_TICKET = (
    _EPILOGUE_FROM
    + """        active = tl.minimum(num_tiles, NUM_SPLITS)
        counter = counter_ptr + pid * tl.num_programs(1) + kvh
        stored = counter + tl.num_programs(0) * tl.num_programs(1)
        last = tl.atomic_add(counter, 1, sem="relaxed", scope="gpu") == active - 1
        tile = tl.where(d[None, :] == 1, l_i[:, None], out)
        tile = tl.where(d[None, :] == 0, m_i[:, None], tile)
        dst = acc_ws_ptr + ws * HEAD_DIM
        if last:
            while tl.atomic_add(stored, 0, sem="acquire", scope="gpu") < active - 1:
                pass
            base = (pid.to(tl.int64) * tl.num_programs(1) + kvh) * NUM_SPLITS * BLOCK_M
            MERGE
            tile = merged
            q_row = q_begin.to(tl.int64) * (tl.num_programs(1) * GROUP) + kvh * GROUP
            dst = out_ptr + q_row * HEAD_DIM
        tile = tile.to(out_ptr.dtype.element_ty)
        tl.store(dst + rows[:, None] * HEAD_DIM + d[None, :], tile, mask=o_mask)
        if last:
            tl.store(counter, 0)
            tl.store(stored, 0)
        else:
            tl.debug_barrier()
            tl.atomic_add(stored, 1, sem="release", scope="gpu")
"""
)
_PART_LOAD = (
    "                    part = tl.load(\n"
    "                        acc_ws_ptr + prow[:, None] * HEAD_DIM + d[None, :], mask=o_mask,\n"
    '                        other=0.0, cache_modifier=".cg",\n'
    "                    ).to(tl.float32)\n"
)
_MERGE_ONE_MORE = (
    "m_run = m_i\n"
    "            total = l_i\n"
    "            acc = out * l_i[:, None]\n"
    "            for k in range(1, OTHERS):\n"
    "                if True:\n"
    "                    prow = base + ((split + k) % NUM_SPLITS) * BLOCK_M + rows\n"
    + _PART_LOAD
    + "                    m_s = tl.sum(tl.where(d[None, :] == 0, part, 0.0), 1)\n"
    "                    l_s = tl.sum(tl.where(d[None, :] == 1, part, 0.0), 1)\n"
    "                    m_new = tl.maximum(m_run, m_s)\n"
    "                    w_run = tl.exp2(m_run - m_new)\n"
    "                    w_s = tl.exp2(m_s - m_new) * l_s\n"
    "                    total = total * w_run + w_s\n"
    "                    acc = acc * w_run[:, None] + part * w_s[:, None]\n"
    "                    m_run = m_new\n"
    "            merged = acc / total[:, None]"
)


def _epilogue() -> str:
    """The shipped split epilogue, from the workspace index to the end of the fused merge's call."""
    src = SRC.read_text()
    start = src.index(_EPILOGUE_FROM)
    return src[start : src.index(_EPILOGUE_TO) + len("                )  # fmt: skip\n")]


def _ticket(merge: str) -> list[tuple[str, str]]:
    return [(_epilogue(), _TICKET.replace("MERGE", merge))]


# session 12: one_store's split kernel with no merge in it (run with fused_combine=0), merged by the
# combine kernel launched programmatically (PDL): its programs may start once every split program
# has begun (they signal it first thing), and wait in `gdc_wait` for the split kernel to finish.
# Wrong outputs (one_store's packing; the combine reads stale maxima and row sums): the cost.
_PDL_COMBINE = [
    *_ML_DROP[:2],
    _ONE_STORE,
    (
        "    seq, qb_start = _query_block(cu_q_ptr, pid, num_seqs, BLOCK_Q, ONE_QBLOCK)\n"
        "    # Tiles are dealt",
        "    seq, qb_start = _query_block(cu_q_ptr, pid, num_seqs, BLOCK_Q, ONE_QBLOCK)\n"
        "    gdc_launch_dependents()\n"
        "    # Tiles are dealt",
    ),
    (
        "    active = tl.minimum(tl.cdiv(limit, TILE_N), NUM_SPLITS)\n    _merge_splits(\n",
        "    active = tl.minimum(tl.cdiv(limit, TILE_N), NUM_SPLITS)\n    gdc_wait()\n"
        "    _merge_splits(\n",
    ),
    (
        "            ONE_QBLOCK=one_qblock, num_warps=8 if block_m >= 64 else 4, **consts,\n",
        "            ONE_QBLOCK=one_qblock, num_warps=8 if block_m >= 64 else 4, **consts,\n"
        "            launch_pdl=True,\n",
    ),
]


# session 12: the shipped kernel assembled with other ptxas options (Triton's `ptx_options`; offline
# `--register-usage-level`, `--maxrregcount` and `--allow-expensive-optimizations=false` leave its
# loop as it is, these change it)
def _ptxas(options: str) -> list[tuple[str, str]]:
    return [
        (
            "        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **consts,\n",
            f"        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **consts,\n"
            f"        ptx_options={options!r},\n",
        )
    ]


# session 12: ws_acc_only plus the row sums (live after the loop in ws_acc_only already: they
# normalise the output), or plus a value computed from the output rows after the loop (their
# sums: a cross-warp reduction, as the row sums' own), each where the maxima would go
_ACC_PLUS_L = [_ML_DROP[0], *_NO_MERGE_PATH]
_ACC_PLUS_OUTSUM = [
    *_ML_DROP,
    (
        "        part_off = (ws",
        "        tl.store(m_ws_ptr + ws + rows, tl.sum(out, 1), mask=row_ok)\n"
        "        part_off = (ws",
    ),
]

# The fused merge as a function of its own that Triton does not inline (`noinline=True`): is the
# loop's schedule what the ~1 us follows? ptxas schedules the loop with whatever the code after
# it keeps live (`acc_plus_m`'s loop differs from `ws_acc_only`'s).
_MERGE_NOINLINE_DEF = """@triton.jit(noinline=True)
def _merge_noinline(
    out_ptr, acc_ws_ptr, m_ws_ptr, l_ws_ptr, pid, kvh, num_kv_heads, q_begin, qb_start, q_len,
    active, stride_ot, stride_oh, stride_od,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    _merge_splits(
        out_ptr, acc_ws_ptr, m_ws_ptr, l_ws_ptr, pid, kvh, num_kv_heads, q_begin, qb_start,
        q_len, active, stride_ot, stride_oh, stride_od, GROUP, HEAD_DIM, D_PAD, BLOCK_Q,
        BLOCK_M, NUM_SPLITS,
    )


"""
_MERGE_NOINLINE = [
    ("                _merge_splits(\n", "                _merge_noinline(\n"),
    ("@triton.jit\ndef _attn_fwd(\n", _MERGE_NOINLINE_DEF + "@triton.jit\ndef _attn_fwd(\n"),
]
# the maxima stored inside the loop after every tile (the last store is the final maximum), so
# they are not live after it, as in ws_acc_only's loop (correct: a candidate)
_M_IN_LOOP = [
    ("        tl.store(m_ws_ptr + ws + rows, m_i, mask=row_ok)\n", ""),
    (
        "    full = tl.minimum((context + qb_start + 1) // TILE_N, num_tiles)\n",
        "    full = tl.minimum((context + qb_start + 1) // TILE_N, num_tiles)\n"
        "    ws_m = ((pid.to(tl.int64) * tl.num_programs(1) + kvh) * NUM_SPLITS + split)\n"
        "    ws_m = ws_m * BLOCK_M\n",
    ),
    (
        "                BLOCK_SIZE, BLOCK_Q, TILE_N, NUM_SPLITS, DOT_PREC, masked == 1,\n"
        "            )  # fmt: skip\n",
        "                BLOCK_SIZE, BLOCK_Q, TILE_N, NUM_SPLITS, DOT_PREC, masked == 1,\n"
        "            )  # fmt: skip\n"
        "            if NUM_SPLITS > 1:\n"
        "                tl.store(m_ws_ptr + ws_m + rows, m_i, mask=row_ok)\n",
    ),
]


# Equivalent rewrites of the tile body (correct: candidates; each changes what ptxas schedules).
# dot_acc: the rescaled accumulator is the P@V dot's accumulator input (the MMA adds into it)
_DOT_ACC = [
    (
        "    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)\n",
        "    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PREC)\n",
    )
]
# fma_scale: scores stay unscaled; the maxima are scaled once a row and the weights' exponent is
# one multiply-add a score (max(s) * c = max(s * c) exactly for c > 0: rounding is monotone)
_FMA_SCALE = [
    (
        "    s = tl.dot(q, k, input_precision=DOT_PREC) * qk_scale  # log2 domain\n",
        "    s = tl.dot(q, k, input_precision=DOT_PREC)  # times qk_scale: the log2 domain\n",
    ),
    (
        "        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every row sees the whole tile\n",
        "        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)\n",
    ),
    (
        "        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: a tile has a key below `limit`\n",
        "        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)\n",
    ),
    (
        "        m_new = tl.maximum(m_i, tl.max(s, 1))\n        m_safe = tl.where(",
        "        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)\n        m_safe = tl.where(",
    ),
    ("    p = tl.exp2(s - m_safe[:, None])\n", "    p = tl.exp2(s * qk_scale - m_safe[:, None])\n"),
]
# l_first: the row sums' update after the P@V dot instead of before the V load
_L_AFTER = [
    (
        "    if BLOCK_Q == 1:\n        l_acc = l_acc * alpha[:, None] + p\n    else:\n"
        "        l_acc = l_acc * alpha[:, None] + tl.sum(p, 1, keep_dims=True)\n",
        "",
    ),
    (
        "    return m_new, l_acc, acc, blk_next\n",
        "    if BLOCK_Q == 1:\n        l_acc = l_acc * alpha[:, None] + p\n    else:\n"
        "        l_acc = l_acc * alpha[:, None] + tl.sum(p, 1, keep_dims=True)\n"
        "    return m_new, l_acc, acc, blk_next\n",
    ),
]


# Lazy rescaling (as FlashAttention-4 does): a row's reference moves only when a tile's maximum
# exceeds it by more than 8 (log2 domain), so weights stay below 2^8 and the accumulator is
# rescaled rarely. lazy_only: the reference stored after the loop, as the maxima are; lazy_ref:
# stored inside the loop where it moved (a store predicated off on most tiles), so nothing of the
# softmax state but the accumulator and row sums is live after the loop (correct: candidates)
_LAZY = [
    (
        "        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: a tile has a key below `limit`\n",
        "        m_tile = tl.max(s, 1)  # finite: a tile has a key below `limit`\n"
        "        m_new = tl.where(m_tile > m_i + 8.0, m_tile, m_i)\n",
    ),
]
_LAZY_REF = [
    *_LAZY,
    ("        tl.store(m_ws_ptr + ws + rows, m_i, mask=row_ok)\n", ""),
    (
        "    full = tl.minimum((context + qb_start + 1) // TILE_N, num_tiles)\n",
        "    full = tl.minimum((context + qb_start + 1) // TILE_N, num_tiles)\n"
        "    ws_m = ((pid.to(tl.int64) * tl.num_programs(1) + kvh) * NUM_SPLITS + split)\n"
        "    ws_m = ws_m * BLOCK_M\n",
    ),
    (
        "        for j in range(lo, hi, NUM_SPLITS):\n"
        "            m_i, l_acc, acc, blk_next = _tile(\n",
        "        for j in range(lo, hi, NUM_SPLITS):\n            m_prev = m_i\n"
        "            m_i, l_acc, acc, blk_next = _tile(\n",
    ),
    (
        "                BLOCK_SIZE, BLOCK_Q, TILE_N, NUM_SPLITS, DOT_PREC, masked == 1,\n"
        "            )  # fmt: skip\n",
        "                BLOCK_SIZE, BLOCK_Q, TILE_N, NUM_SPLITS, DOT_PREC, masked == 1,\n"
        "            )  # fmt: skip\n"
        "            if NUM_SPLITS > 1:\n"
        "                moved = row_ok & (m_i != m_prev)\n"
        "                tl.store(m_ws_ptr + ws_m + rows, m_i, mask=moved)\n",
    ),
]


def _head_groups(n: int) -> list[tuple[str, str]]:
    """Decode without splits, each (sequence, KV head) as `n` programs that share the group's query
    heads (ceil(GROUP / n) each) and each read the whole history: the second reads of the same K/V,
    made at the same time, should come from L2. No split state at all, so the split kernel's loop
    schedule question does not arise; the price is n reads of each K/V tile from L2 (correct)."""
    return [
        (
            "    DOT_PREC: tl.constexpr, FUSED_COMBINE: tl.constexpr, PDL: tl.constexpr,\n"
            "):  # fmt: skip\n    pid = tl.program_id(0)\n    kvh = tl.program_id(1)\n",
            "    DOT_PREC: tl.constexpr, FUSED_COMBINE: tl.constexpr, PDL: tl.constexpr,\n"
            "    HG: tl.constexpr,\n"
            "):  # fmt: skip\n    pid = tl.program_id(0)\n    kvh = tl.program_id(1) // HG\n"
            "    hg = tl.program_id(1) % HG\n",
        ),
        (
            "    tok = qb_start + rows // GROUP\n    head = kvh * GROUP + rows % GROUP\n"
            "    row_ok = (rows < BLOCK_Q * GROUP) & (tok < q_len)\n",
            "    if HG > 1:\n"
            "        tok = qb_start + rows * 0\n"
            "        head = kvh * GROUP + hg * ((GROUP + HG - 1) // HG) + rows\n"
            "        row_ok = (rows < (GROUP + HG - 1) // HG) & (head < (kvh + 1) * GROUP)\n"
            "        row_ok = row_ok & (tok < q_len)\n"
            "    else:\n"
            "        tok = qb_start + rows // GROUP\n        head = kvh * GROUP + rows % GROUP\n"
            "        row_ok = (rows < BLOCK_Q * GROUP) & (tok < q_len)\n",
        ),
        (
            "        splits = num_splits or choose_num_splits(\n"
            "            num_seqs, num_kv_heads, max_seqlen_k, num_sms, cfg.tile_n\n        )\n",
            "        splits = 1\n",
        ),
        (
            "    _attn_fwd[(grid0, num_kv_heads, splits)](\n",
            f"    hg = {n} if decode else 1\n    _attn_fwd[(grid0, num_kv_heads * hg, splits)](\n",
        ),
        (
            "        BLOCK_SIZE=block_size, ONE_QBLOCK=one_qblock, FUSED_COMBINE=fused, PDL=pdl,\n",
            "        BLOCK_SIZE=block_size, ONE_QBLOCK=one_qblock, FUSED_COMBINE=fused, PDL=pdl,\n"
            "        HG=hg,\n",
        ),
    ]


def _maxnreg(n: int) -> list[tuple[str, str]]:
    """The shipped kernel compiled with at most `n` registers a thread (ptxas then schedules the
    loop anew; 86 without a cap on sm_90, 80 for ws_acc_only)."""
    return [
        (
            "        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **consts,\n"
            "    )  # fmt: skip\n    if splits > 1 and not fused:",
            f"        num_warps=cfg.num_warps, num_stages=cfg.num_stages, maxnreg={n}, **consts,\n"
            "    )  # fmt: skip\n    if splits > 1 and not fused:",
        )
    ]


# Decode with splits: rows BLOCK_M / 2 ... repeat the GQA group's query rows (the dots pad the
# group to BLOCK_M rows anyway), and after every tile those rows of the output accumulator take the
# running maxima; the split stores its maxima from there, so the maxima themselves are dead after
# the loop, as in ws_acc_only (correct: a candidate; groups of at most BLOCK_M / 2 heads)
_M_IN_ACC = [
    (
        "    tok = qb_start + rows // GROUP\n"
        "    head = kvh * GROUP + rows % GROUP\n"
        "    row_ok = (rows < BLOCK_Q * GROUP) & (tok < q_len)\n",
        "    DUP: tl.constexpr = (BLOCK_Q == 1) and (NUM_SPLITS > 1) and (2 * GROUP <= BLOCK_M)\n"
        "    src = rows\n"
        "    if DUP:\n"
        "        src = rows % (BLOCK_M // 2)\n"
        "    tok = qb_start + src // GROUP\n"
        "    head = kvh * GROUP + src % GROUP\n"
        "    row_ok = (rows < BLOCK_Q * GROUP) & (tok < q_len)\n"
        "    q_ok = (src < BLOCK_Q * GROUP) & (tok < q_len)\n",
    ),
    (
        "    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)\n",
        "    q = tl.load(q_ptr + q_off, mask=q_ok[:, None] & d_ok[None, :], other=0.0)\n",
    ),
    (
        "                BLOCK_SIZE, BLOCK_Q, TILE_N, NUM_SPLITS, DOT_PREC, masked == 1,\n"
        "            )  # fmt: skip\n",
        "                BLOCK_SIZE, BLOCK_Q, TILE_N, NUM_SPLITS, DOT_PREC, masked == 1,\n"
        "            )  # fmt: skip\n"
        "            if DUP:\n"
        "                acc = tl.where((rows >= BLOCK_M // 2)[:, None], m_i[:, None], acc)\n",
    ),
    (
        "        tl.store(m_ws_ptr + ws + rows, m_i, mask=row_ok)\n",
        "        if DUP:\n"
        "            m_at = m_ws_ptr + ws + (rows - BLOCK_M // 2)[:, None] + 0 * d[None, :]\n"
        "            m_ok = (rows >= BLOCK_M // 2) & (rows - BLOCK_M // 2 < GROUP)\n"
        "            tl.store(m_at, acc, mask=m_ok[:, None] & (d == 0)[None, :])\n"
        "        else:\n"
        "            tl.store(m_ws_ptr + ws + rows, m_i, mask=row_ok)\n",
    ),
]


# session 13: decode splits whose whole epilogue issues one tile store site. The query heads repeat
# in the dots' padding rows (row r computes head r % GROUP), so rows GROUP..2*GROUP-1 carry the
# log-sum-exp of rows 0..GROUP-1 in their first one (fp32) or two (16-bit halves) columns: a split's
# partial is one tile. The store sits in a loop that runs once, or twice for the split that arrives
# last, whose second pass stores the merged output rows (correct; needs 2 * GROUP <= BLOCK_M).
_PACK_DEFS = '''@triton.jit
def _pack_lse(out, lse, rows, d, GROUP: tl.constexpr, DT: tl.constexpr):
    """`out` in the workspace dtype with `lse` written into rows GROUP.. (columns 0 and 1)."""
    tile = out.to(DT)
    side = (rows >= GROUP)[:, None]
    if DT == tl.float32:
        tile = tl.where(side & (d == 0)[None, :], lse[:, None], tile)
    else:
        bits = lse.to(tl.int32, bitcast=True)
        hi = (bits >> 16).to(tl.int16).to(DT, bitcast=True)
        lo = bits.to(tl.int16).to(DT, bitcast=True)
        tile = tl.where(side & (d == 0)[None, :], hi[:, None], tile)
        tile = tl.where(side & (d == 1)[None, :], lo[:, None], tile)
    return tile


@triton.jit
def _unpack_lse(ws_ptr, at, ok, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The log-sum-exp `_pack_lse` put beside rows `at` (-inf where not `ok`)."""
    side = ws_ptr + (at + GROUP) * HEAD_DIM
    if ws_ptr.dtype.element_ty == tl.float32:
        lse = tl.load(side, mask=ok, other=float("-inf"), cache_modifier=".cg")
    else:
        hi = tl.load(side, mask=ok, other=0.0, cache_modifier=".cg").to(tl.int16, bitcast=True)
        lo = tl.load(side + 1, mask=ok, other=0.0, cache_modifier=".cg").to(tl.int16, bitcast=True)
        bits = (hi.to(tl.int32) << 16) | (lo.to(tl.int32) & 0xFFFF)
        lse = tl.where(ok, bits.to(tl.float32, bitcast=True), float("-inf"))
    return lse


@triton.jit
def _merge_packed(ws_ptr, base, active, row_ok, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                  D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, NUM_SPLITS: tl.constexpr):
    rows = tl.arange(0, BLOCK_M)
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    top = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        at = base + s * BLOCK_M + rows
        live = (tl.full([BLOCK_M], s, tl.int32) < active) & row_ok
        top = tl.maximum(top, _unpack_lse(ws_ptr, at, live, GROUP, HEAD_DIM))
    top = tl.where(top == float("-inf"), 0.0, top)
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        at = base + s * BLOCK_M + rows
        live = (tl.full([BLOCK_M], s, tl.int32) < active) & row_ok
        w = tl.exp2(_unpack_lse(ws_ptr, at, live, GROUP, HEAD_DIM) - top)
        part_ok = live[:, None] & d_ok[None, :]
        part = tl.load(ws_ptr + at[:, None] * HEAD_DIM + d[None, :], mask=part_ok, other=0.0,
                       cache_modifier=".cg").to(tl.float32)
        total += w
        acc += part * w[:, None]
    return acc / tl.where(total == 0.0, 1.0, total)[:, None]


@triton.jit
def _attn_fwd(
'''
_PACK_EPILOGUE = (
    _EPILOGUE_FROM
    + """        DT: tl.constexpr = acc_ws_ptr.dtype.element_ty
        tile = _pack_lse(out, m_i + tl.log2(l_i), rows, d, GROUP, DT)
        dst = acc_ws_ptr + (ws + rows)[:, None] * HEAD_DIM + d[None, :]
        mask = (rows < 2 * GROUP)[:, None] & d_ok[None, :]
        active = tl.minimum(num_tiles, NUM_SPLITS)
        counter = counter_ptr + pid * tl.num_programs(1) + kvh
        n = 1
        i = 0
        while i < n:
            tl.store(dst, tile, mask=mask)
            if i == 0:
                tl.debug_barrier()
                if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == active - 1:
                    tl.store(counter, 0)
                    base = (pid.to(tl.int64) * tl.num_programs(1) + kvh) * NUM_SPLITS * BLOCK_M
                    merged = _merge_packed(acc_ws_ptr, base, active, row_ok, GROUP, HEAD_DIM, D_PAD,
                                           BLOCK_M, NUM_SPLITS)
                    tile = merged.to(DT)
                    o_off = q_rows[:, None] * stride_ot + head[:, None] * stride_oh
                    dst = out_ptr + o_off + d[None, :] * stride_od
                    mask = o_mask
                    n = 2
            i += 1
"""
)


def _single_site() -> list[tuple[str, str]]:
    return [
        (_epilogue(), _PACK_EPILOGUE),
        ("@triton.jit\ndef _attn_fwd(\n", _PACK_DEFS),
        (
            "    row_ok = (rows < BLOCK_Q * GROUP) & (tok < q_len)\n",
            "    row_ok = (rows < BLOCK_Q * GROUP) & (tok < q_len)\n"
            "    q_ok = row_ok\n"
            "    if BLOCK_Q == 1 and NUM_SPLITS > 1:\n"
            "        q_ok = (qb_start + rows * 0) < q_len\n",
        ),
        (
            "    q_rows = (q_begin + tok).to(tl.int64)\n",
            "    q_rows = (q_begin + tok).to(tl.int64)\n"
            "    if BLOCK_Q == 1 and NUM_SPLITS > 1:\n"
            "        q_rows = (q_begin + qb_start + rows * 0).to(tl.int64)\n",
        ),
        (
            "    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)\n",
            "    q = tl.load(q_ptr + q_off, mask=q_ok[:, None] & d_ok[None, :], other=0.0)\n",
        ),
    ]


_ZERO_STORE = next(line for line in _ZERO_MERGE_DEF.splitlines(True) if "tl.store" in line)
_XCHG_ZERO_DEF = _ZERO_MERGE_DEF.replace(
    _ZERO_STORE,
    "    words = (out_ptr + off).to(tl.pointer_type(tl.int32))\n"
    '    tl.atomic_xchg(words, tl.zeros([BLOCK_M, D_PAD], tl.int32), mask=mask, sem="relaxed")\n',
)
_ONE_STORE_XCHG_MERGE = [
    *_ONE_STORE_ZERO_MERGE[:-1],
    ("@triton.jit\ndef _attn_fwd(\n", _XCHG_ZERO_DEF + "@triton.jit\ndef _attn_fwd(\n"),
]
_ONE_STORE_ATOMLOAD = [
    *_ONE_STORE_ZERO_MERGE[:-1],
    (
        "@triton.jit\ndef _attn_fwd(\n",
        _ZERO_MERGE_DEF.replace(
            _ZERO_STORE,
            "    words = (out_ptr + off).to(tl.pointer_type(tl.int32))\n"
            "    x = tl.atomic_or(words, tl.zeros([BLOCK_M, D_PAD], tl.int32), mask=mask,\n"
            '                     sem="relaxed")\n'
            '    tl.atomic_xchg(words + 4096, x + 1, mask=mask, sem="relaxed")\n',
        )
        + "@triton.jit\ndef _attn_fwd(\n",
    ),
]

_SINGLE_SITE = _single_site()

VARIANTS = {
    "arith_table": [
        (
            "bt_row = bt_ptr + seq.to(tl.int64) * stride_bt",
            "bt_row = seq.to(tl.int64) * bt_cols",
        ),
        (
            "blk_next = tl.load(bt_row + first, mask=first < bt_cols, other=0)",
            "blk_next = (bt_row + first).to(tl.int32)",
        ),
        (
            "blk_next = tl.load(bt_row + col_next, mask=col_next < bt_cols, other=0)",
            "blk_next = (bt_row + col_next).to(tl.int32)",
        ),
    ],
    "no_merge": [("        if FUSED_COMBINE:\n", "        if FUSED_COMBINE and NUM_SPLITS < 0:\n")],
    "relaxed": [('sem="acq_rel"', 'sem="relaxed"')],
    "no_atomic": [
        (
            'if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == active - 1:',
            "if NUM_SPLITS < 0:",
        )
    ],
    "no_partials": [
        ("        tl.store(m_ws_ptr + ws + rows, m_i, mask=row_ok)\n", ""),
        ("        tl.store(l_ws_ptr + ws + rows, l_i, mask=row_ok)\n", ""),
        (
            "        tl.store(acc_ws_ptr + part_off, out.to(acc_ws_ptr.dtype.element_ty), "
            "mask=o_mask)\n",
            "",
        ),
    ],
    "no_ml": [
        ("        tl.store(m_ws_ptr + ws + rows, m_i, mask=row_ok)\n", ""),
        ("        tl.store(l_ws_ptr + ws + rows, l_i, mask=row_ok)\n", ""),
    ],
    "acc_to_out": [
        (
            "        tl.store(acc_ws_ptr + part_off, out.to(acc_ws_ptr.dtype.element_ty), "
            "mask=o_mask)\n",
            "        o_off = q_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]"
            " * stride_od\n"
            "        tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=o_mask)\n",
        )
    ],
    "ws_only": _NO_MERGE_PATH,
    "no_epilogue_bar": [
        ("    if NUM_SPLITS == 1:\n        o_off", "    if True:\n        o_off"),
        (
            "        tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=o_mask)\n"
            "    else:",
            "        tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=o_mask)\n"
            "        tl.debug_barrier()\n    else:",
        ),
    ],
    "persistent_ws": [
        (
            "        acc_ws = torch.empty((*ws, head_dim), dtype=q.dtype, device=q.device)\n"
            "        m_ws = torch.empty(ws, dtype=torch.float32, device=q.device)\n"
            "        l_ws = torch.empty(ws, dtype=torch.float32, device=q.device)\n",
            "        acc_ws, m_ws, l_ws = _persistent_ws(ws, head_dim, q.dtype, q.device)\n",
        ),
        (
            "def paged_attention(\n",
            "_WS = {}\n\n\ndef _persistent_ws(ws, head_dim, dtype, device):\n"
            "    key = (ws, head_dim, dtype, device)\n"
            "    if key not in _WS:\n"
            "        _WS[key] = (torch.empty((*ws, head_dim), dtype=dtype, device=device),\n"
            "                    torch.empty(ws, dtype=torch.float32, device=device),\n"
            "                    torch.empty(ws, dtype=torch.float32, device=device))\n"
            "    return _WS[key]\n\n\ndef paged_attention(\n",
        ),
    ],
    "ws_acc_only": _ML_DROP,
    "ws_shared": [
        *_ML_DROP,
        ("* NUM_SPLITS + split) * BLOCK_M\n", "* NUM_SPLITS) * BLOCK_M\n"),
    ],
    "out_split0": [
        ("    if NUM_SPLITS == 1:\n        o_off", "    if True:\n        o_off"),
        (
            "        tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=o_mask)\n"
            "    else:",
            "        tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), "
            "mask=o_mask & (split == 0))\n    else:",
        ),
    ],
    "ml_full": [
        (
            "        tl.store(m_ws_ptr + ws + rows, m_i, mask=row_ok)\n",
            "        tl.store(m_ws_ptr + ws + rows, m_i)\n",
        ),
        (
            "        tl.store(l_ws_ptr + ws + rows, l_i, mask=row_ok)\n",
            "        tl.store(l_ws_ptr + ws + rows, l_i)\n",
        ),
    ],
    "acc_only_fma": [
        *_ML_DROP,
        (
            "    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # this program's output, "
            "normalised\n",
            "    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # this program's output, "
            "normalised\n    for _ in tl.static_range(40):\n        out = out * 0.999 + 0.001\n",
        ),
    ],
    "one_ws": [
        (
            "        acc_ws = torch.empty((*ws, head_dim), dtype=q.dtype, device=q.device)\n"
            "        m_ws = torch.empty(ws, dtype=torch.float32, device=q.device)\n"
            "        l_ws = torch.empty(ws, dtype=torch.float32, device=q.device)\n",
            "        acc_ws, m_ws, l_ws, _ = _one_buffer(\n"
            "            ws, head_dim, q.dtype, q.device, 0, False\n"
            "        )\n",
        ),
        ("def paged_attention(\n", _ONE_BUFFER + "def paged_attention(\n"),
    ],
    "one_buf": [
        (
            "        acc_ws = torch.empty((*ws, head_dim), dtype=q.dtype, device=q.device)\n"
            "        m_ws = torch.empty(ws, dtype=torch.float32, device=q.device)\n"
            "        l_ws = torch.empty(ws, dtype=torch.float32, device=q.device)\n",
            "        acc_ws, m_ws, l_ws, cnt = _one_buffer(\n"
            "            ws, head_dim, q.dtype, q.device, grid0 * num_kv_heads, True\n"
            "        )\n",
        ),
        (
            "    counters = _split_counters(q.device, grid0 * num_kv_heads) if fused else out\n",
            "    counters = cnt if fused else out\n",
        ),
        ("def paged_attention(\n", _ONE_BUFFER + "def paged_attention(\n"),
    ],
    "l_only": [("        tl.store(m_ws_ptr + ws + rows, m_i, mask=row_ok)\n", "")],
    "ml_pad": _ML_PAD,
    "counter_pad": _COUNTER_PAD,
    "pad_both": [*_ML_PAD, *_COUNTER_PAD],
    "ml_line": _ML_LINE,
    "xchg": _XCHG,
    "ml_line_xchg": [*_ML_LINE, *_XCHG],
    "no_ml_xchg": [
        ("        tl.store(m_ws_ptr + ws + rows, m_i, mask=row_ok)\n", ""),
        ("        tl.store(l_ws_ptr + ws + rows, l_i, mask=row_ok)\n", ""),
        *_XCHG,
    ],
    "acc_plus_word": _ACC_PLUS_WORD,
    "acc_plus_line": _ACC_PLUS_LINE,
    "acc_plus_m": _ACC_PLUS_M,
    "acc_plus_l": _ACC_PLUS_L,
    "reload": _RELOAD,
    "one_store": [*_ML_DROP, _ONE_STORE],
    "one_store_atomic": _ONE_STORE_ATOMIC,
    "one_store_merge": _ONE_STORE_MERGE,
    "separate_merge": _SEPARATE_MERGE,
    "pdl_combine": _PDL_COMBINE,
    "one_store_reset": _ONE_STORE_RESET,
    "ticket_no_merge": _ticket("merged = out"),
    "ticket_merge_one": _ticket(_MERGE_ONE_MORE.replace("OTHERS", "tl.minimum(active, 2)")),
    "ticket_merge_all": _ticket(_MERGE_ONE_MORE.replace("OTHERS", "active")),
    "one_store_zero_merge": _ONE_STORE_ZERO_MERGE,
    "ptxas_O1": _ptxas("--opt-level=1"),
    "ptxas_cta4": _ptxas("--minnctapersm=4"),
    "ptxas_cta5": _ptxas("--minnctapersm=5"),
    "ptxas_cta6": _ptxas("--minnctapersm=6"),
    "acc_plus_outsum": _ACC_PLUS_OUTSUM,
    "ml_after": _ML_AFTER,
    "ws_only_after": [*_NO_MERGE_PATH, *_ML_AFTER],
    "merge_noinline": _MERGE_NOINLINE,
    "m_in_loop": _M_IN_LOOP,
    "reg80": _maxnreg(80),
    "reg72": _maxnreg(72),
    "m_in_acc": _M_IN_ACC,
    "unroll2": [
        (
            "        for j in range(lo, hi, NUM_SPLITS):\n",
            "        for j in tl.range(lo, hi, NUM_SPLITS, loop_unroll_factor=2):\n",
        )
    ],
    "no_epilogue": [
        ("    if NUM_SPLITS == 1:\n        o_off", "    if True:\n        o_off"),
    ],
    "dot_acc": _DOT_ACC,
    "fma_scale": _FMA_SCALE,
    "fma_dot": [*_FMA_SCALE, *_DOT_ACC],
    "l_after": _L_AFTER,
    "l_after_dot": [*_L_AFTER, *_DOT_ACC],
    "fma_dot_l_after": [*_FMA_SCALE, *_DOT_ACC, *_L_AFTER],
    "lazy_only": _LAZY,
    "lazy_ref": _LAZY_REF,
    "heads2": _head_groups(2),
    "heads4": _head_groups(4),
    "single_site": _SINGLE_SITE,
    "dup_acc_only": [*_ML_DROP, *_SINGLE_SITE[2:]],  # its repeated query rows only
    "site_nodup": _SINGLE_SITE[:2],  # its epilogue only
    "xchg_zero_merge": _ONE_STORE_XCHG_MERGE,
    "atomload_merge": _ONE_STORE_ATOMLOAD,
}

CASES = [  # (shape, batch, context)
    ("qwen2.5-0.5b", 64, 2048),
    ("qwen2.5-0.5b", 64, 8192),
    ("qwen2.5-0.5b", 8, 2048),
    ("qwen2.5-0.5b", 1, 8192),
    ("qwen2.5-0.5b", 256, 2048),
    ("smollm2-135m", 64, 2048),
    ("smollm2-135m", 8, 32768),
]


def main() -> None:
    import pagedctl.kernels.triton_attention as shipped

    args = sys.argv[2:]
    names = [a for a in args if "=" not in a] or list(VARIANTS)
    # FIELD=N: an AttentionConfig field for every kernel timed; splits=N forces the split count
    override = {k: int(v) for k, v in (a.split("=") for a in args if "=" in a)}
    splits = override.pop("splits", None)
    only = os.environ.get("VARIANT_CASES")  # e.g. "0,5": those rows of CASES only
    cases = [CASES[int(i)] for i in only.split(",")] if only else CASES
    mods = {"shipped": shipped} | {n: edited_copy(n, VARIANTS[n]) for n in names}
    lines = []
    for shape, batch, ctx in cases:
        d = sw.SHAPES[shape][2]
        table = _table(batch, -(-ctx // 16), True, "cuda")
        q, pools, lens, cu, _ = sw._pools(shape, batch, ctx, torch.bfloat16, 16, table)
        cfg = dataclasses.replace(sw._shipped(shape, batch), **override)
        stacks = {
            n: [
                functools.partial(
                    m.paged_attention, q, k, v, t, lens, cu, 1, ctx, d**-0.5, splits, cfg
                )
                for k, v, t in pools
            ]
            for n, m in mods.items()
        }
        ref = stacks["shipped"][0]().float()
        diffs = {n: (s[0]().float() - ref).abs().max().item() for n, s in stacks.items()}
        order = list(mods) + list(mods)[::-1]
        times: dict[str, list[float]] = {n: [] for n in mods}
        for n in order:
            times[n].append(per_call_ms(stacks[n]) * 1e3)
        base = sum(times["shipped"]) / 2
        cells = []
        for n in mods:
            us = sum(times[n]) / 2
            cells.append(f"{n} {us:6.2f} ({us / base:.3f}, diff {diffs[n]:.1e})")
        line = f"{shape[:5]} {batch:3d} x {ctx:5d}: " + "  ".join(cells)
        print(line, flush=True)
        lines.append(line)
        del pools, stacks, q
        torch.cuda.empty_cache()
    if len(sys.argv) > 1:
        pathlib.Path(sys.argv[1]).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

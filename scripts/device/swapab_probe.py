"""Is a decode loop with its dots turned over faster? `python3 scripts/device/swapab_probe.py
[OUT.txt]` (on the GPU; on the CPU under TRITON_INTERPRET=1 it only checks the outputs).

A prototype, timed against the shipped kernel and never shipped: decode attention whose two dots
put the KV tile's positions, then the head dimension, on the dot's M axis instead of the GQA
group's 7-16 query rows: scores^T = K @ q^T ([TILE_N, 16]) and out^T += V^T @ p^T ([D, 16]).
M is then 64, which on sm_90 is a warpgroup MMA (wgmma, operands straight from shared memory,
asynchronous) where the shipped kernel's M = 16 is mma.sync fed by ldmatrix; the softmax's row
maxima become column maxima. Everything else is the shipped kernel's: the block table read a tile
ahead, the round-robin split deal, per-column row sums, normalised partials and the fused merge
(`kernels.triton_splits._merge_splits`).

Per case (shape, batch, context, block 16, the policy's split count): the shipped kernel and the
prototype through an identity and a random table over the same caches, order shipped, swap, swap,
shipped for each table (`SWAP_CFG=TILE,WARPS,STAGES` sets the prototype's launch, default 64,4,3;
`SWAP_CASES=0,2` picks cases; `SWAP_ACC_ONLY=1` stores only each split's output rows, no
maxima, row sums or merge, as `variants.py ws_acc_only` does: wrong outputs, a cost only);
microseconds per call (`kernels.bench_timing.stack_ms`) and the largest difference between the
two outputs.
"""

from __future__ import annotations

import functools
import os
import pathlib
import sys

import torch
import triton
import triton.language as tl
from pagedctl.kernels.triton_splits import _merge_splits

LOG2E = 1.4426950408889634


@triton.jit
def _swap_decode(
    q_ptr, k_ptr, v_ptr, out_ptr, bt_ptr, seq_lens_ptr, acc_ws_ptr, m_ws_ptr, l_ws_ptr,
    counter_ptr, qk_scale, stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh, stride_bt, bt_cols,
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr, NUM_SPLITS: tl.constexpr, ACC_ONLY: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    first = (split * TILE_N + tl.arange(0, TILE_N)) // BLOCK_SIZE
    blk_next = tl.load(bt_row + first, mask=first < bt_cols, other=0)
    seq_len = tl.load(seq_lens_ptr + seq)
    num_tiles = tl.cdiv(seq_len, TILE_N)
    if NUM_SPLITS > 1:
        if num_tiles == 0 and split == 0:
            rows = tl.arange(0, BLOCK_M)
            dd = tl.arange(0, D)
            o_off = seq * stride_ot + (kvh * GROUP + rows)[:, None] * stride_oh + dd[None, :]
            zero = tl.zeros([BLOCK_M, D], tl.float32).to(out_ptr.dtype.element_ty)
            tl.store(out_ptr + o_off, zero, mask=(rows < GROUP)[:, None])
        if split >= num_tiles:
            return
    cols = tl.arange(0, BLOCK_M)  # the group's query heads, now the dots' N axis
    col_ok = cols < GROUP
    head = kvh * GROUP + cols % GROUP
    d = tl.arange(0, D)
    q_t = tl.load(
        q_ptr + seq.to(tl.int64) * stride_qt + head[None, :] * stride_qh + d[:, None],
        mask=col_ok[None, :],
        other=0.0,
    )  # [D, BLOCK_M]
    q_t = q_t.to(k_ptr.dtype.element_ty)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_acc = tl.zeros([TILE_N, BLOCK_M], tl.float32)
    acc_t = tl.zeros([D, BLOCK_M], tl.float32)
    k_head = k_ptr + kvh * stride_kh
    v_head = v_ptr + kvh * stride_vh
    for j in range(split, num_tiles, NUM_SPLITS):
        pos = j * TILE_N + tl.arange(0, TILE_N)
        pos_ok = pos < seq_len
        blk = blk_next.to(tl.int64)
        col_next = (pos + NUM_SPLITS * TILE_N) // BLOCK_SIZE
        blk_next = tl.load(bt_row + col_next, mask=col_next < bt_cols, other=0)
        off = pos % BLOCK_SIZE
        k = tl.load(
            k_head + blk[:, None] * stride_kb + off[:, None] * stride_ko + d[None, :],
            mask=pos_ok[:, None],
            other=0.0,
        )  # [TILE_N, D]
        s_t = tl.dot(k, q_t) * qk_scale  # [TILE_N, BLOCK_M], log2 domain
        s_t = tl.where(pos_ok[:, None], s_t, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s_t, 0))
        alpha = tl.exp2(m_i - m_new)
        p_t = tl.exp2(s_t - m_new[None, :])
        l_acc = l_acc * alpha[None, :] + p_t
        v = tl.load(
            v_head + blk[:, None] * stride_vb + off[:, None] * stride_vo + d[None, :],
            mask=pos_ok[:, None],
            other=0.0,
        )  # [TILE_N, D]
        acc_t = acc_t * alpha[None, :] + tl.dot(tl.trans(v), p_t.to(v.dtype))
        m_i = m_new
    l_i = tl.sum(l_acc, 0)
    out_t = acc_t / tl.where(l_i == 0.0, 1.0, l_i)[None, :]  # [D, BLOCK_M]
    if NUM_SPLITS == 1:
        o_off = seq * stride_ot + head[None, :] * stride_oh + d[:, None]
        tl.store(out_ptr + o_off, out_t.to(out_ptr.dtype.element_ty), mask=col_ok[None, :])
    elif ACC_ONLY:  # variants.py's ws_acc_only: the output rows alone (a cost, not a result)
        ws = ((seq.to(tl.int64) * tl.num_programs(1) + kvh) * NUM_SPLITS + split) * BLOCK_M
        part_off = (ws + cols)[None, :] * D + d[:, None]
        tl.store(acc_ws_ptr + part_off, out_t.to(acc_ws_ptr.dtype.element_ty), mask=col_ok[None, :])
    else:  # as the shipped kernel: a normalised partial, then the last split merges
        ws = ((seq.to(tl.int64) * tl.num_programs(1) + kvh) * NUM_SPLITS + split) * BLOCK_M
        tl.store(m_ws_ptr + ws + cols, m_i, mask=col_ok)
        tl.store(l_ws_ptr + ws + cols, l_i, mask=col_ok)
        part_off = (ws + cols)[None, :] * D + d[:, None]
        tl.store(acc_ws_ptr + part_off, out_t.to(acc_ws_ptr.dtype.element_ty), mask=col_ok[None, :])
        tl.debug_barrier()
        active = tl.minimum(num_tiles, NUM_SPLITS)
        counter = counter_ptr + seq * tl.num_programs(1) + kvh
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == active - 1:
            tl.store(counter, 0)
            _merge_splits(
                out_ptr, acc_ws_ptr, m_ws_ptr, l_ws_ptr, seq, kvh, tl.num_programs(1), seq, 0, 1,
                active, stride_ot, stride_oh, 1, GROUP, D, D, 1, BLOCK_M, NUM_SPLITS,
            )  # fmt: skip


def swap_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, splits, tile_n=64,
                   num_warps=4, num_stages=3):  # fmt: skip
    """Decode attention (one query token a sequence) through the prototype."""
    from proto_ab import split_workspace

    num_seqs, _, d = q.shape
    _, block, hkv, _ = k_cache.shape
    group, block_m, out, acc_ws, m_ws, l_ws, counters = split_workspace(q, hkv, splits)
    assert q.stride(2) == k_cache.stride(3) == v_cache.stride(3) == out.stride(2) == 1
    _swap_decode[(num_seqs, hkv, splits)](
        q, k_cache, v_cache, out, block_tables, seq_lens, acc_ws, m_ws, l_ws, counters,
        scale * LOG2E, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), block_tables.shape[1],
        GROUP=group, D=d, BLOCK_SIZE=block, BLOCK_M=block_m, TILE_N=tile_n, NUM_SPLITS=splits,
        ACC_ONLY=os.environ.get("SWAP_ACC_ONLY") == "1", num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out


CASES = [  # (shape, batch, context); block 16 (the engine's default)
    ("qwen2.5-0.5b", 64, 2048), ("smollm2-135m", 64, 2048), ("qwen2.5-0.5b", 64, 8192),
    ("qwen2.5-0.5b", 8, 32768), ("qwen2.5-0.5b", 8, 2048), ("qwen2.5-0.5b", 1, 8192),
]  # fmt: skip
BLOCK = 16


def check_cpu() -> None:
    """Against the reference op, under the interpreter: GQA groups, blocks, splits, NaN slots."""
    from pagedctl.kernels.reference import paged_attention as ref

    torch.manual_seed(0)
    for hq, hkv, block, lens, splits in [
        (14, 2, 16, [1, 17, 64, 130], 3),
        (9, 3, 32, [5, 64, 65, 200], 2),
        (4, 4, 64, [64, 300, 1, 129], 1),
        (14, 2, 16, [40, 90, 0, 7], 8),
    ]:
        d, nb = 64, 64
        k = torch.full((nb, block, hkv, d), float("nan"))
        v = torch.full((nb, block, hkv, d), float("nan"))
        per = max(-(-n // block) for n in lens)
        table = torch.randperm(nb)[: len(lens) * per].view(len(lens), per).to(torch.int32)
        for i, n in enumerate(lens):
            for p in range(n):
                b, o = table[i, p // block], p % block
                k[b, o] = torch.randn(hkv, d)
                v[b, o] = torch.randn(hkv, d)
        q = torch.randn(len(lens), hq, d)
        seq_lens = torch.tensor(lens, dtype=torch.int32)
        cu = torch.arange(len(lens) + 1, dtype=torch.int32)
        want = ref(q, k, v, table, seq_lens, cu, 1, max(lens), d**-0.5)
        got = swap_attention(q, k, v, table, seq_lens, d**-0.5, splits)
        live = seq_lens > 0
        err = (got[live] - want[live]).abs().max().item()
        print(f"hq {hq} hkv {hkv} block {block} lens {lens} splits {splits}: max err {err:.2e}")
        assert err < 1e-4, err
        assert (got[~live] == 0).all()


def main() -> None:
    from proto_ab import against_shipped

    tile, warps, stages = (int(x) for x in os.environ.get("SWAP_CFG", "64,4,3").split(","))
    picked = os.environ.get("SWAP_CASES")
    cases = [CASES[int(i)] for i in picked.split(",")] if picked else CASES
    lines = [f"prototype: tile {tile}, {warps} warps, {stages} stages"]
    print(lines[0], flush=True)
    proto = functools.partial(swap_attention, tile_n=tile, num_warps=warps, num_stages=stages)
    lines += against_shipped("swap", proto, cases, BLOCK)
    if len(sys.argv) > 1:
        pathlib.Path(sys.argv[1]).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        check_cpu()
    else:
        main()

"""Is a decode loop fed by TMA faster? `python3 scripts/device/tma_probe.py [OUT.txt]` (sm_90).

A prototype, timed against the shipped kernel and never shipped: decode attention over head-major
caches whose K and V tiles arrive by one tensor-descriptor (TMA) load each, a tile being one cache
block (block 64 here: 8 KB of K and 8 KB of V for a KV head), with the shipped kernel's split-KV
deal (round robin), partials and fused merge (`kernels.triton_splits._merge_splits`). Its loop has
no address arithmetic and no per-position gather: one thread issues each copy and an mbarrier says
when it landed (Triton 3.6 pipelines the descriptor loads two deep at `num_stages=5`).

Per case (shape, batch, context, block 64, the policy's split count): the shipped kernel and the
prototype through an identity and a random table over the same caches, order shipped, tma, tma,
shipped for each table; microseconds per call (`kernels.bench_timing.stack_ms`) and the largest
difference between the two outputs.
"""

from __future__ import annotations

import pathlib
import sys

import triton
import triton.language as tl
from pagedctl.kernels.triton_splits import _merge_splits
from triton.tools.tensor_descriptor import TensorDescriptor

LOG2E = 1.4426950408889634


@triton.jit
def _tma_tile(q, k, v, pos, seq_len, m_i, l_i, acc, qk_scale, MASKED: tl.constexpr):
    s = tl.dot(q, k.T) * qk_scale
    if MASKED:  # the sequence's last, partial block: its unused rows may hold anything
        ok = pos < seq_len
        s = tl.where(ok[None, :], s, float("-inf"))
        v = tl.where(ok[:, None], v, 0.0)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _tma_decode(
    q_ptr, k_desc, v_desc, out_ptr, bt_ptr, seq_lens_ptr, acc_ws_ptr, m_ws_ptr, l_ws_ptr,
    counter_ptr, qk_scale, stride_bt, stride_qt, stride_qh, stride_ot, stride_oh,
    H_KV: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr, NUM_SPLITS: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    n_full = seq_len // BLOCK
    nb = tl.cdiv(seq_len, BLOCK)
    if split >= nb:
        return
    rows = tl.arange(0, BLOCK_M)
    d = tl.arange(0, D)
    row_ok = rows < GROUP
    head = kvh * GROUP + rows % GROUP
    q_off = seq * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    for j in tl.range(split, n_full, NUM_SPLITS, num_stages=STAGES):
        row0 = (tl.load(bt_row + j) * H_KV + kvh) * BLOCK
        k = k_desc.load([row0, 0])
        v = v_desc.load([row0, 0])
        m_i, l_i, acc = _tma_tile(q, k, v, 0, 0, m_i, l_i, acc, qk_scale, False)
    if (nb > n_full) & ((n_full - split) % NUM_SPLITS == 0):  # the partial block is this split's
        row0 = (tl.load(bt_row + n_full) * H_KV + kvh) * BLOCK
        k = k_desc.load([row0, 0])
        v = v_desc.load([row0, 0])
        pos = n_full * BLOCK + tl.arange(0, BLOCK)
        m_i, l_i, acc = _tma_tile(q, k, v, pos, seq_len, m_i, l_i, acc, qk_scale, True)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if NUM_SPLITS == 1:
        o_off = seq * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:  # as the shipped kernel: a normalised partial, then the last split merges
        ws = ((seq.to(tl.int64) * H_KV + kvh) * NUM_SPLITS + split) * BLOCK_M
        tl.store(m_ws_ptr + ws + rows, m_i, mask=row_ok)
        tl.store(l_ws_ptr + ws + rows, l_i, mask=row_ok)
        part_off = (ws + rows)[:, None] * D + d[None, :]
        tl.store(acc_ws_ptr + part_off, out.to(acc_ws_ptr.dtype.element_ty), mask=row_ok[:, None])
        tl.debug_barrier()
        active = tl.minimum(nb, NUM_SPLITS)
        counter = counter_ptr + seq * H_KV + kvh
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == active - 1:
            tl.store(counter, 0)
            _merge_splits(
                out_ptr, acc_ws_ptr, m_ws_ptr, l_ws_ptr, seq, kvh, H_KV, seq, 0, 1, active,
                stride_ot, stride_oh, 1, GROUP, D, D, 1, BLOCK_M, NUM_SPLITS,
            )  # fmt: skip


def tma_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, splits, stages=5):
    """Decode attention (one query token a sequence) through the prototype; head-major caches
    (`kernels.empty_kv_cache`'s permuted views), tile = cache block."""
    from proto_ab import split_workspace

    num_seqs, _, d = q.shape
    _, block, hkv, _ = k_cache.shape
    k2 = k_cache.transpose(1, 2).reshape(-1, d)  # [blocks x heads x positions, dim], no copy
    v2 = v_cache.transpose(1, 2).reshape(-1, d)
    assert k2.data_ptr() == k_cache.data_ptr(), "the caches must be stored head-major"
    k_desc = TensorDescriptor.from_tensor(k2, [block, d])
    v_desc = TensorDescriptor.from_tensor(v2, [block, d])
    group, block_m, out, acc_ws, m_ws, l_ws, counters = split_workspace(q, hkv, splits)
    _tma_decode[(num_seqs, hkv, splits)](
        q, k_desc, v_desc, out, block_tables, seq_lens, acc_ws, m_ws, l_ws, counters,
        scale * LOG2E, block_tables.stride(0), q.stride(0), q.stride(1), out.stride(0),
        out.stride(1), H_KV=hkv, GROUP=group, D=d, BLOCK=block, BLOCK_M=block_m,
        NUM_SPLITS=splits, STAGES=stages, num_warps=4, num_stages=stages,
    )  # fmt: skip
    return out


CASES = [  # (shape, batch, context); block 64 (a tile is a block)
    ("qwen2.5-0.5b", 64, 2048), ("smollm2-135m", 64, 2048), ("qwen2.5-0.5b", 64, 8192),
    ("qwen2.5-0.5b", 8, 32768), ("smollm2-135m", 8, 32768), ("qwen2.5-0.5b", 1, 8192),
]  # fmt: skip
BLOCK = 64


def main() -> None:
    from proto_ab import against_shipped

    lines = against_shipped("tma", tma_attention, CASES, BLOCK)
    if len(sys.argv) > 1:
        pathlib.Path(sys.argv[1]).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

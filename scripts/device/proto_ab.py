"""The A/B harness of the decode prototypes (`tma_probe.py`, `swapab_probe.py`): a prototype
against the shipped kernel on the same caches, through an identity and a random block table.

Per case (shape, batch, context, at a block size): the policy's split count, then for each table
the order shipped, prototype, prototype, shipped; means of two, microseconds per call
(`kernels.bench_timing.per_call_ms`: layer-stacked graphs over distinct caches, as the benches time
them) and the largest difference between the two outputs. Returns the lines it printed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import pagedctl.kernels.sweep as sw
import torch
import triton
from pagedctl.kernels.bench_timing import _table, per_call_ms
from pagedctl.kernels.triton_attention import _device_info
from pagedctl.kernels.triton_splits import _split_counters, choose_num_splits


def split_workspace(q: torch.Tensor, num_kv_heads: int, splits: int):
    """(GQA group, rows a program, output, partial outputs, maxima, row sums, arrival counters) of a
    decode call with `splits` splits, laid out as the shipped kernel lays them out."""
    num_seqs, num_heads, d = q.shape
    group = num_heads // num_kv_heads
    block_m = max(16, triton.next_power_of_2(group))  # as `tile_shape` gives shipped decode
    ws = (num_seqs, num_kv_heads, splits, block_m)
    acc_ws = torch.empty((*ws, d), dtype=q.dtype, device=q.device)
    m_ws = torch.empty(ws, dtype=torch.float32, device=q.device)
    l_ws = torch.empty(ws, dtype=torch.float32, device=q.device)
    counters = _split_counters(q.device, num_seqs * num_kv_heads)
    return group, block_m, torch.empty_like(q), acc_ws, m_ws, l_ws, counters


# prototype(q, k_cache, v_cache, block_tables, seq_lens, scale, splits) -> output
Prototype = Callable[..., torch.Tensor]


def against_shipped(
    name: str, prototype: Prototype, cases: list[tuple[str, int, int]], block: int
) -> list[str]:
    sms = _device_info(torch.device("cuda"))[1]
    lines = []
    for shape, batch, ctx in cases:
        per_seq = -(-ctx // block)
        ident = _table(batch, per_seq, True, "cuda")
        rand = _table(batch, per_seq, False, "cuda")
        q, pools, lens, cu, scale = sw._pools(shape, batch, ctx, torch.bfloat16, block, ident)
        cfg = sw._shipped(shape, batch)
        splits = choose_num_splits(batch, sw.SHAPES[shape][1], ctx, sms, cfg.tile_n)
        cells = []
        for table_name, t in (("identity", ident), ("random", rand)):
            stacks = {
                "shipped": [
                    functools.partial(
                        sw.paged_attention, q, k, v, t, lens, cu, 1, ctx, scale, splits, cfg
                    )
                    for k, v, _ in pools
                ],
                name: [
                    functools.partial(prototype, q, k, v, t, lens, scale, splits)
                    for k, v, _ in pools
                ],
            }
            first = [stack[0]().float() for stack in stacks.values()]
            diff = (first[0] - first[1]).abs().max().item()
            times: dict[str, list[float]] = {w: [] for w in stacks}
            for who in ("shipped", name, name, "shipped"):
                times[who].append(per_call_ms(stacks[who]) * 1e3)
            a, b = (sum(times[w]) / 2 for w in ("shipped", name))
            cells.append(
                f"{table_name}: shipped {a:6.2f} {name} {b:6.2f} ({b / a:.3f}, diff {diff:.1e})"
            )
        line = f"{shape[:5]} {batch:3d} x {ctx:5d} b{block} splits {splits:2d}: " + "  ".join(cells)
        print(line, flush=True)
        lines.append(line)
        del pools, q
        torch.cuda.empty_cache()
    return lines

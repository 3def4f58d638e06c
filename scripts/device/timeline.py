"""Where a decode call's time goes: `python3 scripts/device/timeline.py [OUT.json [FIELD=N ...]
[variant=NAME] [cases=I,J]]` (fields of `AttentionConfig` to override in the shipped decode config;
a copy of `variants.py` to stamp instead of the shipped kernel; rows of the case list to run).

Runs an instrumented copy of kernels/triton_attention.py (made here by inserting timer reads, so
the shipped kernel is untouched) in the same layer-stack CUDA graph the benches time. Each program
records %globaltimer at its start, after its KV loop (behind a barrier that follows the loop's
last reduction, so every tile has arrived), and at its end (after the merge for the program that
merges), with its SM id. A plain read of the same bytes is stamped the same way. Printed per
shape (medians over the graph's layers, microseconds from the layer's first program start):

  launch    first to last program start       loop   median / max of a program's loop
  end50/end the median and last program end   merge  median time from loop end to end, merging
  gap       last end of a layer to the first start of the next (the graph's node-to-node time)
  percall   the uninstrumented kernel's time per call (`bench_timing.stack_ms`: graph launch
            excluded), and the instrumented one's
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import statistics
import sys

import pagedctl.kernels.sweep as sw
import torch
import triton
import triton.language as tl
from kernel_copy import edited_copy  # (scripts/device, the script's own folder)
from pagedctl.kernels.bench_timing import per_call_ms, read_grid
from pagedctl.kernels.triton_attention import _device_info, paged_attention


@triton.jit
def _now():
    """%globaltimer: nanoseconds, the same clock on every SM."""
    return tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
    )


@triton.jit
def _smid():
    return tl.inline_asm_elementwise(
        "mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1
    )


EDITS = [  # (anchor, replacement): each anchor must occur exactly once
    (
        "acc_ws_ptr, m_ws_ptr, l_ws_ptr, counter_ptr,\n    num_seqs, qk_scale,",
        "acc_ws_ptr, m_ws_ptr, l_ws_ptr, counter_ptr, stamp_ptr,\n    num_seqs, qk_scale,",
    ),
    (
        "    split = tl.program_id(2)\n    seq, qb_start = _query_block(",
        "    split = tl.program_id(2)\n    t0 = _now()\n    merged = 0\n"
        "    seq, qb_start = _query_block(",
    ),
    (
        "    l_i = tl.sum(l_acc, 1)\n",
        "    l_i = tl.sum(l_acc, 1)\n    tl.debug_barrier()\n    t1 = _now()\n",
    ),
    (
        "                tl.store(counter, 0)  # ready",
        "                merged = 1\n                tl.store(counter, 0)  # ready",
    ),
    (
        "\n\n@triton.jit\ndef _combine_splits(",
        "\n    t2 = _now()\n"
        "    at = stamp_ptr + ((pid * tl.num_programs(1) + kvh) * tl.num_programs(2) + split) * 5\n"
        "    tl.store(at, t0)\n    tl.store(at + 1, t1)\n    tl.store(at + 2, t2)\n"
        "    tl.store(at + 3, _smid().to(tl.int64))\n    tl.store(at + 4, merged)\n"
        "\n\n@triton.jit\ndef _combine_splits(",
    ),
    (
        "counters, num_seqs, softmax_scale * LOG2E,",
        "counters, STAMPS, num_seqs, softmax_scale * LOG2E,",
    ),
]


def instrumented(variant: str | None = None):
    """The stamped copy; with `variant`, that copy of `variants.py` stamped (its edits first)."""
    edits = EDITS
    if variant:
        from variants import VARIANTS  # (scripts/device)

        edits = [*VARIANTS[variant], *EDITS]
    mod = edited_copy(f"stamped_{variant or 'shipped'}", edits)
    mod._now, mod._smid, mod.STAMPS = _now, _smid, None  # what the inserted lines call
    return mod


@triton.jit
def _read_stamped(x_ptr, out_ptr, stamp_ptr, per_program, BLOCK: tl.constexpr):
    """`bench_timing._read_sum` with the same stamps (its loop's end is its end)."""
    t0 = _now()
    start = tl.program_id(0).to(tl.int64) * per_program
    acc = tl.zeros([BLOCK], tl.float32)
    for i in range(0, per_program, BLOCK):
        acc += tl.load(x_ptr + start + i + tl.arange(0, BLOCK)).to(tl.float32)
    total = tl.sum(acc)
    tl.debug_barrier()
    t1 = _now()
    tl.store(out_ptr + tl.program_id(0), total)
    at = stamp_ptr + tl.program_id(0) * 5
    tl.store(at, t0)
    tl.store(at + 1, t1)
    tl.store(at + 2, t1)
    tl.store(at + 3, _smid().to(tl.int64))
    tl.store(at + 4, 0)


def _capture(calls):
    """Replay a graph of `calls` a few times (the last replay's stamps stay in the buffers)."""
    for call in calls:
        call()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for call in calls:
            call()
    for _ in range(5):
        g.replay()
    torch.cuda.synchronize()


def summarize(stamps: list[torch.Tensor]) -> dict:
    """Medians over layers of the per-layer figures (microseconds); see the module docstring."""
    per = []
    rows = [s.cpu().tolist() for s in stamps]
    for i, r in enumerate(rows):
        r = [x for x in r if x[0] > 0]  # programs that returned early store nothing
        base = min(x[0] for x in r)
        t0 = sorted((x[0] - base) / 1e3 for x in r)
        loop = sorted((x[1] - x[0]) / 1e3 for x in r)
        end = sorted((x[2] - base) / 1e3 for x in r)
        merge = [(x[2] - x[1]) / 1e3 for x in r if x[4]]
        sms: dict[int, list] = {}
        for x in r:
            sms.setdefault(x[3], []).append((x[2] - base) / 1e3)
        by_count: dict[int, list] = {}
        for ends in sms.values():
            by_count.setdefault(len(ends), []).append(max(ends))
        fig = {
            "launch": t0[-1],
            "start50": t0[len(t0) // 2],
            "loop50": loop[len(loop) // 2],
            "loopmax": loop[-1],
            "end50": end[len(end) // 2],
            "end": end[-1],
            "merge50": statistics.median(merge) if merge else 0.0,
            "sms": len(sms),
            "sm_end_by_programs": {k: statistics.median(v) for k, v in sorted(by_count.items())},
        }
        if i + 1 < len(rows):
            nxt = [x[0] for x in rows[i + 1] if x[0] > 0]
            fig["gap"] = (min(nxt) - max(x[2] for x in r)) / 1e3
        per.append(fig)
    out = {}
    for key in per[0]:
        vals = [p[key] for p in per if key in p]
        if isinstance(vals[0], dict):
            out[key] = {k: statistics.median(v[k] for v in vals if k in v) for k in vals[0]}
        else:
            out[key] = statistics.median(vals)
    ticks = sorted({x for s in rows[:1] for p in s for x in (p[0] % 1000, p[1] % 1000)})
    out["timer_residues_ns"] = ticks[:8]
    return out


OVERRIDE: dict = {}  # AttentionConfig fields to replace in the shipped config (argv 2...)


def attention_case(mod, shape, batch, ctx, splits):
    q, pools, lens, cu, scale = sw._pools(shape, batch, ctx, torch.bfloat16)
    cfg = dataclasses.replace(sw._shipped(shape, batch), **OVERRIDE)
    sms = _device_info(q.device)[1]
    hkv = sw.SHAPES[shape][1]
    n_split = splits or mod.choose_num_splits(batch, hkv, ctx, sms, cfg.tile_n)
    n = batch * hkv * n_split
    stamps = [torch.zeros(n, 5, dtype=torch.int64, device="cuda") for _ in pools]

    def stamped(i, k, v, t):
        mod.STAMPS = stamps[i]
        return mod.paged_attention(q, k, v, t, lens, cu, 1, ctx, scale, splits, cfg)

    plain = [
        functools.partial(paged_attention, q, k, v, t, lens, cu, 1, ctx, scale, splits, cfg)
        for k, v, t in pools
    ]
    calls = [functools.partial(stamped, i, k, v, t) for i, (k, v, t) in enumerate(pools)]
    percall = per_call_ms(plain) * 1e3
    percall_stamped = per_call_ms(calls) * 1e3
    _capture(calls)
    fig = summarize(stamps)
    fig.update(percall=percall, percall_stamped=percall_stamped, splits=n_split,
               layers=len(pools))  # fmt: skip
    return fig


def read_case(nbytes, per_sm):
    sms = _device_info(torch.device("cuda"))[1]
    programs, per_program = read_grid(nbytes, sms * per_sm)
    layers = 8
    size = programs * per_program
    xs = [torch.ones(size, dtype=torch.float16, device="cuda") for _ in range(layers)]
    out = torch.empty(programs, dtype=torch.float32, device="cuda")
    stamps = [torch.zeros(programs, 5, dtype=torch.int64, device="cuda") for _ in xs]
    launch = _read_stamped[(programs,)]
    calls = [
        functools.partial(launch, x, out, s, per_program, BLOCK=4096, num_warps=8)
        for x, s in zip(xs, stamps, strict=True)
    ]
    percall = per_call_ms(calls) * 1e3
    _capture(calls)
    fig = summarize(stamps)
    fig.update(percall=percall, percall_stamped=percall, programs=programs, layers=layers)
    return fig


def main() -> None:
    args = dict(a.split("=") for a in sys.argv[2:])
    variant = args.pop("variant", None)  # a copy of variants.py, stamped instead of the shipped
    only = args.pop("cases", None)  # e.g. "0,5": those rows of the case list (reads always run)
    OVERRIDE.update((k, int(v)) for k, v in args.items())
    mod = instrumented(variant)
    results = []
    cases = [
        ("qwen2.5-0.5b", 64, 2048, None), ("qwen2.5-0.5b", 64, 2048, 2),
        ("qwen2.5-0.5b", 64, 2048, 4), ("qwen2.5-0.5b", 64, 2048, 1),
        # 66 x 2 heads x 3 splits = 396 programs, 3 on every SM of 132 (64 leaves 12 SMs with 2):
        # whether balancing the SMs (a stream-K decode) would shorten the tail
        ("qwen2.5-0.5b", 66, 2048, None),
        ("smollm2-135m", 64, 2048, None), ("qwen2.5-0.5b", 64, 8192, None),
        ("qwen2.5-0.5b", 256, 2048, None), ("qwen2.5-0.5b", 1, 512, None),
        ("qwen2.5-0.5b", 8, 2048, None),
    ]  # fmt: skip
    if only:
        cases = [cases[int(i)] for i in only.split(",")]
    keys = ("percall", "percall_stamped", "launch", "start50", "loop50", "loopmax", "end50",
            "end", "merge50", "gap")  # fmt: skip
    print("case                              " + " ".join(f"{k[:8]:>8}" for k in keys))
    for shape, batch, ctx, splits in cases:
        fig = attention_case(mod, shape, batch, ctx, splits)
        fig["case"] = f"{shape[:5]} {batch}x{ctx} splits {fig['splits']}"
        results.append(fig)
        print(f"{fig['case']:34s}" + " ".join(f"{fig.get(k, 0):8.2f}" for k in keys))
        print(f"{'':34s}SM end by programs/SM {fig['sm_end_by_programs']}  SMs {fig['sms']}")
        torch.cuda.empty_cache()
    for nbytes in (2 * 64 * 2048 * 2 * 64 * 2, 4 * 2 * 64 * 2048 * 2 * 64 * 2):
        for per_sm in (2, 4):
            fig = read_case(nbytes, per_sm)
            fig["case"] = f"read {nbytes >> 20} MB {per_sm}/SM"
            results.append(fig)
            print(f"{fig['case']:34s}" + " ".join(f"{fig.get(k, 0):8.2f}" for k in keys))
            print(f"{'':34s}SM end by programs/SM {fig['sm_end_by_programs']}")
            torch.cuda.empty_cache()
    print("timer residues (ns mod 1000) of the first layer:", results[0]["timer_residues_ns"])
    if len(sys.argv) > 1:
        pathlib.Path(sys.argv[1]).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

"""Decode and prefill attention on a CUDA device: `python -m benchmarks.kernels --out DIR`.

Makes results/kernels-h200.md and .json (one run per model, merged by `--render`). Reports, per
shape: time (median of `triton.testing.do_bench`), bytes moved, achieved bandwidth as a
fraction of this card's measured copy bandwidth; the paging overhead (random vs identity block
table); split-KV vs no split; and peers on a contiguous cache measured in the same run: SDPA and
compiled `flex_attention`, both with the GQA group folded into the query axis.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

from benchmarks.kernel_report import SPLIT_SCAN, write
from benchmarks.kernel_timing import (
    _ms,
    _pool,
    _table,
    copy_bandwidth,
    empty_kernel_ms,
    matmul_rate,
    num_layers,
    per_call_ms,
    read_floor_ms,
)
from pagedctl.envinfo import environment
from pagedctl.kernels import PagedBatch
from pagedctl.kernels.configs import lookup, phase_of
from pagedctl.kernels.triton_attention import _device_info, paged_attention
from pagedctl.kernels.triton_splits import choose_num_splits

SHAPES = {"qwen2.5-0.5b": (14, 2, 64), "smollm2-135m": (9, 3, 64)}


def decode_case(shape, batch, ctx, block, dtype, device, bandwidth, scan_splits=()) -> dict:
    hq, hkv, d = SHAPES[shape]
    q = torch.randn(batch, hq, d, dtype=dtype, device=device)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    cu = torch.arange(batch + 1, dtype=torch.int32, device=device)
    scale = d**-0.5
    kv_bytes = 2 * batch * ctx * hkv * d * q.element_size()
    layers = num_layers(kv_bytes)
    row = {"shape": shape, "batch": batch, "context": ctx, "block": block, "layers": layers}
    row["shared_table"] = True
    # Both tables index the same caches: the paging overhead compares block orders, not two
    # allocations (whose placement in memory alone moved the figure by a few percent). Each
    # serves every layer, as the engine's one table per step does.
    in_order = _table(batch, -(-ctx // block), True, device)
    shuffled = _table(batch, -(-ctx // block), False, device)
    pools = [_pool(batch, ctx, block, hkv, d, dtype, device, shuffled) for _ in range(layers)]
    paged = {
        True: PagedBatch(in_order, lens, cu, 1, ctx),
        False: PagedBatch(shuffled, lens, cu, 1, ctx),
    }

    def calls(identity: bool, splits: int | None = None, cfg=None):
        return [
            lambda k=k, v=v, b=paged[identity]: paged_attention(
                q, k, v, b, scale, num_splits=splits, config=cfg
            )
            for k, v, _ in pools
        ]

    # random, identity, identity, random, twice: a linear drift cancels in the two means
    order = [False, True, True, False] * 2
    times = [per_call_ms(calls(identity)) for identity in order]
    row["ms_random"] = sum(t for t, i in zip(times, order, strict=True) if not i) / 4
    row["ms_identity"] = sum(t for t, i in zip(times, order, strict=True) if i) / 4
    # each adjacent (random, identity) pair on its own: how far one pair's ratio strays
    pairs = [(times[0], times[1]), (times[3], times[2]), (times[4], times[5]), (times[7], times[6])]
    row["paging_overhead_pairs"] = [r / i - 1 for r, i in pairs]
    row["ms_one_split"] = per_call_ms(calls(False, 1))
    row["ms_eager"] = _ms(calls(False)[0])
    capability, sms = _device_info(device)
    shipped = lookup(capability, phase_of(True, batch, hkv, sms), d)
    row["splits_picked"] = choose_num_splits(batch, hkv, ctx, sms, shipped.tile_n)
    if row["splits_picked"] > 1:  # the same splits, merged the other way
        other = replace(shipped, fused_combine=not shipped.fused_combine)
        key = "ms_fused_combine" if other.fused_combine else "ms_combine_kernel"
        row[key] = per_call_ms(calls(False, None, other))
    row["ms_splits"] = {str(n): per_call_ms(calls(False, n)) for n in scan_splits}
    row["bytes"] = kv_bytes + 2 * q.nbytes
    row["bw_fraction"] = row["bytes"] / (row["ms_random"] * 1e-3) / bandwidth
    # the median pair: one stray timing (seen at 1.6 GB a layer, where a stack has 4 layers)
    # moves it less than the ratio of the means, either way
    row["paging_overhead"] = statistics.median(row["paging_overhead_pairs"])
    row["split_speedup"] = row["ms_one_split"] / row["ms_random"]
    return row


def peers(shape, batch, ctx, dtype, device, with_flex: bool) -> dict:
    """SDPA and compiled flex_attention on a contiguous cache, GQA folded into the query axis,
    timed the same way (a stack of layers with distinct caches in one CUDA graph), and a plain
    read of the same K/V bytes (`read_floor_ms`).

    flex_attention compiles once per shape (tens of seconds), so it runs at batch 64 x 2K and 8K.
    """
    hq, hkv, d = SHAPES[shape]
    g = hq // hkv
    q = torch.randn(batch, hkv, g, d, dtype=dtype, device=device)
    kv_bytes = 2 * batch * ctx * hkv * d * q.element_size()
    read_ms, grid = read_floor_ms(kv_bytes, device)
    layers = num_layers(kv_bytes)
    caches = [
        (
            torch.randn(batch, hkv, ctx, d, dtype=dtype, device=device),
            torch.randn(batch, hkv, ctx, d, dtype=dtype, device=device),
        )
        for _ in range(layers)
    ]
    sdpa = [lambda k=k, v=v: F.scaled_dot_product_attention(q, k, v) for k, v in caches]
    out = {"ms_sdpa": per_call_ms(sdpa), "ms_flex": None, "ms_read": read_ms, "read_per_sm": grid}
    if not with_flex:
        return out
    try:
        from torch.nn.attention.flex_attention import flex_attention

        flex = torch.compile(flex_attention, dynamic=False)
        out["ms_flex"] = per_call_ms([lambda k=k, v=v: flex(q, k, v) for k, v in caches])
    except Exception as e:  # report, do not hide: a peer that cannot run is a finding
        out["ms_flex"] = None
        out["flex_error"] = f"{type(e).__name__}: {str(e)[:120]}"
    return out


def prefill_case(shape, q_len, dtype, device, matmul_flops) -> dict:
    hq, hkv, d = SHAPES[shape]
    block = 16
    q = torch.randn(q_len, hq, d, dtype=dtype, device=device)
    k, v, table = _pool(1, q_len, block, hkv, d, dtype, device)
    lens = torch.tensor([q_len], dtype=torch.int32, device=device)
    cu = torch.tensor([0, q_len], dtype=torch.int32, device=device)
    paged = PagedBatch(table, lens, cu, q_len, q_len)
    ms = _ms(lambda: paged_attention(q, k, v, paged, d**-0.5))
    qs = q.transpose(0, 1)[None]
    ks = torch.randn(1, hkv, q_len, d, dtype=dtype, device=device)
    vs = torch.randn_like(ks)
    sdpa = _ms(lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True))
    flops = 4 * hq * d * q_len * (q_len + 1) / 2
    return {
        "shape": shape,
        "q_len": q_len,
        "ms": ms,
        "ms_sdpa_causal": sdpa,
        "floor_ms": flops / matmul_flops * 1e3,
        "flops": flops,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quick", action="store_true", help="a small sweep")
    p.add_argument(
        "--shapes", type=lambda s: s.split(","), default=list(SHAPES), help="comma-separated"
    )
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    p.add_argument("--batches", type=ints, help="comma-separated (default: 1,8,64,256)")
    p.add_argument("--contexts", type=ints, help="comma-separated (default: 512,...,32768)")
    p.add_argument(
        "--render",
        type=Path,
        nargs="+",
        metavar="JSON",
        help="rewrite the tables of kernels.json files (runs of different shapes: one table); "
        "needs no GPU",
    )
    a = p.parse_args()
    if a.render:
        runs = [json.loads(path.read_text()) for path in a.render]
        env = dict(runs[0]["environment"])
        if len(runs) > 1:
            env["runs"] = [r["environment"] for r in runs]
        rows = {key: [x for r in runs for x in r[key]] for key in ("decode", "peers", "prefill")}
        print(write(a.out, env, rows["decode"], rows["peers"], rows["prefill"]))
        return
    device, dtype = torch.device("cuda"), getattr(torch, a.dtype)
    bw, mm = copy_bandwidth(device), matmul_rate(dtype, device)
    env = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "copy_bandwidth_GBps": bw / 1e9,
        "matmul_TFLOPs": mm / 1e12,
        "dtype": a.dtype,
        "sms": _device_info(device)[1],
        "commit": environment()["commit"],
    }
    empty, launch = empty_kernel_ms(device)
    env.update(empty_kernel_us=empty * 1e3, graph_launch_us=launch * 1e3, shapes=a.shapes)
    batches, contexts = (
        ([1, 64], [2048, 8192]) if a.quick else ([1, 8, 64, 256], [512, 2048, 8192, 32768])
    )
    batches, contexts = a.batches or batches, a.contexts or contexts
    env.update(batches=batches, contexts=contexts)
    decode, peer_rows = [], []
    for shape in a.shapes:
        for batch in batches:
            for ctx in contexts:
                if batch * ctx > 256 * 8192:  # 256 x 32K would not be a decode batch anyone runs
                    continue
                for block in (16, 32, 64):
                    scan = SPLIT_SCAN if block == 16 and batch in (8, 64) else ()
                    decode.append(decode_case(shape, batch, ctx, block, dtype, device, bw, scan))
                peer_rows.append(
                    {
                        "shape": shape,
                        "batch": batch,
                        "context": ctx,
                        **peers(
                            shape,
                            batch,
                            ctx,
                            dtype,
                            device,
                            batch == 64 and ctx in (2048, 8192),
                        ),
                    }
                )
                torch.cuda.empty_cache()
                write(a.out, env, decode, peer_rows, [])
    prefill = []
    for s in a.shapes:
        for n in (1024, 4096, 16384):
            prefill.append(prefill_case(s, n, dtype, device, mm))
            write(a.out, env, decode, peer_rows, prefill)
    print(write(a.out, env, decode, peer_rows, prefill))
    assert math.isfinite(bw)


if __name__ == "__main__":
    main()

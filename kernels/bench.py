"""Decode and prefill attention benchmark on a CUDA device: `python -m kernels.bench --out DIR`.

Reports, per shape: time (median of `triton.testing.do_bench`), bytes moved, achieved bandwidth as a
fraction of this card's measured copy bandwidth; the paging overhead (random vs identity block
table); split-KV vs no split; and peers on a contiguous cache measured in the same run: SDPA and
compiled `flex_attention`, both with the GQA group folded into the query axis.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

from kernels.bench_timing import (
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
from kernels.configs import lookup, phase_of
from kernels.triton_attention import _device_info, paged_attention
from kernels.triton_splits import choose_num_splits

SHAPES = {"qwen2.5-0.5b": (14, 2, 64), "smollm2-135m": (9, 3, 64)}
SPLIT_SCAN = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)  # forced split counts timed at batch 8 and 64


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

    def calls(identity: bool, splits: int | None = None, cfg=None):
        return [
            lambda k=k, v=v, t=(in_order if identity else shuffled): paged_attention(
                q, k, v, t, lens, cu, 1, ctx, scale, splits, cfg
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
    ms = _ms(lambda: paged_attention(q, k, v, table, lens, cu, q_len, q_len, d**-0.5))
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


def fixed_and_streaming(decode: list[dict], bandwidth: float) -> list[dict]:
    """Per (shape, batch, block) over its contexts: the line time = fixed + bytes / rate that
    minimises the relative residuals, with the rate as a fraction of the copy bandwidth and the
    worst relative residual.

    Splits the shortfall of a short context into what every call pays once (the graph node's
    launch and drain, each program's dependent loads at its start, the merge at its end) and the
    streaming, which long contexts show on their own.
    """
    groups: dict[tuple, list[dict]] = {}
    for r in decode:
        groups.setdefault((r["shape"], r["batch"], r["block"]), []).append(r)
    fits = []
    for (shape, batch, block), rows in groups.items():
        if len(rows) < 3:
            continue
        xs = [r["bytes"] for r in rows]
        ys = [r["ms_random"] * 1e-3 for r in rows]
        ws = [1 / y**2 for y in ys]  # relative residuals: short contexts count as much as long
        sw, sx = sum(ws), sum(w * x for w, x in zip(ws, xs, strict=True))
        sy = sum(w * y for w, y in zip(ws, ys, strict=True))
        sxx = sum(w * x * x for w, x in zip(ws, xs, strict=True))
        sxy = sum(w * x * y for w, x, y in zip(ws, xs, ys, strict=True))
        slope = (sw * sxy - sx * sy) / (sw * sxx - sx * sx)
        fixed = (sy - slope * sx) / sw
        n = len(rows)
        worst = max(abs(fixed + slope * x - y) / y for x, y in zip(xs, ys, strict=True))
        fits.append(
            {"shape": shape, "batch": batch, "block": block, "contexts": n,
             "fixed_us": fixed * 1e6, "rate_fraction": 1 / slope / bandwidth,
             "worst_residual": worst}
        )  # fmt: skip
    return fits


def _spread(row: dict) -> str:
    """The least and most paging overhead of one adjacent pair of timings, as ` (lo..hi)`; empty
    for rows measured before the pairs were kept."""
    pairs = row.get("paging_overhead_pairs")
    return f" ({min(pairs):+.1%}..{max(pairs):+.1%})" if pairs else ""


def _run_note(env: dict) -> str:
    """What one run timed and at which commit (`PAGEDCTL_COMMIT` when it ran; `note`, set by hand
    in older JSONs, instead where present)."""
    if env.get("note"):
        return env["note"]
    if not env.get("commit"):
        return ""
    batches = ", ".join(str(b) for b in env.get("batches", []))
    return f"{' and '.join(env.get('shapes', []))} batches {batches} at {env['commit']}"


def write(out: Path, env: dict, decode: list, peer_rows: list, prefill: list) -> str:
    """kernels.json and kernels.md under `out` from the rows so far (called as rows land, so a
    run cut short by its time limit still leaves its tables)."""
    bw, mm = env["copy_bandwidth_GBps"] * 1e9, env["matmul_TFLOPs"] * 1e12
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernels.json").write_text(
        json.dumps(
            {"environment": env, "decode": decode, "peers": peer_rows, "prefill": prefill}, indent=1
        )
    )
    runs = env.get("runs", [env])
    copy = " and ".join(f"{r['copy_bandwidth_GBps']:.0f}" for r in runs)
    split_runs = (
        f" (in {len(runs)} runs: each row's % uses its own run's copy bandwidth)"
        if len(runs) > 1
        else ""
    )
    launch = (
        f"; a graph's own launch adds {env['graph_launch_us']:.1f} us to each replay (not in "
        "any figure below)"
        if "graph_launch_us" in env
        else ""
    )
    lines = [
        f"# Paged attention on {env['gpu']} ({env['dtype']})",
        "",
        f"copy bandwidth {copy} GB/s{split_runs}, matmul {mm / 1e12:.0f} TFLOP/s; torch "
        f"{env['torch']}, triton {env['triton']}; an empty kernel costs "
        f"{env['empty_kernel_us']:.1f} us per call in the same kind of graph{launch}",
        "",
    ]
    notes = [_run_note(r) for r in runs]
    if any(notes):
        lines += ["Runs: " + "; ".join(n for n in notes if n) + ".", ""]
    lines += [
        "Times are per call in a CUDA graph of back-to-back calls over distinct per-layer caches "
        "(as a decode step replays them; `layers` in the JSON; where `shared_table` is in the "
        "JSON, through one block table, as the engine's layers share one): what one more call "
        "adds to the "
        "graph (where `graph_launch_us` is in the JSON; before, a replay's time over its calls, "
        "the graph's launch included); eager: one call launched from "
        "Python each time; other combine: the same split count merged the way the shipped "
        "config does not (`f` = `fused_combine`, the last split merges in the same launch; "
        "`k` = a second, combine kernel), `-` where one split is chosen; paging overhead: the "
        "same caches through a random block table against an identity one, four timings of "
        "each, interleaved: the median of the four adjacent pairs' ratios (older tables: the "
        "ratio of the means), in brackets the least and most of them; plain read: a kernel that "
        "only streams the same K/V bytes in, "
        "timed the same way (the fastest of 2, 4, 8 programs per SM): what any decode kernel "
        "pays at this size.",
        "",
        "| shape | batch | ctx | block | us | eager us | % of copy bw | paging overhead "
        "| split speedup | other combine us | SDPA us | flex us | plain read us | x plain read |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    peer_of = {(r["shape"], r["batch"], r["context"]): r for r in peer_rows}
    for r in decode:
        pr = peer_of[(r["shape"], r["batch"], r["context"])]
        flex = "n/a" if pr["ms_flex"] is None else f"{pr['ms_flex'] * 1e3:.1f}"
        read = "n/a | n/a"
        if "ms_read" in pr:
            read = f"{pr['ms_read'] * 1e3:.1f} | {r['ms_random'] / pr['ms_read']:.2f}"
        fused = "-"
        for key, tag in (("ms_fused_combine", "f"), ("ms_combine_kernel", "k")):
            if key in r:
                fused = f"{r[key] * 1e3:.1f} {tag}"
        lines.append(
            f"| {r['shape']} | {r['batch']} | {r['context']} | {r['block']} | "
            f"{r['ms_random'] * 1e3:.1f} | {r['ms_eager'] * 1e3:.1f} | {r['bw_fraction']:.0%} | "
            f"{r['paging_overhead']:+.1%}{_spread(r)} | "
            f"{r['split_speedup']:.1f}x | {fused} | {pr['ms_sdpa'] * 1e3:.1f} | {flex} | "
            f"{read} |"
        )
    scan_cols = sorted({int(n) for r in decode for n in r["ms_splits"]}) or list(SPLIT_SCAN)
    lines += [
        "",
        "Forced split counts (block 16; us per call; `*` = the count `choose_num_splits` picks):",
        "",
        "| shape | batch | ctx | " + " | ".join(str(n) for n in scan_cols) + " |",
        "|---|---|---|" + "---|" * len(scan_cols),
    ]
    for r in decode:
        if not r["ms_splits"]:
            continue
        picked = r.get("splits_picked")  # (older runs did not record it: no mark)
        cells = []
        for n in scan_cols:
            ms = r["ms_splits"].get(str(n))
            cells.append("-" if ms is None else f"{ms * 1e3:.1f}{'*' if n == picked else ''}")
        head = f"| {r['shape']} | {r['batch']} | {r['context']} | "
        lines.append(head + " | ".join(cells) + " |")
    lines += [
        "",
        "Time against bytes over each row's contexts (`time = fixed + bytes / rate`, least "
        "squares of the relative residuals): what a call pays once, and the rate of its "
        "streaming; worst = the largest relative distance of a measured time from the line:",
        "",
        "| shape | batch | block | contexts | fixed us | rate, % of copy bw | worst |",
        "|---|---|---|---|---|---|---|",
    ]
    for f in fixed_and_streaming(decode, bw):
        lines.append(
            f"| {f['shape']} | {f['batch']} | {f['block']} | {f['contexts']} | "
            f"{f['fixed_us']:.1f} | {f['rate_fraction']:.0%} | {f['worst_residual']:.1%} |"
        )
    lines += [
        "",
        "| prefill shape | q_len | ms | floor ms | SDPA causal ms |",
        "|---|---|---|---|---|",
    ]
    for r in prefill:
        lines.append(
            f"| {r['shape']} | {r['q_len']} | {r['ms']:.3f} | {r['floor_ms']:.3f} | "
            f"{r['ms_sdpa_causal']:.3f} |"
        )
    (out / "kernels.md").write_text("\n".join(lines) + "\n")
    return "\n".join(lines)


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
        help="rewrite the tables of kernels.json files (runs of different shapes: one table), "
        "no GPU",
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
        "commit": os.environ.get("PAGEDCTL_COMMIT"),  # the caller's word (see scripts/device)
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

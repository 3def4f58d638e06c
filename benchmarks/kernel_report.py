"""The kernel benchmark's report: `kernels.json` and `kernels.md` from its rows (the decode table,
the forced split counts, time against bytes as a fixed cost and a streaming rate, the targets, the
peers, prefill), for one run or several merged (`python -m benchmarks.kernels --render A.json
B.json ...`). Needs no GPU.
"""

from __future__ import annotations

import json
from pathlib import Path

SPLIT_SCAN = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)  # forced split counts timed at batch 8 and 64


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


def targets(decode: list[dict], peer_rows: list[dict]) -> list[dict]:
    """The decode kernel's targets over the rows measured: per target, what is asked, the worst row
    and every row that misses it (as "shape batch x context block"). Targets whose rows were not
    measured (no batch >= 64 at 2K+, say) are left out.

    - bandwidth: batch >= 64 and context >= 2K reach 75% of the copy bandwidth
    - paging: a random block table costs under 3% against an identity one
    - splits: at batch 1 and context >= 8K, split-KV is at least 5x faster than one split
    - peers: no slower than the best peer (SDPA, compiled flex_attention) on the same shape
    """
    peer_of = {(r["shape"], r["batch"], r["context"]): r for r in peer_rows}

    def name(r: dict) -> str:
        return f"{r['shape']} {r['batch']} x {r['context']} block {r['block']}"

    def best_peer(r: dict) -> float:
        pr = peer_of[(r["shape"], r["batch"], r["context"])]
        return min(ms for ms in (pr["ms_sdpa"], pr.get("ms_flex")) if ms is not None)

    checks = [
        ("decode at batch >= 64, context >= 2K: share of the copy bandwidth", ">= 75%",
         lambda r: r["batch"] >= 64 and r["context"] >= 2048, lambda r: r["bw_fraction"],
         min, lambda v: v >= 0.75, "{:.1%}"),
        ("random block table against an identity one", "< +3%", lambda r: True,
         lambda r: r["paging_overhead"], max, lambda v: v < 0.03, "{:+.1%}"),
        ("split-KV against one split at batch 1, context >= 8K", ">= 5x",
         lambda r: r["batch"] == 1 and r["context"] >= 8192, lambda r: r["split_speedup"],
         min, lambda v: v >= 5, "{:.1f}x"),
        ("time against the best peer on the same shape", "<= 1.00x", lambda r: True,
         lambda r: r["ms_random"] / best_peer(r), max, lambda v: v <= 1.0, "{:.2f}x"),
    ]  # fmt: skip
    out = []
    for what, asked, applies, value, worst_of, holds, fmt in checks:
        rows = [r for r in decode if applies(r)]
        if not rows:
            continue
        worst = worst_of(rows, key=value)
        misses = [r for r in rows if not holds(value(r))]
        out.append(
            {"target": what, "asked": asked, "rows": len(rows), "worst": fmt.format(value(worst)),
             "worst_row": name(worst), "misses": [f"{name(r)}: {fmt.format(value(r))}"
                                                  for r in misses]}
        )  # fmt: skip
    return out


def _spread(row: dict) -> str:
    """The least and most paging overhead of one adjacent pair of timings, as ` (lo..hi)`."""
    pairs = row["paging_overhead_pairs"]
    return f" ({min(pairs):+.1%}..{max(pairs):+.1%})"


def _run_note(env: dict) -> str:
    """What one run timed and at which commit (the caller's `PAGEDCTL_COMMIT`, or git's)."""
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
    lines = [
        f"# Paged attention on {env['gpu']} ({env['dtype']})",
        "",
        f"copy bandwidth {copy} GB/s{split_runs}, matmul {mm / 1e12:.0f} TFLOP/s; torch "
        f"{env['torch']}, triton {env['triton']}; an empty kernel costs "
        f"{env['empty_kernel_us']:.1f} us per call in the same kind of graph; a graph's own "
        f"launch adds {env['graph_launch_us']:.1f} us to each replay (not in any figure below)",
        "",
    ]
    notes = [_run_note(r) for r in runs]
    if any(notes):
        lines += ["Runs: " + "; ".join(n for n in notes if n) + ".", ""]
    lines += [
        "Times are per call in a CUDA graph of back-to-back calls over distinct per-layer caches "
        "through one block table (as a decode step replays them; `layers` in the JSON): what "
        "one more call adds to the graph; eager: one call launched from Python each time; other "
        "combine: the same split count merged the way the shipped config does not (`f` = "
        "`fused_combine`, the last split merges in the same launch; `k` = a second, combine "
        "kernel), `-` where one split is chosen; paging overhead: the same caches through a "
        "random block table against an identity one, four timings of each, interleaved: the "
        "median of the four adjacent pairs' ratios, in brackets the least and most of them; "
        "plain read: a kernel that only streams the same K/V bytes in, timed the same way (the "
        "fastest of 2, 4, 8 programs per SM): what any decode kernel pays at this size.",
        "",
        "| shape | batch | ctx | block | us | eager us | % of copy bw | paging overhead "
        "| split speedup | other combine us | SDPA us | flex us | plain read us | x plain read |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    peer_of = {(r["shape"], r["batch"], r["context"]): r for r in peer_rows}
    for r in decode:
        pr = peer_of[(r["shape"], r["batch"], r["context"])]
        flex = "n/a" if pr["ms_flex"] is None else f"{pr['ms_flex'] * 1e3:.1f}"
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
        picked = r["splits_picked"]
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
    goals = targets(decode, peer_rows)
    if goals:
        lines += [
            "",
            "Targets over the rows above (`benchmarks.kernel_report.targets`):",
            "",
            "| target | asked | rows | worst | worst row | rows that miss |",
            "|---|---|---|---|---|---|",
        ]
        for g in goals:
            misses = "; ".join(g["misses"]) or "none"
            lines.append(
                f"| {g['target']} | {g['asked']} | {g['rows']} | {g['worst']} | "
                f"{g['worst_row']} | {misses} |"
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

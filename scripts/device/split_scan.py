"""Forced split counts at small batches: `python3 scripts/device/split_scan.py OUT.json`, and
`--render IN.json OUT.md` (no GPU) for the table of `results/kernels-splits-h200.md`.

For batch 1 and 8 (where the split policy decides most), every context of the bench and both
model shapes, the shipped config at the policy's count and at forced counts, through a random
block table, timed as `kernels.bench` times a call (layer-stack CUDA graphs,
`bench_timing.stack_ms`). The JSON keeps every time, to test split policies against offline.
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys

import pagedctl.kernels.sweep as sw
import torch
from pagedctl.kernels.bench_timing import per_call_ms
from pagedctl.kernels.triton_attention import _device_info, paged_attention
from pagedctl.kernels.triton_splits import choose_num_splits

SPLITS = (2, 4, 8, 12, 16, 24, 32)


def main() -> None:
    sms = _device_info(torch.device("cuda"))[1]
    rows = []
    for shape in sw.SHAPES:
        for batch in (1, 8):
            for ctx in (512, 2048, 8192, 32768):
                q, pools, lens, cu, scale = sw._pools(shape, batch, ctx, torch.bfloat16)
                cfg = sw._shipped(shape, batch)
                policy = choose_num_splits(batch, sw.SHAPES[shape][1], ctx, sms, cfg.tile_n)
                times = {}
                for n in sorted({policy, *SPLITS}):
                    calls = [
                        functools.partial(
                            paged_attention, q, k, v, t, lens, cu, 1, ctx, scale, n, cfg
                        )
                        for k, v, t in pools
                    ]
                    times[n] = per_call_ms(calls) * 1e3
                best = min(times, key=times.get)
                rows.append(
                    dict(
                        shape=shape,
                        batch=batch,
                        ctx=ctx,
                        tile_n=cfg.tile_n,
                        policy=policy,
                        us=times,
                        best=best,
                    )
                )
                cells = " ".join(
                    f"{n}{'*' if n == policy else ''}:{us:.1f}" for n, us in times.items()
                )
                print(f"{shape[:5]} {batch} x {ctx:5d}: {cells}  best {best}", flush=True)
                del q, pools
                torch.cuda.empty_cache()
    commit = os.environ.get("PAGEDCTL_COMMIT")  # the caller's word (see scripts/device/README)
    with open(sys.argv[1], "w") as f:
        json.dump({"sms": sms, "commit": commit, "rows": rows}, f, indent=1)


def _nearest(us: dict[int, float], n: int) -> float:
    """The time of the timed count nearest `n` (by ratio; the smaller one on a tie)."""
    return us[min(us, key=lambda k: (abs(math.log(k / n)), k))]


def render(data: dict) -> str:
    """The scan as a Markdown table: `o` = the count the policy picked when it ran (`policy` in
    the JSON), `n` = the count `choose_num_splits` picks now, **bold** = the fastest; then each
    policy's time over the fastest, as a geometric mean and at worst (where a pick was not
    timed, the nearest timed count stands in)."""
    sms, rows = data["sms"], data["rows"]
    cols = sorted({int(k) for r in rows for k in r["us"]})
    lines = [
        f"Commit {data.get('commit') or '(not recorded)'}, {sms} SMs; microseconds per call.",
        "",
        "| shape | batch x ctx | " + " | ".join(map(str, cols)) + " | now / best | then / best |",
        "|---|---|" + "---|" * len(cols) + "---|---|",
    ]
    now_ratio, then_ratio = [], []
    for r in rows:
        us = {int(k): v for k, v in r["us"].items()}
        best = min(us.values())
        now = choose_num_splits(r["batch"], sw.SHAPES[r["shape"]][1], r["ctx"], sms, r["tile_n"])
        cells = []
        for c in cols:
            if c not in us:
                cells.append("-")
                continue
            mark = ("o" if c == r["policy"] else "") + ("n" if c == now else "")
            cell = f"**{us[c]:.1f}**" if us[c] == best else f"{us[c]:.1f}"
            cells.append(cell + (f" {mark}" if mark else ""))
        now_ratio.append(_nearest(us, now) / best)
        then_ratio.append(us[r["policy"]] / best)
        untimed = "" if now in us else f" ({now}: nearest timed)"
        lines.append(
            f"| {r['shape']} | {r['batch']} x {r['ctx']} | " + " | ".join(cells)
            + f" | {now_ratio[-1]:.3f}{untimed} | {then_ratio[-1]:.3f} |"
        )  # fmt: skip

    def geo(xs: list[float]) -> float:
        return math.exp(sum(map(math.log, xs)) / len(xs))

    lines += [
        "",
        f"Over these {len(rows)} rows, today's policy is {geo(now_ratio):.3f}x the fastest forced "
        f"count (geometric mean; worst {max(now_ratio):.3f}), the policy of the run "
        f"{geo(then_ratio):.3f}x (worst {max(then_ratio):.3f}).",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if sys.argv[1] == "--render":
        with open(sys.argv[2]) as f:
            table = render(json.load(f))
        with open(sys.argv[3], "w") as f:
            f.write(table)
    else:
        main()

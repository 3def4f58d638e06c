"""Decode pipelined by hand (`AttentionConfig.prefetch`) against the shipped decode config:
`python3 scripts/device/prefetch_ab.py [OUT.json]`.

Every candidate runs on the same per-layer caches (random block tables, head-major storage) in the
layer-stack graph the benches use; the shipped config is timed first and last, the candidates in
between, and each line gives microseconds per call and the largest difference of a candidate's
output from the shipped one's on the first layer. At Qwen 64 x 2K each candidate also runs at
forced split counts.
"""

from __future__ import annotations

import functools
import json
import pathlib
import sys

import torch

import kernels.sweep as sw
from kernels.bench_timing import per_call_ms
from kernels.configs import AttentionConfig
from kernels.triton_attention import paged_attention

CANDIDATES = {
    "t64w4p1": AttentionConfig(16, 64, 4, 3, fused_combine=True, prefetch=1),
    "t64w4p2": AttentionConfig(16, 64, 4, 3, fused_combine=True, prefetch=2),
    "t32w4p1": AttentionConfig(16, 32, 4, 3, fused_combine=True, prefetch=1),
    "t32w4p2": AttentionConfig(16, 32, 4, 3, fused_combine=True, prefetch=2),
    "t64w8p1": AttentionConfig(16, 64, 8, 3, fused_combine=True, prefetch=1),
    "t64w8p2": AttentionConfig(16, 64, 8, 3, fused_combine=True, prefetch=2),
    "t128w8p1": AttentionConfig(16, 128, 8, 3, fused_combine=True, prefetch=1),
}
SCAN = (2, 3, 4, 6)


def _stack(case, ctx, cfg, splits=None):
    q, pools, lens, cu, scale = case
    return [
        functools.partial(paged_attention, q, k, v, t, lens, cu, 1, ctx, scale, splits, cfg)
        for k, v, t in pools
    ]


def main() -> None:
    rows = []
    names = ["shipped", *CANDIDATES]
    print(f"{'shape':22s}" + "".join(f"{n:>10s}" for n in names) + "   max|diff|")
    for shape in sw.SHAPES:
        for batch, ctx in sw.DECODE:
            case = sw._pools(shape, batch, ctx, torch.bfloat16)
            shipped = sw._shipped(shape, batch)
            stack = functools.partial(_stack, case, ctx)

            base = stack(shipped)[0]().float()
            us = {"shipped": per_call_ms(stack(shipped)) * 1e3}
            diff = 0.0
            for name, cfg in CANDIDATES.items():
                try:
                    diff = max(diff, (stack(cfg)[0]().float() - base).abs().max().item())
                    us[name] = per_call_ms(stack(cfg)) * 1e3
                except Exception as e:  # e.g. out of resources
                    print(name, type(e).__name__, e)
                    us[name] = float("nan")
            us["shipped"] = (us["shipped"] + per_call_ms(stack(shipped)) * 1e3) / 2
            label = f"{shape[:5]} {batch:3d} x {ctx:5d}"
            print(f"{label:22s}" + "".join(f"{us[n]:10.1f}" for n in names) + f"   {diff:.1e}")
            row = {"shape": shape, "batch": batch, "ctx": ctx, "us": us, "max_diff": diff}
            if shape.startswith("qwen") and (batch, ctx) == (64, 2048):
                scan = {}
                for name, cfg in [("shipped", shipped), *CANDIDATES.items()]:
                    scan[name] = {s: per_call_ms(stack(cfg, s)) * 1e3 for s in SCAN}
                    line = " ".join(f"{s}:{v:6.1f}" for s, v in scan[name].items())
                    print(f"  splits {name:9s}{line}")
                row["scan"] = scan
            rows.append(row)
            del case, stack
            torch.cuda.empty_cache()
    if len(sys.argv) > 1:
        pathlib.Path(sys.argv[1]).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

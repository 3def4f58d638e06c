"""Decode with and without `split_warps` (each warp its own slice of every KV tile):
`python3 scripts/device/split_warps.py [OUT.json]`.

For each case, the shipped config and split-warp configs (tile, warps, stages) at the split
policy's count and at forced counts, timed as `kernels.sweep` times a config (layer-stack CUDA
graphs through one random block table; `bench_timing.stack_ms`: what one more call adds). Each
line also gives the largest difference of the candidate's output from the shipped config's.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys

import torch

import kernels.sweep as sw
from kernels.bench_timing import per_call_ms
from kernels.triton_attention import paged_attention

CASES = {  # (shape, batch, context): forced split counts besides the policy's
    ("qwen2.5-0.5b", 64, 2048): (1, 2, 3),
    ("smollm2-135m", 64, 2048): (1, 2, 3),
    ("qwen2.5-0.5b", 64, 8192): (1, 2, 3),
    ("qwen2.5-0.5b", 64, 512): (1, 2),
    ("qwen2.5-0.5b", 8, 2048): (4, 8),
    ("qwen2.5-0.5b", 8, 32768): (8, 16),
    ("smollm2-135m", 8, 32768): (8, 16),
    ("qwen2.5-0.5b", 1, 8192): (8, 16),
    ("qwen2.5-0.5b", 256, 2048): (1,),
}
CANDIDATES = [(64, 4, 3), (128, 8, 3), (128, 4, 3)]


def main() -> None:
    rows = []
    for (shape, batch, ctx), forced in CASES.items():
        case = sw._pools(shape, batch, ctx, torch.bfloat16)
        q, pools, lens, cu, scale = case
        shipped = sw._shipped(shape, batch)
        k, v, t = pools[0]
        ref = paged_attention(q, k, v, t, lens, cu, 1, ctx, scale, None, shipped).float()
        cfgs = [("shipped", shipped)] + [
            (
                f"sw t{tile} w{warps} s{stages}",
                dataclasses.replace(
                    shipped, tile_n=tile, num_warps=warps, num_stages=stages, split_warps=True
                ),
            )
            for tile, warps, stages in CANDIDATES
        ]
        for name, cfg in cfgs:
            for splits in (None, *forced):
                if name == "shipped" and splits is not None and splits != 1 and batch >= 256:
                    continue
                try:
                    out = paged_attention(q, k, v, t, lens, cu, 1, ctx, scale, splits, cfg)
                    diff = (out.float() - ref).abs().max().item()
                    calls = [
                        functools.partial(
                            paged_attention, q, kk, vv, tt, lens, cu, 1, ctx, scale, splits, cfg
                        )
                        for kk, vv, tt in pools
                    ]
                    us = per_call_ms(calls) * 1e3
                except Exception as e:  # e.g. out of shared memory
                    print(f"{shape[:5]} {batch}x{ctx} {name} {splits}: {type(e).__name__} {e}")
                    continue
                row = dict(shape=shape, batch=batch, ctx=ctx, cfg=name, splits=splits or "policy")
                row.update(us=us, diff=diff)
                rows.append(row)
                print(
                    f"{shape[:5]} {batch:3d} x {ctx:5d} {name:16s} splits {splits or 'policy':>6}:"
                    f" {us:7.2f} us  diff {diff:.1e}",
                    flush=True,
                )
        del case, q, pools
        torch.cuda.empty_cache()
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump({"rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

"""Forced split counts at small batches: `python3 scripts/device/split_scan.py OUT.json`.

For batch 1 and 8 (where the split policy decides most), every context of the bench and both
model shapes, the shipped config at the policy's count and at forced counts, through a random
block table, timed as `kernels.bench` times a call (layer-stack CUDA graphs,
`bench_timing.stack_ms`). The JSON keeps every time, to test split policies against offline.
"""

from __future__ import annotations

import functools
import json
import sys

import torch

import kernels.sweep as sw
from kernels.bench_timing import per_call_ms
from kernels.triton_attention import _device_info, paged_attention
from kernels.triton_splits import choose_num_splits

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
                    dict(shape=shape, batch=batch, ctx=ctx, policy=policy, us=times, best=best)
                )
                cells = " ".join(
                    f"{n}{'*' if n == policy else ''}:{us:.1f}" for n, us in times.items()
                )
                print(f"{shape[:5]} {batch} x {ctx:5d}: {cells}  best {best}", flush=True)
                del q, pools
                torch.cuda.empty_cache()
    with open(sys.argv[1], "w") as f:
        json.dump({"sms": sms, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

"""Does a random block table cost less with more bytes in flight? `python3
scripts/device/tables_cfg.py OUT.json`

The shapes where a random table costs the shipped decode most (batch 8 x 32K), each through a
random and an identity table over the same caches, under the shipped config and split count and
under neighbours of it: more or fewer splits (programs in flight), a deeper pipeline (tiles in
flight per program), larger tiles. Order identity, random, random, identity; means of two.
Microseconds per call (`kernels.bench_timing.stack_ms`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import sys

import pagedctl.kernels.sweep as sw
import torch
from pagedctl.kernels.bench_timing import _table, per_call_ms
from pagedctl.kernels.triton_attention import _device_info
from pagedctl.kernels.triton_splits import choose_num_splits

SHAPES = [("qwen2.5-0.5b", 8, 32768, 16), ("qwen2.5-0.5b", 8, 32768, 32),
          ("smollm2-135m", 8, 32768, 16)]  # fmt: skip
VARIANTS = [  # (label, config fields, forced splits: None = the policy's)
    ("shipped", {}, None),
    ("splits 16", {}, 16),
    ("splits 32", {}, 32),
    ("stages 4", {"num_stages": 4}, None),
    ("tile 128", {"tile_n": 128}, None),
    ("warps 8", {"num_warps": 8}, None),
]


def main() -> None:
    out = pathlib.Path(sys.argv[1])
    sms = _device_info(torch.device("cuda"))[1]
    rows = []
    for shape, batch, ctx, block in SHAPES:
        per_seq = -(-ctx // block)
        ident = _table(batch, per_seq, True, "cuda")
        rand = _table(batch, per_seq, False, "cuda")
        q, pools, lens, cu, scale = sw._pools(shape, batch, ctx, torch.bfloat16, block, ident)
        for label, fields, splits in VARIANTS:
            cfg = dataclasses.replace(sw._shipped(shape, batch), **fields)
            n = splits or choose_num_splits(batch, sw.SHAPES[shape][1], ctx, sms, cfg.tile_n)
            stacks = {
                name: [
                    functools.partial(
                        sw.paged_attention, q, k, v, t, lens, cu, 1, ctx, scale, n, cfg
                    )
                    for k, v, _ in pools
                ]
                for name, t in (("identity", ident), ("random", rand))
            }
            times: dict[str, list[float]] = {"identity": [], "random": []}
            for name in ("identity", "random", "random", "identity"):
                times[name].append(per_call_ms(stacks[name]) * 1e3)
            us = {k: sum(v) / 2 for k, v in times.items()}
            row = dict(shape=shape, batch=batch, ctx=ctx, block=block, variant=label,
                       splits=n, cfg=cfg.__dict__, us=us, times=times)  # fmt: skip
            rows.append(row)
            print(f"{shape[:5]} {batch} x {ctx} b{block} {label:10s} splits {n:2d}: identity "
                  f"{us['identity']:6.2f} random {us['random']:6.2f} us "
                  f"({us['random'] / us['identity'] - 1:+.1%})", flush=True)  # fmt: skip
        del pools, q
        torch.cuda.empty_cache()
    out.write_text(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()

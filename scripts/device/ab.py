"""A/B of the decode kernel: `python scripts/device/ab.py OLD.py`, where OLD.py is an older copy of
kernels/triton_attention.py (`git show REV:kernels/triton_attention.py > /tmp/old.py`, carried to
the device as an untracked file). Same shapes, shipped configs and split policy, layer-stacked
graphs as `kernels.sweep` times them, in the order old, new, new, old (means of two); each line
also gives the largest difference between the two kernels' outputs on its first layer. Through a
random block table; `AB_TABLES=random,identity` times each shape through both, over the same
caches; `AB_DECODE=64x2048,8x32768` replaces the (batch, context) list."""

import functools
import importlib.util
import os
import sys

import pagedctl.kernels.sweep as sw
import pagedctl.kernels.triton_attention as new
import torch
from pagedctl.kernels.bench_timing import _table, per_call_ms

spec = importlib.util.spec_from_file_location("old_attention", sys.argv[1])
old = importlib.util.module_from_spec(spec)
spec.loader.exec_module(old)


def ab(label, q, pools, table, lens, cu, ctx, scale, cfg) -> None:
    stacks = {
        name: [
            functools.partial(m.paged_attention, q, k, v, table, lens, cu, 1, ctx, scale, None, cfg)
            for k, v, _ in pools
        ]
        for name, m in (("old", old), ("new", new))
    }
    diff = (stacks["old"][0]().float() - stacks["new"][0]().float()).abs().max().item()
    t = {"old": [], "new": []}
    for name in ("old", "new", "new", "old"):
        t[name].append(per_call_ms(stacks[name]) * 1e3)
    o, n = sum(t["old"]) / 2, sum(t["new"]) / 2
    print(f"{label}: old {o:6.1f} us  new {n:6.1f} us  {n / o:.3f}  max |new - old| {diff:.2e}")


kinds = os.environ.get("AB_TABLES", "random").split(",")
decode = sw.DECODE
if os.environ.get("AB_DECODE"):  # e.g. AB_DECODE=64x2048,8x32768
    decode = [tuple(int(n) for n in s.split("x")) for s in os.environ["AB_DECODE"].split(",")]
for shape in sw.SHAPES:
    for batch, ctx in decode:
        q, pools, lens, cu, scale = sw._pools(shape, batch, ctx, torch.bfloat16)
        cfg = sw._shipped(shape, batch)
        for kind in kinds:
            table = pools[0][2] if kind == "random" else _table(batch, -(-ctx // 16), True, "cuda")
            label = f"{shape[:5]} {batch:4d} x {ctx:5d} {kind:8s}"
            ab(label, q, pools, table, lens, cu, ctx, scale, cfg)
        del q, pools
        torch.cuda.empty_cache()

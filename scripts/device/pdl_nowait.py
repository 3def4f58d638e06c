"""Upper bound of a decode attention that never waits for `write_kv` (timing only): `python3
scripts/device/pdl_nowait.py`.

A decode attention that took the newest token's K/V from its inputs (instead of the cache slot
`write_kv` fills) would read nothing `write_kv` writes, so a programmatic launch behind it could
stream the whole history while `write_kv` runs. This builds a copy of the kernel whose
`griddepcontrol.wait` comes after the loop instead of before the first K/V load (it may read the
newest slot before it is written: its outputs are not checked, only timed) and times, per shape,
the shipped launch (no PDL), PDL as shipped (wait before the loads) and the late wait: attention
alone in a stack of layers, and behind `write_kv` (the pair less a stack of the writes alone),
in the order base, pdl, late, late, pdl, base.
"""

import functools
import importlib.util
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import pagedctl.kernels.sweep as sw
import pagedctl.kernels.triton_attention as shipped
import torch
from pagedctl.kernels.bench_timing import per_call_ms
from pagedctl.kernels.triton_kv import write_kv

src = Path(shipped.__file__).read_text()
early = """    if PDL:
        # A programmatic dependent launch"""
assert early in src
src = src.replace(
    early,
    """    if False:
        # A programmatic dependent launch""",
)
late = """    if PDL:
        gdc_launch_dependents()"""
assert late in src
src = src.replace(
    late,
    """    if PDL:
        gdc_wait()
        gdc_launch_dependents()""",
)
path = Path(tempfile.mkdtemp()) / "late_wait_attention.py"
path.write_text(src)
spec = importlib.util.spec_from_file_location("late_wait_attention", path)
late_mod = importlib.util.module_from_spec(spec)
sys.modules["late_wait_attention"] = late_mod
spec.loader.exec_module(late_mod)

SHAPES = [("qwen2.5-0.5b", 64, 2048), ("smollm2-135m", 64, 2048), ("qwen2.5-0.5b", 64, 8192),
          ("qwen2.5-0.5b", 256, 2048), ("qwen2.5-0.5b", 1, 8192)]  # fmt: skip
for shape, batch, ctx in SHAPES:
    q, pools, lens, cu, scale = sw._pools(shape, batch, ctx, torch.bfloat16)
    _, hkv, d = sw.SHAPES[shape]
    last = lens.long() - 1
    new = torch.randn(2, batch, hkv, d, dtype=torch.bfloat16, device="cuda")
    slots = [t.long().gather(1, (last // 16)[:, None])[:, 0] * 16 + last % 16 for _, _, t in pools]
    base_cfg = sw._shipped(shape, batch)
    variants = {"base": (shipped, base_cfg), "pdl": (shipped, replace(base_cfg, pdl=True)),
                "late": (late_mod, replace(base_cfg, pdl=True))}  # fmt: skip
    stacks = {}
    for name, (mod, cfg) in variants.items():
        writes = [
            functools.partial(write_kv, new[0], new[1], k, v, at, release_dependents=cfg.pdl)
            for (k, v, _), at in zip(pools, slots, strict=True)
        ]
        attn = [
            functools.partial(mod.paged_attention, q, k, v, t, lens, cu, 1, ctx, scale, None, cfg)
            for k, v, t in pools
        ]
        pairs = [c for pair in zip(writes, attn, strict=True) for c in pair]
        stacks[name] = (writes, attn, pairs)
    times: dict = {n: [] for n in variants}
    for name in ["base", "pdl", "late", "late", "pdl", "base"]:
        writes, attn, pairs = stacks[name]
        w = per_call_ms(writes)
        times[name].append((per_call_ms(attn), 2 * per_call_ms(pairs) - w, w))
    line = f"{shape[:5]} {batch:4d} x {ctx:5d}:"
    for name, ts in times.items():
        alone, after, w = (sum(x) / len(ts) * 1e3 for x in zip(*ts, strict=True))
        line += f"  {name} alone {alone:6.1f} after write_kv {after:6.1f} (write {w:.1f})"
    print(line)
    del q, pools, stacks
    torch.cuda.empty_cache()

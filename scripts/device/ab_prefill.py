"""A/B of prefill attention: `python3 scripts/device/ab_prefill.py OLD.py`, where OLD.py is an
older copy of kernels/triton_attention.py (carried as an untracked file). One sequence of
`q_len` tokens without history, as `kernels.bench.prefill_case` times it (median of do_bench),
in the order old, new, new, old, beside SDPA causal; each line also gives the largest
difference between the two kernels' outputs."""

import functools
import importlib.util
import sys

import pagedctl.kernels.triton_attention as new
import torch
import torch.nn.functional as F
from pagedctl.kernels.bench import SHAPES
from pagedctl.kernels.bench_timing import _pool
from triton.testing import do_bench

spec = importlib.util.spec_from_file_location("old_attention", sys.argv[1])
old = importlib.util.module_from_spec(spec)
spec.loader.exec_module(old)
dev, dtype = torch.device("cuda"), torch.bfloat16
for shape, (hq, hkv, d) in SHAPES.items():
    for n in (1024, 4096, 16384):
        q = torch.randn(n, hq, d, dtype=dtype, device=dev)
        k, v, table = _pool(1, n, 16, hkv, d, dtype, dev)
        lens = torch.tensor([n], dtype=torch.int32, device=dev)
        cu = torch.tensor([0, n], dtype=torch.int32, device=dev)
        args = (q, k, v, table, lens, cu, n, n, d**-0.5)
        calls = {m.__name__: functools.partial(m.paged_attention, *args) for m in (old, new)}
        diff = (calls[old.__name__]().float() - calls[new.__name__]().float()).abs().max().item()
        t = {name: [] for name in calls}
        for name in (old.__name__, new.__name__, new.__name__, old.__name__):
            t[name].append(do_bench(calls[name], warmup=10, rep=50, return_mode="median"))
        o, w = (sum(t[m.__name__]) / 2 for m in (old, new))
        qs = q.transpose(0, 1)[None]
        ks = torch.randn(1, hkv, n, d, dtype=dtype, device=dev)
        vs = torch.randn_like(ks)
        sdpa = do_bench(
            lambda qs=qs, ks=ks, vs=vs: F.scaled_dot_product_attention(
                qs, ks, vs, is_causal=True, enable_gqa=True
            ),
            warmup=10, rep=50, return_mode="median",
        )  # fmt: skip
        print(
            f"{shape[:5]} {n:6d}: old {o:.3f} ms  new {w:.3f} ms  {w / o:.3f}  SDPA causal "
            f"{sdpa:.3f} ms  max |new - old| {diff:.2e}"
        )
        torch.cuda.empty_cache()

"""Host-side cost of one eager `paged_attention` call on CUDA: `python -m kernels.launch_cost`.

Times the Python side only (no synchronisation inside the loop), for the whole wrapper and for
its parts, so the eager overhead can be attributed: our wrapper's host work vs Triton's launcher.
"""

from __future__ import annotations

import functools
import time

import torch
from pagedctl.kernels import triton_attention as ta


def _us(fn, n: int = 2000) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return host


def main() -> None:
    dev, dt = torch.device("cuda"), torch.bfloat16
    for batch, hq, hkv in ((1, 14, 2), (64, 14, 2), (64, 9, 3)):
        ctx, bs, d = 2048, 16, 64
        nb = batch * ctx // bs
        k = torch.randn(nb, bs, hkv, d, dtype=dt, device=dev)
        v = torch.randn_like(k)
        table = torch.randperm(nb, device=dev).view(batch, -1).to(torch.int32)
        q = torch.randn(batch, hq, d, dtype=dt, device=dev)
        lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
        cu = torch.arange(batch + 1, dtype=torch.int32, device=dev)
        call = functools.partial(ta.paged_attention, q, k, v, table, lens, cu, 1, ctx, 0.125)
        full = _us(call)
        one = _us(functools.partial(call, 1))
        empty = _us(functools.partial(torch.empty, (batch, hkv, 8, 16, 128), device=dev))
        print(
            f"batch {batch} heads {hq}/{hkv}: wrapper+launches {full:.1f} us, one split "
            f"(one launch) {one:.1f} us, one torch.empty {empty:.1f} us"
        )


if __name__ == "__main__":
    main()

"""Rotary then `write_kv` (two launches) against `rotary_write_kv` (one), on the engine's cache
layout: `python3 scripts/device/rotary_kv_ab.py`. Qwen2.5-0.5B heads (14 q, 2 KV, 64), q/k/v as
views of one fused qkv output, head-major block-16 caches, random slots and positions; T tokens a
call, T = 8, 256 (decode batches) and 2048, 16384 (prefill chunks). Eager: CUDA events around
50 calls after a warm-up, the order two, one, one, two (means of two); microseconds a call."""

import torch
from pagedctl.kernels import triton_fused as tf
from pagedctl.kernels.triton_kv import write_kv

from pagedctl import kernels

HQ, HKV, D, BLOCK = 14, 2, 64, 16


def _us(fn, n: int = 50) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / n


def main() -> None:
    dev, dtype = "cuda", torch.bfloat16
    for t in (8, 256, 2048, 16384):
        qkv = torch.randn(t, (HQ + 2 * HKV) * D, device=dev, dtype=dtype)
        q = qkv[:, : HQ * D].view(t, HQ, D)
        k = qkv[:, HQ * D : (HQ + HKV) * D].view(t, HKV, D)
        v = qkv[:, (HQ + HKV) * D :].view(t, HKV, D)
        blocks = 4 * t // BLOCK + 8
        kv = kernels.empty_kv_cache(1, blocks, BLOCK, HKV, D, dtype, dev)[0]
        slots = torch.randperm(blocks * BLOCK, device=dev)[:t]
        pos = torch.randint(0, 4096, (t,), device=dev)
        cos = torch.randn(8192, D // 2, device=dev, dtype=dtype)
        sin = torch.randn(8192, D // 2, device=dev, dtype=dtype)

        args = (q, k, v, cos, sin, pos, kv[0], kv[1], slots)

        def two(q, k, v, cos, sin, pos, kc, vc, slots):
            tf.rotary(q, k, cos, sin, pos)
            write_kv(k, v, kc, vc, slots)

        def one(*a):
            tf.rotary_write_kv(*a)

        times = {"two": [], "one": []}
        for name, fn in (("two", two), ("one", one), ("one", one), ("two", two)):
            times[name].append(_us(lambda fn=fn, args=args: fn(*args)))
        a, b = sum(times["two"]) / 2, sum(times["one"]) / 2
        print(f"T {t:6d}: rotary + write_kv {a:8.1f} us  rotary_write_kv {b:8.1f} us  {b / a:.3f}")


if __name__ == "__main__":
    main()

"""Diagnostic: decode attention at 256 x 1088 (Qwen2.5-0.5B heads) on per-layer pools vs the
engine's layout (one [L, 2, N, 16, 2, 64] tensor of ~100 GB, contiguous blocks per sequence)."""

import torch

from kernels.bench_timing import per_call_ms
from kernels.triton_attention import paged_attention

B, CTX, L, BS, HKV, D, HQ = 256, 1088, 24, 16, 2, 64, 14
per = CTX // BS
dt = torch.bfloat16
q = torch.randn(B, HQ, D, dtype=dt, device="cuda")
lens = torch.full((B,), CTX, dtype=torch.int32, device="cuda")
cu = torch.arange(B + 1, dtype=torch.int32, device="cuda")
ids = torch.arange(B * per, device="cuda").view(B, per).to(torch.int32)
small = [torch.randn(2, B * per, BS, HKV, D, dtype=dt, device="cuda") for _ in range(L)]
calls = [
    lambda kv=kv: paged_attention(q, kv[0], kv[1], ids, lens, cu, 1, 32768, 0.125) for kv in small
]
print(f"per-layer pools: {per_call_ms(calls) * 1e3:.1f} us")
del small, calls
n = int(100e9 // (L * 2 * BS * HKV * D * 2))
big = torch.empty(L, 2, n, BS, HKV, D, dtype=dt, device="cuda")
big[:, :, : B * per].normal_()
calls = [
    lambda i=i: paged_attention(q, big[i, 0], big[i, 1], ids, lens, cu, 1, 32768, 0.125)
    for i in range(L)
]
print(f"engine layout, {n} blocks: {per_call_ms(calls) * 1e3:.1f} us")
far = (ids.long() * (n // (B * per))).to(torch.int32)
calls = [
    lambda i=i: paged_attention(q, big[i, 0], big[i, 1], far, lens, cu, 1, 32768, 0.125)
    for i in range(L)
]
print(f"engine layout, blocks spread over the pool: {per_call_ms(calls) * 1e3:.1f} us")

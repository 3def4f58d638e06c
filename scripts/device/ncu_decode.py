"""One decode attention shape, launched eagerly a few times, for Nsight Compute to profile:
`ncu -k regex:_attn_fwd --launch-skip 3 --launch-count 1 python3 scripts/device/ncu_decode.py
SHAPE BATCH CTX [SPLITS TILE WARPS STAGES FUSED]` (no config = the shipped one and its policy)."""

import sys

import torch
from pagedctl.kernels.bench import SHAPES
from pagedctl.kernels.bench_timing import _pool
from pagedctl.kernels.configs import AttentionConfig
from pagedctl.kernels.triton_attention import paged_attention

shape, batch, ctx = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
splits, cfg = None, None
if len(sys.argv) > 4:
    splits = int(sys.argv[4])
    tile, warps, stages, fused = (int(x) for x in sys.argv[5:9])
    cfg = AttentionConfig(16, tile, warps, stages, fused_combine=bool(fused))
hq, hkv, d = SHAPES[shape]
k, v, table = _pool(batch, ctx, 16, hkv, d, torch.bfloat16, "cuda")
q = torch.randn(batch, hq, d, dtype=torch.bfloat16, device="cuda")
lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
cu = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
for _ in range(6):
    paged_attention(q, k, v, table, lens, cu, 1, ctx, d**-0.5, splits, cfg)
torch.cuda.synchronize()

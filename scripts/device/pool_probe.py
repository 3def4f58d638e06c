"""Decode attention through the engine's own KV pool against the kernel bench's pools:
`python3 scripts/device/pool_probe.py OUT.json [BATCH:CONTEXT ...]` (default 256:1074 64:1074).

Session 13's engine profile (`python -m pagedctl.bench_step --profile`) timed `_attn_fwd` at 44.7 us
a call for Qwen2.5-0.5B at batch 256 x ~1,074 tokens, where the kernel bench's line (fixed cost plus
bytes at its streaming rate, results/kernels-h200.md) predicts ~37 us. The bench times a stack of
small per-layer pools (`kernels.bench_timing._pool`, 4 layers at this size); the engine reads one
allocation of every layer's K and V (`kernels.empty_kv_cache`: `[layers, 2, blocks, ...]`) sized
to the whole card, 24 layers a step. Timed here in one process, each as a layer-stack graph
(`per_call_ms`), in the order A B C D D C B A (means of two), through an identity table:

  bench        the bench's pools (one small allocation per layer), as many layers as it uses
  bench24      the same, 24 layers
  engine       one `empty_kv_cache` of 24 layers over most of the card's memory, the batch's
               blocks first in each layer's region (a fresh pool after prefill)
  engine_tight one `empty_kv_cache` of 24 layers holding just the batch's blocks

Then each stack's kernels alone, by torch.profiler (CUDA time of `_attn_fwd`, as the engine profile
counts it), launched eagerly: the calls back to back, and `engine` again with an MLP-sized GEMM
before each call (`engine+gemm`), as a decode step runs them between other kernels.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import torch
from pagedctl.kernels import empty_kv_cache, paged_attention
from pagedctl.kernels.bench_timing import _pool, _table, num_layers, per_call_ms

HQ, HKV, D, BLOCK, LAYERS = 14, 2, 64, 16, 24  # Qwen2.5-0.5B


def _calls(q, pools, lens, cu, ctx):
    return [
        functools.partial(paged_attention, q, k, v, t, lens, cu, 1, ctx, D**-0.5)
        for k, v, t in pools
    ]


def kernel_us(fns, repeats: int = 3) -> float:
    """Mean CUDA time of one `_attn_fwd` kernel over `repeats` passes of `fns`, each called in
    turn, eagerly (torch.profiler; other kernels among `fns` are not counted)."""
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            for fn in fns:
                fn()
        torch.cuda.synchronize()
    [ev] = [e for e in prof.key_averages() if e.key == "_attn_fwd"]
    return ev.self_device_time_total / ev.count


def case(batch: int, ctx: int, pool_blocks: int) -> dict:
    per_seq = -(-ctx // BLOCK)
    used = batch * per_seq
    table = _table(batch, per_seq, True, "cuda")
    q = torch.randn(batch, HQ, D, dtype=torch.bfloat16, device="cuda")
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    cu = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    layer_bytes = 2 * used * BLOCK * HKV * D * 2
    stacks = {}
    small = [_pool(batch, ctx, BLOCK, HKV, D, torch.bfloat16, "cuda", table) for _ in range(LAYERS)]
    stacks["bench"] = _calls(q, small[: num_layers(layer_bytes)], lens, cu, ctx)
    stacks["bench24"] = _calls(q, small, lens, cu, ctx)
    for name, blocks in (("engine", pool_blocks), ("engine_tight", used)):
        kv = empty_kv_cache(LAYERS, blocks, BLOCK, HKV, D, torch.bfloat16, "cuda")
        kv[:, :, :used].normal_()
        layers = [(kv[i, 0], kv[i, 1], table) for i in range(LAYERS)]
        stacks[name] = _calls(q, layers, lens, cu, ctx)
    order = list(stacks) + list(stacks)[::-1]
    times = {n: [] for n in stacks}
    for n in order:
        times[n].append(per_call_ms(stacks[n]) * 1e3)
    gemm_in = torch.randn(batch, 896, dtype=torch.bfloat16, device="cuda")
    gemm_w = torch.randn(896, 9728, dtype=torch.bfloat16, device="cuda")
    kernels_alone = {n: kernel_us(c) for n, c in stacks.items()}
    gemm_first = [fn for call in stacks["engine"] for fn in (lambda: gemm_in @ gemm_w, call)]
    kernels_alone["engine+gemm"] = kernel_us(gemm_first)
    kv_gb = 2 * LAYERS * pool_blocks * BLOCK * HKV * D * 2 / 1e9
    row = {"batch": batch, "context": ctx, "pool_blocks": pool_blocks, "pool_GB": kv_gb}
    row |= {n: sum(t) / len(t) for n, t in times.items()}
    row["runs"] = times
    row["kernel_us"] = kernels_alone
    return row


def main() -> None:
    out = Path(sys.argv[1])
    cases = [tuple(int(x) for x in a.split(":")) for a in sys.argv[2:]] or [(256, 1074), (64, 1074)]
    free = torch.cuda.mem_get_info()[0]
    per_block = 2 * LAYERS * BLOCK * HKV * D * 2
    pool_blocks = int(free * 0.7) // per_block  # leaves room for the bench's pools beside it
    rows = []
    for batch, ctx in cases:
        rows.append(case(batch, ctx, pool_blocks))
        r = rows[-1]
        print(
            f"{batch} x {ctx}: "
            + "  ".join(f"{n} {r[n]:.2f} us" for n in r["runs"])
            + f"  (pool {r['pool_GB']:.0f} GB); kernels alone: "
            + "  ".join(f"{n} {v:.2f}" for n, v in r["kernel_us"].items()),
            flush=True,
        )
        torch.cuda.empty_cache()
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    out.write_text(json.dumps({"environment": env, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

"""The engine's decode attention against the same kernel on synthetic inputs:
`python3 scripts/device/engine_attn_probe.py OUT.json [BATCH [CONTEXT]]` (default 256 1024).

Session 13's engine profile (`python -m pagedctl.bench_step --profile`, Qwen2.5-0.5B shape, dummy
weights) timed `_attn_fwd` ~13% longer than the kernel bench's line predicts for the same bytes,
and `scripts/device/pool_probe.py` found the engine's pool layout is not why. Here, in one process:
the engine is built as `bench_step` builds it (its decode graphs record the attention inputs of the
bucket's 24 layers as they are captured), prefilled, and stepped; then, under torch.profiler (CUDA
time of one `_attn_fwd`): the decode graph replayed (`graph`), the recorded inputs of the 24 layers
called eagerly in turn (`engine_inputs`, the graph's own buffers as the last step left them; again
with an MLP-sized GEMM before each, `engine_inputs_after_gemm`), and the bench's synthetic inputs at
the same batch and lengths (the engine's, copied), 24 pools (`synthetic`:
`kernels.bench_timing._pool`, identity table). Every variant reads 24 layers' distinct caches, so
none is served from L2 by repeating one layer.
"""

from __future__ import annotations

import functools
import json
import random
import sys
from pathlib import Path

import pagedctl.engine.models.attention as attn_mod
import torch
from pagedctl.engine import SamplingParams
from pagedctl.engine.llm import LLM
from pagedctl.kernels.bench_timing import _pool, _table
from pool_probe import kernel_us  # (scripts/device, the script's own folder)

from pagedctl import kernels

LAYERS = 24


def _recorder(batch: int, recorded: list):
    """`kernels.paged_attention` that also keeps the inputs of the decode bucket `batch`'s calls
    (its capture: one call a layer) in `recorded`."""

    def call(*args, **kwargs):
        q, max_seqlen_q = args[0], args[6]
        if max_seqlen_q <= 1 and q.shape[0] == batch and len(recorded) < LAYERS:
            recorded.append((args, kwargs))
        return kernels.paged_attention(*args, **kwargs)

    return call


def _describe(args: tuple) -> dict:
    names = ["q", "k_cache", "v_cache", "block_tables", "seq_lens", "cu_seqlens_q"]
    out = {}
    for name, t in zip(names, args[:6], strict=True):
        out[name] = {
            "shape": list(t.shape),
            "stride": list(t.stride()),
            "dtype": str(t.dtype),
            "ptr_mod_16": t.data_ptr() % 16,
        }
    out["max_seqlen_q"], out["max_seqlen_k"], out["scale"] = args[6], args[7], args[8]
    return out


def main() -> None:
    out = Path(sys.argv[1])
    batch = int(sys.argv[2]) if len(sys.argv) > 2 else 256
    context = int(sys.argv[3]) if len(sys.argv) > 3 else 1024
    recorded: list[tuple[tuple, dict]] = []
    attn_mod.paged_attention = _recorder(batch, recorded)  # before the LLM captures its graphs
    llm = LLM(
        "qwen2.5-0.5b-instruct", load_format="dummy", device="cuda", max_num_seqs=batch, seed=0
    )
    rng = random.Random(0)
    params = SamplingParams(temperature=0.6, max_tokens=2000, ignore_eos=True)
    for i in range(batch):
        llm.tracker.add(i, [rng.randrange(10000) for _ in range(context)], params, llm.scheduler)
    sched = llm.scheduler
    while sched.waiting or any(s.num_computed_tokens < s.num_tokens - 1 for s in sched.running):
        llm.step()
    for _ in range(40):
        llm.step()
    torch.cuda.synchronize()
    # no sequence has finished: the bucket's graph buffers hold a live step's inputs
    assert len(sched.running) == batch
    assert len(recorded) == LAYERS, f"{len(recorded)} decode attention calls of this batch captured"
    args = recorded[0][0]
    lens = args[4]
    ctx = int(lens.max())
    bucket = llm.runner.graphs.pick(batch, batch, decode=True)
    graph = llm.runner.graphs[bucket].graph
    result = {"batch": batch, "context_max": ctx, "context_min": int(lens.min())}
    result |= {"context_mean": lens.float().mean().item(), "inputs": _describe(args)}
    result["graph"] = kernel_us([graph.replay])
    engine_calls = [functools.partial(kernels.paged_attention, *a, **kw) for a, kw in recorded]
    result["engine_inputs"] = kernel_us(engine_calls)
    x = torch.randn(batch, 896, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(896, 9728, dtype=torch.bfloat16, device="cuda")
    with_gemm = [fn for call in engine_calls for fn in (lambda: x @ w, call)]
    result["engine_inputs_after_gemm"] = kernel_us(with_gemm)
    table = _table(batch, -(-ctx // 16), True, "cuda")
    pools = [_pool(batch, ctx, 16, 2, 64, torch.bfloat16, "cuda", table) for _ in recorded]
    q = torch.randn(batch, 14, 64, dtype=torch.bfloat16, device="cuda")
    cu = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    lens_s = lens.clone()  # the engine's lengths (they differ by when each prefill ended)
    result["synthetic"] = kernel_us(
        [
            functools.partial(kernels.paged_attention, q, k, v, t, lens_s, cu, 1, ctx, 0.125)
            for k, v, t in pools
        ]
    )
    print(json.dumps({k: v for k, v in result.items() if k != "inputs"}))
    print(json.dumps(result["inputs"]))
    out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

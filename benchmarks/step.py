"""One decode step of the whole engine against its memory-bandwidth floor.

`python -m benchmarks.step --out DIR` (CUDA; results/decode-step-h200.json): a batch of `--batch`
sequences with `--context` tokens each is prefilled, then `--steps` engine steps are timed end to
end (schedule, input preparation, the graph replay, sampling, reading the tokens, update). The
floor of a decode step is reading the weights once and every live KV byte once at the card's
measured copy bandwidth; the report gives the step time as a multiple of it, and the GPU-only time
of the step's CUDA graph.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time
from pathlib import Path

import torch

from benchmarks.kernel_timing import copy_bandwidth
from pagedctl.engine import LLM, SamplingParams


def _host_phases(llm: LLM, steps: int) -> dict[str, float]:
    """Milliseconds per step in each phase of `LLM.step` (the GPU synchronised around each)."""
    sched, runner, total = llm.scheduler, llm.runner, {}

    def timed(name, fn, *args):
        torch.cuda.synchronize()
        t = time.perf_counter()
        result = fn(*args)
        torch.cuda.synchronize()
        total[name] = total.get(name, 0.0) + (time.perf_counter() - t) * 1e3 / steps
        return result

    for _ in range(steps):
        _host_phase_step(sched, runner, timed)
    return total


@torch.inference_mode()  # as the runner prepares its inputs (its buffers are inference tensors)
def _host_phase_step(sched, runner, timed) -> None:
    out = timed("schedule", sched.schedule)
    runner.staging.begin_step()
    batch = timed("prepare inputs", runner._prepare, out)
    graph = runner.graphs[batch.graph].graph if batch.graph else None
    if graph is not None:
        timed("graph replay", graph.replay)
    hidden = runner.graphs[batch.graph].hidden if batch.graph else None
    logits = timed("logits", runner.model.compute_logits, hidden[: len(out.seqs)])
    params = [s.sampling_params for s in out.seqs]
    sampled = timed("sample", runner.sampler, logits, params, [None] * len(params))
    timed("update", sched.update, out, [[t] for t in sampled.token_ids])


def _profile(llm: LLM, steps: int) -> str:
    """torch.profiler's table of `steps` engine steps, sorted by self CPU time, then CUDA time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            llm.step()
        torch.cuda.synchronize()
    table = prof.key_averages()
    return (
        table.table(sort_by="self_cpu_time_total", row_limit=30)
        + "\n"
        + table.table(sort_by="self_cuda_time_total", row_limit=30)
    )


def run(
    model: str,
    batch: int,
    context: int,
    steps: int,
    temperature: float,
    profile_dir: Path | None = None,
    num_scheduler_steps: int = 1,
) -> dict:
    device = torch.device("cuda")
    bandwidth = copy_bandwidth(device)
    llm = LLM(
        model,
        load_format="dummy",
        device="cuda",
        max_num_seqs=batch,
        seed=0,
        num_scheduler_steps=num_scheduler_steps,
    )
    rng = random.Random(0)
    params = SamplingParams(
        temperature=temperature,
        max_tokens=steps + 64 + 16 * num_scheduler_steps,
        ignore_eos=True,
        seed=None,
    )
    for i in range(batch):
        prompt = [rng.randrange(10000) for _ in range(context)]
        llm.tracker.add(i, prompt, params, llm.scheduler)
    sched = llm.scheduler
    while sched.waiting or any(s.num_computed_tokens < s.num_tokens - 1 for s in sched.running):
        llm.step()  # prefill (chunked under the token budget) until every row decodes
    for _ in range(8):
        llm.step()  # warm: every sequence decoding, graphs replayed
    assert len(sched.running) == batch
    torch.cuda.synchronize()
    done = sched.stats.num_steps
    t0 = time.perf_counter()
    while sched.stats.num_steps - done < steps:  # a multi-step window counts each of its steps
        llm.step()
    torch.cuda.synchronize()
    step_s = (time.perf_counter() - t0) / (sched.stats.num_steps - done)
    try:  # diagnostics: a failure here must not lose the measurement above
        phases = _host_phases(llm, 20)
    except Exception as e:
        phases = {"error": f"{type(e).__name__}: {e}"}
    try:
        profile = _profile(llm, 10) if profile_dir else None
    except Exception as e:
        profile = f"profiler failed: {type(e).__name__}: {e}"
    if profile is not None:
        profile_dir.mkdir(parents=True, exist_ok=True)
        name = f"profile_b{batch}_k{num_scheduler_steps}.txt"
        (profile_dir / name).write_text(profile)
    bucket = llm.runner.graphs.pick(batch, batch, decode=True) if llm.runner.graphs else None
    graph_s = None
    if bucket:
        graph = llm.runner.graphs[bucket].graph
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            graph.replay()
        end.record()
        end.synchronize()
        graph_s = start.elapsed_time(end) * 1e-3 / 20
    mean_len = context + 8 + steps / 2
    kv_bytes = batch * mean_len * llm.layout.bytes_per_token
    weights = llm.memory["weights_bytes"]
    floor_s = (weights + kv_bytes) / bandwidth
    llm.abort_all()
    memory = dict(llm.memory)
    llm.runner.close()  # the next configuration profiles the card afresh
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return {
        "model": model,
        "batch": batch,
        "context": context,
        "steps": steps,
        "temperature": temperature,
        "num_scheduler_steps": num_scheduler_steps,
        "copy_bandwidth_GBps": bandwidth / 1e9,
        "weights_bytes": weights,
        "live_kv_bytes": kv_bytes,
        "floor_ms": floor_s * 1e3,
        "step_ms": step_s * 1e3,
        "graph_ms": None if graph_s is None else graph_s * 1e3,
        "step_over_floor": step_s / floor_s,
        "graph_over_floor": None if graph_s is None else graph_s / floor_s,
        "decode_tok_s": batch / step_s,
        "cuda_graph_bucket": bucket,
        "host_phases_ms": phases,
        "memory": memory,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="qwen2.5-0.5b-instruct")
    p.add_argument("--batch", type=int, nargs="+", default=[256])
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--profile", action="store_true", help="also write torch.profiler tables")
    p.add_argument("--num-scheduler-steps", type=int, nargs="+", default=[1])
    a = p.parse_args()
    from pagedctl.envinfo import environment

    prof = a.out if a.profile else None
    rows = [
        run(a.model, b, a.context, a.steps, a.temperature, prof, k)
        for b in a.batch
        for k in a.num_scheduler_steps
    ]
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "decode_step.json").write_text(
        json.dumps({"environment": environment(), "rows": rows}, indent=1, default=str)
    )
    for r in rows:
        graph = "eager" if r["graph_ms"] is None else f"{r['graph_ms']:.3f} ms"
        print(
            f"batch {r['batch']} x {r['context']}, {r['num_scheduler_steps']} steps a round: "
            f"step {r['step_ms']:.3f} ms "
            f"({r['step_over_floor']:.2f}x the floor {r['floor_ms']:.3f} ms), graph alone {graph}, "
            f"{r['decode_tok_s']:,.0f} tok/s"
        )
        print(
            "  phases (ms/step, synchronised): "
            + ", ".join(f"{k} {v:.3f}" for k, v in r["host_phases_ms"].items())
        )


if __name__ == "__main__":
    main()

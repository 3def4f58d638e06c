"""What the few-sequence graphs' split attention buys: `python3 scripts/device/few_probe.py OUT.json
[PREFIX ...]` (default prefixes 2048, 8192, 16384 tokens).

A step of at most `FEW_SEQS` sequences and `FEW_MAX_TOKENS` tokens replays a few-sequence graph
whose attention splits each query block's history `FEW_SPLITS` ways (engine/step_graphs.py): a
prefix-cache hit computes a few new tokens after thousands of cached ones, and without splits one
program per query block and KV head walks the whole history. This times that step, W1's model
(Qwen2.5-0.5B shape, dummy weights, bf16), three ways, each in an engine of its own (graphs capture
the split count), in the order few16, few1, mixed, few16: `few16` as shipped, `few1` (the same
graphs, one split), `mixed` (no few-sequence graphs: the step takes the mixed graph of its token
bucket, whose prefill attention does not split).

Per prefix: one request caches the prefix (its blocks full), then `ROUNDS` rounds of `FEW_SEQS`
requests, each the prefix plus `SUFFIX` new random tokens (new every round, so only the prefix
hits), `max_tokens=1`: one step a round. The round's `ModelRunner.execute` time with the device
synchronised around it (`step_*`: inputs, graph replay, sampling) and the wall time of its whole
`generate` (host included: the prefix-cache lookup hashes every prompt's blocks), medians; the step
kinds and prefix-cache hits show the rounds ran as meant.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import pagedctl.engine.step_graphs as sg
import torch
from pagedctl.engine import SamplingParams
from pagedctl.engine.llm import LLM
from pagedctl.engine.model_runner import ModelRunner

ROUNDS = int(os.environ.get("FEW_ROUNDS", 15))
SUFFIX = 16
DEVICE = os.environ.get("FEW_DEVICE", "cuda")  # "cpu": a smoke run through emulated graphs
_sync = torch.cuda.synchronize if DEVICE == "cuda" else (lambda: None)
EXECUTE_MS: list[float] = []  # each ModelRunner.execute call, the device synchronised around it
_execute = ModelRunner.execute


def _timed_execute(self, *args, **kwargs):
    _sync()
    t = time.perf_counter()
    result = _execute(self, *args, **kwargs)
    _sync()
    EXECUTE_MS.append((time.perf_counter() - t) * 1e3)
    return result


ModelRunner.execute = _timed_execute


def run(mode: str, prefixes: list[int]) -> dict:
    sg.FEW_SPLITS = 1 if mode == "few1" else 16
    sg.FEW_SEQS = 0 if mode == "mixed" else 4
    llm = LLM(
        "qwen2.5-0.5b-instruct", load_format="dummy", device=DEVICE, seed=0, max_num_seqs=256,
        gpu_memory_utilization=0.5, max_model_len=max(prefixes) + 64,
        dtype="bfloat16" if DEVICE == "cuda" else "float32",
        cuda_graphs=True if DEVICE == "cuda" else "emulate",
    )  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    out = {}
    for prefix_len in prefixes:
        prefix = torch.randint(0, 10000, (prefix_len,), generator=gen).tolist()
        llm.generate([prefix], one)  # caches the prefix
        times, steps, hits0 = [], [], llm.stats["prefix_cache"]
        kinds0 = dict(llm.runner.step_counts)
        for r in range(ROUNDS + 2):
            prompts = [
                prefix + torch.randint(0, 10000, (SUFFIX,), generator=gen).tolist()
                for _ in range(sg.FEW_SEQS or 4)
            ]
            _sync()
            EXECUTE_MS.clear()
            t = time.perf_counter()
            llm.generate(prompts, one)
            if r >= 2:  # two rounds of warm-up
                times.append((time.perf_counter() - t) * 1e3)
                steps.append(sum(EXECUTE_MS))
        kinds = {k: v - kinds0.get(k, 0) for k, v in llm.runner.step_counts.items()}
        hits = llm.stats["prefix_cache"]
        out[prefix_len] = {
            "step_median_ms": statistics.median(steps),
            "step_min_ms": min(steps),
            "median_ms": statistics.median(times),
            "min_ms": min(times),
            "max_ms": max(times),
            "steps": {k: v for k, v in kinds.items() if v},
            "prefix_cache": {k: hits[k] - hits0[k] for k in hits if isinstance(hits[k], int)},
        }
        print(mode, prefix_len, json.dumps(out[prefix_len]), flush=True)
    del llm
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return out


def main() -> None:
    prefixes = [int(a) for a in sys.argv[2:]] or [2048, 8192, 16384]
    runs = [(mode, run(mode, prefixes)) for mode in ("few16", "few1", "mixed", "few16")]
    Path(sys.argv[1]).write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()

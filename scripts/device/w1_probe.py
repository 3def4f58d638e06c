"""Where a W1 run's time goes, for A/B of engine changes: `python3 scripts/device/w1_probe.py
OUT.json [RECIPE]` (default `recipes/nano-bench.yaml`) measures the tree on `PYTHONPATH`: for an
older tree from `git archive REV engine kernels pagedctl | tar -x -C old_tree`, put it first
(`PYTHONPATH=$PWD/old_tree:$PYTHONPATH python3 scripts/device/w1_probe.py ...`).

Runs pagedctl's side of `pagedctl bench` (`pagedctl.bench.peers.run_pagedctl`: set-up and warm-up,
then one timed `generate`) with three recorders around it:
  - every Triton JIT cache miss of this process (a compilation, or a load from Triton's disk
    cache), with when it happened: one inside the timed `generate` is time W1 pays for a kernel
    specialisation the set-up never met;
  - in a second, synchronised run: the engine's steps by kind (`ModelRunner.step_counts`: decode,
    mixed, few, eager) and the wall time of each kind's `execute` calls, and of each yielded step
    of the multi-step decode rounds (`execute_decode_steps`); the GPU is synchronised around each,
    so the total runs longer than the plain bench: read the split, not the sum;
  - the timed `generate` alone, unsynchronised, as the bench reports it.
Session 10 left the question: W1 ran 1.7-10% slower with the engine on `kernels.rotary_write_kv`
although its decode graph was faster. Session 11's answer (results/fused-rotary-kv-h200.md, section
4): no JIT miss inside the timed run either way, and the decode rounds faster with the op in every
pair; the plain run's spread between runs of the same code (58-64K tok/s) was the loss.
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import torch
import triton
from pagedctl.engine.model_runner import ModelRunner

from pagedctl.bench.peers import run_pagedctl
from pagedctl.bench.recipe import load_bench_recipe, make_workload

COMPILES: list[tuple[float, str]] = []
_sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
WINDOWS: dict[str, float] = {}


def _on_jit_miss(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
    COMPILES.append((time.perf_counter(), f"{fn.name} {repr[:160]}"))
    return False  # compile (or load) as usual


def main() -> None:
    out = Path(sys.argv[1])
    path = sys.argv[2] if len(sys.argv) > 2 else "recipes/nano-bench.yaml"
    recipe = load_bench_recipe(Path(path))
    wl = make_workload(recipe.workload)
    triton.knobs.runtime.jit_cache_hook = _on_jit_miss

    kind_ms: dict[str, float] = defaultdict(float)
    kind_n: Counter[str] = Counter()
    execute, decode_steps = ModelRunner.execute, ModelRunner.execute_decode_steps

    def timed_execute(self, *args, **kwargs):
        before = Counter(self.step_counts)
        _sync()
        t = time.perf_counter()
        result = execute(self, *args, **kwargs)
        _sync()
        kinds = Counter(self.step_counts) - before
        for kind, n in kinds.items():
            kind_ms[kind] += (time.perf_counter() - t) * 1e3 * n / sum(kinds.values())
            kind_n[kind] += n
        return result

    def timed_decode_steps(self, out, k):
        steps = decode_steps(self, out, k)
        while True:
            _sync()
            t = time.perf_counter()
            try:
                tokens = next(steps)
            except StopIteration:
                return
            _sync()
            kind_ms["decode rounds"] += (time.perf_counter() - t) * 1e3
            kind_n["decode rounds"] += 1
            yield tokens

    from pagedctl.engine.llm import LLM

    generate = LLM.generate
    calls = []

    def windowed_generate(self, *args, **kwargs):
        kind_ms.clear()  # the last call, the timed one, is what stays
        kind_n.clear()
        t = time.perf_counter()
        result = generate(self, *args, **kwargs)
        calls.append((t, time.perf_counter()))
        return result

    LLM.generate = windowed_generate
    plain = run_pagedctl(recipe, wl, {})  # as the bench runs it: no synchronisation added
    start, end = calls[-1]
    timed = [name for at, name in COMPILES if start <= at <= end]
    ModelRunner.execute, ModelRunner.execute_decode_steps = timed_execute, timed_decode_steps
    synced = run_pagedctl(recipe, wl, {})
    ModelRunner.execute, ModelRunner.execute_decode_steps = execute, decode_steps
    result = {
        "output_tok_s": sum(c or 0 for c in plain.counts) / plain.wall_s,
        "plain": {"setup_s": plain.setup_s, "wall_s": plain.wall_s},
        "jit_misses_inside_timed_generate": timed,
        "synchronised": {
            "wall_s": synced.wall_s,
            "steps": dict(kind_n),
            "ms_by_kind": {k: round(v, 1) for k, v in kind_ms.items()},
        },
    }
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1)[:3000])


if __name__ == "__main__":
    main()

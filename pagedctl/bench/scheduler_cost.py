"""CPU cost of the scheduler: `schedule()` + `update()` per step, per running sequence.

No model runs: a fake runner hands back one random token per sampling row, so what is timed is the
engine's own bookkeeping (block allocation, hash registration, stop checks, counters) in steady
decode with every sequence running. The scheduler must never be what a GPU waits for.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import asdict, dataclass

from pagedctl.engine import (
    ENGINE_DEFAULTS,
    CacheConfig,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    Sequence,
)


@dataclass(frozen=True)
class SchedulerBenchResult:
    num_seqs: int
    block_size: int
    prompt_len: int
    steps_per_repeat: int
    repeats: int
    schedule_us_per_seq: float
    update_us_per_seq: float
    total_us_per_seq: float
    total_us_per_seq_min: float
    total_us_per_seq_max: float
    step_ms: float

    def as_dict(self) -> dict:
        return asdict(self)


def _fake_tokens(out, rng: random.Random) -> list[list[int]]:
    """One token per row that reached the end of its tokens, none for partial prefill chunks."""
    return [
        [rng.randrange(32000)] if s.num_computed_tokens + n == s.num_tokens else []
        for s, n in zip(out.seqs, out.num_new_tokens, strict=True)
    ]


def run(
    num_seqs: int,
    *,
    block_size: int = ENGINE_DEFAULTS["block_size"],
    prompt_len: int = 128,
    steps: int = 256,
    repeats: int = 5,
    prefix_caching: bool = True,
    seed: int = 0,
) -> SchedulerBenchResult:
    """Time `repeats` runs of `steps` decode steps with `num_seqs` sequences all running."""
    rng = random.Random(seed)
    total_steps = steps * repeats + 16
    num_blocks = num_seqs * (-(-(prompt_len + total_steps + 1) // block_size)) + 1
    sched = Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=max(8192, num_seqs),
            max_num_seqs=num_seqs,
            max_model_len=prompt_len + total_steps + 8,
        ),
        CacheConfig(
            block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=prefix_caching
        ),
    )
    params = SamplingParams(max_tokens=total_steps + 4, ignore_eos=True)
    for _ in range(num_seqs):
        prompt = [rng.randrange(32000) for _ in range(prompt_len)]
        sched.add(Sequence(prompt, params, eos_token_id=2))
    while any(s.num_output_tokens == 0 for s in sched.running) or sched.waiting:
        out = sched.schedule()
        sched.update(out, _fake_tokens(out, rng))
    # Sampled tokens prepared outside the timed region (a real runner hands over a tolist()).
    batches = [[[rng.randrange(32000)] for _ in range(num_seqs)] for _ in range(steps)]
    per_seq_totals, sched_ns, upd_ns = [], 0, 0
    for _ in range(repeats):
        t_sched = t_upd = 0
        for k in range(steps):
            t0 = time.perf_counter_ns()
            out = sched.schedule()
            t1 = time.perf_counter_ns()
            sched.update(out, batches[k])
            t2 = time.perf_counter_ns()
            assert len(out.seqs) == num_seqs and not out.preempted
            t_sched += t1 - t0
            t_upd += t2 - t1
        per_seq_totals.append((t_sched + t_upd) / 1e3 / steps / num_seqs)
        sched_ns += t_sched
        upd_ns += t_upd
    denom = 1e3 * steps * repeats * num_seqs
    median = statistics.median(per_seq_totals)
    return SchedulerBenchResult(
        num_seqs=num_seqs,
        block_size=block_size,
        prompt_len=prompt_len,
        steps_per_repeat=steps,
        repeats=repeats,
        schedule_us_per_seq=round(sched_ns / denom, 3),
        update_us_per_seq=round(upd_ns / denom, 3),
        total_us_per_seq=round(median, 3),
        total_us_per_seq_min=round(min(per_seq_totals), 3),
        total_us_per_seq_max=round(max(per_seq_totals), 3),
        step_ms=round(median * num_seqs / 1e3, 3),
    )

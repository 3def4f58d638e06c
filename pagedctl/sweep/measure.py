"""One timed run of a point and what it counts.

A run is measured from the engine's own counters (`LLM.stats` after minus before) and from one
look at the pool after every step.
"""

from __future__ import annotations

import itertools
import statistics
import time
from typing import Any


class _StepProbe:
    """Given to `LLM.stream` as `should_stop`: looks at the pool once after every step.

    Also follows sequences preempted by recompute (they wait at the front of the queue) to count,
    when each is admitted again, the tokens it looked up and those the prefix cache still held.
    Sequences swapped out wait in `scheduler.swapped` instead and come back without a lookup, so
    they count for neither, nor does a waiting sequence that was never preempted.
    """

    def __init__(self, llm) -> None:
        self.sched = llm.scheduler
        self.num_blocks, self.block_size = self.sched.kv.num_blocks, self.sched.kv.block_size
        self.last_step = self.sched.stats.num_steps
        self.last_waste = self.sched.stats.waste_slot_steps
        self.samples = 0
        self.usage_sum = self.peak_usage = 0.0
        self.used_slots = self.waste = 0
        self.resumed_queried = self.resumed_hit = 0
        self._waiting: list[tuple[Any, int, int]] = []  # (seq, cached tokens, tokens) when seen

    def __call__(self) -> bool:
        stats = self.sched.stats
        if stats.num_steps != self.last_step:
            usage = self.sched.kv.usage
            self.samples += stats.num_steps - self.last_step
            self.usage_sum += usage
            self.peak_usage = max(self.peak_usage, usage)
            self.used_slots += round(usage * self.num_blocks) * self.block_size
            self.waste += stats.waste_slot_steps - self.last_waste
            self.last_step, self.last_waste = stats.num_steps, stats.waste_slot_steps
        self._follow_preempted()
        return False

    def _follow_preempted(self) -> None:
        from pagedctl.engine import SequenceStatus

        preempted = SequenceStatus.PREEMPTED
        for seq, cached, tokens in self._waiting:
            # Admitted again since the last look (finished in that step, perhaps), not dropped.
            if seq.status != preempted and seq.num_computed_tokens > 0:
                self.resumed_queried += tokens
                self.resumed_hit += seq.num_cached_tokens - cached
        self._waiting = [
            (s, s.num_cached_tokens, s.num_tokens)
            for s in itertools.takewhile(lambda s: s.status == preempted, self.sched.waiting)
        ]


def run_once(llm, requests: list[dict], mode: str) -> dict[str, float]:
    """Run the requests (all at once, or one after another) and measure the run."""
    before = llm.stats
    probe = _StepProbe(llm)
    outputs, latencies = [], []
    t0 = time.perf_counter()
    if mode == "batch":
        outputs = list(llm.stream(requests, should_stop=probe))
    else:
        for req in requests:
            t = time.perf_counter()
            outputs.extend(llm.stream([req], should_stop=probe))
            latencies.append(time.perf_counter() - t)
    wall = time.perf_counter() - t0
    probe()
    return _metrics(before, llm.stats, probe, outputs, wall, latencies)


def _metrics(before: dict, after: dict, probe: _StepProbe, outputs, wall, latencies) -> dict:
    def diff(section: str, key: str) -> float:
        return after[section][key] - before[section][key]

    ok = [o for o in outputs if o.ok]
    prompt = sum(len(o.prompt_token_ids) for o in ok)
    samples = [(len(o.prompt_token_ids), c) for o in ok for c in o.outputs]
    output = sum(len(c.token_ids) for _, c in samples)
    bs = after["block_size"]
    tails = [-(p + len(c.token_ids) - 1) % bs for p, c in samples if c.finish_reason != "error"]
    computed = diff("scheduler", "num_prefill_tokens") + diff("scheduler", "num_decode_tokens")
    queried = diff("prefix_cache", "queried_tokens")
    steps = diff("scheduler", "num_steps")
    m = {
        "requests": len(outputs),
        "finished": len(ok),
        "failed": len(outputs) - len(ok),
        "prompt_tokens": prompt,
        "output_tokens": output,
        "wall_s": wall,
        "requests_per_s": len(ok) / wall,
        "output_tok_s": output / wall,
        "total_tok_s": (prompt + output) / wall,
        "preemptions": diff("scheduler", "num_preemptions"),
        "recomputed_tokens": diff("scheduler", "num_recomputed_tokens"),
        "recomputed_share": diff("scheduler", "num_recomputed_tokens") / computed
        if computed
        else 0.0,
        "swap_outs": diff("swap", "swap_outs"),
        "swap_ins": diff("swap", "swap_ins"),
        "swapped_blocks": diff("swap", "blocks_out") + diff("swap", "blocks_in"),
        "swap_bytes": diff("swap", "bytes_moved"),
        "swap_s": diff("swap", "transfer_s"),
        "swap_fallbacks": diff("swap", "fallbacks_to_recompute"),
        "prefill_tokens": diff("scheduler", "num_prefill_tokens"),
        "decode_tokens": diff("scheduler", "num_decode_tokens"),
        "prefix_hit_rate": diff("prefix_cache", "hit_tokens") / queried if queried else 0.0,
        "resumed_queried_tokens": probe.resumed_queried,
        "resumed_hit_tokens": probe.resumed_hit,
        "resumed_hit_share": probe.resumed_hit / probe.resumed_queried
        if probe.resumed_queried
        else 0.0,
        "peak_kv_usage": probe.peak_usage,
        "mean_kv_usage": probe.usage_sum / probe.samples if probe.samples else 0.0,
        "waste_slots": probe.waste / probe.samples if probe.samples else 0.0,
        "waste_share": probe.waste / probe.used_slots if probe.used_slots else 0.0,
        "tail_waste": statistics.fmean(tails) if tails else 0.0,
        "steps": steps,
    }
    if latencies:
        m["first_ms"] = latencies[0] * 1000
        if len(latencies) > 1:
            m["later_ms"] = statistics.median(latencies[1:]) * 1000
    if not ok and outputs:
        m["error"] = outputs[0].error
    return m

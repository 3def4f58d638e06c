"""Host time of prefix-cache hits on long prompts, by part: `python scripts/prefix_host_probe.py
[PREFIX]` (default 16384 tokens).

Runs on the CPU with W1's model shape (Qwen2.5-0.5B, dummy weights) and its step replaced by an
instant one, so only host work is timed: one request caches a prefix, then rounds of 4 requests,
each the prefix plus 16 new random tokens, `max_tokens=1` (the rounds of
`scripts/device/few_probe.py`). Prints milliseconds a round (mean of 5 after 3 of warm-up) of the
whole `generate` and of the parts that grow with the prompt: the tracker's request intake (token
ids checked), the scheduler, the prefix-cache lookup and the block hashing within it.
"""

from __future__ import annotations

import collections
import random
import sys
import time

import pagedctl.engine.kv_cache_manager as kvm
import pagedctl.engine.requests as rq
import pagedctl.engine.scheduler as sch
from pagedctl.engine import SamplingParams
from pagedctl.engine.llm import LLM
from pagedctl.engine.model_runner import ModelRunner, StepResult

SPENT: collections.Counter[str] = collections.Counter()


def timed(cls: type, name: str, label: str) -> None:
    inner = getattr(cls, name)

    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            SPENT[label] += time.perf_counter() - t

    setattr(cls, name, wrapper)


def instant_step(self, out):
    return StepResult(
        [
            [7] * s.num_samples_to_draw if s.num_computed_tokens + n >= s.num_tokens else []
            for s, n in zip(out.seqs, out.num_new_tokens, strict=True)
        ],
        None,
    )


def main() -> None:
    prefix_len = int(sys.argv[1]) if len(sys.argv) > 1 else 16384
    ModelRunner.execute = instant_step
    timed(rq.RequestTracker, "add", "request intake")
    timed(sch.Scheduler, "schedule", "schedule")
    timed(kvm.KVCacheManager, "get_computed_blocks", "prefix lookup")
    timed(kvm.KVCacheManager, "_update_hashes", "block hashing")
    llm = LLM(
        "qwen2.5-0.5b-instruct", load_format="dummy", device="cpu", dtype="float32",
        cuda_graphs=False, max_model_len=prefix_len + 64,
    )  # fmt: skip
    rng = random.Random(0)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    prefix = [rng.randrange(10000) for _ in range(prefix_len)]
    llm.generate([prefix], one)
    rounds = 5
    for r in range(3 + rounds):
        if r == 3:
            SPENT.clear()
        prompts = [prefix + [rng.randrange(10000) for _ in range(16)] for _ in range(4)]
        t = time.perf_counter()
        llm.generate(prompts, one)
        SPENT["generate"] += time.perf_counter() - t
    print(f"prefix {prefix_len} tokens, 4 prompts a round; ms a round:")
    for label, seconds in SPENT.most_common():
        print(f"  {label:16s} {seconds / rounds * 1e3:7.2f}")


if __name__ == "__main__":
    main()

"""Helpers for driving the scheduler without a model (a fake runner hands back chosen tokens)."""

from __future__ import annotations

from collections.abc import Callable

from pagedctl.engine import SamplingParams, Scheduler, Sequence
from pagedctl.engine.core.config import CacheConfig, SchedulerConfig
from pagedctl.engine.core.scheduler import SchedulerOutput

EOS = 2


def make_scheduler(
    num_blocks: int = 16,
    block_size: int = 4,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 16,
    max_model_len: int = 1024,
    enable_prefix_caching: bool = True,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            debug=True,
        ),
        CacheConfig(
            block_size=block_size,
            num_blocks=num_blocks,
            enable_prefix_caching=enable_prefix_caching,
        ),
    )


def make_seq(
    tokens: list[int] | int, max_tokens: int = 16, request_id: str | None = None, **params
) -> Sequence:
    """A sequence whose prompt is `tokens` (or `range(100, 100 + tokens)` when an int)."""
    prompt = list(range(100, 100 + tokens)) if isinstance(tokens, int) else tokens
    params.setdefault("ignore_eos", True)
    return Sequence(
        prompt,
        SamplingParams(max_tokens=max_tokens, **params),
        request_id=request_id,
        eos_token_id=EOS,
    )


def fake_tokens(
    out: SchedulerOutput, token: Callable[[Sequence], int] | int = 7
) -> list[list[int]]:
    """Tokens for every row that reached the end of its tokens; `[]` for partial prefill chunks."""
    sampled = []
    for seq, n in zip(out.seqs, out.num_new_tokens, strict=True):
        if seq.num_computed_tokens + n < seq.num_tokens:
            sampled.append([])
            continue
        draw = token(seq) if callable(token) else token
        sampled.append([draw + i for i in range(seq.num_samples_to_draw)])
    return sampled


def step(sched: Scheduler, token: Callable[[Sequence], int] | int = 7):
    """One schedule + update; returns (output, finished sequences)."""
    out = sched.schedule()
    finished = sched.update(out, fake_tokens(out, token))
    return out, finished


def run_to_completion(sched: Scheduler, max_steps: int = 10_000) -> int:
    steps = 0
    while sched.has_unfinished():
        step(sched)
        steps += 1
        assert steps < max_steps, "scheduler did not finish"
    return steps

"""Prompt logprobs (`SamplingParams.prompt_logprobs`): each prompt token's log-probability given
those before it, from the hidden states a prefill chunk computes, a bounded number of rows of
logits at a time."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from ..core.scheduler import SchedulerOutput
from .staging import Staging

PROMPT_LOGPROB_BYTES = 64 * 2**20  # float32 logits a prompt-logprobs chunk holds at once


class PromptLogprobs(NamedTuple):
    """A prefill chunk's prompt logprobs: the log-probability of prompt token `first + i` given
    those before it (`values[i]`), with the position's most likely tokens (`top[i]`: (token id,
    log-probability) pairs, best first)."""

    first: int
    values: list[float]
    top: list[list[tuple[int, float]]]


def prompt_logprobs(model, staging: Staging, out: SchedulerOutput, hidden: Tensor) -> list | None:
    """Each row's `PromptLogprobs` for the prompt positions this step computes (None for
    rows that do not ask), or None if no row asks. Raw log-probabilities (log_softmax of
    the model's logits, whatever `logprobs_mode`), `PROMPT_LOGPROB_BYTES` of float32
    logits at a time."""
    asked = [
        i
        for i, s in enumerate(out.seqs)
        if s.sampling_params.prompt_logprobs is not None
        and s.num_computed_tokens < s.num_prompt_tokens - 1
    ]
    if not asked:
        return None
    firsts = np.cumsum([0, *out.num_new_tokens])
    result: list[PromptLogprobs | None] = [None] * len(out.seqs)
    chunk = max(1, PROMPT_LOGPROB_BYTES // (4 * model.vocab_size))
    for i in asked:
        seq = out.seqs[i]
        start = seq.num_computed_tokens  # positions start.. predict tokens start + 1..
        stop = min(start + out.num_new_tokens[i], seq.num_prompt_tokens - 1)
        k = seq.sampling_params.prompt_logprobs
        values, top = [], []
        for a in range(start, stop, chunk):
            b = min(a + chunk, stop)
            rows = torch.arange(a - start, b - start, device=hidden.device) + int(firsts[i])
            lp = torch.log_softmax(
                model.compute_logits(hidden.index_select(0, rows)).float(), dim=-1
            )
            targets = staging.to_device(np.asarray(seq.token_ids[a + 1 : b + 1]))
            values += lp.gather(1, targets[:, None]).squeeze(1).tolist()
            if k:
                best, ids = (t.tolist() for t in lp.topk(k, dim=-1))
                top += [list(zip(t, v, strict=True)) for t, v in zip(ids, best, strict=True)]
            else:
                top += [[] for _ in range(b - a)]
        result[i] = PromptLogprobs(start + 1, values, top)
    return result

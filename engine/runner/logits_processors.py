"""The fields that reshape a row's logits before it is sampled, in vLLM's order.

1. `allowed_token_ids`: every other token to -inf;
2. `bad_words`: a word's last token to -inf where the output ends in the word's other tokens;
3. `min_tokens`: EOS and the stop tokens to -inf while the output is shorter;
4. `logit_bias`: each listed token's bias added;
5. penalties: `repetition_penalty` divides the positive logits and multiplies the negative ones
   of every token the prompt or the output holds, then `frequency_penalty` times each token's
   count in the output and `presence_penalty` once for each token it holds are subtracted.

The penalties read per-sequence state kept here on the device: the output's token counts and a
mask of the prompt's tokens, one row each of two pools (`[rows, vocab]`, int32 and bool, grown
as sequences come). A row is filled from the sequence's tokens the first time it is needed (or
again, whenever the tokens it counted are not the sequence's: a sample forked from its parent, a
window's token the caller dropped), then counts each token sampled on the device after that
(`count`): no step copies a sequence's tokens from the host, and a multi-step decode window
applies the penalties without the host in between. The masks and biases are small index lists
copied each step; bad words are matched on the host against the output's last tokens, so they
keep a sequence out of multi-step windows (`SamplingField.one_step`).

Everything runs as torch operations on the logits' device, in float32: the CPU path and CUDA alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from ... import kernels
from ..core.sequence import Sequence
from .staging import Staging

_POOL_GROWTH = 8  # pool rows added at a time


@dataclass
class _Plan:
    """What a batch of sequences (in row order) needs each step, on the device where it does
    not change from step to step: made when the batch's sequences change, reused while they
    do not (a decode window's steps, decode steps of an unchanged batch)."""

    key: tuple[int, ...]
    shaped: bool
    allowed: tuple[Tensor, Tensor] | None = None  # rows, and their kept tokens' mask
    bias: tuple[Tensor, Tensor] | None = None  # (2, n) rows and tokens, and the biases
    penalized: list[int] = field(default_factory=list)  # rows
    penalties: tuple[Tensor, ...] = ()  # rows, repetition, frequency, presence
    pool: Tensor | None = None  # the penalized rows' pool rows
    bad_words: list[int] = field(default_factory=list)  # rows
    min_tokens: list[int] = field(default_factory=list)  # rows
    counted: list[int] = field(default_factory=list)  # penalized rows drawing their own token
    count_at: tuple[Tensor, Tensor | None] | None = None  # their pool rows, rows (None: all)


class LogitsProcessors:
    """Applies the logits-shaping fields of each row's sequence (module docstring)."""

    def __init__(self, vocab_size: int, device: torch.device, staging: Staging) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.staging = staging
        self._rows: dict[int, int] = {}  # seq_id -> its row of the pools
        self._counted: dict[int, int] = {}  # seq_id -> output tokens its row counts
        self._free: list[int] = []
        self._counts = torch.zeros((0, vocab_size), dtype=torch.int32, device=device)
        self._prompt = torch.zeros((0, vocab_size), dtype=torch.bool, device=device)
        self._plan: _Plan | None = None

    def apply(self, logits: Tensor, seqs: list[Sequence], offset: int = 0) -> Tensor:
        """Row r of `logits` ([rows, vocab]) shaped by `seqs[r]`'s fields, as if its output held
        `offset` more tokens than the host has seen (a window's later steps). Returns `logits`
        itself where no row has such a field, else a float32 copy."""
        plan = self._plan_of(seqs)
        if not plan.shaped:
            return logits
        logits = logits.clone() if logits.dtype == torch.float32 else logits.float()
        if plan.allowed is not None:
            rows, keep = plan.allowed
            logits[rows] = logits[rows].masked_fill_(~keep, float("-inf"))
        masked = [
            (r, t)
            for r in plan.bad_words
            for t in banned_tokens(seqs[r].sampling_params.bad_words_token_ids, seqs[r])
        ]
        masked += [
            (r, t)
            for r in plan.min_tokens
            if seqs[r].num_output_tokens + offset < seqs[r].sampling_params.min_tokens
            for t in stop_tokens(seqs[r])
        ]
        if masked:
            at = self._index(np.array(masked, dtype=np.int64).T.ravel()).view(2, -1)
            logits.index_put_((at[0], at[1]), torch.tensor(float("-inf"), device=self.device))
        if plan.bias is not None:
            at, values = plan.bias
            logits.index_put_((at[0], at[1]), values, accumulate=True)
        if plan.penalized:
            for r in plan.penalized:
                self._row(seqs[r], offset)  # filled again where it does not count the tokens
            kernels.apply_penalties(
                logits, plan.penalties[0], plan.pool, self._counts, self._prompt,
                *plan.penalties[1:],
            )  # fmt: skip
        return logits

    def count(self, tokens: Tensor, seqs: list[Sequence], offset: int = 0) -> None:
        """Count each row's sampled token (`tokens`, on the device) in its sequence's output
        counts, for the rows that draw their sequence's own next token (`seqs[r]` once in
        `seqs`; a row of a prompt's n samples belongs to a sample not forked yet, which fills
        its own row later)."""
        plan = self._plan_of(seqs)
        rows = [
            r
            for r in plan.counted
            if self._counted.get(seqs[r].seq_id) == seqs[r].num_output_tokens + offset
        ]
        if not rows:
            return
        if len(rows) == len(plan.counted):  # the common case: the plan's own index tensors
            if plan.count_at is None:
                pool = self._index([self._rows[seqs[r].seq_id] for r in rows])
                plan.count_at = (
                    pool,
                    None if rows == list(range(len(seqs))) else self._index(rows),
                )
            pool, at = plan.count_at
        else:
            pool = self._index([self._rows[seqs[r].seq_id] for r in rows])
            at = self._index(rows)
        drawn = tokens if at is None else tokens.index_select(0, at)
        ones = torch.ones(len(rows), dtype=torch.int32, device=self.device)
        self._counts.index_put_((pool, drawn), ones, accumulate=True)
        for r in rows:
            self._counted[seqs[r].seq_id] += 1

    def release(self, seq: Sequence) -> None:
        """Give a finished sequence's pool row back."""
        row = self._rows.pop(seq.seq_id, None)
        if row is not None:
            del self._counted[seq.seq_id]
            self._free.append(row)
        if self._plan is not None and seq.seq_id in self._plan.key:
            self._plan = None

    def clear(self) -> None:
        """Forget every sequence and free the pools."""
        self._rows.clear()
        self._counted.clear()
        self._free.clear()
        self._plan = None
        self._counts = self._counts[:0]
        self._prompt = self._prompt[:0]

    # ------------------------------------------------------------------ the batch's plan

    def _plan_of(self, seqs: list[Sequence]) -> _Plan:
        key = tuple(s.seq_id for s in seqs)
        if self._plan is None or self._plan.key != key:
            self._plan = self._make_plan(key, seqs)
        return self._plan

    def _make_plan(self, key: tuple[int, ...], seqs: list[Sequence]) -> _Plan:
        shaped = [r for r, s in enumerate(seqs) if s.sampling_params.shapes_logits]
        plan = _Plan(key, bool(shaped))
        allowed_rows, allowed, biased = [], [], []
        once: dict[int, int | None] = {}
        for r, seq in enumerate(seqs):
            once[seq.seq_id] = None if seq.seq_id in once else r
        for r in shaped:
            p = seqs[r].sampling_params
            if p.allowed_token_ids:
                allowed += [(len(allowed_rows), t) for t in p.allowed_token_ids]
                allowed_rows.append(r)
            if p.bad_words:
                plan.bad_words.append(r)
            if p.min_tokens:
                plan.min_tokens.append(r)
            biased += [(r, t, b) for t, b in p.logit_bias]
            if p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1:
                plan.penalized.append(r)
                if once[seqs[r].seq_id] == r:
                    plan.counted.append(r)
        if allowed_rows:
            keep = torch.zeros((len(allowed_rows), self.vocab_size), dtype=torch.bool)
            at = np.array(allowed, dtype=np.int64).T
            keep[at[0], at[1]] = True
            plan.allowed = (self._index(allowed_rows), keep.to(self.device))
        if biased:
            rows_tokens = np.array([(r, t) for r, t, _ in biased], dtype=np.int64).T.ravel()
            at = self._index(rows_tokens).view(2, -1)
            plan.bias = (at, self._floats([b for _, _, b in biased]))
        if plan.penalized:
            params = [seqs[r].sampling_params for r in plan.penalized]
            plan.penalties = (
                self._index(plan.penalized),
                self._floats([p.repetition_penalty for p in params]),
                self._floats([p.frequency_penalty for p in params]),
                self._floats([p.presence_penalty for p in params]),
            )
            plan.pool = self._index([self._row(seqs[r], 0, fill=False) for r in plan.penalized])
        return plan

    # ------------------------------------------------------------------ the pools

    def _row(self, seq: Sequence, offset: int, fill: bool = True) -> int:
        """`seq`'s pool row (taken if it has none), filled from its tokens where it does not
        count them (module docstring); at a window's later steps (`offset` > 0) it always does.
        `fill=False` only takes the row (a plan being made: `apply` fills it)."""
        row = self._rows.get(seq.seq_id)
        if row is None:
            row = self._rows[seq.seq_id] = self._take()
            self._counted[seq.seq_id] = -1  # counts nothing yet
        expected = seq.num_output_tokens + offset
        if not fill or self._counted[seq.seq_id] == expected:
            return row
        assert offset == 0, "a window's sequence has its counts from its first step"
        self._counts[row].zero_()
        if seq.num_output_tokens:
            out = self._index(seq.output_token_ids)
            self._counts[row].index_add_(
                0, out, torch.ones(len(out), dtype=torch.int32, device=self.device)
            )
        self._prompt[row].zero_()
        self._prompt[row].index_fill_(0, self._index(seq.prompt_token_ids), True)
        self._counted[seq.seq_id] = expected
        return row

    def _take(self) -> int:
        if not self._free:
            old = self._counts.shape[0]
            grow = max(_POOL_GROWTH, old // 2)
            self._counts = torch.cat([self._counts, self._counts.new_zeros(grow, self.vocab_size)])
            self._prompt = torch.cat([self._prompt, self._prompt.new_zeros(grow, self.vocab_size)])
            self._free = list(range(old + grow - 1, old - 1, -1))  # rows keep their numbers
        return self._free.pop()

    # ------------------------------------------------------------------ host to device

    def _index(self, values) -> Tensor:
        return self.staging.to_device(np.asarray(values, dtype=np.int64))

    def _floats(self, values: list[float]) -> Tensor:
        bits = np.asarray(values, dtype=np.float32).view(np.int32)
        return self.staging.to_device(bits).view(torch.float32)


def stop_tokens(seq: Sequence) -> list[int]:
    """The tokens that would end `seq` now: EOS (unless `ignore_eos`) and its stop tokens."""
    p = seq.sampling_params
    eos = [] if p.ignore_eos or seq.eos_token_id is None else [seq.eos_token_id]
    return [*eos, *p.stop_token_ids]


def banned_tokens(words: tuple[tuple[int, ...], ...], seq: Sequence) -> list[int]:
    """The last token of each bad word whose other tokens end `seq`'s output (a one-token word
    always), as vLLM matches them."""
    out = seq.output_token_ids
    banned = []
    for word in words:
        head = len(word) - 1
        if head > len(out):
            continue
        if head == 0 or tuple(out[-head:]) == word[:-1]:
            banned.append(word[-1])
    return banned

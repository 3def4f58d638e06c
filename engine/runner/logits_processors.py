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

import numpy as np
import torch
from torch import Tensor

from ..core.sequence import Sequence
from .staging import Staging

_POOL_GROWTH = 8  # pool rows added at a time


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

    @property
    def pool_bytes(self) -> int:
        """Device bytes the penalties' state holds now."""
        return self._counts.nbytes + self._prompt.nbytes

    def apply(self, logits: Tensor, seqs: list[Sequence], offset: int = 0) -> Tensor:
        """Row r of `logits` ([rows, vocab]) shaped by `seqs[r]`'s fields, as if its output held
        `offset` more tokens than the host has seen (a window's later steps). Returns `logits`
        itself where no row has such a field, else a float32 copy."""
        shaped = [r for r, s in enumerate(seqs) if s.sampling_params.shapes_logits]
        if not shaped:
            return logits
        logits = logits.clone() if logits.dtype == torch.float32 else logits.float()
        masked: list[tuple[int, int]] = []  # (row, token) to -inf
        allowed_rows: list[int] = []
        allowed: list[tuple[int, int]] = []  # (index into allowed_rows, token) to keep
        biased: list[tuple[int, int, float]] = []
        penalized: list[int] = []
        for r in shaped:
            seq = seqs[r]
            p = seq.sampling_params
            if p.allowed_token_ids:
                allowed += [(len(allowed_rows), t) for t in p.allowed_token_ids]
                allowed_rows.append(r)
            if p.bad_words:
                masked += [(r, t) for t in banned_tokens(p.bad_words_token_ids, seq)]
            if seq.num_output_tokens + offset < p.min_tokens:
                masked += [(r, t) for t in stop_tokens(seq)]
            biased += [(r, t, b) for t, b in p.logit_bias]
            if p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1:
                penalized.append(r)
        if allowed_rows:
            keep = torch.zeros((len(allowed_rows), self.vocab_size), dtype=torch.bool)
            at = np.array(allowed, dtype=np.int64).T
            keep[at[0], at[1]] = True
            rows = self._index(allowed_rows)
            logits[rows] = logits[rows].masked_fill_(~keep.to(self.device), float("-inf"))
        if masked:
            at = self._index(np.array(masked, dtype=np.int64).T.ravel()).view(2, -1)
            logits.index_put_((at[0], at[1]), torch.tensor(float("-inf"), device=self.device))
        if biased:
            rows_tokens = np.array([(r, t) for r, t, _ in biased], dtype=np.int64).T.ravel()
            at = self._index(rows_tokens).view(2, -1)
            values = self._floats([b for _, _, b in biased])
            logits.index_put_((at[0], at[1]), values, accumulate=True)
        if penalized:
            self._penalize(logits, [(r, seqs[r]) for r in penalized], offset)
        return logits

    def count(self, tokens: Tensor, seqs: list[Sequence], offset: int = 0) -> None:
        """Count each row's sampled token (`tokens`, on the device) in its sequence's output
        counts, for the rows that draw their sequence's own next token (`seqs[r]` once in
        `seqs`; a row of a prompt's n samples belongs to a sample not forked yet, which fills
        its own row later)."""
        once = {}
        for r, seq in enumerate(seqs):
            once[seq.seq_id] = None if seq.seq_id in once else r
        rows = [r for r in once.values() if r is not None and seqs[r].seq_id in self._rows]
        rows = [
            r for r in rows if self._counted[seqs[r].seq_id] == seqs[r].num_output_tokens + offset
        ]
        if not rows:
            return
        pool = self._index([self._rows[seqs[r].seq_id] for r in rows])
        drawn = tokens.index_select(0, self._index(rows))
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

    def clear(self) -> None:
        """Forget every sequence and free the pools."""
        self._rows.clear()
        self._counted.clear()
        self._free.clear()
        self._counts = self._counts[:0]
        self._prompt = self._prompt[:0]

    # ------------------------------------------------------------------ penalties

    def _penalize(self, logits: Tensor, rows: list[tuple[int, Sequence]], offset: int) -> None:
        pool = [self._row(seq, offset) for _, seq in rows]
        at = self._index(pool)
        counts = self._counts.index_select(0, at)
        held = counts > 0
        params = [seq.sampling_params for _, seq in rows]
        every = len(rows) == logits.shape[0]
        index = None if every else self._index([r for r, _ in rows])
        x = logits if every else logits.index_select(0, index)
        if any(p.repetition_penalty != 1 for p in params):
            seen = held | self._prompt.index_select(0, at)
            rep = self._floats([p.repetition_penalty for p in params])[:, None]
            x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
        if any(p.frequency_penalty for p in params):
            x = x - self._floats([p.frequency_penalty for p in params])[:, None] * counts
        if any(p.presence_penalty for p in params):
            x = x - self._floats([p.presence_penalty for p in params])[:, None] * held
        if every:
            logits.copy_(x)
        else:
            logits.index_copy_(0, index, x)

    def _row(self, seq: Sequence, offset: int) -> int:
        """`seq`'s pool row, filled from its tokens where it does not count them (module
        docstring); at a window's later steps (`offset` > 0) it always does."""
        row = self._rows.get(seq.seq_id)
        expected = seq.num_output_tokens + offset
        if row is not None and self._counted[seq.seq_id] == expected:
            return row
        assert offset == 0, "a window's sequence has its counts from its first step"
        if row is None:
            row = self._rows[seq.seq_id] = self._take()
        out = self._index(seq.output_token_ids) if seq.num_output_tokens else None
        self._counts[row].zero_()
        if out is not None:
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
            self._free = list(range(old + grow - 1, old - 1, -1))
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

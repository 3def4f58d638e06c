"""Token sampling: greedy, temperature, top-k, top-p and min-p, reproducible per sequence.

Each sampling row draws exactly one uniform number per step from its own generator (or from the
sampler's shared one when unseeded) and picks its token by inverse CDF over the filtered
distribution in vocabulary order. Every computation on a row depends only on that row, so a seeded
sequence gets the same tokens whatever else is in the batch.

Top-k and top-p never sort whole rows in the common case: the kept set is a head of the order
(probability descending, token id ascending), so it is enough to know its size and the probability
of its last token. Those come from the `_CANDIDATES` largest probabilities (`topk` values, which
are unique whatever the tie order); only a top-p row whose nucleus is larger is sorted in full.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ... import kernels
from ..core.sampling_params import SamplingParams

_CANDIDATES = 64  # largest probabilities looked at first; more (x16 each time) only where needed


@dataclass
class SamplerOutput:
    """One sampled token per row, and its log-probability where asked.

    `logprobs[r]` is what row r's `logprobs_mode` reports for `token_ids[r]` (by default its
    log-probability under the raw logits: log_softmax of the unmodified row), NaN for rows whose
    params did not ask; `logprobs` is None if no row asked. `top_logprobs[r]` holds the row's
    `top_logprobs` most likely tokens as (token id, value) pairs, best first, in the same mode
    (empty for rows that did not ask; None if none did).
    """

    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None = None


def make_generator(
    seed: int | None, sample_index: int, device: torch.device | str
) -> torch.Generator | None:
    """One sequence's generator: its own stream per (seed, sample_index); None if unseeded."""
    if seed is None:
        return None
    digest = hashlib.blake2b(f"{seed}:{sample_index}".encode(), digest_size=8).digest()
    generator = torch.Generator(device=device)
    generator.manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))
    return generator


class Sampler:
    """Samples one token per row of a `[rows, vocab]` logits tensor (any float dtype; rows that
    need more than argmax or plain temperature sampling are computed in float32).

    Unseeded rows share one generator per device, seeded from `seed` (random when None).
    """

    def __init__(self, seed: int | None = None) -> None:
        self.seed = seed
        self._shared: dict[torch.device, torch.Generator] = {}

    def __call__(
        self,
        logits: Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> SamplerOutput:
        """Sample row r with `params[r]`, drawing its randomness from `generators[r]`."""
        return self.result(logits, logits, params, self.sample(logits, params, generators))

    def result(
        self, logits: Tensor, shaped: Tensor, params: list[SamplingParams], tokens: Tensor
    ) -> SamplerOutput:
        """The output of `tokens` drawn from `shaped` (the processed `logits`): the tokens on
        the host, with the logprobs the rows ask for."""
        if not any(p.wants_logprobs for p in params):
            return SamplerOutput(tokens.tolist(), None)
        return SamplerOutput(tokens.tolist(), *_logprobs(logits, shaped, params, tokens))

    def sample(
        self,
        logits: Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> Tensor:
        """The tokens as a tensor on the logits' device (no host synchronisation)."""
        assert logits.dim() == 2 and logits.shape[0] == len(params) == len(generators)
        vocab, device = logits.shape[1], logits.device
        fast = self._uniform_batch(logits, params, generators)
        if fast is not None:
            return fast
        logits = logits.float()
        tokens = torch.empty(len(params), dtype=torch.long, device=device)
        greedy = [r for r, p in enumerate(params) if p.greedy]
        if greedy:
            tokens[greedy] = _take_rows(logits, greedy).argmax(dim=-1)  # first maximum: lowest id
        heads, rest = [], []  # rows needing top-k/top-p first, as one leading block
        for r, p in enumerate(params):
            if not p.greedy:
                (heads if _needs_head(p, vocab) else rest).append(r)
        sampled = heads + rest
        if sampled:
            u = self._uniforms([generators[r] for r in sampled], device)
            rows = _take_rows(logits, sampled)
            tokens[sampled] = _sample(rows, [params[r] for r in sampled], len(heads), u)
        return tokens

    def _uniform_batch(
        self, logits: Tensor, params: list[SamplingParams], generators: list
    ) -> Tensor | None:
        """The common batch (every row greedy, or every row plain temperature sampling with one
        temperature and no seed) without per-row lists and index tensors; the same tokens as
        the general path (on CUDA, the fused kernel `kernels.sample_temperature`: the same
        tokens but where a uniform falls within rounding of a CDF step). None for any other
        batch."""
        if all(p.greedy for p in params):
            # exact in any dtype: upcasting keeps the order. On the CPU, argmax over 16-bit
            # rows is ~5x slower than upcasting them first (a 32 x 49K bf16 batch: 7 ms, 1.5).
            if _is_cpu_half(logits):
                logits = logits.float()
            return logits.argmax(dim=-1)
        t, vocab = params[0].temperature, logits.shape[1]
        if any(g is not None for g in generators) or any(
            p.temperature != t or p.min_p or p.greedy or _needs_head(p, vocab) for p in params
        ):
            return None
        device = logits.device
        u = torch.rand(len(params), generator=self._shared_generator(device), device=device)
        if device.type == "cuda":
            return kernels.sample_temperature(logits, t, u)  # reads the logits once
        temperature = torch.full((1, 1), t, device=device)  # a tensor: true division, as below
        return _inverse_cdf(torch.softmax(logits.float() / temperature, dim=-1), u)

    def warm_up(self, vocab: int, dtype: torch.dtype, device: torch.device) -> None:
        """Compile (or load from Triton's cache) the fused temperature kernels for this
        vocabulary now, so that the first sampled step of a job does not wait for them (0.28 s
        on the H200 with a cold cache, inside a job's timed run: results/job-vs-engine-h200.md).
        Draws nothing from any generator."""
        if device.type == "cuda":
            logits = torch.zeros(1, vocab, dtype=dtype, device=device)
            kernels.sample_temperature(logits, 1.0, torch.zeros(1, device=device))

    def _uniforms(self, generators: list[torch.Generator | None], device: torch.device) -> Tensor:
        """One uniform number in [0, 1) per row: seeded rows from their own generator."""
        u = torch.empty(len(generators), device=device)
        unseeded = [i for i, g in enumerate(generators) if g is None]
        if unseeded:
            shared = self._shared_generator(device)
            u[unseeded] = torch.rand(len(unseeded), generator=shared, device=device)
        for i, g in enumerate(generators):
            if g is not None:
                u[i] = torch.rand(1, generator=g, device=g.device).to(device)[0]
        return u

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        if device not in self._shared:
            generator = torch.Generator(device=device)
            if self.seed is None:
                generator.seed()
            else:
                generator.manual_seed(self.seed)
            self._shared[device] = generator
        return self._shared[device]


def _is_cpu_half(x: Tensor) -> bool:
    """A 16-bit tensor on the CPU, where reductions over it run far slower than over float32."""
    return x.device.type == "cpu" and x.dtype in (torch.float16, torch.bfloat16)


def _take_rows(x: Tensor, rows: list[int]) -> Tensor:
    return x if rows == list(range(x.shape[0])) else x[rows]


def _needs_head(params: SamplingParams, vocab: int) -> bool:
    return 0 < params.top_k < vocab or params.top_p < 1


def _sample(logits: Tensor, params: list[SamplingParams], num_heads: int, u: Tensor) -> Tensor:
    """Temperature, then top-k, top-p (on the first `num_heads` rows), min-p, then inverse CDF."""
    return _inverse_cdf(_filtered(logits, params, num_heads), u)


def _filtered(logits: Tensor, params: list[SamplingParams], num_heads: int) -> Tensor:
    """The probabilities after temperature, top-k, top-p (on the first `num_heads` rows) and
    min-p, those filtered out zero (not renormalised).

    Every filter keeps the probabilities at or above a per-row threshold, so one pass applies them
    all; ties at a top-k/top-p threshold that would keep too many tokens drop the highest ids.
    """
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device)
    probs = torch.softmax(logits / temperature[:, None], dim=-1)
    min_p = [p.min_p for p in params]
    threshold = torch.zeros(len(params), device=device)
    if any(min_p):
        threshold = probs.amax(dim=-1) * torch.tensor(min_p, device=device)
    if num_heads:
        head = probs[:num_heads]
        top_k, top_p = _top_k_top_p(params[:num_heads], probs.shape[-1], device)
        keep, last, maybe_tied = _head_size(head, top_k, top_p)
        threshold[:num_heads] = torch.maximum(threshold[:num_heads], last)
    if any(min_p) or num_heads:
        probs.masked_fill_(probs < threshold[:, None], 0.0)
    if num_heads:
        _drop_surplus_ties(head, keep, last, maybe_tied)
    return probs


def _inverse_cdf(probs: Tensor, u: Tensor) -> Tensor:
    """The token where the CDF passes `u * total`; never a zero-probability token.

    The CPU scans each row in order (accumulating in double), whatever the batch. CUDA works in
    float64 (a batch-dependent token becomes vanishingly rare instead of about one draw in a
    hundred on a flat 152k vocabulary) and in two levels: a scan along a whole 152k-token row
    runs on a few SMs and costs milliseconds per step, so it finds the block of the vocabulary
    from block sums, then scans that block only.
    """
    if probs.device.type == "cpu":
        cdf = probs.cumsum_(dim=-1)
        total = cdf[:, -1]
        target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
        return torch.searchsorted(cdf, target[:, None], right=True).squeeze(1)
    return _inverse_cdf_blocked(probs, u)


_CDF_BLOCK = 1024  # vocabulary entries per block of the two-level inverse CDF


def _inverse_cdf_blocked(probs: Tensor, u: Tensor, block: int = _CDF_BLOCK) -> Tensor:
    """`_inverse_cdf` as block sums + a scan of one block per row (float64 throughout).

    Reads the probabilities in place (no padded copy of a `[rows, vocab]` tensor): the last,
    partial block is summed on its own and read through clamped, masked indices.
    """
    rows, vocab = probs.shape
    full = vocab // block * block
    sums = probs[:, :full].reshape(rows, -1, block).sum(dim=-1, dtype=torch.float64)
    if full < vocab:
        tail = probs[:, full:].sum(dim=-1, keepdim=True, dtype=torch.float64)
        sums = torch.cat([sums, tail], dim=1)
    nb = sums.shape[1]
    csum = sums.cumsum_(dim=-1)  # [rows, nb]
    total = csum[:, -1:]
    target = torch.minimum(u[:, None].double() * total, torch.nextafter(total, total.new_zeros(())))
    blk = torch.searchsorted(csum, target, right=True).clamp_max_(nb - 1)  # [rows, 1]
    before = torch.where(blk > 0, csum.gather(1, (blk - 1).clamp_min(0)), 0.0)
    cols = blk * block + torch.arange(block, device=probs.device)  # [rows, block]
    inside = cols < vocab
    chosen = torch.where(inside, probs.gather(1, cols.clamp_max(vocab - 1)), 0.0)
    inner = chosen.cumsum(dim=-1, dtype=torch.float64).add_(before)
    idx = torch.searchsorted(inner, target, right=True)
    # Rounding may leave the block's last partial sum just under the target: take its last
    # token of nonzero probability (the block has one: its sum passed the target).
    ids = torch.arange(block, device=probs.device)
    last_nonzero = torch.where(chosen > 0, ids, -1).amax(dim=-1, keepdim=True)
    idx = torch.where(idx >= block, last_nonzero, idx)
    return (blk * block + idx).squeeze(1)


def _top_k_top_p(
    params: list[SamplingParams], vocab: int, device: torch.device
) -> tuple[Tensor, Tensor]:
    """Per-row top-k (`vocab` when off) and top-p as tensors."""
    top_k = torch.tensor([min(p.top_k or vocab, vocab) for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device, dtype=torch.float64)
    return top_k, top_p


def _head_size(probs: Tensor, top_k: Tensor, top_p: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per row: how many of the largest probabilities top-k and top-p keep, the smallest kept one,
    and whether tokens tied with it may lie past the head.

    Looks at the largest `_CANDIDATES` first; a top-p row whose nucleus holds every candidate looks
    again at 16 times more, until the whole vocabulary.
    """
    vocab = probs.shape[-1]
    k_on = top_k < vocab
    k = min(vocab, max([_CANDIDATES, *top_k[k_on].tolist()]))
    keep, last = torch.empty_like(top_k), torch.empty_like(probs[:, 0])
    maybe_tied = torch.empty_like(k_on)
    rows = torch.arange(len(top_k), device=probs.device)
    while True:
        values = (probs if len(rows) == len(probs) else probs[rows]).topk(k, dim=-1).values
        keep[rows] = _kept(values, top_k[rows], top_p[rows], k_on[rows])
        last[rows], maybe_tied[rows] = _edge(values, keep[rows], vocab)
        rows = rows[(top_p[rows] < 1) & ~k_on[rows] & (keep[rows] >= k)]
        if k == vocab or not rows.numel():
            return keep, last, maybe_tied
        k = min(vocab, k * 16)


def _edge(values: Tensor, keep: Tensor, vocab: int) -> tuple[Tensor, Tensor]:
    """The smallest kept value, and whether the next one (if unknown: maybe) equals it."""
    n = values.shape[-1]
    last = values.gather(1, (keep.clamp_max(n) - 1)[:, None]).squeeze(1)
    after = values.gather(1, keep.clamp_max(n - 1)[:, None]).squeeze(1)
    maybe_tied = (keep < vocab) & (last > 0) & ((keep >= n) | (after == last))
    return last, maybe_tied


def _kept(values: Tensor, top_k: Tensor, top_p: Tensor, k_on: Tensor) -> Tensor:
    """Size of the head of `values` (sorted descending) that top-k, then top-p, keep."""
    csum = values.double().cumsum(dim=-1)
    k = top_k.clamp_max(values.shape[-1])
    mass = torch.where(k_on, csum.gather(1, (k - 1)[:, None]).squeeze(1), 1.0)
    before = torch.cat([torch.zeros_like(csum[:, :1]), csum[:, :-1]], dim=-1)  # mass above each
    nucleus = (before < (top_p * mass)[:, None]).sum(dim=-1)
    return torch.minimum(torch.where(top_p < 1, nucleus, values.shape[-1]), top_k)


def _drop_surplus_ties(probs: Tensor, keep: Tensor, last: Tensor, maybe_tied: Tensor) -> None:
    """Where more tokens tie at `last` than the head has room for, zero the highest-id ones."""
    rows = maybe_tied.nonzero().squeeze(1)
    if not rows.numel():
        return
    sub, edge = probs[rows], last[rows, None]
    ties = sub == edge
    room = keep[rows] - (sub > edge).sum(dim=-1)
    probs[rows] = sub.masked_fill_(ties & (ties.cumsum(dim=-1) > room[:, None]), 0.0)


def _logprobs(
    raw: Tensor, shaped: Tensor, params: list[SamplingParams], tokens: Tensor
) -> tuple[list[float], list[list[tuple[int, float]]] | None]:
    """The sampled tokens' values in each asking row's `logprobs_mode` (NaN elsewhere), and the
    rows' top tokens where they ask for them.

    raw_logprobs: log_softmax of the model's logits; raw_logits: those logits. processed_*: the
    distribution sampled from, as vLLM reports it: the logits after the logits processors, and
    for a sampled row also divided by its temperature with the tokens top-k, top-p and min-p
    drop at -inf (where a token's probability underflows to 0 after temperature, it counts as
    dropped); processed_logprobs is their log_softmax.
    """
    asked = [r for r, p in enumerate(params) if p.wants_logprobs]
    values = torch.empty((len(asked), raw.shape[1]), device=raw.device)
    by_mode: dict[str, list[int]] = {}
    for i, r in enumerate(asked):
        by_mode.setdefault(params[r].logprobs_mode, []).append(i)
    for mode, where in by_mode.items():
        rows = [asked[i] for i in where]
        source = raw if mode.startswith("raw") else shaped
        x = _take_rows(source, rows).float()
        if mode.startswith("processed"):
            x = _processed(x, [params[r] for r in rows])
        if mode.endswith("logprobs"):
            x = torch.log_softmax(x, dim=-1)
        values[where] = x
    chosen = values.gather(1, tokens[asked, None]).squeeze(1)
    out = [math.nan] * len(params)
    for r, value in zip(asked, chosen.tolist(), strict=True):
        out[r] = value
    k = max(params[r].top_logprobs for r in asked)
    if not k:
        return out, None
    best, ids = (t.tolist() for t in values.topk(k, dim=-1))
    top: list[list[tuple[int, float]]] = [[] for _ in params]
    for i, r in enumerate(asked):
        n = params[r].top_logprobs
        top[r] = list(zip(ids[i][:n], best[i][:n], strict=True))
    return out, top


def _processed(logits: Tensor, params: list[SamplingParams]) -> Tensor:
    """Float32 logits as sampled: greedy rows as they are; sampled rows divided by their
    temperature, with what top-k, top-p and min-p drop at -inf."""
    sampled = [r for r, p in enumerate(params) if not p.greedy]
    if not sampled:
        return logits
    vocab = logits.shape[1]
    heads = [r for r in sampled if _needs_head(params[r], vocab)]
    order = heads + [r for r in sampled if r not in heads]
    rows = logits[order]
    probs = _filtered(rows, [params[r] for r in order], len(heads))
    temperature = torch.tensor([params[r].temperature for r in order], device=logits.device)
    scaled = torch.where(probs > 0, rows / temperature[:, None], float("-inf"))
    out = logits.clone()
    out[order] = scaled
    return out

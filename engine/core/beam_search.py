"""Beam search on shared blocks: a group of live beams that fork and die like a process tree.

A beam request enters the engine as one sequence holding its prompt. When the prompt's last token
is computed, the group takes its first step: the runner hands back each live beam's best
continuations (fp32 log-probabilities, `BeamGroup.num_candidates` per beam) and the group keeps
the best `beam_width` that do not end. The scheduler then points each survivor's block table at
its parent's blocks (reference counts up; the first write into a shared, partly filled block
copies it) and frees the blocks of every beam left without a survivor at once. Prompts and the
long prefixes beams have in common are stored once, which is what PagedAttention (Kwon et al.,
SOSP 2023) found beam search saves most memory on.

The selection is transformers' (`GenerationMixin._beam_search`), so that the hypotheses are the
same token for token: the top `max(2, 1 + number of stop tokens) * beam_width` candidates over the
whole group by cumulative log-probability (summed in float32); among the best `beam_width` of
them, those that end (a stop token, `max_tokens`, `max_model_len`) become finished hypotheses
scored `cumulative_logprob / generated_length ** length_penalty`; at most `beam_width`
hypotheses are kept, and the search ends by the same early-stopping rule (`early_stopping` True:
as soon as `beam_width` hypotheses are finished; False: when the best live beam can no longer
beat the worst hypothesis at its current length; "never": with a positive length penalty, only
when it cannot at `max_tokens`).

The scheduler admits and preempts a group as one unit. A preempted group frees all its blocks and
comes back as one sequence holding the longest prefix its beams share; once that is computed, the
beams fork from it again and compute their own tokens (see `BeamGroup.preempt`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import MISSING, dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from .sampling_fields import SamplingField, params_check, same_field, sampling_field, specs
from .sampling_params import SAMPLING_FIELDS, SamplingParams
from .sequence import Sequence, SequenceStatus
from .units import cdiv

if TYPE_CHECKING:
    from .kv_cache_manager import KVCacheManager

EARLY_STOPPING = (True, False, "never")


@dataclass(frozen=True)
class BeamSearchParams:
    """How to run one request by beam search (vLLM's names; transformers' scoring).

    `beam_width` beams are kept; the request returns `beam_width` hypotheses, best first.
    `max_tokens` counts each hypothesis's generated tokens. `length_penalty` is the exponent of
    the generated length that a finished hypothesis's cumulative log-probability is divided by
    (0: raw sum; above 0 favours longer hypotheses). `early_stopping`: True, False or "never",
    as in transformers. `stop_token_ids` end a beam as EOS does; `ignore_eos` lets beams run
    through EOS. `logprobs`: return each token's log-probability with the hypothesis.
    `skip_special_tokens`, `spaces_between_special_tokens`: how a hypothesis's text is made, as
    a sample's; it leaves out the stop token that ended the hypothesis.

    A field it shares with `SamplingParams` takes that field's `SamplingField`, so one check
    serves both; its own are marked `beam="only"` (`BEAM_ONLY_FIELDS`).
    """

    beam_width: int = sampling_field(
        MISSING, "beams kept, and hypotheses returned", "int", low=1, line=False, beam="only"
    )
    max_tokens: int = same_field(SAMPLING_FIELDS["max_tokens"])
    length_penalty: float = sampling_field(
        1.0,
        "beam search: a finished hypothesis scores its cumulative log-probability divided by "
        "its length to this power (0: the raw sum; above 0 favours longer ones)",
        "float",
        finite=True,
        beam="only",
    )
    early_stopping: bool | str = sampling_field(
        False,
        "beam search: when the search ends: true, once n hypotheses are finished; false, when "
        "the best live beam can no longer beat the worst hypothesis at its current length; "
        '"never", as false but judging a positive length_penalty at max_tokens (longer)',
        "choice",
        choices=EARLY_STOPPING,
        beam="only",
    )
    ignore_eos: bool = same_field(SAMPLING_FIELDS["ignore_eos"])
    stop_token_ids: tuple[int, ...] = same_field(SAMPLING_FIELDS["stop_token_ids"])
    logprobs: bool = same_field(SAMPLING_FIELDS["logprobs"])
    skip_special_tokens: bool = same_field(SAMPLING_FIELDS["skip_special_tokens"])
    spaces_between_special_tokens: bool = same_field(
        SAMPLING_FIELDS["spaces_between_special_tokens"]
    )
    cache_salt: str | None = same_field(SAMPLING_FIELDS["cache_salt"])
    strict_max_tokens: bool = same_field(SAMPLING_FIELDS["strict_max_tokens"])

    def __post_init__(self) -> None:
        _check(self)

    def sampling_params(self) -> SamplingParams:
        """What each beam's sequence carries: greedy, no strings, the fields of `beam="beams"`."""
        return SamplingParams(
            temperature=0.0, **{name: getattr(self, name) for name in CARRIED_BY_BEAMS}
        )


_FIELDS = specs(BeamSearchParams)
_check = params_check(_FIELDS)
BEAM_ONLY_FIELDS: dict[str, SamplingField] = {
    name: spec for name, spec in _FIELDS.items() if spec.beam == "only"
}
# SamplingParams' fields that each beam's sequence carries (the group's own are not: the width,
# and the log-probabilities, which the group gathers from the candidates).
CARRIED_BY_BEAMS = tuple(name for name, spec in SAMPLING_FIELDS.items() if spec.beam == "beams")


@dataclass
class Hypothesis:
    """A finished beam: its generated tokens, their log-probabilities and its score."""

    token_ids: list[int]
    logprobs: list[float]
    cumulative_logprob: float
    score: float  # cumulative_logprob / len(token_ids) ** length_penalty, in float32
    finish_reason: str  # "stop" or "length"
    stop_reason: int | str | None = None


@dataclass
class BeamStats:
    """Memory figures of one group, or summed over groups (`Scheduler.beam_stats`).

    `peak_blocks`: the most distinct KV blocks the group's live beams held at once (taken after
    each step's allocation). `peak_blocks_unshared`: the most the same beams would have held with
    private copies (the sum of each beam's blocks), what an engine without sharing must pay.
    `num_shared_blocks`: blocks held by two beams or more at the group's peak.
    `num_cow_copies`: blocks copied because a beam wrote into a block it shared.
    """

    num_groups: int = 0
    peak_blocks: int = 0
    peak_blocks_unshared: int = 0
    num_shared_blocks: int = 0
    num_cow_copies: int = 0

    def add(self, other: BeamStats) -> None:
        self.num_groups += 1
        self.peak_blocks += other.peak_blocks
        self.peak_blocks_unshared += other.peak_blocks_unshared
        self.num_shared_blocks += other.num_shared_blocks
        self.num_cow_copies += other.num_cow_copies


@dataclass
class _Beam:
    seq: Sequence
    score: float  # cumulative log-probability of its generated tokens (a float32 value)
    logprobs: list[float] = field(default_factory=list)


def _f32(x: float) -> np.float32:
    return np.float32(x)


class BeamGroup:
    """The live beams and finished hypotheses of one beam-search request.

    The group decides which candidates survive and forks its survivors' blocks (`advance`);
    the scheduler owns the running list, finishes the beams the group lets go and counts.
    """

    def __init__(self, params: BeamSearchParams, root: Sequence, eos_token_ids: list[int]) -> None:
        self.params = params
        self.width = params.beam_width
        stops = set(params.stop_token_ids)
        if not params.ignore_eos:
            stops.update(eos_token_ids)
        self.stop_ids = frozenset(stops)
        self.num_candidates = max(2, 1 + len(self.stop_ids)) * self.width
        self.num_prompt_tokens = root.num_prompt_tokens
        self.request_id = root.request_id
        root.beam = self
        self.root: Sequence | None = root  # the prompt, until the first step forks it
        self.leader: Sequence | None = None  # the shared prefix of a preempted group
        self.beams: list[_Beam] = []  # live beams, best first
        self.finished: list[Hypothesis] = []  # best first, at most `width`
        self._improvable = True
        self.done = False
        self.stats = BeamStats(num_groups=1)
        self.num_preemptions = 0

    # ---------------------------------------------------------------- membership

    @property
    def seqs(self) -> list[Sequence]:
        """The sequences the group has in the running set (or wants there): the root or leader
        while one computes, else the live beams, best first."""
        head = self.root or self.leader
        return [head] if head is not None else [b.seq for b in self.beams]

    def seqs_reserved_by(self, seq: Sequence) -> int:
        """Running sequences `seq` stands for: the root or leader all the group's beams."""
        if seq is self.root:
            return self.width
        if seq is self.leader:
            return len(self.beams)
        return 1

    # ---------------------------------------------------------------- one step

    def step(
        self, rows: dict[int, tuple[list[int], list[float]]], max_model_len: int
    ) -> list[tuple[int, int]] | None:
        """Choose the survivors of this step from each live beam's candidates.

        `rows[seq_id]` holds a beam's candidate token ids and their log-probabilities (best
        first), for every live beam, or for the root on the first step. Returns the survivors as
        (index of the parent in `self.beams` or 0 for the root, token), best first, for
        `commit` to receive as sequences; None when the search is over (`self.done`).
        """
        parents = [_Beam(self.root, 0.0)] if self.root is not None else self.beams
        assert {b.seq.seq_id for b in parents} == set(rows), "a group's beams step together"
        ids = np.array([rows[b.seq.seq_id][0] for b in parents], dtype=np.int64)
        lps = np.array([rows[b.seq.seq_id][1] for b in parents], dtype=np.float32)
        scores = np.array([b.score for b in parents], dtype=np.float32)[:, None] + lps
        beam_of = np.broadcast_to(np.arange(len(parents))[:, None], ids.shape)
        # Best score first; ties by beam, then token (the order of a flat [beams x vocab] row).
        order = np.lexsort((ids.ravel(), beam_of.ravel(), -scores.ravel()))
        pick = order[: self.num_candidates]
        top = list(
            zip(
                scores.ravel()[pick].tolist(),
                beam_of.ravel()[pick].tolist(),
                ids.ravel()[pick].tolist(),
                lps.ravel()[pick].tolist(),
                strict=True,
            )
        )
        length = parents[0].seq.num_output_tokens + 1  # of every candidate
        limit = min(self.params.max_tokens, max_model_len - self.num_prompt_tokens)
        at_limit = length >= limit
        ends = [at_limit or c[2] in self.stop_ids for c in top]
        self._add_finished(parents, top[: self.width], ends[: self.width], length, at_limit)
        survivors = [c for c, end in zip(top, ends, strict=True) if not end][: self.width]
        self._pending = [(parents[i], token, score, lp) for score, i, token, lp in survivors]
        self._check_improvable(survivors[0][0] if survivors else None, length, limit)
        if all(ends) or not self._improvable or self._full_and_early():
            self.done = True
            return None
        return [(i, token) for _, i, token, _ in survivors]

    def advance(
        self,
        rows: dict[int, tuple[list[int], list[float]]],
        max_model_len: int,
        kv: KVCacheManager,
    ) -> tuple[list[Sequence], list[Sequence]]:
        """Carry out one step: `step` on the candidates in `rows`, then fork each survivor onto
        its parent's blocks in `kv` (a preempted group's leader first unfolds into its beams).

        Returns the group's sequences to run next, best first (empty when the search is over,
        `done`), and those it lets go, for the scheduler to finish pruned after the forks."""
        heads = self.seqs
        if self.leader is not None:  # the shared prefix is computed again: fork the beams
            leader = heads[0]
            beams = self.unfold()
            for seq in beams:
                kv.fork(leader, seq)
                seq.num_computed_tokens = leader.num_computed_tokens
                seq.status = SequenceStatus.RUNNING
            return beams, [leader]
        survivors = self.step(rows, max_model_len)
        if survivors is None:
            return [], heads
        children, used = [], set()
        for i, _ in survivors:  # forks first: a child copies its parent's tokens as they are
            parent = heads[i]
            if i in used:
                child = parent.fork(sample_index=parent.sample_index)
                kv.fork(parent, child)
            else:
                used.add(i)
                child = parent
            children.append(child)
        for child, (_, token) in zip(children, survivors, strict=True):
            child.token_ids.append(token)
        self.commit(children)
        return children, [seq for i, seq in enumerate(heads) if i not in used]

    def commit(self, seqs: list[Sequence]) -> None:
        """The sequences now holding this step's survivors, in the order `step` gave them."""
        beams = []
        for seq, (parent, _, score, lp) in zip(seqs, self._pending, strict=True):
            beams.append(_Beam(seq, score, [*parent.logprobs, lp]))
        self.beams, self._pending = beams, []
        self.root = None

    def _add_finished(self, parents, top, ends, length, at_limit) -> None:
        if self._full_and_early() or not self._improvable:
            return
        penalty = float(length) ** self.params.length_penalty
        new = []
        for (score, i, token, lp), end in zip(top, ends, strict=True):
            if not end:
                continue
            parent = parents[i]
            stopped = token in self.stop_ids
            new.append(
                Hypothesis(
                    [*parent.seq.output_token_ids, token],
                    [*parent.logprobs, lp],
                    float(score),
                    float(_f32(score) / _f32(penalty)),
                    "stop" if stopped else "length",
                    token if stopped else None,
                )
            )
        if new:
            merged = sorted([*self.finished, *new], key=lambda h: -h.score)  # stable: old first
            self.finished = merged[: self.width]

    def _full_and_early(self) -> bool:
        return len(self.finished) >= self.width and self.params.early_stopping is True

    def _check_improvable(self, best_running: float | None, length: int, limit: int) -> None:
        """transformers' heuristic: can the best live beam still beat the worst hypothesis?"""
        if len(self.finished) < self.width or best_running is None:
            return
        lp = self.params.length_penalty
        hypothetical = limit if self.params.early_stopping == "never" and lp > 0 else length
        best = _f32(best_running) / _f32(float(hypothetical) ** lp)
        if not best > _f32(self.finished[-1].score):
            self._improvable = False

    # ---------------------------------------------------------------- ending early

    def cap(self) -> None:
        """End the search now (the pool cannot hold the group): the live beams become
        hypotheses as they are, with finish reason "length"."""
        lp = self.params.length_penalty
        live = [
            Hypothesis(
                b.seq.output_token_ids,
                list(b.logprobs),
                float(b.score),
                float(_f32(b.score) / _f32(float(b.seq.num_output_tokens) ** lp)),
                "length",
                "kv_cache_full",
            )
            for b in self.beams
        ]
        merged = sorted([*self.finished, *live], key=lambda h: -h.score)
        self.finished = merged[: self.width]
        self.done = True

    def preempt(self) -> Sequence:
        """The sequence to queue again after the group lost all its blocks.

        Before its first step that is the root itself. After it, a new leader holding the
        longest prefix every live beam shares (at most all but their last token): it computes
        that prefix once, then the beams fork from it (`unfold`) and compute the rest. (The
        scheduler counts the preemption in `num_preemptions`.)
        """
        if self.root is not None or self.leader is not None:
            return self.root or self.leader  # (it computes from its first token again)
        seqs = [b.seq for b in self.beams]
        first = seqs[0].token_ids
        shared = len(first) - 1
        for seq in seqs[1:]:
            tokens = seq.token_ids
            n = 0
            while n < shared and tokens[n] == first[n]:
                n += 1
            shared = n
        leader = Sequence(
            first[:shared],
            seqs[0].sampling_params,
            request_id=self.request_id,
            eos_token_id=seqs[0].eos_token_id,
        )
        leader.num_prompt_tokens = min(self.num_prompt_tokens, shared)
        leader._max_computed_tokens = shared  # its tokens are all computed again
        leader.beam = self
        self.leader = leader
        return leader

    def unfold(self) -> list[Sequence]:
        """The leader computed the shared prefix: the beams to fork from it, best first."""
        self.leader = None
        return [b.seq for b in self.beams]

    def blocks_to_resume(self, block_size: int) -> int:
        """Blocks the group holds once its leader and every beam are computed again."""
        if self.leader is None:
            return 0
        full = self.leader.num_tokens // block_size
        each = cdiv(self.beams[0].seq.num_tokens, block_size)
        return full + len(self.beams) * (each - full)

    # ---------------------------------------------------------------- figures

    def measure(self) -> None:
        """Record the blocks the live beams hold now (after a step's allocation)."""
        tables = [s.block_table[s.num_dropped_blocks :] for s in self.seqs]
        held = Counter(b for t in tables for b in t)
        stats = self.stats
        stats.peak_blocks_unshared = max(stats.peak_blocks_unshared, sum(map(len, tables)))
        if len(held) > stats.peak_blocks:
            stats.peak_blocks = len(held)
            stats.num_shared_blocks = sum(1 for c in held.values() if c > 1)

"""The state of one sequence as it moves through the engine.

Field ownership (one writer per field):
- the `Scheduler` writes `status`, `num_computed_tokens`, `token_ids` (appends), `finish_reason`,
  `error`, `error_code` and the per-sequence counters;
- the `KVCacheManager` writes `block_table` and `block_hashes`;
- the model runner only reads.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

from .sampling_params import SamplingParams

if TYPE_CHECKING:
    from .beam_search import BeamGroup


class SequenceStatus(enum.IntEnum):
    """Lifecycle of a sequence; every value from FINISHED_STOPPED on counts as finished."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6
    FINISHED_PRUNED = 7  # a beam its group no longer needs: the group keeps what it produced
    SWAPPED = -1  # preempted with its KV moved to the host pool, to come back as it was

    @property
    def is_finished(self) -> bool:
        return self >= SequenceStatus.FINISHED_STOPPED


FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
    SequenceStatus.FINISHED_ERROR: "error",
}

_seq_ids = itertools.count()


class Sequence:
    """One sample of one request: its tokens, progress, KV blocks and counters.

    Chunked prefill, prefix-cache hits, decode and recompute after preemption are all the same thing
    here: `num_computed_tokens` (tokens whose KV is in the cache) catching up with `num_tokens`.
    The step that makes them equal produces logits for the next token.
    """

    __slots__ = (
        "_max_computed_tokens",
        "beam",
        "block_hashes",
        "block_table",
        "cache_salt",
        "eos_token_id",
        "error",
        "error_code",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_dropped_blocks",
        "num_preemptions",
        "num_prompt_tokens",
        "num_recomputed_tokens",
        "parent_seq_id",
        "request_id",
        "sample_index",
        "sampling_params",
        "seq_id",
        "status",
        "stop_reason",
        "tail_waste",
        "token_ids",
    )

    def __init__(
        self,
        prompt_token_ids: Seq[int],
        sampling_params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        eos_token_id: int | None = None,
        seq_id: int | None = None,
    ) -> None:
        self.seq_id = next(_seq_ids) if seq_id is None else seq_id
        self.request_id = str(self.seq_id) if request_id is None else request_id
        self.sampling_params = sampling_params or SamplingParams()
        self.cache_salt = self.sampling_params.cache_salt
        self.eos_token_id = eos_token_id
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.num_computed_tokens = 0
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.num_dropped_blocks = 0  # leading table entries given back: out of the window
        self.block_hashes: list[bytes] = []
        self.sample_index = 0
        self.parent_seq_id: int | None = None
        self.beam: BeamGroup | None = None  # the beam-search group this sequence is a beam of
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        self.error_code: str | None = None  # machine-readable, with `error`
        # Counters (scheduler-owned).
        self.num_preemptions = 0
        self.num_cached_tokens = (
            0  # prompt tokens served by the prefix cache, summed over admissions
        )
        self.num_recomputed_tokens = 0  # tokens computed again after a preemption lost their KV
        self.tail_waste = 0  # unused slots in the last block when the sequence finished
        self._max_computed_tokens = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status >= SequenceStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    @property
    def num_samples_to_draw(self) -> int:
        """Tokens the runner samples when this sequence next produces logits.

        A request with `n > 1` is one sequence until its prompt is computed; its first sampling step
        draws n tokens and the scheduler forks n - 1 children that share the prompt's blocks.
        """
        n = self.sampling_params.n
        if n > 1 and self.sample_index == 0 and len(self.token_ids) == self.num_prompt_tokens:
            return n
        return 1

    @property
    def num_seqs_reserved(self) -> int:
        """Running sequences this one stands for (`max_num_seqs` counts them): itself and the
        samples or beams it will fork into once its prompt is computed."""
        if self.beam is not None:
            return self.beam.seqs_reserved_by(self)
        return self.num_samples_to_draw

    def fork(self, sample_index: int) -> Sequence:
        """A child with this sequence's tokens and progress; blocks are shared by the KV manager."""
        child = Sequence(
            self.token_ids,
            self.sampling_params,
            request_id=self.request_id,
            eos_token_id=self.eos_token_id,
        )
        child.num_prompt_tokens = self.num_prompt_tokens
        child.num_computed_tokens = self.num_computed_tokens
        child._max_computed_tokens = self._max_computed_tokens
        child.status = self.status
        child.sample_index = sample_index
        child.parent_seq_id = self.seq_id
        child.beam = self.beam
        return child

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={self.block_table}, "
            f"dropped={self.num_dropped_blocks})"
        )

"""The multi-step decode window: one scheduled decode step run `k` tokens deep.

`num_scheduler_steps = k > 1` lets a pure decode step (every row one token, no copy, no fork, no
beam, no sampling field that needs a step of its own, such as log-probabilities) run `k` forward
passes before the next `schedule()`, the host waiting once instead of `k` times. The window
reserves every row's slots for its next `k - 1` tokens up front (all or none), so the steps inside
it allocate nothing; `Scheduler.update` is called once per token exactly as `k` single steps would
be, and the window closes by giving back what a window cut short reserved but did not use.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from .units import cdiv

if TYPE_CHECKING:
    from .kv_cache_manager import KVCacheManager
    from .scheduler import SchedulerOutput, SchedulerStats
    from .sequence import Sequence


class DecodeWindow:
    """The scheduler's open multi-step window, if any: `lookahead` tokens are reserved ahead of
    every running sequence's next token while it is open (0: closed)."""

    def __init__(self, kv: KVCacheManager, max_model_len: int, stats: SchedulerStats) -> None:
        self.kv = kv
        self.max_model_len = max_model_len
        self.stats = stats
        self.lookahead = 0

    def open(self, out: SchedulerOutput, k: int) -> bool:
        """Let the decode step `out` run `k` tokens deep; False (run one step) unless every row
        is a decode that samples one token with `k - 1` more positions inside `max_model_len`
        and the pool holds every row's slots ahead. Between the `k` calls to `update` that
        follow, sequences hold blocks up to `k - 1` tokens ahead; `close` ends the window."""
        if k <= 1 or out.copies or not out.seqs:
            return False
        bs = self.kv.block_size
        needed = 0
        for seq, n in zip(out.seqs, out.num_new_tokens, strict=True):
            c = seq.num_computed_tokens
            if n != 1 or c + 1 != seq.num_tokens or not self._fits(seq, k):
                return False
            needed += max(cdiv(c + k, bs) - len(seq.block_table), 0)
        if needed > self.kv.num_free_blocks:
            return False
        for seq in out.seqs:
            copies = self.kv.allocate_slots(seq, k)
            assert copies == (), "a decode row without a pending copy needs none ahead"
        self.lookahead = k - 1
        return True

    def _fits(self, seq: Sequence, k: int) -> bool:
        """Whether `seq` may decode `k` tokens with no scheduler decision between them."""
        return (
            seq.num_samples_to_draw == 1  # no fork pending
            and seq.beam is None  # a group chooses its beams between tokens
            and seq.sampling_params.multi_step  # no field that needs a step of its own
            and seq.num_tokens + k - 1 <= self.max_model_len
        )

    def count_step(self, out: SchedulerOutput) -> None:
        """Stats of the 2nd, 3rd, ... step of the window (the first was scheduled)."""
        self.stats.num_decode_tokens += sum(1 for s in out.seqs if not s.is_finished)

    def close(self, seqs: Iterable[Sequence] = ()) -> None:
        """End the window. One cut short (the runner failed inside it) leaves its sequences
        holding slots reserved for tokens that will not come from it: they give back every
        block beyond the one their next token goes into."""
        self.lookahead = 0
        for seq in seqs:
            if not seq.is_finished:
                self.kv.trim(seq, seq.num_tokens)

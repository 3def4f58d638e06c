"""A step that raises is traced to the rows it holds, so that one request cannot end a run.

`execute_contained` runs a scheduled step; when the runner raises, the rows run again in halves
(each a step of its own) down to those that fail alone. `LLM` then fails those requests and
applies the rest.
"""

from __future__ import annotations

import logging

from ..core.scheduler import SchedulerOutput
from ..core.sequence import Sequence
from .model_runner import ModelRunner, StepResult

logger = logging.getLogger("pagedctl.engine")


def execute_contained(
    runner: ModelRunner, out: SchedulerOutput
) -> tuple[StepResult, list[tuple[Sequence, Exception]]]:
    """Run a step: its `StepResult` (a failed row's holds nothing) and the rows the step failed
    on, each with what it raised.

    When the step raises, its rows run again in halves, each as a step of its own; a half
    that fails again is halved again, down to single rows, which are then the culprits
    (at most 2 * rows - 1 runs, never a loop). `Scheduler.update` has not run, so every
    retried row computes the same tokens at the same positions from the same inputs and
    rewrites its own KV slots. A greedy row's tokens are those of a run without the
    culprit; a seeded row may draw anew if the failure came after the sampler's draw.
    """
    try:
        result = runner.execute(out)
    except MemoryError:  # the host is out of memory: retrying would only make it worse
        raise
    except Exception as exc:
        if len(out.seqs) == 1:
            return StepResult([[]], None), [(out.seqs[0], exc)]
        return _bisect(runner, out, exc)
    return result, []


def _bisect(runner: ModelRunner, out: SchedulerOutput, first: Exception):
    n = len(out.seqs)
    merged = StepResult([[] for _ in range(n)], None)
    culprits: list[tuple[Sequence, Exception]] = []
    # Copy-on-write copies go with every retry up to the first that succeeds, none after.
    # A copy is `dst <- src`, where `dst` is the copying row's own new block and `src` a
    # block still held by others: the slots of `src` that the copying row reads are
    # computed positions of every holder, which no row of this step writes, so a copy done
    # again moves the same data. Only after a retry succeeded has some row written its new
    # positions into a `dst`, which a later copy would overwrite; every row that ends well
    # runs in or after that first success, after the last copy. Rows that fail write only
    # their own slots, and are rewritten or freed.
    copies = out.copies
    pending = _halves(list(range(n)))
    while pending:
        rows = pending.pop()
        sub = SchedulerOutput(
            [out.seqs[i] for i in rows],
            [out.num_new_tokens[i] for i in rows],
            list(copies),
        )
        sub.total_num_scheduled_tokens = sum(sub.num_new_tokens)
        try:
            result = runner.execute(sub)
        except MemoryError:
            raise
        except Exception as exc:
            if len(rows) == 1:
                culprits.append((out.seqs[rows[0]], exc))
            else:
                pending += _halves(rows)
            continue
        copies = []
        merged.place(result, rows)
    if not culprits:
        logger.warning(
            "a step of %d rows failed (%s: %s), but each of its rows ran when retried",
            n, type(first).__name__, first,
        )  # fmt: skip
    return merged, culprits


def _halves(rows: list[int]) -> list[list[int]]:
    """The two halves of `rows`, the first last (the retry stack pops it first)."""
    mid = len(rows) // 2
    return [rows[mid:], rows[:mid]]

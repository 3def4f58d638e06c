"""Preemption by swapping: the host block pool and the cost model that picks swap or recompute.

PagedAttention's scheduler recovers a preempted sequence group in one of two ways: it copies the
group's blocks to CPU memory and back (swap), or frees them and computes the tokens again
(recompute). The paper found recompute better for small blocks, whose many small transfers waste
PCIe bandwidth, and swap better for large ones. Here a swap moves all of a victim's blocks in one
gathered copy (`HostKVCache`), so the block size matters less; `PreemptionCosts` compares the
two from figures timed on the machine at start-up.

The host pool holds no hashes: the prefix cache serves only device blocks, and a swapped-out
sequence's device blocks are freed (still findable by their hashes while their data lasts there).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

PREEMPTION_MODES = ("recompute", "swap", "auto")


class HostBlockPool:
    """Block ids of the host KV pool with reference counts; a block is free at count 0.

    Blocks shared on the device by the beams of one victim group are shared on the host in the
    same way, so a group's swap moves each distinct block once. Only blocks in use have a count
    (a pool of gigabytes holds hundreds of thousands of small blocks); free blocks are kept as
    runs of consecutive ids, and an allocation takes one run where one is long enough (the
    lowest such), so that a victim's blocks move in one copy (`HostKVCache`). Only when none is
    does it piece runs together, longest first.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_cnt: dict[int, int] = {}  # block id -> holders, for blocks in use
        self._runs: list[tuple[int, int]] = [(0, num_blocks)] if num_blocks else []
        self._num_free = num_blocks  # (start, length) above: sorted, disjoint, never adjacent

    @property
    def num_free_blocks(self) -> int:
        return self._num_free

    @property
    def num_used_blocks(self) -> int:
        return len(self.ref_cnt)

    @property
    def num_free_runs(self) -> int:
        return len(self._runs)

    def allocate(self, num_blocks: int) -> list[int]:
        if num_blocks > self._num_free:
            raise RuntimeError(f"asked for {num_blocks} host blocks, {self._num_free} free")
        fit = next((run for run in self._runs if run[1] >= num_blocks), None)
        sources = [fit] if fit else sorted(self._runs, key=lambda run: -run[1])
        runs = dict(self._runs)  # start -> length
        out: list[int] = []
        for start, n in sources:
            take = min(n, num_blocks - len(out))
            out.extend(range(start, start + take))
            del runs[start]
            if take < n:
                runs[start + take] = n - take
            if len(out) == num_blocks:
                break
        self._runs = sorted(runs.items())
        for block_id in out:
            self.ref_cnt[block_id] = 1
        self._num_free -= num_blocks
        return out

    def touch(self, block_id: int) -> None:
        assert block_id in self.ref_cnt, f"host block {block_id} is free"
        self.ref_cnt[block_id] += 1

    def free(self, block_ids: list[int]) -> None:
        released = []
        for block_id in block_ids:
            count = self.ref_cnt.get(block_id, 0)
            if count <= 0:
                raise RuntimeError(f"double free of host block {block_id}")
            if count == 1:
                del self.ref_cnt[block_id]
                released.append(block_id)
            else:
                self.ref_cnt[block_id] = count - 1
        self._num_free += len(released)
        self._release(sorted(released))

    def _release(self, ids: list[int]) -> None:
        """Put sorted free `ids` back as runs, merged with their neighbours."""
        for _, first, n in host_runs(ids):
            i = bisect.bisect(self._runs, (first, 0))
            if i < len(self._runs) and self._runs[i][0] == first + n:  # joins the next run
                n += self._runs.pop(i)[1]
            if i and sum(self._runs[i - 1]) == first:  # joins the previous run
                first, prev = self._runs[i - 1]
                self._runs[i - 1] = (first, prev + n)
            else:
                self._runs.insert(i, (first, n))

    def check_integrity(self, tables: list[list[int]]) -> None:
        """Every host block's count is the number of swapped tables holding it."""
        holders: dict[int, int] = {}
        for table in tables:
            for block_id in table:
                holders[block_id] = holders.get(block_id, 0) + 1
        assert holders == self.ref_cnt, "host reference counts drifted from the swapped tables"
        free = {b for start, n in self._runs for b in range(start, start + n)}
        assert len(free) == self._num_free == sum(n for _, n in self._runs), "host runs drifted"
        assert not free & self.ref_cnt.keys(), "a host block is both free and in use"
        assert len(self.ref_cnt) + self._num_free == self.num_blocks, "host free count drifted"


@dataclass(frozen=True)
class PreemptionCosts:
    """Seconds to bring a victim back, by swap or by recompute, from figures timed at start-up.

    Attributes:
        transfer_fixed_s: a gathered transfer's cost whatever it moves (one way).
        transfer_s_per_block: what each block adds to it (one way).
        prefill_fixed_s: a prefill's cost whatever its length (the line's intercept through two
            timed prefill lengths). Recompute is charged it: a step that recomputes runs a prefill
            where the step it replaces would have been a decode (a graph replay, several steps
            per launch), so on a card the model does not fill, that cost is most of what
            recompute takes.
        prefill_s_per_token: what each recomputed token adds (the line's slope).
    """

    transfer_fixed_s: float
    transfer_s_per_block: float
    prefill_fixed_s: float
    prefill_s_per_token: float

    def swap_s(self, num_blocks: int) -> float:
        """Out and back in."""
        return 2 * (self.transfer_fixed_s + num_blocks * self.transfer_s_per_block)

    def recompute_s(self, num_tokens: int) -> float:
        return self.prefill_fixed_s + num_tokens * self.prefill_s_per_token

    def prefers_swap(self, num_blocks: int, num_tokens: int) -> bool:
        return self.swap_s(num_blocks) < self.recompute_s(num_tokens)

    def as_dict(self) -> dict:
        return {
            "transfer_fixed_s": self.transfer_fixed_s,
            "transfer_s_per_block": self.transfer_s_per_block,
            "prefill_fixed_s": self.prefill_fixed_s,
            "prefill_s_per_token": self.prefill_s_per_token,
        }


def host_runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """`(offset, first id, length)` of each run of consecutive ids in `ids`, in order."""
    runs: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[i - 1] + 1:
            runs.append((start, ids[start], i - start))
            start = i
    return runs


def host_blocks(swap_space_bytes: int, bytes_per_block: int) -> int:
    """Blocks a host pool of `swap_space_bytes` holds."""
    return swap_space_bytes // bytes_per_block if bytes_per_block else 0


def fitted(xs: tuple[float, float], ys: tuple[float, float]) -> tuple[float, float]:
    """(intercept, slope) of the line through two points, both clamped at zero."""
    slope = max((ys[1] - ys[0]) / (xs[1] - xs[0]), 0.0)
    return max(ys[0] - slope * xs[0], 0.0), slope

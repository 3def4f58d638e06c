"""Preemption by swapping: the host block pool and the cost model that picks swap or recompute.

PagedAttention's scheduler recovers a preempted sequence group in one of two ways: it copies the
group's blocks to CPU memory and back (swap), or frees them and computes the tokens again
(recompute). The paper found recompute better for small blocks, whose many small transfers waste
PCIe bandwidth, and swap better for large ones. Here a swap moves all of a victim's blocks in one
gathered transfer, so the block size matters less; `PreemptionCosts` compares the two from
figures timed on the machine at start-up.

The host pool holds no hashes: the prefix cache serves only device blocks, and a swapped-out
sequence's device blocks are freed (still findable by their hashes while their data lasts there).
"""

from __future__ import annotations

from dataclasses import dataclass

PREEMPTION_MODES = ("recompute", "swap", "auto")


class HostBlockPool:
    """Block ids of the host KV pool with reference counts; a block is free at count 0.

    Blocks shared on the device by the beams of one victim group are shared on the host in the
    same way, so a group's swap moves each distinct block once. Only blocks in use have a count
    (a pool of gigabytes holds hundreds of thousands of small blocks).
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_cnt: dict[int, int] = {}  # block id -> holders, for blocks in use
        self._free = list(range(num_blocks - 1, -1, -1))  # popped from the end: low ids first

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return len(self.ref_cnt)

    def allocate(self, num_blocks: int) -> list[int]:
        if num_blocks > len(self._free):
            raise RuntimeError(f"asked for {num_blocks} host blocks, {len(self._free)} free")
        out = [self._free.pop() for _ in range(num_blocks)]
        for block_id in out:
            self.ref_cnt[block_id] = 1
        return out

    def touch(self, block_id: int) -> None:
        assert block_id in self.ref_cnt, f"host block {block_id} is free"
        self.ref_cnt[block_id] += 1

    def free(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            count = self.ref_cnt.get(block_id, 0)
            if count <= 0:
                raise RuntimeError(f"double free of host block {block_id}")
            if count == 1:
                del self.ref_cnt[block_id]
                self._free.append(block_id)
            else:
                self.ref_cnt[block_id] = count - 1

    def check_integrity(self, tables: list[list[int]]) -> None:
        """Every host block's count is the number of swapped tables holding it."""
        holders: dict[int, int] = {}
        for table in tables:
            for block_id in table:
                holders[block_id] = holders.get(block_id, 0) + 1
        assert holders == self.ref_cnt, "host reference counts drifted from the swapped tables"
        assert len(self.ref_cnt) + len(self._free) == self.num_blocks, "host free count drifted"


@dataclass(frozen=True)
class PreemptionCosts:
    """Seconds to bring a victim back, by swap or by recompute, from figures timed at start-up.

    Attributes:
        transfer_fixed_s: a gathered transfer's cost whatever it moves (one way).
        transfer_s_per_block: what each block adds to it (one way).
        prefill_s_per_token: the marginal cost of a prefill token in a step (the slope between two
            prefill lengths, so a step's fixed cost, paid anyway, is not charged to recompute).
    """

    transfer_fixed_s: float
    transfer_s_per_block: float
    prefill_s_per_token: float

    def swap_s(self, num_blocks: int) -> float:
        """Out and back in."""
        return 2 * (self.transfer_fixed_s + num_blocks * self.transfer_s_per_block)

    def recompute_s(self, num_tokens: int) -> float:
        return num_tokens * self.prefill_s_per_token

    def prefers_swap(self, num_blocks: int, num_tokens: int) -> bool:
        return self.swap_s(num_blocks) < self.recompute_s(num_tokens)

    def as_dict(self) -> dict:
        return {
            "transfer_fixed_s": self.transfer_fixed_s,
            "transfer_s_per_block": self.transfer_s_per_block,
            "prefill_s_per_token": self.prefill_s_per_token,
        }


def host_blocks(swap_space_bytes: int, bytes_per_block: int) -> int:
    """Blocks a host pool of `swap_space_bytes` holds."""
    return swap_space_bytes // bytes_per_block if bytes_per_block else 0


def fitted(xs: tuple[float, float], ys: tuple[float, float]) -> tuple[float, float]:
    """(intercept, slope) of the line through two points, both clamped at zero."""
    slope = max((ys[1] - ys[0]) / (xs[1] - xs[0]), 0.0)
    return max(ys[0] - slope * xs[0], 0.0), slope

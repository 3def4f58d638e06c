"""The persistent block tables of the running sequences: one row each, on the host and the device.

Each live sequence keeps one row of a host array (int32 block ids, `max_blocks` wide) from its
first step to its release; a step copies into it only the block ids its sequence gained since the
last step, and only the rows that changed travel to the device copy the kernels read. A row is
copied whole again when its sequence's table was replaced (a preemption freed it, a fork) or a
copy-on-write changed a block id inside it. On the CPU the device copy is the host array itself.
Owned by the `ModelRunner`; the scheduler's `Sequence.block_table` stays the source of truth.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ..core.sequence import Sequence
from .staging import Staging


@dataclass
class _Row:
    """A sequence's row in the persistent block-table array and how much of it is current."""

    slot: int
    table: list[int]  # the sequence's own list object: replaced on free and fork
    synced: int


class BlockTables:
    """Rows of `max_blocks` block ids for up to `num_rows` sequences (grown on demand)."""

    def __init__(
        self,
        *,
        max_blocks: int,
        block_size: int,
        device: torch.device,
        staging: Staging,
        num_rows: int,
    ) -> None:
        self.max_blocks = max_blocks
        self.block_size = block_size
        self.device = device
        self.staging = staging
        self._rows: dict[int, _Row] = {}
        self._dirty: set[int] = set()  # rows whose host copy changed since the last push
        self._free_slots: list[int] = []
        self._host = np.zeros((0, max_blocks), dtype=np.int32)
        self.device_table: Tensor = torch.zeros((0, max_blocks), dtype=torch.int32, device=device)
        self._grow(num_rows)

    def sync(self, seq: Sequence) -> int:
        """The sequence's row, with its block table copied in."""
        table = seq.block_table
        row = self._rows.get(seq.seq_id)
        if row is None:
            if not self._free_slots:
                self._grow(2 * len(self._host))
            row = self._rows[seq.seq_id] = _Row(self._free_slots.pop(), table, 0)
        elif row.table is not table or len(table) < row.synced:
            row.table, row.synced = table, 0  # freed (preempted) or replaced: copy it all again
        n = len(table)
        if n > row.synced:
            if n > self.max_blocks:
                raise RuntimeError(
                    f"sequence {seq.seq_id} holds {n} blocks, more than max_model_len allows "
                    f"({self.max_blocks}); this is a scheduler bug"
                )
            self._host[row.slot, row.synced : n] = table[row.synced :]
            self._dirty.add(row.slot)
            row.synced = n
        return row.slot

    def slot_mapping(self, rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Cache slots (int64) of `positions` of the sequences in `rows` (broadcast)."""
        bs = self.block_size
        return self._host[rows, positions // bs].astype(np.int64) * bs + positions % bs

    def push(self) -> None:
        """Copy the rows changed since the last push to the device table."""
        if not self._dirty:
            return
        if self.device.type != "cpu":  # on the CPU the device table is the host array
            idx = np.fromiter(self._dirty, dtype=np.int64, count=len(self._dirty))
            rows = self.staging.to_device(self._host[idx])
            self.device_table.index_copy_(0, self.staging.to_device(idx), rows)
        self._dirty.clear()

    def invalidate(self) -> None:
        """Block ids changed inside some tables (a copy-on-write): copy every row again."""
        for row in self._rows.values():
            row.synced = 0

    def release(self, seq_id: int) -> None:
        """Give a finished sequence's row back."""
        row = self._rows.pop(seq_id, None)
        if row is not None:
            self._free_slots.append(row.slot)

    def clear(self) -> None:
        self._rows.clear()

    def _grow(self, num_rows: int) -> None:
        old = len(self._host)
        host = np.zeros((num_rows, self.max_blocks), dtype=np.int32)
        host[:old] = self._host
        self._host = host
        if self.device.type == "cpu":
            self.device_table = torch.from_numpy(host)
        else:
            dev = torch.zeros((num_rows, self.max_blocks), dtype=torch.int32, device=self.device)
            dev[:old] = self.device_table
            self.device_table = dev
        self._free_slots.extend(range(num_rows - 1, old - 1, -1))

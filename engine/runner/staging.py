"""Host-to-device copies of a step's small inputs through one pinned arena.

A copy from pageable memory makes the host wait for the stream; from pinned memory it is
asynchronous, but the memory must not be overwritten until the copy has run. The arena is reused
each step once the previous step's copies are done: an event recorded after each copy, waited on
at the start of the next step (not a device-wide synchronisation). On the CPU, arrays are used as
they are.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from ..core.units import cdiv

_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32}


class Staging:
    """Stages int32/int64 arrays for asynchronous copies to `device`."""

    def __init__(self, device: torch.device, size: int = 4 * 2**20) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        if self.pinned:
            self._arena = torch.empty(size, dtype=torch.uint8).pin_memory()
            self._arena_np = self._arena.numpy()
            self._used = 0
            self._event = torch.cuda.Event()

    def begin_step(self) -> None:
        """Reuse the arena once every copy of the previous step has been done."""
        if self.pinned:
            self._event.synchronize()
            self._used = 0

    def stage(self, array: np.ndarray) -> Tensor:
        """A host tensor holding `array`: on CUDA, a slice of the pinned arena (valid until the
        next step begins), which an asynchronous copy may read; on the CPU, the array itself.
        Call `staged()` after enqueueing the copy that reads it."""
        if not self.pinned:
            return torch.from_numpy(np.ascontiguousarray(array))
        start = cdiv(self._used, 8) * 8
        end = start + array.nbytes
        if end > len(self._arena):
            self._event.synchronize()  # no copy still reads the old arena
            self._arena = torch.empty(2 * end, dtype=torch.uint8).pin_memory()
            self._arena_np = self._arena.numpy()
            start, end = 0, array.nbytes
        self._used = end
        self._arena_np[start:end].view(array.dtype).reshape(array.shape)[...] = array
        return self._arena[start:end].view(_TORCH_DTYPES[array.dtype]).view(array.shape)

    def staged(self) -> None:
        """Mark the copies enqueued so far as readers of the arena."""
        if self.pinned:
            self._event.record()

    def to_device(self, array: np.ndarray) -> Tensor:
        """The array on the device (on the CPU: the array itself, no copy)."""
        host = self.stage(array)
        if not self.pinned:
            return host
        dev = host.to(self.device, non_blocking=True)
        self.staged()
        return dev

"""The host side of swapping: swapped-out KV blocks in host memory and the transfers to them.

The host pool is `[blocks, layers, 2, *block]`: a block is one contiguous run over every layer's
K and V, so consecutive host blocks are one contiguous range of memory. A transfer gathers (or
lands) a victim's device blocks in one contiguous device tensor and copies each run of
consecutive host ids in one copy; `HostBlockPool` hands a victim one run where it can, so a swap
is one gather kernel and one copy each way.

Transfers are queued on the current stream and never waited for. Whatever reads or writes either
side next (the step's forward pass, a later swap, a block freed and reused) comes after them in
stream order, and the host never touches the pool's memory itself. On CUDA the pool is pinned,
so a copy is a DMA that runs while the host prepares the next step; on the CPU device it is an
ordinary tensor and the same code runs synchronously.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch
from torch import Tensor

from ..core.swap import host_runs
from .staging import Staging


class HostKVCache:
    """Swapped-out blocks of the device KV pool `kv` (`[layers, 2, blocks, *block]`) in host
    memory, allocated on first use; `seconds` is the time the transfers took."""

    def __init__(self, kv: Tensor, num_blocks: int, staging: Staging) -> None:
        self.num_blocks = num_blocks
        self._kv = kv
        self._staging = staging
        self._cuda = kv.device.type == "cuda"
        self._pool: Tensor | None = None
        self._seconds = 0.0
        self._timings: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    @property
    def bytes_per_block(self) -> int:
        layers, kv, _, *rest = self._kv.shape
        return layers * kv * int(np.prod(rest)) * self._kv.element_size()

    @property
    def seconds(self) -> float:
        """Time spent in transfers so far (on CUDA read from events, waiting for the last)."""
        for start, end in self._timings:
            end.synchronize()
            self._seconds += start.elapsed_time(end) / 1000
        self._timings.clear()
        return self._seconds

    def reset_seconds(self) -> None:
        _ = self.seconds
        self._seconds = 0.0

    def swap_out(self, dev: list[int], host: list[int]) -> None:
        """Copy device blocks `dev[i]` into host blocks `host[i]`."""
        if not dev:
            return
        order = sorted(range(len(host)), key=host.__getitem__)
        host = [host[i] for i in order]
        with self._timed():
            gathered = self._blocks_view().index_select(0, self._index([dev[i] for i in order]))
            pool = self._host_pool()
            for offset, first, n in host_runs(host):
                pool[first : first + n].copy_(gathered[offset : offset + n], non_blocking=True)

    def swap_in(self, host: list[int], dev: list[int]) -> None:
        """Copy host blocks `host[i]` into device blocks `dev[i]`."""
        if not host:
            return
        order = sorted(range(len(host)), key=host.__getitem__)
        host = [host[i] for i in order]
        with self._timed():
            pool = self._host_pool()
            landed = torch.empty(
                (len(host), *pool.shape[1:]), dtype=pool.dtype, device=self._kv.device
            )
            for offset, first, n in host_runs(host):
                landed[offset : offset + n].copy_(pool[first : first + n], non_blocking=True)
            self._blocks_view()[self._index([dev[i] for i in order])] = landed

    def close(self) -> None:
        _ = self.seconds
        self._pool = None
        self._kv = None

    # ------------------------------------------------------------------ internals

    def _blocks_view(self) -> Tensor:
        """The device pool as `[blocks, layers, 2, *block]` (a view)."""
        return self._kv.permute(2, 0, 1, *range(3, self._kv.dim()))

    def _host_pool(self) -> Tensor:
        if self._pool is None:
            layers, kv, _, *rest = self._kv.shape
            self._pool = torch.empty(
                (self.num_blocks, layers, kv, *rest), dtype=self._kv.dtype, pin_memory=self._cuda
            )
        return self._pool

    def _index(self, ids: list[int]) -> Tensor:
        return self._staging.to_device(np.array(ids, dtype=np.int64))

    @contextmanager
    def _timed(self) -> Iterator[None]:
        """Time what the block enqueues: by events on CUDA (read later, not waited for here; the
        pairs already done are folded in), else by the clock."""
        if not self._cuda:
            start = time.perf_counter()
            yield
            self._seconds += time.perf_counter() - start
            return
        events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        events[0].record()
        yield
        events[1].record()
        while self._timings and self._timings[0][1].query():
            start_ev, end_ev = self._timings.pop(0)
            self._seconds += start_ev.elapsed_time(end_ev) / 1000
        self._timings.append(events)

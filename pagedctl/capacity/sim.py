"""Section 4: one arrival stream against three allocators of the same pool.

The model (the one behind the vLLM-on-a-T4 figures that `recipes/capacity-t4.yaml` compares
against): requests arrive as a Poisson stream; a request of `size` tokens (prompt + output, cut to
max_len) lives `lifetime` steps and holds its memory from admission to departure. An allocator
that cannot place a request when it arrives refuses it (no queue), so the refusal rate is the
share of traffic each scheme turns away at that load.

- reservation: a contiguous `max_len` buffer per request (every buffer is the same size, so the
  pool is `pool // max_len` slots);
- exact: a contiguous buffer of exactly `size` tokens, first-fit in one address space (an oracle
  that knows every length in advance; its only waste is external fragmentation);
- paged: `ceil(size / block_size)` blocks from the engine's own `engine.block_pool.BlockPool`.

Load is the offered token-time over the pool's: `rate x mean(size x lifetime) / pool tokens`; at
1.0 the requests would need the whole pool on average if nothing were wasted.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field

import numpy as np

from pagedctl.engine import BlockPool, cdiv

WARMUP_SHARE = 0.1  # arrivals before this share of the stream fill the pool and are not counted


class ReservationAllocator:
    """Max-length contiguous reservations: equal buffers, so a count of free slots."""

    name = "reservation"

    def __init__(self, pool_tokens: int, max_len: int) -> None:
        self.max_len = max_len
        self.free_slots = pool_tokens // max_len
        self.held = 0

    def admit(self, size: int):
        if not self.free_slots:
            return None
        self.free_slots -= 1
        self.held += self.max_len
        return True

    def release(self, handle, size: int) -> None:
        self.free_slots += 1
        self.held -= self.max_len

    def unusable_free(self, size: int, pool_tokens: int) -> int:
        return 0  # a refusal means every slot is taken; the remainder is under one slot


class ExactFitAllocator:
    """Contiguous buffers of exactly the requested size, first fit over address-ordered holes."""

    name = "exact"

    def __init__(self, pool_tokens: int) -> None:
        self.starts = np.zeros(256, dtype=np.int64)
        self.sizes = np.zeros(256, dtype=np.int64)
        self.sizes[0] = pool_tokens
        self.n = 1
        self.held = 0

    def admit(self, size: int):
        n = self.n
        sizes = self.sizes[:n]
        i = int(np.argmax(sizes >= size)) if n else 0
        if not n or sizes[i] < size:
            return None
        start = int(self.starts[i])
        if sizes[i] == size:
            self._delete(i)
        else:
            self.starts[i] += size
            self.sizes[i] -= size
        self.held += size
        return start

    def release(self, start: int, size: int) -> None:
        n, starts, sizes = self.n, self.starts, self.sizes
        i = int(np.searchsorted(starts[:n], start))
        left = i > 0 and starts[i - 1] + sizes[i - 1] == start
        right = i < n and starts[i] == start + size
        if left and right:
            sizes[i - 1] += size + sizes[i]
            self._delete(i)
        elif left:
            sizes[i - 1] += size
        elif right:
            starts[i] = start
            sizes[i] += size
        else:
            self._insert(i, start, size)
        self.held -= size

    def unusable_free(self, size: int, pool_tokens: int) -> int:
        free = pool_tokens - self.held
        return free if free >= size else 0  # free, yet in no hole large enough

    def _delete(self, i: int) -> None:
        n = self.n
        self.starts[i : n - 1] = self.starts[i + 1 : n]
        self.sizes[i : n - 1] = self.sizes[i + 1 : n]
        self.n = n - 1

    def _insert(self, i: int, start: int, size: int) -> None:
        n = self.n
        if n == len(self.starts):
            self.starts = np.concatenate([self.starts, np.zeros(n, dtype=np.int64)])
            self.sizes = np.concatenate([self.sizes, np.zeros(n, dtype=np.int64)])
        self.starts[i + 1 : n + 1] = self.starts[i:n]
        self.sizes[i + 1 : n + 1] = self.sizes[i:n]
        self.starts[i] = start
        self.sizes[i] = size
        self.n = n + 1


class PagedAllocator:
    """Blocks from the engine's `BlockPool`, taken at admission and freed tail first."""

    name = "paged"

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size

    @property
    def held(self) -> int:
        return self.pool.num_used_blocks * self.block_size

    def admit(self, size: int):
        need = cdiv(size, self.block_size)
        if need > self.pool.num_free_blocks:
            return None
        return self.pool.get_new_blocks(need)

    def release(self, blocks, size: int) -> None:
        self.pool.free_blocks(reversed(blocks))

    def unusable_free(self, size: int, pool_tokens: int) -> int:
        return 0  # any free block serves anyone: a refusal means too few blocks are free


@dataclass
class AllocatorResult:
    """One allocator at one load; fractions are of the pool's tokens."""

    allocator: str
    load: float
    requests: int = 0
    refused: int = 0
    occupancy: float = 0.0  # time-averaged memory held
    utilisation: float = 0.0  # time-averaged tokens the live sequences hold
    mean_live: float = 0.0  # time-averaged sequences admitted and not yet finished
    held_at_refusal: float | None = None  # mean over refusals
    p5_held_at_refusal: float | None = None  # 5th percentile: "refuses from ... held"
    min_held_at_refusal: float | None = None
    used_at_refusal: float | None = None
    internal_waste_at_refusal: float | None = None  # held but not holding tokens
    external_waste_at_refusal: float | None = None  # free, but unusable for the refused request
    wall_s: float = 0.0

    @property
    def refusal_rate(self) -> float:
        return self.refused / self.requests if self.requests else 0.0

    def as_dict(self) -> dict:
        return {**self.__dict__, "refusal_rate": self.refusal_rate}


@dataclass(frozen=True)
class Stream:
    """Sizes, lifetimes and unit-rate inter-arrival gaps, shared by every load and allocator."""

    sizes: np.ndarray
    lifetimes: np.ndarray
    gaps: np.ndarray
    token_time: float = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "token_time", float(np.mean(self.sizes * self.lifetimes)))


def make_stream(lengths, n: int, seed: int = 0) -> Stream:
    """`n` requests drawn from a `Lengths` source, reproducibly."""
    rng = np.random.default_rng(seed)
    sizes, lifetimes = lengths.sample(n, rng)
    return Stream(sizes.astype(np.int64), lifetimes, rng.exponential(1.0, n))


def run_allocator(alloc, stream: Stream, pool_tokens: int, load: float) -> AllocatorResult:
    """Drive one allocator through the stream at `load`; measure after the warm-up."""
    t0 = time.perf_counter()
    rate = load * pool_tokens / stream.token_time
    arrivals = (np.cumsum(stream.gaps) / rate).tolist()
    sizes = stream.sizes.tolist()
    lifetimes = stream.lifetimes.tolist()
    n = len(sizes)
    first = int(n * WARMUP_SHARE)
    t_warm = arrivals[first] if n else 0.0
    r = AllocatorResult(alloc.name, load)
    heap: list = []
    push, pop = heapq.heappush, heapq.heappop
    admit, release = alloc.admit, alloc.release
    used = live = 0
    held_int = used_int = live_int = 0.0
    last = t_warm
    ref_used = ref_ext = 0.0
    ref_helds: list[int] = []
    for i in range(n):
        t = arrivals[i]
        while heap and heap[0][0] <= t:
            end, _, handle, size = pop(heap)
            if end > last:
                dt = end - last
                held_int += alloc.held * dt
                used_int += used * dt
                live_int += live * dt
                last = end
            release(handle, size)
            used -= size
            live -= 1
        if t > last:
            dt = t - last
            held_int += alloc.held * dt
            used_int += used * dt
            live_int += live * dt
            last = t
        size = sizes[i]
        handle = admit(size)
        if handle is not None:
            push(heap, (t + lifetimes[i], i, handle, size))
            used += size
            live += 1
        if i < first:
            continue
        r.requests += 1
        if handle is None:
            r.refused += 1
            ref_helds.append(alloc.held)
            ref_used += used
            ref_ext += alloc.unusable_free(size, pool_tokens)
    span = (last - t_warm) * pool_tokens
    if span > 0:
        r.occupancy, r.utilisation = held_int / span, used_int / span
        r.mean_live = live_int / (last - t_warm)
    if r.refused:
        k = r.refused * pool_tokens
        ref_held = float(sum(ref_helds))
        r.held_at_refusal, r.used_at_refusal = ref_held / k, ref_used / k
        r.internal_waste_at_refusal = (ref_held - ref_used) / k
        r.external_waste_at_refusal = ref_ext / k
        r.p5_held_at_refusal = float(np.percentile(ref_helds, 5)) / pool_tokens
        r.min_held_at_refusal = min(ref_helds) / pool_tokens
    r.wall_s = time.perf_counter() - t0
    return r


def simulate(
    stream: Stream,
    *,
    num_blocks: int,
    block_size: int,
    max_len: int,
    loads: list[float],
    allocators: tuple[str, ...] = ("reservation", "exact", "paged"),
) -> list[AllocatorResult]:
    """Every allocator at every load, on a pool of `num_blocks` x `block_size` tokens."""
    pool_tokens = num_blocks * block_size
    makers = {
        "reservation": lambda: ReservationAllocator(pool_tokens, max_len),
        "exact": lambda: ExactFitAllocator(pool_tokens),
        "paged": lambda: PagedAllocator(num_blocks, block_size),
    }
    return [
        run_allocator(makers[name](), stream, pool_tokens, load)
        for load in loads
        for name in allocators
    ]


def offered_slots(stream: Stream, pool_tokens: int, load: float) -> float:
    """Sequences the stream would keep alive at `load` if none were refused (rate x lifetime)."""
    rate = load * pool_tokens / stream.token_time
    return rate * float(np.mean(stream.lifetimes))


def erlang_b(servers: int, offered: float) -> float:
    """Erlang's loss formula: the share of Poisson arrivals refused by `servers` equal slots
    under `offered` load (whatever the lifetime distribution): the reservation scheme's theory."""
    b = 1.0
    for k in range(1, servers + 1):
        b = offered * b / (k + offered * b)
    return b


def bench(requests: int, load: float, seed: int = 0) -> dict:
    """Time one load of the T4 capacity setting (lognormal mean 260 / median 180, 58,064 blocks
    of 16, max length 2,048) through all three allocators: the figure the 1M-request target is
    about."""
    import os

    from pagedctl.capacity.lengths import from_distribution

    t0 = time.perf_counter()
    stream = make_stream(from_distribution("lognormal:mean=260,median=180", 2048), requests, seed)
    t_stream = time.perf_counter() - t0
    results = simulate(stream, num_blocks=58064, block_size=16, max_len=2048, loads=[load])
    total = time.perf_counter() - t0
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {
        "requests": requests,
        "load": load,
        "pool_tokens": 58064 * 16,
        "stream_s": round(t_stream, 3),
        "per_allocator_s": {r.allocator: round(r.wall_s, 3) for r in results},
        "total_s": round(total, 3),
        "us_per_request": round(1e6 * total / requests, 2),
        "target_s": 60.0,
        "cpus_allowed": affinity,
        "results": [r.as_dict() for r in results],
    }

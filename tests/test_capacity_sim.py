"""`pagedctl capacity` section 4: the allocators, the event loop, and the T4 refusal pattern."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedctl.capacity import sim
from pagedctl.capacity.lengths import Lengths, from_distribution
from pagedctl.engine.core import block_pool

T4_LENGTHS = from_distribution("lognormal:mean=260,median=180", 2048)


def test_paged_allocator_drives_the_engines_block_pool(monkeypatch) -> None:
    calls = {"get_new_blocks": 0, "free_blocks": 0}
    for name in calls:
        real = getattr(block_pool.BlockPool, name)

        def spy(self, *args, _real=real, _name=name):
            calls[_name] += 1
            return _real(self, *args)

        monkeypatch.setattr(block_pool.BlockPool, name, spy)
    alloc = sim.PagedAllocator(num_blocks=256, block_size=16)
    assert type(alloc.pool) is block_pool.BlockPool  # the class itself, not a copy
    admitted = []
    admit = alloc.admit
    alloc.admit = lambda size: admitted.append(admit(size)) or admitted[-1]
    stream = sim.make_stream(from_distribution("uniform:min=1,max=300", 2048), 2000, seed=3)
    r = sim.run_allocator(alloc, stream, pool_tokens=256 * 16, load=1.5)
    taken = [blocks for blocks in admitted if blocks is not None]
    assert r.refused > 0 and len(taken) < 2000
    assert calls["get_new_blocks"] == len(taken)  # every admission took its blocks from the pool
    assert all(isinstance(b, block_pool.KVCacheBlock) for blocks in taken for b in blocks)
    assert calls["free_blocks"] > 0
    alloc.pool.check_integrity()
    assert 0 < alloc.pool.num_used_blocks <= 256


def test_reservation_slots_are_pool_over_max_len() -> None:
    a = sim.ReservationAllocator(pool_tokens=10_000, max_len=2048)
    assert [a.admit(5) for _ in range(5)] == [True] * 4 + [None]  # 10,000 // 2,048 = 4 slots
    assert a.held == 4 * 2048 and a.unusable_free(5, 10_000) == 0
    a.release(True, 5)
    assert a.admit(2048) is True


def test_exact_fit_first_fit_merges_and_fragments() -> None:
    a = sim.ExactFitAllocator(pool_tokens=10)
    x, y, z = a.admit(3), a.admit(3), a.admit(3)
    assert (x, y, z) == (0, 3, 6) and a.held == 9
    a.release(y, 3)  # hole [3, 6) and [9, 10)
    assert a.admit(4) is None  # 4 tokens free, none of them contiguous enough
    assert a.unusable_free(4, 10) == 4
    assert a.admit(1) == 3  # first fit: the lowest hole that is large enough
    a.release(x, 3)  # [0, 3) joins nothing on its right ([3, 4) is taken)
    a.release(3, 1)  # [3, 4) joins [0, 3) and [4, 6): one hole [0, 6)
    assert a.admit(6) == 0
    a.release(0, 6)
    a.release(z, 3)
    assert (a.n, int(a.sizes[0]), a.held) == (1, 10, 0)


class _Reference:
    """First fit over a cell map: the slow, obvious version."""

    def __init__(self, size: int) -> None:
        self.cells = [False] * size

    def admit(self, size: int):
        run = 0
        for i, used in enumerate(self.cells):
            run = 0 if used else run + 1
            if run == size:
                start = i - size + 1
                self.cells[start : i + 1] = [True] * size
                return start
        return None

    def release(self, start: int, size: int) -> None:
        self.cells[start : start + size] = [False] * size


@settings(max_examples=150, deadline=None)
@given(
    st.integers(1, 48),
    st.lists(st.tuples(st.booleans(), st.integers(1, 12), st.integers(0, 10**6)), max_size=80),
)
def test_exact_fit_matches_a_cell_map(pool: int, ops) -> None:
    fast, ref = sim.ExactFitAllocator(pool), _Reference(pool)
    live: list[tuple[int, int]] = []
    for alloc, size, pick in ops:
        if alloc or not live:
            got, want = fast.admit(size), ref.admit(size)
            assert got == want
            if got is not None:
                live.append((got, size))
        else:
            start, size = live.pop(pick % len(live))
            fast.release(start, size)
            ref.release(start, size)
        assert fast.held == sum(ref.cells)
        assert int(fast.sizes[: fast.n].sum()) == pool - fast.held
        starts, ends = fast.starts[: fast.n], fast.starts[: fast.n] + fast.sizes[: fast.n]
        assert np.all(starts[1:] > ends[:-1])  # holes ordered and never adjacent (always merged)


def test_reservation_refusals_follow_erlangs_formula() -> None:
    stream = sim.make_stream(T4_LENGTHS, 60_000, seed=1)
    slots = 58064 * 16 // 2048
    for load in (0.27, 0.32):
        (r,) = sim.simulate(
            stream,
            num_blocks=58064,
            block_size=16,
            max_len=2048,
            loads=[load],
            allocators=("reservation",),
        )
        theory = sim.erlang_b(slots, sim.offered_slots(stream, 58064 * 16, load))
        assert abs(r.refusal_rate - theory) < 0.015, (load, r.refusal_rate, theory)


def test_time_averages_obey_littles_law() -> None:
    lengths = Lengths("t", 512, prompt=np.array([10, 50, 200]), output=np.array([5, 100, 300]))
    stream = sim.make_stream(lengths, 40_000, seed=2)
    (r,) = sim.simulate(
        stream, num_blocks=4096, block_size=16, max_len=512, loads=[0.3], allocators=("exact",)
    )
    assert r.refused == 0
    rate = 0.3 * 4096 * 16 / stream.token_time
    assert r.mean_live == pytest.approx(rate * stream.lifetimes.mean(), rel=0.05)
    assert r.utilisation == pytest.approx(0.3, rel=0.05)  # nothing refused: load is what is held
    assert r.occupancy == r.utilisation  # exact fit holds exactly what it uses


def test_the_t4_pattern_reservations_refuse_first_paged_last() -> None:
    stream = sim.make_stream(T4_LENGTHS, 40_000, seed=0)
    results = sim.simulate(
        stream, num_blocks=58064, block_size=16, max_len=2048, loads=[0.285, 1.2]
    )
    r = {(x.load, x.allocator): x for x in results}
    moderate, high = 0.285, 1.2
    # moderate load: reservations turn away ~14% with the memory held and a quarter of it used
    assert 0.11 < r[moderate, "reservation"].refusal_rate < 0.17
    assert r[moderate, "reservation"].occupancy > 0.95
    assert 0.22 < r[moderate, "reservation"].utilisation < 0.28
    assert r[moderate, "exact"].refused == r[moderate, "paged"].refused == 0
    # high load: exact fit refuses with memory free but in pieces; paged only when it is gone
    exact, paged = r[high, "exact"], r[high, "paged"]
    assert exact.refused and 0.83 < exact.p5_held_at_refusal < 0.91
    assert exact.external_waste_at_refusal > 0.05 and exact.internal_waste_at_refusal == 0
    assert paged.refused > exact.refused
    assert paged.p5_held_at_refusal > 0.95 and paged.external_waste_at_refusal == 0


def test_bench_reports_its_figures() -> None:
    r = sim.bench(3000, 1.0)
    assert r["requests"] == 3000 and set(r["per_allocator_s"]) == {"reservation", "exact", "paged"}
    assert r["total_s"] >= sum(r["per_allocator_s"].values())

"""Preemption by swap to a host pool: greedy and beam outputs equal to recompute's and to an
unconstrained pool's, host-pool exhaustion falling back to recompute, aborts while swapped out
leaking nothing, the host pool and the swap moves of the KV manager on their own, `auto` and its
cost model, and the settings refused before a model is loaded.

The engines are the tiny random models of tests/tiny_models.py with their logits sharpened (as
tests/test_beam_search.py explains, a flat distribution leaves beams nearly tied, and which one
survives would be decided by rounding, not by the scheduler): one loaded model per family, rebuilt
with each pool by `LLM.reconfigure`.
"""

from __future__ import annotations

import random

import pytest
import torch

from pagedctl.engine import (
    BeamSearchParams,
    ConfigError,
    EngineConfig,
    SamplingParams,
    Scheduler,
    Sequence,
    SequenceStatus,
)
from pagedctl.engine.core.beam_search import BeamGroup
from pagedctl.engine.core.config import CacheConfig, SchedulerConfig
from pagedctl.engine.core.kv_cache_manager import KVCacheManager
from pagedctl.engine.core.swap import HostBlockPool, PreemptionCosts, fitted, host_blocks
from pagedctl.engine.llm import LLM
from pagedctl.engine.runner.host_kv import HostKVCache
from pagedctl.engine.runner.staging import Staging
from tests.sched_utils import EOS, make_seq
from tests.tiny_models import save_tiny_model

ATOL = 1e-4  # beams' cumulative log-probabilities, run against run
SWAP_SPACE = 1 / 64  # GiB: 16 MiB, hundreds of blocks of the tiny models, never full here
TINY_SWAP_SPACE = 16 * 1024 / 2**30  # two 16-token blocks of the tiny models (8 KiB each)

_rng = random.Random(0)
PROMPTS = [[_rng.randrange(256) for _ in range(_rng.randint(3, 40))] for _ in range(12)]
PARAMS: list = [
    SamplingParams(temperature=0.0, max_tokens=_rng.randint(10, 50), ignore_eos=True)
    for _ in PROMPTS
]
N3 = 3  # a request of three greedy samples
BEAMS = (5, 9)  # beam groups of width 4 among them
PARAMS[N3] = SamplingParams(n=3, temperature=0.0, max_tokens=30, ignore_eos=True)
PARAMS[BEAMS[0]] = BeamSearchParams(beam_width=4, max_tokens=24)
PARAMS[BEAMS[1]] = BeamSearchParams(beam_width=4, max_tokens=16)
# Pools, by block size, that hold every request alone but not all at once: many preemptions.
SMALL_POOL = {16: 16, 64: 6}
BIG_POOL = 1000
BASE = dict(
    num_blocks=BIG_POOL,
    block_size=16,
    enable_prefix_caching=False,
    preemption_mode="recompute",
    swap_space=SWAP_SPACE,
    max_num_seqs=256,
)


def save_sharp_model(arch: str, folder) -> None:
    """The tiny model of `arch`, its final norm scaled so its logits have a standard deviation
    of 2 (a softmax temperature of about 0.1: competing beams far apart)."""
    model = save_tiny_model(arch, folder)
    with torch.no_grad():
        std = model(torch.tensor([PROMPTS[0]])).logits.std().item()
        model.model.norm.weight.mul_(2.0 / std)
    model.save_pretrained(folder, safe_serialization=True)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """One LLM per family (debug=True: the invariants are checked after every step)."""
    out = {}
    for arch in ("qwen2", "llama", "mistral"):
        folder = tmp_path_factory.mktemp(f"{arch}-swap")
        save_sharp_model(arch, folder)
        out[arch] = LLM(str(folder), device="cpu", dtype="float32", debug=True, **BASE)
    return out


def results(outs) -> list[list[tuple[list[int], float | None, str | None]]]:
    return [[(c.token_ids, c.cumulative_logprob, c.stop_reason) for c in o.outputs] for o in outs]


def assert_same(got, ref) -> None:
    """Token for token the same completions in the same order; beams' cumulative
    log-probabilities within ATOL."""
    assert len(got) == len(ref)
    for i, (a, b) in enumerate(zip(got, ref, strict=True)):
        assert [c[0] for c in a] == [c[0] for c in b], f"request {i}"
        assert [c[2] for c in a] == [c[2] for c in b], f"request {i}"
        for (_, x, _), (_, y, _) in zip(a, b, strict=True):
            assert (x is None) == (y is None), f"request {i}"
            if x is not None:
                assert abs(x - y) <= ATOL, (i, x, y)


def rebuild(llm: LLM, **settings) -> None:
    """A fresh pool, scheduler and runner with BASE and `settings` (a test that failed before
    may have left requests in flight: they are dropped, so that it fails alone)."""
    if llm.scheduler.has_unfinished() or len(llm.tracker):
        llm.abort_all()
    llm.reconfigure(**{**BASE, **settings})


class Run:
    """One `generate` on a rebuilt pool, with the units that the KV manager swapped out."""

    def __init__(self, llm: LLM, prompts=PROMPTS, params=PARAMS, **settings) -> None:
        rebuild(llm, **settings)
        self.llm = llm
        self.swapped_units: list[list[Sequence]] = []
        self.swapped_blocks: list[int] = []  # each swapped unit's distinct device blocks
        kv = llm.scheduler.kv
        swap_out = kv.swap_out

        def recording(unit):
            blocks = len({b for seq in unit for b in kv.held_blocks(seq)})
            ops = swap_out(unit)
            if ops is not None:
                assert len(ops) == blocks
                self.swapped_units.append(list(unit))
                self.swapped_blocks.append(blocks)
            return ops

        kv.swap_out = recording
        self.outs = llm.generate(prompts, params)
        self.results = results(self.outs)
        self.sched = llm.stats["scheduler"]
        self.swap = llm.stats["swap"]

    @property
    def swapped_requests(self) -> set[str]:
        return {unit[0].request_id for unit in self.swapped_units}

    def assert_nothing_held(self) -> None:
        """Every device block free (cached ones count as free), no host block in use, nothing
        swapped out, nothing left in flight."""
        sched = self.llm.scheduler
        assert sched.kv.num_free_blocks == sched.kv.num_blocks
        if sched.kv.host is not None:
            assert sched.kv.host.num_used_blocks == 0
            sched.kv.host.check_integrity([])
        assert not sched.has_unfinished() and not sched.swapped and self.swap["swapped_now"] == 0
        assert len(self.llm.tracker) == 0


_references: dict[str, list] = {}


def reference(llm: LLM, arch: str) -> list:
    """The outputs of a pool that never preempts (computed once per family)."""
    if arch not in _references:
        run = Run(llm)
        assert run.sched["num_preemptions"] == 0
        assert all(o.ok for o in run.outs)
        assert [len(o.outputs) for o in run.outs].count(4) == 2  # both groups return 4
        assert len(run.outs[N3].outputs) == 3
        _references[arch] = run.results
    return _references[arch]


# ---------------------------------------------------------------------- outputs


@pytest.mark.parametrize("prefix", [False, True], ids=["no-prefix-cache", "prefix-cache"])
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("arch", ["qwen2", "llama", "mistral"])
def test_every_preemption_mode_gives_the_unconstrained_outputs(engines, arch, block_size, prefix):
    """Greedy samples (n=1 and n=3) and two beam groups of width 4 in one batch, on a pool that
    preempts many times: recompute, swap and auto give the unconstrained pool's tokens and beam
    scores. Swap mode really swaps (beam groups and the n=3 siblings among the units moved),
    brings back every unit it moved, block for block, and leaves nothing held."""
    llm = engines[arch]
    ref = reference(llm, arch)
    small = dict(
        num_blocks=SMALL_POOL[block_size], block_size=block_size, enable_prefix_caching=prefix
    )
    by_mode = {}
    for mode in ("recompute", "swap", "auto"):
        run = by_mode[mode] = Run(llm, preemption_mode=mode, **small)
        assert_same(run.results, ref)
        assert run.sched["num_preemptions"] > 0, mode
        # Each preemption is counted once, in its request's metrics (a group's in the group).
        assert sum(o.metrics.num_preemptions for o in run.outs) == run.sched["num_preemptions"]
        assert "kv_cache_full" not in {c[2] for r in run.results for c in r}
        run.assert_nothing_held()
    recompute, swap = by_mode["recompute"], by_mode["swap"]
    assert recompute.swap["swap_outs"] == 0 and recompute.swap["num_host_blocks"] == 0
    assert recompute.swap["recomputed_tokens"] > 0
    st = swap.swap
    assert st["swap_outs"] > 0 and st["fallbacks_to_recompute"] == 0
    assert st["swap_ins"] == st["swap_outs"] == len(swap.swapped_units)
    assert st["blocks_in"] == st["blocks_out"] > 0
    block_bytes = llm.layout.bytes_per_block(block_size)
    assert st["bytes_moved"] == (st["blocks_in"] + st["blocks_out"]) * block_bytes
    assert st["num_host_blocks"] == host_blocks(int(SWAP_SPACE * 2**30), block_bytes)
    assert st["transfer_s"] > 0
    # A swap moves KV that recompute computes again.
    assert st["recomputed_tokens"] < recompute.swap["recomputed_tokens"]
    if block_size == 16:  # (the 64-token pool swaps fewer, larger units)
        assert any(len(unit) == 4 for unit in swap.swapped_units)  # a group's four beams
        assert str(N3) in swap.swapped_requests


def test_an_exhausted_host_pool_falls_back_to_recompute(engines):
    """A host pool of two blocks takes some swaps and refuses the rest, which are recomputed
    instead; a pool of none refuses them all. The outputs stay those of the unconstrained
    pool, and nothing is left on the host."""
    llm = engines["qwen2"]
    ref = reference(llm, "qwen2")
    small = dict(num_blocks=SMALL_POOL[16], block_size=16, preemption_mode="swap")
    tiny = Run(llm, swap_space=TINY_SWAP_SPACE, **small)
    assert_same(tiny.results, ref)
    st = tiny.swap
    assert st["num_host_blocks"] == 2
    assert st["fallbacks_to_recompute"] > 0 and st["swap_outs"] > 0
    assert st["recomputed_tokens"] > 0
    assert max(tiny.swapped_blocks) <= 2  # only units the two blocks could take
    assert tiny.sched["num_swap_fallbacks"] == st["fallbacks_to_recompute"]
    tiny.assert_nothing_held()

    none = Run(llm, swap_space=0.0, **small)
    assert_same(none.results, ref)
    assert none.swap["num_host_blocks"] == 0 and none.swap["swap_outs"] == 0
    # Every swap asked for fell back (a group whose first beams already took this step's
    # slots is recomputed without asking: those are not fallbacks).
    assert 0 < none.swap["fallbacks_to_recompute"] <= none.sched["num_preemptions"]
    none.assert_nothing_held()


def test_a_group_too_big_to_swap_back_alone_is_recomputed_and_capped(engines):
    """A pool of four 8-token blocks: a group of three beams is swapped out for an older
    request; alone again, it cannot come back (its beams need more blocks than the pool holds),
    so it is recomputed, and capped, in that same step, as under recompute: that step does not
    run empty (`LLM.step` would raise "scheduler made no progress")."""
    llm = engines["qwen2"]
    prompts = [[11, 12, 13, 14, 30, 31, 3]] * 2
    params = [
        BeamSearchParams(beam_width=1, max_tokens=3, ignore_eos=True),
        BeamSearchParams(beam_width=3, max_tokens=3, ignore_eos=True),
    ]
    pool = dict(num_blocks=4, block_size=8)
    recompute = Run(llm, prompts, params, preemption_mode="recompute", **pool)
    swap = Run(llm, prompts, params, preemption_mode="swap", **pool)
    assert swap.results == recompute.results
    assert {c[2] for c in swap.results[1]} == {"kv_cache_full"}
    assert swap.swap["swap_outs"] == 1 and swap.swap["swap_ins"] == 0
    assert swap.swap["fallbacks_to_recompute"] == 1
    swap.assert_nothing_held()


# ---------------------------------------------------------------------- aborts


def test_abort_all_while_swapped_out_frees_both_pools(engines):
    """`stream(should_stop=...)` aborts everything as soon as some request is swapped out: no
    device or host block stays held, and the same engine then runs the batch again to the
    unconstrained outputs."""
    llm = engines["llama"]
    ref = reference(llm, "llama")
    rebuild(llm, num_blocks=SMALL_POOL[16], preemption_mode="swap")
    sched = llm.scheduler
    seen = []

    def should_stop():
        seen.append(sched.num_swapped)
        return sched.num_swapped > 0

    outs = list(llm.stream(PROMPTS, PARAMS, should_stop=should_stop))
    assert seen[-1] > 0 and sched.kv.host.num_used_blocks == 0
    assert len(outs) < len(PROMPTS)  # stopped early
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    assert not sched.has_unfinished() and not sched.swapped and len(llm.tracker) == 0
    again = results(llm.generate(PROMPTS, PARAMS))
    assert_same(again, ref)
    assert sched.stats.num_swap_outs > 0 and sched.kv.host.num_used_blocks == 0


def _kind(seq: Sequence) -> str:
    if seq.beam is not None:
        return "beams"
    return "samples" if seq.sampling_params.n > 1 else "plain"


def test_aborting_swapped_requests_leaks_nothing_and_leaves_the_others_alone(engines):
    """A beam group, the n=3 request and a plain one, each aborted while swapped out: each
    frees its host blocks at once; the rest finish with the unconstrained outputs, and at the
    end both pools are empty."""
    llm = engines["qwen2"]
    ref = reference(llm, "qwen2")
    rebuild(llm, num_blocks=SMALL_POOL[16], preemption_mode="swap")
    sched, kv = llm.scheduler, llm.scheduler.kv
    for i, (prompt, params) in enumerate(zip(PROMPTS, PARAMS, strict=True)):
        assert not llm.tracker.add(i, prompt, params, sched)
    done, aborted = {}, {}
    for _ in range(2_000):
        if not sched.has_unfinished():
            break
        for out in llm.step():
            done[int(out.request_id)] = out
        unit = next((u for u in sched.swapped if _kind(u[0]) not in aborted), None)
        if unit is None:
            continue
        kind, rid = _kind(unit[0]), unit[0].request_id
        seqs = [s for s in sched.unfinished() if s.request_id == rid]
        used = kv.host.num_used_blocks
        held = len({h for s in seqs for h in kv.host_table(s)})
        assert held > 0
        sched.finish(seqs, SequenceStatus.FINISHED_ABORTED)
        for seq in seqs:
            llm.runner.release(seq)
            assert seq.status == SequenceStatus.FINISHED_ABORTED and not kv.host_table(seq)
        assert used - kv.host.num_used_blocks == held
        sched.check_invariants()
        aborted[kind] = int(rid)
    assert set(aborted) == {"beams", "samples", "plain"} and not sched.has_unfinished()
    assert aborted["samples"] == N3 and aborted["beams"] in BEAMS
    assert set(done) == set(range(len(PROMPTS))) - set(aborted.values())
    for i, out in done.items():
        assert_same(results([out]), [ref[i]])
    assert llm.abort_all() == len(aborted)  # the tracker forgets them
    assert kv.num_free_blocks == kv.num_blocks and kv.host.num_used_blocks == 0
    kv.host.check_integrity([])


# ---------------------------------------------------------------------- auto


def test_auto_calibrates_its_costs_and_follows_them(engines):
    """`auto` times a transfer and a prefill at start-up (non-negative figures, shown in the
    stats) and gives recompute's outputs. Costs under which a swap never pays make it
    recompute every victim; costs under which it always pays make it swap every one."""
    llm = engines["qwen2"]
    ref = reference(llm, "qwen2")
    small = dict(num_blocks=SMALL_POOL[16], block_size=16, preemption_mode="auto")
    run = Run(llm, **small)
    costs = llm.scheduler.costs
    assert isinstance(costs, PreemptionCosts)
    assert min(costs.as_dict().values()) >= 0
    assert costs.transfer_fixed_s + costs.transfer_s_per_block > 0
    assert run.swap["costs"] == costs.as_dict()
    assert_same(run.results, ref)

    for swaps, forced in (
        (False, PreemptionCosts(1.0, 1.0, 0.0, 0.0)),  # a transfer costs a second, prefills nothing
        (True, PreemptionCosts(0.0, 0.0, 0.0, 1.0)),  # a transfer is free, a token costs a second
    ):
        rebuild(llm, **small)
        llm.scheduler.costs = forced
        got = results(llm.generate(PROMPTS, PARAMS))
        assert_same(got, ref)
        stats = llm.stats["swap"]
        preemptions = llm.stats["scheduler"]["num_preemptions"]
        assert preemptions > 0
        if swaps:
            assert stats["swap_outs"] > 0 and stats["fallbacks_to_recompute"] == 0
        else:
            assert stats["swap_outs"] == 0 and stats["recomputed_tokens"] > 0
            assert stats["fallbacks_to_recompute"] == 0  # recompute was chosen, not forced


def test_auto_without_room_to_calibrate_swaps_while_the_host_has_room(engines):
    """A host pool under two blocks cannot be timed: `auto` has no costs and behaves as swap."""
    llm = engines["qwen2"]
    rebuild(llm, preemption_mode="auto", swap_space=8 * 1024 / 2**30)
    assert llm.scheduler.kv.host.num_blocks == 1 and llm.scheduler.costs is None
    assert llm.stats["swap"]["costs"] is None


def test_preemption_costs_by_hand():
    """A round trip is two transfers; recompute is charged a prefill's fixed cost and its
    tokens; swap is chosen exactly when its round trip is the cheaper."""
    costs = PreemptionCosts(
        transfer_fixed_s=1e-3,
        transfer_s_per_block=1e-4,
        prefill_fixed_s=0.0,
        prefill_s_per_token=1e-5,
    )
    assert costs.swap_s(10) == pytest.approx(2 * (1e-3 + 10 * 1e-4))  # 4 ms
    assert costs.recompute_s(160) == pytest.approx(1.6e-3)
    assert not costs.prefers_swap(10, 160)  # 4 ms against 1.6 ms
    assert costs.prefers_swap(10, 1000)  # 4 ms against 10 ms
    assert not costs.prefers_swap(10, 400)  # a tie recomputes
    assert costs.as_dict() == {
        "transfer_fixed_s": 1e-3,
        "transfer_s_per_block": 1e-4,
        "prefill_fixed_s": 0.0,
        "prefill_s_per_token": 1e-5,
    }
    # A prefill's fixed cost is charged to every recompute, however short.
    flat = PreemptionCosts(1e-4, 1e-5, prefill_fixed_s=5e-3, prefill_s_per_token=0.0)
    assert flat.recompute_s(1) == flat.recompute_s(1000) == pytest.approx(5e-3)
    assert flat.prefers_swap(64, 1)  # 1.48 ms of copies against a 5 ms prefill
    assert fitted((1, 64), (2.0, 8.3)) == pytest.approx((1.9, 0.1))
    assert fitted((1, 64), (5.0, 1.0)) == (5.0, 0.0)  # a falling slope is clamped at zero
    assert fitted((10, 20), (0.0, 10.0)) == (0.0, 1.0)  # so is a negative intercept
    assert host_blocks(16 * 1024, 8 * 1024) == 2
    assert host_blocks(16 * 1024 - 1, 8 * 1024) == 1
    assert host_blocks(16 * 1024, 0) == 0


# ---------------------------------------------------------------------- settings


@pytest.mark.parametrize(
    "settings, match",
    [
        ({"preemption_mode": "swapp"}, "preemption_mode must be one of recompute, swap, auto"),
        ({"preemption_mode": None}, "preemption_mode needs a value"),
        ({"swap_space": -1.0}, "swap_space must be a number >= 0"),
        ({"swap_space": "4GiB"}, "swap_space must be a number"),
    ],
)
def test_bad_swap_settings_are_refused_before_loading(monkeypatch, settings, match):
    """The settings are checked before the model is resolved or built."""

    def never(*args, **kwargs):
        raise AssertionError("the model was loaded before the settings were checked")

    monkeypatch.setattr("pagedctl.engine.llm.resolve_model", never)
    monkeypatch.setattr("pagedctl.engine.llm.build_model", never)
    with pytest.raises(ConfigError, match=match):
        LLM("no-such-model", device="cpu", **settings)
    with pytest.raises(ConfigError, match=match):
        EngineConfig(**settings)


def test_swap_settings_defaults_and_recipes():
    """recompute with 4 GiB by default; a recipe's integer swap_space is taken as GiB."""
    c = EngineConfig()
    assert (c.preemption_mode, c.swap_space) == ("recompute", 4.0)
    c = EngineConfig.from_mapping({"preemption_mode": "auto", "swap_space": 2})
    assert (c.preemption_mode, c.swap_space) == ("auto", 2.0)
    assert EngineConfig(swap_space=0.0).swap_space == 0.0


def test_recompute_mode_has_no_host_pool(engines):
    """Under recompute no host pool is sized, whatever swap_space says."""
    llm = engines["qwen2"]
    rebuild(llm, swap_space=1.0)
    assert llm.scheduler.kv.host is None and llm.memory["num_host_blocks"] == 0
    assert llm.memory["swap_space_bytes"] == 0


# ---------------------------------------------------------------------- host pool


def test_host_block_pool():
    """Low ids first, in one run; touch shares a block, free drops one holder at a time; asking
    for more than is free, freeing a free block and touching one are refused; check_integrity
    compares the counts with the tables that hold them."""
    pool = HostBlockPool(4)
    assert (pool.num_free_blocks, pool.num_used_blocks) == (4, 0)
    a = pool.allocate(2)
    assert a == [0, 1] and pool.ref_cnt == {0: 1, 1: 1}
    pool.touch(1)
    assert pool.ref_cnt[1] == 2 and (pool.num_free_blocks, pool.num_used_blocks) == (2, 2)
    pool.check_integrity([[0, 1], [1]])
    with pytest.raises(AssertionError, match="drifted"):
        pool.check_integrity([[0, 1]])
    with pytest.raises(RuntimeError, match="asked for 3 host blocks, 2 free"):
        pool.allocate(3)
    assert pool.num_free_blocks == 2  # a refused allocation takes nothing
    pool.free([1])
    assert pool.ref_cnt == {0: 1, 1: 1}
    pool.free([0, 1])
    assert (pool.num_free_blocks, pool.num_used_blocks) == (4, 0)
    pool.check_integrity([])
    with pytest.raises(RuntimeError, match="double free of host block 1"):
        pool.free([1])
    with pytest.raises(AssertionError, match="host block 3 is free"):
        pool.touch(3)
    assert pool.num_free_runs == 1  # freed blocks merge back into one run
    assert pool.allocate(4) == [0, 1, 2, 3]
    with pytest.raises(RuntimeError):
        pool.allocate(1)
    pool.free([3, 2, 1, 0])
    pool.check_integrity([])


def test_host_block_pool_hands_out_runs():
    """A victim gets one run of consecutive ids where one is long enough (the lowest); when
    none is, the longest runs are pieced together; freed ids merge with their neighbours."""
    pool = HostBlockPool(10)
    a, b, c = pool.allocate(3), pool.allocate(2), pool.allocate(3)
    assert (a, b, c) == ([0, 1, 2], [3, 4], [5, 6, 7])
    pool.free(a)
    pool.free(c)
    assert pool.num_free_runs == 2  # 0-2 and 5-9
    assert pool.allocate(4) == [5, 6, 7, 8]  # the first run that holds four
    assert pool.allocate(2) == [0, 1]
    pool.check_integrity([b, [5, 6, 7, 8], [0, 1]])
    pool.free([5, 6, 7, 8])
    assert pool.allocate(6) == [5, 6, 7, 8, 9, 2]  # no run of six: the longest first
    assert pool.num_free_blocks == 0 and pool.num_free_runs == 0
    pool.free([3, 4, 0, 1, 5, 6, 7, 8, 9, 2])
    assert pool.num_free_runs == 1
    pool.check_integrity([])


def test_host_block_pool_survives_random_use():
    """Random allocations, shares and frees: the runs and counts always match the holders."""
    rng = random.Random(0)
    pool, held = HostBlockPool(50), []
    for _ in range(3000):
        if held and rng.random() < 0.5:
            pool.free(held.pop(rng.randrange(len(held))))
        elif (n := rng.randint(1, 8)) <= pool.num_free_blocks:
            table = pool.allocate(n)
            assert len(set(table)) == n
            if rng.random() < 0.3:
                pool.touch(table[0])
                held.append([table[0]])
            held.append(table)
        pool.check_integrity(held)


def test_host_kv_cache_moves_scattered_blocks_both_ways():
    """Blocks out to scattered host ids (several runs) and back to other device blocks arrive
    whole in every layer's K and V; the transfers are timed."""
    kv = torch.randn(3, 2, 8, 4, 2, 5)  # [layers, 2, blocks, block, heads, dim]
    host = HostKVCache(kv, 6, Staging(torch.device("cpu")))
    host.swap_out([1, 6, 3, 0], [4, 0, 1, 5])  # host runs 0-1 and 4-5
    want = kv[:, :, [1, 6, 3, 0]].clone()
    kv[:, :, [1, 6, 3, 0]] = 0
    host.swap_in([5, 0, 4, 1], [2, 7, 4, 5])  # blocks 0, 6, 1, 3 land on 2, 7, 4, 5
    torch.testing.assert_close(kv[:, :, [4, 7, 5, 2]], want, rtol=0, atol=0)
    assert host.seconds > 0
    host.reset_seconds()
    assert host.seconds == 0


def _manager(num_blocks=8, host=4, caching=False) -> KVCacheManager:
    return KVCacheManager(CacheConfig(4, num_blocks, caching, num_host_blocks=host))


def _computed(kv: KVCacheManager, seq: Sequence) -> None:
    """Give `seq` the blocks of its whole prompt, as if a step had computed it."""
    assert kv.allocate_slots(seq, seq.num_tokens) is not None
    seq.num_computed_tokens = seq.num_tokens
    kv.cache_blocks(seq)


def test_swap_out_and_in_keep_sharing_inside_a_unit():
    """Two sequences of one unit sharing two blocks: the shared blocks go to the host once and
    are shared there, the device blocks are freed; back in, fresh device blocks are shared in
    the same way and the copies pair each host block with its new device block."""
    kv = _manager()
    a = make_seq(10)  # blocks of 4: two full, one partial
    _computed(kv, a)
    b = a.fork(sample_index=1)
    kv.fork(a, b)
    b.num_computed_tokens = a.num_computed_tokens
    before = list(a.block_table)
    ops = kv.swap_out([a, b])
    assert [d for d, _ in ops] == before and len({h for _, h in ops}) == 3
    assert a.block_table == b.block_table == []
    assert kv.host_table(a) == kv.host_table(b) == [h for _, h in ops]
    assert kv.host.ref_cnt == {h: 2 for _, h in ops} and kv.num_free_blocks == 8
    kv.check_integrity([])
    assert kv.blocks_to_swap_in([a, b], 1) == 3 + 0 + 1  # tokens 10 and 11 fit the third block
    back = kv.swap_in([a, b])
    assert [h for h, _ in back] == [h for _, h in ops]
    assert a.block_table == b.block_table == [d for _, d in back]
    assert all(kv.pool.blocks[d].ref_cnt == 2 for d in a.block_table)
    assert kv.host.num_used_blocks == 0 and kv.host_table(a) == []
    kv.check_integrity([a, b])


def test_swap_out_leaves_blocks_others_hold_and_is_all_or_nothing():
    """A block that a sequence outside the unit also holds is copied and stays on the device
    for it; a unit the host pool cannot take whole is refused and keeps its blocks."""
    kv = _manager(num_blocks=8, host=2, caching=True)
    a = make_seq(list(range(100, 110)))
    _computed(kv, a)
    b = make_seq(list(range(100, 108)) + [7, 7])  # a prefix hit on a's first two blocks
    hit, n = kv.get_computed_blocks(b)
    assert n == 8 and kv.allocate_slots(b, b.num_tokens - n, hit) is not None
    b.num_computed_tokens = b.num_tokens
    shared = a.block_table[:2]
    assert b.block_table[:2] == shared
    assert kv.swap_out([a]) is None  # three blocks, room for two
    assert len(a.block_table) == 3 and kv.host.num_used_blocks == 0
    kv.check_integrity([a, b])
    kv.host = HostBlockPool(3)
    ops = kv.swap_out([a])
    assert [d for d, _ in ops][:2] == shared
    assert all(kv.pool.blocks[d].ref_cnt == 1 for d in shared)  # b's, still on the device
    kv.check_integrity([b])
    kv.swap_in([a])
    assert a.block_table[:2] != shared  # fresh blocks; b's stay its own
    kv.check_integrity([a, b])
    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks == 8 and kv.host.num_used_blocks == 0


def test_swapped_in_blocks_serve_the_prefix_cache_again():
    """While a sequence is out, its freed device blocks keep their hashes; once those are
    evicted, the blocks it comes back to are registered in their place, so a later request
    with the same prefix hits them."""
    kv = _manager(num_blocks=4, host=4, caching=True)
    a = make_seq(list(range(100, 110)))
    _computed(kv, a)
    assert kv.swap_out([a]) is not None
    filler = make_seq(list(range(200, 216)))
    _computed(kv, filler)  # takes all four blocks: a's old hashes are evicted
    kv.free(filler)
    kv.swap_in([a])
    b = make_seq(list(range(100, 108)) + [5, 5])
    hit, n = kv.get_computed_blocks(b)
    assert n == 8 and [blk.block_id for blk in hit] == a.block_table[:2]


def test_no_host_pool_means_no_swap():
    """Without a host pool a swap is refused and the sequence keeps its blocks."""
    kv = _manager(host=0)
    a = make_seq(6)
    _computed(kv, a)
    assert kv.host is None and kv.swap_out([a]) is None and len(a.block_table) == 2


# ---------------------------------------------------------------------- scheduler


def _scheduler(mode="swap", num_blocks=6, host=16, max_seqs=4) -> Scheduler:
    return Scheduler(
        SchedulerConfig(64, max_seqs, 1024, debug=True, preemption_mode=mode),
        CacheConfig(4, num_blocks, False, num_host_blocks=host),
    )


def _step(sched: Scheduler, token: int = 7):
    """One schedule + update with `token` for every row that samples (beams: fixed candidates)."""
    out = sched.schedule()
    sampled, logprobs = [], []
    for seq, n in zip(out.seqs, out.num_new_tokens, strict=True):
        if seq.num_computed_tokens + n < seq.num_tokens:
            sampled.append([])
            logprobs.append([])
        elif seq.beam is not None:
            k = seq.beam.num_candidates
            sampled.append(list(range(3, 3 + k)))
            logprobs.append([-0.5 * i for i in range(1, k + 1)])
        else:
            sampled.append([token + i for i in range(seq.num_samples_to_draw)])
            logprobs.append([])
    return out, sched.update(out, sampled, logprobs)


def test_scheduler_swaps_the_newest_out_and_back_before_new_admissions():
    """The newest running sequence is swapped out (not recomputed) when the oldest needs a
    block; while it is out, a waiting request is not admitted; it comes back, with its
    computed tokens, as soon as its blocks fit, ahead of the waiting one."""
    sched = _scheduler(num_blocks=6, max_seqs=2)
    a = make_seq(7, max_tokens=10, request_id="a")
    b = make_seq(list(range(50, 57)), max_tokens=10, request_id="b")
    c = make_seq(list(range(80, 84)), max_tokens=2, request_id="c")
    for seq in (a, b, c):
        sched.add(seq)
    for _ in range(6):
        out, _ = _step(sched)
    assert not out.swap_out and sched.kv.num_free_blocks == 0
    out, _ = _step(sched)  # a needs a 4th block: b goes to the host
    assert out.preempted == [b] and b.status == SequenceStatus.SWAPPED
    assert [s.request_id for s in out.seqs] == ["a"]
    assert len(out.swap_out) == 3 and b.num_computed_tokens == 12 and not b.block_table
    assert sched.stats.num_swap_outs == 1 and sched.stats.num_recomputed_tokens == 0
    while True:
        out, _ = _step(sched)
        if out.swap_in:
            break
        assert b.status == SequenceStatus.SWAPPED and c.status == SequenceStatus.WAITING
        assert [s.request_id for s in out.seqs] == ["a"]  # nothing admitted while b is out
    assert a.is_finished and [s.request_id for s in out.seqs] == ["b", "c"]
    assert out.num_new_tokens[0] == 1  # b goes on from its computed tokens
    assert sched.stats.num_swap_ins == 1 and sched.stats.num_recomputed_tokens == 0
    while sched.has_unfinished():
        _step(sched)
    assert sched.kv.num_free_blocks == 6 and sched.kv.host.num_used_blocks == 0
    assert a.num_output_tokens == b.num_output_tokens == 10


def test_scheduler_recomputes_a_group_that_cannot_come_back_alone():
    """Runner-free, the case behind the "no progress" error: a group of three beams swapped
    out for an older one-beam group, alone again, needs more blocks than the pool has to come
    back; the step that gives up on the swap admits it for recompute and caps it at once."""
    sched = Scheduler(
        SchedulerConfig(14, 4, 10, debug=True, preemption_mode="swap"),
        CacheConfig(8, 4, False, num_host_blocks=3),
    )
    groups = []
    for width in (1, 3):
        params = BeamSearchParams(beam_width=width, max_tokens=3, ignore_eos=True)
        seq = Sequence([11, 12, 13, 14, 30, 31, 3], params.sampling_params(), eos_token_id=EOS)
        groups.append(BeamGroup(params, seq, [EOS]))
        sched.add(seq)
    for _ in range(20):
        if not sched.has_unfinished():
            break
        out, finished = _step(sched)
        assert out.seqs or finished, "a step ran nothing and finished nothing"
    assert not sched.has_unfinished()
    assert sched.stats.num_swap_outs == 1 and sched.stats.num_swap_fallbacks == 1
    assert all(g.done for g in groups)
    assert {h.stop_reason for h in groups[1].finished} == {"kv_cache_full"}
    assert sched.kv.num_free_blocks == 4 and sched.kv.host.num_used_blocks == 0

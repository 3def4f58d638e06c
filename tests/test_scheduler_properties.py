"""Property-based test: random interleavings of add / step / abort / preemption-mode switches
keep the invariants of docs/design.md, with sampled requests and beam-search groups (their
candidates drawn at random) side by side, and preemption by recompute, by swap to a host pool of
random size, or by cost (`auto`).

The runner is simulated by `SlotTokens`: the token each KV slot holds on the device and on the
host, moved by the step's swap-outs, swap-ins and copies and written by its rows, so that every
scheduled row is checked to read back its own tokens (a swap's copies that do not match the
tables, a block left out of them, a stale prefix hit would all show)."""

import dataclasses

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedctl.engine import BeamSearchParams, SamplingParams, Scheduler, Sequence, SequenceStatus
from pagedctl.engine.core.beam_search import BeamGroup
from pagedctl.engine.core.config import CacheConfig, SchedulerConfig
from pagedctl.engine.core.swap import PREEMPTION_MODES, PreemptionCosts
from tests.sched_utils import EOS

PREFIXES = [[], [11, 12, 13, 14, 15, 16, 17, 18], [11, 12, 13, 14, 30, 31]]
CANDIDATE_TOKENS = list(range(2, 14))  # EOS among them; a group of width 3 asks for 6


def candidates(seq: Sequence, data=None) -> tuple[list[int], list[float]]:
    """A beam's candidates, best first, as the runner hands them: distinct tokens with
    non-increasing log-probabilities (drawn, or fixed when `data` is None)."""
    n = seq.beam.num_candidates
    if data is None:
        return list(range(3, 3 + n)), [-0.5 * i for i in range(1, n + 1)]
    tokens = data.draw(st.permutations(CANDIDATE_TOKENS))[:n]
    costs = data.draw(st.lists(st.integers(1, 40), min_size=n, max_size=n))
    return tokens, [-c / 8 for c in sorted(costs)]


# `auto`'s costs: none (swap while the host has room), one that always swaps, one that never
# does, and one that swaps a victim of more than 5 computed tokens (a round trip of 0.5 s
# against 0.1 s a token) and recomputes a shorter one.
NEVER_SWAP = PreemptionCosts(1e3, 1.0, 0.0, 0.0)
PAST_5_TOKENS = PreemptionCosts(0.25, 0.0, 0.0, 0.1)
COSTS = [None, PreemptionCosts(0.0, 0.0, 0.0, 1.0), NEVER_SWAP, PAST_5_TOKENS]
# Full attention, or a sliding window (blocks out of it given back) shorter or longer than a block
WINDOWS = [None, None, 1, 3, 5, 11]


class SlotTokens:
    """What a runner's KV pools hold, as the token at each slot: the device pool by block id,
    the host pool by host block id (a slot never written holds None)."""

    def __init__(self, block_size: int, window: int | None = None) -> None:
        self.block_size = block_size
        self.window = window  # a row reads back only the keys its first query sees
        self.device: dict[int, list] = {}
        self.host: dict[int, list] = {}

    def _block(self, pool: dict[int, list], block_id: int) -> list:
        return list(pool.get(block_id, [None] * self.block_size))

    def run(self, out) -> None:
        """Carry out a step as `LLM.step` orders it: swap-outs, swap-ins, copy-on-write copies,
        then every row's KV writes; then each row reads its tokens back through its table."""
        for dev, host in out.swap_out:
            self.host[host] = self._block(self.device, dev)
        for host, dev in out.swap_in:
            self.device[dev] = self._block(self.host, host)
        for src, dst in out.copies:
            self.device[dst] = self._block(self.device, src)
        bs = self.block_size
        rows = list(zip(out.seqs, out.num_new_tokens, strict=True))
        for seq, n in rows:
            for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
                block = self.device.setdefault(seq.block_table[pos // bs], [None] * bs)
                block[pos % bs] = seq.token_ids[pos]
        for seq, n in rows:
            end = seq.num_computed_tokens + n
            start = max(seq.num_computed_tokens - self.window + 1, 0) if self.window else 0
            assert start // bs >= seq.num_dropped_blocks or not self.window, seq
            read = [self.device[seq.block_table[p // bs]][p % bs] for p in range(start, end)]
            assert read == seq.token_ids[start:end], f"{seq} reads the wrong KV"


def parked(seq: Sequence) -> bool:
    """A beam out of the scheduler while its preempted group's leader computes their shared
    prefix again (`BeamGroup.preempt`): it holds no block and comes back by `unfold`. (A group
    that ended while so, capped because it outgrew the pool, keeps its leader and beams.)"""
    group = seq.beam
    return (
        group is not None
        and not group.done
        and group.leader is not None
        and any(b.seq is seq for b in group.beams)
    )


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        block_size=st.sampled_from([1, 2, 4, 8]),
        num_blocks=st.integers(1, 24),
        budget=st.integers(1, 40),
        max_seqs=st.integers(1, 6),
        max_model_len=st.integers(4, 64),
        caching=st.booleans(),
        mode=st.sampled_from(PREEMPTION_MODES),
        host_blocks=st.sampled_from([0, 1, 3, 8, 64]),
        costs=st.sampled_from(COSTS),
        window=st.sampled_from(WINDOWS),
    )
    def setup(
        self,
        block_size,
        num_blocks,
        budget,
        max_seqs,
        max_model_len,
        caching,
        mode,
        host_blocks,
        costs,
        window,
    ):
        self.build(
            SchedulerConfig(budget, max_seqs, max_model_len, debug=True, preemption_mode=mode),
            CacheConfig(
                block_size, num_blocks, caching, num_host_blocks=host_blocks, sliding_window=window
            ),
            costs,
        )

    def build(self, sched_config, cache_config, costs) -> None:
        self.sched = Scheduler(sched_config, cache_config, costs)
        self.kv_data = SlotTokens(cache_config.block_size, cache_config.sliding_window)
        self.seqs: list[Sequence] = []  # every sequence ever created, children included
        self.known: set[int] = set()
        self.groups: list[BeamGroup] = []
        self.aborted: set[str] = set()  # request ids
        self.steps = 0

    def _track(self, seqs) -> None:
        for seq in seqs:
            if id(seq) not in self.known:
                self.known.add(id(seq))
                self.seqs.append(seq)

    @rule(
        prefix=st.sampled_from(PREFIXES),
        suffix=st.lists(st.integers(3, 9), max_size=30),
        max_tokens=st.integers(1, 12),
        n=st.integers(1, 3),
        ignore_eos=st.booleans(),
        salt=st.sampled_from([None, None, "s"]),
    )
    def add(self, prefix, suffix, max_tokens, n, ignore_eos, salt):
        params = SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=ignore_eos, cache_salt=salt)
        seq = Sequence(prefix + suffix, params, eos_token_id=EOS)
        self.sched.add(seq)
        self._track([seq])
        if seq.is_finished:
            assert seq.error and not seq.block_table

    @rule(
        prefix=st.sampled_from(PREFIXES),
        suffix=st.lists(st.integers(3, 9), max_size=30),
        width=st.integers(1, 3),
        max_tokens=st.integers(1, 10),
        length_penalty=st.sampled_from([0.0, 1.0, 2.0]),
        early_stopping=st.sampled_from([True, False, "never"]),
        ignore_eos=st.booleans(),
        stop=st.sampled_from([(), (5,)]),
    )
    def add_beam(
        self, prefix, suffix, width, max_tokens, length_penalty, early_stopping, ignore_eos, stop
    ):
        params = BeamSearchParams(
            beam_width=width,
            max_tokens=max_tokens,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
            ignore_eos=ignore_eos,
            stop_token_ids=stop,
        )
        seq = Sequence(prefix + suffix, params.sampling_params(), eos_token_id=EOS)
        group = BeamGroup(params, seq, [EOS])
        self.sched.add(seq)
        self._track([seq])
        self.groups.append(group)
        if seq.is_finished:
            assert seq.error and not seq.block_table

    @rule(data=st.data())
    def step(self, data):
        out = self.sched.schedule()
        assert out.total_num_scheduled_tokens <= self.sched.config.max_num_batched_tokens
        assert all(n >= 1 for n in out.num_new_tokens)
        assert len(set(map(id, out.seqs))) == len(out.seqs)
        sampled, logprobs = [], []
        for seq, n in zip(out.seqs, out.num_new_tokens, strict=True):
            assert len(seq.block_table) * self.sched.kv.block_size >= seq.num_computed_tokens + n
            if seq.num_computed_tokens + n < seq.num_tokens:
                sampled.append([])
                logprobs.append([])
            elif seq.beam is not None:
                tokens, lps = candidates(seq, data)
                sampled.append(tokens)
                logprobs.append(lps)
            else:
                k = seq.num_samples_to_draw
                sampled.append(data.draw(st.lists(st.integers(2, 9), min_size=k, max_size=k)))
                logprobs.append([])
        self.check_transfers(out)
        self.kv_data.run(out)
        finished = self.sched.update(out, sampled, logprobs)
        self._track([*self.sched.running, *self.sched.waiting, *finished])
        for seq in finished:
            assert seq.is_finished and not seq.block_table and not self.sched.kv.host_table(seq)
        if not out.seqs and not finished:  # `LLM.step` would raise: no progress
            assert not self.sched.has_unfinished(), "a step ran nothing and finished nothing"
        self.steps += 1

    def check_transfers(self, out) -> None:
        """A step's swaps: only where the mode and the host pool allow them, never a swap-out
        and a swap-in in the same step, no block written twice, swapped-out units off the
        device (their host tables are blocks just written) and swapped-in ones running."""
        kv = self.sched.kv
        assert not (out.swap_out and out.swap_in)
        if out.swap_out:
            assert kv.host is not None and self.sched.config.preemption_mode != "recompute"
            if self.sched.config.preemption_mode == "auto":
                assert self.sched.costs is not NEVER_SWAP
        if self.sched.config.preemption_mode == "auto" and self.sched.costs is PAST_5_TOKENS:
            computed: dict[str, int] = {}  # (n > 1 siblings are separate units: summed here)
            for seq in out.preempted:
                if seq.status == SequenceStatus.SWAPPED:
                    rid = seq.request_id
                    computed[rid] = computed.get(rid, 0) + seq.num_computed_tokens
            assert all(n > 5 for n in computed.values()), computed
        for ops in (out.swap_out, out.swap_in):  # (a device block two victims held goes twice)
            assert len({dst for _, dst in ops}) == len(ops), "two copies into one block"
        moved_out = {h for _, h in out.swap_out}
        for seq in out.preempted:
            if seq.status == SequenceStatus.SWAPPED:
                assert not seq.block_table and set(kv.host_table(seq)) <= moved_out, seq
        for seq in out.seqs:
            assert seq.status == SequenceStatus.RUNNING and not kv.host_table(seq), seq

    @rule(mode=st.sampled_from(PREEMPTION_MODES))
    def switch_mode(self, mode):
        """A later preemption goes by another mode; units already on the host stay there."""
        self.sched.config = dataclasses.replace(self.sched.config, preemption_mode=mode)

    @precondition(lambda self: self.sched.has_unfinished())
    @rule(data=st.data())
    def abort(self, data):
        live = self.sched.unfinished()  # running, swapped out and waiting
        seq = data.draw(st.sampled_from(live))
        # A beam group is cancelled whole (as LLM.abort_all does): every beam, or its leader.
        unit = [s for s in live if s.request_id == seq.request_id] if seq.beam else [seq]
        if seq.beam:
            self.aborted.add(seq.request_id)
        self.sched.finish(unit, SequenceStatus.FINISHED_ABORTED)
        assert all(not s.block_table and not self.sched.kv.host_table(s) for s in unit)

    @invariant()
    def invariants_hold(self):
        if not hasattr(self, "sched"):
            return
        sched = self.sched
        # free + used == total, device and host ref_cnt == holders, table sizes on both sides
        sched.check_invariants()
        swapped = {id(s) for unit in sched.swapped for s in unit}
        live = {id(s) for s in sched.running} | {id(s) for s in sched.waiting} | swapped
        assert len(live) == len(sched.running) + len(sched.waiting) + sched.num_swapped
        assert all(sched.swapped), "an empty unit is left swapped out"
        host = sched.kv.host
        if host is None:
            assert not swapped and sched.stats.num_swap_outs == 0
        else:
            used = {h for unit in sched.swapped for s in unit for h in sched.kv.host_table(s)}
            assert host.num_used_blocks == len(used)
        for seq in self.seqs:
            on_host = sched.kv.host_table(seq)
            assert not (seq.block_table and on_host), f"{seq} holds blocks on both sides"
            if id(seq) in swapped:
                assert seq.status == SequenceStatus.SWAPPED and not seq.block_table, seq
            elif on_host:
                raise AssertionError(f"{seq} holds host blocks but is not swapped out")
            if id(seq) in live:
                assert not seq.is_finished
            elif parked(seq):  # a beam of a preempted group, waiting for its leader
                assert seq.status == SequenceStatus.PREEMPTED and not seq.block_table, seq
            else:
                assert seq.is_finished and not seq.block_table, seq
                assert seq.num_output_tokens <= seq.sampling_params.max_tokens
        for group in self.groups:
            self.check_group(group, live)

    def check_group(self, group: BeamGroup, live: set[int]) -> None:
        """A group's live beams are at most its width; a group that ended holds no sequence in
        the scheduler and returns 1 to `width` hypotheses, best first, each within max_tokens
        and ending with a stop token exactly when its finish reason is "stop"."""
        params = group.params
        mine = [s for s in self.seqs if s.beam is group and id(s) in live]
        assert len(group.beams) <= group.width
        if group.request_id in self.aborted:
            assert not mine
            return
        if not group.done:
            return
        assert not mine, mine
        assert 1 <= len(group.finished) <= group.width
        scores = [h.score for h in group.finished]
        assert scores == sorted(scores, reverse=True)
        for h in group.finished:
            assert 1 <= len(h.token_ids) <= params.max_tokens
            stopped = h.token_ids[-1] in group.stop_ids and h.stop_reason != "kv_cache_full"
            assert h.finish_reason == ("stop" if stopped else "length"), h

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        sched = self.sched
        for _ in range(5_000):
            if not sched.has_unfinished():
                break
            out = sched.schedule()
            self.check_transfers(out)
            self.kv_data.run(out)
            sampled, logprobs = [], []
            for s, n in zip(out.seqs, out.num_new_tokens, strict=True):
                tokens, lps = [], []
                if s.num_computed_tokens + n == s.num_tokens:
                    tokens, lps = candidates(s) if s.beam else ([5] * s.num_samples_to_draw, [])
                sampled.append(tokens)
                logprobs.append(lps)
            sched.update(out, sampled, logprobs)
        assert not sched.has_unfinished(), "a sequence never finished"
        assert sched.kv.num_free_blocks == sched.kv.num_blocks, "blocks leaked"
        sched.kv.pool.check_integrity()
        if sched.kv.host is not None:
            assert sched.kv.host.num_used_blocks == 0, "host blocks leaked"
            sched.kv.host.check_integrity([])


class SwapMachine(SchedulerMachine):
    """The same rules on pools small enough that most runs preempt, by swap or by `auto`, with
    host pools from one block (most swaps fall back) to plenty, and runs of steps in a row so
    that swapped-out units come back, or are aborted while out."""

    @initialize(
        block_size=st.sampled_from([2, 4]),
        num_blocks=st.integers(5, 12),
        budget=st.integers(4, 40),
        max_seqs=st.integers(2, 6),
        max_model_len=st.integers(16, 64),
        caching=st.booleans(),
        mode=st.sampled_from(["swap", "swap", "auto"]),
        host_blocks=st.sampled_from([1, 3, 8, 64]),
        costs=st.sampled_from(COSTS),
        window=st.sampled_from(WINDOWS),
    )
    def setup(
        self,
        block_size,
        num_blocks,
        budget,
        max_seqs,
        max_model_len,
        caching,
        mode,
        host_blocks,
        costs,
        window,
    ):
        self.build(
            SchedulerConfig(budget, max_seqs, max_model_len, debug=True, preemption_mode=mode),
            CacheConfig(
                block_size, num_blocks, caching, num_host_blocks=host_blocks, sliding_window=window
            ),
            costs,
        )

    @rule(
        prefix=st.sampled_from(PREFIXES),
        suffix=st.lists(st.integers(3, 9), min_size=1, max_size=8),
        max_tokens=st.integers(4, 16),
        n=st.integers(1, 3),
        ignore_eos=st.booleans(),
        salt=st.sampled_from([None, None, "s"]),
    )
    def add(self, prefix, suffix, max_tokens, n, ignore_eos, salt):
        """Short prompts that fit the small pools, asking for more tokens than they fit."""
        super().add(prefix, suffix, max_tokens, n, ignore_eos, salt)

    @rule(
        prefix=st.sampled_from(PREFIXES),
        suffix=st.lists(st.integers(3, 9), min_size=1, max_size=8),
        width=st.integers(1, 3),
        max_tokens=st.integers(4, 10),
        length_penalty=st.sampled_from([0.0, 1.0]),
        early_stopping=st.sampled_from([True, "never"]),
        ignore_eos=st.booleans(),
        stop=st.sampled_from([(), (5,)]),
    )
    def add_beam(
        self, prefix, suffix, width, max_tokens, length_penalty, early_stopping, ignore_eos, stop
    ):
        """Short prompts here too."""
        super().add_beam(
            prefix, suffix, width, max_tokens, length_penalty, early_stopping, ignore_eos, stop
        )

    @rule(data=st.data(), k=st.integers(2, 10))
    def steps(self, data, k):
        """Several steps in a row, the invariants checked after each."""
        for _ in range(k):
            self.step(data)
            self.invariants_hold()


MACHINE_SETTINGS = settings(
    max_examples=400,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = MACHINE_SETTINGS
TestSwapMachine = SwapMachine.TestCase
TestSwapMachine.settings = settings(MACHINE_SETTINGS, max_examples=200)

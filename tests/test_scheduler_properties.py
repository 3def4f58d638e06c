"""Property-based test: random interleavings of add / step / abort keep the invariants of
docs/design.md, with sampled requests and beam-search groups (their candidates drawn at random)
side by side."""

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedctl.engine import BeamSearchParams, SamplingParams, Sequence, SequenceStatus
from pagedctl.engine.beam_search import BeamGroup
from tests.sched_utils import EOS, make_scheduler

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


def parked(seq: Sequence) -> bool:
    """A beam out of the scheduler while its preempted group's leader computes their shared
    prefix again (`BeamGroup.preempt`): it holds no block and comes back by `unfold`."""
    group = seq.beam
    return group is not None and group.leader is not None and any(b.seq is seq for b in group.beams)


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        block_size=st.sampled_from([1, 2, 4, 8]),
        num_blocks=st.integers(1, 24),
        budget=st.integers(1, 40),
        max_seqs=st.integers(1, 6),
        max_model_len=st.integers(4, 64),
        caching=st.booleans(),
    )
    def setup(self, block_size, num_blocks, budget, max_seqs, max_model_len, caching):
        self.sched = make_scheduler(
            num_blocks=num_blocks,
            block_size=block_size,
            max_num_batched_tokens=budget,
            max_num_seqs=max_seqs,
            max_model_len=max_model_len,
            enable_prefix_caching=caching,
        )
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
            assert len(seq.block_table) * self.sched.block_size >= seq.num_computed_tokens + n
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
        finished = self.sched.update(out, sampled, logprobs)
        self._track([*self.sched.running, *self.sched.waiting, *finished])
        for seq in finished:
            assert seq.is_finished and not seq.block_table
        self.steps += 1

    @precondition(lambda self: self.sched.running or self.sched.waiting)
    @rule(data=st.data())
    def abort(self, data):
        live = list(self.sched.running) + list(self.sched.waiting)
        seq = data.draw(st.sampled_from(live))
        # A beam group is cancelled whole (as LLM.abort_all does): every beam, or its leader.
        unit = [s for s in live if s.request_id == seq.request_id] if seq.beam else [seq]
        if seq.beam:
            self.aborted.add(seq.request_id)
        self.sched.finish(unit, SequenceStatus.FINISHED_ABORTED)
        assert all(not s.block_table for s in unit)

    @invariant()
    def invariants_hold(self):
        if not hasattr(self, "sched"):
            return
        self.sched.check_invariants()  # free + used == total, ref_cnt == holders, table sizes
        live = {id(s) for s in self.sched.running} | {id(s) for s in self.sched.waiting}
        assert len(live) == len(self.sched.running) + len(self.sched.waiting)
        for seq in self.seqs:
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


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(
    max_examples=400,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

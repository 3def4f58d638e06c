"""Property-based test: random interleavings of add / step / abort keep the invariants of
docs/design.md."""

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedctl.engine import SamplingParams, Sequence, SequenceStatus
from tests.sched_utils import EOS, make_scheduler

PREFIXES = [[], [11, 12, 13, 14, 15, 16, 17, 18], [11, 12, 13, 14, 30, 31]]


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
        self.steps = 0

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
        self.seqs.append(seq)
        if seq.is_finished:
            assert seq.error and not seq.block_table

    @rule(data=st.data())
    def step(self, data):
        out = self.sched.schedule()
        assert out.total_num_scheduled_tokens <= self.sched.config.max_num_batched_tokens
        assert all(n >= 1 for n in out.num_new_tokens)
        assert len(set(map(id, out.seqs))) == len(out.seqs)
        sampled = []
        for seq, n in zip(out.seqs, out.num_new_tokens, strict=True):
            assert len(seq.block_table) * self.sched.block_size >= seq.num_computed_tokens + n
            if seq.num_computed_tokens + n < seq.num_tokens:
                sampled.append([])
            else:
                k = seq.num_samples_to_draw
                sampled.append(data.draw(st.lists(st.integers(2, 9), min_size=k, max_size=k)))
        before = {id(s) for s in self.sched.running}
        finished = self.sched.update(out, sampled)
        self.seqs.extend(s for s in self.sched.running if id(s) not in before)
        self.seqs.extend(s for s in finished if s.parent_seq_id is not None and s not in self.seqs)
        for seq in finished:
            assert seq.is_finished and not seq.block_table
        self.steps += 1

    @precondition(lambda self: self.sched.running or self.sched.waiting)
    @rule(data=st.data())
    def abort(self, data):
        live = list(self.sched.running) + list(self.sched.waiting)
        seq = data.draw(st.sampled_from(live))
        self.sched.finish([seq], SequenceStatus.FINISHED_ABORTED)
        assert not seq.block_table

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
            else:
                assert seq.is_finished and not seq.block_table, seq
                assert seq.num_output_tokens <= seq.sampling_params.max_tokens

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        sched = self.sched
        for _ in range(5_000):
            if not sched.has_unfinished():
                break
            out = sched.schedule()
            sched.update(
                out,
                [
                    [5] * s.num_samples_to_draw if s.num_computed_tokens + n == s.num_tokens else []
                    for s, n in zip(out.seqs, out.num_new_tokens, strict=True)
                ],
            )
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

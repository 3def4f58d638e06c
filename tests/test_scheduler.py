"""Scheduler: budget and chunking, prefix hits, preemption and resume, refusal, stops, forks."""

from pagedctl.engine import SequenceStatus
from tests.sched_utils import EOS, make_scheduler, make_seq, run_to_completion, step


def scheduled(out) -> dict[str, int]:
    return {s.request_id: n for s, n in zip(out.seqs, out.num_new_tokens, strict=True)}


def test_token_budget_chunks_prefill_and_mixes_decode():
    sched = make_scheduler(max_num_batched_tokens=8)
    a = make_seq(list(range(10)), request_id="a")
    b = make_seq(list(range(50, 60)), request_id="b")
    sched.add(a)
    sched.add(b)
    out, _ = step(sched)
    assert scheduled(out) == {"a": 8}  # a chunk; b waits for budget
    assert a.num_computed_tokens == 8 and a.num_output_tokens == 0 and a.block_table == [0, 1]
    out, _ = step(sched)
    assert scheduled(out) == {"a": 2, "b": 6}  # a finishes its prompt and samples; b starts
    assert a.num_output_tokens == 1 and b.num_output_tokens == 0
    out, _ = step(sched)
    assert scheduled(out) == {"a": 1, "b": 4}  # a decodes, b finishes its prompt
    assert out.total_num_scheduled_tokens == 5
    assert sched.stats.num_prefill_tokens == 20 and sched.stats.num_decode_tokens == 1


def test_prefix_hit_is_not_charged_to_the_budget():
    sched = make_scheduler(max_num_batched_tokens=16)
    a = make_seq(list(range(12)), max_tokens=1, request_id="a")
    sched.add(a)
    _, finished = step(sched)
    assert finished == [a] and a.block_table == []  # finished sequences hold no blocks
    sched.stats.num_prefill_tokens = 0
    b = make_seq([*range(12), 90, 91], request_id="b")
    sched.add(b)
    out, _ = step(sched)
    assert scheduled(out) == {"b": 2}
    assert b.num_cached_tokens == 12 and b.block_table[:3] == [0, 1, 2]
    assert sched.kv.stats.hit_tokens == 12 and sched.kv.stats.queried_tokens == 12 + 14


def test_preemption_evicts_newest_and_resumes_after_recompute():
    sched = make_scheduler(num_blocks=6, max_num_seqs=2)
    a = make_seq(list(range(7)), max_tokens=10, request_id="a")
    b = make_seq(list(range(50, 57)), max_tokens=10, request_id="b")
    c = make_seq(list(range(80, 84)), max_tokens=2, request_id="c")
    for seq in (a, b, c):
        sched.add(seq)
    out, _ = step(sched)
    assert scheduled(out) == {"a": 7, "b": 7}  # c waits: max_num_seqs
    for _ in range(5):
        out, _ = step(sched)
        assert scheduled(out) == {"a": 1, "b": 1}
    assert a.num_computed_tokens == b.num_computed_tokens == 12
    assert sched.kv.num_free_blocks == 0
    # a needs a 4th block; b, the most recently admitted, is preempted; c is not admitted.
    out, _ = step(sched)
    assert scheduled(out) == {"a": 1} and out.preempted == [b]
    assert b.status == SequenceStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.block_table == [] and b.num_preemptions == 1
    assert list(sched.waiting) == [b, c]
    # b's first two blocks are still cached, but the pool cannot hold all of b: it waits, and so
    # does c behind it (strict FCFS).
    while not a.is_finished:
        out, _ = step(sched)
        assert scheduled(out) == {"a": 1}
    assert a.num_output_tokens == 10
    out, _ = step(sched)
    assert scheduled(out) == {"b": 5, "c": 4}
    assert b.num_cached_tokens == 8
    assert b.num_recomputed_tokens == 4  # positions 8..11 had KV before the preemption
    assert sched.stats.num_preemptions == 1 and sched.stats.num_recomputed_tokens == 4
    run_to_completion(sched)
    assert b.num_output_tokens == 10 and c.num_output_tokens == 2


def test_resumed_sequence_waits_until_its_whole_prefill_fits():
    sched = make_scheduler(
        num_blocks=8, max_num_batched_tokens=8, max_num_seqs=2, enable_prefix_caching=False
    )
    a = make_seq(list(range(12)), max_tokens=8, request_id="a")
    b = make_seq(list(range(50, 62)), max_tokens=8, request_id="b")
    sched.add(a)
    sched.add(b)
    while not step(sched)[0].preempted:
        pass
    assert b.status == SequenceStatus.PREEMPTED and a.num_computed_tokens == 17
    free_blocks = sched.kv.num_free_blocks
    remaining = b.num_tokens  # nothing cached: all of b is recomputed
    assert remaining == 15 and free_blocks == 3
    # A 7-token chunk (2 blocks) would fit, but all 15 tokens (4 blocks) would not: b waits.
    out, _ = step(sched)
    assert scheduled(out) == {"a": 1}
    while not a.is_finished:
        assert "b" not in scheduled(step(sched)[0])
    out, _ = step(sched)
    assert scheduled(out) == {"b": 8}
    run_to_completion(sched)
    assert b.num_output_tokens == 8 and b.num_recomputed_tokens == 14


def test_impossible_requests_are_refused_with_a_reason():
    sched = make_scheduler(num_blocks=4, max_model_len=12)
    too_big = make_seq(16)
    sched.add(too_big)
    assert too_big.status == SequenceStatus.FINISHED_ERROR
    assert too_big.finish_reason == "error"
    assert "max_model_len=12" in too_big.error

    sched = make_scheduler(num_blocks=4)
    too_big = make_seq(16)
    sched.add(too_big)
    assert too_big.error == (
        "prompt of 16 tokens plus one generated token needs 5 KV blocks; "
        "the whole pool has 4 (16 tokens)"
    )
    empty = make_seq([])
    sched.add(empty)
    assert empty.status == SequenceStatus.FINISHED_ERROR and "empty prompt" in empty.error
    fits = make_seq(15, max_tokens=1)
    sched.add(fits)
    assert not sched.waiting or sched.waiting[0] is fits
    run_to_completion(sched)
    assert fits.status == SequenceStatus.FINISHED_LENGTH
    assert sched.stats.num_refused == 2


def test_sequence_outgrowing_the_pool_is_stopped_not_retried():
    sched = make_scheduler(num_blocks=4)
    a = make_seq(10, max_tokens=100)
    sched.add(a)
    run_to_completion(sched, max_steps=50)
    assert a.status == SequenceStatus.FINISHED_LENGTH and a.stop_reason == "kv_cache_full"
    assert a.num_tokens == 17 and a.block_table == []
    assert sched.kv.num_free_blocks == 4


def test_stop_conditions():
    sched = make_scheduler(max_model_len=20)
    eos = make_seq(4, ignore_eos=False, request_id="eos")
    ignored = make_seq(5, max_tokens=3, request_id="ignored")
    stop_id = make_seq(6, stop_token_ids=[EOS], request_id="stop_id")
    long = make_seq(18, max_tokens=50, request_id="long")
    for seq in (eos, ignored, stop_id, long):
        sched.add(seq)
    _, finished = step(sched, token=EOS)
    assert {s.request_id for s in finished} == {"eos", "stop_id"}
    assert eos.finish_reason == "stop" and eos.stop_reason == EOS
    assert stop_id.finish_reason == "stop"
    run_to_completion(sched)
    assert ignored.finish_reason == "length" and ignored.output_token_ids == [EOS, 7, 7]
    assert long.finish_reason == "length" and long.stop_reason == "max_model_len"
    assert long.num_tokens == 20


def test_parallel_samples_fork_after_the_prompt_and_copy_on_write():
    sched = make_scheduler()
    parent = make_seq(6, n=3, max_tokens=3, request_id="r")
    sched.add(parent)
    out, _ = step(sched)
    assert scheduled(out) == {"r": 6}
    children = sched.running[1:]
    assert [s.output_token_ids for s in sched.running] == [[7], [8], [9]]
    assert [s.sample_index for s in sched.running] == [0, 1, 2]
    assert all(c.block_table == [0, 1] and c.parent_seq_id == parent.seq_id for c in children)
    assert [sched.kv.pool.blocks[i].ref_cnt for i in (0, 1)] == [3, 3]
    out, _ = step(sched)
    # Two of the three writers into the shared partial block copy it; the last one keeps it.
    assert out.copies == [(1, 2), (1, 3)]
    assert [s.block_table for s in sched.running] == [[0, 2], [0, 3], [0, 1]]
    assert [sched.kv.pool.blocks[i].ref_cnt for i in (0, 1, 2, 3)] == [3, 1, 1, 1]
    run_to_completion(sched)
    assert all(s.num_output_tokens == 3 for s in [parent, *children])
    assert sched.kv.num_free_blocks == 16


def test_max_num_seqs_limits_admission():
    sched = make_scheduler(max_num_seqs=2)
    seqs = [make_seq(list(range(i * 10, i * 10 + 3)), max_tokens=2) for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    out, _ = step(sched)
    assert out.seqs == seqs[:2]
    out, _ = step(sched)
    assert out.seqs == seqs[:2]  # both finish in this step
    out, _ = step(sched)
    assert out.seqs == seqs[2:]


def test_finish_from_outside_frees_blocks_and_skips_results():
    sched = make_scheduler()
    a, b = make_seq(5, max_tokens=10), make_seq(list(range(40, 45)), max_tokens=10)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    sched.finish([a], SequenceStatus.FINISHED_ABORTED)  # cancelled while the step runs
    assert a.block_table == [] and sched.running == [b]
    finished = sched.update(out, [[7], [7]])
    assert finished == [] and a.num_output_tokens == 0 and b.num_output_tokens == 1
    assert a.finish_reason == "abort"


def test_waste_counters():
    sched = make_scheduler(block_size=4)
    a = make_seq(5, max_tokens=2)
    sched.add(a)
    step(sched)  # 5 tokens computed in 2 blocks: 3 empty slots
    assert sched.stats.waste_slot_steps == 3 and sched.stats.peak_waste_slots == 3
    _, finished = step(sched)  # 6 computed: 2 empty slots, then it finishes
    assert finished == [a] and a.tail_waste == 2
    assert sched.stats.num_steps == 2

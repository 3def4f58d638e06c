"""Beam groups inside the engine: every scheduling mode gives the same hypotheses, a group is one
unit for the pool and for failures, and its memory figures are the pool's own."""

import pytest

from pagedctl.engine import BeamSearchParams, SamplingParams
from pagedctl.engine.llm import LLM
from tests.tiny_models import save_tiny_model

BEAM = BeamSearchParams(beam_width=4, max_tokens=10, ignore_eos=True)
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
PROMPTS = [
    [5, 17, 99, 3, 42, 8, 1, 200, 31] * 3,
    [7, 7, 7, 100, 2],
    [5, 17, 99, 3, 42, 8, 1, 200, 31] * 3 + [9],
    [11, 12, 13],
]
PARAMS = [BEAM, BEAM, BeamSearchParams(beam_width=2, max_tokens=6, length_penalty=0.0), GREEDY]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2-beams")
    save_tiny_model("qwen2", path)
    return path


def make_llm(folder, **settings):
    return LLM(str(folder), device="cpu", dtype="float32", debug=True, **settings)


def hypotheses(outs):
    return [[(c.token_ids, round(c.cumulative_logprob or 0.0, 4)) for c in o.outputs] for o in outs]


def assert_pool_empty(llm):
    kv = llm.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks
    assert not llm.scheduler.has_unfinished() and len(llm.tracker) == 0


@pytest.fixture(scope="module")
def plain(folder):
    llm = make_llm(folder, enable_prefix_caching=False)
    outs = llm.generate(PROMPTS, PARAMS)
    assert all(o.ok for o in outs)
    assert [len(o.outputs) for o in outs] == [4, 4, 2, 1]
    return hypotheses(outs)


@pytest.mark.parametrize(
    "settings",
    [
        {"cuda_graphs": "emulate"},  # graph replays for the forward, candidates outside
        {"cuda_graphs": "emulate", "num_scheduler_steps": 4},  # beams fall back to one step
        {"enable_prefix_caching": True, "block_size": 4, "max_num_batched_tokens": 8},
        {"num_gpu_blocks_override": 22, "block_size": 4},  # groups preempted and resumed
        {"max_num_seqs": 5},  # a group of 4 and one more sequence at most
    ],
    ids=["graphs", "multi-step", "chunked+prefix-cache", "preemption", "max-num-seqs"],
)
def test_every_scheduling_mode_gives_the_same_hypotheses(folder, plain, settings):
    llm = make_llm(folder, **settings)
    outs = llm.generate(PROMPTS, PARAMS)
    assert hypotheses(outs) == plain
    if not llm.config.enable_prefix_caching:
        assert_pool_empty(llm)
    if "num_gpu_blocks_override" in settings:
        assert llm.stats["scheduler"]["num_preemptions"] > 0
        assert sum(o.metrics.num_preemptions for o in outs) > 0
    if settings.get("enable_prefix_caching"):
        assert llm.stats["prefix_cache"]["hit_tokens"] > 0  # the third prompt reuses the first's


def test_group_peak_is_the_pools_peak(folder):
    """Alone in the pool (no prefix cache), a group's peak_blocks is the pool's own peak, and
    its unshared figure is the sum of its beams' tables: sharing is counted, not estimated."""
    for width in (2, 4):
        llm = make_llm(folder, enable_prefix_caching=False, block_size=4)
        (out,) = llm.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=width, max_tokens=12))
        m = out.metrics
        assert m.peak_blocks == llm.scheduler.kv.stats.peak_used_blocks
        assert m.peak_blocks < m.peak_blocks_unshared
        assert m.num_cow_copies > 0 and m.num_shared_blocks > 0
        longest = len(PROMPTS[0]) + max(len(c.token_ids) for c in out.outputs)
        assert m.peak_blocks_unshared <= width * -(-longest // 4)
        stats = llm.stats["beam_search"]
        assert stats["num_groups"] == 1 and stats["peak_blocks"] == m.peak_blocks
        assert_pool_empty(llm)


def test_a_failing_beam_fails_its_request_alone(folder, plain):
    """A real exception in the forward pass, at a position only the first beam request's
    beams reach: that request ends with internal_error, the others are untouched."""
    llm = make_llm(folder, enable_prefix_caching=False)
    real = llm.model.forward
    deep = len(PROMPTS[0]) + 5

    def forward(input_ids, positions, *args, **kwargs):
        if bool((positions == deep).any()):
            raise IndexError("poisoned batch")
        return real(input_ids, positions, *args, **kwargs)

    llm.model.forward = forward
    outs = llm.generate(PROMPTS, PARAMS)
    assert outs[0].error_code == "internal_error" and outs[0].outputs == []
    assert "IndexError: poisoned batch" in outs[0].error
    assert outs[2].error_code == "internal_error"  # the third prompt is as long
    assert hypotheses([outs[1], outs[3]]) == [plain[1], plain[3]]
    assert_pool_empty(llm)


def test_a_group_that_cannot_fit_the_pool_ends_with_what_it_has(folder):
    """A pool that holds the prompt but not four beams growing: the group ends without a hang,
    its live beams returned as "length" hypotheses (stop reason kv_cache_full)."""
    llm = make_llm(folder, enable_prefix_caching=False, block_size=4, num_gpu_blocks_override=9)
    (out,) = llm.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=4, max_tokens=40))
    assert out.ok and len(out.outputs) == 4
    assert {c.stop_reason for c in out.outputs} == {"kv_cache_full"}
    assert all(c.finish_reason == "length" for c in out.outputs)
    assert_pool_empty(llm)


def test_abort_mid_search_frees_every_block(folder):
    llm = make_llm(folder, enable_prefix_caching=False, block_size=4)
    for i, (prompt, params) in enumerate(zip(PROMPTS, PARAMS, strict=True)):
        llm.tracker.add(i, prompt, params, llm.scheduler)
    for _ in range(4):
        assert not llm.step()  # in the middle of every search
    assert len(llm.scheduler.running) > len(PROMPTS)  # the groups have forked
    assert llm.abort_all() == len(PROMPTS)
    assert_pool_empty(llm)


def test_refusals_and_bad_params(folder):
    llm = make_llm(folder, max_num_batched_tokens=4, max_num_seqs=8)
    (out,) = llm.beam_search([PROMPTS[1]], BeamSearchParams(beam_width=8, max_tokens=4))
    assert out.error_code == "beam_width_too_large" and "max_num_batched_tokens=4" in out.error
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0)
    with pytest.raises(ValueError, match="early_stopping"):
        BeamSearchParams(beam_width=2, early_stopping="sometimes")
    with pytest.raises(TypeError, match="length_penalty"):
        BeamSearchParams(beam_width=2, length_penalty=float("nan"))
    with pytest.raises(TypeError, match="beam_search takes"):
        llm.beam_search([PROMPTS[1]], [GREEDY])

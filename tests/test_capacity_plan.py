"""`pagedctl capacity` sections 1-3: vLLM's T4 figures from their inputs, lengths, waste."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pagedctl.capacity import plan
from pagedctl.capacity.card import CardError, resolve_card, scheduler_budget
from pagedctl.capacity.lengths import (
    Lengths,
    LengthsError,
    from_distribution,
    parse_distribution,
)
from pagedctl.capacity.model import resolve_footprint
from pagedctl.engine.core.units import parse_bytes

T4_DIST = "lognormal:mean=260,median=180"


def t4_inputs(**kw) -> plan.PlanInputs:
    base = dict(
        footprint=resolve_footprint("qwen2.5-0.5b-instruct"),
        dtype="float16",
        dtype_bytes=2,
        card=resolve_card("14.6GiB", None),
        gpu_mems=(0.85, 0.70, 0.95),
        block_sizes=(16, 32, 64),
        max_len=2048,
        non_kv_bytes=parse_bytes("2.02GB"),
    )
    return plan.PlanInputs(**{**base, **kw})


def sections(inputs: plan.PlanInputs):
    mem = plan.memory(inputs)
    pools = plan.pools(inputs, mem)
    pool = plan.primary(inputs, pools)
    caps = {r["seq_len"]: r for r in plan.capacity_rows(inputs, pool, mem)}
    return mem, pools, pool, caps


def test_the_t4_pool_from_its_rounded_inputs() -> None:
    _, pools, pool, caps = sections(t4_inputs())
    # by hand: floor(0.85 x 14.6 x 2^30) - 2.02e9 = 11,305,136,035 B; / (16 x 12,288 B) = 57,500
    assert pool.budget_bytes == math.floor(0.85 * 14.6 * 2**30) - 2_020_000_000
    assert pool.num_blocks == 57_500
    assert pool.tokens == 920_000
    vllm = {"tokens": 929_024, 2048: 453, 512: 1814, 256: 3629, 128: 7258}
    assert abs(pool.tokens / vllm["tokens"] - 1) < 0.02
    for n in (2048, 512, 256, 128):
        assert abs(caps[n]["paged"] / vllm[n] - 1) < 0.02, n
    for g, vllm_tokens in ((0.70, 738_992), (0.95, 1_057_104)):
        assert abs(pools[(g, 16)].tokens / vllm_tokens - 1) < 0.02
    assert caps[2048]["contiguous_same_budget"] == 11_305_136_035 // (2048 * 12288) == 449


def test_the_t4_block_count_gives_vllms_counts_exactly() -> None:
    _, pools, pool, caps = sections(t4_inputs(num_blocks=58064))
    assert pool.tokens == 929_024
    assert [caps[n]["paged"] for n in (2048, 512, 256, 128)] == [453, 1814, 3629, 7258]
    assert caps[256]["contiguous_same_budget"] == 453
    assert round(caps[256]["ratio_same_budget"], 1) == 8.0
    assert round(caps[256]["ratio_whole_card"], 1) == 6.3  # against the 573 vLLM measured on the T4
    assert pools[(None, 64)].tokens == 929_024  # other block sizes keep the pool's bytes
    assert plan.vllm_line(pool, 2048) == (
        "GPU KV cache size: 929,024 tokens, Maximum concurrency for 2,048 tokens per request: "
        "453.62x"
    )


def test_whole_card_reservations_and_the_estimated_non_kv() -> None:
    inputs = t4_inputs(non_kv_bytes=None, card=resolve_card(None, "t4"))
    mem, _, _, caps = sections(inputs)
    assert mem.weights_bytes == 494_032_768 * 2
    assert (mem.batched_tokens, mem.logit_rows) == scheduler_budget(inputs.card.total_bytes)
    # the engine's step graphs keep a pool as large as the profiled peak (its default on CUDA)
    assert mem.graph_reserve_bytes == mem.activation_peak_bytes > 0
    assert mem.non_kv_bytes == mem.weights_bytes + 2 * mem.activation_peak_bytes
    card = inputs.card.total_bytes - mem.weights_bytes - 256 * 2**20
    assert caps[128]["contiguous_whole_card"] == card // (2048 * 12288)


def test_without_cuda_graphs_the_estimate_reserves_no_graph_pool() -> None:
    card = resolve_card(None, "t4")
    with_graphs = plan.memory(t4_inputs(non_kv_bytes=None, card=card))
    eager = plan.memory(t4_inputs(non_kv_bytes=None, card=card, cuda_graphs=False))
    assert eager.graph_reserve_bytes == 0
    assert eager.non_kv_bytes == with_graphs.non_kv_bytes - with_graphs.activation_peak_bytes
    # a given figure is taken as it is, graphs or not
    given = plan.memory(t4_inputs(card=card))
    assert given.given and given.graph_reserve_bytes == 0


def test_t4_block_waste_within_a_third_of_a_point() -> None:
    inputs = t4_inputs(num_blocks=58064)
    _, pools, _, _ = sections(inputs)
    rows = plan.block_rows(inputs, from_distribution(T4_DIST, 2048), pools)
    shares = [r["waste_share"] for r in rows]
    for ours, vllm in zip(shares, (0.028, 0.056, 0.108), strict=True):
        assert abs(ours - vllm) <= 0.003
    for r, vllm in zip(rows, (3470, 3370, 3190), strict=True):
        assert abs(r["sequences_held"] / vllm - 1) < 0.02


def test_block_waste_by_hand() -> None:
    lengths = Lengths("test", 64, prompt=np.array([1, 16, 17, 40]), output=np.array([0, 0, 0, 0]))
    inputs = t4_inputs(num_blocks=100, block_sizes=(16,), max_len=64)
    _, pools, _, _ = sections(inputs)
    (row,) = plan.block_rows(inputs, lengths, pools)
    # held: 16, 16, 32, 48 -> mean 28; lengths mean 18.5; waste 15, 0, 15, 8
    assert row["mean_held_tokens"] == pytest.approx(28.0)
    assert row["waste_tokens"] == pytest.approx(9.5)
    assert row["waste_share"] == pytest.approx(9.5 / 28)
    assert row["sequences_held"] == int(100 // (28 / 16))


def test_distributions() -> None:
    d = parse_distribution(T4_DIST)
    assert d.params["mu"] == pytest.approx(math.log(180))
    assert math.exp(d.params["mu"] + d.params["sigma"] ** 2 / 2) == pytest.approx(260)
    lengths = from_distribution(T4_DIST, 2048)
    pmf = lengths.pmf()
    assert pmf.sum() == pytest.approx(1.0) and pmf[0] == 0
    mean = float((pmf * np.arange(len(pmf))).sum())
    sizes, lifetimes = lengths.sample(200_000, np.random.default_rng(1))
    assert sizes.max() <= 2048 and sizes.min() >= 1
    assert sizes.mean() == pytest.approx(mean, rel=0.01)
    assert np.array_equal(sizes, lifetimes)  # a drawn length is all output: one step per token
    fixed = from_distribution("fixed:100", 64).pmf()
    assert fixed[64] == 1.0  # cut at max_len
    uni = from_distribution("uniform:min=0.5,max=10.5", 2048).pmf()
    assert uni[1:12] == pytest.approx([0.05] + [0.1] * 9 + [0.05])  # ceil of U(0.5, 10.5)
    assert uni[12:].sum() == 0


@pytest.mark.parametrize(
    "spec",
    [
        "lognormal:mean=100,median=200",
        "lognormal:mean=100",
        "gamma:k=2",
        "uniform:min=5,max=1",
        "exponential:mean=-3",
        "lognormal:mean=abc,median=1",
    ],
)
def test_bad_distributions_are_refused(spec: str) -> None:
    with pytest.raises(LengthsError):
        parse_distribution(spec)


def test_card_presets_and_errors() -> None:
    assert resolve_card(None, "H200").total_bytes == int(139.80 * 2**30)
    with pytest.raises(CardError, match="presets"):
        resolve_card(None, "v100")
    with pytest.raises(CardError, match="not both"):
        resolve_card("16GiB", "t4")
    with pytest.raises(CardError):
        resolve_card("sixteen", None)

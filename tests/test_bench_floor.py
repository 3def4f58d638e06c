"""The physical floor `pagedctl bench` reports beside the sides, and the long-tail workload."""

from dataclasses import replace
from pathlib import Path

import pytest

from pagedctl.bench.floor import Card, ModelCost, model_cost, workload_floor
from pagedctl.bench.recipe import load_bench_recipe, make_workload
from pagedctl.engine import resolve_model
from pagedctl.recipe_file import RecipeError

ROOT = Path(__file__).resolve().parents[1]


def test_floor_by_hand() -> None:
    """Two requests: prompts of 2 and 4 tokens, answers of 3 and 1 tokens."""
    cost = ModelCost(
        weights_bytes=1000,
        body_flops_per_token=10,
        head_flops_per_row=4,
        attn_flops_per_pair=2,
        kv_bytes_per_token=100,
    )
    card = Card(bandwidth_Bps=1000.0, matmul_flops=100.0)
    f = workload_floor([2, 4], [3, 1], cost, card)
    # prefill: 10 x 6 tokens + 2 x (3 + 10) causal pairs + 4 x 2 first-token rows
    assert f["prefill_s"] == pytest.approx((60 + 26 + 8) / 100)
    # decode: steps 1 and 2 hold only the first request (context 3, then 4): streaming wins
    assert f["decode_steps"] == 2
    assert f["decode_s"] == pytest.approx((1000 + 300) / 1000 + (1000 + 400) / 1000)
    assert f["decode_arithmetic_s"] == pytest.approx((14 + 6) / 100 + (14 + 8) / 100)
    # arithmetic bound once the card streams fast enough
    fast = workload_floor([2, 4], [3, 1], cost, Card(1e9, 100.0))
    assert fast["decode_s"] == pytest.approx(fast["decode_arithmetic_s"])


def test_model_cost_of_the_qwen_preset() -> None:
    cost = model_cost(resolve_model("qwen2.5-0.5b-instruct").hf_config, 2)
    assert cost.weights_bytes == 494_032_768 * 2  # Qwen2.5-0.5B's published parameter count
    assert cost.kv_bytes_per_token == 12288
    assert cost.head_flops_per_row == 2 * 151936 * 896  # the tied embedding, once


def test_the_floor_streams_the_packed_weights() -> None:
    """Under int4 the floor streams what the engine holds: the projections' nibbles and a float16
    scale and offset per 128 weights; the tied embedding, norms and biases stay bfloat16."""
    import torch

    from pagedctl.bench.floor import held_weights_bytes

    source = resolve_model("qwen2.5-0.5b-instruct", "dummy")
    projections = 24 * (896 * (896 + 128 + 128 + 896) + 3 * 4864 * 896)  # q k v o, gate up down
    floats = 494_032_768 - projections
    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    held = held_weights_bytes(source, "int4", cpu, bf16)
    assert held == floats * 2 + projections // 2 + projections // 128 * 4
    assert held_weights_bytes(source, "none", cpu, bf16) == 494_032_768 * 2
    cost = model_cost(source.hf_config, 2, held)
    assert cost.weights_bytes == held
    assert cost.body_flops_per_token == model_cost(source.hf_config, 2).body_flops_per_token


def test_long_tail_workload() -> None:
    recipe = load_bench_recipe(ROOT / "recipes/long-tail.yaml")
    wl = make_workload(recipe.workload)
    long = [m for m in wl.max_tokens if m > 64]
    assert len(long) == 26 and all(640 <= m <= 1280 for m in long)
    assert all(32 <= m <= 64 for m in wl.max_tokens if m <= 64)
    # the long tail replaces the chosen answers only: prompts and the rest are drawn as before
    plain = make_workload(replace(recipe.workload, long_fraction=0.0))
    assert plain.prompts == wl.prompts
    pairs = zip(plain.max_tokens, wl.max_tokens, strict=True)
    assert sum(a != b for a, b in pairs) == 26


@pytest.mark.parametrize(
    ("workload", "message"),
    [
        ("long_fraction: 0.1", "needs long_output_len"),
        ("long_fraction: 1.5\n  long_output_len: [2, 3]", r"long_fraction must be in \[0, 1\]"),
        ("long_fraction: true\n  long_output_len: [2, 3]", "long_fraction must be"),
        ("long_fraction: 0.5\n  long_output_len: [3, 2]", "long_output_len must be"),
    ],
)
def test_long_tail_keys_are_checked(tmp_path: Path, workload: str, message: str) -> None:
    path = tmp_path / "r.yaml"
    path.write_text(f"model: tiny-llama\nworkload:\n  {workload}\n")
    with pytest.raises(RecipeError, match=message):
        load_bench_recipe(path)

"""Sampler: exact tokens against a slow reference, distributions, and seeded reproducibility."""

from __future__ import annotations

import math

import pytest
import torch

from pagedctl.engine.core.sampling_params import SamplingParams as SP
from pagedctl.engine.runner.sampler import Sampler, make_generator

MIXED = [
    SP(temperature=0.8),
    SP(top_k=7),
    SP(top_p=0.9),
    SP(top_p=0.97),  # nucleus larger than the first candidate head on flat rows
    SP(top_k=1500, top_p=0.95, temperature=1.3),
    SP(top_k=40, top_p=0.5, min_p=0.1, temperature=0.6),
    SP(min_p=0.2),
    SP(top_k=2000),
]


def _copy(generator: torch.Generator) -> torch.Generator:
    clone = torch.Generator()
    clone.set_state(generator.get_state())
    return clone


def _reference_probs(row: torch.Tensor, p: SP) -> torch.Tensor:
    """Filtered distribution, written the slow obvious way (stable full sort, Python loops)."""
    probs = torch.softmax(row / p.temperature, dim=-1)
    order = torch.sort(probs, descending=True, stable=True).indices.tolist()
    kept = order[: p.top_k or len(order)]
    if p.top_p < 1:
        mass = sum(float(probs[i]) for i in kept)
        acc, nucleus = 0.0, []
        for i in kept:
            nucleus.append(i)
            acc += float(probs[i])
            if acc >= p.top_p * mass:
                break
        kept = nucleus
    kept = [i for i in kept if float(probs[i]) >= p.min_p * float(probs.max())]
    out = torch.zeros(len(probs), dtype=torch.float64)
    out[kept] = probs[kept].double()
    return out / out.sum()


def _reference_token(row: torch.Tensor, p: SP, u: float) -> int:
    cdf = _reference_probs(row, p).cumsum(0)
    return int(
        torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=torch.float64), right=True)
    )


def test_greedy_is_argmax_with_lowest_id_on_ties_and_draws_nothing() -> None:
    logits = torch.randn(6, 50)
    logits[2, [5, 9, 30]] = 100.0
    logits[4, :] = 1.0
    gens = [make_generator(3, i, "cpu") for i in range(6)]
    before = [g.get_state() for g in gens]
    out = Sampler()(logits, [SP(temperature=0, seed=3)] * 6, gens)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.token_ids[2] == 5 and out.token_ids[4] == 0
    assert all(torch.equal(g.get_state(), s) for g, s in zip(gens, before, strict=True))
    assert out.logprobs is None


@pytest.mark.parametrize("vocab", [50, 3000])
@pytest.mark.parametrize("big_k", [True, False])  # without, top-p heads grow 64 -> 1024 -> vocab
def test_tokens_equal_reference_inverse_cdf(vocab: int, big_k: bool) -> None:
    torch.manual_seed(vocab)
    params = [p for p in MIXED * 4 if big_k or p.top_k < 64]
    scales = torch.tensor([0.5, 2.0, 5.0, 1.0, 3.0] * 7)[: len(params), None]
    logits = torch.randn(len(params), vocab) * scales
    gens = [make_generator(11, i, "cpu") for i in range(len(params))]
    uniforms = [float(torch.rand(1, generator=_copy(g))) for g in gens]
    out = Sampler()(logits, params, gens)
    expected = [_reference_token(logits[r], p, uniforms[r]) for r, p in enumerate(params)]
    assert out.token_ids == expected


def test_top_k_one_equals_greedy_even_with_ties() -> None:
    logits = torch.randn(16, 2000) * 3
    logits[3, [7, 1999]] = 50.0
    out = Sampler(seed=1)(logits, [SP(top_k=1, temperature=1.5)] * 16, [None] * 16)
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_tiny_top_p_keeps_only_the_top_token() -> None:
    logits = torch.randn(16, 5000) * 0.1  # nearly flat: the top token has little mass
    out = Sampler(seed=2)(logits, [SP(top_p=1e-6)] * 16, [None] * 16)
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_top_k_ties_at_the_edge_keep_the_lowest_ids() -> None:
    logits = torch.full((4000, 10), -5.0)
    logits[:, [2, 4, 6, 8]] = 3.0
    out = Sampler(seed=3)(logits, [SP(top_k=2)] * 4000, [None] * 4000)
    assert set(out.token_ids) == {2, 4}


def test_flat_top_p_keeps_the_lowest_ids_of_the_nucleus() -> None:
    rows, vocab = 2000, 3000  # every token ties; the nucleus exceeds the first candidate head
    out = Sampler(seed=4)(torch.zeros(rows, vocab), [SP(top_p=0.5)] * rows, [None] * rows)
    size = int((_reference_probs(torch.zeros(vocab), SP(top_p=0.5)) > 0).sum())
    assert abs(size - vocab // 2) <= 1
    assert max(out.token_ids) < size and max(out.token_ids) > size * 0.9


def test_top_p_applies_to_the_renormalised_top_k_head() -> None:
    # Top-2 head renormalised is (4/7, 3/7): top_p=0.5 keeps one token; on the raw
    # distribution (0.4, 0.3, ...) it would keep two.
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log().repeat(2000, 1)
    out = Sampler(seed=5)(logits, [SP(top_k=2, top_p=0.5)] * 2000, [None] * 2000)
    assert set(out.token_ids) == {0}


def test_min_p_drops_tokens_below_a_fraction_of_the_top_probability() -> None:
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().repeat(4000, 1)
    out = Sampler(seed=6)(logits, [SP(min_p=0.35)] * 4000, [None] * 4000)
    assert set(out.token_ids) == {0, 1}  # threshold 0.175
    assert abs(out.token_ids.count(0) / 4000 - 0.5 / 0.8) < 0.03


@pytest.mark.parametrize(
    "params", [SP(temperature=0.7), SP(top_k=6, top_p=0.9, min_p=0.04, temperature=1.2)]
)
def test_frequencies_match_the_distribution(params: SP) -> None:
    draws = 20_000
    row = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    out = Sampler(seed=7)(row.repeat(draws, 1), [params] * draws, [None] * draws)
    probs = _reference_probs(row, params)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=8).double()
    support = probs > 0
    assert torch.all(counts[~support] == 0)
    expected = probs[support] * draws
    chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
    assert chi2 < 24.3  # chi-square, 7 degrees of freedom at most, p = 0.001


def _run_target(target: SP, position: int, others: list[SP], steps: int) -> list[int]:
    """Tokens of one seeded sequence placed among `others` (some seeded, some not)."""
    torch.manual_seed(123)
    target_logits = [torch.randn(3000) * 2 for _ in range(steps)]
    sampler = Sampler(seed=len(others))
    gens = [make_generator(p.seed, i, "cpu") for i, p in enumerate(others)]
    gens.insert(position, make_generator(target.seed, 0, "cpu"))
    params = [*others[:position], target, *others[position:]]
    tokens = []
    for step in range(steps):
        logits = torch.randn(len(params), 3000) * (step % 3 + 1)
        logits[position] = target_logits[step]
        tokens.append(sampler(logits, params, gens).token_ids[position])
    return tokens


@pytest.mark.parametrize(
    "target",
    [
        SP(seed=9, **kw)
        for kw in (
            {"temperature": 0.9},
            {"top_p": 0.97},
            {"top_k": 50, "top_p": 0.9},
            {"min_p": 0.05},
            {"top_k": 1500, "logprobs": True},
        )
    ],
)
def test_seeded_row_is_independent_of_the_batch(target: SP) -> None:
    alone = _run_target(target, 0, [], steps=8)
    crowd = [*MIXED, SP(temperature=0), SP(seed=4, top_p=0.8), SP(seed=9, temperature=0.5)]
    assert _run_target(target, 3, crowd, steps=8) == alone
    assert _run_target(target, 7, crowd[::-1] * 2, steps=8) == alone
    assert _run_target(target, 1, [SP(top_k=2500, top_p=0.99)], steps=8) == alone


def test_sample_indices_give_distinct_reproducible_streams() -> None:
    logits = torch.zeros(1, 1000)

    def stream(seed: int, index: int) -> list[int]:
        gen = make_generator(seed, index, "cpu")
        return [Sampler()(logits, [SP(seed=seed)], [gen]).token_ids[0] for _ in range(20)]

    assert stream(5, 0) == stream(5, 0)
    assert len({tuple(stream(5, i)) for i in range(4)} | {tuple(stream(6, 0))}) == 5
    assert make_generator(None, 0, "cpu") is None


def test_sampling_row_draws_exactly_one_uniform() -> None:
    gen = make_generator(1, 0, "cpu")
    after_one = _copy(gen)
    torch.rand(1, generator=after_one)
    Sampler()(torch.randn(1, 3000), [SP(seed=1, top_p=0.9, top_k=2000)], [gen])
    assert torch.equal(gen.get_state(), after_one.get_state())


def test_logprobs_are_raw_log_softmax_at_the_sampled_ids() -> None:
    logits = torch.randn(6, 300) * 3
    params = [
        SP(logprobs=True, temperature=0.5, top_k=5),
        SP(),
        SP(temperature=0, logprobs=True),
        SP(logprobs=True, min_p=0.3),
        SP(temperature=0),
        SP(logprobs=True, top_p=0.2),
    ]
    out = Sampler(seed=8)(logits, params, [None] * 6)
    raw = torch.log_softmax(logits, dim=-1)
    assert out.logprobs is not None
    for r, p in enumerate(params):
        if p.logprobs:
            assert out.logprobs[r] == pytest.approx(float(raw[r, out.token_ids[r]]), abs=1e-5)
        else:
            assert math.isnan(out.logprobs[r])


@pytest.mark.parametrize("vocab", [1000, 1024, 5003])
def test_blocked_inverse_cdf_equals_the_full_scan(vocab: int) -> None:
    """The two-level inverse CDF (CUDA's) picks the token of a full float64 scan, never a zero-
    probability one, whatever the block boundaries (tested here on the CPU with small blocks)."""
    from pagedctl.engine.runner.sampler import _inverse_cdf_blocked

    gen = torch.Generator().manual_seed(vocab)
    probs = torch.softmax(torch.randn(300, vocab, generator=gen) * 3, dim=-1)
    probs[0::4, 1::2] = 0.0  # filtered rows: every other token removed
    probs[1::4, : vocab - 3] = 0.0  # all the mass in the last tokens (a partial last block)
    probs[2::4, 5:] = 0.0  # all the mass in the first block
    u = torch.rand(300, generator=gen)
    u[:5] = torch.tensor([0.0, 1 - 2**-24, 0.5, 1e-9, 0.999999])
    cdf = probs.double().cumsum(dim=-1)
    total = cdf[:, -1]
    target = torch.minimum(u.double() * total, torch.nextafter(total, torch.zeros_like(total)))
    want = torch.searchsorted(cdf, target[:, None], right=True).squeeze(1)
    for block in (64, 100, 1024):
        got = _inverse_cdf_blocked(probs.clone(), u, block)
        assert torch.equal(got, want), block
        assert bool((probs.gather(1, got[:, None]) > 0).all())


@pytest.mark.parametrize("params", [SP(temperature=0.7), SP(temperature=0.0), SP(temperature=1.3)])
def test_uniform_batch_fast_path_equals_the_general_path(monkeypatch, params) -> None:
    logits = torch.randn(64, 3000) * 2
    fast = Sampler(seed=5)(logits.clone(), [params] * 64, [None] * 64)
    monkeypatch.setattr(Sampler, "_uniform_batch", lambda *a: None)
    general = Sampler(seed=5)(logits.clone(), [params] * 64, [None] * 64)
    assert fast.token_ids == general.token_ids

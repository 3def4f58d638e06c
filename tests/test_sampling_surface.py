"""The sampling fields batch users send, against transformers on the same weights (float32, CPU).

Penalties, logit_bias, allowed_token_ids, bad_words and min_tokens: greedy tokens equal to
transformers' `generate` with its own processors (`repetition_penalty`, `min_new_tokens`,
`SequenceBiasLogitsProcessor`, `NoBadWordsLogitsProcessor`) or with a logits processor written
here for OpenAI's presence/frequency rule and the allowed-token mask; the same tokens with
chunked prefill, under preemption, in multi-step decode windows and per sample of `n`.
Logprobs: the top tokens and the prompt's logprobs equal the log_softmax of one transformers
forward pass over prompt and output to 1e-4; `processed_logprobs` is the distribution sampled
from (temperature, top-k).
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from pagedctl.engine import SamplingParams
from pagedctl.engine.llm import LLM
from pagedctl.engine.runner.logits_processors import banned_tokens
from tests.tiny_models import save_tiny_model

MAX = 16
TOL = 1e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    hf = save_tiny_model("llama", folder)
    rng = random.Random(3)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (4, 11, 29, 40)]
    return str(folder), hf, prompts


def engine(folder: str, **kwargs) -> LLM:
    return LLM(folder, device="cpu", dtype="float32", **{"num_blocks": 64, **kwargs})


def tokens(llm: LLM, prompts, params) -> list[list[int]]:
    outs = llm.generate(prompts, params)
    assert all(o.ok for o in outs), [o.error for o in outs]
    return [o.outputs[0].token_ids for o in outs]


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's rule over the output tokens: logit - frequency * count - presence * (count > 0)."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        counts = torch.zeros_like(scores)
        out = input_ids[:, self.prompt_len :]
        counts.scatter_add_(1, out, torch.ones_like(out, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0)


class Allowed(LogitsProcessor):
    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def __call__(self, input_ids, scores):
        keep = torch.full_like(scores, float("-inf"))
        keep[:, self.ids] = 0
        return scores + keep


@torch.no_grad()
def hf_generate(hf, prompt: list[int], **kwargs) -> list[int]:
    out = hf.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        do_sample=False,
        pad_token_id=0,
        **{"max_new_tokens": MAX, **kwargs},
    )
    return out[0, len(prompt) :].tolist()


GREEDY = SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True)


def test_repetition_penalty_matches_transformers(tiny):
    folder, hf, prompts = tiny
    params = dataclasses.replace(GREEDY, repetition_penalty=1.8)
    want = [hf_generate(hf, p, repetition_penalty=1.8) for p in prompts]
    assert want != [hf_generate(hf, p) for p in prompts]  # the penalty changes the answers
    assert tokens(engine(folder), prompts, params) == want
    # chunked prefill, and a pool small enough to preempt
    small = engine(folder, num_blocks=8, block_size=16, max_num_batched_tokens=16)
    assert tokens(small, prompts, params) == want
    assert small.stats["scheduler"]["num_preemptions"] > 0


@pytest.mark.parametrize(("presence", "frequency"), [(1.5, 0.0), (0.0, 1.0), (-0.5, 2.0)])
def test_presence_and_frequency_penalties_follow_openais_rule(tiny, presence, frequency):
    folder, hf, prompts = tiny
    params = dataclasses.replace(GREEDY, presence_penalty=presence, frequency_penalty=frequency)
    want = [
        hf_generate(hf, p, logits_processor=LogitsProcessorList(
            [OpenAIPenalties(len(p), presence, frequency)]))
        for p in prompts
    ]  # fmt: skip
    assert tokens(engine(folder), prompts, params) == want


def test_logit_bias_allowed_tokens_and_min_tokens_match_transformers(tiny):
    folder, hf, prompts = tiny
    llm = engine(folder)
    plain = tokens(llm, prompts, GREEDY)
    # logit_bias: transformers' sequence bias of one-token sequences
    bias = {plain[0][1]: -50.0, 7: 3.5, 200: 2.0}
    want = [hf_generate(hf, p, sequence_bias={(t,): b for t, b in bias.items()}) for p in prompts]
    assert tokens(llm, prompts, dataclasses.replace(GREEDY, logit_bias=bias)) == want != plain
    # allowed_token_ids
    allowed = [3, 50, 51, 99, 180]
    got = tokens(llm, prompts, dataclasses.replace(GREEDY, allowed_token_ids=allowed))
    proc = LogitsProcessorList([Allowed(allowed)])
    assert got == [hf_generate(hf, p, logits_processor=proc) for p in prompts]
    assert {t for row in got for t in row} <= set(allowed)
    # min_tokens: a stop token that greedy reaches early is masked until then
    stop = plain[1][2]
    early = SamplingParams(temperature=0, max_tokens=MAX, stop_token_ids=[stop])
    assert tokens(llm, prompts[1:2], early)[0][-1] == stop
    late = dataclasses.replace(early, min_tokens=8)
    got = tokens(llm, prompts, late)
    want = [hf_generate(hf, p, eos_token_id=stop, min_new_tokens=8) for p in prompts]
    assert got == want and len(got[1]) >= 8


def test_bad_words_mask_the_last_token_after_its_prefix(tiny):
    folder, hf, prompts = tiny
    llm = engine(folder)
    plain = tokens(llm, prompts, GREEDY)
    words = ((plain[2][3], plain[2][4]), (plain[0][5],))  # as token ids
    params = dataclasses.replace(GREEDY, bad_words=("w",)).with_bad_words_ids(words)
    got = tokens(llm, prompts, params)
    want = [hf_generate(hf, p, bad_words_ids=[list(w) for w in words]) for p in prompts]
    assert got == want != plain
    for row in got:
        assert words[1][0] not in row
        assert all(row[i : i + 2] != list(words[0]) for i in range(len(row) - 1))


def test_banned_tokens_match_only_the_outputs_end():
    seq = type("S", (), {"output_token_ids": [5, 6, 7]})()
    words = ((6, 7, 9), (7, 8), (4,), (6, 8), (1, 5, 6, 7, 2), (0, 1, 5, 6, 7, 2))
    assert banned_tokens(words, seq) == [9, 8, 4]  # a word longer than the output never matches


def test_penalties_in_multi_step_windows_and_per_sample(tiny):
    """Device-side counts carry through 5-step windows, and each of n samples counts its own
    tokens: greedy samples of n=3 are the n=1 answer, not a penalty over all three."""
    folder, _, prompts = tiny
    params = dataclasses.replace(
        GREEDY, frequency_penalty=1.5, repetition_penalty=1.3, logit_bias={9: 4.0}, min_tokens=4
    )
    single = tokens(engine(folder, cuda_graphs="emulate"), prompts, params)
    windows = engine(folder, cuda_graphs="emulate", num_scheduler_steps=5, max_num_seqs=8)
    assert tokens(windows, prompts, params) == single
    assert windows.runner.step_counts["decode"] > 0
    outs = engine(folder).generate(prompts[:2], dataclasses.replace(params, n=3))
    for out, want in zip(outs, single, strict=False):
        assert [s.token_ids for s in out.outputs] == [want] * 3


@torch.no_grad()
def hf_log_softmax(hf, ids: list[int]) -> torch.Tensor:
    return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def test_top_logprobs_and_prompt_logprobs_are_the_models(tiny):
    folder, hf, prompts = tiny
    params = dataclasses.replace(GREEDY, logprobs=True, top_logprobs=5, prompt_logprobs=3)
    for kwargs in ({}, {"max_num_batched_tokens": 8, "block_size": 16}):
        llm = engine(folder, **kwargs)
        for prompt, out in zip(prompts, llm.generate(prompts, params), strict=True):
            sample = out.outputs[0]
            lp = hf_log_softmax(hf, prompt + sample.token_ids)
            n = len(prompt)
            for j, (tok, value, top) in enumerate(
                zip(sample.token_ids, sample.logprobs, sample.top_logprobs, strict=True)
            ):
                row = lp[n - 1 + j]
                assert abs(value - row[tok]) < TOL
                best = row.topk(5)
                assert [t for t, _ in top] == best.indices.tolist()
                assert (
                    max(abs(v - w) for (_, v), w in zip(top, best.values.tolist(), strict=True))
                    < TOL
                )
            assert out.prompt_logprobs[0] is None and out.prompt_top_logprobs[0] == []
            for i in range(1, n):
                assert abs(out.prompt_logprobs[i] - lp[i - 1, prompt[i]]) < TOL
                assert [t for t, _ in out.prompt_top_logprobs[i]] == lp[i - 1].topk(
                    3
                ).indices.tolist()


def test_prompt_logprobs_compute_a_cached_prefix_again(tiny):
    folder, hf, prompts = tiny
    llm = engine(folder, block_size=16)
    prompt = prompts[3]  # 40 tokens: two full blocks to hit
    assert llm.generate([prompt], GREEDY)[0].ok
    scored = llm.generate([prompt], dataclasses.replace(GREEDY, prompt_logprobs=0))[0]
    assert scored.metrics.num_cached_tokens == 0
    lp = hf_log_softmax(hf, prompt)
    assert all(abs(scored.prompt_logprobs[i] - lp[i - 1, prompt[i]]) < TOL for i in range(1, 40))
    assert llm.generate([prompt], GREEDY)[0].metrics.num_cached_tokens == 32  # still cached


def test_logprobs_modes(tiny):
    """raw_logits are the model's logits; processed_logprobs the distribution sampled from:
    biased, divided by the temperature, outside the top-k at -inf."""
    folder, hf, prompts = tiny
    llm = engine(folder)
    base = SamplingParams(max_tokens=4, ignore_eos=True, logprobs=True, top_logprobs=3, seed=1)
    raw = llm.generate(prompts[:1], dataclasses.replace(base, logprobs_mode="raw_logits"))[0]
    sample = raw.outputs[0]
    with torch.no_grad():
        logits = hf(torch.tensor([prompts[0] + sample.token_ids])).logits[0]
    n = len(prompts[0])
    assert abs(sample.logprobs[0] - logits[n - 1, sample.token_ids[0]]) < TOL
    mode = dataclasses.replace(
        base, logprobs_mode="processed_logprobs", temperature=0.7, top_k=3, logit_bias={5: 1.0}
    )
    sample = llm.generate(prompts[:1], mode)[0].outputs[0]
    with torch.no_grad():
        logits = hf(torch.tensor([prompts[0] + sample.token_ids])).logits[0].float()
    for j, (tok, value, top) in enumerate(
        zip(sample.token_ids, sample.logprobs, sample.top_logprobs, strict=True)
    ):
        x = logits[n - 1 + j].clone()
        x[5] += 1.0
        x = x / 0.7
        kth = x.topk(3).values[-1]
        want = torch.where(x >= kth, x, float("-inf")).log_softmax(-1)
        assert abs(value - want[tok]) < TOL and tok in x.topk(3).indices.tolist()
        assert [t for t, _ in top] == x.topk(3).indices.tolist()
        assert abs(sum(torch.tensor([v for _, v in top]).exp()) - 1) < TOL


def test_out_of_vocabulary_ids_fail_their_request_alone(tiny):
    folder, _, prompts = tiny
    llm = engine(folder)
    outs = llm.generate(
        prompts[:3],
        [GREEDY, dataclasses.replace(GREEDY, logit_bias={256: 1.0}),
         dataclasses.replace(GREEDY, allowed_token_ids=[3, 999])],
    )  # fmt: skip
    assert outs[0].ok
    assert [o.error_code for o in outs[1:]] == ["token_out_of_vocab"] * 2
    assert "logit_bias token ids [256]" in outs[1].error


@pytest.mark.parametrize("mode", ["swap", "deterministic"])
def test_penalties_and_logprobs_hold_under_swap_and_deterministic(tiny, mode):
    """Preempted by swap (the counts stay on the device while the KV is on the host), or with
    `deterministic`: the tokens and logprobs of an unconstrained run."""
    folder, _, prompts = tiny
    params = dataclasses.replace(
        GREEDY, presence_penalty=0.8, repetition_penalty=1.5, logit_bias={3: 2.0}, logprobs=True,
        top_logprobs=2, prompt_logprobs=1,
    )  # fmt: skip
    big = engine(folder, block_size=16).generate(prompts, params)
    extra = {"deterministic": True}
    if mode == "swap":
        extra = {"num_blocks": 8, "preemption_mode": "swap", "swap_space": 1 / 64}  # GiB
    small = engine(folder, block_size=16, max_num_batched_tokens=16, **extra)
    outs = small.generate(prompts, params)
    if mode == "swap":
        assert small.stats["scheduler"]["num_preemptions"] > 0
    for a, b in zip(big, outs, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert max(abs(x - y) for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs,
                                               strict=True)) < TOL  # fmt: skip
        assert all(
            abs(x - y) < TOL
            for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], strict=True)
        )

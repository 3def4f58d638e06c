"""A request on which the engine fails ends alone with an internal_error; the run goes on.

The failures are real exceptions raised inside the model's forward pass (or the tokenizer), keyed
on what the batch holds: a poison token id, or a position that only one request reaches.
"""

import itertools
import logging
import random

import pytest

from pagedctl.engine import SamplingParams
from pagedctl.engine.llm import LLM
from tests.tiny_models import save_tiny_model

POISON = 7  # absent from every clean prompt and (checked) from every clean output
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama-fail")
    save_tiny_model("llama", path)
    return path


def make_llm(folder, **settings):
    settings = {"num_blocks": 48, "block_size": 4, "max_num_seqs": 8, **settings}
    llm = LLM(str(folder), device="cpu", dtype="float32", debug=True, **settings)
    # Attention reads only slots written since their block was taken: with NaN everywhere else,
    # a retry that let a row read a slot it did not write (a copy redone over it) shows.
    llm.runner._kv.fill_(float("nan"))
    return llm


def clean_prompts(count, seed=0, lengths=(3, 12)):
    rng = random.Random(seed)
    tokens = [t for t in range(3, 120) if t != POISON]
    return [[rng.choice(tokens) for _ in range(rng.randint(*lengths))] for _ in range(count)]


def poison_forward(llm, when, exc=IndexError):
    """Make the model's forward raise `exc` whenever `when(input_ids, positions)` holds."""
    real = llm.model.forward

    def forward(input_ids, positions, *args, **kwargs):
        if when(input_ids, positions):
            raise exc("poisoned batch")
        return real(input_ids, positions, *args, **kwargs)

    llm.model.forward = forward


def has_poison(input_ids, positions):
    return bool((input_ids == POISON).any())


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def clean_run(folder, prompts, params, **settings):
    outs = make_llm(folder, **settings).generate(prompts, params)
    assert all(o.ok for o in outs)
    assert all(POISON not in c.token_ids for o in outs for c in o.outputs)
    return tokens(outs)


def assert_failed(out):
    assert not out.ok and out.outputs == []
    assert out.error_code == "internal_error"
    assert out.error == "the engine failed on this request: IndexError: poisoned batch"


def assert_pool_empty(llm):
    kv = llm.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks
    assert not llm.scheduler.has_unfinished() and len(llm.tracker) == 0


def test_a_poisoned_prompt_fails_alone(folder, caplog):
    """The step that prefills the poison prompt (n=2, with six clean ones) fails; bisection
    finds it, the others' greedy tokens are those of a run without it, logged once."""
    prompts = clean_prompts(6)
    expected = clean_run(folder, prompts, GREEDY)
    llm = make_llm(folder)
    poison_forward(llm, has_poison)
    bad = SamplingParams(n=2, temperature=0.0, max_tokens=8, ignore_eos=True)
    items = [*prompts[:3], {"prompt_token_ids": [5, POISON, POISON, 9], "request_id": "bad"}]
    items += prompts[3:]
    with caplog.at_level(logging.WARNING, logger="pagedctl.engine"):
        outs = llm.generate(items, [GREEDY] * 3 + [bad] + [GREEDY] * 3)
    assert_failed(outs[3])
    assert outs[3].request_id == "bad"
    good = outs[:3] + outs[4:]
    assert all(o.ok for o in good) and tokens(good) == expected
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "request bad failed" in warnings[0].getMessage()
    assert "IndexError: poisoned batch" in warnings[0].getMessage()
    assert_pool_empty(llm)


def test_a_failure_mid_decode_is_contained(folder):
    """Only the long request reaches position 30, several decode steps in; it fails there, the
    short ones (whose last position is 19) go on unchanged, chunked prefill included."""
    prompts = clean_prompts(5)
    long_prompt = clean_prompts(1, seed=9, lengths=(26, 26))[0]
    settings = {"max_num_batched_tokens": 16}
    expected = clean_run(folder, prompts, GREEDY, **settings)
    llm = make_llm(folder, **settings)
    poison_forward(llm, lambda ids, pos: bool((pos == 30).any()))
    outs = llm.generate([prompts[0], long_prompt, *prompts[1:]], GREEDY)
    assert_failed(outs[1])
    good = outs[:1] + outs[2:]
    assert all(o.ok for o in good) and tokens(good) == expected
    assert_pool_empty(llm)


def test_parallel_samples_fail_together(folder):
    """A request of n=3 fails in its first step after the fork, a step with copy-on-write
    copies (its own and those of a good n=2 request, whose prompt also ends in a partly filled
    block): all three samples finish with the request's error, the good request's samples are
    those of a clean run, the pending-fork and block accounting stay right (debug invariants)."""
    prompts = clean_prompts(3, seed=3)
    # Seeded, each sample from its own generator as in the clean run, so that the two differ;
    # their logprobs show a KV slot overwritten by a copy redone at the wrong time.
    pair = SamplingParams(
        n=2, temperature=1.0, seed=2, max_tokens=8, ignore_eos=True, logprobs=True
    )
    prompts.insert(1, clean_prompts(1, seed=12, lengths=(17, 17))[0])  # decodes 17..24
    params = [GREEDY, pair, GREEDY, GREEDY]
    n3 = SamplingParams(n=3, temperature=0.8, seed=4, max_tokens=8, ignore_eos=True)
    long_prompt = clean_prompts(1, seed=5, lengths=(25, 25))[0]  # first decode at 25
    clean = make_llm(folder).generate(prompts, params)
    llm = make_llm(folder)
    poison_forward(llm, lambda ids, pos: bool((pos == 25).any()))
    outs = llm.generate([*prompts[:2], long_prompt, *prompts[2:]], [*params[:2], n3, *params[2:]])
    assert_failed(outs[2])
    good = outs[:2] + outs[3:]
    assert all(o.ok for o in good)
    assert good[1].outputs[0].token_ids != good[1].outputs[1].token_ids
    for got, want in zip(good[1].outputs, clean[1].outputs, strict=True):
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)
    assert [[c.token_ids for c in o.outputs] for o in good] == [
        [c.token_ids for c in o.outputs] for o in clean
    ]
    assert llm.scheduler.kv.stats.cow_copies >= 3
    assert llm.scheduler.stats.num_finished == 5 + 3
    assert_pool_empty(llm)


def test_a_failure_inside_a_multi_step_decode_window(folder, caplog):
    """With `num_scheduler_steps=4` on the emulated graph path, the failing window's rows run
    again one step at a time (its reserved slots given back); the culprit fails there."""
    prompts = clean_prompts(5, seed=6)
    long_prompt = clean_prompts(1, seed=7, lengths=(24, 24))[0]
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    settings = {"cuda_graphs": "emulate", "num_scheduler_steps": 4}
    expected = clean_run(folder, prompts, params, **settings)
    llm = make_llm(folder, **settings)
    poison_forward(llm, lambda ids, pos: bool((pos == 29).any()))
    with caplog.at_level(logging.DEBUG, logger="pagedctl.engine"):
        outs = llm.generate([*prompts[:2], long_prompt, *prompts[2:]], params)
    assert_failed(outs[2])
    good = outs[:2] + outs[3:]
    assert all(o.ok for o in good) and tokens(good) == expected
    assert any("decode window failed" in r.getMessage() for r in caplog.records)
    assert llm.runner.step_counts["decode"] > 0
    assert_pool_empty(llm)


def test_a_failure_in_the_sampler_is_contained(folder):
    """The sampler refuses one request's parameters (top_k=13) at its first token."""
    prompts = clean_prompts(5, seed=13)
    expected = clean_run(folder, prompts, GREEDY)
    llm = make_llm(folder)
    sampler = llm.runner.sampler
    real = sampler.sample

    def sample(logits, params, generators):
        if any(p.top_k == 13 for p in params):
            raise IndexError("poisoned batch")
        return real(logits, params, generators)

    sampler.sample = sample
    odd = SamplingParams(temperature=0.5, top_k=13, max_tokens=8)
    outs = llm.generate(
        [*prompts[:2], [5, 6, 8], *prompts[2:]], [GREEDY] * 2 + [odd] + [GREEDY] * 3
    )
    assert_failed(outs[2])
    good = outs[:2] + outs[3:]
    assert all(o.ok for o in good) and tokens(good) == expected
    assert_pool_empty(llm)


def test_a_failure_on_every_row_fails_every_request_and_ends(folder):
    """Nothing to blame on one row (the forward always raises): every request fails, once
    each, and the stream ends instead of retrying forever."""
    llm = make_llm(folder)
    poison_forward(llm, lambda ids, pos: True)
    prompts = clean_prompts(11, seed=8)
    asked = itertools.count()
    outs = list(llm.stream(prompts, GREEDY, should_stop=lambda: next(asked) > 40))
    assert sorted(o.index for o in outs) == list(range(len(prompts)))
    for out in outs:
        assert_failed(out)
    assert_pool_empty(llm)


@pytest.mark.parametrize("exc", [KeyboardInterrupt, MemoryError])
def test_interrupts_and_host_memory_errors_are_not_contained(folder, exc):
    llm = make_llm(folder)
    poison_forward(llm, has_poison, exc)
    with pytest.raises(exc):
        llm.generate([[5, 6], [POISON, 8]], GREEDY)


class FlakyTokenizer:
    """Decodes ids to "t<id>" words; fails on the 5th decode of a short window (the incremental
    detokenizer's, which only stop-string checks use) and on any decode of exactly 5 tokens (a
    whole output of 5)."""

    eos_token_id = None

    def __init__(self):
        self.incremental = 0

    def decode(self, ids, skip_special_tokens=True, **kwargs):
        if len(ids) < 5:  # an incremental window
            self.incremental += 1
            if self.incremental == 5:
                raise IndexError("poisoned batch")
        elif len(ids) == 5:
            raise IndexError("poisoned batch")
        return "".join(f" t{i}" for i in ids)

    def convert_tokens_to_ids(self, names):
        return [None for _ in names]

    def convert_ids_to_tokens(self, ids):
        return f"t{ids}" if isinstance(ids, int) else [f"t{i}" for i in ids]


def test_a_tokenizer_failure_fails_its_request_alone(folder, caplog):
    """A stop-string check and a final decode that raise fail their own requests only; the
    first is that of the second sample of an n=2 request, whose first sample, still running,
    ends with it."""
    llm = make_llm(folder)
    llm.tracker.tokenizer = FlakyTokenizer()
    prompts = clean_prompts(4, seed=10)
    stop = SamplingParams(
        n=2, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True, stop=("never",)
    )
    five = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    with caplog.at_level(logging.WARNING, logger="pagedctl.engine"):
        outs = llm.generate(prompts, [GREEDY, stop, five, GREEDY])
    assert_failed(outs[1])
    assert_failed(outs[2])
    for out in (outs[0], outs[3]):
        assert out.ok and len(out.outputs[0].token_ids) == 8
        assert out.outputs[0].text == "".join(f" t{i}" for i in out.outputs[0].token_ids)
    messages = sorted(r.getMessage().split(":")[0] for r in caplog.records)
    assert messages == [
        "request 1 failed; its 2 sequence(s) end with an error, the others go on",
        "request 2 failed; its 1 sequence(s) end with an error, the others go on",
    ]
    assert_pool_empty(llm)


# ---------------------------------------------------------------- strict max_tokens


def test_strict_max_tokens_refuses_what_cannot_fit(folder):
    llm = make_llm(folder, max_model_len=64, num_blocks=40)
    prompt = clean_prompts(1, seed=11, lengths=(50, 50))[0]
    strict = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, strict_max_tokens=True)
    lenient = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    fits = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True, strict_max_tokens=True)
    outs = llm.generate(
        [prompt, prompt, prompt, [], list(range(64))], [strict, lenient, fits] + [strict] * 2
    )
    refused, cut, full, empty, too_long = outs
    assert refused.error_code == "context_length_exceeded" and refused.outputs == []
    assert refused.error == (
        "max_model_len is 64 tokens, but the request asks for 70 (50 in the prompt, "
        "20 in max_tokens); lower max_tokens to at most 14"
    )
    # Without it the request runs and is cut short at the limit, as before.
    (c,) = cut.outputs
    assert (
        len(c.token_ids) == 14 and c.finish_reason == "length" and c.stop_reason == "max_model_len"
    )
    (f,) = full.outputs
    assert f.token_ids == c.token_ids and f.finish_reason == "length" and f.stop_reason is None
    assert empty.error_code == "empty_prompt"
    assert too_long.error_code == "prompt_too_long"  # the prompt alone leaves no room
    assert_pool_empty(llm)


def test_strict_max_tokens_is_a_bool():
    with pytest.raises(TypeError, match="strict_max_tokens"):
        SamplingParams(strict_max_tokens="yes")

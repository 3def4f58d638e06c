"""The sampling surface through a real `pagedctl generate` job on the bundled model: penalties,
logit_bias, bad_words, allowed tokens, top logprobs (chat and completions), echo and prompt
scoring, each line's bad value its own error record while the other lines run."""

from __future__ import annotations

import math

import pytest

from pagedctl import bundled_model
from pagedctl.engine.llm import LLM
from pagedctl.exits import EXIT_PARTIAL
from tests.job_utils import (
    FAST,
    by_id,
    check_ok_line,
    completion_text,
    read_jsonl,
    run,
    write_jsonl,
)

pytestmark = pytest.mark.slow

CHAT_URL, COMPLETION_URL = "/v1/chat/completions", "/v1/completions"
CAPITAL = "The capital of France is"
SCORED = "The capital of France is Paris."


def line(cid: str, url: str, **body) -> dict:
    return {"custom_id": cid, "method": "POST", "url": url, "body": body}


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def tokenizer():
    return LLM(bundled_model(), device="cpu", dtype="float32", num_blocks=8).tokenizer


@pytest.fixture(scope="module")
def job(tmp_path_factory, tokenizer):
    paris = tokenizer.encode(" Paris", add_special_tokens=False)[0]
    rows = [
        line("plain", COMPLETION_URL, prompt=CAPITAL, max_tokens=8),
        line("biased", COMPLETION_URL, prompt=CAPITAL, max_tokens=8, logit_bias={str(paris): -100}),
        line("bad-words", COMPLETION_URL, prompt=CAPITAL, max_tokens=8, bad_words=["Paris"]),
        line("allowed", COMPLETION_URL, prompt=CAPITAL, max_tokens=4,
             allowed_token_ids=[paris, 30], logprobs=1),
        line("penalized", COMPLETION_URL, prompt="1, 2, 1, 2, 1, 2,", max_tokens=12,
             frequency_penalty=2.0, presence_penalty=1.0),
        line("repeat", COMPLETION_URL, prompt="1, 2, 1, 2, 1, 2,", max_tokens=12),
        line("min", COMPLETION_URL, prompt=CAPITAL, max_tokens=12, min_tokens=12),
        line("chat-top", CHAT_URL, messages=chat("Say hi."), max_tokens=6, logprobs=True,
             top_logprobs=3),
        line("echo", COMPLETION_URL, prompt=CAPITAL, max_tokens=3, logprobs=2, echo=True),
        line("score", COMPLETION_URL, prompt=SCORED, max_tokens=0, logprobs=0, echo=True),
        line("prompt-lp", COMPLETION_URL, prompt=SCORED, max_tokens=1, prompt_logprobs=2),
        line("bad-top", CHAT_URL, messages=chat("x"), logprobs=True, top_logprobs=21),
        line("bad-bias", COMPLETION_URL, prompt="x", logit_bias={"999999": 1}),
        line("bad-penalty", COMPLETION_URL, prompt="x", repetition_penalty=-1),
        line("bad-min", COMPLETION_URL, prompt="x", max_tokens=4, min_tokens=5),
        line("zero-no-echo", COMPLETION_URL, prompt="x", max_tokens=0),
    ]  # fmt: skip
    folder = tmp_path_factory.mktemp("job")
    src = write_jsonl(folder / "in.jsonl", rows)
    done = run(src, *FAST)
    assert done.returncode == EXIT_PARTIAL, done.stderr[-2000:]  # the bad lines are errors
    out = by_id(read_jsonl(src.with_suffix(".out.jsonl")))
    errors = by_id(read_jsonl(src.with_suffix(".errors.jsonl")))
    return out, errors, paris


def test_bad_values_are_their_lines_errors(job):
    out, errors, _ = job
    assert {cid: e["error"]["code"] for cid, e in errors.items()} == {
        "bad-top": "invalid_field",
        "bad-bias": "token_out_of_vocab",
        "bad-penalty": "invalid_field",
        "bad-min": "invalid_field",
        "zero-no-echo": "max_tokens_out_of_range",
    }
    assert "top_logprobs must be an integer in [0, 20]" in errors["bad-top"]["error"]["message"]
    assert len(out) == 11


def test_biases_masks_and_penalties_change_the_text(job, tokenizer):
    out, _, paris = job
    text = {cid: completion_text(check_ok_line(r)) for cid, r in out.items()}
    assert text["plain"].startswith(" Paris")
    assert "Paris" not in text["biased"] and "Paris" not in text["bad-words"]
    allowed = out["allowed"]["response"]["body"]["choices"][0]["logprobs"]["tokens"]
    assert set(allowed) <= {tokenizer.decode([paris]), tokenizer.decode([30])}
    assert text["penalized"] != text["repeat"]
    assert text["repeat"].count("1, 2") > text["penalized"].count("1, 2")
    body = out["min"]["response"]["body"]
    assert (
        body["usage"]["completion_tokens"] == 12 and body["choices"][0]["finish_reason"] == "length"
    )


def test_top_logprobs_chat_and_completions(job):
    out, _, _ = job
    content = out["chat-top"]["response"]["body"]["choices"][0]["logprobs"]["content"]
    assert len(content) == 6
    for entry in content:
        top = entry["top_logprobs"]
        assert len(top) == 3 and set(top[0]) == {"token", "logprob", "bytes"}
        assert [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
        assert top[0]["token"] == entry["token"]  # greedy: the sampled token is the likeliest
        assert math.isclose(top[0]["logprob"], entry["logprob"], abs_tol=1e-6)
    lp = out["echo"]["response"]["body"]["choices"][0]["logprobs"]
    for tokens, top in zip(lp["tokens"][1:], lp["top_logprobs"][1:], strict=True):
        assert 2 <= len(top) <= 3 and tokens in top


def test_echo_and_prompt_scoring(job):
    out, _, _ = job
    echo = out["echo"]["response"]["body"]
    choice = echo["choices"][0]
    assert choice["text"].startswith(CAPITAL) and len(choice["text"]) > len(CAPITAL)
    lp = choice["logprobs"]
    assert "".join(lp["tokens"]) == choice["text"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    prompt_tokens = echo["usage"]["prompt_tokens"]
    assert len(lp["tokens"]) == prompt_tokens + echo["usage"]["completion_tokens"]
    score = out["score"]["response"]["body"]
    assert score["choices"][0]["text"] == SCORED
    assert score["usage"]["completion_tokens"] == 0
    scored = score["choices"][0]["logprobs"]
    assert "".join(scored["tokens"]) == SCORED and scored["token_logprobs"][0] is None
    # the same prompt's logprobs asked for as vLLM's prompt_logprobs: the same numbers
    plp = out["prompt-lp"]["response"]["body"]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(scored["tokens"])
    for given, entries in zip(scored["token_logprobs"][1:], plp[1:], strict=True):
        assert 1 <= len(entries) <= 3
        assert any(math.isclose(e["logprob"], given, abs_tol=1e-5) for e in entries.values())
    assert "prompt_logprobs" not in score

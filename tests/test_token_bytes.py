"""A token's exact bytes: joined over a sample's tokens they spell its text, even where a token
holds part of a character (an emoji split over byte-level BPE tokens)."""

from __future__ import annotations

import pytest

from pagedctl import bundled_model
from pagedctl.engine.models.source import resolve_model
from pagedctl.engine.models.weights import load_tokenizer
from pagedctl.engine.token_bytes import TokenBytes


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model(bundled_model()))


TEXTS = ["Hi 😀 café", "日本語のテキスト", " two  spaces\n\ttab", "🇫🇷🧑‍🚀"]


@pytest.mark.parametrize("text", TEXTS)
def test_bytes_spell_the_text(tokenizer, text: str) -> None:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    token_bytes = TokenBytes(tokenizer)
    assert token_bytes.byte_level
    assert b"".join(token_bytes(t) for t in ids) == text.encode()
    decoded_alone = b"".join(tokenizer.decode([t]).encode() for t in ids)
    if "😀" in text:
        assert decoded_alone != text.encode()  # what a per-token decode loses


def test_special_tokens_are_their_text(tokenizer) -> None:
    eos = tokenizer.eos_token_id
    assert TokenBytes(tokenizer)(eos) == tokenizer.eos_token.encode()


@pytest.mark.parametrize("text", TEXTS)
def test_completion_tokens_show_partial_characters_as_openai_does(tokenizer, text: str) -> None:
    """The completions form's `tokens`: a token of whole characters is its text; one that holds
    part of a character is `bytes:` and its bytes as \\xHH escapes, so that the tokens spell the
    text apart from those, and the bytes come back whole."""
    from pagedctl.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
    from pagedctl.generate.records import ok_record, token_bytes_of

    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    token_bytes = TokenBytes(tokenizer)
    sample = CompletionOutput(0, text, ids, "stop", None, [-1.0] * len(ids))
    out = RequestOutput("r", 0, "p", [1], outputs=[sample], metrics=RequestMetrics(1, 0))
    body = ok_record("x", "completion", "m", out, token_bytes=token_bytes)["response"]["body"]
    tokens = body["choices"][0]["logprobs"]["tokens"]
    assert b"".join(map(token_bytes_of, tokens)) == text.encode()
    for t, tok in zip(ids, tokens, strict=True):
        raw = token_bytes(t)
        try:
            assert tok == raw.decode()
        except UnicodeDecodeError:
            assert tok == "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
    if "😀" in text or "日本" in text:  # byte tokens, shown as bytes, never as U+FFFD
        assert any(tok.startswith("bytes:\\x") for tok in tokens)
        assert not any("\ufffd" in tok for tok in tokens)

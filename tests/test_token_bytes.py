"""A token's exact bytes: joined over a sample's tokens they spell its text, even where a token
holds part of a character (an emoji split over byte-level BPE tokens)."""

from __future__ import annotations

import pytest

from pagedctl import bundled_model
from pagedctl.engine.model_source import resolve_model
from pagedctl.engine.token_bytes import TokenBytes
from pagedctl.engine.weights import load_tokenizer


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

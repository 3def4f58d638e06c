"""Incremental detokenizer: equality with a full decode, and stop strings, on real tokenizers.

The tokenizers are trained here, offline, on a small multilingual text: a byte-level BPE (GPT-2 /
Llama 3 / Qwen style), a SentencePiece-style BPE with byte fallback and the Llama decoder chain,
and a plain Metaspace one.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from pagedctl.engine.detokenizer import IncrementalDetokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog. Hello world, hello again!",
    "Grüße aus München: Straße, Äpfel, Öl und Übermut. Ça va très bien, merci à vous.",
    "Привет, мир! Как дела? Ελληνικά γράμματα: αβγδε.",
    "日本語のテキストと中文文本，还有한국어 문장도 있습니다。東京は大きい都市です。",
    "Emoji: 😀😃😄 👍🏽 👨‍👩‍👧‍👦 🇫🇷🇯🇵 ❤️ 🎉 and math ∑∫√∞ ≠ ≤.",
    "مرحبا بالعالم. שלום עולם. नमस्ते दुनिया।",
    "def main():\n    print('hello')\n    return 42\n",
]
SPECIALS = ["<unk>", "<|endoftext|>", "<|im_start|>"]


def _byte_level() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, initial_alphabet=alphabet, show_progress=False
    )
    tok.train_from_iterator(CORPUS * 3, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def _metaspace(byte_fallback: bool) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=SPECIALS, show_progress=False)
    tok.train_from_iterator(CORPUS * 3, trainer)
    if byte_fallback:  # add <0x00>..<0xFF> as ordinary tokens, as SentencePiece models have them
        model = json.loads(tok.to_str())["model"]
        vocab = dict(model["vocab"])
        vocab.update({f"<0x{b:02X}>": len(vocab) + b for b in range(256)})
        merges = [tuple(m) for m in model["merges"]]
        tok.model = models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True)
        parts = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        tok.decoder = decoders.Sequence([*parts, decoders.Strip(" ", 1, 0)])
    else:
        tok.decoder = decoders.Metaspace(prepend_scheme="first")
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


TOKENIZERS = {
    "byte_level": _byte_level(),
    "llama_sp": _metaspace(byte_fallback=True),
    "metaspace": _metaspace(byte_fallback=False),
}
BYTE_LEVEL = TOKENIZERS["byte_level"]
EXTRA_CHARS = "".join(CORPUS) + "👩‍🚀🧑🏿‍🤝‍🧑🏻𝄞\U0001f9ff\u200d\u0301 ▁\n\t"


def _stream(
    tok: Any, ids: list[int], chunks: list[int], stop: tuple[str, ...] = (), skip: bool = True
) -> tuple[IncrementalDetokenizer, list[str]]:
    det = IncrementalDetokenizer(tok, [1, 2, 3], stop, skip_special_tokens=skip)
    deltas, i = [], 0
    for n in chunks * (len(ids) + 1):
        if i >= len(ids):
            break
        deltas.append(det.append(ids[i : i + n]))
        i += n
    deltas.append(det.finish())
    return det, deltas


texts = st.text(
    alphabet=st.one_of(st.characters(codec="utf-8"), st.sampled_from(EXTRA_CHARS)), max_size=40
)
chunk_sizes = st.lists(st.integers(1, 5), min_size=1, max_size=8)


@pytest.mark.parametrize("name", TOKENIZERS)
@settings(max_examples=150, deadline=None)
@given(text=texts, chunks=chunk_sizes, skip=st.booleans())
def test_streamed_text_equals_full_decode(name: str, text: str, chunks: list[int], skip: bool):
    tok = TOKENIZERS[name]
    ids = tok.encode(text, add_special_tokens=False)
    for chunking in ([1], chunks):
        det, deltas = _stream(tok, ids, chunking, skip=skip)
        assert "".join(deltas) == det.text == tok.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("name", TOKENIZERS)
@settings(max_examples=150, deadline=None)
@given(data=st.data(), chunks=chunk_sizes, skip=st.booleans())
def test_random_token_ids_including_specials_and_broken_bytes(name, data, chunks, skip) -> None:
    tok = TOKENIZERS[name]
    ids = data.draw(st.lists(st.integers(0, len(tok) - 1), max_size=40))
    det, deltas = _stream(tok, ids, chunks, skip=skip)
    assert "".join(deltas) == det.text == tok.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("name", TOKENIZERS)
@settings(max_examples=150, deadline=None)
@given(data=st.data(), text=texts, chunks=chunk_sizes)
def test_stop_strings_cut_before_the_first_match(name: str, data, text: str, chunks) -> None:
    tok = TOKENIZERS[name]
    ids = tok.encode(text, add_special_tokens=False)
    full = tok.decode(ids, skip_special_tokens=True)
    slices = st.tuples(st.integers(0, len(full)), st.integers(1, 4))
    cut = [full[a : a + n] for a, n in data.draw(st.lists(slices, max_size=3))]
    stop = (*cut, *data.draw(st.lists(st.text(st.sampled_from(full or "x"), max_size=3))))
    det, deltas = _stream(tok, ids, chunks, tuple(stop))
    assert "".join(deltas) == det.text
    assert not any(s and s in det.text for s in stop)
    if det.stopped_on is None:
        assert det.text == full
    else:
        assert full[len(det.text) :].startswith(det.stopped_on)
        assert det.append(ids[:2]) == "" and det.finish() == ""


def test_windows_stay_short() -> None:
    class Counting:
        def __init__(self) -> None:
            self.longest = 0

        def decode(self, ids: list[int], **kwargs: Any) -> str:
            self.longest = max(self.longest, len(ids))
            return BYTE_LEVEL.decode(ids, **kwargs)

        def __getattr__(self, name: str) -> Any:
            return getattr(BYTE_LEVEL, name)

    counting = Counting()
    ids = BYTE_LEVEL.encode(" ".join(CORPUS) * 3)
    det, _ = _stream(counting, ids, [1])
    assert det.text == BYTE_LEVEL.decode(ids)
    assert len(ids) > 1000 and counting.longest <= 12  # a few characters, not the whole output


def test_incomplete_characters_are_held_back() -> None:
    ids = BYTE_LEVEL.encode("🎉👨‍👩‍👧‍👦日本")
    assert len(ids) > 8  # the characters really are split across tokens
    det = IncrementalDetokenizer(BYTE_LEVEL, [])
    deltas = [det.append([i]) for i in ids]
    assert deltas[0] == "" and all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == "🎉👨‍👩‍👧‍👦日本" and det.finish() == ""


def test_a_broken_character_at_the_end_is_flushed_by_finish() -> None:
    ids = BYTE_LEVEL.encode("ok 😀")
    det = IncrementalDetokenizer(BYTE_LEVEL, [])
    assert det.append(ids[:2]) == "ok"
    assert det.append(ids[2:-1]) == ""  # " " and the first bytes of the emoji wait
    assert det.finish() == BYTE_LEVEL.decode(ids[:-1])[2:] and det.text.endswith("\ufffd")


def test_sentencepiece_leading_spaces() -> None:
    tok = TOKENIZERS["llama_sp"]
    ids = tok.encode("Hello world, hello again", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids[1:2])[0].startswith("▁")
    det = IncrementalDetokenizer(tok, [])
    deltas = [det.append([i]) for i in ids]
    assert deltas[0] == "Hello" and all(d.startswith(" ") for d in deltas[1:])
    assert "".join(deltas) == "Hello world, hello again"


def test_byte_fallback_runs_are_held_until_they_end() -> None:
    tok = TOKENIZERS["llama_sp"]
    assert IncrementalDetokenizer(tok, [])._byte_fallback
    assert not IncrementalDetokenizer(TOKENIZERS["metaspace"], [])._byte_fallback
    assert not IncrementalDetokenizer(BYTE_LEVEL, [])._byte_fallback
    ids = tok.encode("ok 𝄞 go", add_special_tokens=False)  # 𝄞 is not in the vocabulary
    tokens = tok.convert_ids_to_tokens(ids)
    start = tokens.index("<0xF0>")
    assert tokens[start : start + 4] == ["<0xF0>", "<0x9D>", "<0x84>", "<0x9E>"]
    det = IncrementalDetokenizer(tok, [])
    deltas = [det.append([i]) for i in ids]
    assert deltas[start : start + 4] == ["", "", "", ""]
    assert "".join(deltas) == "ok 𝄞 go"
    # An invalid run decodes to one U+FFFD per byte, even across a skipped special token.
    ids = [tok.convert_tokens_to_ids(t) for t in ["▁a", "<0x41>", "<unk>", "<0x80>"]]
    det, deltas = _stream(tok, ids, [1])
    assert ids[0] != ids[2] and tok.decode(ids[:2]) == "aA"  # "▁a" is a real token
    assert det.text == tok.decode(ids, skip_special_tokens=True) == "a\ufffd\ufffd"


def test_special_tokens_are_skipped_or_kept() -> None:
    eos = BYTE_LEVEL.eos_token_id
    ids = [*BYTE_LEVEL.encode("Hello"), eos, *BYTE_LEVEL.encode(" world")]
    assert _stream(BYTE_LEVEL, ids, [1])[0].text == "Hello world"
    assert _stream(BYTE_LEVEL, ids, [1], skip=False)[0].text == "Hello<|endoftext|> world"


def _pieces(text: str) -> tuple[list[int], list[str]]:
    ids = BYTE_LEVEL.encode(text)
    pieces = [BYTE_LEVEL.decode([i]) for i in ids]
    assert "".join(pieces) == text
    return ids, pieces


def test_stop_inside_one_token_and_across_tokens() -> None:
    text = "Hi, say hello again"
    ids, pieces = _pieces(text)
    j = pieces.index("hello")
    before = "".join(pieces[:j])
    det, deltas = _stream(BYTE_LEVEL, ids, [1], ("ell",))
    assert (det.text, det.stopped_on) == (before + "h", "ell")
    assert "".join(deltas) == det.text
    across = pieces[j][-2:] + pieces[j + 1][:2]  # "lo a"
    det, _ = _stream(BYTE_LEVEL, ids, [1], (across,))
    assert (det.text, det.stopped_on) == (before + "hel", across)


def test_stop_at_the_very_start() -> None:
    ids, _ = _pieces("Hello world")
    det, deltas = _stream(BYTE_LEVEL, ids, [1], ("Hel",))
    assert det.text == "" and set(deltas) == {""} and det.stopped_on == "Hel"


def test_the_earliest_stop_wins() -> None:
    ids, _ = _pieces("The quick brown fox")
    stop = ("own", "quick brown fox", "fox")
    det, _ = _stream(BYTE_LEVEL, ids, [len(ids)], stop)  # both in one step: earliest start
    assert (det.text, det.stopped_on) == ("The ", "quick brown fox")
    det, _ = _stream(BYTE_LEVEL, ids, [1], stop)  # streamed: the first to complete
    assert (det.text, det.stopped_on) == ("The quick br", "own")


def test_no_match_releases_everything() -> None:
    ids, _ = _pieces("Hello world, hello again!")
    det, _ = _stream(BYTE_LEVEL, ids, [2], ("zebra", "again?"))
    assert det.text == "Hello world, hello again!" and det.stopped_on is None


def test_a_partial_match_is_held_then_released() -> None:
    ids, pieces = _pieces("Hello world, hello again")
    det = IncrementalDetokenizer(BYTE_LEVEL, [], ("world peace",))
    shown = []
    for i in ids:
        shown.append(det.append([i]))
    assert pieces[3:6] == ["wor", "ld", ","]
    assert shown[3:6] == ["", "", "world,"]  # "wor", "world" could start the stop string
    assert "".join(shown) == "Hello world, hello again" and det.finish() == ""
    det = IncrementalDetokenizer(BYTE_LEVEL, [], ("again!",))
    assert det.append(ids) == "Hello world, hello " and det.finish() == "again"


def test_min_tokens_holds_stop_strings_off_until_then():
    """A stop string whose text is complete within the first `min_tokens` tokens does not stop
    the output, nor is that text searched again; one completed after does (vLLM's rule)."""
    tok = _byte_level()
    ids = [t for w in ("Hello", " world", ",", " hello", " world") for t in tok.encode(w)]
    first = next(i + 1 for i in range(len(ids)) if "world" in tok.decode(ids[: i + 1]))
    stops = {}
    for min_tokens in (0, first, len(ids)):
        detok = IncrementalDetokenizer(tok, [], ("world",), min_tokens=min_tokens)
        for t in ids:
            detok.append([t])
            if detok.stopped_on:
                break
        stops[min_tokens] = (detok.stopped_on, detok.text + detok.finish())
    assert stops[0] == ("world", "Hello ")
    assert stops[first] == ("world", "Hello world, hello ")
    assert stops[len(ids)] == (None, "Hello world, hello world")

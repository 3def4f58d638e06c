"""The output-text fields, with vLLM's semantics: `skip_special_tokens`,
`spaces_between_special_tokens` and `include_stop_str_in_output`.

On the bundled SmolLM2-135M-Instruct (fp32, CPU), whose greedy answers run on past EOS into
`<|im_end|>` and `<|im_start|>` (two of them in a row), each text is checked against
transformers' `decode` of the sample's own tokens; then a real `pagedctl generate` job takes each
field on a line and refuses a bad value on its line alone.
"""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from pagedctl import bundled_model
from pagedctl.engine import BeamSearchParams, SamplingParams
from pagedctl.engine.detokenizer import IncrementalDetokenizer, decode_text
from pagedctl.engine.llm import LLM
from tests.job_utils import (
    FAST,
    by_id,
    check_ok_line,
    completion_text,
    read_jsonl,
    run,
    write_jsonl,
)

CHATS = ["What is the capital of France?", "Say hi.", "Name a colour."]
NEVER = "\x00never"  # a stop string no output holds: the text is made incrementally


@pytest.fixture(scope="module")
def smol() -> LLM:
    return LLM(bundled_model(), device="cpu", dtype="float32", block_size=16, quantization="none")


def _chat(llm: LLM, **params) -> list:
    """One output per chat of CHATS, greedy unless `params` say otherwise."""
    sp = SamplingParams(**{"temperature": 0.0, "max_tokens": 40, **params})
    outs = llm.chat([[{"role": "user", "content": c}] for c in CHATS], sp)
    assert all(o.ok for o in outs), [o.error for o in outs]
    return [o.outputs[0] for o in outs]


@pytest.fixture(scope="module")
def past_eos(smol: LLM) -> list:
    """The greedy answers run 40 tokens on past EOS: special tokens amid the text."""
    outs = _chat(smol, ignore_eos=True)
    special = set(smol.tokenizer.all_special_ids)
    assert all(special & set(o.token_ids) for o in outs)
    pairs = [p for o in outs for p in zip(o.token_ids, o.token_ids[1:], strict=False)]
    assert any(a in special and b in special for a, b in pairs), "no two special tokens in a row"
    return outs


def _decode(tok, ids: list[int], skip: bool) -> str:
    return tok.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("stop", [(), (NEVER,)], ids=["whole", "incremental"])
@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("spaces", [True, False])
def test_the_text_is_transformers_decode(smol, past_eos, skip, spaces, stop):
    outs = _chat(
        smol, ignore_eos=True, skip_special_tokens=skip, spaces_between_special_tokens=spaces,
        stop=stop,
    )  # fmt: skip
    tok = smol.tokenizer
    for out, ref in zip(outs, past_eos, strict=True):
        assert out.token_ids == ref.token_ids
        assert out.text == tok.decode(
            out.token_ids, skip_special_tokens=skip, spaces_between_special_tokens=spaces
        )
        assert ("<|im_end|>" in out.text) is not skip


def test_the_stop_token_text_only_with_include_stop_str_in_output(smol):
    """EOS (`<|im_end|>`) and a stop token of the answer's own: left out of the text unless
    include_stop_str_in_output keeps it; a special one shows only with skip_special_tokens
    false."""
    tok = smol.tokenizer
    for skip in (True, False):
        for include in (False, True):
            outs = _chat(smol, skip_special_tokens=skip, include_stop_str_in_output=include)
            for out in outs:
                assert out.finish_reason == "stop" and out.token_ids[-1] == tok.eos_token_id
                kept = out.token_ids if include else out.token_ids[:-1]
                assert out.text == _decode(tok, kept, skip)
                assert out.text.endswith("<|im_end|>") is (include and not skip)
    period = tok.convert_tokens_to_ids(".")
    for include in (False, True):
        (out, *_) = _chat(smol, stop_token_ids=[period], include_stop_str_in_output=include)
        assert out.stop_reason == period and out.token_ids[-1] == period
        assert out.text == "The capital of France is Paris" + "." * include


def _offsets(tok, ids: list[int], skip: bool) -> list[int]:
    """Where each token's text starts in the decoded text (and where the text ends)."""
    return [len(_decode(tok, ids[:k], skip)) for k in range(len(ids) + 1)]


def _stop_inside(text: str, offsets: list[int], across: bool) -> tuple[int, int]:
    """A stop string's (start, end) in `text` that starts inside a token's text and ends inside
    the same token's (or, `across`, the next one's), the string's first occurrence."""
    for k in range(len(offsets) - 2):
        a, b, c = offsets[k : k + 3]
        if b - a < 3 or (across and c - b < 2):
            continue
        start, end = a + 1, (b + 1 if across else b - 1)
        if text.find(text[start:end]) == start:
            return start, end
    raise AssertionError("no such stop string")


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("across", [False, True], ids=["in-a-token", "across-tokens"])
def test_include_stop_str_in_output_cuts_after_the_stop_string(smol, past_eos, skip, across):
    tok = smol.tokenizer
    ref = past_eos[0]
    text = _decode(tok, ref.token_ids, skip)
    start, end = _stop_inside(text, _offsets(tok, ref.token_ids, skip), across)
    stop = text[start:end]
    for include in (False, True):
        (out, *_) = _chat(
            smol, ignore_eos=True, stop=[stop], skip_special_tokens=skip,
            include_stop_str_in_output=include,
        )  # fmt: skip
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert out.token_ids == ref.token_ids[: len(out.token_ids)]
        assert out.text == text[: end if include else start]


def test_a_stop_string_across_special_tokens_matches_the_text_they_make(smol, past_eos):
    """A stop string spanning a special token: "Paris.<|im_end|>" is in the text that keeps
    special tokens, "Paris.\\n" in the one that drops them; each stops only the sample whose
    text holds it (vLLM matches the text as made)."""
    tok = smol.tokenizer
    ids = past_eos[0].token_ids
    for stop, skip in (("Paris.<|im_end|>", False), ("Paris.\n", True)):
        assert stop in _decode(tok, ids, skip) and stop not in _decode(tok, ids, not skip)
        for include in (False, True):
            (on, *_) = _chat(
                smol, ignore_eos=True, stop=[stop], skip_special_tokens=skip,
                include_stop_str_in_output=include,
            )  # fmt: skip
            assert on.stop_reason == stop
            assert on.text == "The capital of France is " + (stop if include else "")
        (off, *_) = _chat(smol, ignore_eos=True, stop=[stop], skip_special_tokens=not skip)
        assert off.finish_reason == "length" and off.text == _decode(tok, ids, not skip)


def test_include_stop_str_in_output_with_parallel_samples(smol):
    """n=6 seeded samples, the same tokens with and without the stop string in the text."""
    tok = smol.tokenizer
    stop = "e "
    runs = {}
    for include in (False, True):
        params = SamplingParams(
            n=6, temperature=1.0, seed=11, max_tokens=24, stop=[stop],
            include_stop_str_in_output=include,
        )  # fmt: skip
        (req,) = smol.generate(["The weather today is"], params)
        runs[include] = req.outputs
    stopped = 0
    for without, with_ in zip(runs[False], runs[True], strict=True):
        assert without.token_ids == with_.token_ids
        text = _decode(tok, with_.token_ids, True)
        if with_.stop_reason == stop:
            stopped += 1
            cut = text.index(stop)
            assert without.text == text[:cut] and with_.text == text[: cut + len(stop)]
        else:
            assert without.text == with_.text == text and stop not in text
    assert stopped >= 2


def test_beam_search_text_takes_the_special_token_fields(smol):
    tok = smol.tokenizer
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": CHATS[1]}], tokenize=False, add_generation_prompt=True
    )
    for skip in (True, False):
        for ignore_eos in (True, False):
            params = BeamSearchParams(
                beam_width=2, max_tokens=32, ignore_eos=ignore_eos, skip_special_tokens=skip
            )
            (req,) = smol.beam_search([prompt], params)
            for h in req.outputs:
                kept = h.token_ids[:-1] if h.finish_reason == "stop" else h.token_ids
                assert h.text == _decode(tok, kept, skip)
            if not ignore_eos:
                assert any(h.finish_reason == "stop" for h in req.outputs)
            else:
                assert any("<|im_" in _decode(tok, h.token_ids, False) for h in req.outputs)


def _wordpiece() -> PreTrainedTokenizerFast:
    """A WordPiece decoder, which puts a space between tokens, special ones included."""
    vocab = {w: i for i, w in enumerate(["[UNK]", "hello", "world", "##s", "[CLS]", "[SEP]"])}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]"
    )


def test_spaces_between_special_tokens_drops_the_decoders_space_between_two():
    """vLLM's fast-tokenizer rule: false joins special tokens in a row; a special token and
    the text beside it keep their space. transformers' fast decode ignores the option."""
    tok = _wordpiece()
    ids = [1, 3, 5, 5, 4, 2]  # hello ##s [SEP] [SEP] [CLS] world
    spaced = "hellos [SEP] [SEP] [CLS] world"
    assert tok.decode(ids, spaces_between_special_tokens=False) == spaced
    assert decode_text(tok, ids, skip_special_tokens=False) == spaced
    joined = "hellos [SEP][SEP][CLS] world"
    assert decode_text(tok, ids, False, spaces_between_special_tokens=False) == joined
    assert decode_text(tok, ids, True, spaces_between_special_tokens=False) == "hellos world"
    for chunk in (1, 2, 4):
        det = IncrementalDetokenizer(
            tok, [4], skip_special_tokens=False, spaces_between_special_tokens=False
        )
        deltas = [det.append(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
        assert "".join(deltas) + det.finish() == joined == det.text


def test_included_stop_string_deltas_are_never_taken_back():
    """Without include_stop_str_in_output a stop string's possible start is held back; with it
    nothing is, and the deltas end with the stop string."""
    tok = _wordpiece()
    ids = [1, 3, 5, 5, 4, 2]  # hello ##s [SEP] [SEP] [CLS] world
    det = IncrementalDetokenizer(tok, [], ("[SEP] [CLS]",), skip_special_tokens=False)
    assert [det.append([i]) for i in ids] == ["hello", "s", " ", "[SEP] ", "", ""]
    assert det.text == "hellos [SEP] " and det.stopped_on == "[SEP] [CLS]"
    det = IncrementalDetokenizer(tok, [], ("[SEP] [CLS]",), False, True, True)
    assert [det.append([i]) for i in ids] == ["hello", "s", " [SEP]", " [SEP]", " [CLS]", ""]
    assert det.text == "hellos [SEP] [SEP] [CLS]" and det.stopped_on == "[SEP] [CLS]"


# ---------------------------------------------------------------- a real job


CHAT = [{"role": "user", "content": CHATS[0]}]


@pytest.mark.slow
def test_a_job_takes_each_field_on_its_line_and_refuses_a_bad_value_alone(tmp_path):
    talk = {"messages": CHAT, "max_tokens": 24, "ignore_eos": True}
    rows = [
        {"custom_id": "plain", **talk},
        {"custom_id": "specials", **talk, "skip_special_tokens": False},
        {"custom_id": "joined", **talk, "skip_special_tokens": False,
         "spaces_between_special_tokens": False},
        {"custom_id": "cut", **talk, "stop": ["Paris"]},
        {"custom_id": "kept", **talk, "stop": ["Paris"], "include_stop_str_in_output": True},
        {"custom_id": "bad-skip", **talk, "skip_special_tokens": "no"},
        {"custom_id": "bad-include", **talk, "include_stop_str_in_output": 1},
        {"custom_id": "bad-spaces", **talk, "spaces_between_special_tokens": "false"},
    ]  # fmt: skip
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    res = run(src, *FAST)
    assert res.returncode == 3, res.stderr  # some lines failed, the others ran
    records = by_id(read_jsonl(tmp_path / "in.out.jsonl"))
    out = {cid: completion_text(check_ok_line(r)) for cid, r in records.items()}
    assert set(out) == {"plain", "specials", "joined", "cut", "kept"}, res.stderr
    errors = {e["custom_id"]: e["error"] for e in read_jsonl(tmp_path / "in.errors.jsonl")}
    assert {cid: e["code"] for cid, e in errors.items()} == {
        "bad-skip": "invalid_field", "bad-include": "invalid_field", "bad-spaces": "invalid_field",
    }  # fmt: skip
    assert "skip_special_tokens" in errors["bad-skip"]["message"]
    assert "<|im_end|>" in out["specials"] and "<|im_" not in out["plain"]
    bare = out["specials"]
    for special in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"):
        bare = bare.replace(special, "")
    assert bare == out["plain"] and out["joined"] == out["specials"]
    assert out["kept"] == out["cut"] + "Paris" == "The capital of France is Paris"

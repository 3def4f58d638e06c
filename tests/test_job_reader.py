"""The JSONL input reader: both line forms, every error code, line numbers, limits, streaming."""

from __future__ import annotations

import copy
import inspect
import itertools
import json
import sys
import tracemalloc
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedctl.engine import SamplingParams
from pagedctl.generate.reader import (
    ERROR_CODES,
    InputError,
    JobRequest,
    LineError,
    ReaderLimits,
    count_lines,
    read_requests,
)

LIMITS = ReaderLimits(
    max_tokens_limit=4096, max_n=8, default_max_tokens=100, models=frozenset({"m", "gpt-4o-mini"})
)
CHAT_URL, COMPLETION_URL = "/v1/chat/completions", "/v1/completions"
USER = [{"role": "user", "content": "hi"}]


def _write(tmp_path: Path, data: bytes | list) -> Path:
    if isinstance(data, list):
        data = b"".join(
            (x if isinstance(x, bytes) else json.dumps(x).encode()) + b"\n" for x in data
        )
    path = tmp_path / "in.jsonl"
    path.write_bytes(data)
    return path


def _read(tmp_path: Path, data: bytes | list, limits: ReaderLimits = LIMITS) -> list:
    return list(read_requests(_write(tmp_path, data), limits))


def _one(tmp_path: Path, line: Any, limits: ReaderLimits = LIMITS) -> JobRequest | LineError:
    (item,) = _read(tmp_path, [line], limits)
    return item


def _batch(url: str, body: dict, cid: str = "r1") -> dict:
    return {"custom_id": cid, "method": "POST", "url": url, "body": body}


# ---------------------------------------------------------------- valid lines


def test_openai_chat_with_every_sampling_field(tmp_path: Path) -> None:
    body = {
        "model": "gpt-4o-mini",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
        ],
        "max_completion_tokens": 12,
        "temperature": 0,
        "top_p": 0.9,
        "top_k": 40,
        "min_p": 0.05,
        "n": 3,
        "stop": ["\n\n", "END"],
        "seed": 7,
        "ignore_eos": True,
        "logprobs": True,
        "stop_token_ids": [2, 3],
    }
    assert _one(tmp_path, _batch(CHAT_URL, body)) == JobRequest(
        line_no=1,
        custom_id="r1",
        endpoint="chat",
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "a\nb"}],
        prompt=None,
        prompt_token_ids=None,
        sampling={
            "max_tokens": 12,
            "n": 3,
            "temperature": 0.0,
            "top_p": 0.9,
            "min_p": 0.05,
            "top_k": 40,
            "seed": 7,
            "stop": ["\n\n", "END"],
            "stop_token_ids": [2, 3],
            "ignore_eos": True,
            "logprobs": True,
            "strict_max_tokens": True,
        },
    )


def test_openai_completion_with_every_sampling_field(tmp_path: Path) -> None:
    body = {"prompt": "Once", "max_tokens": 5, "temperature": 1.5, "top_p": 1, "top_k": -1,
            "min_p": 0, "n": 8, "stop": "\n", "seed": -3, "ignore_eos": False,
            "logprobs": 1}  # fmt: skip
    req = _one(tmp_path, _batch(COMPLETION_URL, body))
    assert (req.endpoint, req.prompt, req.messages, req.prompt_token_ids) == (
        "completion", "Once", None, None)  # fmt: skip
    assert req.sampling == {"max_tokens": 5, "n": 8, "temperature": 1.5, "top_p": 1.0,
                            "min_p": 0.0, "top_k": 0, "seed": -3, "stop": ["\n"],
                            "ignore_eos": False, "logprobs": True, "top_logprobs": 1,
                            "strict_max_tokens": True}  # fmt: skip
    assert SamplingParams(**req.sampling).stop == ("\n",)


@pytest.mark.parametrize(
    ("prompt", "text", "ids"),
    [(["one"], "one", None), ([5, 6], None, [5, 6]), ([[5, 6]], None, [5, 6])],
)
def test_openai_completion_prompt_forms(tmp_path: Path, prompt, text, ids) -> None:
    req = _one(tmp_path, _batch(COMPLETION_URL, {"prompt": prompt}))
    assert (req.prompt, req.prompt_token_ids) == (text, ids)


def test_simple_forms_and_defaults(tmp_path: Path) -> None:
    lines = [
        {
            "custom_id": "c",
            "messages": USER,
            "temperature": 0.2,
            "max_tokens": 9,
            "logprobs": False,
        },
        {"id": 17, "prompt": "p", "top_k": 5, "n": 2, "logprobs": 0, "stop": [], "seed": 1},
        {"id": "t", "prompt_token_ids": [1, 2, 3], "min_p": 0.5, "top_p": 0.5, "ignore_eos": True},
        {"id": "d", "prompt": "p"},
    ]
    chat, text, ids, plain = _read(tmp_path, lines)
    assert (chat.endpoint, chat.messages, chat.sampling) == (
        "chat", USER, {"max_tokens": 9, "strict_max_tokens": True, "temperature": 0.2,
                       "logprobs": False})  # fmt: skip
    assert (text.custom_id, text.endpoint, text.prompt) == ("17", "completion", "p")
    assert text.sampling == {"max_tokens": 100, "n": 2, "top_k": 5, "seed": 1, "stop": [],
                             "logprobs": True}  # fmt: skip
    assert (ids.endpoint, ids.prompt_token_ids, ids.prompt) == ("completion", [1, 2, 3], None)
    assert ids.sampling == {"max_tokens": 100, "top_p": 0.5, "min_p": 0.5, "ignore_eos": True}
    assert plain.sampling == {"max_tokens": 100}  # only what the line gave, plus max_tokens
    assert [r.line_no for r in (chat, text, ids, plain)] == [1, 2, 3, 4]


def test_default_max_tokens_is_capped_by_the_limit(tmp_path: Path) -> None:
    limits = ReaderLimits(max_tokens_limit=64, default_max_tokens=256)
    assert _one(tmp_path, {"id": "a", "prompt": "p"}, limits).sampling == {"max_tokens": 64}


def test_harmless_fields_are_accepted(tmp_path: Path) -> None:
    body = {"messages": USER, "model": "m", "user": "u", "metadata": {"k": "v"}, "store": False,
            "stream": False, "presence_penalty": 0, "priority": 3, "service_tier": "auto",
            "frequency_penalty": 0.0, "logit_bias": {}, "tools": [], "tool_choice": "none",
            "response_format": {"type": "text"}, "top_logprobs": 0, "max_tokens": 4,
            "max_completion_tokens": 4, "n": 2, "best_of": 2, "echo": False,
            "length_penalty": 1.0, "chat_template_kwargs": {}, "cache_salt": "s"}  # fmt: skip
    req = _one(tmp_path, _batch(CHAT_URL, body))
    assert req.sampling == {"max_tokens": 4, "strict_max_tokens": True, "n": 2, "cache_salt": "s",
                            "presence_penalty": 0.0, "frequency_penalty": 0.0, "logit_bias": {},
                            "top_logprobs": 0}  # fmt: skip
    assert SamplingParams(**req.sampling).cache_salt == "s"
    assert "model" not in asdict(req)


def test_ids_ints_and_agreeing_aliases(tmp_path: Path) -> None:
    items = _read(tmp_path, [{"custom_id": "x", "id": "x", "prompt": "p"},
                             {"custom_id": 5, "id": "5", "prompt": "p"}])  # fmt: skip
    assert [i.custom_id for i in items] == ["x", "5"]


# ---------------------------------------------------------------- errors

MSG = [{"role": "user", "content": "x"}]
# fmt: off
ERROR_CASES: list[tuple[str, bytes | dict, str | None]] = [
    ("invalid_utf8", b'{"id": "a", "prompt": "\xff"}', "a"),
    ("invalid_utf8", b'{"id": "a\xff", "prompt": "p"}', None),
    ("invalid_json", b'{"id": "a", "prompt": ', None),
    ("invalid_json", b'{"id": "a", "prompt": "p", "temperature": NaN}', "a"),
    ("invalid_json", b"[" * 100_000 + b"]" * 100_000, None),
    ("not_an_object", b'["a"]', None),
    ("not_an_object", b"42", None),
    ("missing_custom_id", {"prompt": "p"}, None),
    ("missing_custom_id", {"custom_id": "", "prompt": "p"}, None),
    ("missing_custom_id", {"method": "POST", "url": CHAT_URL, "body": {"messages": MSG}}, None),
    ("unknown_method", {"custom_id": "a", "method": "GET", "url": CHAT_URL, "body": {}}, "a"),
    ("unknown_method", {"custom_id": "a", "url": CHAT_URL, "body": {"messages": MSG}}, "a"),
    ("unknown_url", _batch("/v1/embeddings", {"input": "x"}, "a"), "a"),
    ("missing_prompt", {"id": "a", "max_tokens": 3}, "a"),
    ("missing_prompt", _batch(CHAT_URL, {"prompt": None}, "a"), "a"),
    ("ambiguous_prompt", {"id": "a", "prompt": "p", "messages": MSG}, "a"),
    ("ambiguous_prompt", {"id": "a", "prompt": "p", "prompt_token_ids": [1]}, "a"),
    ("invalid_messages", {"id": "a", "messages": []}, "a"),
    ("invalid_messages", {"id": "a", "messages": [{"role": "robot", "content": "x"}]}, "a"),
    ("invalid_messages", {"id": "a", "messages": [{"role": "user", "content": 5}]}, "a"),
    ("invalid_messages", {"id": "a", "messages": [{"role": "user", "content": [{"t": 1}]}]}, "a"),
    ("invalid_messages", {"id": "a", "messages": ["hi"]}, "a"),
    ("invalid_prompt", {"id": "a", "prompt": ""}, "a"),
    ("invalid_prompt", {"id": "a", "prompt": 3}, "a"),
    ("invalid_prompt", {"id": "a", "prompt": "bad \ud800"}, "a"),
    ("invalid_prompt", {"id": "a", "prompt_token_ids": [1, -2]}, "a"),
    ("invalid_prompt", {"id": "a", "prompt_token_ids": [1, True]}, "a"),
    ("invalid_prompt", {"id": "a", "prompt_token_ids": []}, "a"),
    ("invalid_field", {"id": "a", "prompt": "p", "temperature": -0.1}, "a"),
    ("invalid_field", {"id": "a", "prompt": "p", "temperature": "hot"}, "a"),
    ("invalid_field", b'{"id": "a", "prompt": "p", "temperature": 1e400}', "a"),
    ("invalid_field", {"id": "a", "prompt": "p", "top_p": 0}, "a"),
    ("invalid_field", {"id": "a", "prompt": "p", "top_k": -2}, "a"),
    ("invalid_field", {"id": "a", "prompt": "p", "top_k": 2.5}, "a"),
    ("invalid_field", {"id": "a", "prompt": "p", "min_p": 1.5}, "a"),
    ("invalid_field", {"id": "a", "prompt": "p", "seed": "x"}, "a"),
    ("invalid_field", {"id": "a", "prompt": "p", "seed": 2**64}, "a"),
    ("invalid_field", {"id": "a", "prompt": "p", "ignore_eos": 1}, "a"),
    ("invalid_field", {"id": "a", "prompt": "p", "stop": ["a"] * 17}, "a"),
    ("invalid_field", {"id": "a", "prompt": "p", "stop": [""]}, "a"),
    ("invalid_field", {"id": "a", "prompt": "p", "stop": 5}, "a"),
    ("invalid_field", {"id": "a", "prompt": "p", "stop_token_ids": [-1]}, "a"),
    ("invalid_field", {"id": "a", "prompt": "p", "max_tokens": True}, "a"),
    ("invalid_field", {"id": "a", "prompt": "p", "max_tokens": 5.5}, "a"),
    ("invalid_field", {"id": "a", "messages": MSG, "max_tokens": 5,
                       "max_completion_tokens": 6}, "a"),
    ("invalid_field", {"id": "a", "prompt": "p", "n": "2"}, "a"),
    ("invalid_field", {"id": "a", "prompt": "p", "n": 2, "best_of": 1}, "a"),
    ("invalid_field", {"id": "a", "messages": MSG, "logprobs": 1}, "a"),
    ("invalid_field", _batch(COMPLETION_URL, {"prompt": "p", "logprobs": -1}, "a"), "a"),
    ("invalid_field", {"custom_id": "a", "id": "b", "prompt": "p"}, None),
    ("invalid_field", {"custom_id": 1.5, "prompt": "p"}, None),
    ("invalid_field", {"custom_id": True, "prompt": "p"}, None),
    ("invalid_field", _batch(CHAT_URL, None, "a"), "a"),
    ("invalid_field", _batch(CHAT_URL, {"prompt": "p"}, "a"), "a"),
    ("invalid_field", _batch(COMPLETION_URL, {"prompt_token_ids": [1]}, "a"), "a"),
    ("max_tokens_out_of_range", {"id": "a", "prompt": "p", "max_tokens": 0}, "a"),
    ("max_tokens_out_of_range", {"id": "a", "prompt": "p", "max_tokens": 4097}, "a"),
    ("max_tokens_out_of_range", {"id": "a", "messages": MSG, "max_completion_tokens": -1}, "a"),
    ("duplicate_key", b'{"id": "a", "prompt": "p", "temperature": 0, "temperature": 2}', "a"),
    ("duplicate_key", b'{"id": "a", "id": "b", "prompt": "p"}', None),
    ("duplicate_key", b'{"id": "a", "messages": [{"role": "user", "role": "system",'
                      b' "content": "x"}]}', "a"),
    ("unknown_field", {"id": "a", "prompt": "p", "temprature": 0}, "a"),
    ("unknown_field", {"id": "a", "prompt": "p", "max_token": 5}, "a"),
    ("unknown_field", {"id": "a", "prompt": "p", "something_new": [1]}, "a"),
    ("unknown_field", _batch(CHAT_URL, {"messages": MSG, "input": "x"}, "a"), "a"),
    ("unknown_field", {**_batch(CHAT_URL, {"messages": MSG}, "a"), "max_tokens": 5}, "a"),
    ("unknown_field", {**_batch(CHAT_URL, {"messages": MSG}, "a"), "extra": 1}, "a"),
    ("model_not_found", _batch(CHAT_URL, {"messages": MSG, "model": "gpt-4o"}, "a"), "a"),
    ("invalid_field", _batch(CHAT_URL, {"messages": MSG, "model": 4}, "a"), "a"),
    ("invalid_field", {"id": "a", "prompt": "p", "cache_salt": ""}, "a"),
    ("invalid_field", {"id": "a", "prompt": "p", "cache_salt": 5}, "a"),
    ("n_out_of_range", {"id": "a", "prompt": "p", "n": 0}, "a"),
    ("n_out_of_range", {"id": "a", "prompt": "p", "n": 9}, "a"),
    ("invalid_field", {"id": "a", "prompt": "p", "presence_penalty": 2.5}, "a"),
    ("invalid_field", {"id": "a", "prompt": "p", "frequency_penalty": -3}, "a"),
    ("invalid_field", {"id": "a", "prompt": "p", "repetition_penalty": 0}, "a"),
    ("invalid_field", {"id": "a", "prompt": "p", "logit_bias": {"x5": 10}}, "a"),
    ("invalid_field", {"id": "a", "prompt": "p", "logit_bias": {"5": "10"}}, "a"),
    ("invalid_field", {"id": "a", "prompt": "p", "allowed_token_ids": []}, "a"),
    ("invalid_field", {"id": "a", "prompt": "p", "min_tokens": 200}, "a"),
    ("invalid_field", {"id": "a", "prompt": "p", "prompt_logprobs": 21}, "a"),
    ("invalid_field", {"id": "a", "prompt": "p", "logprobs_mode": "softmax"}, "a"),
    ("unsupported_field", _batch(CHAT_URL, {"messages": MSG, "tools": [{}]}, "a"), "a"),
    ("unsupported_field", _batch(CHAT_URL, {"messages": MSG,
                                            "response_format": {"type": "json_object"}}, "a"), "a"),
    ("unsupported_field", _batch(CHAT_URL, {"messages": MSG, "stream": True}, "a"), "a"),
    ("invalid_field", _batch(CHAT_URL, {"messages": MSG, "top_logprobs": 2}, "a"), "a"),
    ("invalid_field", _batch(CHAT_URL, {"messages": MSG, "logprobs": True,
                                        "top_logprobs": 21}, "a"), "a"),
    ("unsupported_field", _batch(CHAT_URL, {"messages": MSG, "echo": True}, "a"), "a"),
    ("unsupported_field", _batch(COMPLETION_URL, {"prompt": "p", "top_logprobs": 2}, "a"), "a"),
    ("unsupported_field", _batch(CHAT_URL, {"messages": MSG, "stream_options": {}}, "a"), "a"),
    ("unsupported_field", {"id": "a", "prompt": "p", "length_penalty": 0.5}, "a"),
    ("unsupported_field", {"id": "a", "prompt": "p", "max_new_tokens": 5}, "a"),
    ("unsupported_field", {"id": "a", "prompt": "p", "stop_sequences": ["x"]}, "a"),
    ("unsupported_field", {"id": "a", "prompt": "p", "do_sample": False}, "a"),
    ("invalid_field", _batch(COMPLETION_URL, {"prompt": "p", "chat_template_kwargs": {
        "enable_thinking": False}}, "a"), "a"),
    ("unsupported_field", _batch(COMPLETION_URL, {"prompt": ["a", "b"]}, "a"), "a"),
    ("invalid_field", _batch(COMPLETION_URL, {"prompt": "p", "echo": 1}, "a"), "a"),
    ("unsupported_field", _batch(COMPLETION_URL, {"prompt": "p", "best_of": 3}, "a"), "a"),
    ("invalid_field", _batch(COMPLETION_URL, {"prompt": "p", "logprobs": 21}, "a"), "a"),
    ("unsupported_field", {"id": "a", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, "a"),
    ("unsupported_field", {"id": "a", "messages": [
        {"role": "assistant", "content": "", "tool_calls": [{"id": "t"}]}]}, "a"),
]
# fmt: on


@pytest.mark.parametrize(("code", "line", "custom_id"), ERROR_CASES)
def test_error_codes(tmp_path: Path, code: str, line: bytes | dict, custom_id: str | None) -> None:
    err = _one(tmp_path, line)
    assert isinstance(err, LineError), err
    assert (err.line_no, err.code, err.custom_id) == (1, code, custom_id), err.message
    assert err.message and len(err.message) < 200


def test_every_error_code_is_exercised() -> None:
    assert {code for code, _, _ in ERROR_CASES} | {"duplicate_custom_id", "line_too_long"} == set(
        ERROR_CODES
    )


def test_messages_say_what_is_allowed(tmp_path: Path) -> None:
    got = _read(tmp_path, [
        {"id": "a", "prompt": "p", "max_tokens": 0},
        {"id": "b", "prompt": "p", "n": 20},
        _batch("/v1/embeddings", {}, "c"),
        {"id": "d", "prompt": "p", "temperature": "x" * 500},
        {"id": "e", "prompt": "p", "presence_penalty": 3},
        {"id": "f", "prompt": "p", "tools": [{}]},
    ])  # fmt: skip
    assert [e.message for e in got] == [
        "max_tokens must be an integer in 1..4096, got 0",
        "n must be an integer in 1..8, got 20",
        'url must be one of /v1/chat/completions, /v1/completions; got "/v1/embeddings"',
        'temperature must be a number >= 0, got "' + "x" * 36 + "...",
        "presence_penalty must be a number in [-2, 2], got 3",
        "tools=a list of 1 is not supported; remove it or set it to []",
    ]


def test_a_broken_line_whose_id_reads_owns_it(tmp_path: Path) -> None:
    lines = [
        b'{"id": "a", "prompt": "caf\xe9"}',
        b'{"id": "b", "top_k": 1, "top_k": 2}',
        {"id": "a", "prompt": "p"},
        {"id": "b", "prompt": "p"},
        {"id": "c", "prompt": "p"},
    ]
    got = [(getattr(i, "code", "ok"), i.custom_id) for i in _read(tmp_path, lines)]
    assert got == [("invalid_utf8", "a"), ("duplicate_key", "b"), ("duplicate_custom_id", "a"),
                   ("duplicate_custom_id", "b"), ("ok", "c")]  # fmt: skip


def test_duplicate_custom_id_first_line_wins_even_when_it_failed(tmp_path: Path) -> None:
    lines = [
        {"custom_id": "a", "prompt": "first"},
        {"custom_id": "a", "prompt": "second"},
        {"custom_id": "b", "prompt": "p", "n": 0},  # an error, but it owns "b"
        {"id": "b", "prompt": "p"},
        _batch(CHAT_URL, {"messages": USER}, "a"),
        {"id": 7, "prompt": "p"},
        {"id": "7", "prompt": "p"},
    ]
    got = [(i.line_no, getattr(i, "code", "ok"), i.custom_id) for i in _read(tmp_path, lines)]
    assert got == [(1, "ok", "a"), (2, "duplicate_custom_id", "a"), (3, "n_out_of_range", "b"),
                   (4, "duplicate_custom_id", "b"), (5, "duplicate_custom_id", "a"),
                   (6, "ok", "7"), (7, "duplicate_custom_id", "7")]  # fmt: skip
    assert _read(tmp_path, lines)[1].message == (
        'custom_id "a" is already used by an earlier line; make it unique'
    )


# ---------------------------------------------------------------- lines, limits, streaming


def _ok(cid: str) -> bytes:
    return json.dumps({"id": cid, "prompt": "p"}).encode()


def test_line_numbers_across_empty_lines_crlf_and_bom(tmp_path: Path) -> None:
    data = b"\xef\xbb\xbf" + _ok("a") + b"\r\n\r\n   \t \n\n" + _ok("b") + b"\r\n[]\n" + _ok("c")
    got = [(i.line_no, i.custom_id) for i in _read(tmp_path, data)]
    assert got == [(1, "a"), (5, "b"), (6, None), (7, "c")]
    assert count_lines(tmp_path / "in.jsonl") == 7


def test_bom_only_tolerated_on_line_one(tmp_path: Path) -> None:
    got = _read(tmp_path, _ok("a") + b"\n\xef\xbb\xbf" + _ok("b") + b"\n")
    assert [getattr(i, "code", "ok") for i in got] == ["ok", "invalid_json"]


def test_over_long_line_is_skipped_in_bounded_memory(tmp_path: Path) -> None:
    limits = ReaderLimits(max_line_bytes=1024)
    big = b'{"id": "big", "prompt": "' + b"x" * 5_000_000 + b'"}'
    path = _write(tmp_path, _ok("a") + b"\n" + big + b"\r\n\n" + _ok("b") + b"\n" + big)
    tracemalloc.start()
    try:
        got = list(read_requests(path, limits))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [(i.line_no, getattr(i, "code", "ok")) for i in got] == [
        (1, "ok"), (2, "line_too_long"), (4, "ok"), (5, "line_too_long")]  # fmt: skip
    assert got[1].custom_id is None and "1024 bytes" in got[1].message
    assert peak < 512 * 1024, peak


@pytest.mark.parametrize("ending", [b"\n", b"\r\n", b""])
def test_line_size_limit_is_exact(tmp_path: Path, ending: bytes) -> None:
    line = _ok("a")
    for limit, ok in ((len(line), True), (len(line) - 1, False)):
        (item,) = _read(tmp_path, line + ending, ReaderLimits(max_line_bytes=limit))
        assert isinstance(item, JobRequest) == ok


@pytest.mark.parametrize(
    ("data", "lines"),
    [(b"", 0), (b"\n", 1), (b"a", 1), (b"a\n", 1), (b"a\nb", 2), (b"a\r\n\r\nb\r\n", 3)],
)
def test_count_lines(tmp_path: Path, data: bytes, lines: int) -> None:
    assert count_lines(_write(tmp_path, data)) == lines


def test_count_lines_across_chunks(tmp_path: Path) -> None:
    path = _write(tmp_path, b"x" * (3 << 20) + b"\n" * 5 + b"y" * (1 << 20))
    assert count_lines(path) == 6


def test_reading_200k_lines_is_lazy_and_bounded(tmp_path: Path) -> None:
    n = 200_000
    line = '{"custom_id": "r%d", "prompt": "tell me about number %d", "max_tokens": 8}\n'
    path = tmp_path / "big.jsonl"
    with open(path, "w") as f:
        for start in range(0, n, 10_000):
            f.write("".join(line % (i, i) for i in range(start, start + 10_000)))
    assert path.stat().st_size > 12_000_000
    items = read_requests(path, LIMITS)
    assert inspect.isgenerator(items)
    tracemalloc.start()
    try:
        head = list(itertools.islice(items, 1000))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert head[-1].line_no == 1000 and peak < 1 << 20, peak  # the file is not read up front
    count, last = 1000, None
    for last in items:  # noqa: B007
        count += 1
    assert (count, last.line_no, last.custom_id) == (n, n, f"r{n - 1}")
    assert count_lines(path) == n


def test_memory_while_draining_is_only_the_ids_seen(tmp_path: Path) -> None:
    n = 20_000
    path = _write(tmp_path, [{"custom_id": f"id{i}", "messages": USER, "n": 2} for i in range(n)])
    ids = {f"id{i}" for i in range(n)}
    ids_bytes = sys.getsizeof(ids) + sum(sys.getsizeof(i) for i in ids)
    tracemalloc.start()
    try:
        count = sum(1 for _ in read_requests(path, LIMITS))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert count == n
    assert peak < ids_bytes + (1 << 20), (peak, ids_bytes)  # holding requests would be ~10x


def test_limits_are_validated() -> None:
    with pytest.raises(ValueError, match="max_n must be a positive integer"):
        ReaderLimits(max_n=0)


# ---------------------------------------------------------------- fuzz

VALID = [
    _batch(CHAT_URL, {"messages": USER, "max_tokens": 5, "temperature": 0.5, "n": 2}),
    _batch(COMPLETION_URL, {"prompt": "p", "logprobs": 1, "stop": ["x"], "seed": 3}),
    {"custom_id": "s", "prompt_token_ids": [1, 2], "top_k": 3, "top_p": 0.5},
    {"id": 4, "messages": [{"role": "user", "content": [{"type": "text", "text": "t"}]}]},
]
KEYS = ["custom_id", "id", "method", "url", "body", "prompt", "messages", "prompt_token_ids",
        "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "n",
        "stop", "seed", "ignore_eos", "logprobs", "best_of", "stream", "presence_penalty",
        "stop_token_ids", "role", "content"]  # fmt: skip
WORDS = ["POST", CHAT_URL, COMPLETION_URL, "user", "text", "\ud800", "s"]
SCALARS = (st.none() | st.booleans() | st.integers(-5, 40) | st.integers()
           | st.floats(allow_nan=False) | st.text(max_size=6) | st.sampled_from(WORDS))  # fmt: skip
JSON = st.recursive(
    SCALARS,
    lambda kids: (
        st.lists(kids, max_size=3) | st.dictionaries(st.sampled_from(KEYS), kids, max_size=3)
    ),
    max_leaves=6,
)
DELETE = object()


@st.composite
def _mutated(draw: st.DrawFn) -> bytes:
    obj = copy.deepcopy(draw(st.sampled_from(VALID)))
    for _ in range(draw(st.integers(0, 3))):
        target = obj["body"] if isinstance(obj.get("body"), dict) and draw(st.booleans()) else obj
        key, value = draw(st.sampled_from(KEYS)), draw(JSON | st.just(DELETE))
        if value is DELETE:
            target.pop(key, None)
        else:
            target[key] = value
    return json.dumps(obj).encode()


LINE = st.one_of(
    st.binary(max_size=40).map(lambda b: b.replace(b"\n", b"")),
    JSON.map(lambda v: json.dumps(v).encode()),
    _mutated(),
    st.sampled_from([b"", b"  ", b"\r", b"\xef\xbb\xbf", b"\xef\xbb\xbf{}"]),
)


def _expected_line_numbers(data: bytes, max_bytes: int) -> list[int]:
    pieces = data.split(b"\n")
    if pieces[-1] == b"":
        pieces.pop()
    out = []
    for no, piece in enumerate(pieces, 1):
        line = piece.removesuffix(b"\r")
        too_long = len(line) > max_bytes
        if too_long or (line.removeprefix(b"\xef\xbb\xbf") if no == 1 else line).strip():
            out.append(no)
    return out


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(lines=st.lists(LINE, max_size=12), endings=st.lists(st.sampled_from([b"\n", b"\r\n"])),
       final=st.booleans())  # fmt: skip
def test_fuzz_one_item_per_non_empty_line(tmp_path: Path, lines, endings, final) -> None:
    ends = itertools.cycle(endings or [b"\n"])
    data = b"".join(line + next(ends) for line in lines)
    data = data if final or not data else data.rstrip(b"\r\n")
    limits = ReaderLimits(max_line_bytes=120, max_tokens_limit=30, max_n=3)
    try:
        items = list(read_requests(_write(tmp_path, data), limits))
    except InputError:  # random bytes that begin like a compressed file or UTF-16 text
        assert data[:1] in (b"\x1f", b"B", b"\xfd", b"(", b"P", b"\xff", b"\xfe", b"\x00")
        return
    assert [i.line_no for i in items] == _expected_line_numbers(data, 120)
    assert count_lines(tmp_path / "in.jsonl") == (data.count(b"\n") + (data[-1:] not in b"\n"))
    ids = [i.custom_id for i in items if getattr(i, "code", "") != "duplicate_custom_id"]
    ids = [i for i in ids if i is not None]
    assert len(ids) == len(set(ids))  # one record per id, besides the duplicates' errors
    for item in items:
        if isinstance(item, LineError):
            assert item.code in ERROR_CODES and item.message
            continue
        SamplingParams(**item.sampling)
        assert 1 <= item.sampling["max_tokens"] <= 30 and item.endpoint in ("chat", "completion")
        given_ = [item.messages, item.prompt, item.prompt_token_ids]
        assert sum(g is not None for g in given_) == 1
        json.dumps(asdict(item), ensure_ascii=False).encode()  # writable as UTF-8


# ---------------------------------------------------------------- fields, models, file kinds


def test_unknown_fields_name_the_field_and_the_fix(tmp_path: Path) -> None:
    got = _read(tmp_path, [
        {"id": "a", "prompt": "p", "temprature": 0},
        {**_batch(CHAT_URL, {"messages": MSG}, "b"), "max_tokens": 5},
        {"id": "c", "prompt": "p", "max_new_tokens": 5},
        b'{"id": "d", "prompt": "p", "top_p": 0.5, "top_p": 1}',
        _batch(CHAT_URL, {"messages": MSG, "model": "gpt-4o"}, "e"),
    ])  # fmt: skip
    assert [e.message for e in got] == [
        'unknown field "temprature" in the line; did you mean "temperature"?',
        '"max_tokens" belongs inside body, not beside it',
        '"max_new_tokens" is not an OpenAI field; use max_tokens',
        'key "top_p" appears twice in one object; give it once',
        'model "gpt-4o" is not served by this job (it serves "gpt-4o-mini", "m"); fix the line, '
        "or run with --accept-any-model",
    ]


def test_any_model_when_no_names_are_given(tmp_path: Path) -> None:
    line = _batch(CHAT_URL, {"messages": MSG, "model": "anything"})
    assert isinstance(_one(tmp_path, line, ReaderLimits()), JobRequest)


def test_a_given_max_tokens_is_strict_and_the_default_a_cap(tmp_path: Path) -> None:
    given, default = _read(tmp_path, [{"id": "a", "prompt": "p", "max_tokens": 7},
                                      {"id": "b", "prompt": "p"}])  # fmt: skip
    assert SamplingParams(**given.sampling).strict_max_tokens
    assert not SamplingParams(**default.sampling).strict_max_tokens


@pytest.mark.parametrize("kind", ["gzip", "bz2", "lzma"])
def test_compressed_input_is_read_by_its_first_bytes(tmp_path: Path, kind: str) -> None:
    module = __import__(kind)
    data = b"".join(json.dumps({"id": str(i), "prompt": "p"}).encode() + b"\n" for i in range(5))
    path = tmp_path / "in.jsonl"  # the name does not say: the bytes do
    path.write_bytes(module.compress(data))
    assert [r.custom_id for r in read_requests(path)] == ["0", "1", "2", "3", "4"]
    assert count_lines(path) == 5


def test_a_damaged_compressed_input_is_an_input_error(tmp_path: Path) -> None:
    import gzip

    lines = [json.dumps({"id": str(i), "prompt": "p" * 50}).encode() for i in range(2000)]
    path = tmp_path / "in.jsonl.gz"
    path.write_bytes(gzip.compress(b"\n".join(lines))[:3000])  # cut: the tail is missing
    with pytest.raises(InputError, match="damaged"):
        list(read_requests(path))


@pytest.mark.parametrize(
    ("head", "why"),
    [(b"\x28\xb5\x2f\xfd\x00", "zstd"), (b"PK\x03\x04", "zip"),
     ('{"id": "a"}'.encode("utf-16"), "UTF-16"), (b"PAR1\x00", "Parquet")],
)  # fmt: skip
def test_files_that_are_not_jsonl_are_refused_whole(tmp_path: Path, head: bytes, why: str):
    path = tmp_path / "in.jsonl"
    path.write_bytes(head + b"\n" * 3)
    with pytest.raises(InputError, match=why):
        list(read_requests(path))


def test_the_docs_list_every_field_and_code() -> None:
    from pagedctl.generate.fields import FIELDS, OTHER_NAMES, UNSUPPORTED
    from pagedctl.generate.reader import ENGINE_ERROR_CODES

    docs = (Path(__file__).resolve().parents[1] / "docs" / "jobs.md").read_text()
    for name in [*FIELDS, *UNSUPPORTED, *OTHER_NAMES, *ERROR_CODES, *ENGINE_ERROR_CODES]:
        assert f"`{name}`" in docs, name


@pytest.mark.parametrize(
    "raw",
    [
        b'{"id": "a", "prompt": "p" "max_tokens": 3}',  # a comma missing: its position
        b"[" * 100_000 + b"]" * 100_000,  # nesting too deep: a long message of its own
        b'{"id": "a", "prompt": "p", "seed": ' + b"7" * 5000 + b"}",  # Python's digit limit
        b'{"id": "a", "prompt": "' + b"x" * 10_000 + b'", }',  # a long line, the error at its end
    ],
    ids=["position", "nesting", "digits", "long-line"],
)
def test_an_invalid_json_message_is_the_parsers_whole_message(tmp_path: Path, raw: bytes):
    try:
        json.loads(raw.decode())
    except (ValueError, RecursionError) as e:
        expected = str(e)
    err = _one(tmp_path, raw)
    assert err.code == "invalid_json"
    assert err.message == f"invalid JSON: {expected}"
    if raw.startswith(b'{"id": "a", "prompt": "p" '):
        assert "line 1 column 27 (char 26)" in err.message


def test_integer_fields_take_integral_floats_as_openai_does(tmp_path: Path) -> None:
    body = {"prompt": "p", "max_tokens": 4.0, "n": 2.0, "best_of": 2.0, "top_k": 5.0}
    req = _one(tmp_path, _batch(COMPLETION_URL, {**body, "seed": 3.0, "logprobs": 1.0}))
    s = req.sampling
    assert (s["max_tokens"], s["n"], s["top_k"], s["seed"], s["logprobs"]) == (4, 2, 5, 3, True)
    assert all(type(s[k]) is int for k in ("max_tokens", "n", "top_k", "seed"))
    alias = _one(tmp_path, {"id": "a", "prompt": "p", "max_completion_tokens": 7.0})
    assert alias.sampling["max_tokens"] == 7 and type(alias.sampling["max_tokens"]) is int


@pytest.mark.parametrize("key", ["max_tokens", "max_completion_tokens", "n", "top_k", "seed"])
def test_an_integer_field_with_a_fractional_part_is_refused_saying_so(tmp_path, key) -> None:
    err = _one(tmp_path, {"id": "a", "prompt": "p", key: 4.5})
    assert err.code == "invalid_field"
    assert err.message == f"{key} must be an integer, got 4.5, which has a fractional part"


def test_chat_logprobs_stays_true_or_false(tmp_path: Path) -> None:
    err = _one(tmp_path, _batch(CHAT_URL, {"messages": MSG, "logprobs": 1.0}, "a"))
    assert err.code == "invalid_field" and "true or false" in err.message


def test_one_max_tokens_range() -> None:
    from pagedctl.engine.core.sampling_params import MIN_MAX_TOKENS
    from pagedctl.generate.validate import FieldError, check_max_tokens

    assert MIN_MAX_TOKENS == 1
    assert check_max_tokens(4.0) == 4 and type(check_max_tokens(4.0)) is int
    assert check_max_tokens(2**40) == 2**40  # no upper bound without a model's limit
    assert check_max_tokens(8, 8) == 8
    cases = [
        (0, None, "max_tokens_out_of_range", "max_tokens must be an integer >= 1, got 0"),
        (9, 8, "max_tokens_out_of_range", "max_tokens must be an integer in 1..8, got 9"),
        (4.5, 8, "invalid_field", "must be an integer in 1..8, got 4.5, which has a fractional"),
        ("4", None, "invalid_field", 'max_tokens must be an integer >= 1, got "4"'),
        (True, None, "invalid_field", "max_tokens must be an integer >= 1, got true"),
    ]
    for value, high, code, message in cases:
        with pytest.raises(FieldError) as e:
            check_max_tokens(value, high)
        assert e.value.code == code and message in e.value.message, e.value.message
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        SamplingParams(max_tokens=MIN_MAX_TOKENS - 1)

"""OpenAI batch output/error lines built from engine outputs: shape, choices, usage, logprobs."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from pagedctl.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedctl.generate.records import dumps, error_record, ok_record, token_bytes_of


class Opt:
    """Schema for "this, or null"."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner


def check(obj: Any, schema: Any, where: str = "$") -> None:
    """A tiny JSON-shape validator: dict = required keys, [s] = list of s, str = literal,
    set = one of these literals, None = null, a type = that JSON type (bool is not an int)."""
    if isinstance(schema, Opt):
        if obj is not None:
            check(obj, schema.inner, where)
    elif schema is None:
        assert obj is None, f"{where}: expected null, got {obj!r}"
    elif isinstance(schema, str):
        assert obj == schema, f"{where}: expected {schema!r}, got {obj!r}"
    elif isinstance(schema, set):
        assert obj in schema, f"{where}: {obj!r} not in {schema}"
    elif isinstance(schema, dict):
        assert isinstance(obj, dict), f"{where}: expected an object, got {obj!r}"
        missing = schema.keys() - obj.keys()
        assert not missing, f"{where}: missing {sorted(missing)}"
        for key, sub in schema.items():
            check(obj[key], sub, f"{where}.{key}")
    elif isinstance(schema, list):
        assert isinstance(obj, list), f"{where}: expected an array, got {obj!r}"
        for i, item in enumerate(obj):
            check(item, schema[0], f"{where}[{i}]")
    else:
        ok = isinstance(obj, schema) and not (isinstance(obj, bool) and schema is not bool)
        assert ok, f"{where}: expected {schema}, got {obj!r}"


USAGE = {"prompt_tokens": int, "completion_tokens": int, "total_tokens": int}
FINISH = {"stop", "length"}
STOP_REASON = Opt((int, str))
CHAT_LOGPROBS = {"content": [{"token": str, "logprob": float, "bytes": [int], "top_logprobs": []}]}
CHAT_CHOICE = {
    "index": int,
    "message": {"role": "assistant", "content": str},
    "logprobs": Opt(CHAT_LOGPROBS),
    "finish_reason": FINISH,
    "stop_reason": STOP_REASON,
}
TEXT_LOGPROBS = {
    "tokens": [str],
    "token_logprobs": [float],
    "top_logprobs": None,
    "text_offset": [int],
}
TEXT_CHOICE = {
    "index": int,
    "text": str,
    "logprobs": Opt(TEXT_LOGPROBS),
    "finish_reason": FINISH,
    "stop_reason": STOP_REASON,
}
BODY = {"id": str, "created": int, "model": str, "usage": USAGE}
CHAT_BODY = {**BODY, "object": "chat.completion", "choices": [CHAT_CHOICE]}
TEXT_BODY = {**BODY, "object": "text_completion", "choices": [TEXT_CHOICE]}


def line_schema(body: dict) -> dict:
    response = {"status_code": int, "request_id": str, "body": body}
    return {"id": str, "custom_id": str, "response": response, "error": None}


ERROR_LINE = {
    "id": str,
    "custom_id": Opt(str),
    "response": None,
    "error": {"code": str, "message": str, "line": Opt(int)},
}
VOCAB = {1: "Hello", 2: ",", 3: " wörld", 4: "!", 5: "é"}
VOCAB_BYTES = {i: t.encode() for i, t in VOCAB.items()} | {6: b"\xf0\x9f\x98", 7: b"\x80"}


def request(*samples: CompletionOutput, prompt_len: int = 4, cached: int = 0) -> RequestOutput:
    metrics = RequestMetrics(num_prompt_tokens=prompt_len, num_cached_tokens=cached)
    ids = list(range(100, 100 + prompt_len))
    return RequestOutput("r", 0, "p", ids, outputs=list(samples), metrics=metrics)


def sample(index: int, ids: list[int], finish: str = "stop", logprobs: list[float] | None = None):
    text = b"".join(VOCAB_BYTES[t] for t in ids).decode()
    stop_reason = 2 if finish == "stop" else None
    return CompletionOutput(index, text, ids, finish, stop_reason, logprobs)


def roundtrip(record: dict) -> dict:
    return json.loads(dumps(record))


def test_checker_rejects_wrong_shapes() -> None:
    out = request(sample(0, [1, 2]))
    body = roundtrip(ok_record("a", "chat", "m", out))["response"]["body"]
    check(body, CHAT_BODY)
    with pytest.raises(AssertionError, match="missing"):
        check({k: v for k, v in body.items() if k != "usage"}, CHAT_BODY)
    with pytest.raises(AssertionError, match="created"):
        check({**body, "created": True}, CHAT_BODY)
    with pytest.raises(AssertionError, match="object"):
        check(body, TEXT_BODY)


def test_chat_record_single_sample() -> None:
    out = request(sample(0, [1, 2, 3]), prompt_len=7, cached=4)
    rec = roundtrip(ok_record("req-1", "chat", "smol", out, created=1700000000))
    check(rec, line_schema(CHAT_BODY))
    assert rec["id"].startswith("batch_req_") and rec["custom_id"] == "req-1"
    resp = rec["response"]
    assert resp["status_code"] == 200 and resp["request_id"].startswith("req_")
    body = resp["body"]
    assert body["id"].startswith("chatcmpl-")
    assert (body["created"], body["model"]) == (1700000000, "smol")
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Hello, wörld", "refusal": None},
            "logprobs": None,
            "finish_reason": "stop",
            "stop_reason": 2,
        }
    ]
    assert body["usage"] == {
        "prompt_tokens": 7,
        "completion_tokens": 3,
        "total_tokens": 10,
        "prompt_tokens_details": {"cached_tokens": 4},
    }


def test_completion_record_n3_sorted_and_usage_summed() -> None:
    out = request(sample(2, [4]), sample(0, [1, 2, 3, 4], "length"), sample(1, []), prompt_len=5)
    rec = roundtrip(ok_record("c", "completion", "m", out))
    check(rec, line_schema(TEXT_BODY))
    body = rec["response"]["body"]
    assert body["id"].startswith("cmpl-")
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["text"] for c in body["choices"]] == ["Hello, wörld!", "", "!"]
    assert [c["finish_reason"] for c in body["choices"]] == ["length", "stop", "stop"]
    assert body["usage"]["completion_tokens"] == 5 and body["usage"]["total_tokens"] == 10


def test_chat_logprobs() -> None:
    out = request(sample(0, [5, 1], logprobs=[-0.5, -math.inf]))
    body = roundtrip(ok_record("x", "chat", "m", out, token_bytes=VOCAB_BYTES.__getitem__))
    check(body, line_schema(CHAT_BODY))
    assert body["response"]["body"]["choices"][0]["logprobs"] == {
        "content": [
            {"token": "é", "logprob": -0.5, "bytes": [195, 169], "top_logprobs": []},
            {"token": "Hello", "logprob": -9999.0, "bytes": list(b"Hello"), "top_logprobs": []},
        ]
    }


def test_completion_logprobs_and_token_id_fallback() -> None:
    out = request(sample(0, [1, 3, 4], logprobs=[-1.0, -0.25, 0.0]))
    body = roundtrip(ok_record("x", "completion", "m", out, token_bytes=VOCAB_BYTES.__getitem__))
    check(body, line_schema(TEXT_BODY))
    assert body["response"]["body"]["choices"][0]["logprobs"] == {
        "tokens": ["Hello", " wörld", "!"],
        "token_logprobs": [-1.0, -0.25, 0.0],
        "top_logprobs": None,
        "text_offset": [0, 5, 11],
    }
    bare = roundtrip(ok_record("x", "completion", "m", out))["response"]["body"]
    assert bare["choices"][0]["logprobs"]["tokens"] == ["token_id:1", "token_id:3", "token_id:4"]


def test_logprobs_of_a_character_split_over_tokens_carry_its_bytes() -> None:
    """An emoji in two byte tokens: each shows as U+FFFD, but the bytes spell the emoji."""
    out = request(sample(0, [1, 6, 7, 4], logprobs=[-1.0] * 4))
    chat = roundtrip(ok_record("x", "chat", "m", out, token_bytes=VOCAB_BYTES.__getitem__))
    content = chat["response"]["body"]["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == ["Hello", "\ufffd", "\ufffd", "!"]
    assert bytes(b for c in content for b in c["bytes"]) == "Hello\U0001f600!".encode()
    text = roundtrip(ok_record("x", "completion", "m", out, token_bytes=VOCAB_BYTES.__getitem__))
    logprobs = text["response"]["body"]["choices"][0]["logprobs"]
    assert logprobs["text_offset"] == [0, 5, 5, 6]
    # OpenAI's completions form: a token of partial characters is "bytes:" and \xHH escapes
    assert logprobs["tokens"] == ["Hello", "bytes:\\xf0\\x9f\\x98", "bytes:\\x80", "!"]
    assert b"".join(map(token_bytes_of, logprobs["tokens"])) == "Hello\U0001f600!".encode()


def test_records_are_unique() -> None:
    out = request(sample(0, [1]))
    recs = [ok_record("a", "chat", "m", out) for _ in range(50)]
    assert len({r["id"] for r in recs}) == 50
    assert len({r["response"]["request_id"] for r in recs}) == 50
    assert len({r["response"]["body"]["id"] for r in recs}) == 50


@pytest.mark.parametrize(
    ("out", "endpoint", "match"),
    [
        (request(sample(0, [1], "abort")), "chat", "'abort'"),
        (request(sample(0, [1], "error")), "completion", "'error'"),
        (request(sample(0, [1, 2], logprobs=[-1.0])), "chat", "1 logprobs for 2 tokens"),
        (request(sample(0, [1])), "embeddings", "endpoint"),
        (RequestOutput("r", 0, "p", [1], error="prompt too long"), "chat", "prompt too long"),
    ],
)
def test_ok_record_refuses(out: RequestOutput, endpoint: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ok_record("a", endpoint, "m", out)


def test_error_record_shape() -> None:
    rec = roundtrip(error_record(None, "invalid_json", "line 3 is not JSON", 3))
    check(rec, ERROR_LINE)
    assert rec["custom_id"] is None and rec["response"] is None
    assert rec["error"] == {"code": "invalid_json", "message": "line 3 is not JSON", "line": 3}
    rec = roundtrip(error_record("q", "prompt_too_long", "8000 > 2048", None))
    check(rec, ERROR_LINE)
    assert rec["id"].startswith("batch_req_") and rec["error"]["line"] is None


def test_dumps_is_one_compact_line() -> None:
    assert dumps({"a": 1, "b": [1, 2], "c": None}) == '{"a":1,"b":[1,2],"c":null}\n'
    tricky = {"t": 'a\nb\r\u2028c\u2029d\x85e\x1ef é 😀 "q" \\'}
    line = dumps(tricky)
    assert line.endswith("\n") and line.count("\n") == 1
    assert len(line.splitlines()) == 1 and len(line.encode().splitlines()) == 1
    assert "é 😀" in line  # ensure_ascii=False
    assert json.loads(line) == tricky
    with pytest.raises(ValueError):
        dumps({"x": math.nan})


def test_progress_figures_are_gathered_only_when_they_would_show(capsys):
    """A job asks `due()` before it gathers the engine's figures for a progress line: once per
    interval in a log, never when quiet (a million short requests must not gather them each)."""
    from pagedctl.generate.progress import Reporter

    quiet = Reporter(10, quiet=True, log_format="text")
    assert not quiet.due()
    log = Reporter(10, quiet=False, log_format="json", interval_s=3600)
    assert log.due()  # the first finished request gets a line
    log.update(1, ok=1)
    assert not log.due()
    log._last -= 3600
    assert log.due()
    assert capsys.readouterr().err.count('"event": "progress"') == 1


def test_the_first_progress_line_shows_on_a_machine_just_booted(monkeypatch, capsys):
    """The monotonic clock counts from boot: a fresh container is up for less than an interval,
    and its first finished request still gets its line."""
    from pagedctl.generate import progress

    monkeypatch.setattr(progress.time, "monotonic", lambda: 5.0)
    log = progress.Reporter(10, quiet=False, log_format="json", interval_s=3600)
    assert log.due()
    log.update(1, ok=1)
    assert capsys.readouterr().err.count('"event": "progress"') == 1

"""Streaming JSONL reader for `pagedctl generate`: each non-empty line -> a request or an error.

Two line forms, detected per line (a line with `body`, `url` or `method` is the OpenAI form):
- OpenAI batch: {"custom_id", "method": "POST", "url": "/v1/chat/completions" | "/v1/completions",
  "body": {...}}; the prompt and sampling fields live in `body`.
- simple: {"custom_id" | "id", one of "prompt" | "messages" | "prompt_token_ids", sampling fields}.

Choices worth knowing:
- An integer id is taken as its decimal string. The first line that names an id owns it, even if
  that line is an error; a later line with that id is a duplicate_custom_id error whose record
  carries no custom_id, so every id has exactly one record (a result or an error).
- A completion `prompt` is a string, a list of token ids, or a one-element list of either.
- Text content parts are joined with newlines (as vLLM). `max_completion_tokens` is an alias of
  `max_tokens`; top_k -1 means off (0); an integer completions `logprobs` (0 or 1) means true.
- `sampling` holds only the fields the line gave, plus max_tokens (default: the smaller of
  `default_max_tokens` and `max_tokens_limit`), so the caller can lay it over its own defaults.
- Unknown fields are ignored; known ones that would change the output and that we do not
  implement are errors unless set to their neutral value (e.g. presence_penalty 0).
- The file is read in binary, one bounded line at a time: memory is O(max_line_bytes) plus the
  set of ids seen.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, BinaryIO

from engine import SamplingParams

ERROR_CODES: dict[str, str] = {
    "line_too_long": "the line is longer than the line size limit (--max-line-bytes)",
    "invalid_utf8": "the line is not valid UTF-8",
    "invalid_json": "the line is not valid JSON",
    "not_an_object": "the line is JSON but not an object",
    "missing_custom_id": "no custom_id (or id in the simple form), or it is empty",
    "duplicate_custom_id": "an earlier line already used this custom_id (the first one wins)",
    "unknown_method": 'method is not "POST"',
    "unknown_url": "url is not /v1/chat/completions or /v1/completions",
    "missing_prompt": "none of prompt, messages, prompt_token_ids",
    "ambiguous_prompt": "more than one of prompt, messages, prompt_token_ids",
    "invalid_messages": "messages is not a non-empty list of {role, content} text messages",
    "invalid_prompt": "prompt is not a non-empty string or list of token ids",
    "invalid_field": "a known field has a bad type or value",
    "max_tokens_out_of_range": "max_tokens is below 1 or above the model's limit",
    "n_out_of_range": "n is below 1 or above the limit",
    "unsupported_field": "a field that would change the output, which pagedctl does not implement",
}
URLS = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
ROLES = ("system", "user", "assistant", "tool", "developer")
PROMPT_KEYS = ("prompt", "messages", "prompt_token_ids")
MAX_STOP = 16
MAX_TOKEN_ID = 2**31 - 1
_BOM = b"\xef\xbb\xbf"
_SURROGATE = re.compile("[\ud800-\udfff]")
# Fields we do not implement, with the values that leave the output unchanged (null always does).
_OFF: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (0,), "frequency_penalty": (0,), "repetition_penalty": (1,),
    "logit_bias": ({},), "tools": ([],), "functions": ([],), "tool_choice": ("none", "auto"),
    "function_call": ("none", "auto"), "response_format": ({"type": "text"},),
    "stream": (False,), "top_logprobs": (0,), "echo": (False,), "suffix": ("",),
    "use_beam_search": (False,), "min_tokens": (0,), "include_stop_str_in_output": (False,),
    "skip_special_tokens": (True,), "add_generation_prompt": (True,),
    "continue_final_message": (False,), "modalities": (["text"],), "audio": (), "prediction": (),
    "reasoning_effort": (), "guided_json": (), "guided_regex": (), "guided_choice": (),
    "guided_grammar": (), "structured_outputs": (), "prompt_logprobs": (), "bad_words": ([],),
    "allowed_token_ids": (), "logits_processors": ([],), "chat_template": (),
    "truncate_prompt_tokens": (),
}  # fmt: skip


@dataclass(frozen=True)
class ReaderLimits:
    """Per-line limits; `max_tokens_limit` is the engine's max_model_len."""

    max_line_bytes: int = 4 * 2**20
    max_tokens_limit: int = 32768
    max_n: int = 16
    default_max_tokens: int = 256

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ReaderLimits.{f.name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class JobRequest:
    """One valid input line; `sampling` holds only the fields the line gave, plus max_tokens."""

    line_no: int
    custom_id: str
    endpoint: str
    messages: list[dict] | None
    prompt: str | None
    prompt_token_ids: list[int] | None
    sampling: dict


@dataclass(frozen=True)
class LineError:
    """One bad input line; `code` is a key of ERROR_CODES.

    `custom_id` is the line's id when it could be read, except for duplicate_custom_id, where it is
    None: the id belongs to the earlier line (the message names it).
    """

    line_no: int
    custom_id: str | None
    code: str
    message: str


class _Bad(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


def read_requests(
    path: Path, limits: ReaderLimits = ReaderLimits()
) -> Iterator[JobRequest | LineError]:
    """Yield one item per non-empty line of a JSONL file, lazily, in file order."""
    seen: set[str] = set()
    with open(path, "rb") as f:
        for line_no, raw in _lines(f, limits.max_line_bytes):
            if raw is None:
                msg = f"line is over {limits.max_line_bytes} bytes; shorten it or raise the limit"
                yield LineError(line_no, None, "line_too_long", msg)
            elif raw.strip():
                yield _parse_line(line_no, raw, limits, seen)


def count_lines(path: Path) -> int:
    """Number of lines (empty ones included), i.e. the last line number read_requests can give."""
    count, last = 0, b"\n"
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            count += chunk.count(b"\n")
            last = chunk[-1:]
    return count + (last != b"\n")


def _lines(f: BinaryIO, max_bytes: int) -> Iterator[tuple[int, bytes | None]]:
    """(line_no, line without its line end) or (line_no, None) for an over-long line."""
    line_no = 0
    while chunk := f.readline(max_bytes + 2):
        line_no += 1
        line = chunk.removesuffix(b"\n").removesuffix(b"\r")
        if len(line) > max_bytes:
            while chunk and not chunk.endswith(b"\n"):  # skip the rest in bounded pieces
                chunk = f.readline(1 << 16)
            yield line_no, None
        else:
            yield line_no, line.removeprefix(_BOM) if line_no == 1 else line


def _parse_line(line_no: int, raw: bytes, limits: ReaderLimits, seen: set[str]) -> Any:
    custom_id = None
    try:
        obj = _decode(raw)
        openai = "body" in obj or "url" in obj or "method" in obj
        custom_id = _custom_id(obj, simple=not openai)
        if custom_id in seen:  # the id belongs to the first line: this record does not carry it
            msg = f"custom_id {_show(custom_id)} is already used by an earlier line; make it unique"
            return LineError(line_no, None, "duplicate_custom_id", msg)
        seen.add(custom_id)
        return _request(line_no, custom_id, obj, openai, limits)
    except _Bad as e:
        return LineError(line_no, custom_id, e.code, e.message)


def _decode(raw: bytes) -> dict:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _Bad("invalid_utf8", f"byte {e.start} is not valid UTF-8; save as UTF-8") from None
    try:
        obj = json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        raise _Bad("invalid_json", f"invalid JSON at column {e.colno}: {e.msg}") from None
    except (ValueError, RecursionError) as e:
        raise _Bad("invalid_json", f"invalid JSON: {str(e)[:80]}") from None
    if not isinstance(obj, dict):
        raise _Bad("not_an_object", f"a line must be a JSON object, got {_show(obj)}")
    return obj


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


def _custom_id(obj: dict, simple: bool) -> str:
    ids = []
    for key in ("custom_id", "id") if simple else ("custom_id",):
        value = obj.get(key)
        if value is None:
            continue
        value = str(value) if _is_int(value) else value
        if not isinstance(value, str) or not _is_text(value):
            raise _Bad("invalid_field", f"{key} must be a string or an integer, got {_show(value)}")
        ids.append(value)
    if len(ids) == 2 and ids[0] != ids[1]:
        raise _Bad(
            "invalid_field", f"custom_id {_show(ids[0])} and id {_show(ids[1])} differ; give one"
        )
    if not ids or not ids[0]:
        where = "custom_id (or id)" if simple else "custom_id"
        raise _Bad("missing_custom_id", f"every line needs a non-empty {where}")
    return ids[0]


def _request(line_no: int, cid: str, obj: dict, openai: bool, limits: ReaderLimits) -> JobRequest:
    body, endpoint = _openai_envelope(obj) if openai else (obj, None)
    given = [k for k in PROMPT_KEYS if body.get(k) is not None]
    if len(given) > 1:
        raise _Bad("ambiguous_prompt", f"give only one of {', '.join(given)}")
    if not given:
        want = {"chat": "messages", "completion": "prompt"}.get(
            endpoint or "", "/".join(PROMPT_KEYS)
        )
        raise _Bad("missing_prompt", f"the request has no {want}")
    key = given[0]
    allowed = {"chat": "messages", "completion": "prompt", None: key}[endpoint]
    if key != allowed:
        raise _Bad("invalid_field", f"{key} is not a field of the {endpoint} body; use {allowed}")
    endpoint = endpoint or ("chat" if key == "messages" else "completion")
    messages = _messages(body[key]) if key == "messages" else None
    prompt, ids = _prompt(body[key]) if key == "prompt" else (None, None)
    if key == "prompt_token_ids":
        ids = _token_ids(body[key], "prompt_token_ids")
    sampling = _sampling(body, endpoint, limits)
    return JobRequest(line_no, cid, endpoint, messages, prompt, ids, sampling)


def _openai_envelope(obj: dict) -> tuple[dict, str]:
    if obj.get("method") != "POST":
        raise _Bad("unknown_method", f'method must be "POST", got {_show(obj.get("method"))}')
    url = obj.get("url")
    if not isinstance(url, str) or url not in URLS:
        raise _Bad("unknown_url", f"url must be one of {', '.join(URLS)}; got {_show(url)}")
    if not isinstance(obj.get("body"), dict):
        raise _Bad("invalid_field", f"body must be an object, got {_show(obj.get('body'))}")
    return obj["body"], URLS[url]


def _messages(value: Any) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise _Bad("invalid_messages", f"messages must be a non-empty list, got {_show(value)}")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise _Bad("invalid_messages", f"messages[{i}] must be an object, got {_show(m)}")
        if m.get("role") not in ROLES:
            allowed = ", ".join(ROLES)
            raise _Bad("invalid_messages", f"messages[{i}].role must be one of {allowed}")
        if m.get("tool_calls"):
            raise _Bad("unsupported_field", f"messages[{i}].tool_calls is not supported")
        out.append({"role": m["role"], "content": _content(m.get("content"), i)})
    return out


def _content(value: Any, i: int) -> str:
    where = f"messages[{i}].content"
    if isinstance(value, str):
        if not _is_text(value):
            raise _Bad("invalid_messages", f"{where} has unpaired surrogates; fix its encoding")
        return value
    if not isinstance(value, list):
        raise _Bad("invalid_messages", f"{where} must be a string or a list, got {_show(value)}")
    texts = []
    for part in value:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" and isinstance(kind, str):
            raise _Bad(
                "unsupported_field", f"{where}: only text parts are supported, got {_show(kind)}"
            )
        text = part.get("text") if kind == "text" else None
        if not isinstance(text, str) or not _is_text(text):
            raise _Bad("invalid_messages", f'{where} parts must be {{"type": "text", "text": str}}')
        texts.append(text)
    return "\n".join(texts)


def _prompt(value: Any) -> tuple[str | None, list[int] | None]:
    if isinstance(value, list) and value and all(isinstance(v, str | list) for v in value):
        if len(value) > 1:
            raise _Bad(
                "unsupported_field", "prompt lists several prompts; put each on its own line"
            )
        value = value[0]
    if isinstance(value, list):
        return None, _token_ids(value, "prompt")
    if not isinstance(value, str) or not value or not _is_text(value):
        raise _Bad("invalid_prompt", f"prompt must be a non-empty string, got {_show(value)}")
    return value, None


def _token_ids(value: Any, key: str) -> list[int]:
    if not isinstance(value, list) or not value or not all(_is_token(t) for t in value):
        raise _Bad("invalid_prompt", f"{key} must be a non-empty list of token ids (ints >= 0)")
    return value


def _sampling(body: dict, endpoint: str, limits: ReaderLimits) -> dict:
    s: dict[str, Any] = {"max_tokens": _max_tokens(body, limits)}
    if body.get("n") is not None:
        s["n"] = _int_in(body, "n", limits.max_n, "n_out_of_range")
    _best_of(body.get("best_of"), s.get("n", 1))
    for key, (allowed, ok) in _CHECKS.items():
        if (value := body.get(key)) is not None:
            if not ok(value):
                raise _Bad("invalid_field", f"{key} must be {allowed}, got {_show(value)}")
            s[key] = _CONVERT.get(key, _keep)(value)
    if body.get("logprobs") is not None:
        s["logprobs"] = _logprobs(body["logprobs"], endpoint)
    _unsupported(body)
    try:
        SamplingParams(**s)
    except (ValueError, TypeError) as e:
        raise _Bad("invalid_field", str(e)) from None
    return s


def _max_tokens(body: dict, limits: ReaderLimits) -> int:
    given = [k for k in ("max_tokens", "max_completion_tokens") if body.get(k) is not None]
    values = {_int_in(body, k, limits.max_tokens_limit, "max_tokens_out_of_range") for k in given}
    if len(values) > 1:
        raise _Bad("invalid_field", "max_tokens and max_completion_tokens differ; give one")
    return values.pop() if values else min(limits.default_max_tokens, limits.max_tokens_limit)


def _int_in(body: dict, key: str, high: int, code: str) -> int:
    value = body[key]
    msg = f"{key} must be an integer in 1..{high}, got {_show(value)}"
    if not _is_int(value):
        raise _Bad("invalid_field", msg)
    if not 1 <= value <= high:
        raise _Bad(code, msg)
    return value


def _best_of(value: Any, n: int) -> None:
    if value is None or (_is_int(value) and value == n):
        return
    if _is_int(value) and value > n:
        raise _Bad("unsupported_field", f"best_of > n is not supported; remove best_of or set {n}")
    raise _Bad("invalid_field", f"best_of must be an integer >= n ({n}), got {_show(value)}")


def _logprobs(value: Any, endpoint: str) -> bool:
    if _is_int(value) and value > 1 and endpoint == "completion":
        raise _Bad("unsupported_field", "logprobs > 1 is not supported: use 0 or 1 (sampled token)")
    if isinstance(value, bool):
        return value
    if _is_int(value) and value >= 0 and endpoint == "completion":
        return True  # 0 or 1: the sampled token's logprob, which is what we return
    allowed = "true or false" if endpoint == "chat" else "0, 1, true or false"
    raise _Bad("invalid_field", f"logprobs must be {allowed}, got {_show(value)}")


def _is_num(v: Any) -> bool:
    return _is_int(v) or (isinstance(v, float) and math.isfinite(v))


def _is_token(v: Any) -> bool:
    return _is_int(v) and 0 <= v <= MAX_TOKEN_ID


def _is_stop(v: Any) -> bool:
    stops = [v] if isinstance(v, str) else v
    ok = isinstance(stops, list) and len(stops) <= MAX_STOP
    return ok and all(isinstance(s, str) and s and _is_text(s) for s in stops)


def _keep(v: Any) -> Any:
    return v


# Sampling fields checked by one rule each: field -> (what is allowed, check); then converted.
_CHECKS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "temperature": ("a number >= 0", lambda v: _is_num(v) and v >= 0),
    "top_p": ("a number in (0, 1]", lambda v: _is_num(v) and 0 < v <= 1),
    "min_p": ("a number in [0, 1]", lambda v: _is_num(v) and 0 <= v <= 1),
    "top_k": ("an integer >= -1 (-1 or 0 turns it off)", lambda v: _is_int(v) and v >= -1),
    "seed": ("an integer in -2**63..2**64-1", lambda v: _is_int(v) and -(2**63) <= v < 2**64),
    "stop": (f"a non-empty string or a list of up to {MAX_STOP} of them", _is_stop),
    "stop_token_ids": ("a list of token ids (ints >= 0)", lambda v: isinstance(v, list)
                       and all(_is_token(t) for t in v)),
    "ignore_eos": ("true or false", lambda v: isinstance(v, bool)),
}  # fmt: skip
_CONVERT: dict[str, Callable[[Any], Any]] = {
    "temperature": float, "top_p": float, "min_p": float, "top_k": lambda v: max(v, 0),
    "stop": lambda v: [v] if isinstance(v, str) else v,
}  # fmt: skip


def _unsupported(body: dict) -> None:
    for key in [k for k in body if k in _OFF]:
        value, harmless = body[key], _OFF[key]
        if value is not None and not any(_same(value, h) for h in harmless):
            fix = f" or set it to {json.dumps(harmless[0])}" if harmless else ""
            raise _Bad(
                "unsupported_field", f"{key}={_show(value)} is not supported; remove it{fix}"
            )


def _same(a: Any, b: Any) -> bool:
    return isinstance(a, bool) == isinstance(b, bool) and a == b


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_text(value: str) -> bool:
    """True unless the string holds lone surrogates (from JSON escapes), which UTF-8 cannot hold."""
    return _SURROGATE.search(value) is None


def _show(value: Any) -> str:
    """A short description of a value for an error message (never a huge or deep repr)."""
    if isinstance(value, dict | list):
        return f"{'an object' if isinstance(value, dict) else 'a list'} of {len(value)}"
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."

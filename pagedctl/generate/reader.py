"""Streaming JSONL reader for `pagedctl generate`: each non-empty line -> a request or an error.

Two line forms, detected per line (a line with `body`, `url` or `method` is the OpenAI form):
- OpenAI batch: {"custom_id", "method": "POST", "url": "/v1/chat/completions" | "/v1/completions",
  "body": {...}}; the prompt and sampling fields live in `body`.
- simple: {"custom_id" | "id", one of "prompt" | "messages" | "prompt_token_ids", sampling fields}.

Choices worth knowing:
- An integer id is taken as its decimal string. The first line that names an id owns it, even if
  that line is an error; a later line with that id is a duplicate_custom_id error. Its record
  carries the line's own id (OpenAI's output schema wants a string), so a reader joins results
  on custom_id and error records on (custom_id, code) or on the line number.
- A key given twice in one object is an error, not "the last one wins": JSON parsers disagree on
  which wins, so the line does not say what it asks for.
- The fields themselves are checked in `validate` (the accepted fields, prompt forms, sampling
  defaults and aliases); this module finds the id, the form and the prompt field.
- A gzip, bzip2 or xz file is read through its decompressor (found by its first bytes, whatever
  its name); a file of another encoding or compression is refused as a whole (`InputError`).
- The file is read in binary, one bounded line at a time: memory is O(max_line_bytes) plus the
  set of ids seen.
"""

from __future__ import annotations

import bz2
import gzip
import io
import json
import lzma
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, BinaryIO

from pagedctl.generate.validate import (
    FieldError,
    check_fields,
    check_model,
    is_int,
    is_text,
    parse_chat_options,
    parse_echo,
    parse_messages,
    parse_prompt,
    parse_sampling,
    parse_token_ids,
    show,
)

ERROR_CODES: dict[str, str] = {
    "line_too_long": "the line is longer than the line size limit (--max-line-bytes)",
    "invalid_utf8": "the line is not valid UTF-8",
    "invalid_json": "the line is not valid JSON",
    "not_an_object": "the line is JSON but not an object",
    "missing_custom_id": "no custom_id (or id in the simple form), or it is empty",
    "duplicate_custom_id": "an earlier line already used this custom_id (the first one wins)",
    "duplicate_key": "a key appears twice in one JSON object",
    "unknown_method": 'method is not "POST"',
    "unknown_url": "url is not /v1/chat/completions or /v1/completions",
    "missing_prompt": "none of prompt, messages, prompt_token_ids",
    "ambiguous_prompt": "more than one of prompt, messages, prompt_token_ids",
    "invalid_messages": "messages is not a non-empty list of {role, content} text messages",
    "invalid_prompt": "prompt is not a non-empty string or list of token ids",
    "invalid_field": "a known field has a bad type or value",
    "unknown_field": "a field that is not an accepted request field (a typo, or misplaced)",
    "model_not_found": "model names another model than the one this job serves",
    "max_tokens_out_of_range": "max_tokens is below 1 or above the model's limit",
    "n_out_of_range": "n is below 1 or above the limit",
    "unsupported_field": "a field that would change the output, which pagedctl does not implement",
}
# Engine refusals that reach the errors file with their own code (see the engine's RequestOutput).
ENGINE_ERROR_CODES: dict[str, str] = {
    "context_length_exceeded": "the prompt plus max_tokens is over the engine's max_model_len",
    "prompt_too_long": "the prompt alone leaves no room within max_model_len or the KV pool",
    "empty_prompt": "the prompt renders to no token",
    "chat_template_failed": "the chat template raised an error on these messages and options",
    "token_out_of_vocab": "a token id is outside the model's vocabulary",
    "no_tokenizer": "text or stop strings given to a model without a tokenizer",
    "no_chat_template": "messages given to a model without a chat template",
    "beam_width_too_large": "beam search: n over max_num_batched_tokens (the beams step as one)",
    "kv_cache_full": "the whole KV pool could not hold a beam search up to its first hypothesis",
    "internal_error": "the engine failed on this request (the message says how); the job went on",
}
URLS = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
PROMPT_KEYS = ("prompt", "messages", "prompt_token_ids")
_BOM = b"\xef\xbb\xbf"


class InputError(ValueError):
    """The input file as a whole cannot be read as JSONL (its encoding or compression)."""


@dataclass(frozen=True)
class ReaderLimits:
    """Per-line limits; `max_tokens_limit` is the engine's max_model_len. `models` are the names
    a line's `model` may give (None: any)."""

    max_line_bytes: int = 4 * 2**20
    max_tokens_limit: int = 32768
    max_n: int = 16
    default_max_tokens: int = 256
    models: frozenset[str] | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "models":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ReaderLimits.{f.name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class JobRequest:
    """One valid input line; `sampling` holds only the fields the line gave, plus max_tokens;
    `chat` the chat-template fields a chat line gave (`validate.parse_chat_options`), or None."""

    line_no: int
    custom_id: str
    endpoint: str
    messages: list[dict] | None
    prompt: str | None
    prompt_token_ids: list[int] | None
    sampling: dict
    chat: dict | None = None
    echo: str | None = None  # `validate.parse_echo`: "echo", "prompt_only" or None


@dataclass(frozen=True)
class LineError:
    """One bad input line; `code` is a key of ERROR_CODES.

    `custom_id` is the line's id when it could be read (a duplicate's too), else None.
    """

    line_no: int
    custom_id: str | None
    code: str
    message: str


# First bytes of the compressed files read through a decompressor, and of those refused.
_MAGIC = {b"\x1f\x8b": "gzip", b"BZh": "bzip2", b"\xfd7zXZ\x00": "xz"}
_REFUSED = {
    b"\x28\xb5\x2f\xfd": "zstd-compressed: decompress it first (zstd -d)",
    b"PK\x03\x04": "a zip archive: extract the .jsonl first",
    b"\xff\xfe": "UTF-16 or UTF-32: convert it to UTF-8 (iconv -t UTF-8)",
    b"\xfe\xff": "UTF-16: convert it to UTF-8 (iconv -t UTF-8)",
    b"\x00\x00\xfe\xff": "UTF-32: convert it to UTF-8 (iconv -t UTF-8)",
    b"PAR1": "Parquet, not JSONL",
}


def input_kind(path: Path) -> str:
    """ "jsonl", "gzip", "bzip2" or "xz", from the file's first bytes; InputError for a file that
    would only turn into garbage error records (another compression, UTF-16, an archive)."""
    with open(path, "rb") as f:
        head = f.read(8)
    for magic, why in _REFUSED.items():
        if head.startswith(magic):
            raise InputError(f"input {path} is {why}")
    return next((kind for magic, kind in _MAGIC.items() if head.startswith(magic)), "jsonl")


def open_input(path: Path) -> BinaryIO:
    """The input as a binary stream of JSONL bytes (decompressed on the fly)."""
    kind = input_kind(path)
    if kind == "jsonl":
        return open(path, "rb")
    return _Decompressed(path, kind)


class _Decompressed(io.BufferedReader):
    """A decompressing reader whose damage (a cut or corrupt file) is an InputError."""

    def __init__(self, path: Path, kind: str) -> None:
        opener = {"gzip": gzip.open, "bzip2": bz2.open, "xz": lzma.open}[kind]
        super().__init__(opener(path, "rb"))
        self.where = f"{kind} input {path}"

    def readline(self, size: int | None = -1) -> bytes:
        try:
            return super().readline(size)
        except (OSError, EOFError, lzma.LZMAError, zlib.error) as e:
            raise InputError(f"{self.where} is damaged: {e}") from None

    def read(self, size: int | None = -1) -> bytes:
        try:
            return super().read(size)
        except (OSError, EOFError, lzma.LZMAError, zlib.error) as e:
            raise InputError(f"{self.where} is damaged: {e}") from None


def read_requests(
    path: Path, limits: ReaderLimits = ReaderLimits()
) -> Iterator[JobRequest | LineError]:
    """Yield one item per non-empty line of a JSONL file, lazily, in file order."""
    seen: set[str] = set()
    with open_input(path) as f:
        for line_no, raw in _lines(f, limits.max_line_bytes):
            if raw is None:
                msg = f"line is over {limits.max_line_bytes} bytes; shorten it or raise the limit"
                yield LineError(line_no, None, "line_too_long", msg)
            elif raw.strip():
                yield _parse_line(line_no, raw, limits, seen)


def count_lines(path: Path) -> int:
    """Number of lines (empty ones included), i.e. the last line number read_requests can give."""
    count, last = 0, b"\n"
    with open_input(path) as f:
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
        try:
            obj = _decode(raw)
        except FieldError as e:
            custom_id = _salvaged_id(raw) if e.code in _SALVAGE else None
            if custom_id is None:
                raise
            if custom_id in seen:
                return _duplicate(line_no, custom_id)
            seen.add(custom_id)  # a line that names an id owns it, even a broken one
            raise
        openai = "body" in obj or "url" in obj or "method" in obj
        custom_id = _custom_id(obj, simple=not openai)
        if custom_id in seen:
            return _duplicate(line_no, custom_id)
        seen.add(custom_id)
        return _request(line_no, custom_id, obj, openai, limits)
    except FieldError as e:
        return LineError(line_no, custom_id, e.code, e.message)


def _duplicate(line_no: int, custom_id: str) -> LineError:
    msg = f"custom_id {show(custom_id)} is already used by an earlier line; make it unique"
    return LineError(line_no, custom_id, "duplicate_custom_id", msg)


# Lines that are refused whole but whose id can still be read, so that their record names it.
_SALVAGE = ("duplicate_key", "invalid_utf8", "invalid_json")  # invalid_json: NaN, Infinity


def _salvaged_id(raw: bytes) -> str | None:
    """The id of a line with a key given twice, a stray non-UTF-8 byte or a NaN, if the id is
    whole and unambiguous."""
    try:  # every object as its list of pairs, so that a repeated id key shows
        pairs = json.loads(raw.decode("utf-8", errors="replace"), object_pairs_hook=list)
    except (ValueError, RecursionError):
        return None
    if not isinstance(pairs, list) or not all(isinstance(p, tuple) for p in pairs):
        return None
    keys = [k for k, _ in pairs]
    if keys.count("custom_id") > 1 or keys.count("id") > 1:
        return None  # which one is meant is the question
    obj = dict(pairs)
    try:
        cid = _custom_id(obj, simple=not ("body" in obj or "url" in obj or "method" in obj))
    except FieldError:
        return None
    return None if "\ufffd" in cid else cid


def _decode(raw: bytes) -> dict:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise FieldError(
            "invalid_utf8", f"byte {e.start} is not valid UTF-8; save as UTF-8"
        ) from None
    try:
        obj = json.loads(text, parse_constant=_no_constant, object_pairs_hook=_unique_keys)
    except FieldError:
        raise
    except (ValueError, RecursionError) as e:  # the parser's whole message, never cut: its
        # position (line 1 of the line's text), NaN, nesting too deep, an int of 5,000 digits
        raise FieldError("invalid_json", f"invalid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise FieldError("not_an_object", f"a line must be a JSON object, got {show(obj)}")
    return obj


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    obj = dict(pairs)
    if len(obj) < len(pairs):
        seen: set[str] = set()
        key = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise FieldError(
            "duplicate_key", f"key {show(key)} appears twice in one object; give it once"
        )
    return obj


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


def _custom_id(obj: dict, simple: bool) -> str:
    ids = []
    for key in ("custom_id", "id") if simple else ("custom_id",):
        value = obj.get(key)
        if value is None:
            continue
        value = str(value) if is_int(value) else value
        if not isinstance(value, str) or not is_text(value):
            raise FieldError(
                "invalid_field", f"{key} must be a string or an integer, got {show(value)}"
            )
        ids.append(value)
    if len(ids) == 2 and ids[0] != ids[1]:
        raise FieldError(
            "invalid_field", f"custom_id {show(ids[0])} and id {show(ids[1])} differ; give one"
        )
    if not ids or not ids[0]:
        where = "custom_id (or id)" if simple else "custom_id"
        raise FieldError("missing_custom_id", f"every line needs a non-empty {where}")
    return ids[0]


def _request(line_no: int, cid: str, obj: dict, openai: bool, limits: ReaderLimits) -> JobRequest:
    if openai:
        body, endpoint = _openai_envelope(obj)
        check_fields(obj, "envelope")
        check_fields(body, "body")
    else:
        check_fields(obj, "simple")
        body, endpoint = obj, None
    check_model(body.get("model"), limits.models)
    given = [k for k in PROMPT_KEYS if body.get(k) is not None]
    if len(given) > 1:
        raise FieldError("ambiguous_prompt", f"give only one of {', '.join(given)}")
    if not given:
        want = {"chat": "messages", "completion": "prompt"}.get(
            endpoint or "", "/".join(PROMPT_KEYS)
        )
        raise FieldError("missing_prompt", f"the request has no {want}")
    key = given[0]
    allowed = {"chat": "messages", "completion": "prompt", None: key}[endpoint]
    if key != allowed:
        raise FieldError(
            "invalid_field", f"{key} is not a field of the {endpoint} body; use {allowed}"
        )
    endpoint = endpoint or ("chat" if key == "messages" else "completion")
    messages = parse_messages(body[key]) if key == "messages" else None
    prompt, ids = parse_prompt(body[key]) if key == "prompt" else (None, None)
    if key == "prompt_token_ids":
        ids = parse_token_ids(body[key], "prompt_token_ids")
    sampling = parse_sampling(
        body,
        endpoint,
        max_tokens_limit=limits.max_tokens_limit,
        default_max_tokens=limits.default_max_tokens,
        max_n=limits.max_n,
    )
    chat = parse_chat_options(body, endpoint)
    echo = parse_echo(body, endpoint)
    return JobRequest(line_no, cid, endpoint, messages, prompt, ids, sampling, chat, echo)


def _openai_envelope(obj: dict) -> tuple[dict, str]:
    if obj.get("method") != "POST":
        raise FieldError("unknown_method", f'method must be "POST", got {show(obj.get("method"))}')
    url = obj.get("url")
    if not isinstance(url, str) or url not in URLS:
        raise FieldError("unknown_url", f"url must be one of {', '.join(URLS)}; got {show(url)}")
    if not isinstance(obj.get("body"), dict):
        raise FieldError("invalid_field", f"body must be an object, got {show(obj.get('body'))}")
    return obj["body"], URLS[url]

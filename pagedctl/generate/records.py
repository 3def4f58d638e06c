"""OpenAI batch output and error lines, built from what the engine hands back.

One line per request: `{"id", "custom_id", "response", "error"}` (OpenAI's `BatchRequestOutput`).
A success carries `response.body`, a `chat.completion` or `text_completion` object with one choice
per sample (per hypothesis of a beam search, best first) and the token `usage`; a failure carries
`error{code, message, line}` and a null `response`. A beam-search choice also carries
`cumulative_logprob`, the sum of its tokens' log-probabilities (pagedctl's key: OpenAI's choices
have none; the name is that of vLLM's CompletionOutput).

A token that holds part of a character (one byte of an emoji split over byte-level BPE tokens)
has no text of its own. The chat form shows it as U+FFFD with its exact `bytes`; the completions
form, whose `tokens` are strings only, shows it as OpenAI's API does: `bytes:` followed by each of
its bytes as a `\\xHH` escape (`bytes:\\xf0\\x9f`), which `token_bytes_of` reads back.

With a reasoning parser (`REASONING_PARSERS`, vLLM's names), a chat message carries the text of
the model's `<think>...</think>` block as `reasoning_content` and the rest as `content`
(`split_reasoning`); without one the message has no `reasoning_content` key.
"""

from __future__ import annotations

import codecs
import json
import math
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the engine is only read here; importing it at run time is not needed
    from pagedctl.engine import CompletionOutput, RequestOutput

TokenBytes = Callable[[int], bytes]  # a token id's exact bytes
ENDPOINTS = ("chat", "completion")
REASONING_PARSERS = ("qwen3", "deepseek_r1")
THINK_START, THINK_END = "<think>", "</think>"
FINISH_REASONS = ("stop", "length")
MIN_LOGPROB = -9999.0  # stands in for -inf (JSON has no infinities), as vLLM does

# Characters that JSON leaves raw with ensure_ascii=False but that some line splitters
# (str.splitlines, JavaScript) treat as line breaks; escaped so a record is one line everywhere.
_LINE_BREAKS = {"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"}
BYTES_PREFIX = "bytes:"  # a completions token that is no whole characters: bytes:\xf0\x9f
_BYTE_ESCAPES = re.compile(r"(?:\\x[0-9a-f]{2})+")


def _hex() -> str:
    return secrets.token_hex(12)


def _logprob(x: float | None) -> float | None:
    """A logprob for JSON: -inf as MIN_LOGPROB; None (an echoed prompt's first token) stays."""
    return x if x is None or math.isfinite(x) else MIN_LOGPROB


def _token_pieces(
    sample: CompletionOutput, token_bytes: TokenBytes | None
) -> list[tuple[str, bytes | None]]:
    """Each token's (text, exact bytes). A token holding part of a character (one byte of an
    emoji) shows as U+FFFD, but its bytes are its own, so the bytes spell the text. Without a
    tokenizer the id stands in, in vLLM's "token_id:<id>" form, with no bytes."""
    if len(sample.logprobs or ()) != len(sample.token_ids):
        raise ValueError(
            f"sample {sample.index} has {len(sample.logprobs or ())} logprobs for "
            f"{len(sample.token_ids)} tokens (an engine bug); write an error_record instead"
        )
    return [_piece(t, token_bytes) for t in sample.token_ids]


def _piece(token_id: int, token_bytes: TokenBytes | None) -> tuple[str, bytes | None]:
    """One token's (text, exact bytes): its bytes decoded (U+FFFD for part of a character), or
    without a tokenizer vLLM's "token_id:<id>" and no bytes."""
    if token_bytes is None:
        return f"token_id:{token_id}", None
    raw = token_bytes(token_id)
    return raw.decode("utf-8", errors="replace"), raw


def _tops(sample: CompletionOutput) -> list[list[tuple[int, float]]]:
    """Each position's most likely tokens (none where the sample did not ask for them)."""
    if sample.top_logprobs is None:
        return [[] for _ in sample.token_ids]
    return sample.top_logprobs


def _chat_logprobs(sample: CompletionOutput, token_bytes: TokenBytes | None) -> dict | None:
    if sample.logprobs is None:
        return None

    def entry(text: str, raw: bytes | None, lp: float) -> dict:
        return {"token": text, "logprob": _logprob(lp), "bytes": None if raw is None else list(raw)}

    pieces = _token_pieces(sample, token_bytes)
    content = [
        {
            **entry(text, raw, lp),
            "top_logprobs": [entry(*_piece(t, token_bytes), v) for t, v in top],
        }
        for (text, raw), lp, top in zip(pieces, sample.logprobs, _tops(sample), strict=True)
    ]
    return {"content": content}


def _completion_token(text: str, raw: bytes | None) -> str:
    """A completions token: its text, or `bytes:\\xHH...` when its bytes are not whole UTF-8
    characters (OpenAI's form), so that no byte of the text is lost to U+FFFD."""
    if raw is None:
        return text
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return BYTES_PREFIX + "".join(f"\\x{b:02x}" for b in raw)


def token_bytes_of(token: str) -> bytes:
    """The bytes of one completions `tokens` entry: a `bytes:\\xHH...` token's bytes, else the
    token's text in UTF-8. (A token whose own text is "bytes:" and escapes reads as bytes: the
    chat form's `bytes` field is exact.)"""
    rest = token.removeprefix(BYTES_PREFIX)
    if rest != token and _BYTE_ESCAPES.fullmatch(rest):
        return bytes.fromhex(rest.replace("\\x", ""))
    return token.encode("utf-8")


def _completion_logprobs(sample: CompletionOutput, token_bytes: TokenBytes | None) -> dict | None:
    if sample.logprobs is None:
        return None
    pieces = _token_pieces(sample, token_bytes)
    tokens = [_completion_token(text, raw) for text, raw in pieces]
    # text_offset counts characters of the text: a token that starts inside a character (its
    # later bytes) points at that character.
    offsets, pos = [], 0
    chars = codecs.getincrementaldecoder("utf-8")(errors="replace")
    for text, raw in pieces:
        offsets.append(pos)
        pos += len(text) if raw is None else len(chars.decode(raw))
    top = None
    if sample.top_logprobs is not None:  # OpenAI's: the N most likely, and the sampled token
        top = []
        for token, lp, best in zip(tokens, sample.logprobs, sample.top_logprobs, strict=True):
            if lp is None:  # an echoed prompt's first token: nothing before it
                top.append(None)
                continue
            entries = {_completion_token(*_piece(t, token_bytes)): _logprob(v) for t, v in best}
            entries.setdefault(token, _logprob(lp))
            top.append(entries)
    return {
        "tokens": tokens,
        "token_logprobs": [_logprob(lp) for _, lp in zip(tokens, sample.logprobs, strict=True)],
        "top_logprobs": top,
        "text_offset": offsets,
    }


def split_reasoning(text: str, parser: str) -> tuple[str | None, str | None]:
    """(reasoning_content, content) of a chat answer, as vLLM's reasoning parser `parser` of
    `REASONING_PARSERS` splits it. The text after a `<think>` the model wrote (what came before
    it is dropped) and up to `</think>` is the reasoning, the text after `</think>` the content;
    nothing is stripped of whitespace, and an empty content is None. Without `</think>`:
    - qwen3: the whole text is content (thinking off); so it is without a `<think>` too.
    - deepseek_r1: the template opened `<think>` in the prompt, so the whole text is reasoning
      (the answer was cut before the block closed) and content is None.
    """
    if parser not in REASONING_PARSERS:
        raise ValueError(f"reasoning parser must be one of {REASONING_PARSERS}, got {parser!r}")
    if parser == "qwen3" and (THINK_START not in text or THINK_END not in text):
        return None, text
    _, opened, rest = text.partition(THINK_START)
    rest = rest if opened else text
    if THINK_END not in rest:
        return (None, rest) if parser == "qwen3" else (rest, None)
    reasoning, _, content = rest.partition(THINK_END)
    return reasoning, content or None


def _message(text: str, role: str, reasoning_parser: str | None) -> dict:
    if reasoning_parser is None:
        return {"role": role, "content": text, "refusal": None}
    reasoning, content = split_reasoning(text, reasoning_parser)
    return {"role": role, "content": content, "reasoning_content": reasoning, "refusal": None}


def _choice(
    sample: CompletionOutput,
    endpoint: str,
    token_bytes: TokenBytes | None,
    role: str = "assistant",
    reasoning_parser: str | None = None,
) -> dict:
    if sample.finish_reason not in FINISH_REASONS:
        raise ValueError(
            f"sample {sample.index} finished with {sample.finish_reason!r}; only 'stop' and "
            "'length' belong in an output record (write an error_record for the others)"
        )
    choice: dict[str, Any] = {"index": sample.index}
    if endpoint == "chat":
        choice["message"] = _message(sample.text, role, reasoning_parser)
        choice["logprobs"] = _chat_logprobs(sample, token_bytes)
    else:
        choice["text"] = sample.text
        choice["logprobs"] = _completion_logprobs(sample, token_bytes)
    choice["finish_reason"] = sample.finish_reason
    choice["stop_reason"] = sample.stop_reason
    if sample.cumulative_logprob is not None:  # a beam-search hypothesis
        choice["cumulative_logprob"] = _logprob(sample.cumulative_logprob)
    return choice


def _echoed(
    sample: CompletionOutput, out: RequestOutput, echo: str, token_bytes: TokenBytes | None
) -> CompletionOutput:
    """A completions sample with its prompt before it (`echo` "echo"), or the prompt alone
    ("prompt_only": the one token drawn is left out), as vLLM echoes: the prompt's text (decoded
    from its tokens' bytes where it came as token ids), and with logprobs the prompt's tokens
    first, the first one's logprob null."""
    prompt_ids = list(out.prompt_token_ids)
    prompt_text = out.prompt
    if prompt_text is None:
        raw = b"".join(token_bytes(t) for t in prompt_ids) if token_bytes else b""
        prompt_text = raw.decode("utf-8", errors="replace")
    keep = echo != "prompt_only"
    ids = prompt_ids + (sample.token_ids if keep else [])
    logprobs = top = None
    if sample.logprobs is not None:
        prompt_lps = out.prompt_logprobs or [None] * len(prompt_ids)
        logprobs = list(prompt_lps) + (sample.logprobs if keep else [])
        if sample.top_logprobs is not None:
            prompt_top = out.prompt_top_logprobs or [[] for _ in prompt_ids]
            top = list(prompt_top) + (sample.top_logprobs if keep else [])
    text = prompt_text + (sample.text if keep else "")
    return replace(sample, text=text, token_ids=ids, logprobs=logprobs, top_logprobs=top)


def _prompt_logprobs(out: RequestOutput, token_bytes: TokenBytes | None) -> list | None:
    """vLLM's `prompt_logprobs` of a response: per prompt token, null for the first, then
    {token id: {"logprob", "decoded_token"}} for the prompt's own token and the position's most
    likely ones."""
    if out.prompt_logprobs is None:
        return None
    tops = out.prompt_top_logprobs or [[] for _ in out.prompt_token_ids]
    result: list[dict | None] = []
    for token, lp, best in zip(out.prompt_token_ids, out.prompt_logprobs, tops, strict=True):
        if lp is None:
            result.append(None)
            continue
        entries = {}
        for t, v in [(token, lp), *best]:
            entries[str(t)] = {"logprob": _logprob(v), "decoded_token": _piece(t, token_bytes)[0]}
        result.append(entries)
    return result


def _usage(out: RequestOutput) -> dict:
    prompt = len(out.prompt_token_ids)
    completion = sum(len(s.token_ids) for s in out.outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": out.metrics.num_cached_tokens},
    }


def ok_record(
    custom_id: str,
    endpoint: str,
    model: str,
    out: RequestOutput,
    token_bytes: TokenBytes | None = None,
    created: int | None = None,
    *,
    role: str = "assistant",
    reasoning_parser: str | None = None,
    echo: str | None = None,
) -> dict:
    """The output line of a finished request: a `chat.completion` or `text_completion` body.

    `endpoint` is "chat" or "completion"; `token_bytes(id)` gives a token's bytes for logprobs.
    A chat message's `role` is "assistant" unless the prompt had no generation prompt (then vLLM
    gives the last message's role); `reasoning_parser` splits its text (`split_reasoning`).
    `echo` ("echo" or "prompt_only", a completions line's) puts the prompt before each choice
    (`_echoed`). A request that asked for its prompt's logprobs has them as `prompt_logprobs`
    (an echoing one in its choices' logprobs instead).
    Raises ValueError for a failed request or a sample that did not finish with "stop"/"length".
    """
    if endpoint not in ENDPOINTS:
        raise ValueError(f"endpoint must be one of {ENDPOINTS}, got {endpoint!r}")
    if out.error is not None:
        raise ValueError(f"request {custom_id!r} failed ({out.error}); write an error_record")
    chat = endpoint == "chat"
    samples = sorted(out.outputs, key=lambda s: s.index)
    usage = _usage(out)
    if echo is not None and not chat:
        samples = [_echoed(s, out, echo, token_bytes) for s in samples]
        if echo == "prompt_only":
            usage.update(completion_tokens=0, total_tokens=usage["prompt_tokens"])
    body = {
        "id": ("chatcmpl-" if chat else "cmpl-") + _hex(),
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()) if created is None else created,
        "model": model,
        "choices": [_choice(s, endpoint, token_bytes, role, reasoning_parser) for s in samples],
        "usage": usage,
    }
    prompt_logprobs = None if echo else _prompt_logprobs(out, token_bytes)  # echo: in choices
    if prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs
    response = {"status_code": 200, "request_id": "req_" + _hex(), "body": body}
    return {
        "id": "batch_req_" + _hex(),
        "custom_id": custom_id,
        "response": response,
        "error": None,
    }


def error_record(custom_id: str | None, code: str, message: str, line_no: int | None) -> dict:
    """The error line of a request that failed; `line_no` is its 1-based line in the input."""
    error = {"code": code, "message": message, "line": line_no}
    return {"id": "batch_req_" + _hex(), "custom_id": custom_id, "response": None, "error": error}


def dumps(record: dict) -> str:
    """One compact JSON line, "\\n"-terminated, with no raw line break inside it."""
    text = json.dumps(record, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    if any(c in text for c in _LINE_BREAKS):
        for raw, escaped in _LINE_BREAKS.items():
            text = text.replace(raw, escaped)
    return text + "\n"

"""Per-field checks of one `pagedctl generate` request: prompt, messages, token ids, sampling.

Each check returns the field in the form the engine takes, or raises FieldError with a code of
`reader.ERROR_CODES` and a message that says what to fix.

Choices worth knowing:
- A completion `prompt` is a string, a list of token ids, or a one-element list of either.
- The chat-template fields (`CHAT_FIELDS`) belong to chat lines: a completions line may carry
  them at their defaults only. The engine renders the template with them (`parse_chat_options`).
- Text content parts are joined with newlines (as vLLM). `max_completion_tokens` is an alias of
  `max_tokens`; top_k -1 means off (0); an integer completions `logprobs` (0 or 1) means true.
- An integer field (`fields.INTEGER_FIELDS`) given as a float with no fractional part (4.0) is
  that integer, as in OpenAI's API; 4.5 is refused for its fractional part. `check_max_tokens` is
  the one max_tokens range, of a job's lines and of a sweep's workloads.
- The sampling dict holds only the fields the body gave, plus max_tokens (default: the smaller of
  `default_max_tokens` and `max_tokens_limit`), so the caller can lay it over its own defaults.
- A sampling field is checked by its engine spec (`SamplingField`: kind and range, in the words
  of `SamplingField.describe`), unless the line takes it in a form of its own (`_LINE_FORMS`) or
  by the job's limits (max_tokens, n) or the endpoint's form (logprobs).
- Every field is checked against `fields.FIELDS`: an unknown one is an error naming it; a field of
  OpenAI's or vLLM's API that we do not implement is an error unless set to its neutral value
  (e.g. presence_penalty 0), so nothing that would change the output is silently ignored.
- `use_beam_search: true` (vLLM's field) makes the line a beam search of `n` beams, which must be
  given. What it makes of each field is the field's `SamplingField.beam`: `length_penalty` and
  `early_stopping` act only there (without it they are refused unless neutral: 1 and false).
  Beam search matches stop tokens only, so `stop` strings are refused with it; the sampling
  fields (temperature, top_p, top_k, min_p, seed) are checked and have no effect on it
  (OpenAI-form files routinely carry a temperature). `engine_params` is the one place that turns
  a checked sampling dict into the engine's SamplingParams or BeamSearchParams.
"""

from __future__ import annotations

import difflib
import json
import math
import re
from collections.abc import Callable
from typing import Any

from pagedctl.engine import (
    MAX_LOGPROBS,
    MIN_MAX_TOKENS,
    SAMPLING_FIELDS,
    BeamSearchParams,
    SamplingField,
    SamplingParams,
)
from pagedctl.generate.fields import (
    ENVELOPE,
    FIELDS,
    INTEGER_FIELDS,
    LINE_FIELDS,
    OTHER_NAMES,
    SIMPLE_IDS,
    UNSUPPORTED,
)

ROLES = ("system", "user", "assistant", "tool", "developer")
MAX_STOP = 16
MAX_TOKEN_ID = 2**31 - 1
MAX_SALT = 256
MAX_BIAS = 1024  # token ids a line's logit_bias may list
MAX_BIAS_VALUE = 100.0
_SURROGATE = re.compile("[\ud800-\udfff]")


class FieldError(Exception):
    """Why a request line is rejected; `code` is a key of `reader.ERROR_CODES`."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


def parse_messages(value: Any) -> list[dict]:
    """Chat `messages` as a list of {role, content} with text content."""
    if not isinstance(value, list) or not value:
        raise FieldError(
            "invalid_messages", f"messages must be a non-empty list, got {show(value)}"
        )
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise FieldError("invalid_messages", f"messages[{i}] must be an object, got {show(m)}")
        if m.get("role") not in ROLES:
            allowed = ", ".join(ROLES)
            raise FieldError("invalid_messages", f"messages[{i}].role must be one of {allowed}")
        if m.get("tool_calls"):
            raise FieldError("unsupported_field", f"messages[{i}].tool_calls is not supported")
        out.append({"role": m["role"], "content": _content(m.get("content"), i)})
    return out


def _content(value: Any, i: int) -> str:
    where = f"messages[{i}].content"
    if isinstance(value, str):
        if not is_text(value):
            raise FieldError(
                "invalid_messages", f"{where} has unpaired surrogates; fix its encoding"
            )
        return value
    if not isinstance(value, list):
        raise FieldError(
            "invalid_messages", f"{where} must be a string or a list, got {show(value)}"
        )
    texts = []
    for part in value:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" and isinstance(kind, str):
            raise FieldError(
                "unsupported_field", f"{where}: only text parts are supported, got {show(kind)}"
            )
        text = part.get("text") if kind == "text" else None
        if not isinstance(text, str) or not is_text(text):
            raise FieldError(
                "invalid_messages", f'{where} parts must be {{"type": "text", "text": str}}'
            )
        texts.append(text)
    return "\n".join(texts)


# The chat-template fields of a line, each at the value that leaves a prompt as the model's
# template makes it by default (the engine's `chat` options: vLLM's fields and defaults).
CHAT_FIELDS: dict[str, Any] = {
    "add_generation_prompt": True,
    "continue_final_message": False,
    "chat_template": "",
    "chat_template_kwargs": {},
}
_KINDS = {bool: "true or false", str: "a string", dict: "an object"}


def parse_chat_options(body: dict, endpoint: str) -> dict | None:
    """The chat-template fields the body gave, as the engine's `chat` options (None for none;
    an empty chat_template is none: the job's or the model's template is used, as in vLLM).

    FieldError `invalid_field` for a value of the wrong type, and for one on a completions line
    other than the default (a template applies to messages only). Whether the options go
    together (not both add_generation_prompt and continue_final_message) and the keys of
    chat_template_kwargs are the engine's to check, with the tokenizer at hand.
    """
    given = {k: body[k] for k in CHAT_FIELDS if body.get(k) is not None}
    for key, value in given.items():
        kind = type(CHAT_FIELDS[key])
        if not isinstance(value, kind) or (kind is str and not is_text(value)):
            raise FieldError("invalid_field", f"{key} must be {_KINDS[kind]}, got {show(value)}")
    if endpoint != "chat":
        for key, value in given.items():
            if not _same(value, CHAT_FIELDS[key]):
                raise FieldError(
                    "invalid_field",
                    f"{key} applies to chat lines (messages) only; remove it from this "
                    "completions line",
                )
        return None
    options = {k: v for k, v in given.items() if k != "chat_template" or v}
    return options or None


def parse_prompt(value: Any) -> tuple[str | None, list[int] | None]:
    """A completion `prompt` as (text, None) or (None, token ids)."""
    if isinstance(value, list) and value and all(isinstance(v, str | list) for v in value):
        if len(value) > 1:
            raise FieldError(
                "unsupported_field", "prompt lists several prompts; put each on its own line"
            )
        value = value[0]
    if isinstance(value, list):
        return None, parse_token_ids(value, "prompt")
    if not isinstance(value, str) or not value or not is_text(value):
        raise FieldError("invalid_prompt", f"prompt must be a non-empty string, got {show(value)}")
    return value, None


def parse_token_ids(value: Any, key: str) -> list[int]:
    """A non-empty list of token ids; `key` names the field in the message. (The types, then the
    range, each checked in one pass in C: a line may hold many thousands of ids.)"""
    if (
        not isinstance(value, list)
        or not value
        or set(map(type, value)) != {int}  # no bools, floats or strings
        or min(value) < 0
        or max(value) > MAX_TOKEN_ID
    ):
        raise FieldError(
            "invalid_prompt", f"{key} must be a non-empty list of token ids (ints >= 0)"
        )
    return value


def check_fields(obj: dict, form: str) -> None:
    """Refuse a key that `form` ("envelope", "simple" or "body") does not take: an unknown one as
    `unknown_field` (naming the nearest known one), another API's name or an unimplemented field
    as `unsupported_field` unless it holds a neutral value."""
    if form == "envelope":
        for key in obj:
            if key not in ENVELOPE:
                raise FieldError("unknown_field", _unknown(key, ENVELOPE, form))
        return
    extra = SIMPLE_IDS if form == "simple" else ()
    for key in obj:
        if key in FIELDS or key in extra:
            continue
        value = obj[key]
        if key in OTHER_NAMES:
            raise FieldError(
                "unsupported_field", f"{show(key)} is not an OpenAI field; use {OTHER_NAMES[key]}"
            )
        if key not in UNSUPPORTED:
            raise FieldError("unknown_field", _unknown(key, (*FIELDS, *UNSUPPORTED, *extra), form))
        harmless = UNSUPPORTED[key]
        if value is not None and not any(_same(value, h) for h in harmless):
            fix = f" or set it to {json.dumps(harmless[0])}" if harmless else ""
            raise FieldError(
                "unsupported_field", f"{key}={show(value)} is not supported; remove it{fix}"
            )


def _unknown(key: str, known: tuple[str, ...], form: str) -> str:
    if form == "envelope" and (key in FIELDS or key in UNSUPPORTED or key in OTHER_NAMES):
        return f"{show(key)} belongs inside body, not beside it"
    where = {"envelope": "the line", "simple": "the line", "body": "body"}[form]
    near = difflib.get_close_matches(key, known, n=1, cutoff=0.75)
    hint = f"; did you mean {show(near[0])}?" if near else "; docs/jobs.md lists the fields"
    return f"unknown field {show(key)} in {where}{hint}"


def check_model(value: Any, models: frozenset[str] | None) -> None:
    """`model` must name the served model (any name when `models` is None)."""
    if value is None:
        return
    if not isinstance(value, str):
        raise FieldError("invalid_field", f"model must be a string, got {show(value)}")
    if models is not None and value not in models:
        names = ", ".join(sorted(map(show, models)))
        raise FieldError(
            "model_not_found",
            f"model {show(value)} is not served by this job (it serves {names}); fix the line, "
            "or run with --accept-any-model",
        )


def parse_sampling(
    body: dict, endpoint: str, *, max_tokens_limit: int, default_max_tokens: int, max_n: int
) -> dict:
    """The sampling fields the body gave, plus max_tokens, checked against the engine's params
    (`engine_params`); a beam search's dict also holds `use_beam_search: True`.

    A max_tokens the line gives is strict (a prompt plus it over max_model_len is refused, as
    OpenAI refuses it); the default one is a cap (a long prompt gets what the model has left).
    """
    body = _integers(body, endpoint)
    echo = parse_echo(body, endpoint)
    if echo == "prompt_only":  # max_tokens 0: one token drawn, not shown
        body = {**body, **{k: 1 for k in _MAX_TOKENS if body.get(k) == 0}}
    beam = _use_beam_search(body.get("use_beam_search"))
    s: dict[str, Any] = {"max_tokens": _max_tokens(body, max_tokens_limit, default_max_tokens)}
    if any(body.get(k) is not None for k in _MAX_TOKENS):
        s["strict_max_tokens"] = True
    if body.get("n") is not None:
        s["n"] = _int_in(body, "n", max_n, "n_out_of_range")
    elif beam:
        raise FieldError(
            "invalid_field",
            f"use_beam_search needs n, the beam width: give an integer in 1..{max_n}",
        )
    _best_of(body.get("best_of"), s.get("n", 1), beam)
    for key, (allowed, ok, convert) in _RULES.items():
        if (value := body.get(key)) is not None:
            if not ok(value):
                raise FieldError("invalid_field", f"{key} must be {allowed}, got {show(value)}")
            if beam or key not in BEAM_ONLY:
                s[key] = convert(value)
            elif not _same(value, BEAM_ONLY[key]):
                raise FieldError(
                    "unsupported_field",
                    f'{key} applies to beam search only; add "use_beam_search": true, or '
                    f"remove {key}",
                )
    if body.get("logprobs") is not None:
        s["logprobs"], top = _logprobs(body["logprobs"], endpoint)
        if top > 1 or (top and not beam):  # a beam's hypotheses carry their own tokens'
            s["top_logprobs"] = top
    _top_logprobs(s, body, endpoint)
    if echo and s.get("logprobs"):  # the prompt's tokens carry logprobs too (as vLLM)
        s["prompt_logprobs"] = max(s.get("prompt_logprobs") or 0, s.get("top_logprobs", 0))
    if beam:
        s["use_beam_search"] = True
    try:
        engine_params(s, {})
    except (ValueError, TypeError) as e:
        raise FieldError("invalid_field", str(e)) from None
    return s


# How a beam search takes the sampling dict's keys (`SamplingField.beam`): the BeamSearchParams
# field each becomes; the fields of no effect on it (it is deterministic), and those it refuses
# unless at their default; and its own fields, with the defaults a sampled line may give them at.
_BEAM_PARAMS = {
    **{k: f.beam_name or k for k, f in SAMPLING_FIELDS.items() if f.beam in ("beams", "group")},
    **{k: k for k, f in LINE_FIELDS.items() if f.beam == "only"},
}
NO_EFFECT_ON_BEAMS = tuple(k for k, f in SAMPLING_FIELDS.items() if f.beam == "ignored")
_REFUSED_BY_BEAMS = {k: f for k, f in SAMPLING_FIELDS.items() if f.beam == "refused"}
BEAM_ONLY: dict[str, Any] = {k: f.default for k, f in LINE_FIELDS.items() if f.beam == "only"}


def engine_params(sampling: dict, defaults: dict[str, Any]) -> SamplingParams | BeamSearchParams:
    """The engine's params of a line's checked `sampling` laid over the job's `defaults`: a
    BeamSearchParams when the line asks for beam search, else a SamplingParams.

    Raises FieldError for what a beam search cannot honour (stop strings, the line's or the
    job's default ones), ValueError or TypeError for a value the engine refuses.
    """
    s = {**defaults, **sampling}
    if not sampling.get("use_beam_search"):
        return SamplingParams(**s)
    if sampling.get("stop"):
        raise FieldError(
            "unsupported_field",
            "stop strings do not end a beam search (it matches stop tokens only); remove stop "
            "and use stop_token_ids",
        )
    if s.get("stop"):
        raise FieldError(
            "unsupported_field",
            "the job's default stop strings (--stop, recipe sampling.stop) do not end a beam "
            'search (it matches stop tokens only); give this line "stop": [] and '
            "stop_token_ids, or run it without the default",
        )
    ignored = {"use_beam_search", *NO_EFFECT_ON_BEAMS}
    ignored |= {k for k, f in _REFUSED_BY_BEAMS.items() if k in s and f.at_default(s[k])}
    for key in s.keys() - _BEAM_PARAMS.keys() - ignored:  # a field not mapped: never dropped
        raise FieldError("unsupported_field", f"{key} is not supported with beam search")
    return BeamSearchParams(**{_BEAM_PARAMS[k]: v for k, v in s.items() if k in _BEAM_PARAMS})


def _use_beam_search(value: Any) -> bool:
    if value is None or isinstance(value, bool):
        return bool(value)
    raise FieldError("invalid_field", f"use_beam_search must be true or false, got {show(value)}")


def as_int(value: Any) -> Any:
    """An integer field's value: a float with no fractional part (4.0) as the integer it is;
    anything else as it came, for the field's own check to judge."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _integers(body: dict, endpoint: str) -> dict:
    """`body` with its integer fields' integral floats as integers; FieldError for one that has a
    fractional part (4.5), naming it."""
    keys = [k for k in INTEGER_FIELDS if isinstance(body.get(k), float)]
    if endpoint == "chat" and "logprobs" in keys:  # chat's logprobs is true or false
        keys.remove("logprobs")
    for key in keys:
        if math.isfinite(body[key]) and not body[key].is_integer():
            raise FieldError(
                "invalid_field",
                f"{key} must be an integer, got {show(body[key])}, which has a fractional part",
            )
    return {**body, **{k: as_int(body[k]) for k in keys}} if keys else body


def check_max_tokens(value: Any, high: int | None = None, key: str = "max_tokens") -> int:
    """`value` as a max_tokens: an integer (4.0 counts as 4) from 1 to `high` (no upper bound
    when None). The one range of a job's lines and a sweep's workloads.

    Raises FieldError: `invalid_field` for what is no integer, `max_tokens_out_of_range` for
    one outside the range.
    """
    value = as_int(value)
    want = f"{MIN_MAX_TOKENS}..{high}" if high is not None else f">= {MIN_MAX_TOKENS}"
    msg = f"{key} must be an integer {'in ' if high is not None else ''}{want}, got {show(value)}"
    if not is_int(value):
        fraction = isinstance(value, float) and math.isfinite(value)
        raise FieldError(
            "invalid_field", msg + (", which has a fractional part" if fraction else "")
        )
    if value < MIN_MAX_TOKENS or (high is not None and value > high):
        raise FieldError("max_tokens_out_of_range", msg)
    return value


_MAX_TOKENS = ("max_tokens", *LINE_FIELDS["max_tokens"].aliases)  # a line's names for it


def _max_tokens(body: dict, high: int, default: int) -> int:
    given = [k for k in _MAX_TOKENS if body.get(k) is not None]
    values = {check_max_tokens(body[k], high, k) for k in given}
    if len(values) > 1:
        raise FieldError("invalid_field", "max_tokens and max_completion_tokens differ; give one")
    return values.pop() if values else min(default, high)


def _int_in(body: dict, key: str, high: int, code: str) -> int:
    value = body[key]
    msg = f"{key} must be an integer in 1..{high}, got {show(value)}"
    if not is_int(value):
        raise FieldError("invalid_field", msg)
    if not 1 <= value <= high:
        raise FieldError(code, msg)
    return value


def _best_of(value: Any, n: int, beam: bool) -> None:
    if value is None or (is_int(value) and value == n):
        return
    if beam:
        raise FieldError(
            "unsupported_field",
            f"with use_beam_search, n is the beam width and every beam is returned; remove "
            f"best_of or set it to n ({n})",
        )
    if is_int(value) and value > n:
        raise FieldError(
            "unsupported_field", f"best_of > n is not supported; remove best_of or set {n}"
        )
    raise FieldError("invalid_field", f"best_of must be an integer >= n ({n}), got {show(value)}")


def _logprobs(value: Any, endpoint: str) -> tuple[bool, int]:
    """A line's `logprobs` as (the sampled tokens' logprobs, how many top tokens): chat's true
    or false; completions' integer N (the sampled token's and the N most likely, as OpenAI's
    completions), or true (the sampled token's) or false."""
    if isinstance(value, bool):
        return value, 0
    if is_int(value) and 0 <= value <= MAX_LOGPROBS and endpoint == "completion":
        return True, value
    allowed = "true or false" if endpoint == "chat" else f"an integer in 0..{MAX_LOGPROBS}"
    raise FieldError("invalid_field", f"logprobs must be {allowed}, got {show(value)}")


def _top_logprobs(s: dict, body: dict, endpoint: str) -> None:
    """Chat's `top_logprobs` needs `logprobs: true` (OpenAI refuses it without); completions
    give the number as `logprobs` instead."""
    if body.get("top_logprobs") is None or "top_logprobs" not in s:
        return
    if endpoint == "completion":
        raise FieldError(
            "unsupported_field",
            "top_logprobs is a chat field; a completions line asks for N top tokens with "
            '"logprobs": N',
        )
    if s["top_logprobs"] and not s.get("logprobs"):
        raise FieldError("invalid_field", 'top_logprobs needs "logprobs": true')


def parse_echo(body: dict, endpoint: str) -> str | None:
    """Completions' `echo`: "echo" (the prompt's text, and with logprobs its tokens', before
    the completion's), "prompt_only" (with `max_tokens: 0`: the prompt alone, OpenAI's scoring
    form; the engine draws one token, which the record leaves out, as vLLM) or None. Chat
    lines may give it false only."""
    value = body.get("echo")
    if value is None or value is False:
        return None
    if not isinstance(value, bool):
        raise FieldError("invalid_field", f"echo must be true or false, got {show(value)}")
    if endpoint == "chat":
        raise FieldError(
            "unsupported_field", "echo is supported on completions lines; remove it from chat"
        )
    zero = any(is_int(v := as_int(body.get(k))) and v == 0 for k in _MAX_TOKENS)
    return "prompt_only" if zero else "echo"


def _same(a: Any, b: Any) -> bool:
    return isinstance(a, bool) == isinstance(b, bool) and a == b


def is_int(value: Any) -> bool:
    """True for an int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_text(value: str) -> bool:
    """True unless the string holds lone surrogates (from JSON escapes), which UTF-8 cannot hold."""
    return _SURROGATE.search(value) is None


def show(value: Any) -> str:
    """A short description of a value for an error message (never a huge or deep repr)."""
    if isinstance(value, dict | list):
        return f"{'an object' if isinstance(value, dict) else 'a list'} of {len(value)}"
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _is_num(v: Any) -> bool:
    return is_int(v) or (isinstance(v, float) and math.isfinite(v))


def _is_token(v: Any) -> bool:
    return is_int(v) and 0 <= v <= MAX_TOKEN_ID


def _is_stop(v: Any) -> bool:
    stops = [v] if isinstance(v, str) else v
    ok = isinstance(stops, list) and len(stops) <= MAX_STOP
    return ok and all(isinstance(s, str) and s and is_text(s) for s in stops)


def _keep(v: Any) -> Any:
    return v


def _is_bias(v: Any) -> bool:
    """An OpenAI `logit_bias`: token ids (JSON keys: decimal strings) to finite numbers."""
    if not isinstance(v, dict) or len(v) > MAX_BIAS:
        return False
    return all(
        isinstance(k, str) and k.isascii() and k.isdigit() and int(k) <= MAX_TOKEN_ID and _is_num(b)
        for k, b in v.items()
    )


def _clamped_bias(v: dict) -> dict[int, float]:
    """Each bias clamped to [-100, 100], as OpenAI's and vLLM's servers clamp them."""
    return {int(k): min(max(float(b), -MAX_BIAS_VALUE), MAX_BIAS_VALUE) for k, b in v.items()}


# The line forms of their own: where a line takes more than the engine (top_k -1, vLLM's "off")
# or less (a few stop strings, 64-bit seeds, token ids, salts of bounded length): field -> (what
# is allowed, check, the engine's value of it).
_LINE_FORMS: dict[str, tuple[str, Callable[[Any], bool], Callable[[Any], Any]]] = {
    "top_k": ("an integer >= -1 (-1 or 0 turns it off)", lambda v: is_int(v) and v >= -1,
              lambda v: max(v, 0)),
    "seed": ("an integer in -2**63..2**64-1", lambda v: is_int(v) and -(2**63) <= v < 2**64,
             _keep),
    "stop": (f"a non-empty string or a list of up to {MAX_STOP} of them", _is_stop,
             lambda v: [v] if isinstance(v, str) else v),
    "stop_token_ids": ("a list of token ids (ints >= 0)", lambda v: isinstance(v, list)
                       and all(_is_token(t) for t in v), _keep),
    "cache_salt": (f"a non-empty string of up to {MAX_SALT} characters",
                   lambda v: isinstance(v, str) and 0 < len(v) <= MAX_SALT and is_text(v), _keep),
    "logit_bias": (f"an object of up to {MAX_BIAS} token ids (as strings) to numbers",
                   _is_bias, _clamped_bias),
    "allowed_token_ids": ("a non-empty list of token ids (ints >= 0)", lambda v: isinstance(
                          v, list) and v and all(_is_token(t) for t in v), _keep),
    "bad_words": (f"a non-empty string or a list of up to {MAX_STOP} of them", _is_stop,
                  lambda v: [v] if isinstance(v, str) else v),
}  # fmt: skip
# Fields checked by code of their own: the job's limits (max_tokens, n), the endpoint's forms.
_OWN_CHECKS = ("max_tokens", "n", "logprobs")


def _line_form(spec: SamplingField) -> tuple[str, Callable[[Any], bool], Callable[[Any], Any]]:
    """The line form of a field the line takes as the engine does: its kind and range, a float
    field's value as a float."""
    if spec.kind in ("int", "float"):
        number = is_int if spec.kind == "int" else _is_num
        convert = float if spec.kind == "float" else _keep
        return spec.describe(), lambda v: number(v) and spec.admits(v), convert
    if spec.kind == "bool":
        return spec.describe(), lambda v: isinstance(v, bool), _keep
    assert spec.kind == "choice", f"a {spec.kind} field needs a line form in _LINE_FORMS"
    return spec.describe(), lambda v: any(_same(v, c) for c in spec.choices), _keep


# Every sampling field checked by one rule, in field order: field -> (allowed, check, conversion).
_RULES = {
    name: _LINE_FORMS.get(name) or _line_form(spec)
    for name, spec in LINE_FIELDS.items()
    if name not in _OWN_CHECKS
}


def accepted(name: str) -> str:
    """What a line may give for sampling field `name`, in the words of its check's error."""
    if name in _RULES:
        return _RULES[name][0]
    return {
        "max_tokens": "an integer in 1..max_model_len",
        "n": "an integer in 1..16",
        "logprobs": f"chat: true or false; completions: an integer in 0..{MAX_LOGPROBS}, true "
        "or false",
    }[name]

"""`SamplingField`: what pagedctl knows about one field of a request's params.

Every field of `SamplingParams` and `BeamSearchParams` carries one as its dataclass metadata, as
`EngineConfig`'s settings carry their `Setting`. The params check themselves with it, and the rest
is made from it: the request lines' fields, their checks and their table in docs/jobs.md, the
recipe keys and flags that set a job's defaults, how a sampled request becomes a beam search, and
which sequences may run a multi-step decode window. Adding a sampling field is its declaration
and the code that acts on it (the sampler, the scheduler).
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

KINDS = ("int", "float", "bool", "str", "strs", "ints", "bias", "choice")
LIST_KINDS = ("strs", "ints", "bias")  # kept as tuples
BEAM_MODES = ("beams", "group", "ignored", "refused", "only")
_TYPE_WORDS = {  # what a type error says a field must be
    "int": "an integer",
    "float": "a number",
    "bool": "a bool",
    "str": "a string",
    "strs": "a string or a list of strings",
    "ints": "integers",
    "bias": "token ids mapped to finite numbers",
}
_LINE_WORDS = {  # JSON's
    **_TYPE_WORDS,
    "bool": "true or false",
    "ints": "a list of integers",
    "bias": "an object of token ids to numbers",
}


@dataclass(frozen=True)
class SamplingField:
    """What the rest of pagedctl knows about one field of `SamplingParams` or `BeamSearchParams`.

    Attributes:
        help: what it does, in a request line's words (the job's field table, docs/jobs.md).
        kind: "int", "float", "bool", "str", "strs" (a string or a list of strings, kept as a
            tuple), "ints" (a list of integers, kept as a tuple), "bias" (token ids mapped to
            numbers, kept as a tuple of (id, number) pairs by id) or "choice".
        default: the field's default (MISSING: it has none).
        low, high: inclusive bounds of a number (`low_open`: the low bound is excluded).
        finite: a number must be finite (checked with its type).
        note: what an error says after the range ("0 disables it").
        choices: the values a "choice" takes.
        aliases: other names a request line may give it by (OpenAI's `max_completion_tokens`).
        line: a request line may give it (False: it follows from other fields).
        beam: how a beam search takes a `SamplingParams` field: "beams" (each beam's sequence
            carries it), "group" (the beam group does, as the `BeamSearchParams` field
            `beam_name`, or of the same name), "ignored" (checked, and of no effect: beam search
            is deterministic) or "refused" (not with beam search, unless at its default).
            "only": a field of `BeamSearchParams` alone, which a sampled request takes only
            at its default.
        beam_name: the `BeamSearchParams` field a "group" field becomes, if named otherwise.
        one_step: a value other than the default needs the host between two tokens (as
            log-probabilities, gathered from each step's logits), so it keeps the sequence out
            of a multi-step decode window, which samples k tokens before the host sees any
            (`SamplingParams.multi_step`).
        shapes: a value other than the default has a logits processor reshape the sequence's
            logits before sampling (`SamplingParams.shapes_logits`, `runner.logits_processors`).
        job: a job's defaults may set it (a recipe's `sampling:` key).
        flag: the help of the `pagedctl generate` flag that sets the job's default ("": none).
    """

    help: str
    kind: str
    default: Any = MISSING
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    finite: bool = False
    note: str = ""
    choices: tuple[Any, ...] = ()
    aliases: tuple[str, ...] = ()
    line: bool = True
    beam: str = "beams"
    beam_name: str = ""
    one_step: bool = False
    shapes: bool = False
    job: bool = False
    flag: str = ""

    def __post_init__(self) -> None:
        assert self.kind in KINDS and self.beam in BEAM_MODES, self
        assert self.job or not self.flag, "a flag sets a job's default"

    @property
    def ranged(self) -> bool:
        """Whether a value of the right type may still be refused (a range, or choices)."""
        return self.kind == "choice" or self.low is not None or self.high is not None

    def describe(self) -> str:
        """What the field takes, in JSON's words: "a number in (0, 1]", 'true, false or "never"'."""
        if self.kind == "choice":
            words = [json.dumps(c) for c in self.choices]
            return ", ".join(words[:-1]) + " or " + words[-1]
        return " ".join(filter(None, (_LINE_WORDS[self.kind], self.bounds()))) + self._note()

    def bounds(self) -> str:
        """A number's range in words (">= 1", "in (0, 1]"); "" when it has none."""
        low, high = self.low, self.high
        if low is not None and high is not None:
            return f"in {'(' if self.low_open else '['}{low:g}, {high:g}]"
        if low is not None:
            return f"{'>' if self.low_open else '>='} {low:g}"
        return f"<= {high:g}" if high is not None else ""

    def admits(self, value: float) -> bool:
        """Whether a number lies in the field's range (NaN never does)."""
        low, high = self.low, self.high
        above = low is None or (value > low if self.low_open else value >= low)
        return above and (high is None or value <= high)

    def at_default(self, value: Any) -> bool:
        """Whether `value` is the default: equal, a bool only to a bool, a list to its tuple."""
        if isinstance(value, list):
            value = tuple(value)
        return isinstance(value, bool) == isinstance(self.default, bool) and value == self.default

    def normalize(self, value: Any) -> Any:
        """A list field's value as the tuple the params keep (a lone string as one of one;
        integers of other types, numpy's, as ints); any other value as it is."""
        if self.kind == "strs":
            return (value,) if isinstance(value, str) else tuple(value)
        if self.kind == "ints":
            return tuple(int(t) if _is_integer(t) else t for t in value)
        if self.kind == "bias":
            pairs = value.items() if isinstance(value, dict) else value
            pairs = [(int(t) if _is_integer(t) else t, b) for t, b in pairs]
            return tuple(sorted(pairs, key=lambda p: (0, p[0]) if _is_integer(p[0]) else (1, 0)))
        return value

    def type_test(self) -> Callable[[Any], bool]:
        """A test of a value's type (None passes where None is the default; a finite number
        must be finite; a choice's values are checked with the ranges)."""
        test = _TYPE_TESTS[self.kind]
        if self.finite:
            test = _finite
        if self.default is None:
            return lambda v: v is None or test(v)
        return test

    def type_error(self, name: str, value: Any) -> TypeError:
        noun = "a finite number" if self.finite else _TYPE_WORDS[self.kind]
        return TypeError(f"{name} must be {noun}, got {value!r}")

    def value_test(self) -> Callable[[Any], bool]:
        """A test of a value of the right type: in the range, or one of the choices."""
        if self.kind == "choice":
            return lambda v: v in self.choices
        return lambda v: v is None or self.admits(v)

    def value_error(self, name: str, value: Any) -> ValueError:
        if self.kind == "choice":
            return ValueError(f"{name} must be {self.describe()}, got {value!r}")
        return ValueError(f"{name} must be {self.bounds()}{self._note()}, got {value}")

    def _note(self) -> str:
        return f" ({self.note})" if self.note else ""


def sampling_field(default: Any, help: str, kind: str, **info: Any) -> Any:
    """A dataclass field whose metadata is its `SamplingField` (default MISSING: required)."""
    spec = SamplingField(help, kind, default, **info)
    return field(default=default, metadata={"sampling": spec})


def same_field(spec: SamplingField) -> Any:
    """A dataclass field that takes another class's field as it is: its spec and default."""
    return field(default=spec.default, metadata={"sampling": spec})


def specs(cls: type) -> dict[str, SamplingField]:
    """The `SamplingField` of each field of params class `cls`, in field order."""
    return {f.name: f.metadata["sampling"] for f in fields(cls) if "sampling" in f.metadata}


def params_check(table: dict[str, SamplingField]) -> Callable[[Any], None]:
    """The check of a frozen params class, made once from its fields' specs: it turns the list
    fields into tuples, then checks every type (TypeError), then every value (ValueError), each
    in field order. (Made once: a job builds params for every line.)"""
    lists = [(name, spec.normalize) for name, spec in table.items() if spec.kind in LIST_KINDS]
    types = [(name, spec, spec.type_test()) for name, spec in table.items()]
    values = [(name, spec, spec.value_test()) for name, spec in table.items() if spec.ranged]

    def check(params: Any) -> None:
        for name, normalize in lists:
            object.__setattr__(params, name, normalize(getattr(params, name)))
        for name, spec, test in types:
            if not test(value := getattr(params, name)):
                raise spec.type_error(name, value)
        for name, spec, test in values:
            if not test(value := getattr(params, name)):
                raise spec.value_error(name, value)

    return check


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_integer(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


_TYPE_TESTS = {
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "float": _is_number,
    "bool": lambda v: isinstance(v, bool),
    "str": lambda v: isinstance(v, str),
    "strs": lambda v: all(isinstance(s, str) for s in v),
    "ints": lambda v: all(_is_integer(t) for t in v),
    "bias": lambda v: all(
        len(p) == 2 and _is_integer(p[0]) and _is_number(p[1]) and math.isfinite(p[1]) for p in v
    ),
    "choice": lambda v: True,  # its values are checked with the ranges
}


def _finite(value: Any) -> bool:
    return _is_number(value) and math.isfinite(value)

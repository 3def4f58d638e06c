"""The sampling fields' one source, `SamplingField`: what is made of it agrees with it.

docs/jobs.md's table of sampling fields is the one the specs make (`table()` below prints it:
paste it there when a field changes); a beam carries only fields that beam search has; no flag
of a job's sampling defaults shadows an engine flag; a field the engine implements is no longer
listed as another API's unimplemented one.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from pagedctl.engine import (
    BEAM_ONLY_FIELDS,
    SAMPLING_FIELDS,
    SETTING_NAMES,
    SETTINGS,
    BeamSearchParams,
    SamplingField,
    SamplingParams,
)
from pagedctl.generate.fields import (
    ALIASES,
    FIELDS,
    LINE_FIELDS,
    OTHER_NAMES,
    UNSUPPORTED,
    describe,
)
from pagedctl.generate.recipe import SAMPLING_KEYS
from pagedctl.generate.validate import _line_form, accepted
from pagedctl.options import SAMPLING_FLAG_NAMES

DOCS = Path(__file__).resolve().parents[1] / "docs" / "jobs.md"


def _default(name: str) -> str:
    spec = LINE_FIELDS[name]
    value = "none" if spec.default in (None, ()) else str(spec.default)
    if isinstance(spec.default, bool):
        value = str(spec.default).lower()
    if spec.flag:
        return f"`--{name.replace('_', '-')}`, the recipe's, else {value}"
    return f"the recipe's, else {value}" if spec.job else value


def table() -> str:
    """docs/jobs.md's table of the sampling fields a line may give."""
    rows = ["| field | what it does | accepted | default |", "|---|---|---|---|"]
    for name, spec in LINE_FIELDS.items():
        names = f"`{name}`" + "".join(f" (alias `{a}`)" for a in spec.aliases)
        row = f"| {names} | {describe(name)} | {accepted(name)} | {_default(name)} |"
        rows.append(row.replace("*", r"\*"))  # 2**63 is no emphasis
    return "\n".join(rows) + "\n"


def test_the_docs_table_of_sampling_fields_is_the_specs():
    assert table() in DOCS.read_text(), "docs/jobs.md's sampling table is stale; paste:\n" + table()


def test_every_line_field_is_listed_once():
    assert set(LINE_FIELDS) | set(ALIASES) <= set(FIELDS)
    assert not set(FIELDS) & (set(UNSUPPORTED) | set(OTHER_NAMES))
    assert not set(UNSUPPORTED) & set(OTHER_NAMES)


def test_each_beam_carries_only_what_beam_search_has():
    beam_fields = set(BeamSearchParams.__dataclass_fields__)
    for name, spec in SAMPLING_FIELDS.items():
        if spec.beam in ("beams", "group"):
            assert (spec.beam_name or name) in beam_fields, name
    assert set(BEAM_ONLY_FIELDS) <= beam_fields
    assert not set(BEAM_ONLY_FIELDS) & set(SAMPLING_FIELDS)


def test_job_defaults_and_flags():
    assert set(SAMPLING_FLAG_NAMES) <= set(SAMPLING_KEYS) <= set(SAMPLING_FIELDS)
    engine_flags = {n for s in SETTING_NAMES for n in (s, *SETTINGS[s].aliases)}
    assert not set(SAMPLING_FLAG_NAMES) & engine_flags  # the engine's --seed is not the lines'
    assert "seed" in SAMPLING_KEYS and "seed" not in SAMPLING_FLAG_NAMES


def test_a_field_that_needs_the_host_every_token_keeps_out_of_a_multi_step_window():
    assert SamplingParams().multi_step and SamplingParams(logprobs=False).multi_step
    assert not SamplingParams(logprobs=True).multi_step


@pytest.mark.parametrize(
    ("params", "error"),
    [
        ({"temperature": math.nan}, "temperature must be >= 0, got nan"),
        ({"ignore_eos": 1}, "ignore_eos must be a bool, got 1"),
        ({"stop_token_ids": [1.0]}, r"stop_token_ids must be integers, got \(1.0,\)"),
        ({"cache_salt": 7}, "cache_salt must be a string, got 7"),
    ],
)
def test_params_refuse_what_their_specs_do_not_take(params, error):
    with pytest.raises((TypeError, ValueError), match=error):
        SamplingParams(**params)


def test_token_ids_of_other_integer_types_are_ints():
    np = pytest.importorskip("numpy")
    params = SamplingParams(stop_token_ids=np.array([3, 5]))
    assert params.stop_token_ids == (3, 5) and all(type(t) is int for t in params.stop_token_ids)
    assert BeamSearchParams(beam_width=2, stop_token_ids=np.array([3])).stop_token_ids == (3,)


@pytest.mark.parametrize(
    ("spec", "words", "good", "bad"),
    [
        (SamplingField("", "int", 0, low=0, note="0 is off"), "an integer >= 0 (0 is off)", 3, -1),
        (SamplingField("", "float", 1.0, low=0, low_open=True, high=2), "a number in (0, 2]", 2, 0),
        (SamplingField("", "bool", False), "true or false", True, 1),
        (SamplingField("", "choice", "a", choices=("a", True)), '"a" or true', True, 1),
    ],
)
def test_a_field_a_line_takes_as_the_engine_does_needs_no_line_form(spec, words, good, bad):
    """A new field of these kinds is checked on a line by its spec alone, in its words."""
    allowed, ok, _ = _line_form(spec)
    assert allowed == spec.describe() == words
    assert ok(good) and not ok(bad)

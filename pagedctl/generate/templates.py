"""Output paths made per run: `{input_stem}`, `{input_sha}` and `{date}` in `--output`, `--errors`,
`--summary-json` (and a recipe's `job` paths), so that one fixed command writes each night's input
to its own files.

`{date}` is the day (local time, `YYYY-MM-DD`) the job's first run started, kept in its manifest:
a run finds the manifest of an earlier run over the same input bytes and takes its day, so a
resume after midnight writes to the files it started, and a rerun of a finished job finds them.
"""

from __future__ import annotations

import glob
import string
import time
from dataclasses import dataclass
from pathlib import Path

from pagedctl.generate.runctl import read_manifest

FIELDS = {
    "input_stem": "the input's name without .jsonl and compression (`in/2026-12-06.jsonl.gz`: "
    "`2026-12-06`)",
    "input_sha": "the first 12 hex digits of the sha256 of the input's bytes",
    "date": "the day the job's first run started, YYYY-MM-DD (local time)",
}
SHA_DIGITS = 12


class TemplateError(ValueError):
    """A path template names an unknown field or is malformed (a usage error)."""


def fields_of(text: str) -> set[str]:
    """The template fields `text` names; TemplateError for anything but `{name}` of FIELDS
    (`{{` and `}}` are literal braces)."""
    names = set()
    try:
        parts = list(string.Formatter().parse(text))
    except ValueError as e:
        raise TemplateError(f"path {text!r}: {e} (write a literal brace as {{{{ or }}}})") from None
    for _, name, spec, conversion in parts:
        if name is None:
            continue
        if name in FIELDS and (spec or conversion):
            raise TemplateError(f"path {text!r}: {{{name}}} takes no format or conversion")
        if name not in FIELDS:
            known = ", ".join(f"{{{k}}}" for k in FIELDS)
            raise TemplateError(f"path {text!r}: unknown field {{{name}}}; known: {known}")
        names.add(name)
    return names


@dataclass(frozen=True)
class RunNames:
    """The values of the template fields for one input."""

    input_stem: str
    input_sha256: str  # the whole digest, as the manifest records it
    today: str

    def render(self, text: str, date: str | None = None) -> str:
        return text.format(
            input_stem=self.input_stem,
            input_sha=self.input_sha256[:SHA_DIGITS],
            date=date or self.today,
        )


def today() -> str:
    return time.strftime("%Y-%m-%d")


def job_date(output_template: str, names: RunNames) -> str:
    """The `{date}` of this input's job: the day recorded by an earlier run over the same input
    bytes whose output the template names (the newest such), else today."""
    if "date" not in fields_of(output_template):
        return names.today
    parts = [names.render(piece) for piece in _split_date(output_template)]
    pattern = "*".join(glob.escape(p) for p in parts)
    days = []
    for found in glob.glob(pattern + ".manifest.json"):
        manifest = read_manifest(Path(found))
        if manifest is None or manifest.get("input_sha256") != names.input_sha256:
            continue
        day = manifest.get("date")
        out = found.removesuffix(".manifest.json")
        if isinstance(day, str) and names.render(output_template, date=day) == out:
            days.append(day)
    return max(days) if days else names.today


def _split_date(text: str) -> list[str]:
    """The template cut at each `{date}` (literal `{{date}}` kept whole)."""
    pieces, current = [], ""
    for literal, name, _, _ in string.Formatter().parse(text):
        current += literal.replace("{", "{{").replace("}", "}}")
        if name == "date":
            pieces.append(current)
            current = ""
        elif name is not None:
            current += "{" + name + "}"
    pieces.append(current)
    return pieces

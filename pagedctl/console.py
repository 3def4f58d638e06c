"""Printing results to stdout: a Rich Console that squeezes nothing into a pipe or a log file, and
a command's tables as text tables, TSV or JSON (`--format` of `sweep`, `bench` and `capacity`)."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Sequence
from enum import Enum
from typing import Any

from rich.console import Console

WIDE = 100_000  # columns when stdout is not a terminal: in effect no limit


class Format(str, Enum):
    """What a command prints to stdout as its result."""

    table = "table"
    tsv = "tsv"
    json = "json"

    def __str__(self) -> str:  # the word, in help and in a recorded command line
        return self.value


FORMAT_HELP = (
    "What goes to stdout: table (text tables), tsv (each table as tab-separated lines, header "
    "first, after a '# TITLE' line and before an empty line; the cells as the tables show them) "
    "or json (the result document, as in the .json file). With tsv and json, progress lines go "
    "to stderr.  [default: table]"
)


def stdout_console(stderr: bool = False) -> Console:
    """A Console for stdout (or stderr): the terminal's width on a terminal; into a pipe or a
    file (a cron log), each table at its natural width and each line whole, never squeezed or
    wrapped into 80 columns. Tables must not expand to the width (Rich's default)."""
    console = Console(stderr=stderr)
    if console.is_terminal:
        return console
    return Console(stderr=stderr, width=WIDE)


def progress_console(fmt: Format) -> Console:
    """Where a command's progress lines go: stdout with its tables, stderr when stdout carries
    TSV or JSON for a program to read."""
    return stdout_console(stderr=fmt is not Format.table)


def tsv_lines(title: str, headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    """One table as TSV: `# title`, the header, a line per row (tabs and newlines in a cell
    become spaces)."""

    def line(cells: Iterable[Any]) -> str:
        return "\t".join(str(c).replace("\t", " ").replace("\n", " ") for c in cells)

    return [f"# {title}", line(headers), *(line(r) for r in rows)]


def print_tsv(tables: Iterable[tuple[str, Sequence[str], Iterable[Sequence[Any]]]]) -> None:
    """Tables as TSV on stdout, an empty line after each."""
    for title, headers, rows in tables:
        sys.stdout.write("\n".join(tsv_lines(title, headers, rows)) + "\n\n")
    sys.stdout.flush()


def print_json(doc: Any) -> None:
    """A result document as JSON on stdout (a NumPy or torch scalar as its number)."""
    sys.stdout.write(json.dumps(doc, indent=1, default=_plain) + "\n")
    sys.stdout.flush()


def _plain(value: Any) -> Any:
    return value.item() if hasattr(value, "item") else str(value)

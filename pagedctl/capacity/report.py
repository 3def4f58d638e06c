"""Tables of `pagedctl capacity`: one definition per section, printed with Rich and written as
CSV (raw values), Markdown and JSON."""

from __future__ import annotations

import csv
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table

from pagedctl.engine import format_bytes

Fmt = Callable[[object], str]


def _int(v: object) -> str:
    return "-" if v is None else f"{int(v):,}"


def _pct(v: object) -> str:
    return "-" if v is None else f"{100 * float(v):.1f}%"


def _pct2(v: object) -> str:
    return "-" if v is None else f"{100 * float(v):.2f}%"


def _x(v: object) -> str:
    return "-" if v is None else f"{float(v):.2f}x"


def _f1(v: object) -> str:
    return "-" if v is None else f"{float(v):.1f}"


def _bytes(v: object) -> str:
    return "-" if v is None else format_bytes(float(v))


def _frac(v: object) -> str:
    return "given --num-blocks" if v is None else f"{float(v):g}"


def _text(v: object) -> str:
    return "-" if v is None else str(v)


def _num(v: object) -> str:
    if v is None:
        return "n/a"
    v = float(v)
    if v == int(v) and abs(v) >= 10:
        return f"{int(v):,}"
    return f"{v:.4g}"


@dataclass
class Section:
    """One table: columns are (row key, header, formatter); rows are dicts kept as computed."""

    key: str
    title: str
    columns: list[tuple[str, str, Fmt]]
    rows: list[dict]
    notes: list[str] = field(default_factory=list)

    def cells(self) -> list[list[str]]:
        return [[fmt(row.get(k)) for k, _, fmt in self.columns] for row in self.rows]


POOL_COLUMNS = [
    ("gpu_mem", "gpu mem", _frac),
    ("block_size", "block", _int),
    ("bytes_per_token", "KV B/token", _int),
    ("kv_budget_bytes", "KV budget", _bytes),
    ("num_blocks", "blocks", _int),
    ("pool_tokens", "pool tokens", _int),
    ("max_concurrency", "concurrency @max-len", _x),
]
CAPACITY_COLUMNS = [
    ("seq_len", "tokens/seq", _int),
    ("paged", "paged", _int),
    ("contiguous_same_budget", "contiguous, same budget", _int),
    ("ratio_same_budget", "ratio", _x),
    ("contiguous_whole_card", "contiguous, whole card", _int),
    ("ratio_whole_card", "ratio", _x),
]
BLOCK_COLUMNS = [
    ("block_size", "block", _int),
    ("waste_tokens", "tokens lost/seq", _f1),
    ("waste_share", "share of held", _pct),
    ("mean_held_tokens", "held tokens/seq", _f1),
    ("pool_tokens", "pool tokens", _int),
    ("sequences_held", "sequences held", _int),
]
HOST_COLUMNS = [
    ("block_size", "block", _int),
    ("swap_space_bytes", "host pool", _bytes),
    ("bytes_per_block", "KV B/block", _int),
    ("host_blocks", "host blocks", _int),
    ("host_tokens", "host tokens", _int),
    ("mean_blocks", "blocks/seq (mean)", _f1),
    ("preempted_at_mean", "preempted seqs @mean", _int),
    ("preempted_at_max_len", "preempted seqs @max-len", _int),
]
SIM_COLUMNS = [
    ("load", "load", _text),
    ("allocator", "allocator", _text),
    ("refusal_rate", "refused", _pct2),
    ("occupancy", "occupancy (held)", _pct),
    ("utilisation", "utilisation", _pct),
    ("mean_live", "live seqs", _int),
    ("held_at_refusal", "held @refusal", _pct),
    ("p5_held_at_refusal", "held @refusal, p5", _pct),
    ("internal_waste_at_refusal", "internal @refusal", _pct),
    ("external_waste_at_refusal", "external @refusal", _pct),
]
COMPARE_COLUMNS = [
    ("label", "figure", _text),
    ("reference", "reference", _num),
    ("ours", "ours", _num),
    ("diff", "diff", _text),
    ("tol", "tolerance", _text),
    ("ok", "ok", _text),
]
PROBE_COLUMNS = [
    ("what", "measured on this GPU", _text),
    ("estimate", "estimate", _text),
    ("measured", "measured", _text),
    ("diff", "diff", _text),
]


def print_sections(console: Console, header: list[str], sections: list[Section]) -> None:
    for line in header:
        console.print(line, highlight=False)
    for s in sections:
        table = Table(title=s.title, title_justify="left")
        for i, (_, head, _) in enumerate(s.columns):
            table.add_column(head, justify="left" if i == 0 else "right")
        for cells in s.cells():
            table.add_row(*cells)
        console.print(table)
        for note in s.notes:
            console.print(f"  {note}", highlight=False, soft_wrap=True)


def markdown(title: str, header: list[str], sections: list[Section]) -> str:
    out = [f"# {title}", "", *[f"{line}  " for line in header], ""]
    for s in sections:
        out += [f"## {s.title}", ""]
        out.append("| " + " | ".join(h for _, h, _ in s.columns) + " |")
        out.append("|" + "|".join("---" for _ in s.columns) + "|")
        out += ["| " + " | ".join(cells) + " |" for cells in s.cells()]
        out += [""] + [f"- {n}" for n in s.notes] + ([""] if s.notes else [])
    return "\n".join(out).rstrip() + "\n"


def write_csv(path: Path, section: Section) -> None:
    keys = list(dict.fromkeys(k for row in section.rows for k in row))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(section.rows)


def file_names(stem: str, keys: list[str]) -> list[str]:
    """The files `write_all` writes for sections `keys`: Markdown, JSON, a CSV per section."""
    return [f"{stem}.md", f"{stem}.json", *(f"{stem}-{key}.csv" for key in keys)]


def write_all(
    out_dir: Path, stem: str, title: str, header: list[str], sections: list[Section], doc: dict
) -> list[Path]:
    """`<stem>.md`, `<stem>.json` and one `<stem>-<section>.csv` per section."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [out_dir / name for name in file_names(stem, [s.key for s in sections])]
    written[0].write_text(markdown(title, header, sections))
    written[1].write_text(json.dumps(doc, indent=2, default=_jsonable) + "\n")
    for s, path in zip(sections, written[2:], strict=True):
        write_csv(path, s)
    return written


def _jsonable(v: object) -> object:
    if hasattr(v, "item"):
        return v.item()
    return str(v)

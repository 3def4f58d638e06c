"""The tracked text speaks about the software, not about how its making was organised.

Every git-tracked text file (binaries skipped; nothing else but this file) is searched for words
about the work itself, the PATTERNS below: the work's periods and tickets, workload labels, the
source documents under their working name, the design card's file name where the user's document
is docs/design.md, the workplace's tools. The patterns are spelled so that this file does not
match them itself. A random seed ("seed: 0", "the seed of the dummy
weights") is not such a word. Tracked file names are searched the same way. Skipped outside a git
checkout. README.md also stays under 10 KB.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SELF = Path(__file__).resolve()
README_LIMIT = 10_240  # bytes

_I = re.IGNORECASE
PATTERNS: list[tuple[str, re.Pattern[str]]] = [
    ("work period", re.compile(r"\bsess(?:ion)s?\b", _I)),
    ("issue number", re.compile(r"\bissues? #?\d+\b", _I)),
    ("workload label", re.compile(r"\bW[1-6]\b")),  # as a label: lower-case w4 is "4 warps"
    ("round", re.compile(r"\brounds? \d+\b|\brounds of work\b", _I)),
    (
        "source documents",
        re.compile(
            r"\bthe seed['’]s\b"  # the possessive; "the seeds" may be random ones
            r"|\bseed (?:recipes?|figures?|documents?|measurements?|workloads?)\b"
            r"|\bseed-(?:block|capacity|oversub|shared)"
            r"|\bthe seed (?:reported|measured|found|ran|run)\b",
            _I,
        ),
    ),
    ("design card", re.compile(r"\bDESIGN\.md\b")),  # docs/design.md, the user's document, is fine
    ("workplace tool", re.compile(r"\bdevice\s+tool\b", _I)),
    ("work notes", re.compile(r"\bclosing\s+note\b", _I)),
]


def matches(text: str) -> list[str]:
    """The names of the patterns found in one line."""
    return [name for name, pattern in PATTERNS if pattern.search(text)]


def tracked_files(root: Path) -> list[Path]:
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    probe = subprocess.run(
        ["git", "rev-parse", "--show-toplevel"], cwd=root, capture_output=True, text=True
    )
    if probe.returncode != 0 or Path(probe.stdout.strip()).resolve() != root.resolve():
        pytest.skip("not run from a git checkout of the project")
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True
    ).stdout
    return [root / name for name in listed.decode().split("\0") if name]


def read_text(path: Path) -> str | None:
    """The file's text, or None for a binary (a NUL byte, or not UTF-8) or a deleted file."""
    try:
        data = path.read_bytes()
    except (FileNotFoundError, IsADirectoryError):
        return None
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def findings(root: Path, files: list[Path]) -> list[str]:
    """`file:line: text` for every tracked line (and `file: (its name)`) that names the work."""
    found = []
    for path in files:
        if path.resolve() == SELF:
            continue
        rel = path.relative_to(root).as_posix()
        if matches(rel):
            found.append(f"{rel}: (its name)")
        text = read_text(path)
        if text is None:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if matches(line):
                found.append(f"{rel}:{number}: {line.strip()[:160]}")
    return found


def test_patterns_catch_the_work_and_spare_random_seeds() -> None:
    caught = [  # each with a "|" that is taken out below, so this file stays clean
        "a|s i|n s|ession 3",
        "S|essions o|f w|ork",
        "d|one (i|ssue 8)",
        "s|ee i|ssue #1|2",
        "W|1's p|ool",
        "t|he W|2-W|4 r|ecipes",
        "r|ound 2",
        "a|fter r|ounds o|f w|ork",
        "t|he s|eed's f|igures",
        "t|he s|eed’s",
        "t|he s|eed r|ecipes",
        "S|eed f|igures b|eside o|urs",
        "s|eed d|ocuments",
        "a s|eed m|easurement",
        "s|eed w|orkloads",
        "r|ecipes/s|eed-b|lock-s|ize.y|aml",
        "s|eed-c|apacity",
        "s|eed-o|versubscribed",
        "s|eed-s|hared-p|refix",
        "t|he s|eed r|eported 1|89",
        "w|hat t|he s|eed m|easured",
        "t|he s|eed r|an o|n a T|4",
        "s|ee D|ESIGN.m|d",
        "t|hrough t|he d|evice t|ool",
        "c|losing n|ote",
    ]
    spared = [
        "seed: 0",
        "the seed of the dummy weights",
        "A per-request `seed` gives the same tokens",
        "seed=_int(path, 'seed', 0)",
        "generator.manual_seed(self.seed)",
        "the seeds of each request",
        "docs/design.md",
        "sw t128 w4 s3",
        "issues are reported on the tracker",
        "round-robin",
        "a round trip of 2 ms",
        "possession",
        "the device's tools",
    ]
    caught = [s.replace("|", "") for s in caught]
    assert [s for s in caught if not matches(s)] == []
    assert [s for s in spared if matches(s)] == []


def test_no_words_about_how_the_work_was_organised() -> None:
    found = findings(ROOT, tracked_files(ROOT))
    by_folder: dict[str, int] = {}
    for entry in found:
        folder = entry.split(":")[0].split("/")[0] if "/" in entry.split(":")[0] else "(top)"
        by_folder[folder] = by_folder.get(folder, 0) + 1
    summary = ", ".join(f"{k}: {v}" for k, v in sorted(by_folder.items()))
    assert not found, f"{len(found)} lines ({summary}):\n" + "\n".join(found)


def test_readme_stays_short() -> None:
    size = (ROOT / "README.md").stat().st_size
    assert size < README_LIMIT, f"README.md is {size:,} bytes; keep it under {README_LIMIT:,}"

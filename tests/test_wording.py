"""The tracked text speaks about the software, not about how its making was organised.

Every git-tracked text file (binaries skipped; nothing else but this file) is searched for words
about the work itself: sessions, issue numbers, workload labels W1-W6, rounds, the source
documents ("the seed's figures", the seed-* recipe names, "DESIGN.md" where the user's document is
docs/design.md), the device tool, closing notes. A random seed ("seed: 0", "the seed of the dummy
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
    ("session", re.compile(r"\bsessions?\b", _I)),
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
    ("DESIGN.md", re.compile(r"\bDESIGN\.md\b")),  # docs/design.md, the user's document, is fine
    ("device tool", re.compile(r"\bdevice tool\b", _I)),
    ("closing note", re.compile(r"\bclosing note\b", _I)),
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
    caught = [
        "as in session 3",
        "Sessions of work",
        "done (issue 8)",
        "see issue #12",
        "W1's pool",
        "the W2-W4 recipes",
        "round 2",
        "after rounds of work",
        "the seed's figures",
        "the seed’s",
        "the seed recipes",
        "Seed figures beside ours",
        "seed documents",
        "a seed measurement",
        "seed workloads",
        "recipes/seed-block-size.yaml",
        "seed-capacity",
        "seed-oversubscribed",
        "seed-shared-prefix",
        "the seed reported 189",
        "what the seed measured",
        "the seed ran on a T4",
        "see DESIGN.md",
        "through the device tool",
        "closing note",
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

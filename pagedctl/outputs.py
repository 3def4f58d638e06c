"""Where the result files of `sweep`, `bench` and `capacity` go; a run never overwrites a file by
default.

Without `--out`, each run writes to a new folder of its own under the current directory,
`runs/NAME-YYYYMMDD-HHMMSS/`: NAME is the results' name (the recipe's, `--name`, or capacity's
`capacity-MODEL-CARD`), the time is when the command started (local time), and `-2`, `-3`, ... is
appended where that folder exists already (two runs started in the same second). With `--out DIR`
the files go to DIR, and a file already there is kept: the command refuses before it loads or runs
anything (exit 64, naming the file) unless `--overwrite` is given.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path

import typer
from rich.console import Console

from pagedctl.exits import EXIT_USAGE
from pagedctl.options import with_default

RUNS = Path("runs")
OVERWRITE_HELP = "Replace result files that already exist (in --out, or a file named by a flag)."


def out_help(files: str = "the result files") -> str:
    """The help of `--out`, for a command that writes `files`."""
    return with_default(
        f"Folder for {files}; a file already there is kept and the command refuses (exit 64) "
        "unless --overwrite.",
        "a new folder runs/NAME-YYYYMMDD-HHMMSS",
    )


def run_folder(name: str, started: datetime, runs: Path = RUNS) -> Path:
    """A new folder `runs/NAME-YYYYMMDD-HHMMSS[-N]`, created here (so two runs never share one)."""
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.") or "run"
    base = f"{stem}-{started:%Y%m%d-%H%M%S}"
    runs.mkdir(parents=True, exist_ok=True)
    for n in itertools.count(1):
        path = runs / (base if n == 1 else f"{base}-{n}")
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path
    raise AssertionError("unreachable")


class ResultFolder:
    """One run's folder for its result files: `--out` as given, else a new run folder (made on
    first use, so that a run that fails before writing leaves none)."""

    def __init__(self, out: Path | None, name: str, overwrite: bool = False) -> None:
        self.out, self.name, self.overwrite = out, name, overwrite
        self.started = datetime.now()
        self._path: Path | None = None

    def refuse_existing(self, names: Iterable[str], files: Iterable[tuple[Path, str]] = ()) -> None:
        """Exit 64 if a result file would replace one that exists, unless --overwrite: `names`
        are files in the folder (only --out can hold any), `files` are (path, flag) pairs of
        files named by a flag, such as `--output-json`."""
        if self.overwrite:
            return
        taken = [(self.out / n, "--out") for n in names if self.out is not None]
        taken = [(p, flag) for p, flag in [*taken, *files] if p.exists()]
        if not taken:
            return
        (path, flag), more = taken[0], len(taken) - 1
        others = f" (and {more} more of this run's files)" if more else ""
        Console(stderr=True).print(
            f"error: {path} exists{others}; pass --overwrite to replace it, or another {flag}",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
        raise typer.Exit(EXIT_USAGE)

    def path(self) -> Path:
        """The folder, created if need be."""
        if self._path is None:
            if self.out is None:
                self._path = run_folder(self.name, self.started)
            else:
                self.out.mkdir(parents=True, exist_ok=True)
                self._path = self.out
        return self._path

"""Where a job writes: the output and errors files named from the input (told apart from it by
identity, not by path), and each file checked writable before anything is loaded."""

from __future__ import annotations

import os
from pathlib import Path

from pagedctl.exits import EXIT_USAGE
from pagedctl.generate.errors import JobExit
from pagedctl.generate.recipe import JobSettings


def output_paths(settings: JobSettings) -> tuple[Path, Path]:
    """`<stem>.out.jsonl` and `<stem>.errors.jsonl` beside the input unless given; the errors
    file follows a given output (`-o x.out.jsonl` alone: `x.errors.jsonl` beside it)."""
    src = settings.input
    stem = base_name(src.name)
    out = settings.output or src.with_name(f"{stem}.out.jsonl")
    for path in (out, settings.errors):
        if path is not None and path.suffix in COMPRESSED:
            raise JobExit(
                EXIT_USAGE,
                f"{path}: results are written uncompressed, one durable line at a time (a torn "
                "compressed tail could not be repaired on resume); compress the file after the "
                "job, or name it .jsonl",
            )
    if settings.errors is not None:
        err = settings.errors
    elif settings.output is not None:
        out_stem = base_name(out.name).removesuffix(".out")
        err = out.with_name(f"{out_stem}.errors.jsonl")
    else:
        err = src.with_name(f"{stem}.errors.jsonl")
    ids = {identity(p) for p in (src, out, err)}
    if len(ids) < 3:  # by path, and by file: a hard link or a symlink to the input is the input
        raise JobExit(EXIT_USAGE, f"input {src}, output {out} and errors {err} must all differ")
    return out, err


COMPRESSED = (".gz", ".bz2", ".xz", ".zst")


def base_name(name: str) -> str:
    """`in.jsonl.gz` -> `in`: outputs are named after the input without its compression."""
    for suffix in COMPRESSED:
        name = name.removesuffix(suffix)
    return name.removesuffix(".jsonl").removesuffix(".json")


def identity(path: Path) -> tuple:
    """An existing file's (device, inode), else its resolved path."""
    try:
        st = path.stat()
    except OSError:
        return (str(path.resolve()),)
    return (st.st_dev, st.st_ino)


def unwritable(path: Path, regular: bool) -> str | None:
    """Why `path` cannot be written as a file, or None; a missing folder counts as creatable."""
    if path.is_dir():
        return "it is a folder; give a file path"
    if path.exists():
        if regular and not path.is_file():
            return "it is not a regular file"
        if not os.access(path, os.W_OK):
            return "it is not writable (its mode, or a read-only disk)"
        return None
    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        return f"{folder} is not a folder"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"{folder} is not writable (its mode, or a read-only disk)"
    return None


def check_writable(paths: list[tuple[str, Path | None, bool]]) -> None:
    """Refuse (64) the first of `(what, path, must be a regular file)` that cannot be written
    now; then create the folders they need (only once every path is known to be usable)."""
    paths = [(what, path, regular) for what, path, regular in paths if path is not None]
    for what, path, regular in paths:
        try:
            problem = unwritable(path, regular)
        except OSError as e:
            problem = e.strerror or str(e)
        if problem is not None:
            raise JobExit(EXIT_USAGE, f"cannot write the {what} {path}: {problem}")
    for what, path, _ in paths:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise JobExit(EXIT_USAGE, f"cannot write the {what} {path}: {e.strerror}") from None

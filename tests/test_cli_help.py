"""Every command's `--help`: each engine flag shows its default, and no bracketed text is lost.

Help is plain click text (`rich_markup_mode=None`): Rich markup would take `[default: 16 tokens]`
or any other square-bracketed help for a style tag and drop it.
"""

from __future__ import annotations

import re

import pytest
import typer.main
from typer.testing import CliRunner

from pagedctl.cli import app
from pagedctl.engine.core.config import NAMES, show_default
from pagedctl.options import flag_of

ROOT = typer.main.get_command(app)
ENGINE_COMMANDS = (("generate",), ("bench",), ("sweep",))


def _paths(cmd, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out = [path]
    if hasattr(cmd, "commands"):  # a group (typer brings its own click: no isinstance)
        for name, sub in cmd.commands.items():
            out += _paths(sub, (*path, name))
    return out


PATHS = _paths(ROOT)


def _command(path: tuple[str, ...]):
    cmd = ROOT
    for name in path:
        cmd = cmd.commands[name]
    return cmd


def _help(path: tuple[str, ...], width: int = 1000) -> str:
    res = CliRunner().invoke(
        app, [*path, "--help"], terminal_width=width, max_content_width=width, color=False
    )
    assert res.exit_code == 0, res.output
    return res.output


def _flat(text: str) -> str:
    return " ".join(text.split())


def _entries(text: str) -> dict[str, str]:
    """Each option's help entry (its flags, then its help), whitespace collapsed, by its first
    flag."""
    entries: dict[str, list[str]] = {}
    current = None
    assert "Options:" in text, "not click's plain layout"
    for line in text.split("Options:", 1)[1].splitlines():
        if re.match(r"^  -", line):
            current = line.split()[0].rstrip(",")
            entries[current] = [line]
        elif current and line.startswith("   "):
            entries[current].append(line)
        elif line.strip():
            current = None  # the next section ("Commands:")
    return {k: _flat("\n".join(v)) for k, v in entries.items()}


def test_every_command_is_covered():
    names = {" ".join(p) for p in PATHS}
    assert {"generate", "sweep", "capacity", "bench", "bench scheduler", "models list"} <= names


@pytest.mark.parametrize("path", ENGINE_COMMANDS, ids=" ".join)
def test_every_engine_flag_shows_its_default(path):
    entries = _entries(_help(path))
    for name in NAMES:
        entry = entries[flag_of(name)]
        assert f"[default: {show_default(name)}]" in entry, entry
        assert "[default: (" not in entry, entry  # click's parentheses around a text default


@pytest.mark.parametrize("path", PATHS, ids=lambda p: " ".join(p) or "pagedctl")
def test_no_bracketed_text_is_lost(path):
    out = _help(path)
    flat = _flat(out)
    assert "─" not in out and "╭" not in out  # click's plain layout, not Rich's panels
    cmd = _command(path)
    texts = [cmd.help or ""] + [getattr(p, "help", None) or "" for p in cmd.params]
    for text in texts:
        for bracketed in re.findall(r"\[[^\]]*\]", text):
            assert _flat(bracketed) in flat, f"{bracketed!r} missing from {' '.join(path)} --help"
    for p in cmd.params:
        if isinstance(getattr(p, "show_default", None), str):
            assert p.show_default in flat, f"{p.opts[0]}'s default missing"


@pytest.mark.parametrize("path", ENGINE_COMMANDS, ids=" ".join)
def test_wrapping_loses_no_default(path):
    assert _help(path, 80).count("[default:") == _help(path).count("[default:")


def test_bench_alone_prints_the_same_help():
    res = CliRunner().invoke(app, ["bench"], terminal_width=1000, max_content_width=1000)
    assert res.exit_code == 0, res.output
    assert res.output.strip() == _help(("bench",)).strip()


def _value_columns(text: str) -> list[str]:
    """The first column (flags or argument name, with their value's name) of each entry of the
    Arguments and Options sections."""
    columns, section = [], False
    for line in text.splitlines():
        if line in ("Arguments:", "Options:"):
            section = True
        elif line and not line.startswith(" "):
            section = False  # "Commands:", or the usage text
        elif section and re.match(r"^  \S", line):
            columns.append(re.split(r"\s{2,}", line.strip(), maxsplit=1)[0])
    return columns


@pytest.mark.parametrize("path", PATHS, ids=lambda p: " ".join(p) or "pagedctl")
def test_values_are_named_in_words_not_python_types(path):
    """`--stop TEXT`, `--output PATH`, `INPUT`: never typer's `<list[str]>` or `<int range>`."""
    columns = _value_columns(_help(path))
    assert columns, "no option found"
    for column in columns:
        assert not re.search(r"<[^>]*>", column), f"{' '.join(path)} --help: {column!r}"
    if path == ("generate",):
        assert {"INPUT", "--stop TEXT", "--max-tokens INTEGER", "-o, --output PATH"} <= set(columns)
    if path == ("sweep",):
        assert "--block-size VALUES" in columns


def test_engine_flag_help_says_what_it_does_on_the_cpu():
    entries = _entries(_help(("generate",)))
    assert "ignored on the CPU" in entries["--cuda-graphs"]
    assert "traceback" in entries["--debug"] and "invariants" in entries["--debug"]


def test_version_flag_prints_the_version_without_torch():
    import subprocess
    import sys

    import pagedctl

    code = (
        "import atexit, sys; "
        "atexit.register(lambda: print('torch' in sys.modules, file=sys.stderr)); "
        "sys.argv = ['pagedctl', '--version']; from pagedctl.cli import main; main()"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout == f"pagedctl {pagedctl.__version__}\n"
    assert res.stderr.strip() == "False"  # torch was not imported

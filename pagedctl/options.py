"""Command-line options made from `EngineConfig` and `SamplingParams`: one flag per engine
setting, and per sampling field a job's default may set, never written twice.

`engine_flags` adds the settings' flags to a command (`generate`, `bench`), `axis_flags` adds them
as comma-separated sweep axes (`sweep`). Flag names are the settings' names with dashes, as vLLM's
are (`--gpu-memory-utilization`, `--num-gpu-blocks-override`); each alias is a second spelling
(`--gpu-mem`, `--num-blocks`). `sampling_flags` adds `generate`'s flags for the sampling defaults
of its lines (`--temperature`, `--stop`, ...: the fields whose `SamplingField` has a `flag`). A
flag left out is None, so a recipe's value stands.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable
from typing import Any

import typer

from pagedctl.engine import (
    RUNTIME_SETTING_NAMES,
    SAMPLING_FIELDS,
    SETTING_NAMES,
    SETTINGS,
    describe_setting,
    setting_default,
)

_TYPES = {"int": int, "float": float, "bool": bool, "str": str, "bytes": str, "choice": str}
# What a flag's value is, in help: click's words for its types, as `--max-tokens INTEGER`.
METAVARS = {"int": "INTEGER", "float": "FLOAT", "str": "TEXT", "Path": "PATH", "bytes": "SIZE"}
METAVARS["choice"] = METAVARS["list[str]"] = METAVARS["str"]
AXIS_METAVAR = "VALUES"  # a sweep axis: one value or comma-separated values


def flag_names(name: str) -> list[str]:
    """`--the-name` and `--an-alias` for setting `name`."""
    return ["--" + n.replace("_", "-") for n in (name, *SETTINGS[name].aliases)]


def flag_of(name: str) -> str:
    """The flag a message names for setting `name`."""
    return flag_names(name)[0]


def with_default(help: str, default: str) -> str:
    """`help` ending in its default as a plain `[default: X]` (pass `show_default=False`): click
    would put a default given as text in parentheses, its mark of a description, not a value."""
    return f"{help}  [default: {default}]"


def _help(name: str, more: str = "") -> str:
    """The help line of setting `name`, ending in its default as click writes one.

    click puts a default given as text in parentheses ("[default: (16 tokens)]", its mark of a
    description rather than a value); written here, it reads as the value it is, and stays plain
    text: help is never parsed as Rich markup (`rich_markup_mode=None` in `pagedctl.cli`).
    """
    s = SETTINGS[name]
    unit = f" ({s.unit})" if s.unit and s.unit != "fraction" else ""
    return with_default(f"{s.help.rstrip('.')}{unit}.{more}", setting_default(name))


def _engine_option(name: str) -> tuple[type, Any]:
    s = SETTINGS[name]
    decls = flag_names(name)
    if s.kind == "bool":
        decls = [f"{d}/--no-{d[2:]}" for d in decls]
    metavar = None if s.kind == "bool" else METAVARS[s.kind]
    info = typer.Option(None, *decls, help=_help(name), show_default=False, metavar=metavar)
    return _TYPES[s.kind] | None, info


def _axis_option(name: str) -> tuple[type, Any]:
    more = f" One value, or an axis of comma-separated values, each {describe_setting(name)}."
    return str | None, typer.Option(
        None, *flag_names(name), help=_help(name, more), show_default=False, metavar=AXIS_METAVAR
    )


def engine_flags(names: Iterable[str] = SETTING_NAMES) -> Callable:
    """Decorator: the command also takes a flag per setting in `names`; they reach it as one
    keyword, `engine`, a dict of the flags that were given (by setting name)."""
    return _with_options(list(names), _engine_option, "engine")


def axis_flags(names: Iterable[str] = RUNTIME_SETTING_NAMES) -> Callable:
    """Decorator: the command takes each setting in `names` as an axis flag (text, comma-
    separated); they reach it as one keyword, `axes`, a dict of the flags that were given."""
    return _with_options(list(names), _axis_option, "axes")


def _sampling_option(name: str) -> tuple[type, Any]:
    """The flag of a job's default of sampling field `name`: a number shows its default; a list
    is repeated (`--stop A --stop B`); a bool is a plain switch (`--ignore-eos`)."""
    spec = SAMPLING_FIELDS[name]
    flag, help = "--" + name.replace("_", "-"), spec.flag
    if spec.kind in ("int", "float"):
        help = with_default(help, str(spec.default))
    kind = {"strs": list[str], "bool": bool}.get(spec.kind) or _TYPES[spec.kind]
    return kind | None, typer.Option(None, flag, help=help, show_default=False)


SAMPLING_FLAG_NAMES = tuple(name for name, spec in SAMPLING_FIELDS.items() if spec.flag)


def sampling_flags(names: Iterable[str] = SAMPLING_FLAG_NAMES) -> Callable:
    """Decorator: the command also takes a flag per sampling field in `names`; they reach it as
    one keyword, `sampling`, a dict of the flags that were given (by field name)."""
    return _with_options(list(names), _sampling_option, "sampling")


def _with_options(names: list[str], make: Callable, keyword: str) -> Callable:
    def decorate(command: Callable) -> Callable:
        sig = inspect.signature(command, eval_str=True)
        own = [p for p in sig.parameters.values() if p.name != keyword]
        made = {name: make(name) for name in names}
        extra = [
            inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=info, annotation=kind)
            for n, (kind, info) in made.items()
        ]

        @functools.wraps(command)
        def wrapper(**kwargs: Any) -> Any:
            given = {n: kwargs.pop(n) for n in names if kwargs.get(n) is not None}
            for n in names:
                kwargs.pop(n, None)
            return command(**kwargs, **{keyword: given})

        hints = {p.name: p.annotation for p in own if p.annotation is not p.empty}
        hints.update({n: kind for n, (kind, _) in made.items()})
        wrapper.__signature__ = sig.replace(parameters=own + extra)
        wrapper.__annotations__ = hints
        return wrapper

    return decorate


def plain_metavars(command: Any) -> None:
    """Name every value of `command` and its subcommands in words, where none was named: an
    option's by click's name for its type (`--stop TEXT`, `--output PATH`), an argument by its
    own name (INPUT). Typer's own choice, the Python type (`<list[str]>`, `<int range>`), is
    not a word a user knows; a range shows in the help's `[x>=1]` already."""
    for param in command.params:
        describe_type = getattr(param, "type_descriptor", None)
        if describe_type is None:  # a typer that writes click's metavars itself
            continue
        if param.param_type_name == "argument":
            param.metavar = param.metavar or param.name.upper()
            param.display_type_rich = _no_type  # typer adds the type after an argument's name
        elif param.metavar is None and not param.is_flag and not param.count:
            param.metavar = _metavar(describe_type)
    for sub in getattr(command, "commands", {}).values():
        plain_metavars(sub)


def _metavar(describe_type: Any) -> str:
    if describe_type.is_choice:
        return "[" + "|".join(str(c) for c in describe_type.choices or ()) + "]"
    annotation = describe_type.annotation
    name = getattr(annotation, "__name__", None) or str(annotation)
    if describe_type.is_list:
        name = f"list[{getattr(annotation, '__args__', (str,))[0].__name__}]"
    return METAVARS.get(name, "VALUE")


def _no_type(ctx: Any) -> None:
    return None

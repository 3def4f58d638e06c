"""The `pagedctl` command line: one folder per command; this module only wires them.

`main` makes the process safe to stop and to print before anything heavy is imported: the
commands (and `app`, built on first use) are imported only then.
"""

from __future__ import annotations

import functools
import itertools
import json
import signal
import sys
from typing import Any

from pagedctl.exits import EXIT_SIGINT, EXIT_TEMPFAIL, EXIT_USAGE

_CLICK_USAGE = 2  # the code click gives its usage errors (UsageError, BadParameter, ...)


def _json_logs(argv: list[str]) -> bool:
    """Whether the command line asks for JSON lines on stderr (`--log-format json`)."""
    return "--log-format=json" in argv or any(
        a == "--log-format" and b == "json" for a, b in itertools.pairwise(argv)
    )


def _error(code: int, message: str) -> None:
    """The last line of a failed command: text, or the JSON `error` event with its exit code."""
    if _json_logs(sys.argv):
        line = {"level": "error", "event": "error", "exit_code": code, "message": message}
        print(json.dumps(line), file=sys.stderr, flush=True)
    else:
        print(f"error: {message}", file=sys.stderr, flush=True)


def _stop_early(signum: int, frame: Any) -> None:
    """SIGTERM (and SIGINT while the commands are imported) before a command takes them over:
    the same exit a command gives (75, 130), not a silent death or a traceback from an import."""
    name = signal.Signals(signum).name
    _error(
        EXIT_SIGINT if signum == signal.SIGINT else EXIT_TEMPFAIL,
        f"stopped by {name} before any work: rerun the same command",
    )
    raise SystemExit(EXIT_SIGINT if signum == signal.SIGINT else EXIT_TEMPFAIL)


def _robust_streams() -> None:
    """Print any path on any terminal: a character the terminal's encoding (ASCII under LANG=C
    or PYTHONIOENCODING=ascii) cannot show is written as a backslash escape, not a crash."""
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(errors="backslashreplace")


@functools.cache
def _app() -> Any:
    import typer
    from typer.core import TyperGroup

    from pagedctl import __version__
    from pagedctl.bench.cmd import bench_app
    from pagedctl.capacity.cmd import bench_capacity_sim, capacity
    from pagedctl.generate.cmd import generate
    from pagedctl.models.cmd import models_app
    from pagedctl.options import plain_metavars
    from pagedctl.sweep.cmd import sweep

    class PagedctlGroup(TyperGroup):
        """The command group, with one exit-code table (`pagedctl.exits`) for every command: a
        flag that does not parse is a usage error like any other (64), not click's 2. Every
        command's values are named in words in its help (`plain_metavars`)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            plain_metavars(self)

        def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
            if not standalone_mode:
                return super().main(*args, standalone_mode=False, **kwargs)
            try:
                code = super().main(*args, standalone_mode=False, **kwargs)
            except (typer.Abort, KeyboardInterrupt):
                _error(EXIT_SIGINT, "interrupted")
                sys.exit(EXIT_SIGINT)
            except Exception as e:
                if not (hasattr(e, "show") and isinstance(getattr(e, "exit_code", None), int)):
                    raise
                if type(e).__name__ == "NoArgsIsHelpError":  # `pagedctl` alone: the help
                    e.show()
                    sys.exit(0)
                code = EXIT_USAGE if e.exit_code == _CLICK_USAGE else e.exit_code
                if _json_logs(sys.argv) and hasattr(e, "format_message"):
                    _error(code, e.format_message())
                else:
                    e.show()  # click's own message: "Usage: ... Error: No such option: --x"
                sys.exit(code)
            sys.exit(code if isinstance(code, int) else 0)

    app = typer.Typer(
        cls=PagedctlGroup,
        name="pagedctl",
        help="Offline batch LLM inference and KV-cache capacity planning on a paged engine.",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
        rich_markup_mode=None,
    )

    def print_version(value: bool) -> None:
        if value:
            typer.echo(f"pagedctl {__version__}")
            raise typer.Exit()

    @app.callback()
    def root(
        version: bool = typer.Option(
            False,
            "--version",
            help="Print the pagedctl version and exit.",
            is_eager=True,
            callback=print_version,
        ),
    ) -> None:
        pass  # the options of `pagedctl` itself; the help is the app's

    app.command("generate")(generate)
    app.command("sweep")(sweep)
    app.command("capacity")(capacity)
    app.add_typer(bench_app, name="bench")
    app.add_typer(models_app, name="models")
    bench_app.command("capacity-sim")(bench_capacity_sim)

    @app.command()
    def version() -> None:
        """Print the pagedctl version."""
        print_version(True)

    return app


def __getattr__(name: str) -> Any:
    if name == "app":
        return _app()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main() -> None:
    _robust_streams()
    previous_int = signal.signal(signal.SIGINT, _stop_early)
    signal.signal(signal.SIGTERM, _stop_early)  # stays: a command may take it over
    app = _app()
    signal.signal(signal.SIGINT, previous_int)  # from here Ctrl-C is KeyboardInterrupt again
    app()

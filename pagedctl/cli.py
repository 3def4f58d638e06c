"""The `pagedctl` command line: one folder per command; this module only wires them."""

from __future__ import annotations

import sys
from typing import Any

import typer
from typer.core import TyperGroup

from pagedctl import __version__
from pagedctl.bench.cmd import bench_app
from pagedctl.capacity.cmd import bench_capacity_sim, capacity
from pagedctl.exits import EXIT_SIGINT, EXIT_USAGE
from pagedctl.generate.cmd import generate
from pagedctl.models.cmd import models_app
from pagedctl.sweep.cmd import sweep


class PagedctlGroup(TyperGroup):
    """The command group, with one exit-code table (`pagedctl.exits`) for every command: a flag
    that does not parse is a usage error like any other (64), not click's 2."""

    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        try:
            code = super().main(*args, standalone_mode=False, **kwargs)
        except (typer.Abort, KeyboardInterrupt):
            print("interrupted", file=sys.stderr)
            sys.exit(EXIT_SIGINT)
        except Exception as e:
            if not (hasattr(e, "show") and isinstance(getattr(e, "exit_code", None), int)):
                raise
            e.show()  # click's own message: "Usage: ... Error: No such option: --x"
            if type(e).__name__ == "NoArgsIsHelpError":  # `pagedctl` alone: the help, no error
                sys.exit(0)
            sys.exit(EXIT_USAGE if e.exit_code == _CLICK_USAGE else e.exit_code)
        sys.exit(code if isinstance(code, int) else 0)


_CLICK_USAGE = 2  # the code click gives its usage errors (UsageError, BadParameter, ...)


app = typer.Typer(
    cls=PagedctlGroup,
    name="pagedctl",
    help="Offline batch LLM inference and KV-cache capacity planning on a paged engine.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
app.command("generate")(generate)
app.command("sweep")(sweep)
app.command("capacity")(capacity)
app.add_typer(bench_app, name="bench")
app.add_typer(models_app, name="models")
bench_app.command("capacity-sim")(bench_capacity_sim)


@app.command()
def version() -> None:
    """Print the pagedctl version."""
    typer.echo(f"pagedctl {__version__}")


def main() -> None:
    app()

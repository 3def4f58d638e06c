"""The `pagedctl` command line: one folder per command; this module only wires them."""

from __future__ import annotations

import typer

from pagedctl import __version__
from pagedctl.bench.cmd import bench_app
from pagedctl.capacity.cmd import bench_capacity_sim, capacity
from pagedctl.generate.cmd import generate
from pagedctl.models.cmd import models_app
from pagedctl.sweep.cmd import sweep

app = typer.Typer(
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

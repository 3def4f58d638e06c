"""`pagedctl capacity`: flags and recipe in, sections 1-6 on the terminal and under `--out`."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import typer
from rich.console import Console

from pagedctl.capacity import sim
from pagedctl.capacity.inputs import fail
from pagedctl.capacity.recipe import CapacityRecipeError, load_capacity_recipe
from pagedctl.capacity.run import CapacityRun
from pagedctl.console import FORMAT_HELP, Format
from pagedctl.engine import ENGINE_DEFAULTS, QUANTIZATIONS
from pagedctl.options import with_default
from pagedctl.outputs import OVERWRITE_HELP, ResultFolder, out_help
from pagedctl.recipe_file import RecipeError, find_recipe

DEFAULTS: dict[str, Any] = {
    "gpu_mem": [ENGINE_DEFAULTS["gpu_memory_utilization"]],
    "dtype": "auto",
    "block_size": [ENGINE_DEFAULTS["block_size"]],
    "loads": [0.25, 0.5, 0.75, 1.0, 1.25],
    "requests": 100_000,
    "seed": 0,
    "shared_prefix": 0,
    "cuda_context": "256MiB",
    "quantization": ENGINE_DEFAULTS["quantization"],
}


def capacity(
    recipe: str | None = typer.Option(
        None, "--recipe", help="Capacity recipe: a shipped one's name (capacity-t4) or a YAML file."
    ),
    model: str | None = typer.Option(
        None, "--model", help="Model folder, config .json, preset or cached HF id."
    ),
    device_memory: str | None = typer.Option(
        None, "--device-memory", help="Card memory, e.g. 14.6GiB (default: the GPU present)."
    ),
    gpu: str | None = typer.Option(
        None, "--gpu", help="Card preset: t4, l4, a10g, a100-40g, a100-80g, h100, h200."
    ),
    gpu_mem: str | None = typer.Option(
        None,
        "--gpu-memory-utilization",
        "--gpu-mem",
        help=with_default(
            "Fraction(s) of total device memory the engine may use, e.g. 0.7,0.9.",
            str(ENGINE_DEFAULTS["gpu_memory_utilization"]),
        ),
        show_default=False,
    ),
    non_kv_memory: str | None = typer.Option(
        None,
        "--non-kv-memory",
        help="Memory that is not KV cache (default: weights + activation estimate).",
    ),
    num_blocks: int | None = typer.Option(
        None,
        "--num-gpu-blocks-override",
        "--num-blocks",
        min=1,
        help="KV blocks in the pool (overrides the budget).",
    ),
    dtype: str | None = typer.Option(
        None, help="auto, float16, bfloat16 or float32 (default: auto)."
    ),
    quantization: str | None = typer.Option(
        None,
        "--quantization",
        help=with_default(
            "Weights as the engine loads them: " + ", ".join(QUANTIZATIONS) + " (auto: the "
            "checkpoint's own integers where its float weights take over half the card, as on "
            "CUDA).",
            str(ENGINE_DEFAULTS["quantization"]),
        ),
        show_default=False,
    ),
    block_size: str | None = typer.Option(
        None,
        "--block-size",
        help=with_default(
            "KV block size(s) in tokens, e.g. 16,32,64.", str(ENGINE_DEFAULTS["block_size"])
        ),
        show_default=False,
    ),
    max_len: int | None = typer.Option(
        None,
        "--max-len",
        "--max-model-len",
        min=1,
        help=with_default("Longest sequence, prompt + output.", "the model's"),
        show_default=False,
    ),
    lengths: Path | None = typer.Option(
        None, "--lengths", help="JSONL job whose requests give the lengths."
    ),
    outputs: Path | None = typer.Option(
        None, "--outputs", help="Output file of a `generate` run of --lengths: real lengths."
    ),
    dist: str | None = typer.Option(
        None, "--dist", help="Length distribution, e.g. lognormal:mean=260,median=180."
    ),
    shared_prefix: int | None = typer.Option(
        None,
        "--shared-prefix",
        min=0,
        help=with_default("Tokens every sequence shares (paged only).", "0"),
        show_default=False,
    ),
    loads: str | None = typer.Option(
        None,
        help=with_default("Simulated loads: offered token-time / pool.", "0.25,0.5,0.75,1,1.25"),
        show_default=False,
    ),
    requests: int | None = typer.Option(
        None,
        "--requests",
        min=100,
        help=with_default("Simulated requests per load.", "100000"),
        show_default=False,
    ),
    seed: int | None = typer.Option(
        None, help=with_default("Seed of the simulated stream.", "0"), show_default=False
    ),
    cuda_context: str | None = typer.Option(
        None,
        "--cuda-context",
        help=with_default("CUDA context, for whole-card reservations.", "256MiB"),
        show_default=False,
    ),
    cuda_graphs: bool | None = typer.Option(
        None,
        "--cuda-graphs/--no-cuda-graphs",
        help=with_default(
            "Count the pool the engine's step graphs keep (its default on CUDA).", "on"
        ),
        show_default=False,
    ),
    swap_space: float | None = typer.Option(
        None,
        "--swap-space",
        min=0.0,
        help="Host memory (GiB) for preempted sequences' KV (--preemption-mode swap or auto): "
        "its blocks and the preempted sequences it holds, apart from the running capacity.",
    ),
    no_sim: bool = typer.Option(False, "--no-sim", help="Skip the simulation."),
    probe: bool = typer.Option(False, "--probe", help="Measure on this machine's GPU."),
    plot: bool = typer.Option(False, "--plot", help="Also write PNG charts (matplotlib)."),
    out: Path | None = typer.Option(
        None, "--out", help=out_help("the CSV, Markdown and JSON files"), show_default=False
    ),
    overwrite: bool = typer.Option(False, "--overwrite", help=OVERWRITE_HELP),
    name: str | None = typer.Option(
        None, "--name", help="Output files capacity-NAME* (default: model and card)."
    ),
    fmt: Format = typer.Option(Format.table, "--format", help=FORMAT_HELP, show_default=False),
) -> None:
    """How many sequences fit: a paged pool vs contiguous reservations, for real lengths.

    For a model, a card and a length distribution; no GPU needed (except for --probe), and the
    weights are never loaded.

    1. the pool: bytes per token, blocks, vLLM's concurrency line;
    2. sequences that fit at 128, 256, ... --max-len tokens, paged vs contiguous;
    3. block-size waste over the lengths (--lengths or --dist);
    4. one arrival stream against max-length reservations, exact-length first-fit
       reservations and the engine's BlockPool, at several loads;
    5. --probe: the same figures measured on this machine's GPU;
    6. --plot: PNG charts.

    --swap-space GIB adds the host pool that --preemption-mode swap or auto would get: its
    blocks and the preempted sequences it holds, apart from the running capacity.

    Files go to --out, by default to a new folder runs/capacity-NAME-YYYYMMDD-HHMMSS.
    """
    flags = dict(locals())  # the options, before any other name is bound here
    switches = {k: flags.pop(k) for k in ("recipe", "no_sim", "probe", "plot")}
    output = {"overwrite": flags.pop("overwrite"), "format": flags.pop("fmt")}
    output["format"] = None if fmt is Format.table else fmt.value
    command = _command_line({**switches, **flags, **output})
    del flags["out"]  # not a setting of the run: where its files go
    if plot:
        _require_matplotlib()
    if probe:
        import torch

        if not torch.cuda.is_available():
            fail("--probe needs a CUDA device; this machine has none", code=1)
    try:
        doc = load_capacity_recipe(find_recipe(recipe)) if recipe else {}
    except (CapacityRecipeError, RecipeError) as e:
        fail(str(e))
    s = {**DEFAULTS, **doc, **{k: v for k, v in flags.items() if v is not None}}
    run = CapacityRun(s, command)
    folder = ResultFolder(out, run.stem(), overwrite)
    folder.refuse_existing(run.file_names(simulate=not no_sim, probe=probe, plot=plot))
    run.compute(simulate=not no_sim, probe=probe)
    run.emit(plot, folder, fmt)


NEGATABLE = ("cuda_graphs",)  # flags given as --X/--no-X: False is a choice, not an absence


def _command_line(given: dict[str, Any]) -> str:
    """The command as the user typed it, rebuilt from the options that were given."""
    words = ["pagedctl", "capacity"]
    for key, value in given.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            words.append(flag)
        elif value is False and key in NEGATABLE:
            words.append("--no-" + flag[2:])
        elif value is not None and value is not False:
            words += [flag, str(value)]
    return shlex.join(words)


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        fail("--plot needs matplotlib: pip install 'pagedctl[plot]' (or pip install matplotlib)")


def bench_capacity_sim(
    requests: int = typer.Option(1_000_000, min=1000, help="Simulated requests."),
    load: float = typer.Option(1.0, min=0.01, help="Load (offered token-time / pool)."),
    output: Path | None = typer.Option(None, "-o", "--output", help="Write results as JSON."),
) -> None:
    """Wall time of the capacity simulation: the T4 recipe's stream through all three allocators.

    Target: 1,000,000 requests in under a minute on one CPU core (pin it: taskset -c 0 ...).
    """
    import json
    import os

    from pagedctl.envinfo import environment

    r = sim.bench(requests, load)
    Console().print(
        f"{r['requests']:,} requests at load {load:g}: {r['total_s']:.1f} s "
        f"({r['us_per_request']:.1f} µs per request; "
        + ", ".join(f"{k} {v:.1f} s" for k, v in r["per_allocator_s"].items())
        + f"; target < {r['target_s']:.0f} s) on {r['cpus_allowed']} allowed CPU(s)",
        highlight=False,
    )
    if output is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
        cmd = f"pagedctl bench capacity-sim --requests {requests} --load {load:g}"
        if r["cpus_allowed"] == 1 and hasattr(os, "sched_getaffinity"):
            cmd = f"taskset -c {min(os.sched_getaffinity(0))} {cmd}"  # how it was pinned
        doc = {"benchmark": "capacity simulation", "command": cmd, "environment": environment()}
        output.write_text(json.dumps({**doc, **r}, indent=2) + "\n")
        Console().print(f"wrote {output}", highlight=False)

"""`pagedctl bench`: the engine against its peers on one workload, and the engine's own benches."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from pagedctl.console import (
    FORMAT_HELP,
    Format,
    print_json,
    print_tsv,
    progress_console,
    stdout_console,
)
from pagedctl.engine import ENGINE_DEFAULTS
from pagedctl.options import engine_flags
from pagedctl.outputs import OVERWRITE_HELP, ResultFolder, out_help

console = stdout_console()
bench_app = typer.Typer(
    help="Benchmarks: the engine against its peers, measured in the same run.",
    rich_markup_mode=None,
)


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise typer.BadParameter(f"expected positive integers, got {text!r}")
    return values


@bench_app.callback(invoke_without_command=True)
@engine_flags()
def bench_recipe(
    ctx: typer.Context,
    recipe: str | None = typer.Option(
        None,
        help="Benchmark recipe: a shipped one's name (nano-bench, nano-bench-cpu, ...) or "
        "a YAML file. Engine flags override its engine settings.",
    ),
    peer: str | None = typer.Option(
        None,
        help="Peers, comma-separated: hf-generate, hf-static, hf-continuous, vllm (where it is "
        "installed), or none (default: the recipe's peers).",
    ),
    temperature: float | None = typer.Option(
        None, min=0.0, help="Override the recipe's temperature (0: the greedy variant)."
    ),
    num_requests: int | None = typer.Option(
        None, min=1, help="Override the recipe's number of requests (a quick check)."
    ),
    output_json: Path | None = typer.Option(
        None, help="Write the JSON result here (kept if it exists, unless --overwrite)."
    ),
    out: Path | None = typer.Option(
        None,
        help=out_help("RECIPE-NAME.md (and .json unless --output-json)"),
        show_default=False,
    ),
    overwrite: bool = typer.Option(False, "--overwrite", help=OVERWRITE_HELP),
    fmt: Format = typer.Option(Format.table, "--format", help=FORMAT_HELP, show_default=False),
    engine: dict[str, Any] | None = None,
) -> None:
    """pagedctl and its transformers peers on one workload, in this process: one table.

    Wall time, requests/s, output and total tok/s, peak memory, preemptions and pagedctl's output
    tok/s divided by each side's. EOS is ignored everywhere; every side's output is counted and
    checked against the tokens asked for. Writes RECIPE-NAME.md and .json to --out, by default
    to a new folder runs/RECIPE-NAME-YYYYMMDD-HHMMSS. Exit status 1 when a side fails or
    miscounts; 64 on a bad flag or recipe, or a result file that exists (--overwrite).
    """
    if ctx.invoked_subcommand is not None:
        if recipe is not None:
            raise typer.BadParameter("--recipe runs the recipe benchmark; give no subcommand")
        return
    if recipe is None:
        given = [peer, temperature, num_requests, output_json, out]
        if engine or overwrite or fmt is not Format.table or any(v is not None for v in given):
            raise typer.BadParameter(
                "these options run a recipe: give --recipe NAME|FILE (or a subcommand)"
            )
        typer.echo(ctx.get_help())  # plain: Rich markup would drop every "[default: ...]"
        raise typer.Exit(0)
    import dataclasses
    import shlex

    from pagedctl.bench import recipe as br
    from pagedctl.bench import report as bench_report
    from pagedctl.envinfo import environment
    from pagedctl.models.bundled import engine_settings
    from pagedctl.recipe_file import RecipeError, find_recipe

    try:
        spec = br.load_bench_recipe(find_recipe(recipe))
        folder = ResultFolder(out, spec.name, overwrite)
        named = [(output_json, "--output-json")] if output_json is not None else []
        folder.refuse_existing(bench_report.file_names(spec.name, output_json is None), named)
        spec.config = spec.config.replace(**(engine or {}))
        spec.config = spec.config.replace(**engine_settings(spec.config.given()))
        peers = br.parse_peers(peer) if peer is not None else list(spec.peers)
        bench_report.check_runnable(spec)
    except (RecipeError, ValueError) as e:
        raise typer.BadParameter(str(e)) from None
    overrides = {"temperature": temperature, "num_requests": num_requests}
    spec.workload = dataclasses.replace(
        spec.workload, **{k: v for k, v in overrides.items() if v is not None}
    )
    log = progress_console(fmt)

    def say(line: str, style: str | None = None) -> None:
        log.print(line, style=style, markup=False, highlight=False)

    doc = bench_report.run_bench(spec, peers, lambda line: say(line, "dim"))
    doc = {"command": "pagedctl " + shlex.join(sys.argv[1:]), **doc}
    doc["environment"] = {**environment(), **bench_report.device_info(spec)}
    if fmt is Format.json:
        print_json(doc)
    elif fmt is Format.tsv:
        print_tsv([(bench_report.title(doc), bench_report.COLUMNS, bench_report.table_rows(doc))])
    else:
        console.print(bench_report.rich_table(doc))
    for line in bench_report.config_lines(doc):
        say(line)
    if doc.get("floor"):
        say(bench_report.floor_line(doc["floor"]))
    json_path = output_json or folder.path() / f"{spec.name}.json"
    for path in bench_report.write_outputs(doc, folder.path(), json_path, spec.name):
        say(f"wrote {path}")
    if any(r["status"] in ("error", "mismatch") for r in doc["sides"]):
        raise typer.Exit(1)


@bench_app.command("scheduler")
def bench_scheduler(
    num_seqs: str = typer.Option("256,1024", help="Running sequences, comma-separated."),
    block_size: int = typer.Option(
        ENGINE_DEFAULTS["block_size"], min=1, help="KV block size in tokens."
    ),
    prompt_len: int = typer.Option(128, min=1, help="Prompt length in tokens."),
    steps: int = typer.Option(256, min=1, help="Decode steps timed per repeat."),
    repeats: int = typer.Option(5, min=1, help="Timed repeats; the median is reported."),
    output: Path | None = typer.Option(None, "-o", "--output", help="Write results as JSON."),
) -> None:
    """CPU cost of schedule() + update() per step, in microseconds per running sequence.

    No model runs; a fake runner returns random tokens. Target: under 2 µs per running sequence.
    """
    from pagedctl.bench import scheduler_cost
    from pagedctl.envinfo import environment

    results = [
        scheduler_cost.run(
            n, block_size=block_size, prompt_len=prompt_len, steps=steps, repeats=repeats
        )
        for n in _int_list(num_seqs)
    ]
    table = Table(title="scheduler: schedule() + update(), steady decode, all sequences running")
    for col in (
        "running seqs",
        "schedule µs/seq",
        "update µs/seq",
        "total µs/seq (median)",
        "min–max",
        "step ms",
    ):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(
            str(r.num_seqs),
            f"{r.schedule_us_per_seq:.2f}",
            f"{r.update_us_per_seq:.2f}",
            f"{r.total_us_per_seq:.2f}",
            f"{r.total_us_per_seq_min:.2f}–{r.total_us_per_seq_max:.2f}",
            f"{r.step_ms:.2f}",
        )
    console.print(table)
    if output is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
        doc = {
            "benchmark": "scheduler",
            "command": "pagedctl bench scheduler " + f"--num-seqs {num_seqs} --block-size "
            f"{block_size} --prompt-len {prompt_len} --steps {steps} --repeats {repeats}",
            "target_us_per_seq": 2.0,
            "environment": environment(),
            "results": [r.as_dict() for r in results],
        }
        output.write_text(json.dumps(doc, indent=2) + "\n")
        console.print(f"wrote {output}")


@bench_app.command("transformers")
def bench_transformers(
    prompts: Path = typer.Option(
        Path("recipes/data/chat-cpu.jsonl"), help="JSONL of {custom_id, messages, max_tokens}."
    ),
    model: str | None = typer.Option(None, help="Model (default: the bundled SmolLM2-135M)."),
    device: str = typer.Option("cpu", help="cpu or cuda."),
    hf_batch_size: int = typer.Option(
        32, min=1, help="Padded batch size of the transformers side."
    ),
    dtype: str = typer.Option("auto", help="auto, float32, bfloat16 or float16 (both sides)."),
    repeats: int = typer.Option(3, min=1, help="Timed runs of each side (alternating); medians."),
    peer: str | None = typer.Option(
        None, "--peer", help="vllm: vLLM as a third side, in its own process."
    ),
    vllm_python: Path | None = typer.Option(
        None, "--vllm-python", help="The interpreter that has vLLM.  [default: this one]"
    ),
    output: Path | None = typer.Option(None, "-o", "--output", help="Write results as JSON."),
) -> None:
    """The engine vs transformers `generate` with padded batches: same prompts, same run.

    Greedy, each request's own max_tokens, EOS honoured; output tokens per second of each side
    and their ratio (target on CPU: 1.5x or more).
    """
    from pagedctl.bench import transformers as bt
    from pagedctl.envinfo import environment

    if peer not in (None, "vllm"):
        raise typer.BadParameter(f"unknown peer {peer!r}; the one peer here is vllm")
    if vllm_python is not None and peer is None:
        raise typer.BadParameter("--vllm-python needs --peer vllm")
    vllm = None
    if peer == "vllm":
        from pagedctl.bench.vllm_peer import not_installed, vllm_version

        vllm = {"python": str(vllm_python)} if vllm_python else {}
        python = vllm.get("python", sys.executable)
        if vllm_version(python) is None:  # before any model loads
            raise typer.BadParameter(not_installed(python))
    result = bt.run(prompts, model, device, hf_batch_size, dtype=dtype, repeats=repeats, vllm=vllm)
    table = Table(
        title=f"{result['requests']} chat requests, {result['prompt_tokens']} prompt tokens"
    )
    for col in ("side", "wall s (median)", "output tokens", "output tok/s"):
        table.add_column(col, justify="right")
    for side in ("engine", "transformers", *(["vllm"] if vllm is not None else [])):
        r = result[side]
        table.add_row(
            side, f"{r['wall_s']:.2f}", str(r["output_tokens"]), f"{r['output_tok_s']:.1f}"
        )
    console.print(table)
    console.print(
        f"ratio (engine / transformers, output tok/s): {result['ratio_output_tok_s']:.2f}x; "
        f"identical outputs: {result['identical_outputs']}/{result['requests']}"
    )
    if vllm is not None:
        console.print(
            f"ratio (engine / vLLM {result['vllm']['version']}): "
            f"{result['ratio_vllm_output_tok_s']:.2f}x; identical outputs: "
            f"{result['identical_outputs_vllm']}/{result['requests']}"
        )
    if output is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
        cmd = (
            f"pagedctl bench transformers --prompts {prompts} --device {device} "
            + (f"--dtype {dtype} --repeats {repeats} ")
            + (f"--hf-batch-size {hf_batch_size}" + (f" --model {model}" if model else ""))
            + (" --peer vllm" if vllm is not None else "")
            + (f" --vllm-python {vllm_python}" if vllm_python else "")
        )
        doc = {
            "benchmark": "engine vs transformers generate (the cron job's chat prompts)",
            "command": cmd,
            "environment": environment(),
            **result,
        }
        output.write_text(json.dumps(doc, indent=2) + "\n")
        console.print(f"wrote {output}")


@bench_app.command("job-memory")
def bench_job_memory(
    lines: int = typer.Option(200_000, min=1, help="Input lines (2 output tokens each)."),
    output: Path | None = typer.Option(None, "-o", "--output", help="Write results as JSON."),
) -> None:
    """RSS growth of a `generate` job over a long input (target: under 200 MiB at 200,000 lines).

    Runs in this process on the dummy-weight tiny-llama preset, sampling RSS every 50 ms.
    """
    from pagedctl.bench import memory as bench_memory
    from pagedctl.envinfo import environment

    result = bench_memory.run(lines)
    r = result
    console.print(
        f"{r['lines']:,} lines, {r['results_written']:,} results in {r['wall_s']} s; RSS "
        f"{r['rss_before_job_mib']} MiB before the job, peak {r['rss_peak_mib']} MiB: growth "
        f"{r['rss_growth_mib']} MiB (target < {r['target_growth_mib']} MiB)"
    )
    if output is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
        doc = {
            "benchmark": "generate job memory",
            "command": f"pagedctl bench job-memory --lines {lines}",
            "environment": environment(),
            **result,
        }
        output.write_text(json.dumps(doc, indent=2) + "\n")
        console.print(f"wrote {output}")

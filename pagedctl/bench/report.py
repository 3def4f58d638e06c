"""`pagedctl bench --recipe`: run pagedctl and its peers on one workload, check and compare them.

Each side's row holds its wall time (the measured pass only; set-up is reported apart), requests/s,
output tok/s (only the tokens each request asked for), total tok/s (prompt + output), peak memory,
preemptions, and pagedctl's output tok/s divided by the side's. A side whose requests did not each
get exactly their `max_tokens` is marked `mismatch`; a side that fails is a row with its error.
"""

from __future__ import annotations

import json
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
from rich import box
from rich.table import Table

from pagedctl.bench.continuous import run_hf_continuous
from pagedctl.bench.peers import (
    MemoryMeter,
    SideRun,
    run_hf_generate,
    run_hf_static,
    run_pagedctl,
    run_vllm,
)
from pagedctl.bench.recipe import BenchRecipe, Workload, make_workload
from pagedctl.engine import format_bytes

SIDES: dict[str, Callable[[BenchRecipe, Workload, dict], SideRun]] = {
    "pagedctl": run_pagedctl,
    "hf-generate": run_hf_generate,
    "hf-static": run_hf_static,
    "hf-continuous": run_hf_continuous,
    "vllm": run_vllm,
}
COLUMNS = (
    "side",
    "status",
    "wall s",
    "req/s",
    "output tok/s",
    "total tok/s",
    "peak mem",
    "preempt",
    "pagedctl ÷",
)


FLOOR_NOTE = (
    "every request admitted at once; prefill arithmetic at the matmul rate, then each decode step "
    "streaming the weights and the live KV once (or its arithmetic, if longer), measured in this "
    "run (pagedctl.bench.floor)"
)


def check_runnable(recipe: BenchRecipe) -> None:
    """Fail early, with the engine's own message, on a model, device or dtype that cannot run."""
    from pagedctl.engine import resolve_device, resolve_dtype, resolve_model

    try:
        device = resolve_device(recipe.device)
    except ValueError:
        raise ValueError(
            f"the recipe asks for device {recipe.device!r}, which torch does not see; on this "
            "machine use a CPU recipe such as recipes/nano-bench-cpu.yaml"
        ) from None
    resolve_dtype(recipe.dtype, device)
    resolve_model(recipe.model, recipe.load_format)


def device_info(recipe: BenchRecipe) -> dict:
    """The accelerator the run used, for the environment record."""
    from pagedctl.engine import resolve_device

    device = resolve_device(recipe.device)
    if device.type != "cuda":
        return {"device": "cpu"}
    return {"device": str(device), "gpu": torch.cuda.get_device_name(device)}


def run_bench(recipe: BenchRecipe, peers: list[str], log: Callable[[str], None]) -> dict:
    """Run pagedctl, then each peer, one after another in this process; a JSON-ready result."""
    from pagedctl.engine import resolve_device

    device = resolve_device(recipe.device)
    wl = make_workload(recipe.workload)
    rows: list[dict] = []
    for name in ["pagedctl", *peers]:
        settings = {} if name == "pagedctl" else recipe.peers.get(name, {})
        if rows and rows[-1]["status"] == "error" and not _device_usable(device):
            rows.append({"side": name, "status": "error", "error": "skipped: " + _LOST})
        else:
            log(f"{name}: running {len(wl.prompts)} requests ...")
            rows.append(measure_side(name, recipe, wl, settings, device))
        log(_progress_line(rows[-1]))
    base = _output_rate(rows[0])
    for row in rows[1:]:
        if base and _output_rate(row):
            row["pagedctl_speedup"] = round(base / _output_rate(row), 2)
    _compare_outputs(rows, wl)
    floor = None
    if device.type == "cuda" and _device_usable(device):
        from pagedctl.bench.floor import floor_of

        log("floor: measuring the card's bandwidth and matmul rate ...")
        floor = floor_of(recipe, wl)
        if rows[0]["status"] != "error":
            floor["pagedctl_over_floor"] = round(rows[0]["wall_s"] / floor["floor_s"], 3)
        log(floor_line(floor))
    w = recipe.workload
    return {
        "benchmark": f"pagedctl bench: {recipe.name}",
        "workload": {
            "num_requests": w.num_requests,
            "prompt_len": list(w.prompt_len),
            "output_len": list(w.output_len),
            **(
                {"long_fraction": w.long_fraction, "long_output_len": list(w.long_output_len)}
                if w.long_fraction and w.long_output_len
                else {}
            ),
            "token_ids_half_open": list(w.token_ids),
            "seed": w.seed,
            "temperature": w.temperature,
            "ignore_eos": True,
            "prompt_tokens": wl.prompt_tokens,
            "requested_output_tokens": wl.output_tokens,
        },
        "sides": rows,
        "floor": floor,
        "ratios_output_tok_s": {
            r["side"]: r["pagedctl_speedup"] for r in rows[1:] if "pagedctl_speedup" in r
        },
    }


def _compare_outputs(rows: list[dict], wl: Workload) -> None:
    """Greedy: how many requests got the same tokens as pagedctl's (on the same weights; a side
    with weights of its own, such as vLLM's dummy ones, differs by construction)."""
    ours = rows[0].pop("_tokens", None)
    for row in rows[1:]:
        theirs = row.pop("_tokens", None)
        if wl.temperature == 0 and ours is not None and theirs is not None:
            pairs = zip(ours, theirs, strict=True)
            same = sum(a is not None and list(a) == list(b) for a, b in pairs)
            row["same_outputs_as_pagedctl"] = f"{same}/{len(ours)}"


def _output_rate(row: dict) -> float:
    """Output tok/s before rounding (0 when the side has none)."""
    if row["status"] in ("error", "unavailable") or not row["output_tokens"]:
        return 0.0
    return row["output_tokens"] / row["wall_s"]


_LOST = "the CUDA context was lost in an earlier side's error"


def _device_usable(device: torch.device) -> bool:
    """After a device-side assert every later CUDA call fails: the other sides cannot run."""
    if device.type != "cuda":
        return True
    try:
        torch.cuda.synchronize(device)
    except Exception:
        return False
    return True


def measure_side(
    name: str, recipe: BenchRecipe, wl: Workload, settings: dict, device: torch.device
) -> dict:
    """One side under a memory meter; an exception becomes a row with the error."""
    from pagedctl.bench.vllm_peer import PeerUnavailable

    meter = MemoryMeter(device)
    try:
        with meter:
            run = SIDES[name](recipe, wl, settings)
    except PeerUnavailable as e:  # not installed here: said plainly, not a failure of the run
        return {"side": name, "status": "unavailable", "error": str(e)}
    except Exception as e:
        return {
            "side": name,
            "status": "error",
            "error": f"{type(e).__name__}: {e}",
            "traceback": traceback.format_exc(limit=-4),
        }
    return _row(name, run, wl, meter)


def _row(name: str, run: SideRun, wl: Workload, meter: MemoryMeter) -> dict:
    asked = wl.max_tokens
    finished = [i for i, c in enumerate(run.counts) if c is not None]
    wrong = [(i, c, asked[i]) for i, c in enumerate(run.counts) if c is not None and c != asked[i]]
    output = sum(run.counts[i] or 0 for i in finished)
    prompt = sum(len(wl.prompts[i]) for i in finished)
    status = "mismatch" if wrong else "ok" if len(finished) == len(asked) else "partial"
    row = {
        "side": name,
        "status": status,
        "config": run.config,
        "setup_s": round(run.setup_s, 2),
        "wall_s": round(run.wall_s, 4),
        "requests": len(asked),
        "requests_finished": len(finished),
        "prompt_tokens": prompt,
        "output_tokens": output,
        "requested_output_tokens": sum(asked),
        "computed_output_tokens": run.computed_tokens,
        "requests_per_s": round(len(finished) / run.wall_s, 3),
        "output_tok_s": round(output / run.wall_s, 1),
        "total_tok_s": round((prompt + output) / run.wall_s, 1),
        "peak_memory_bytes": meter.peak,
        "peak_memory_kind": meter.kind,
        "memory_before_bytes": meter.base,  # left over from earlier sides (CUDA) or RSS (CPU)
        **run.extra,
    }
    if run.peak_memory:  # a side in a process of its own measures itself
        row["peak_memory_bytes"] = run.peak_memory["bytes"]
        row["peak_memory_kind"] = run.peak_memory["kind"]
    if run.tokens is not None:
        row["_tokens"] = run.tokens  # compared with pagedctl's in `run_bench`, then dropped
    if wrong:
        row["mismatches"] = {"count": len(wrong), "first": wrong[:5]}
    return row


def _progress_line(row: dict) -> str:
    if row["status"] in ("error", "unavailable"):
        return f"{row['side']}: {row['status']}: {_first_line(row['error'])}"
    return (
        f"{row['side']}: {row['status']}, {row['output_tokens']:,} output tokens in "
        f"{row['wall_s']:.2f} s = {row['output_tok_s']:,.1f} tok/s (set-up {row['setup_s']:.1f} s)"
    )


def floor_line(floor: dict) -> str:
    card = floor["card"]
    line = (
        f"floor: {floor['floor_s']:.3f} s (prefill {floor['prefill_s']:.3f} s, "
        f"{floor['decode_steps']:,} decode steps {floor['decode_s']:.3f} s) at "
        f"{card['copy_bandwidth_GBps']:,.0f} GB/s and {card['matmul_TFLOPs']:,.0f} TFLOP/s"
    )
    if "pagedctl_over_floor" in floor:
        line += f"; pagedctl takes {floor['pagedctl_over_floor']:.2f}x the floor"
    return line


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else text


def table_rows(doc: dict) -> list[list[str]]:
    """The result table as strings, one list per side (columns: COLUMNS)."""
    rows = []
    for r in doc["sides"]:
        if r["status"] in ("error", "unavailable"):
            rows.append([r["side"], r["status"], *["-"] * (len(COLUMNS) - 2)])
            continue
        speedup = r.get("pagedctl_speedup")
        rows.append(
            [
                r["side"],
                r["status"],
                f"{r['wall_s']:.2f}",
                f"{r['requests_per_s']:.2f}",
                f"{r['output_tok_s']:,.1f}",
                f"{r['total_tok_s']:,.1f}",
                format_bytes(max(r["peak_memory_bytes"], 0)),
                str(r.get("preemptions", "-")),
                f"{speedup:.2f}x" if speedup else "-",
            ]
        )
    return rows


def config_lines(doc: dict) -> list[str]:
    """One line per side: its configuration, set-up time and error, if any."""
    lines = []
    for r in doc["sides"]:
        if r["status"] in ("error", "unavailable"):
            word = "ERROR" if r["status"] == "error" else "not run:"
            lines.append(f"{r['side']}: {word} {_first_line(r['error'])}")
            continue
        cfg = ", ".join(f"{k} {v}" for k, v in r["config"].items())
        extra = f"; set-up {r['setup_s']:.1f} s (not timed)"
        if r["computed_output_tokens"] != r["output_tokens"]:
            extra += f"; {r['computed_output_tokens']:,} output positions computed"
        if "mismatches" in r:
            extra += f"; MISMATCH (request, got, asked): {r['mismatches']['first']}"
        if "same_outputs_as_pagedctl" in r:
            extra += f"; the same greedy tokens as pagedctl: {r['same_outputs_as_pagedctl']}"
        if r["status"] == "partial":
            extra += f"; only {r['requests_finished']}/{r['requests']} requests finished"
        lines.append(f"{r['side']}: {cfg}{extra}")
    return lines


def title(doc: dict) -> str:
    """The title of the result table: the benchmark and its workload."""
    w = doc["workload"]
    return (
        f"{doc['benchmark']}: {w['num_requests']} requests, {w['prompt_tokens']:,} prompt "
        f"tokens, {w['requested_output_tokens']:,} output tokens asked, EOS ignored"
    )


def rich_table(doc: dict) -> Table:
    table = Table(box=box.SIMPLE_HEAD, title=title(doc))
    for col in COLUMNS:
        table.add_column(col, justify="left" if col in ("side", "status") else "right")
    for row in table_rows(doc):
        table.add_row(*row)
    return table


def markdown(doc: dict) -> str:
    w, env = doc["workload"], doc.get("environment", {})
    machine = env.get("gpu") or env.get("cpu")
    lines = [
        f"# {doc['benchmark']}",
        "",
        f"`{doc.get('command', '')}`",
        "",
        f"{machine}; torch {env.get('torch')}, transformers {env.get('transformers')}, "
        f"pagedctl {env.get('commit')}, {env.get('date')}.",
        "",
        f"Workload: {w['num_requests']} requests, prompt lengths uniform in {w['prompt_len']} "
        f"({w['prompt_tokens']:,} tokens), max_tokens uniform in {w['output_len']}"
        + (
            f" ({w['long_fraction']:.0%} of the requests in {w['long_output_len']} instead) "
            if w.get("long_fraction")
            else " "
        )
        + f"({w['requested_output_tokens']:,} asked), token ids in [{w['token_ids_half_open'][0]}, "
        f"{w['token_ids_half_open'][1]}), seed {w['seed']}, temperature {w['temperature']}, EOS "
        "ignored on every side. Output tok/s counts only the tokens each request asked for; "
        "wall time is the measured pass, set-up apart.",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
        *("| " + " | ".join(row) + " |" for row in table_rows(doc)),
        "",
        *(f"- {line}" for line in config_lines(doc)),
        *([f"- {floor_line(doc['floor'])}: {FLOOR_NOTE}"] if doc.get("floor") else []),
        "",
    ]
    return "\n".join(lines)


def file_names(stem: str, with_json: bool = True) -> list[str]:
    """The files `write_outputs` writes in its folder: the Markdown table and the JSON result
    (unless that goes elsewhere, `--output-json`)."""
    return [f"{stem}.md", *([f"{stem}.json"] if with_json else [])]


def write_outputs(doc: dict, out_dir: Path, json_path: Path | None, stem: str) -> list[Path]:
    """The JSON result and the Markdown table; returns the paths written."""
    md_name, json_name = file_names(stem)
    json_path = json_path or out_dir / json_name
    md_path = out_dir / md_name
    for p in (json_path, md_path):
        p.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(doc, indent=2) + "\n")
    md_path.write_text(markdown(doc))
    return [json_path, md_path]

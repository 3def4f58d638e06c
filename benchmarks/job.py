"""`pagedctl generate` against the engine it drives, on the same requests.

`python -m benchmarks.job OUT_DIR [MODEL]` (results/job-vs-engine-h200.*) from the repository root
(MODEL: a .gguf or a folder; default the bundled SmolLM2-135M-Instruct). nano-bench's requests
(`make_workload` of recipes/nano-bench.yaml: 256 prompts of U[100, 1024] random token ids,
`max_tokens` U[100, 1024], EOS ignored, temperature 0.6) run once as a JSONL job of
`prompt_token_ids` lines through `pagedctl generate` in a child process (its summary's wall: model
loading and graph capture excluded; reading, validating, writing and fsyncing the records
included), then again in a fresh process, and once as `pagedctl bench` runs its own side
(`run_pagedctl`: a warm-up, then one timed `generate`), all with the engine's defaults. Then the
example job's 32 chat and completion lines repeated 64 times (2,048 lines of text: tokenizer, chat
template, detokenizer) as a job only. The engine side runs last: this process keeps its memory,
which a job started after it would lack.

Each job's child records its Triton JIT cache misses (a compilation, or a load from Triton's disk
cache) and how many fell inside the job's timed `LLM.stream`, in `NAME.jit.json`: a job must not
meet a kernel specialisation that start-up did not compile. `JOB_REQUESTS=N` shrinks both sets (N
requests of 8 output tokens) for a smoke run on the CPU. Writes `OUT_DIR/job_vs_engine.json`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
N = int(os.environ.get("JOB_REQUESTS", 256))


def trace_jit(path: Path) -> None:
    """In the job's child: record Triton JIT misses (start, seconds, kernel) and the window of
    `LLM.stream`, written to `path` at exit."""
    import atexit

    import triton

    from pagedctl.engine import LLM

    misses: list[list] = []
    marks: dict[str, float] = {}

    def before(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
        misses.append([time.perf_counter(), None, fn.name])
        return False  # compile (or load) as usual

    def after(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
        if misses and misses[-1][1] is None:
            misses[-1][1] = time.perf_counter() - misses[-1][0]
        return False

    triton.knobs.runtime.jit_cache_hook = before
    triton.knobs.runtime.jit_post_compile_hook = after
    stream = LLM.stream

    def timed_stream(self, *args, **kwargs):
        marks["stream_start"] = time.perf_counter()
        yield from stream(self, *args, **kwargs)
        marks["stream_end"] = time.perf_counter()

    LLM.stream = timed_stream

    def write() -> None:
        lo, hi = marks.get("stream_start", float("inf")), marks.get("stream_end", float("inf"))
        inside = [m for m in misses if lo <= m[0] <= hi]
        path.write_text(json.dumps({
            "misses": len(misses), "misses_in_stream": len(inside),
            "seconds_in_stream": round(sum(m[1] or 0.0 for m in inside), 3),
            "in_stream": [[round(m[0] - lo, 3), round(m[1] or 0.0, 3), m[2]] for m in inside],
        }, indent=1))  # fmt: skip

    atexit.register(write)


def bench_workload():
    """nano-bench's requests (N of them, 8 output tokens each, when JOB_REQUESTS shrinks them)."""
    from pagedctl.bench.recipe import load_bench_recipe, make_workload

    spec = load_bench_recipe(ROOT / "recipes/nano-bench.yaml").workload
    if spec.num_requests != N:
        spec = replace(spec, num_requests=N, output_len=(8, 8))
    return make_workload(spec)


def run_job(name: str, lines: list[dict], out: Path, model: str | None) -> dict:
    """`pagedctl generate` of `lines` in a child process: its summary, JIT misses and exit code."""
    src = out / f"{name}.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    cmd = [sys.executable, "-m", "benchmarks.job", "--job", str(src)]
    cmd += ["-o", str(out / f"{name}.out"), "--errors", str(out / f"{name}.err")]
    cmd += ["--summary-json", str(out / f"{name}.json")]
    cmd += ["--model", model] if model else []
    t = time.perf_counter()
    env = dict(os.environ, JOB_TRACE_JIT=str(out / f"{name}.jit.json"))
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    (out / f"{name}.log").write_text(done.stdout[-4000:] + done.stderr[-4000:])
    summary = json.loads((out / f"{name}.json").read_text())
    jit = json.loads((out / f"{name}.jit.json").read_text())
    summary["jit"] = {k: jit[k] for k in ("misses", "misses_in_stream", "seconds_in_stream")}
    summary["process_wall_s"] = round(time.perf_counter() - t, 2)
    summary["exit_code"] = done.returncode
    return summary


def run_engine(wl, model: str | None) -> dict:
    """The same requests as `pagedctl bench` runs its own side: a warm-up, then one `generate`."""
    from pagedctl.bench.peers import run_pagedctl
    from pagedctl.bench.recipe import BenchRecipe
    from pagedctl.engine import EngineConfig
    from pagedctl.models.bundled import engine_settings

    config = EngineConfig(**engine_settings({"model": model} if model else {}))
    side = run_pagedctl(BenchRecipe(name="job-vs-engine", config=config), wl, {})
    tokens = sum(c or 0 for c in side.counts)
    return {"wall_s": round(side.wall_s, 3), "output_tokens": tokens,
            "output_tok_per_s": tokens / side.wall_s}  # fmt: skip


def chat_lines() -> list[dict]:
    """The example job's lines, repeated N / 4 times under fresh ids."""
    example = ROOT / "recipes/data/example.jsonl"
    lines = []
    for rep in range(max(1, N // 4)):
        for line in map(json.loads, example.read_text().splitlines()):
            key = "custom_id" if "custom_id" in line else "id"
            lines.append({**line, key: f"{line[key]}-{rep}"})
    return lines


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    model = sys.argv[2] if len(sys.argv) > 2 else None
    wl = bench_workload()
    lines = [
        {"custom_id": f"bench-{i}", "prompt_token_ids": p, "max_tokens": m, "ignore_eos": True,
         "temperature": wl.temperature}
        for i, (p, m) in enumerate(zip(wl.prompts, wl.max_tokens, strict=True))
    ]  # fmt: skip
    result = {}
    for key, run in (
        ("bench_job", lambda: run_job("bench", lines, out, model)),
        ("bench_job_again", lambda: run_job("bench_again", lines, out, model)),
        ("chat_job", lambda: run_job("chat", chat_lines(), out, model)),
        ("engine", lambda: run_engine(wl, model)),
    ):
        result[key] = run()
        print(key, json.dumps(result[key]), flush=True)
    (out / "job_vs_engine.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    if sys.argv[1] == "--job":  # the child: `pagedctl generate ARGS`
        from pagedctl.cli import main as cli_main

        if os.environ.get("JOB_TRACE_JIT"):
            trace_jit(Path(os.environ["JOB_TRACE_JIT"]))
        sys.argv = ["pagedctl", "generate", *sys.argv[2:]]
        cli_main()
    else:
        main()

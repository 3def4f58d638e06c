"""`pagedctl generate` against the engine it drives, on the same requests: `python3
scripts/device/job_vs_engine.py OUT_DIR [MODEL]` (MODEL: a .gguf or folder; default the bundled
SmolLM2-135M-Instruct).

W1's requests (`make_workload` of recipes/nano-bench.yaml's workload: 256 prompts of U[100, 1024]
token ids, `max_tokens` U[100, 1024], EOS ignored, temperature 0.6) once as a JSONL job of
`prompt_token_ids` lines run by `python3 -m pagedctl generate` in a child process (its summary's
wall: model loading and graph capture excluded; reading, validating, writing and fsyncing the
records included), and once as `pagedctl bench` runs its own side (`run_pagedctl`: a warm-up, then
one timed `generate`), both with the engine's defaults. Then the bundled example's 32 chat and
completion lines repeated 64 times (2,048 lines of text: tokenizer, chat template, detokenizer)
as a job only. The engine side runs last: this process keeps its memory, which a job started
after it would lack.

Each job's child also records its Triton JIT cache misses (a compilation, or a load from Triton's
disk cache) with their wall time, and the window of the job's `LLM.stream` (its summary's wall), in
`NAME.jit.json`; the W1 job runs twice (`w1`, then `w1_again` in a fresh process with Triton's disk
cache warm): what a job pays for kernel specialisations the graph capture never met.

`JOB_REQUESTS=N` shrinks both sets (N requests of 8 tokens) for a smoke run on the CPU.
`JOB_FAKE_MODEL=1` replaces the model's step by an instant one that draws random tokens, in the
job and the engine alike, so only host work is timed (`results/job-vs-engine-h200.md`).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
N = int(os.environ.get("JOB_REQUESTS", 256))
FAKE = os.environ.get("JOB_FAKE_MODEL") == "1"


def fake_model() -> None:
    """Every step returns at once: a random token for each row that reaches its end."""
    from pagedctl.engine.model_runner import ModelRunner, StepResult

    rng = random.Random(1)

    def execute(self, out):
        return StepResult(
            [
                [rng.randrange(1000, 20000) for _ in range(s.num_samples_to_draw)]
                if s.num_computed_tokens + n >= s.num_tokens
                else []
                for s, n in zip(out.seqs, out.num_new_tokens, strict=True)
            ],
            None,
        )

    ModelRunner.execute = execute


def trace_jit(path: Path) -> None:
    """In the job's child: record Triton JIT misses (start, seconds, kernel) and the window of
    `LLM.stream`, written to `path` at exit."""
    import atexit

    import triton
    from pagedctl.engine.llm import LLM

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


def w1_workload():
    from pagedctl.bench.recipe import load_bench_recipe, make_workload

    spec = load_bench_recipe(ROOT / "recipes/nano-bench.yaml").workload
    if spec.num_requests != N:
        spec = replace(spec, num_requests=N, output_len=(8, 8))
    return make_workload(spec)


def run_job(name: str, lines: list[dict], out: Path, model: str | None) -> dict:
    src = out / f"{name}.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    cmd = [sys.executable, __file__, "--job", str(src), "-o", str(out / f"{name}.out")]
    cmd += ["--errors", str(out / f"{name}.err"), "--summary-json", str(out / f"{name}.json")]
    cmd += ["--model", model] if model else []
    t = time.perf_counter()
    env = dict(os.environ, JOB_TRACE_JIT=str(out / f"{name}.jit.json"))
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    summary = json.loads((out / f"{name}.json").read_text())
    jit = json.loads((out / f"{name}.jit.json").read_text())
    summary["jit"] = {k: jit[k] for k in ("misses", "misses_in_stream", "seconds_in_stream")}
    summary["process_wall_s"] = round(time.perf_counter() - t, 2)
    summary["exit_code"] = done.returncode
    (out / f"{name}.log").write_text(done.stdout[-4000:] + done.stderr[-4000:])
    return summary


def run_engine(wl, model: str | None) -> dict:
    from pagedctl.bench.peers import run_pagedctl
    from pagedctl.bench.recipe import BenchRecipe

    side = run_pagedctl(BenchRecipe(name="job-vs-engine", model=model), wl, {})
    tokens = sum(c or 0 for c in side.counts)
    return {"wall_s": round(side.wall_s, 3), "output_tokens": tokens,
            "output_tok_per_s": tokens / side.wall_s}  # fmt: skip


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    model = sys.argv[2] if len(sys.argv) > 2 else None
    wl = w1_workload()
    lines = [
        {"custom_id": f"w1-{i}", "prompt_token_ids": p, "max_tokens": m, "ignore_eos": True,
         "temperature": wl.temperature}
        for i, (p, m) in enumerate(zip(wl.prompts, wl.max_tokens, strict=True))
    ]  # fmt: skip
    result = {"w1_job": run_job("w1", lines, out, model)}
    print("w1 job", json.dumps(result["w1_job"]), flush=True)
    result["w1_job_again"] = run_job("w1_again", lines, out, model)
    print("w1 job again", json.dumps(result["w1_job_again"]), flush=True)
    example_file = ROOT / "recipes/data/example.jsonl"
    example = [json.loads(s) for s in example_file.read_text().splitlines()]
    chat = []
    for rep in range(max(1, N // 4)):
        for line in example:
            line = dict(line)
            key = "custom_id" if "custom_id" in line else "id"
            line[key] = f"{line[key]}-{rep}"
            chat.append(line)
    result["chat_job"] = run_job("chat", chat, out, model)
    print("chat job", json.dumps(result["chat_job"]), flush=True)
    result["w1_engine"] = run_engine(wl, model)
    print("w1 engine", json.dumps(result["w1_engine"]), flush=True)
    (out / "job_vs_engine.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    if FAKE:
        fake_model()
    if sys.argv[1] == "--job":  # the child: `pagedctl generate ARGS`, the fake model if asked
        from pagedctl.cli import main as cli_main

        if os.environ.get("JOB_TRACE_JIT"):
            trace_jit(Path(os.environ["JOB_TRACE_JIT"]))
        sys.argv = ["pagedctl", "generate", *sys.argv[2:]]
        cli_main()
    else:
        main()

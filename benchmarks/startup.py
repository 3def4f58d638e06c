"""The whole wall time of a small `pagedctl generate` job, fresh and run again, with its phases.

`python -m benchmarks.startup OUT [--runs 3] [--requests 32] [--profile]` (CUDA;
results/startup-h200.*): a job of `--requests` `prompt_token_ids` lines (prompts of U[50, 400]
random token ids, `max_tokens` U[16, 256], EOS ignored, greedy) on the Qwen2.5-0.5B-Instruct preset
with dummy weights, run `--runs` times as `python -m pagedctl generate` in a child process, each
with a new output file. The first run starts from an empty `$PAGEDCTL_HOME` (no compilation cache
of pagedctl's); later runs reuse it, as a nightly job on the same machine would. Each run's whole
command is timed from outside (interpreter start to exit) and its summary's `startup` phases are
kept. `--profile` adds one more run under cProfile and writes its 40 costliest functions by
cumulative time to `OUT/startup.profile.txt`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path


def job_lines(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [
        {
            "custom_id": f"job-{i}",
            "prompt_token_ids": [rng.randrange(10000) for _ in range(rng.randint(50, 400))],
            "max_tokens": rng.randint(16, 256),
            "ignore_eos": True,
            "temperature": 0,
        }
        for i in range(n)
    ]


def run_once(out: Path, name: str, src: Path, env: dict, args: list[str], profile: bool) -> dict:
    cmd = [sys.executable]
    if profile:
        cmd += ["-m", "cProfile", "-o", str(out / f"{name}.prof")]
    cmd += ["-m", "pagedctl", "generate", str(src), "-o", str(out / f"{name}.out.jsonl")]
    cmd += ["--errors", str(out / f"{name}.err.jsonl"), "--summary-json", str(out / f"{name}.json")]
    cmd += ["-q", *args]
    t = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t
    (out / f"{name}.log").write_text(done.stdout[-8000:] + done.stderr[-8000:])
    if done.returncode != 0:
        raise SystemExit(f"{name}: exit {done.returncode}\n{done.stderr[-3000:]}")
    summary = json.loads((out / f"{name}.json").read_text())
    return {"command_wall_s": round(wall, 2), "summary": summary}


def profile_table(path: Path, limit: int = 40) -> str:
    import io
    import pstats

    buf = io.StringIO()
    pstats.Stats(str(path), stream=buf).sort_stats("cumulative").print_stats(limit)
    return buf.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--model", default="qwen2.5-0.5b-instruct")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--home", type=Path, help="PAGEDCTL_HOME (default: a new one under OUT)")
    opts = ap.parse_args()
    out = opts.out
    out.mkdir(parents=True, exist_ok=True)
    src = out / "startup-job.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in job_lines(opts.requests)))
    home = opts.home or out / "home"
    env = dict(os.environ, PAGEDCTL_HOME=str(home))
    args = ["--model", opts.model, "--load-format", opts.load_format]
    runs = []
    for i in range(opts.runs):
        result = run_once(out, f"run{i}", src, env, args, profile=False)
        runs.append(result)
        s = result["summary"]
        print(
            f"run {i}: whole command {result['command_wall_s']:.2f} s, generating "
            f"{s['wall_s']:.2f} s, start-up {json.dumps(s.get('startup'))}",
            flush=True,
        )
    report = {"requests": opts.requests, "model": opts.model, "runs": runs}
    if opts.profile:
        result = run_once(out, "profiled", src, env, args, profile=True)
        (out / "startup.profile.txt").write_text(profile_table(out / "profiled.prof"))
        report["profiled_command_wall_s"] = result["command_wall_s"]
    from pagedctl.envinfo import environment

    report["environment"] = environment()
    (out / "startup.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

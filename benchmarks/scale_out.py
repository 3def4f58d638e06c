"""`pagedctl generate` on one engine against `--replicas N`, the same job in the same call.

    python -m benchmarks.scale_out OUT_DIR [--replicas 1,2] [--requests 4096] [--model M]
        [--load-format dummy] [--prompt-len 100,1024] [--output-len 100,1024] [--temperature 0]
        [--ray-address auto] [-- ENGINE FLAGS...]

Writes a nano-bench-shaped job (`make_workload`: prompts of random token ids in
[0, 10000), lengths and `max_tokens` uniform in the given ranges, EOS ignored) as
`prompt_token_ids` lines, then runs it as a one-process job and with each `--replicas` count,
each into fresh output files, one after another. Every run's summary is kept; the table compares
output tokens per second over the part of each run that generated: a one-process job's wall
starts after its model loaded, a scaled-out job's after its driver started, with its replicas
loading inside it, so their loading (`replicas_ready_s`) is taken off. Whole-command walls
(start-up included on both sides) are listed too. Every `custom_id` must come back once, and
greedy answers (`--temperature 0`) must equal the one-process job's.

Writes OUT_DIR/scale_out.json and OUT_DIR/scale_out.md; the default shape is the multi-GPU run
(4,096 requests, Qwen2.5-0.5B preset, dummy weights, one GPU a replica).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from pagedctl.bench.recipe import WorkloadSpec, make_workload
from pagedctl.envinfo import environment


def pair(text: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in text.split(","))
    return lo, hi


def write_job(path: Path, args) -> int:
    spec = WorkloadSpec(
        num_requests=args.requests,
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        token_ids=(0, 10000),
        seed=0,
        temperature=args.temperature,
    )
    w = make_workload(spec)
    with path.open("w") as f:
        for i, (prompt, n) in enumerate(zip(w.prompts, w.max_tokens, strict=True)):
            line = {"custom_id": f"w1-{i:05d}", "prompt_token_ids": prompt, "max_tokens": n}
            if args.temperature == 0:
                line["logprobs"] = True  # the answer's tokens, to compare across runs
            f.write(json.dumps(line) + "\n")
    return len(w.prompts)


def run_job(src: Path, out_dir: Path, name: str, extra: list[str], args) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = out_dir / "summary.json"
    cmd = [
        sys.executable, "-m", "pagedctl", "generate", str(src),
        "-o", str(out_dir / "out.jsonl"), "--errors", str(out_dir / "errors.jsonl"),
        "--model", args.model, "--load-format", args.load_format,
        "--temperature", str(args.temperature), "--ignore-eos", "-q",
        "--summary-json", str(summary), *extra, *args.engine,
    ]  # fmt: skip
    start = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ})
    whole = time.perf_counter() - start
    if r.returncode != 0:
        raise SystemExit(f"{name} failed ({r.returncode}):\n{r.stderr[-4000:]}")
    s = json.loads(summary.read_text())
    ready = s.get("replicas_ready_s") or 0.0
    generating = s["wall_s"] - ready
    return {
        "name": name,
        "command": " ".join(cmd[1:]),
        "whole_wall_s": round(whole, 2),
        "wall_s": s["wall_s"],
        "replicas_ready_s": s.get("replicas_ready_s"),
        "generating_s": round(generating, 3),
        "output_tokens": s["output_tokens"],
        "output_tok_per_s": round(s["output_tokens"] / generating, 1),
        "preemptions": s["preemptions"],
        "replicas": s.get("replicas"),
        "answers": answers(out_dir / "out.jsonl"),
    }


def answers(path: Path) -> dict[str, list | None]:
    out: dict[str, list | None] = {}
    for line in path.read_text().splitlines():
        r = json.loads(line)
        assert r["custom_id"] not in out, f"{r['custom_id']} twice in {path}"
        lp = r["response"]["body"]["choices"][0]["logprobs"]
        out[r["custom_id"]] = lp["tokens"] if lp else None
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--replicas", default="1,2")
    p.add_argument("--requests", type=int, default=4096)
    p.add_argument("--model", default="qwen2.5-0.5b-instruct")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--prompt-len", type=pair, default=(100, 1024))
    p.add_argument("--output-len", type=pair, default=(100, 1024))
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ray-address", default=None)
    p.add_argument("engine", nargs="*", help="engine flags for every run (after --)")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    src = args.out / "w1.jsonl"
    n = write_job(src, args)
    address = ["--ray-address", args.ray_address] if args.ray_address else []
    runs = [run_job(src, args.out / "one-process", "one process", [], args)]
    for k in (int(x) for x in args.replicas.split(",")):
        extra = ["--replicas", str(k), *address]
        runs.append(run_job(src, args.out / f"replicas-{k}", f"--replicas {k}", extra, args))
    base = runs[0]
    for r in runs:
        assert len(r["answers"]) == n, f"{r['name']}: {len(r['answers'])} of {n} answers"
        r["same_answers_as_one_process"] = r["answers"] == base["answers"]
        r["vs_one_process"] = round(r["output_tok_per_s"] / base["output_tok_per_s"], 3)
    one_replica = next((r for r in runs if r["name"] == "--replicas 1"), None)
    for r in runs:
        if one_replica is not None:
            r["vs_one_replica"] = round(r["output_tok_per_s"] / one_replica["output_tok_per_s"], 3)
        del r["answers"]
    result = {"requests": n, "args": vars(args) | {"out": str(args.out)}, "runs": runs,
              "environment": environment()}  # fmt: skip
    (args.out / "scale_out.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    lines = [
        "| run | generating s | replicas ready s | whole command s | output tok/s | vs one "
        "process | vs one replica | same answers |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in runs:
        lines.append(
            f"| {r['name']} | {r['generating_s']:.2f} | {r['replicas_ready_s'] or '-'} | "
            f"{r['whole_wall_s']:.1f} | {r['output_tok_per_s']:,.1f} | {r['vs_one_process']:.3f} | "
            f"{r.get('vs_one_replica', '-')} | {r['same_answers_as_one_process']} |"
        )
    table = "\n".join(lines)
    (args.out / "scale_out.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()

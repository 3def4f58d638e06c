"""What the `deterministic` setting costs and which answers it keeps: the engine with and without.

`python -m benchmarks.deterministic --dtypes bfloat16,float16,float32 --out results` (results/
deterministic-cpu.md, .json) from the repository root runs the cron job's workload: the 32
chat prompts of recipes/data/chat-cpu.jsonl on the bundled SmolLM2-135M-Instruct, greedy, each
request's own `max_tokens`. `--recipe nano-bench --device cuda --dtypes bfloat16` runs a bench
recipe's workload instead (results/deterministic-h200.md).

Per dtype, one engine alternates the two modes (`reconfigure`, which empties the prefix cache), the
order reversed every repeat, after an untimed warm-up of each: the figure is output tokens over the
`generate` call's wall time, the median of `--repeats`. What each mode keeps, counted on the same
engine: the answers of a second pass over the prompts (every prefix read from the cache) equal to
the first pass's, and `--alone` prompts run one at a time equal to their answers in the batch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import pagedctl  # noqa: F401  (first: the checkout's kernels/ must not shadow Hugging Face's)
from pagedctl import bundled_model
from pagedctl.bench.recipe import load_bench_recipe, make_workload
from pagedctl.bench.transformers import chat_prompt_ids, load_chat_requests
from pagedctl.engine import LLM, SamplingParams
from pagedctl.envinfo import environment
from pagedctl.recipe_file import find_recipe

ROOT = Path(__file__).resolve().parents[1]
CHAT = ROOT / "recipes" / "data" / "chat-cpu.jsonl"


def chat_workload(llm: LLM) -> tuple[list[list[int]], list[int]]:
    rows = load_chat_requests(CHAT)
    return chat_prompt_ids(llm.tokenizer, rows), [r["max_tokens"] for r in rows]


def answers(llm: LLM, prompts: list[list[int]], limits: list[int]) -> tuple[float, int, list]:
    params = [SamplingParams(temperature=0.0, max_tokens=m) for m in limits]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return wall, sum(map(len, tokens)), tokens


def measure(args: argparse.Namespace, dtype: str) -> dict:
    if args.recipe:
        recipe = load_bench_recipe(find_recipe(args.recipe))
        llm = LLM(config=recipe.config.replace(dtype=dtype, device=args.device))
        work = make_workload(recipe.workload)
        prompts, limits = work.prompts, work.max_tokens
    else:
        llm = LLM(str(bundled_model()), device=args.device, dtype=dtype)
        prompts, limits = chat_workload(llm)
    modes = {"off": False, "on": True}
    runs: dict[str, list[float]] = {m: [] for m in modes}
    kept: dict[str, dict] = {}
    for mode, on in modes.items():  # warm-up, and what each mode keeps
        llm.reconfigure(deterministic=on)
        _, _, first = answers(llm, prompts, limits)
        _, _, second = answers(llm, prompts, limits)
        alone = [answers(llm, [prompts[i]], [limits[i]])[2][0] for i in range(args.alone)]
        kept[mode] = {
            "second_pass_same": sum(a == b for a, b in zip(first, second, strict=True)),
            "alone_same": sum(a == first[i] for i, a in enumerate(alone)),
            "tokens": first,
        }
    for r in range(args.repeats):
        for mode in modes if r % 2 == 0 else reversed(modes):
            llm.reconfigure(deterministic=modes[mode])
            wall, out_tokens, _ = answers(llm, prompts, limits)
            runs[mode].append(out_tokens / wall)
    med = {m: statistics.median(v) for m, v in runs.items()}
    same = sum(a == b for a, b in zip(kept["off"]["tokens"], kept["on"]["tokens"], strict=True))
    return {
        "dtype": dtype,
        "requests": len(prompts),
        "tok_s": runs,
        "median_tok_s": med,
        "cost": med["off"] / med["on"],
        "second_pass_same": {m: kept[m]["second_pass_same"] for m in modes},
        "alone_same": {m: kept[m]["alone_same"] for m in modes},
        "alone_checked": args.alone,
        "on_equals_off": same,
    }


def report(rows: list[dict], args: argparse.Namespace) -> str:
    lines = [
        f"# `deterministic`: cost and answers kept ({args.device}, {rows[0]['requests']} "
        f"requests, greedy, median of {args.repeats})",
        "",
        "| dtype | off tok/s | on tok/s | off / on | second pass same, off | on | "
        f"alone same (of {args.alone}), off | on | on = off |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        m, s, a = r["median_tok_s"], r["second_pass_same"], r["alone_same"]
        lines.append(
            f"| {r['dtype']} | {m['off']:.1f} | {m['on']:.1f} | {r['cost']:.2f}x | "
            f"{s['off']}/{r['requests']} | {s['on']}/{r['requests']} | {a['off']} | {a['on']} | "
            f"{r['on_equals_off']}/{r['requests']} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--recipe", help="a bench recipe's workload instead of the chat prompts")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--alone", type=int, default=8, help="prompts also run one at a time")
    ap.add_argument("--name", default="deterministic-cpu")
    ap.add_argument("--out", type=Path, default=ROOT / "results")
    args = ap.parse_args()
    rows = []
    for dtype in args.dtypes.split(","):
        rows.append(measure(args, dtype))
        print(report(rows, args), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.md").write_text(report(rows, args))
    doc = {"environment": environment(), "args": {k: str(v) for k, v in vars(args).items()}}
    (args.out / f"{args.name}.json").write_text(json.dumps({**doc, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

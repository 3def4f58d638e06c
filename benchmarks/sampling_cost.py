"""What the logits-shaping fields and prompt scoring cost: one engine, the same workload.

`python -m benchmarks.sampling_cost --recipe nano-bench --out results/sampling-cost-h100` (from
the repository root; writes OUT.md and OUT.json) runs a bench recipe's workload (nano-bench: 256
requests on the Qwen2.5-0.5B shape, the recipe's temperature and engine settings) on one engine
under each variant, alternating them (the order reversed every repeat) after an untimed warm-up
of each; the figure is output tokens over the `generate` call's wall time, the median of
`--repeats`:

- `plain`: the recipe's sampling;
- `penalties`: every row also with presence 0.5, frequency 0.5 and repetition 1.1 penalties;
- `penalties+bias`: those and a `logit_bias` of 16 token ids on every row;
- `top_logprobs`: every row with the sampled token's logprob and its 5 most likely tokens (a
  one-step field: it keeps rows out of multi-step windows).

Prompt scoring: one request of `--score-len` prompt tokens with `prompt_logprobs` (5 top
tokens), timed against the same prompt without, and the device's peak memory over the engine's
steady state for each (`torch.cuda.max_memory_allocated`, CUDA only): the chunked log-softmax
of `runner.prompt_logprobs.PROMPT_LOGPROB_BYTES`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import time
from pathlib import Path

import torch

import pagedctl  # noqa: F401  (first: the checkout's kernels/ must not shadow Hugging Face's)
from pagedctl import bundled_model
from pagedctl.bench.recipe import load_bench_recipe, make_workload
from pagedctl.engine import LLM, SamplingParams
from pagedctl.envinfo import environment
from pagedctl.recipe_file import find_recipe

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {
    "plain": {},
    "penalties": {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1},
    "penalties+bias": {
        "presence_penalty": 0.5,
        "frequency_penalty": 0.5,
        "repetition_penalty": 1.1,
        "logit_bias": {t: (-1.0) ** t * 2.0 for t in range(100, 1700, 100)},
    },
    "top_logprobs": {"logprobs": True, "top_logprobs": 5},
}


def timed(llm: LLM, prompts: list, params: list[SamplingParams]) -> tuple[float, int]:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    assert all(o.ok for o in outs), [o.error for o in outs if not o.ok][:3]
    return wall, sum(len(o.outputs[0].token_ids) for o in outs)


def variants(args: argparse.Namespace, llm: LLM, work) -> dict:
    base = [
        SamplingParams(temperature=work.temperature, max_tokens=m, ignore_eos=True)
        for m in work.max_tokens
    ]
    params = {v: [dataclasses.replace(p, **extra) for p in base] for v, extra in VARIANTS.items()}
    for v in params:  # warm-up
        timed(llm, work.prompts[: args.warmup], params[v][: args.warmup])
    runs: dict[str, list[float]] = {v: [] for v in params}
    names = list(params)
    for r in range(args.repeats):
        for v in names if r % 2 == 0 else reversed(names):
            wall, tokens = timed(llm, work.prompts, params[v])
            runs[v].append(tokens / wall)
            print(f"{v}: {tokens / wall:.0f} tok/s", flush=True)
    med = {v: statistics.median(x) for v, x in runs.items()}
    return {
        "tok_s": runs,
        "median_tok_s": med,
        "ratio": {v: med["plain"] / m for v, m in med.items()},
    }


def scoring(args: argparse.Namespace, llm: LLM) -> dict:
    rng = random.Random(0)

    def prompt() -> list[int]:  # a new one each run: no prefix-cache hit for the plain runs
        return [rng.randrange(10, 10000) for _ in range(args.score_len)]

    cuda = llm.device.type == "cuda"
    out = {}
    for name, extra in (("without", {}), ("prompt_logprobs", {"prompt_logprobs": 5})):
        params = SamplingParams(temperature=0.0, max_tokens=1, **extra)
        llm.generate([prompt()], params)  # warm-up
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        walls = [timed(llm, [prompt()], [params])[0] for _ in range(args.repeats)]
        out[name] = {"wall_s": statistics.median(walls)}
        if cuda:
            out[name]["peak_over_steady_MiB"] = (torch.cuda.max_memory_allocated() - base) / 2**20
    out["cost"] = out["prompt_logprobs"]["wall_s"] / out["without"]["wall_s"]
    return out


def report(res: dict, args: argparse.Namespace) -> str:
    env = res["environment"]
    lines = [
        f"# Sampling fields: what they cost ({env.get('gpu') or res['device']})",
        "",
        f"`python -m benchmarks.sampling_cost --recipe {args.recipe}`; commit "
        f"{env.get('commit', '?')}, torch {env.get('torch')}; {res['requests']} requests, median "
        f"of {args.repeats} alternating runs.",
        "",
        "| variant | output tok/s | plain / variant |",
        "|---|---:|---:|",
    ]
    v = res["variants"]
    for name, tok_s in v["median_tok_s"].items():
        lines.append(f"| {name} | {tok_s:,.0f} | {v['ratio'][name]:.3f} |")
    s = res["scoring"]
    lines += [
        "",
        f"Prompt scoring, one prompt of {args.score_len} tokens, 5 top tokens a position:",
        "",
        "| | wall s | peak over steady MiB |",
        "|---|---:|---:|",
    ]
    for name in ("without", "prompt_logprobs"):
        peak = s[name].get("peak_over_steady_MiB")
        lines.append(
            f"| {name} | {s[name]['wall_s']:.4f} | {'-' if peak is None else f'{peak:.0f}'} |"
        )
    lines.append(f"\nprompt_logprobs / without: {s['cost']:.2f}x")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", default="nano-bench")
    ap.add_argument("--device", help="override the recipe's device")
    ap.add_argument("--requests", type=int, help="the first N requests of the workload")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=16, help="requests of each variant's warm-up")
    ap.add_argument("--score-len", type=int, default=2000)
    ap.add_argument("--out", type=Path, required=True, help="path prefix of OUT.md and OUT.json")
    args = ap.parse_args()
    recipe = load_bench_recipe(find_recipe(args.recipe))
    config = recipe.config if args.device is None else recipe.config.replace(device=args.device)
    if config.model is None:  # the bundled model
        config = config.replace(model=str(bundled_model()))
    llm = LLM(config=config)
    work = make_workload(recipe.workload)
    if args.requests:
        work = dataclasses.replace(
            work, prompts=work.prompts[: args.requests], max_tokens=work.max_tokens[: args.requests]
        )
    res = {"environment": environment(), "requests": len(work.prompts), "device": config.device}
    res["variants"] = variants(args, llm, work)
    res["scoring"] = scoring(args, llm)
    text = report(res, args)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(text)
    args.out.with_suffix(".json").write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()

"""Beam search on paged blocks: the KV memory its sharing saves, and its speed against transformers.

`python -m benchmarks.beam_search --out results` (results/beam-search-cpu.md, .json) from the
repository root; on a GPU `--device cuda --dtype bfloat16 --name beam-search-h200`. The model is
the bundled SmolLM2-135M-Instruct unless `--model PATH` names a Hugging Face folder; the prompts
are the chat requests below (some with a system prompt), rendered by the model's chat template.

Memory. One `LLM.beam_search` call on all the prompts per beam width and block size, EOS on, the
prefix cache off (so that every shared block is one the beams share by forking, not one a prompt
found cached). Per request the engine reports `peak_blocks`, the most distinct KV blocks its live
beams held at once, and `peak_blocks_unshared`, what the same beams would have held with private
copies (the sum over beams of ceil(tokens / block size): what an engine with one contiguous cache
per beam pays, before any reservation for the tokens still to come). The saving is
1 - peak_blocks / peak_blocks_unshared, over the sums of all requests and as the mean of the
requests' own savings. The PagedAttention paper (Kwon et al., SOSP 2023) reports 37-55% for beam
search on Alpaca. An independent check of the figure: with one request in the engine and the
prefix cache off, the pool's own peak of used blocks (`llm.stats`) must equal that request's
`peak_blocks`; `--pool-checks` requests are run alone to assert it.

Speed. The first `--speed-prompts` prompts (8 on the CPU, else all), `--speed-max-tokens` tokens
at most (64 on the CPU, else `--max-tokens`), widths `--speed-widths`, blocks of 16 and the prefix
cache on but emptied before every run: one `beam_search` call on all of them against transformers
`generate` (`num_beams` = `num_return_sequences` = width, greedy, the same length penalty and
early stopping) on the same token ids, left-padded in batches of each `--hf-batch-sizes` (its
fastest is the one compared), its model loaded from the same folder in the same dtype. Each side
is warmed up once, then the sides alternate for `--repeats` runs and the medians are reported.
Tokens are those of the best hypothesis of each request, its EOS included. Agreement: the share
of requests whose best hypothesis has the same tokens on both sides (reported, not asserted: bf16
rounding, or a tie between beams, may pick another one), with both sides' length-penalised scores
where they differ.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAPER = (
    "PagedAttention (Kwon et al., SOSP 2023): beam search saves 37-55% of KV memory on Alpaca "
    "(parallel sampling 6-10%)"
)

TUTOR = "You are a patient tutor. Explain step by step and check the reader's understanding."
CODER = "You are a senior Python developer. Answer with short, idiomatic code and a brief note."
CONCISE = "You are a helpful assistant. Keep answers under five sentences."
TRAVEL = (
    "You are a travel planner for a small agency. Suggest realistic itineraries, mention "
    "travel times between places, and flag anything that needs booking in advance."
)

CHATS: list[tuple[str | None, str]] = [
    (None, "What is the capital of Australia, and why isn't it Sydney?"),
    (None, "Write a short poem about a lighthouse keeper who has never seen the sea in daylight."),
    (CONCISE, "How do vaccines train the immune system?"),
    (
        None,
        "I have two weeks before a job interview for a data analyst position. I know Excel well "
        "but my SQL is rusty and I have never used Python. What should I focus on each day?",
    ),
    (CODER, "How do I read a large CSV file in chunks with pandas and sum one column?"),
    (TUTOR, "Why does ice float on water when most solids sink in their own liquid?"),
    (None, "Give me three ideas for a birthday dinner for a friend who is vegetarian."),
    (
        TRAVEL,
        "We are a family of four with kids aged 8 and 11, flying into Lisbon for five days in "
        "April. We like beaches, old castles and good food, but not long drives. Plan our week.",
    ),
    (None, "Explain the difference between a virus and a bacterium."),
    (CODER, "What does the `yield` keyword do in Python? Show a small example."),
    (None, "Summarise the plot of Romeo and Juliet in a paragraph."),
    (CONCISE, "What causes the seasons on Earth?"),
    (
        None,
        "My tomato plants have yellow leaves at the bottom and some brown spots. I water them "
        "every evening and they get about six hours of sun. What could be wrong and what can I "
        "do about it?",
    ),
    (TUTOR, "Can you explain what a derivative is, using a car's speedometer as an example?"),
    (None, "Write a polite email to my landlord asking to fix a leaking kitchen tap."),
    (None, "What are the pros and cons of working from home?"),
    (
        CODER,
        "I have a list of dictionaries with 'name' and 'age' keys. How do I sort it by age and "
        "then by name, and how do I keep only people older than 30?",
    ),
    (None, "How does a bill become a law in the United States?"),
    (CONCISE, "Is it better to run in the morning or in the evening?"),
    (
        TUTOR,
        "I keep mixing up mean, median and mode. Could you explain each with the same small set "
        "of numbers, and tell me when the median is more useful than the mean?",
    ),
    (None, "Tell me a short story about a robot who learns to bake bread."),
    (None, "What should I pack for a three-day hiking trip in the mountains in autumn?"),
]


def chat_prompts() -> list[dict]:
    """The requests as `{"messages": [...]}` prompts."""
    out = []
    for system, user in CHATS:
        messages = [{"role": "system", "content": system}] if system else []
        out.append({"messages": [*messages, {"role": "user", "content": user}]})
    return out


def render(tokenizer, prompt: dict) -> list[int]:
    """The token ids the engine makes of a `{"messages"}` prompt (its chat template, no BOS)."""
    text = tokenizer.apply_chat_template(
        prompt["messages"], tokenize=False, add_generation_prompt=True
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------- memory


def memory_rows(outs, width: int, block_size: int, max_tokens: int) -> list[dict]:
    """Each request's figures, and what makes one impossible (a bound it breaks)."""
    rows = []
    for o in outs:
        m = o.metrics
        prompt = m.num_prompt_tokens
        lengths = [len(c.token_ids) for c in o.outputs]
        row = {
            "prompt_tokens": prompt,
            "hypotheses": len(o.outputs),
            "best_tokens": lengths[0] if lengths else 0,
            "mean_tokens_per_beam": statistics.mean(lengths) if lengths else 0.0,
            "best_finish": o.outputs[0].finish_reason if o.outputs else None,
            "peak_blocks": m.peak_blocks,
            "peak_blocks_unshared": m.peak_blocks_unshared,
            "num_shared_blocks": m.num_shared_blocks,
            "num_cow_copies": m.num_cow_copies,
        }
        row["saving"] = 1 - m.peak_blocks / m.peak_blocks_unshared if m.peak_blocks_unshared else 0
        most = width * math.ceil((prompt + max_tokens) / block_size)
        broken = []
        if o.error:
            broken.append(f"error: {o.error}")
        if not m.peak_blocks_unshared or m.peak_blocks > m.peak_blocks_unshared:
            broken.append("peak_blocks > peak_blocks_unshared")
        if m.peak_blocks < math.ceil(prompt / block_size):
            broken.append("peak_blocks below the prompt's own blocks")
        if m.peak_blocks_unshared > most:
            broken.append(
                f"peak_blocks_unshared above width x ceil((prompt + max) / block) = {most}"
            )
        if m.num_shared_blocks > m.peak_blocks:
            broken.append("num_shared_blocks > peak_blocks")
        if len(o.outputs) != width:
            broken.append(f"{len(o.outputs)} hypotheses, not {width}")
        row["impossible"] = broken
        rows.append(row)
    return rows


def memory_summary(rows: list[dict]) -> dict:
    shared = sum(r["peak_blocks"] for r in rows)
    unshared = sum(r["peak_blocks_unshared"] for r in rows)
    savings = [r["saving"] for r in rows]
    return {
        "requests": len(rows),
        "mean_prompt_tokens": round(statistics.mean(r["prompt_tokens"] for r in rows), 1),
        "mean_tokens_per_beam": round(statistics.mean(r["mean_tokens_per_beam"] for r in rows), 1),
        "mean_best_tokens": round(statistics.mean(r["best_tokens"] for r in rows), 1),
        "best_stopped": sum(r["best_finish"] == "stop" for r in rows),
        "peak_blocks": shared,
        "peak_blocks_unshared": unshared,
        "saving": round(1 - shared / unshared, 4) if unshared else None,
        "saving_mean_per_request": round(statistics.mean(savings), 4),
        "saving_min_max": [round(min(savings), 4), round(max(savings), 4)],
        "shared_blocks_at_peak": sum(r["num_shared_blocks"] for r in rows),
        "cow_copies": sum(r["num_cow_copies"] for r in rows),
        "impossible": sum(bool(r["impossible"]) for r in rows),
    }


def run_memory(llm, prompts, a) -> tuple[list[dict], list[dict]]:
    """Every width at every block size; then `--pool-checks` requests alone against the pool."""
    from pagedctl.engine import BeamSearchParams

    runs, checks = [], []
    for block_size in ints(a.block_sizes):
        for width in ints(a.widths):
            llm.reconfigure(block_size=block_size, enable_prefix_caching=False)
            params = BeamSearchParams(
                beam_width=width,
                max_tokens=a.max_tokens,
                length_penalty=a.length_penalty,
                early_stopping=a.early_stopping,
            )
            t0 = time.perf_counter()
            outs = llm.beam_search(prompts, params)
            wall = time.perf_counter() - t0
            rows = memory_rows(outs, width, block_size, a.max_tokens)
            run = {"block_size": block_size, "width": width, "wall_s": round(wall, 2)}
            run.update(summary=memory_summary(rows), requests=rows)
            run["pool_peak_used_blocks"] = llm.stats["prefix_cache"]["peak_used_blocks"]
            runs.append(run)
            s = run["summary"]
            print(
                f"memory block {block_size} width {width}: {s['peak_blocks']} / "
                f"{s['peak_blocks_unshared']} blocks, saving {s['saving']:.1%} (per request "
                f"{s['saving_mean_per_request']:.1%}), {wall:.1f} s",
                flush=True,
            )
            if width == max(ints(a.widths)) and block_size == ints(a.block_sizes)[0]:
                for i in range(min(a.pool_checks, len(prompts))):
                    llm.reconfigure(enable_prefix_caching=False)  # a fresh pool: its peak is 0
                    (out,) = llm.beam_search([prompts[i]], params)
                    pool = llm.stats["prefix_cache"]["peak_used_blocks"]
                    check = {
                        "request": i,
                        "block_size": block_size,
                        "width": width,
                        "peak_blocks": out.metrics.peak_blocks,
                        "pool_peak_used_blocks": pool,
                        "same_as_in_batch": out.metrics.peak_blocks == rows[i]["peak_blocks"],
                    }
                    checks.append(check)
                    print(
                        f"pool check: request {i} alone, width {width}: peak_blocks "
                        f"{check['peak_blocks']}, pool peak {pool} (in the batch: "
                        f"{rows[i]['peak_blocks']})",
                        flush=True,
                    )
    return runs, checks


# ---------------------------------------------------------------------------- speed


def strip_eos(tokens: list[int], eos: set[int]) -> list[int]:
    """Tokens up to the first EOS, that EOS left out."""
    cut = next((i for i, t in enumerate(tokens) if t in eos), len(tokens))
    return list(tokens[:cut])


def counted(tokens: list[int], eos: set[int]) -> int:
    """Generated tokens of a hypothesis, its EOS included."""
    body = strip_eos(tokens, eos)
    return len(body) + (len(body) < len(tokens))


def engine_runner(llm, prompts, ids, params, eos: set[int]):
    def run() -> list[dict]:
        llm.reset_prefix_cache()  # every run computes its prompts, as transformers does
        outs = llm.beam_search(prompts, params)
        sync(llm.device)
        best = []
        for o, mine in zip(outs, ids, strict=True):
            assert o.prompt_token_ids == mine, "the engine rendered a prompt otherwise"
            c = o.outputs[0]
            n = counted(c.token_ids, eos)
            score = c.cumulative_logprob / n**params.length_penalty if n else None
            best.append({"tokens": strip_eos(c.token_ids, eos), "counted": n, "score": score})
        return best

    return run


def hf_runner(model, ids: list[list[int]], width: int, a, batch_size: int, eos: set[int], pad):
    import torch

    from pagedctl.bench.peers import left_pad

    @torch.inference_mode()
    def batch(rows: list[list[int]]) -> list[dict]:
        w = max(map(len, rows))
        x, mask = left_pad(rows, w, model.device, pad)
        out = model.generate(
            x,
            attention_mask=mask,
            num_beams=width,
            num_return_sequences=width,
            do_sample=False,
            max_new_tokens=a.speed_max_tokens,
            length_penalty=a.length_penalty,
            early_stopping=a.early_stopping,
            pad_token_id=pad,
            eos_token_id=sorted(eos),
            return_dict_in_generate=True,
            output_scores=True,
        )
        seqs = out.sequences[:, w:].reshape(len(rows), width, -1)[:, 0].tolist()
        scores = out.sequences_scores.reshape(len(rows), width)[:, 0].tolist()
        return [
            {"tokens": strip_eos(s, eos), "counted": counted(s, eos), "score": sc}
            for s, sc in zip(seqs, scores, strict=True)
        ]

    def run() -> list[dict]:
        best = []
        for i in range(0, len(ids), batch_size):
            best += batch(ids[i : i + batch_size])
        sync(model.device)
        return best

    return run


def timed(fn) -> tuple[float, list[dict]]:
    t0 = time.perf_counter()
    best = fn()
    return time.perf_counter() - t0, best


def loadavg() -> float | None:
    """The machine's 1-minute load average: what else ran beside a timed run."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def side_figures(walls: list[float], best: list[dict]) -> dict:
    wall = statistics.median(walls)
    tokens = sum(b["counted"] for b in best)
    return {
        "wall_s": round(wall, 3),
        "wall_s_all": [round(w, 3) for w in walls],
        "requests_per_s": round(len(best) / wall, 3),
        "output_tokens": tokens,
        "output_tok_s": round(tokens / wall, 2),
    }


def agreement(ours: list[dict], theirs: list[dict]) -> dict:
    same = [a["tokens"] == b["tokens"] for a, b in zip(ours, theirs, strict=True)]
    differ = []
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        if a["tokens"] != b["tokens"]:
            common = next(
                (
                    j
                    for j, (x, y) in enumerate(zip(a["tokens"], b["tokens"], strict=False))
                    if x != y
                ),
                min(len(a["tokens"]), len(b["tokens"])),
            )
            differ.append({
                "request": i, "pagedctl_tokens": a["counted"], "transformers_tokens": b["counted"],
                "same_first_tokens": common,
                "pagedctl_score": _round(a["score"]), "transformers_score": _round(b["score"]),
            })  # fmt: skip
    return {"same": sum(same), "of": len(same), "rate": round(sum(same) / len(same), 4),
            "differ": differ}  # fmt: skip


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 5)


def run_speed(llm, hf, prompts, ids, a) -> list[dict]:
    import torch

    from pagedctl.engine import BeamSearchParams

    eos = set(llm.tracker.eos_token_ids)
    pad = llm.tracker.eos_token_ids[0]
    n = len(prompts)
    sizes = sorted({n if s == "all" else min(int(s), n) for s in a.hf_batch_sizes.split(",")})
    runs = []
    for width in ints(a.speed_widths):
        params = BeamSearchParams(
            beam_width=width,
            max_tokens=a.speed_max_tokens,
            length_penalty=a.length_penalty,
            early_stopping=a.early_stopping,
        )
        sides = {"pagedctl": engine_runner(llm, prompts, ids, params, eos)}
        for s in sizes:
            sides[f"transformers_batch_{s}"] = hf_runner(hf, ids, width, a, s, eos, pad)
        # warm-up of each side: two requests, four tokens
        llm.beam_search(prompts[:2], BeamSearchParams(beam_width=width, max_tokens=4))
        hf_runner(hf, ids[:2], width, _few(a), 2, eos, pad)()
        walls: dict[str, list[float]] = {k: [] for k in sides}
        loads: dict[str, list[float | None]] = {k: [] for k in sides}
        best: dict[str, list[dict]] = {}
        for rep in range(a.repeats):
            order = list(sides) if rep % 2 == 0 else list(sides)[::-1]
            for name in order:
                loads[name].append(loadavg())
                wall, best[name] = timed(sides[name])
                walls[name].append(wall)
                print(
                    f"speed width {width} {name}: {wall:.2f} s (load {loads[name][-1]})", flush=True
                )
        run: dict = {"width": width, "prompts": n, "max_tokens": a.speed_max_tokens}
        run.update(prompt_tokens=sum(map(len, ids)), threads=torch.get_num_threads())
        run["pagedctl"] = side_figures(walls["pagedctl"], best["pagedctl"])
        run["pagedctl"]["loadavg_before"] = loads["pagedctl"]
        run["transformers"] = {}
        for s in sizes:
            key = f"transformers_batch_{s}"
            run["transformers"][str(s)] = side_figures(walls[key], best[key])
            run["transformers"][str(s)]["agreement"] = agreement(best["pagedctl"], best[key])
            run["transformers"][str(s)]["loadavg_before"] = loads[key]
        fastest = min(run["transformers"], key=lambda s: run["transformers"][s]["wall_s"])
        run["transformers_fastest_batch"] = int(fastest)
        peer = run["transformers"][fastest]
        run["ratio_output_tok_s"] = round(run["pagedctl"]["output_tok_s"] / peer["output_tok_s"], 3)
        run["ratio_requests_per_s"] = round(
            run["pagedctl"]["requests_per_s"] / peer["requests_per_s"], 3
        )
        run["agreement"] = peer["agreement"]
        runs.append(run)
        print(
            f"speed width {width}: pagedctl {run['pagedctl']['output_tok_s']} tok/s, transformers "
            f"(batch {fastest}) {peer['output_tok_s']} tok/s: {run['ratio_output_tok_s']}x; "
            f"best hypothesis agrees on {peer['agreement']['same']} of {n}",
            flush=True,
        )
    return runs


def _few(a):
    """The arguments of a warm-up: four new tokens."""
    return argparse.Namespace(**{**vars(a), "speed_max_tokens": 4})


# ---------------------------------------------------------------------------- report


def markdown(result: dict) -> str:
    a, env, e = result["args"], result["environment"], result["engine"]
    lines = [
        f"# {result['name']}",
        "",
        f"Beam search on {result['model']} ({e['device']}, {e['dtype']}): the KV blocks the "
        "beams' sharing saves, and pagedctl's `LLM.beam_search` against transformers "
        f"`generate(num_beams=...)`. Length penalty {a['length_penalty']:g}, early stopping "
        f"{a['early_stopping']}, EOS on.",
        "",
        f"Regenerate: `{result['command']}`",
        "",
        f"Ran on {env['gpu'] + ' beside ' if env.get('gpu') else ''}"
        f"{env['cpu']} ({env['cpu_count']} CPUs); torch {env['torch']}, transformers "
        f"{env['transformers']}; pagedctl {env['pagedctl']} commit {env['commit']}; "
        f"{env['date']}; {result['wall_s']:.0f} s in all.",
        "",
    ]
    if result.get("memory"):
        lines += [
            "## Memory",
            "",
            f"{len(result['prompts'])} chat prompts, answers of up to {a['max_tokens']} tokens, "
            "one `beam_search` call per row, prefix cache off. Blocks: the sums over requests "
            "of each request's peak of distinct blocks held by its live beams (paged) and of "
            "the same beams' blocks with private copies (unshared: sum over beams of "
            "ceil(tokens / block size)). Saving: 1 - paged / unshared, over the sums and as "
            "the mean (min-max) of the requests' own. Tokens per beam: generated tokens of a "
            "returned hypothesis, mean over hypotheses and requests.",
            "",
            "| block | width | prompt tokens (mean) | tokens per beam (mean) | best stopped at EOS "
            "| paged blocks | unshared blocks | saving | saving per request, mean (min-max) "
            "| shared at peak | CoW copies | pool peak, all at once | wall |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|",
        ]
        for r in result["memory"]:
            s = r["summary"]
            lo, hi = s["saving_min_max"]
            lines.append(
                f"| {r['block_size']} | {r['width']} | {s['mean_prompt_tokens']:.0f} "
                f"| {s['mean_tokens_per_beam']:.0f} | {s['best_stopped']} of {s['requests']} "
                f"| {s['peak_blocks']:,} | {s['peak_blocks_unshared']:,} | **{s['saving']:.1%}** "
                f"| {s['saving_mean_per_request']:.1%} ({lo:.1%}-{hi:.1%}) "
                f"| {s['shared_blocks_at_peak']:,} | {s['cow_copies']:,} "
                f"| {r['pool_peak_used_blocks']:,} | {r['wall_s']:.0f} s |"
            )
        lines += [
            "",
            f"For comparison: {PAPER}; their widths, model and way of counting are not ours. "
            "Shared at peak: blocks held by two beams or more at each request's peak, summed. "
            "Pool peak: the most blocks the pool had in use during the call, all requests in "
            "it together (below the sum of their peaks, which come at different times).",
        ]
        bad = sum(r["summary"]["impossible"] for r in result["memory"])
        if bad:
            lines.append(f"\n{bad} request rows break a bound (see `impossible` in the JSON).")
        if result.get("pool_checks"):
            checks = ", ".join(
                f"request {c['request']} (width {c['width']}, block {c['block_size']}): "
                f"{c['peak_blocks']} = {c['pool_peak_used_blocks']}"
                for c in result["pool_checks"]
            )
            lines += [
                "",
                "Check: each request alone in a fresh pool (prefix cache off), its "
                f"`peak_blocks` against the pool's peak of used blocks: {checks}.",
            ]
        lines.append("")
    if result.get("speed"):
        lines += [
            "## Speed",
            "",
            "One `beam_search` call on all the prompts against transformers `generate` on the "
            "same token ids, left-padded in batches of each size, its fastest batch compared. "
            "Tokens: the best hypothesis of each request, its EOS included. Medians of "
            f"{a['repeats']} runs, the sides alternating, each warmed up once. Agreement: "
            "requests whose best hypothesis is the same on both sides.",
            "",
            "| width | prompts x max tokens | side | wall | requests/s | tok/s | pagedctl ÷ "
            "| same best hypothesis |",
            "|---:|---|---|---:|---:|---:|---:|---|",
        ]
        for r in result["speed"]:
            size = f"{r['prompts']} x {r['max_tokens']}"
            p = r["pagedctl"]
            lines.append(
                f"| {r['width']} | {size} | pagedctl, one call | {p['wall_s']:.2f} s "
                f"| {p['requests_per_s']:.2f} | {p['output_tok_s']:.1f} | | |"
            )
            for s, t in r["transformers"].items():
                ratio = p["output_tok_s"] / t["output_tok_s"]
                g = t["agreement"]
                best = " (fastest)" if int(s) == r["transformers_fastest_batch"] else ""
                lines.append(
                    f"| {r['width']} | {size} | transformers, batch {s}{best} "
                    f"| {t['wall_s']:.2f} s "
                    f"| {t['requests_per_s']:.2f} | {t['output_tok_s']:.1f} | {ratio:.2f}x "
                    f"| {g['same']} of {g['of']} |"
                )
        loads = [
            x
            for r in result["speed"]
            for side in [r["pagedctl"], *r["transformers"].values()]
            for x in side.get("loadavg_before", [])
            if x is not None
        ]
        if loads:
            lines += [
                "",
                f"The machine's 1-minute load average before the timed runs: {min(loads):.1f}-"
                f"{max(loads):.1f} on {result['environment']['cpu_count']} CPUs, other work "
                "beside this one above that (each side's own in the JSON).",
            ]
        lines.append("")
        for r in result["speed"]:
            for d in r["agreement"]["differ"]:
                lines.append(
                    f"- width {r['width']}, request {d['request']}: the first "
                    f"{d['same_first_tokens']} tokens agree; {d['pagedctl_tokens']} against "
                    f"{d['transformers_tokens']} tokens, length-penalised score "
                    f"{d['pagedctl_score']} (pagedctl) against {d['transformers_score']}"
                )
        lines.append("")
    return "\n".join(lines)


def _shown_path(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def command(a, defaults: dict) -> str:
    parts = ["python -m benchmarks.beam_search"]
    for k, v in vars(a).items():
        if k in ("out", "render") or v == defaults.get(k):
            continue
        flag = "--" + k.replace("_", "-")
        parts.append(f"{flag} {str(v).lower() if k == 'early_stopping' else v}")
    return " ".join(parts) + f" --out {_shown_path(a.out)}"


def early_stopping(text: str) -> bool | str:
    value = {"false": False, "true": True, "never": "never"}.get(text.lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"false, true or never, not {text!r}")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a Hugging Face folder [default: the bundled model]")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N [default: cpu]")
    p.add_argument("--dtype", default="float32", help="float32, bfloat16, ... [default: float32]")
    p.add_argument(
        "--parts", default="memory,speed", help="memory, speed or both [default: memory,speed]"
    )
    p.add_argument(
        "--widths", default="2,4,8", help="beam widths of the memory part [default: 2,4,8]"
    )
    p.add_argument(
        "--block-sizes", default="16,32", help="block sizes of the memory part [default: 16,32]"
    )
    p.add_argument(
        "--max-tokens", type=int, default=256, help="answers of the memory part [default: 256]"
    )
    p.add_argument(
        "--pool-checks", type=int, default=2, help="requests run alone as a check [default: 2]"
    )
    p.add_argument(
        "--speed-widths", default="4,8", help="beam widths of the speed part [default: 4,8]"
    )
    p.add_argument(
        "--speed-prompts",
        type=int,
        help="the first N prompts, 0: all [default: 8 on the CPU, else all]",
    )
    p.add_argument(
        "--speed-max-tokens", type=int, help="[default: 64 on the CPU, else --max-tokens]"
    )
    p.add_argument(
        "--hf-batch-sizes", default="1,all", help="transformers' batch sizes [default: 1,all]"
    )
    p.add_argument("--repeats", type=int, default=2, help="timed runs of each side [default: 2]")
    p.add_argument("--length-penalty", type=float, default=1.0, help="[default: 1.0]")
    p.add_argument(
        "--early-stopping",
        type=early_stopping,
        default=False,
        help="false, true or never, as in transformers [default: false]",
    )
    p.add_argument("--out", type=Path, default=ROOT / "results", help="[default: results]")
    p.add_argument(
        "--name",
        default="beam-search-cpu",
        help="the output files' stem [default: beam-search-cpu]",
    )
    p.add_argument("--render", type=Path, help="redraw the Markdown of a JSON result; run nothing")
    return p


def main() -> None:
    p = parser()
    a = p.parse_args()
    if a.render:
        result = json.loads(a.render.read_text())
        a.render.with_suffix(".md").write_text(markdown(result))
        return
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from pagedctl.engine import LLM
    from pagedctl.envinfo import environment
    from pagedctl.models.bundled import engine_settings

    shown = command(a, vars(p.parse_args([])))
    cpu = a.device == "cpu"
    if a.speed_prompts is None:
        a.speed_prompts = 8 if cpu else 0
    if a.speed_max_tokens is None:
        a.speed_max_tokens = 64 if cpu else a.max_tokens
    began = time.monotonic()
    parts = a.parts.split(",")
    settings = engine_settings({"model": a.model} if a.model else {})
    # On a GPU the pool takes half the card: transformers runs in the same process beside it.
    memory = {} if cpu else {"gpu_memory_utilization": 0.5}
    llm = LLM(
        **settings, **memory, device=a.device, dtype=a.dtype, block_size=ints(a.block_sizes)[0]
    )
    prompts = chat_prompts()
    ids = [render(llm.tokenizer, q) for q in prompts]
    result: dict = {
        "benchmark": "beam search: KV blocks saved by sharing, speed against transformers",
        "name": a.name,
        "command": shown,
        "environment": environment(),
        "model": llm.model_name,
        "engine": {"device": str(llm.device), "dtype": str(llm.dtype).removeprefix("torch.")},
        "args": {k: v for k, v in vars(a).items() if k not in ("out", "render")},
        "paper": PAPER,
        "prompts": [
            {"messages": q["messages"], "prompt_tokens": len(i)}
            for q, i in zip(prompts, ids, strict=True)
        ],
    }
    if "memory" in parts:
        result["memory"], result["pool_checks"] = run_memory(llm, prompts, a)
        for c in result["pool_checks"]:
            assert c["peak_blocks"] == c["pool_peak_used_blocks"], (
                f"request {c['request']} alone: peak_blocks {c['peak_blocks']} but the pool's "
                f"peak {c['pool_peak_used_blocks']}"
            )
    if "speed" in parts:
        llm.reconfigure(block_size=16, enable_prefix_caching=True)
        hf_logging.disable_progress_bar()
        hf = AutoModelForCausalLM.from_pretrained(llm.source.weights_dir, dtype=llm.dtype)
        hf = hf.to(llm.device).eval()
        n = a.speed_prompts or len(prompts)
        result["speed"] = run_speed(llm, hf, prompts[:n], ids[:n], a)
        result["engine"]["num_blocks"] = llm.stats["num_blocks"]
        del hf
        gc.collect()
        if llm.device.type == "cuda":
            torch.cuda.empty_cache()
    result["wall_s"] = round(time.monotonic() - began, 1)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / f"{a.name}.json").write_text(json.dumps(result, indent=1) + "\n")
    (a.out / f"{a.name}.md").write_text(markdown(result))
    print(f"wrote {a.out / a.name}.json and .md ({result['wall_s']:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()

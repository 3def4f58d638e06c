"""The engine against transformers `generate` (padded batches) on one set of chat prompts.

Both sides get the same token ids, greedy decoding, each request's own `max_tokens`, and stop at
EOS. Transformers pads each batch on the left and decodes until its longest request is done; only
each request's own tokens (up to its EOS or `max_tokens`) count as useful output.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from engine import SamplingParams
from engine.llm import LLM


def load_chat_requests(path: Path) -> list[dict]:
    """Lines of {"custom_id", "messages", "max_tokens"}."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _engine_side(llm: LLM, prompts: list[list[int]], max_tokens: list[int]) -> dict:
    llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    params = [SamplingParams(temperature=0.0, max_tokens=m) for m in max_tokens]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    tokens = [o.outputs[0].token_ids for o in outs]
    return {
        "wall_s": wall,
        "tokens": tokens,
        "preemptions": llm.stats["scheduler"]["num_preemptions"],
    }


@torch.inference_mode()
def _transformers_side(
    folder: Path, prompts, max_tokens, eos: set[int], batch_size: int, device: str, dtype
) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    pad = 0

    def run_batch(batch, limits):
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=max(limits), do_sample=False, pad_token_id=pad
        )
        rows = []
        for row, limit in zip(out[:, width:].tolist(), limits, strict=True):
            row = row[:limit]
            cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
            rows.append(row[:cut])
        return rows

    run_batch([prompts[0]], [4])  # warm-up
    t0 = time.perf_counter()
    tokens = []
    for i in range(0, len(prompts), batch_size):
        tokens += run_batch(prompts[i : i + batch_size], max_tokens[i : i + batch_size])
    return {"wall_s": time.perf_counter() - t0, "tokens": tokens}


def run(
    prompts_path: Path,
    model: str | None = None,
    device: str = "cpu",
    hf_batch_size: int = 32,
    max_num_seqs: int = 256,
    dtype: str = "auto",
) -> dict:
    """Measure both sides in this process, one after the other; returns a JSON-ready dict."""
    requests = load_chat_requests(prompts_path)
    llm = LLM(model, device=device, max_num_seqs=max_num_seqs, dtype=dtype)
    tok = llm.tokenizer
    prompts = [
        tok(
            tok.apply_chat_template(r["messages"], tokenize=False, add_generation_prompt=True),
            add_special_tokens=False,
        )["input_ids"]
        for r in requests
    ]
    max_tokens = [int(r["max_tokens"]) for r in requests]
    eos = set(llm.tracker.eos_token_ids)
    ours = _engine_side(llm, prompts, max_tokens)
    folder, torch_dtype = llm.source.weights_dir, llm.dtype
    settings = {
        "dtype": str(llm.dtype),
        "device": str(llm.device),
        "num_blocks": llm.scheduler.kv.num_blocks,
        "block_size": llm.scheduler.block_size,
    }
    del llm
    theirs = _transformers_side(
        folder, prompts, max_tokens, eos, hf_batch_size, device, torch_dtype
    )
    n_ours = sum(map(len, ours["tokens"]))
    n_theirs = sum(map(len, theirs["tokens"]))
    same = sum(a == b for a, b in zip(ours["tokens"], theirs["tokens"], strict=True))
    tps_ours, tps_theirs = n_ours / ours["wall_s"], n_theirs / theirs["wall_s"]
    return {
        "requests": len(prompts),
        "prompt_tokens": sum(map(len, prompts)),
        "prompt_tokens_min_max": [min(map(len, prompts)), max(map(len, prompts))],
        "requested_max_tokens": sum(max_tokens),
        "engine": {
            "wall_s": round(ours["wall_s"], 3),
            "output_tokens": n_ours,
            "output_tok_s": round(tps_ours, 2),
            "preemptions": ours["preemptions"],
            **settings,
        },
        "transformers": {
            "wall_s": round(theirs["wall_s"], 3),
            "output_tokens": n_theirs,
            "output_tok_s": round(tps_theirs, 2),
            "batch_size": hf_batch_size,
            "padding": "left",
            "attention": "sdpa (default)",
        },
        "ratio_output_tok_s": round(tps_ours / tps_theirs, 3),
        "identical_outputs": same,
    }

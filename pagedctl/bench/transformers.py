"""The engine against transformers `generate` (padded batches), and vLLM where it is installed,
on one set of chat prompts.

Both sides get the same token ids, greedy decoding, each request's own `max_tokens`, and stop at
EOS. Transformers pads each batch on the left and decodes until its longest request is done; only
each request's own tokens (up to its EOS or `max_tokens`) count as useful output. Both models are
loaded once; timed runs alternate engine / transformers and the medians are reported.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from pagedctl.bench.peers import left_pad
from pagedctl.engine import LLM, SamplingParams
from pagedctl.models.bundled import engine_settings


def load_chat_requests(path: Path) -> list[dict]:
    """Lines of {"custom_id", "messages", "max_tokens"}."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def chat_prompt_ids(tok, requests: list[dict]) -> list[list[int]]:
    """Each request's messages through the chat template, as the engine renders them."""
    return [
        tok(
            tok.apply_chat_template(r["messages"], tokenize=False, add_generation_prompt=True),
            add_special_tokens=False,
        )["input_ids"]
        for r in requests
    ]


def _engine_runner(llm: LLM, prompts: list[list[int]], max_tokens: list[int]) -> Callable:
    params = [SamplingParams(temperature=0.0, max_tokens=m) for m in max_tokens]

    def run() -> list[list[int]]:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

    return run


def _transformers_runner(model, prompts, max_tokens, eos: set[int], batch_size: int) -> Callable:
    device, pad = model.device, 0

    @torch.inference_mode()
    def run_batch(batch, limits):
        width = max(len(p) for p in batch)
        ids, mask = left_pad(batch, width, device, pad)
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=max(limits), do_sample=False, pad_token_id=pad
        )
        rows = []
        for row, limit in zip(out[:, width:].tolist(), limits, strict=True):
            row = row[:limit]
            cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
            rows.append(row[:cut])
        return rows

    def run() -> list[list[int]]:
        tokens = []
        for i in range(0, len(prompts), batch_size):
            tokens += run_batch(prompts[i : i + batch_size], max_tokens[i : i + batch_size])
        return tokens

    return run


def _timed(fn: Callable) -> tuple[float, list[list[int]]]:
    t0 = time.perf_counter()
    tokens = fn()
    return time.perf_counter() - t0, tokens


def run(
    prompts_path: Path,
    model: str | None = None,
    device: str = "cpu",
    hf_batch_size: int = 32,
    max_num_seqs: int = 256,
    dtype: str = "auto",
    repeats: int = 3,
    vllm: dict | None = None,
) -> dict:
    """Measure the sides, alternating; returns a JSON-ready dict. With `vllm` (the peer's
    settings, `bench.vllm_peer`), vLLM is a third side, in its own process."""
    from transformers import AutoModelForCausalLM

    requests = load_chat_requests(prompts_path)
    engine = engine_settings({"model": model} if model else {})
    llm = LLM(**engine, device=device, max_num_seqs=max_num_seqs, dtype=dtype)
    prompts = chat_prompt_ids(llm.tokenizer, requests)
    max_tokens = [int(r["max_tokens"]) for r in requests]
    hf = AutoModelForCausalLM.from_pretrained(llm.source.weights_dir, dtype=llm.dtype)
    hf = hf.to(llm.device).eval()
    sides = {
        "engine": _engine_runner(llm, prompts, max_tokens),
        "transformers": _transformers_runner(
            hf, prompts, max_tokens, set(llm.tracker.eos_token_ids), hf_batch_size
        ),
    }
    _engine_runner(llm, prompts[:2], [4, 4])()  # warm-up
    _transformers_runner(hf, prompts[:2], [4, 4], set(), 2)()
    peer = None
    if vllm is not None:
        from pagedctl.bench.vllm_peer import VLLMProcess

        dtype_name = str(llm.dtype).removeprefix("torch.")
        kv = llm.memory["kv_cache_bytes"]
        peer = VLLMProcess(llm.source, dtype_name, llm.seed, vllm, kv_cache_bytes=kv)
    walls: dict[str, list[float]] = {name: [] for name in [*sides, *(["vllm"] if peer else [])]}
    tokens: dict[str, list[list[int]]] = {}
    try:
        for _ in range(repeats):
            for name, fn in sides.items():
                wall, tokens[name] = _timed(fn)
                walls[name].append(wall)
            if peer is not None:  # timed inside its process, around its own generate
                tokens["vllm"], wall = peer.generate(prompts, max_tokens, 0.0, ignore_eos=False)
                walls["vllm"].append(wall)
    finally:
        if peer is not None:
            peer.close()
    result = {
        "requests": len(prompts),
        "prompt_tokens": sum(map(len, prompts)),
        "prompt_tokens_min_max": [min(map(len, prompts)), max(map(len, prompts))],
        "requested_max_tokens": sum(max_tokens),
        "repeats": repeats,
    }
    for name in walls:
        n = sum(map(len, tokens[name]))
        wall = statistics.median(walls[name])
        result[name] = {
            "wall_s": round(wall, 3),
            "wall_s_all": [round(w, 3) for w in walls[name]],
            "output_tokens": n,
            "output_tok_s": round(n / wall, 2),
        }
    result["engine"].update(
        dtype=str(llm.dtype),
        device=str(llm.device),
        num_blocks=llm.scheduler.kv.num_blocks,
        block_size=llm.scheduler.kv.block_size,
        preemptions=llm.stats["scheduler"]["num_preemptions"],
    )
    result["transformers"].update(batch_size=hf_batch_size, padding="left", attention="sdpa")
    result["ratio_output_tok_s"] = round(
        result["engine"]["output_tok_s"] / result["transformers"]["output_tok_s"], 3
    )
    result["identical_outputs"] = sum(
        a == b for a, b in zip(tokens["engine"], tokens["transformers"], strict=True)
    )
    if peer is not None:
        result["vllm"].update(peer.config, setup_s=round(peer.setup_s, 1))
        result["ratio_vllm_output_tok_s"] = round(
            result["engine"]["output_tok_s"] / result["vllm"]["output_tok_s"], 3
        )
        result["identical_outputs_vllm"] = sum(
            list(a) == list(b) for a, b in zip(tokens["engine"], tokens["vllm"], strict=True)
        )
    return result

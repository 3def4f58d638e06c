"""The physical floor of a workload on this card: the least time any engine could take.

Measured in the same run: the card's copy bandwidth (a 2 GiB device-to-device copy, read and
write counted) and its dense matmul rate (8192^3 in the run's dtype). Then, with every request
admitted at once (the most batching there can be):

- prefill: every prompt's matmul and causal-attention arithmetic at the matmul rate (and one
  row of logits a prompt, for its first token);
- decode: one step per output token after the first; step t streams the weights once and the
  KV of every sequence still running, or does its arithmetic, whichever takes longer.

A step of a real engine also pays kernel launches, the sampler and the host; the floor pays
none of them, so an engine's time over the floor is the room left. The floor does not depend
on the block size or the scheduler.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Card:
    """What the floor is computed from, as measured on this device."""

    bandwidth_Bps: float
    matmul_flops: float


@dataclass(frozen=True)
class ModelCost:
    """Bytes and arithmetic of one model in one dtype."""

    weights_bytes: int  # every parameter once (a tied embedding once)
    body_flops_per_token: int  # 2 x the parameters of the layers (no embedding, no lm head)
    head_flops_per_row: int  # 2 x vocab x hidden: one row of logits
    attn_flops_per_pair: int  # QK^T and PV of one query against one key, over every layer
    kv_bytes_per_token: int


def _timed(fn, repeats: int, device: torch.device) -> float:
    """Fastest of `repeats` runs of `fn`, in seconds (after one warm-up)."""
    fn()
    torch.cuda.synchronize(device)
    best = math.inf
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e-3)
    return best


def measure_card(device: torch.device, dtype: torch.dtype) -> Card:
    """The card's copy bandwidth and matmul rate (CUDA)."""
    n = 8192
    card = Card(
        bandwidth_Bps=_copy_rate(device), matmul_flops=2 * n**3 / _matmul_s(n, dtype, device)
    )
    torch.cuda.empty_cache()
    return card


def _copy_rate(device: torch.device) -> float:
    src = torch.empty(2**30, dtype=torch.float16, device=device).normal_()
    dst = torch.empty_like(src)
    return 2 * src.nbytes / _timed(lambda: dst.copy_(src), 10, device)


def _matmul_s(n: int, dtype: torch.dtype, device: torch.device) -> float:
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    return _timed(lambda: a @ b, 10, device)


def model_cost(hf_config, dtype_bytes: int, weights_bytes: int | None = None) -> ModelCost:
    """`weights_bytes`: what the engine holds (packed integers), else every parameter in the
    dtype; the arithmetic is the same either way (weight-only integers are multiplied as
    floats)."""
    from pagedctl.engine import KVLayout, expected_weight_shapes, model_spec

    spec = model_spec(hf_config)
    shapes = expected_weight_shapes(hf_config)
    params = sum(math.prod(s) for s in shapes.values())
    head = spec.vocab_size * spec.hidden_size
    body = params - head * (1 if spec.tie_word_embeddings else 2)
    layout = KVLayout.from_config(hf_config, dtype_bytes)
    return ModelCost(
        weights_bytes=params * dtype_bytes if weights_bytes is None else weights_bytes,
        body_flops_per_token=2 * body,
        head_flops_per_row=2 * head,
        attn_flops_per_pair=4 * spec.num_layers * spec.num_heads * spec.head_dim,
        kv_bytes_per_token=layout.bytes_per_token,
    )


def held_weights_bytes(source, quantization: str, device: torch.device, dtype: torch.dtype) -> int:
    """The bytes of weights the engine holds for `source` under `quantization`, planned the way
    the engine plans its load."""
    from pagedctl.engine import expected_weight_shapes, plan_quantization, planned_weights_bytes

    plan = plan_quantization(source, quantization, device, dtype)
    shapes = expected_weight_shapes(source.hf_config)
    gguf = source.gguf_file if plan.method == "gguf" else None
    return planned_weights_bytes(shapes, plan.method, dtype.itemsize, plan.stored, gguf)


def workload_floor(prompt_lens: list[int], max_tokens: list[int], cost: ModelCost, card: Card):
    """The floor of these requests, in seconds, and its parts (a JSON-ready dict)."""
    p = np.asarray(prompt_lens, dtype=np.float64)
    m = np.asarray(max_tokens, dtype=np.int64)
    prefill_flops = float(
        cost.body_flops_per_token * p.sum()
        + cost.attn_flops_per_pair * (p * (p + 1) / 2).sum()
        + cost.head_flops_per_row * len(p)
    )
    prefill_s = prefill_flops / card.matmul_flops
    decode_s = bytes_s = flops_s = 0.0
    steps = int(m.max()) - 1 if len(m) else 0
    for t in range(1, steps + 1):  # step t computes each live sequence's token t + 1
        live = m > t
        n = int(live.sum())
        context = p[live] + t
        kv = float(context.sum()) * cost.kv_bytes_per_token
        step_bytes = (cost.weights_bytes + kv) / card.bandwidth_Bps
        flops = (cost.body_flops_per_token + cost.head_flops_per_row) * n
        step_flops = (flops + cost.attn_flops_per_pair * float(context.sum())) / card.matmul_flops
        decode_s += max(step_bytes, step_flops)
        bytes_s += step_bytes
        flops_s += step_flops
    return {
        "floor_s": prefill_s + decode_s,
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "decode_steps": steps,
        "decode_streaming_s": bytes_s,
        "decode_arithmetic_s": flops_s,
        "card": {
            "copy_bandwidth_GBps": round(card.bandwidth_Bps / 1e9, 1),
            "matmul_TFLOPs": round(card.matmul_flops / 1e12, 1),
        },
        "model": asdict(cost),
    }


def floor_of(recipe, wl) -> dict:
    """The recipe's workload floor on its device, measured now (CUDA only). The weights
    stream as the engine holds them under the recipe's `quantization` (packed bytes)."""
    from pagedctl.engine import resolve_device, resolve_dtype, resolve_model

    device = resolve_device(recipe.device)
    dtype = resolve_dtype(recipe.dtype, device)
    start = time.perf_counter()
    card = measure_card(device, dtype)
    source = resolve_model(recipe.model, recipe.load_format)
    held = held_weights_bytes(source, recipe.config.quantization, device, dtype)
    cost = model_cost(source.hf_config, dtype.itemsize, held)
    out = workload_floor([len(x) for x in wl.prompts], wl.max_tokens, cost, card)
    out["measured_in_s"] = round(time.perf_counter() - start, 2)
    return out

"""Offline sweep of the attention kernel's launch configs on a CUDA device (none at run time).

`python -m kernels.sweep --out DIR` times every candidate (tile, warps, stages) on decode and
prefill shapes of our models, then the split-KV wave count, and writes the timings and the
winners; the winners are copied by hand into `kernels/configs.py` and `choose_num_splits`.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
from pathlib import Path

import torch
from triton.testing import do_bench

from kernels.configs import AttentionConfig
from kernels.triton_attention import MAX_SPLITS, MIN_SPLIT_TOKENS, paged_attention

SHAPES = {"qwen2.5-0.5b": (14, 2, 64), "smollm2-135m": (9, 3, 64)}
DECODE = [
    (1, 8192),
    (1, 32768),
    (8, 8192),
    (64, 2048),
    (64, 8192),
    (64, 32768),
    (256, 2048),
    (256, 8192),
]
PREFILL = [4096, 16384]


def _graph_ms(fn) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return do_bench(g.replay, warmup=10, rep=40, return_mode="median")


def _case(shape: str, batch: int, ctx: int, q_len: int, dtype, block: int = 16):
    hq, hkv, d = SHAPES[shape]
    per_seq = -(-ctx // block)
    k = torch.randn(batch * per_seq, block, hkv, d, dtype=dtype, device="cuda")
    v = torch.randn_like(k)
    table = torch.randperm(batch * per_seq, device="cuda").view(batch, per_seq).to(torch.int32)
    q = torch.randn(batch * q_len, hq, d, dtype=dtype, device="cuda")
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    cu = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * q_len
    return q, k, v, table, lens, cu, d**-0.5


def splits_for(waves: int, batch: int, hkv: int, ctx: int, sms: int) -> int:
    wanted = math.ceil(waves * sms / (batch * hkv))
    return max(1, min(wanted, math.ceil(ctx / MIN_SPLIT_TOKENS), MAX_SPLITS))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    dtype, sms = torch.bfloat16, torch.cuda.get_device_properties(0).multi_processor_count
    rows: list[dict] = []
    decode_cfgs = [
        AttentionConfig(16, t, w, s)
        for t, w, s in itertools.product((32, 64, 128), (2, 4, 8), (2, 3, 4))
    ]
    decode_cases = [(s, b, c) for s in SHAPES for b, c in DECODE]
    for shape, batch, ctx in decode_cases:
        call = _call(shape, batch, ctx, 1, dtype)
        for cfg in decode_cfgs:
            ms = _graph_ms(functools.partial(call, None, cfg))
            rows.append(
                {
                    "phase": "decode",
                    "shape": shape,
                    "batch": batch,
                    "ctx": ctx,
                    "cfg": cfg.__dict__,
                    "waves": "policy",
                    "ms": ms,
                }
            )
        del call
        torch.cuda.empty_cache()
    best = _ranked([r for r in rows if r["phase"] == "decode"])[:3]
    for shape, batch, ctx in decode_cases:
        call = _call(shape, batch, ctx, 1, dtype)
        for cfg_d, waves in itertools.product(best, (1, 2, 4, 8)):
            n = splits_for(waves, batch, SHAPES[shape][1], ctx, sms)
            ms = _graph_ms(functools.partial(call, n, AttentionConfig(**cfg_d)))
            rows.append(
                {
                    "phase": "waves",
                    "shape": shape,
                    "batch": batch,
                    "ctx": ctx,
                    "cfg": cfg_d,
                    "waves": waves,
                    "splits": n,
                    "ms": ms,
                }
            )
        del call
        torch.cuda.empty_cache()
    prefill_cfgs = [
        AttentionConfig(m, t, w, s)
        for m, t, w, s in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3))
    ]
    for shape, n in itertools.product(SHAPES, PREFILL):
        call = _call(shape, 1, n, n, dtype)
        for cfg in prefill_cfgs:
            try:
                fn = functools.partial(call, None, cfg)
                ms = do_bench(fn, warmup=10, rep=40, return_mode="median")
            except Exception as e:  # e.g. out of shared memory: not a candidate
                ms = None
                print(f"prefill {cfg}: {type(e).__name__}")
            rows.append(
                {"phase": "prefill", "shape": shape, "q_len": n, "cfg": cfg.__dict__, "ms": ms}
            )
    summary = {
        "decode_best_configs": _ranked([r for r in rows if r["phase"] == "decode"])[:5],
        "waves": _wave_table(rows),
        "prefill_best_configs": _ranked([r for r in rows if r["phase"] == "prefill"])[:5],
    }
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "sweep.json").write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))
    print(json.dumps(summary, indent=1))


def _call(shape: str, batch: int, ctx: int, q_len: int, dtype):
    """`paged_attention` bound to one random case; call it with (num_splits, config)."""
    q, k, v, table, lens, cu, scale = _case(shape, batch, ctx, q_len, dtype)
    return functools.partial(paged_attention, q, k, v, table, lens, cu, q_len, ctx, scale)


def _ranked(rows: list[dict]) -> list[dict]:
    """Configs by the geometric mean over shapes of (time / the shape's best time)."""
    by_shape: dict = {}
    for r in rows:
        if r["ms"] is not None:
            key = (r["shape"], r.get("batch"), r.get("ctx"), r.get("q_len"))
            by_shape.setdefault(key, []).append(r)
    score: dict = {}
    for group in by_shape.values():
        fastest = min(r["ms"] for r in group)
        for r in group:
            score.setdefault(json.dumps(r["cfg"], sort_keys=True), []).append(r["ms"] / fastest)
    full = [k for k, v in score.items() if len(v) == len(by_shape)]
    full.sort(key=lambda k: math.prod(score[k]) ** (1 / len(score[k])))
    return [json.loads(k) for k in full]


def _wave_table(rows: list[dict]) -> list[dict]:
    out = []
    for r in rows:
        if r["phase"] == "waves":
            out.append({k: r[k] for k in ("shape", "batch", "ctx", "cfg", "waves", "splits", "ms")})
    return out


if __name__ == "__main__":
    main()

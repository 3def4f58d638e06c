"""Offline sweep of the attention kernel's launch configs on a CUDA device (none at run time).

`python -m kernels.sweep --out DIR` times every candidate (tile, warps, stages) on decode shapes
of our models (each a stack of per-layer caches in one CUDA graph, as `kernels.bench` times them),
then forced split counts with the two best configs of each shape (with and without the fused
combine), and, with `--prefill`, the prefill configs; it writes the timings and the winners,
which are copied by hand into `kernels/configs.py` and `choose_num_splits`. Instead, `--deep` times
DEEP_CONFIGS beside the shipped config, `--pdl` the shipped config with and without a
programmatic dependent launch, alone and behind `write_kv` as the engine runs it, `--layout`
token- against head-major cache storage with random and identity tables, beside a plain read of
the same bytes, and `--tables` tables of growing locality (those three: `kernels.sweep_access`).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
from dataclasses import replace
from pathlib import Path

import torch
from pagedctl.kernels.bench import SHAPES
from pagedctl.kernels.bench_timing import _pool, _table, num_layers, per_call_ms
from pagedctl.kernels.configs import AttentionConfig, lookup, phase_of
from pagedctl.kernels.triton_attention import _device_info, paged_attention
from triton.testing import do_bench

DECODE = [(1, 8192), (8, 2048), (64, 512), (64, 2048), (64, 8192), (256, 1024), (256, 2048)]
PREFILL = [4096, 16384]
DECODE_CONFIGS = [
    AttentionConfig(16, t, w, s)
    for t, w, s in [
        *itertools.product((64, 128), (4, 8), (2, 3, 4)),
        (32, 4, 3),
        (128, 2, 3),
        (256, 8, 3),
    ]
]
SPLITS = (1, 2, 3, 4, 6, 8, 12, 16)  # forced split counts, timed with the best configs
# `--deep`: candidates beside the shipped config at 1-6 splits on DEEP_SHAPES (batch 256
# unsplit). Timed on the H200 and lost to the shipped config on the batch-64 shapes: deeper
# pipelines (4-8 stages; results/kernels-sweep-deep-h200.json), programs of 1-2 warps
# (kernels-sweep-narrow-h200.json), and tiles cut into per-warp slices, each with its own
# softmax state and no cross-warp traffic inside the loop (kernels-sweep-slices-h200.json).
DEEP_CONFIGS = [
    AttentionConfig(16, t, w, s) for t, w, s in [(64, 4, 3), (64, 4, 4), (64, 4, 5), (128, 4, 3)]
]
DEEP_SPLITS = (1, 2, 3, 4, 6)
DEEP_SHAPES = [(64, 512), (64, 2048), (64, 8192), (256, 1024), (256, 2048)]


def _pools(shape: str, batch: int, ctx: int, dtype, block: int = 16, table=None):
    """Per-layer caches (enough layers to exceed L2, stored as the engine stores them) through
    one block table for every layer, as the engine's: `table`, or a fresh random one."""
    hq, hkv, d = SHAPES[shape]
    kv_bytes = 2 * batch * -(-ctx // block) * block * hkv * d * torch.finfo(dtype).bits // 8
    if table is None:
        table = _table(batch, -(-ctx // block), False, "cuda")
    pools = [
        _pool(batch, ctx, block, hkv, d, dtype, "cuda", table) for _ in range(num_layers(kv_bytes))
    ]
    q = torch.randn(batch, hq, d, dtype=dtype, device="cuda")
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    cu = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    return q, pools, lens, cu, d**-0.5


def _stack_ms(case, ctx: int, splits: int | None, cfg: AttentionConfig) -> float:
    """Milliseconds per call of a graph of per-layer calls (see `kernels.bench`)."""
    q, pools, lens, cu, scale = case
    calls = [
        functools.partial(paged_attention, q, k, v, t, lens, cu, 1, ctx, scale, splits, cfg)
        for k, v, t in pools
    ]
    return per_call_ms(calls)


def _candidate_ms(case, ctx: int, splits: int | None, cfg: AttentionConfig) -> float | None:
    """`_stack_ms`, or None for a config this device cannot run (e.g. out of shared memory)."""
    try:
        return _stack_ms(case, ctx, splits, cfg)
    except Exception as e:
        print(f"{cfg} at {splits or 'policy'} splits: {type(e).__name__}")
        return None


def _shipped(shape: str, batch: int) -> AttentionConfig:
    """The config `paged_attention` picks on this device for a decode batch of `shape`."""
    capability, sms = _device_info(torch.device("cuda"))
    return lookup(capability, phase_of(True, batch, SHAPES[shape][1], sms), SHAPES[shape][2])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--prefill", action="store_true", help="also sweep the prefill configs")
    p.add_argument(
        "--deep",
        action="store_true",
        help="instead: the shipped config against DEEP_CONFIGS on DEEP_SHAPES",
    )
    p.add_argument(
        "--pdl",
        action="store_true",
        help="instead: the shipped config with and without a programmatic dependent launch "
        "(kernels.sweep_access)",
    )
    p.add_argument(
        "--tables",
        action="store_true",
        help="instead: the shipped config through block tables of growing locality (random, "
        "shuffled runs of consecutive blocks, identity; kernels.sweep_access)",
    )
    p.add_argument(
        "--layout",
        action="store_true",
        help="instead: the shipped config on a token-major cache [block, token, head, dim] "
        "against a head-major one [block, head, token, dim], random and identity tables, and a "
        "plain read of the same bytes (kernels.sweep_access)",
    )
    a = p.parse_args()
    dtype = torch.bfloat16
    rows: list[dict] = []
    a.out.mkdir(parents=True, exist_ok=True)
    if a.pdl or a.layout or a.tables:
        from pagedctl.kernels import sweep_access  # (it builds on this module's pools)

        run = (
            sweep_access.pdl if a.pdl else sweep_access.layouts if a.layout else sweep_access.tables
        )
        run(a.out, rows, dtype)
        return
    for shape, (batch, ctx) in itertools.product(SHAPES, DEEP_SHAPES if a.deep else DECODE):
        case = _pools(shape, batch, ctx, dtype)
        key = {"phase": "decode", "shape": shape, "batch": batch, "ctx": ctx}
        for cfg in [_shipped(shape, batch)] if a.deep else DECODE_CONFIGS:
            ms = _candidate_ms(case, ctx, None, cfg)
            rows.append({**key, "cfg": cfg.__dict__, "splits": "policy", "ms": ms})
        mine = [r for r in rows if r["phase"] == "decode" and r["ms"] is not None]
        top = sorted((r for r in mine if r["shape"] == shape and r["batch"] == batch
                      and r["ctx"] == ctx), key=lambda r: r["ms"])[:2]  # fmt: skip
        if batch <= 64 and not a.deep:
            for r, n, fused in itertools.product(top, SPLITS, (False, True)):
                if fused and n == 1:
                    continue
                cfg = AttentionConfig(**{**r["cfg"], "fused_combine": fused})
                ms = _stack_ms(case, ctx, n, cfg)
                rows.append({**key, "phase": "splits", "cfg": cfg.__dict__, "splits": n, "ms": ms})
        if a.deep:
            for cfg, n in itertools.product(DEEP_CONFIGS, DEEP_SPLITS if batch <= 64 else (1,)):
                cfg = replace(cfg, fused_combine=n > 1)
                ms = _candidate_ms(case, ctx, n, cfg)
                rows.append({**key, "phase": "deep", "cfg": cfg.__dict__, "splits": n, "ms": ms})
        del case
        torch.cuda.empty_cache()
        _write(a.out, rows)
    if a.prefill:
        _prefill(rows, dtype)
    print(json.dumps(_write(a.out, rows), indent=1))


def _write(out: Path, rows: list[dict]) -> dict:
    decode = [r for r in rows if r["phase"] == "decode"]
    summary = {
        "decode_best_configs": _ranked(decode)[:5],
        "best_per_shape": _best_per_shape(rows),
        "prefill_best_configs": _ranked([r for r in rows if r["phase"] == "prefill"])[:5],
    }
    (out / "sweep.json").write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))
    return summary


def _best_per_shape(rows: list[dict]) -> list[dict]:
    best: dict = {}
    for r in rows:
        if r["phase"] in ("decode", "splits", "deep") and r["ms"] is not None:
            key = (r["shape"], r["batch"], r["ctx"])
            if key not in best or r["ms"] < best[key]["ms"]:
                best[key] = r
    return list(best.values())


def _prefill(rows: list[dict], dtype) -> None:
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


def _case(shape: str, batch: int, ctx: int, q_len: int, dtype, block: int = 16):
    hq, hkv, d = SHAPES[shape]
    k, v, table = _pool(batch, ctx, block, hkv, d, dtype, "cuda")
    q = torch.randn(batch * q_len, hq, d, dtype=dtype, device="cuda")
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    cu = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * q_len
    return q, k, v, table, lens, cu, d**-0.5


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


if __name__ == "__main__":
    main()

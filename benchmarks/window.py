"""One decoder layer's decode step, kernel by kernel, sliding-window against full attention:
`python -m benchmarks.window --out DIR` (CUDA; results/window-layer-h100.md and .json).

For each model (a preset's shapes: Mistral-7B, Gemma-2-2B), batch and context, the kernels of
one layer at decode are timed as the engine's decode step replays them (`kernel_timing`: a
stack of layers with distinct data in one CUDA graph, cold L2): the four projections (qkv, o,
gate_up, down; torch matmuls of the layer's shapes) and paged attention over the full context
and over the model's window (the same pool and table: the windowed kernel reads only the
window's blocks). Each attention row is set beside a plain read of the K/V bytes it must read
(`read_floor_ms`). Norms, rotary and the KV write are the same in both layers and left out.
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch

from benchmarks.kernel_timing import _pool, num_layers, per_call_ms, read_floor_ms
from pagedctl.engine.models.layers import model_spec
from pagedctl.engine.models.source import resolve_model
from pagedctl.kernels import PagedBatch
from pagedctl.kernels.triton_attention import paged_attention

MODELS = ("mistral-7b", "gemma-2-2b")
CARDS = ("T4", "L4", "A10", "A100", "H100", "H200", "B200")
CASES = ((1, 32768), (16, 2048), (16, 8192), (16, 32768), (64, 2048), (64, 8192), (64, 32768))


def projections(spec, batch: int, dtype, device) -> dict[str, float]:
    """Milliseconds per call of each projection of one layer at `batch` decode tokens."""
    hq, hkv, d, hidden = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.hidden_size
    inter = spec.intermediate_size
    shapes = {
        "qkv": (hidden, (hq + 2 * hkv) * d),
        "o": (hq * d, hidden),
        "gate_up": (hidden, 2 * inter),
        "down": (inter, hidden),
    }
    out = {}
    for name, (k, n) in shapes.items():
        x = torch.randn(batch, k, dtype=dtype, device=device)
        ws = [
            torch.randn(n, k, dtype=dtype, device=device) * 0.02
            for _ in range(num_layers(2 * k * n))
        ]
        out[name] = per_call_ms([lambda w=w, x=x: x @ w.t() for w in ws])
        del ws
    return out


def attention(spec, window: int, batch: int, ctx: int, dtype, device) -> dict:
    """Full and windowed paged attention of `batch` decode rows at `ctx` tokens, each beside a
    plain read of the K/V bytes it needs."""
    hq, hkv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
    block = 16
    q = torch.randn(batch, hq, d, dtype=dtype, device=device)
    kv_bytes = 2 * batch * ctx * hkv * d * q.element_size()
    pools = [_pool(batch, ctx, block, hkv, d, dtype, device) for _ in range(num_layers(kv_bytes))]
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    cu = torch.arange(batch + 1, dtype=torch.int32, device=device)
    row = {"batch": batch, "context": ctx, "layers": len(pools)}
    for name, w in (("full", None), ("window", window)):
        calls = [
            lambda k=k, v=v, t=t, w=w: paged_attention(
                q,
                k,
                v,
                PagedBatch(t, lens, cu, 1, ctx),
                spec.attn_scale,
                window=w,
                softcap=spec.attn_softcap,
            )
            for k, v, t in pools
        ]
        keys = ctx if w is None else min(ctx, w)
        row[f"ms_{name}"] = per_call_ms(calls)
        row[f"bytes_{name}"] = 2 * batch * keys * hkv * d * q.element_size()
    del pools, calls
    torch.cuda.empty_cache()
    for name in ("full", "window"):  # with the pools freed: a read floor allocates its own
        row[f"ms_read_{name}"] = read_floor_ms(row[f"bytes_{name}"], device)[0]
    return row


def run(model: str, dtype, device) -> dict:
    spec = model_spec(resolve_model(model).hf_config)
    windows = {w for w in spec.layer_windows if w is not None}
    assert len(windows) == 1, f"{model}: one window expected, has {windows}"
    window = windows.pop()
    rows, proj = [], {}
    for batch, ctx in CASES:
        if batch not in proj:
            proj[batch] = projections(spec, batch, dtype, device)
        row = attention(spec, window, batch, ctx, dtype, device)
        row["projections_ms"] = proj[batch]
        linear = sum(proj[batch].values())
        row["layer_ms_full"] = linear + row["ms_full"]
        row["layer_ms_window"] = linear + row["ms_window"]
        rows.append(row)
        print(
            f"{model} b{batch} ctx{ctx}: attention full {row['ms_full']:.3f} ms, "
            f"window {row['ms_window']:.3f} ms; layer {row['layer_ms_full']:.3f} -> "
            f"{row['layer_ms_window']:.3f} ms",
            flush=True,
        )
    layers = spec.layer_windows
    return {
        "model": model,
        "heads": [spec.num_heads, spec.num_kv_heads, spec.head_dim],
        "window": window,
        "softcap": spec.attn_softcap,
        "windowed_layers": sum(w is not None for w in layers),
        "layers": len(layers),
        "rows": rows,
    }


def render(report: dict) -> str:
    lines = [
        "# One decoder layer at decode: sliding-window against full attention",
        "",
        "`python -m benchmarks.window --out results` (one CUDA device, bf16, dummy weights, "
        "block size 16).",
        "",
        f"{report['device']}; torch {report['torch']}, Triton {report['triton']}.",
        "",
        "Per call, in a CUDA graph of a stack of layers on cold data "
        "(`benchmarks/kernel_timing.py`). Projections are the layer's four matmuls "
        "(qkv + o + gate_up + down); read floor: a plain "
        "read of the K/V bytes the attention needs (the whole context, or the window's).",
        "",
    ]
    for m in report["models"]:
        hq, hkv, d = m["heads"]
        lines += [
            f"## {m['model']}: {hq} query / {hkv} KV heads x {d}, window {m['window']}, "
            f"soft cap {m['softcap']}; {m['windowed_layers']} of {m['layers']} layers windowed",
            "",
            "| batch | context | projections ms | attention full ms (read floor) | "
            "attention window ms (read floor) | layer full ms | layer window ms | window ÷ full |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in m["rows"]:
            proj = sum(r["projections_ms"].values())
            lines.append(
                f"| {r['batch']} | {r['context']:,} | {proj:.3f} | {r['ms_full']:.3f} "
                f"({r['ms_read_full']:.3f}) | {r['ms_window']:.3f} ({r['ms_read_window']:.3f}) | "
                f"{r['layer_ms_full']:.3f} | {r['layer_ms_window']:.3f} | "
                f"{r['layer_ms_window'] / r['layer_ms_full']:.2f} |"
            )
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--dtype", default="bfloat16")
    a = p.parse_args()
    device, dtype = torch.device("cuda"), getattr(torch, a.dtype)
    import triton

    report = {
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "host": platform.node(),
        "dtype": a.dtype,
        "models": [run(m, dtype, device) for m in a.models.split(",")],
    }
    card = next((c for c in CARDS if c in report["device"]), "gpu").lower()
    name = f"window-layer-{card}"
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    (a.out / f"{name}.md").write_text(render(report))
    print(render(report))


if __name__ == "__main__":
    main()

"""A decode step's projections alone: the skinny kernel (`kernels.triton_linear`, norm and SwiGLU
fused) against cuBLAS with the separate norm and SwiGLU kernels, and against the weight read.

`python -m benchmarks.linear --out DIR` (CUDA): the four projections of a Qwen2.5-0.5B layer
(q/k/v with its norm, o, gate/up with its norm and SwiGLU, down) at decode batches of 1, 16 and
64 rows, each call one node of a layer stack in a CUDA graph on weights past L2 (as a decode step
replays them), for the shipped config and a few others; the floor is the weight's bytes at the
card's copy bandwidth.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, replace
from pathlib import Path
from unittest import mock

import torch
import triton

from benchmarks.kernel_timing import copy_bandwidth, num_layers, per_call_ms
from pagedctl import kernels
from pagedctl.kernels import configs

HIDDEN, INTER, QKV = 896, 4864, 1152  # Qwen2.5-0.5B
PROJECTIONS = {  # name -> (in, out, fused norm, SwiGLU)
    "qkv": (HIDDEN, QKV, True, False),
    "o": (HIDDEN, HIDDEN, False, False),
    "gate_up": (HIDDEN, 2 * INTER, True, True),
    "down": (INTER, HIDDEN, False, False),
}


def calls(name: str, rows: int, dtype: torch.dtype) -> list:
    """One call per layer of projection `name` at `rows` rows, each on its own weight."""
    k, n, norm, swiglu = PROJECTIONS[name]
    layers = num_layers(n * k * dtype.itemsize)
    dev = "cuda"
    x, res = (torch.randn(rows, k, device=dev).to(dtype) for _ in range(2))
    nw = torch.ones(k, device=dev, dtype=dtype)
    weights = [(torch.randn(n, k, device=dev) / k**0.5).to(dtype) for _ in range(layers)]
    if norm:
        return [lambda w=w: kernels.norm_linear(x, res, nw, 1e-6, w, None, swiglu) for w in weights]
    return [lambda w=w: kernels.linear(x, w) for w in weights]


def time_side(name: str, rows: int, dtype: torch.dtype, cfg: configs.LinearConfig | None):
    """Microseconds per call with `cfg` as the sm90 config (None: cuBLAS and separate ops)."""
    table = {} if cfg is None else {"sm90": cfg}
    with mock.patch.dict(configs.LINEAR_CONFIGS, table, clear=True):
        try:
            return per_call_ms(calls(name, rows, dtype)) * 1e3
        except triton.runtime.errors.OutOfResources:  # a variant past the shared memory
            return None


def _us(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    a = p.parse_args()
    from pagedctl.envinfo import environment

    dtype, shipped = torch.bfloat16, configs.LINEAR_CONFIGS["sm90"]
    variants = {"shipped": shipped}
    for block_k, stages, warps in [(64, 4, 4), (256, 3, 4), (128, 3, 4), (128, 5, 4), (128, 4, 8)]:
        cfg = replace(shipped, block_k=block_k, num_stages=stages, num_warps=warps)
        variants[f"k{block_k}-s{stages}-w{warps}"] = cfg
    bandwidth = copy_bandwidth(torch.device("cuda"))
    rows_out = []
    for rows in a.rows:
        for name, (k, n, _, _) in PROJECTIONS.items():
            row = {"rows": rows, "projection": name, "floor_us": n * k * 2 / bandwidth * 1e6}
            row["separate_us"] = time_side(name, rows, dtype, None)
            for label, cfg in variants.items():
                row[f"{label}_us"] = time_side(name, rows, dtype, cfg)
            rows_out.append(row)
            print(
                f"{rows:3d} rows {name:8s} floor {row['floor_us']:.2f} us, separate "
                f"{row['separate_us']:.2f}, "
                + ", ".join(f"{lbl} {_us(row[f'{lbl}_us'])}" for lbl in variants),
                flush=True,
            )
    a.out.mkdir(parents=True, exist_ok=True)
    report = {
        "environment": environment(),
        "copy_bandwidth_GBps": bandwidth / 1e9,
        "variants": {k: asdict(v) for k, v in variants.items()},
        "rows": rows_out,
    }
    (a.out / "linear.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

"""Weight-only quantized matmul on a CUDA device: `python -m benchmarks.quant_kernels --out
results/quant-kernels-h100` (writes OUT.json and OUT.md).

For each format (4 bits in groups of 128 with offsets, 8 bits in groups of 128, 8 bits per
channel), each linear layer of Qwen2.5-0.5B and Llama-3-8B (fused qkv, o, fused gate/up, down)
and batches of 1, 16, 256 and 1024 rows: the Triton kernel dequantizing in registers
(`kernels.triton_quant`, float16 `x`; for 4 bits also bfloat16), the weight dequantized by
`kernels.triton_dequant` and then float16 `F.linear` (what `linear` ships for calls of at least
`DEQUANT_ROWS` rows: the plan column's `dq`), torch's float16 `F.linear` on a float weight of the
same shape,
and torch's own weight-only ops where this build has them for the format and the device:
`torch._weight_int4pack_mm` (4 bits, bfloat16, sm_80+; the weight converted by
`torch._convert_weight_to_int4pack`) and `torch._weight_int8pack_mm` (8 bits per channel). Each
peer's output is checked once against `kernels.quant.reference_linear` on the same weight (so
each times the same product), then each is timed as one node of a stack of calls on distinct
weights in a CUDA graph (`benchmarks.kernel_timing.stack_ms`), the stack COLD_BYTES or
MAX_COPIES weights (at least 100 MB, twice an H100's L2) so that no weight is still in L2 when
its call comes. Floor: the bytes the quantized call reads
(integers, scales, offsets, activations) over this card's measured copy bandwidth.

`--sweep` also times the decode-sized calls (1 and 16 rows) over candidate tiles and forced
split counts, against the shipped choice. `--smoke` runs a tiny layer through every path once and
times nothing: on a CUDA device, or on the CPU under `TRITON_INTERPRET=1`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

import torch
import torch.nn.functional as F

import pagedctl  # noqa: F401  (first: the checkout's kernels/ must not shadow Hugging Face's)
from pagedctl.envinfo import environment
from pagedctl.kernels import quant, triton_dequant
from pagedctl.kernels import triton_quant as tq
from pagedctl.kernels.configs import MatmulConfig

# name -> (bits, group size (0: one group a row), offsets)
FORMATS = {"int4-g128": (4, 128, True), "int8-g128": (8, 128, False), "int8-channel": (8, 0, False)}
MODELS = {  # (out_features, in_features) of each linear layer
    "qwen2.5-0.5b": {  # hidden 896, intermediate 4864, 14 query and 2 KV heads of 64
        "qkv": (1152, 896), "o": (896, 896), "gate_up": (9728, 896), "down": (896, 4864),
    },
    "llama-3-8b": {  # hidden 4096, intermediate 14336, 32 query and 8 KV heads of 128
        "qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
    },
}  # fmt: skip
BATCHES = (1, 16, 256, 1024)
COLD_BYTES = 256 * 2**20  # a timed stack reads at least this much (H100/H200 L2: 50/60 MB)
MAX_COPIES = 256
SMOKE_SHAPE = (96, 256)
SWEEP_TILES = [  # decode candidates: (block_n, block_k, num_stages), 16 rows, 4 warps
    (bn, bk, stages) for bn in (32, 64, 128) for bk in (128, 256) for stages in (3, 4)
]
SWEEP_SPLITS = (1, 2, 3, 4, 6, 8, 12, 16)


def random_weight(fmt: str, shape: tuple[int, int], device: str, seed: int = 0):
    """A `QuantizedWeight` of random integers, scales and offsets (float16) of a format."""
    bits, group, offsets = FORMATS[fmt]
    out_features, in_features = shape
    group = group or in_features
    gen = torch.Generator(device=device).manual_seed(seed)
    if bits == 4:
        qdata = torch.randint(
            0, 256, (out_features, in_features // 2), generator=gen, device=device
        )
        qdata = qdata.to(torch.uint8)
    else:
        qdata = torch.randint(-128, 128, (out_features, in_features), generator=gen, device=device)
        qdata = qdata.to(torch.int8)
    groups = (out_features, in_features // group)
    scales = (torch.rand(groups, generator=gen, device=device) + 0.5) / (8 * in_features**0.5)
    shift = (-8 * scales).half() if offsets else None
    return quant.QuantizedWeight(bits, group, qdata, scales.half(), shift)


def int4pack(weight: quant.QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight` (4 bits) in tinygemm's layout: the packed integers (even features in the high
    nibble, for `_convert_weight_to_int4pack`) and `[groups, out, (scale, zero)]` in bfloat16,
    where tinygemm computes `(q - 8) * scale + zero`."""
    q = quant.integers(weight)
    packed = ((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8)
    offsets = torch.zeros_like(weight.scales) if weight.offsets is None else weight.offsets
    zero = offsets.float() + 8 * weight.scales.float()
    pairs = torch.stack([weight.scales.float(), zero], dim=-1).transpose(0, 1).contiguous()
    return torch._convert_weight_to_int4pack(packed, 8), pairs.to(torch.bfloat16)


DTYPES = {  # the dtype of `x` each method runs
    "triton": torch.float16, "triton_bf16": torch.bfloat16, "dequant": torch.float16,
    "fp16_linear": torch.float16, "torch_int4": torch.bfloat16, "torch_int8": torch.float16,
}  # fmt: skip


def methods(fmt: str, device: str) -> dict[str, str | None]:
    """name -> None for each method that may run for this format on this device, else why it
    does not."""
    bits, group, _ = FORMATS[fmt]
    bf16 = device == "cuda" and torch.cuda.get_device_capability() >= (8, 0)
    out: dict[str, str | None] = {"triton": None, "dequant": None, "fp16_linear": None}
    if bits == 4:  # tinygemm runs bfloat16: the kernel too, beside it
        out["triton_bf16"] = None if bf16 else "bfloat16: CUDA sm_80+ only"
        out["torch_int4"] = None if bf16 else "torch._weight_int4pack_mm: CUDA sm_80+ only"
    if bits == 8 and group == 0:
        found = hasattr(torch, "_weight_int8pack_mm")
        out["torch_int8"] = None if found else "no torch._weight_int8pack_mm in this build"
    return out


def build(name: str, qw: quant.QuantizedWeight):
    """The call of `x` that method `name` makes with (a copy of) `qw` in its own layout."""
    if name in ("triton", "triton_bf16"):  # the in-register kernel at any row count
        prepared = tq.prepare(qw)
        return lambda x: tq.linear(x, prepared, config=in_register(x.shape[0], prepared))
    if name == "dequant":  # what `tq.linear` ships from DEQUANT_ROWS rows: dequantize + cuBLAS
        prepared = tq.prepare(qw)
        return lambda x: F.linear(x, triton_dequant.dequantize(prepared, x.dtype))
    if name == "fp16_linear":
        dense = quant.dequantize(qw, torch.float16)
        return lambda x: F.linear(x, dense)
    if name == "torch_int4":
        packed, pairs = int4pack(qw)
        return lambda x: torch._weight_int4pack_mm(x, packed, qw.group_size, pairs)
    scales = qw.scales[:, 0].contiguous()  # torch_int8: one scale a row
    return lambda x: torch._weight_int8pack_mm(x, qw.qdata, scales.to(x.dtype))


def in_register(rows: int, prepared: tq.TritonQuantWeight) -> MatmulConfig:
    """The config `tq.plan` gives a call of `rows` rows on this device (passing it keeps the
    in-register kernel where the shipped `linear` would dequantize)."""
    capability = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    sms = torch.cuda.get_device_properties(0).multi_processor_count if capability else 8
    return tq.plan(rows, prepared, capability, sms).config


def checked(name: str, qw: quant.QuantizedWeight, rows: int) -> str | None:
    """Run method `name` once on random rows; None if it matches the reference (a relative
    error under 2% of the output's largest value: the peers round in bfloat16 or float16),
    else what went wrong."""
    x = torch.randn(rows, qw.shape[1], device=qw.qdata.device).to(DTYPES[name])
    try:
        got = build(name, qw)(x).float()
    except (RuntimeError, NotImplementedError) as e:  # a peer that cannot run is a finding
        return f"{type(e).__name__}: {str(e)[:160]}"
    want = quant.reference_linear(x.float(), qw)
    err = float((got - want).abs().max() / want.abs().max())
    return None if err < 2e-2 else f"off the reference by {err:.3g} (relative)"


def copies(nbytes: int) -> int:
    """Distinct weights a timed stack holds: COLD_BYTES in all, 4 to MAX_COPIES of them."""
    return max(4, min(MAX_COPIES, -(-COLD_BYTES // nbytes)))


def time_method(fmt: str, shape: tuple[int, int], name: str, rows: int, nbytes: int) -> float:
    """Milliseconds a call of a method adds to a graph of calls on distinct weights."""
    from benchmarks.kernel_timing import stack_ms

    x = torch.randn(rows, shape[1], device="cuda").to(DTYPES[name])
    fns = [build(name, random_weight(fmt, shape, "cuda", s)) for s in range(copies(nbytes))]
    per_call = stack_ms([lambda fn=fn: fn(x) for fn in fns])[0]
    del fns
    torch.cuda.empty_cache()
    return per_call


def method_bytes(name: str, qw: quant.QuantizedWeight, rows: int) -> int:
    """Bytes a call reads: the weight as the method stores it, and the activations."""
    out_features, in_features = qw.shape
    weight = 2 * out_features * in_features if name == "fp16_linear" else qw.nbytes
    return weight + 2 * rows * in_features


def case(model: str, layer: str, fmt: str, rows: int, bandwidth: float) -> dict:
    shape = MODELS[model][layer]
    qw = random_weight(fmt, shape, "cuda")
    row = {"model": model, "layer": layer, "shape": list(shape), "format": fmt, "rows": rows}
    row["bytes"] = method_bytes("triton", qw, rows)
    row["floor_us"] = row["bytes"] / bandwidth * 1e6
    capability = torch.cuda.get_device_capability()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cfg, block_k, split, _ = tq.plan(rows, tq.prepare(qw), capability, sms)
    row["plan"] = {"block_m": cfg.block_m, "block_n": cfg.block_n, "block_k": block_k}
    row["plan"].update(split_k=split, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    row["plan"]["dequantizes"] = tq.dequantizes(rows, torch.device("cuda"), capability, False)
    for name, why_not in methods(fmt, "cuda").items():
        problem = why_not or checked(name, qw, rows)
        if problem:
            row[f"{name}_error"] = problem
            continue
        row[f"{name}_us"] = 1e3 * time_method(fmt, shape, name, rows, method_bytes(name, qw, rows))
    return row


def sweep_case(model: str, layer: str, fmt: str, rows: int) -> dict:
    """The shipped decode choice against SWEEP_TILES (each with the plan's split) and the
    shipped tile with each of SWEEP_SPLITS, one graph stack each."""
    from benchmarks.kernel_timing import stack_ms

    shape = MODELS[model][layer]
    count = copies(random_weight(fmt, shape, "cuda").nbytes)
    weights = [tq.prepare(random_weight(fmt, shape, "cuda", s)) for s in range(count)]
    x = torch.randn(rows, shape[1], device="cuda", dtype=torch.float16)
    capability = torch.cuda.get_device_capability()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    shipped = tq.plan(rows, weights[0], capability, sms)

    def us(config: MatmulConfig | None = None, split: int | None = None) -> float:
        calls = [lambda w=w: tq.linear(x, w, config=config, split_k=split) for w in weights]
        return 1e3 * stack_ms(calls)[0]

    row = {"model": model, "layer": layer, "format": fmt, "rows": rows, "shipped_us": us()}
    row["shipped"] = [shipped.config.block_n, shipped.block_k, shipped.split_k]
    tiles = {}
    for bn, bk, stages in SWEEP_TILES:
        cfg = MatmulConfig(16, bn, bk, num_warps=4, num_stages=stages)
        tiles[f"{bn}x{bk}x{stages}"] = us(cfg)
    row["tiles_us"] = tiles
    row["splits_us"] = {str(s): us(split=s) for s in SWEEP_SPLITS}
    return row


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a and b else "-"


def us_cell(row: dict, name: str) -> str:
    t = row.get(f"{name}_us")
    return f"{t:.1f}" if t else ("err" if f"{name}_error" in row else "-")


def markdown(env: dict, rows: list[dict], sweeps: list[dict]) -> str:
    lines = [
        f"# Weight-only quantized matmul, {env.get('gpu', 'no GPU')}",
        "",
        f"`python -m benchmarks.quant_kernels --out OUT`; torch {env['torch']}, triton "
        f"{env['triton']}, copy bandwidth {env.get('copy_bandwidth_GBps', 0):.0f} GB/s, an empty "
        f"graph node {env.get('empty_node_us', 0):.1f} us. Times in us per call as one node of a "
        "CUDA graph of calls on distinct weights (cold L2); floor = bytes the quantized call "
        "reads / copy bandwidth. `triton` runs float16 x in registers, `triton bf16` bfloat16 x, "
        "`dequant` dequantizes then runs float16 `F.linear` (`dq` in the plan: what ships), "
        "`torch int4` "
        "tinygemm (bfloat16), `torch int8` `_weight_int8pack_mm` (float16).",
        "",
        "| model | layer | out x in | format | rows | plan (n, k, split) | floor | triton "
        "| / floor | triton bf16 | dequant | dequant / triton | fp16 F.linear | F.linear / triton "
        "| torch int4 | torch int8 | torch op / triton |",
        "|---|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        p = r["plan"]
        op = r.get("torch_int4_us") or r.get("torch_int8_us")
        # tinygemm runs bfloat16: against the kernel in bfloat16
        mine = r.get("triton_bf16_us") if "torch_int4_us" in r else r.get("triton_us")
        lines.append(
            f"| {r['model']} | {r['layer']} | {r['shape'][0]}x{r['shape'][1]} | {r['format']} "
            f"| {r['rows']} | {p['block_n']}, {p['block_k']}, {p['split_k']}"
            f"{', dq' if p.get('dequantizes') else ''} "
            f"| {r['floor_us']:.1f} | {us_cell(r, 'triton')} "
            f"| {ratio(r.get('triton_us'), r['floor_us'])} | {us_cell(r, 'triton_bf16')} "
            f"| {us_cell(r, 'dequant')} | {ratio(r.get('dequant_us'), r.get('triton_us'))} "
            f"| {us_cell(r, 'fp16_linear')} | {ratio(r.get('fp16_linear_us'), r.get('triton_us'))} "
            f"| {us_cell(r, 'torch_int4')} | {us_cell(r, 'torch_int8')} "
            f"| {ratio(op, mine)} |"
        )
    errors = sorted({(k, v) for r in rows for k, v in r.items() if k.endswith("_error")})
    if errors:
        lines += ["", "Methods that did not run or did not match the reference:", ""]
        lines += [f"- `{k.removesuffix('_error')}`: {v}" for k, v in errors]
    if sweeps:
        lines += ["", "## Decode sweep (float16 x; us per call)", ""]
        lines.append(
            "| model | layer | format | rows | shipped (n, k, split) | shipped | best tile "
            "(n x k x stages) | its us | best split | its us |"
        )
        lines.append("|---|---|---|---:|---|---:|---|---:|---:|---:|")
        for s in sweeps:
            tile = min(s["tiles_us"], key=s["tiles_us"].get)
            split = min(s["splits_us"], key=s["splits_us"].get)
            lines.append(
                f"| {s['model']} | {s['layer']} | {s['format']} | {s['rows']} "
                f"| {', '.join(map(str, s['shipped']))} | {s['shipped_us']:.1f} | {tile} "
                f"| {s['tiles_us'][tile]:.1f} | {split} | {s['splits_us'][split]:.1f} |"
            )
    return "\n".join(lines) + "\n"


def smoke(device: str) -> list[dict]:
    """Every method once on a tiny layer, checked against the reference; no timing."""
    rows = []
    for fmt in FORMATS:
        qw = random_weight(fmt, SMOKE_SHAPE, device)
        for name, why_not in methods(fmt, device).items():
            problem = why_not or next(filter(None, (checked(name, qw, n) for n in (1, 3))), None)
            rows.append({"format": fmt, "method": name, "problem": problem})
            assert why_not or problem is None or name.startswith("torch_"), (fmt, name, problem)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="path prefix of OUT.json and OUT.md")
    names = lambda s: s.split(",")  # noqa: E731
    p.add_argument("--models", type=names, default=list(MODELS), help=f"of {', '.join(MODELS)}")
    layers = ["qkv", "o", "gate_up", "down"]
    p.add_argument("--layers", type=names, default=layers, help=f"of {', '.join(layers)}")
    p.add_argument("--formats", type=names, default=list(FORMATS), help=f"of {', '.join(FORMATS)}")
    p.add_argument(
        "--batches",
        type=lambda s: [int(b) for b in s.split(",")],
        default=BATCHES,
        help="rows of x, comma-separated (default: 1,16,256,1024)",
    )
    p.add_argument("--sweep", action="store_true", help="also sweep the decode tiles and splits")
    p.add_argument("--smoke", action="store_true", help="a tiny layer through every path, untimed")
    a = p.parse_args()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    env = environment()
    if a.smoke:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            p.error("--smoke without a CUDA device needs TRITON_INTERPRET=1")
        result = {"environment": env, "smoke": smoke(device)}
        a.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps(result["smoke"], indent=1))
        return
    import triton

    from benchmarks.kernel_timing import copy_bandwidth, empty_kernel_ms

    bandwidth = copy_bandwidth(torch.device("cuda"))
    env.update(triton=triton.__version__, copy_bandwidth_GBps=bandwidth / 1e9)
    env["empty_node_us"] = empty_kernel_ms(torch.device("cuda"))[0] * 1e3
    rows, sweeps = [], []

    def write() -> str:
        text = markdown(env, rows, sweeps)
        doc = {"environment": env, "rows": rows, "sweeps": sweeps}
        a.out.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
        a.out.with_suffix(".md").write_text(text)
        return text

    for model in a.models:
        for layer in a.layers:
            for fmt in a.formats:
                for n in a.batches:
                    rows.append(case(model, layer, fmt, n, bandwidth))
                    print(rows[-1], flush=True)
                    write()
                    if a.sweep and n <= 16:
                        sweeps.append(sweep_case(model, layer, fmt, n))
                        torch.cuda.empty_cache()
                        write()
    print(write())
    assert math.isfinite(bandwidth)


if __name__ == "__main__":
    main()

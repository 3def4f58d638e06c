"""The Triton weight-only matmul as each device family compiles it, without a GPU: `python -m
benchmarks.quant_compile --out results/quant-kernels-compile` (writes OUT.json and OUT.md).

For each family's card (sm_75: a T4, 40 SMs; sm_80: an A100, 108; sm_90: an H100, 132), each
linear layer of Qwen2.5-0.5B and Llama-3-8B (Mistral-7B's are the same; fused qkv, o, fused
gate/up, down), 4 bits in groups of 128 with offsets and 8 bits per channel, and calls of 1,
16 and 256 rows in float16: the launch `kernels.triton_quant.plan` makes on that card (tile,
reduction step, splits); the kernel cross-compiled as `linear` launches it
(`triton_quant.cross_compile`); its shared memory per program against the family's limit (64
KB a program on Turing); the registers and spills ptxas reports (`ptxas -v`, the ptxas Triton
ships); whether the dot became tensor-core instructions (`mma`/`wgmma` in the PTX); and the
programs per SM its shared memory and registers allow. Nothing is timed.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import tempfile
from pathlib import Path

import pagedctl  # noqa: F401  (first: the checkout's kernels/ must not shadow Hugging Face's)
from benchmarks.quant_kernels import MODELS
from pagedctl.envinfo import environment
from pagedctl.kernels import triton_quant as tq
from pagedctl.kernels.configs import SM75_SHARED_LIMIT

# family -> (card, compute capability, SMs, shared memory a program may use, registers an SM)
CARDS = {
    "sm75": ("T4", 75, 40, SM75_SHARED_LIMIT, 65536),
    "sm80": ("A100", 80, 108, 163 * 1024, 65536),
    "sm90": ("H100", 90, 132, 227 * 1024, 65536),
}
SHARED_PER_SM = {"sm75": 64 * 1024, "sm80": 164 * 1024, "sm90": 228 * 1024}
FORMATS = {"int4-g128": (4, 128, True), "int8-channel": (8, 0, False)}
ROWS = (1, 16, 256)


def ptxas_usage(ptx: str, cc: int, arch: str) -> dict:
    """Registers and spill bytes ptxas reports compiling `ptx` for `arch` (the ptxas Triton
    uses for `cc`)."""
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(cc).path
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        cmd = [ptxas, "-v", f"--gpu-name={arch}", str(src), "-o", str(Path(tmp) / "k.cubin")]
        log = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    regs = re.search(r"Used (\d+) registers", log)
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", log)]
    return {"registers": int(regs.group(1)) if regs else None, "spill_bytes": sum(spills)}


def case(fam: str, model: str, layer: str, fmt: str, rows: int) -> dict:
    card, cc, sms, shared_limit, regs_per_sm = CARDS[fam]
    out_features, in_features = MODELS[model][layer]
    bits, group, offsets = FORMATS[fmt]
    weight = tq.meta_weight(out_features, in_features, bits, group or in_features, offsets)
    launch = tq.plan(rows, weight, (cc // 10, cc % 10), sms)
    kernel = tq.cross_compile(cc, launch, weight, "fp16")
    ptx = kernel.asm["ptx"]
    arch = re.search(r"\.target (sm_\w+)", ptx).group(1)
    usage = ptxas_usage(ptx, cc, arch)
    cfg = launch.config
    threads = 32 * cfg.num_warps
    shared = kernel.metadata.shared
    by_regs = regs_per_sm // max(1, (usage["registers"] or 0) * threads)
    by_shared = SHARED_PER_SM[fam] // shared if shared else by_regs
    return {
        "family": fam, "card": card, "model": model, "layer": layer, "format": fmt, "rows": rows,
        "block_m": cfg.block_m, "block_n": cfg.block_n, "block_k": launch.block_k,
        "num_warps": cfg.num_warps, "num_stages": cfg.num_stages, "split_k": launch.split_k,
        "shared_bytes": shared, "shared_limit_bytes": shared_limit, **usage,
        "programs_per_sm": min(by_regs, by_shared, 32),
        "tensor_cores": "wgmma" if "wgmma" in ptx else "mma" if "mma.sync" in ptx else "fma",
    }  # fmt: skip


def markdown(env: dict, rows: list[dict]) -> str:
    head = ["card", "model", "layer", "format", "rows", "tile n x m x k", "warps", "stages",
            "split", "shared KB", "limit KB", "regs", "spill B", "progs/SM", "dot"]  # fmt: skip
    lines = [
        "# The Triton weight-only matmul, cross-compiled per device family",
        "",
        f"`python -m benchmarks.quant_compile --out OUT` on a machine without a GPU (triton "
        f"{env.get('triton')}, commit {env.get('commit', '?')}). Nothing is timed: the "
        "launch `plan` makes on each card, the kernel compiled as `linear` launches it, float16 "
        "activations.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for r in rows:
        tile = f"{r['block_n']} x {r['block_m']} x {r['block_k']}"
        cells = [r["card"], r["model"], r["layer"], r["format"], r["rows"], tile, r["num_warps"],
                 r["num_stages"], r["split_k"], f"{r['shared_bytes'] / 1024:.1f}",
                 f"{r['shared_limit_bytes'] / 1024:.0f}", r["registers"], r["spill_bytes"],
                 r["programs_per_sm"], r["tensor_cores"]]  # fmt: skip
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="path prefix of OUT.json and OUT.md")
    names = lambda s: s.split(",")  # noqa: E731
    p.add_argument("--families", type=names, default=list(CARDS), help="of " + ", ".join(CARDS))
    p.add_argument("--models", type=names, default=list(MODELS), help="of " + ", ".join(MODELS))
    a = p.parse_args()
    import triton

    env = environment()
    env["triton"] = triton.__version__
    rows = []
    for fam in a.families:
        for model in a.models:
            for layer in MODELS[model]:
                for fmt in FORMATS:
                    for n in ROWS:
                        rows.append(case(fam, model, layer, fmt, n))
                        print(rows[-1], flush=True)
    over = [r for r in rows if r["shared_bytes"] > r["shared_limit_bytes"] or r["spill_bytes"]]
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.with_suffix(".json").write_text(json.dumps({"environment": env, "rows": rows}, indent=1))
    a.out.with_suffix(".md").write_text(markdown(env, rows))
    print(markdown(env, rows))
    if over:
        raise SystemExit(f"{len(over)} launches over their shared memory or spilling: {over}")


if __name__ == "__main__":
    main()

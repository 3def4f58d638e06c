"""Registers and main-loop length of the decode kernel on sm_90, per ptxas, without a GPU:
`PYTHONPATH=TRITON_DIR python scripts/sass_probe.py [NAME ...] [--ptxas VERSION=PATH ...]`.

Compiles `_attn_fwd` for Qwen2.5-0.5B's decode (group 7, head_dim 64, block 16, tile 64, 3 splits,
fused merge, bf16, 4 warps, 3 stages) with the Triton on the path (the H200 machine has 3.6: `pip
install --no-deps --target DIR triton==3.6.0`), for the shipped kernel (`shipped`) and the copies of
`scripts/device/variants.py` named; then assembles the same PTX with each `--ptxas` binary (e.g. the
`bin/ptxas` of `pip download --no-deps nvidia-cuda-nvcc==13.0.88`; a ptxas older than the PTX's ISA
gets its `.version` lowered to 8.5). Prints registers a thread (`cuobjdump -res-usage`) and the
instructions of the longest backward branch's loop, and how alike the loops are
(`difflib.SequenceMatcher` over the instructions with register numbers removed), each against the
second name's loop from Triton's own ptxas: `results/kernels-variants-h200.txt`, session 11.
"""

from __future__ import annotations

import difflib
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "scripts" / "device"), str(ROOT)]

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def compile_decode(name: str):
    """(PTX, cubin) of the named kernel copy for the decode shape above."""
    import pagedctl.kernels.triton_attention as shipped

    if name == "shipped":
        mod = shipped
    else:
        import variants
        from kernel_copy import edited_copy

        mod = edited_copy(name, variants.VARIANTS[name])
    fn = mod._attn_fwd
    ptrs = {n: "*bf16" for n in ["q_ptr", "k_ptr", "v_ptr", "out_ptr", "acc_ws_ptr"]}
    ptrs |= {n: "*i32" for n in ["bt_ptr", "seq_lens_ptr", "cu_q_ptr", "counter_ptr"]}
    ptrs |= {n: "*fp32" for n in ["m_ws_ptr", "l_ws_ptr"]}
    consts = dict(GROUP=7, HEAD_DIM=64, D_PAD=64, BLOCK_SIZE=16, BLOCK_Q=1, BLOCK_M=16, TILE_N=64,
                  NUM_SPLITS=3, ONE_QBLOCK=True, DOT_PREC="tf32", FUSED_COMBINE=True, PDL=False,
                  stride_qd=1, stride_od=1, stride_kd=1, stride_vd=1)  # fmt: skip
    consts |= {n: 1 for n in fn.arg_names if n.isupper() and n not in consts}  # e.g. HG
    sig = {n: "constexpr" if n in consts else ptrs.get(n, "i32") for n in fn.arg_names}
    sig["qk_scale"] = "fp32"
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, n in enumerate(fn.arg_names)
        if n.endswith("_ptr") or (n.startswith("stride") and n not in consts)
    }
    target = GPUTarget("cuda", 90, 32)
    opts = triton.compiler.make_backend(target).parse_options({"num_warps": 4, "num_stages": 3})
    k = triton.compile(ASTSource(fn, sig, consts, attrs), target=target, options=opts.__dict__)
    return k.asm["ptx"], k.asm["cubin"]


def inspect(cubin: Path) -> tuple[int, list[str]]:
    """(registers, the longest loop's instructions with register numbers removed)."""
    sass = subprocess.run([BIN / "cuobjdump", "-sass", cubin], capture_output=True, text=True)
    ins = [
        (int(m.group(1), 16), m.group(2))
        for m in re.finditer(r"/\*([0-9a-f]{4})\*/\s+(.*?);", sass.stdout)
    ]
    best = (0, -1)
    for at, text in ins:
        target = re.search(r"BRA .*?0x([0-9a-f]+)", text)
        if (
            target
            and int(target.group(1), 16) < at
            and at - int(target.group(1), 16) > best[1] - best[0]
        ):
            best = (int(target.group(1), 16), at)
    loop = [re.sub(r"U?R\d+", "R", t) for at, t in ins if best[0] <= at <= best[1]]
    usage = subprocess.run([BIN / "cuobjdump", "-res-usage", cubin], capture_output=True, text=True)
    return int(re.search(r"REG:(\d+)", usage.stdout).group(1)), loop


def main() -> None:
    args = sys.argv[1:]
    assemblers = (
        dict(a.split("=", 1) for a in args[args.index("--ptxas") + 1 :])
        if "--ptxas" in args
        else {}
    )
    names = (args[: args.index("--ptxas")] if "--ptxas" in args else args) or ["shipped"]
    work = Path(tempfile.mkdtemp())
    loops = {}
    for name in names:
        ptx, cubin = compile_decode(name)
        (work / f"{name}.cubin").write_bytes(cubin)
        regs, loops[name, "triton"] = inspect(work / f"{name}.cubin")
        size = len(loops[name, "triton"])
        print(f"{name:16s} triton {triton.__version__}: {regs} registers, loop {size}")
        for version, exe in assemblers.items():
            src = work / f"{name}.{version}.ptx"
            src.write_text(ptx)
            out = work / f"{name}.{version}.cubin"
            run = subprocess.run([exe, "--gpu-name=sm_90a", src, "-o", out], capture_output=True)
            if run.returncode:  # an older ptxas: lower the PTX ISA version
                src.write_text(re.sub(r"^\.version \d+\.\d+", ".version 8.5", ptx, flags=re.M))
                subprocess.run([exe, "--gpu-name=sm_90a", src, "-o", out], check=True)
            regs, loops[name, version] = inspect(out)
            print(f"{'':16s} ptxas {version}: {regs} registers, loop {len(loops[name, version])}")
    if len(names) > 1:
        ref = loops[names[1], "triton"]
        for (name, version), loop in loops.items():
            ratio = difflib.SequenceMatcher(None, loop, ref).ratio()
            print(f"{name} ({version}) against {names[1]} (triton): {ratio:.3f}")


if __name__ == "__main__":
    main()

"""The Triton weight-only quantized matmul (`kernels.triton_quant`): under the CPU interpreter
against `kernels.quant.reference_linear` (both bit widths, every group size, offsets or none,
ragged rows, columns and reduction steps, float16/bfloat16/float32 `x`, split-K, batch
invariance), its launch plan, cross-compilation of every shipped config for sm_75/sm_80/sm_90,
and on a CUDA device (marked `gpu`) at model sizes and inside a replayed CUDA graph.

Tolerance: the standard bound of a dot whose operands are rounded once to the dot's dtype and
whose sum runs in float32, `|out - exact| <= (2u + K 2^-24) sum_k |x_k w_k| + 2 u_out |exact|`,
with `u` the unit roundoff of the dot's operands (float16 2^-11, bfloat16 2^-8, TF32 2^-11,
float32 2^-24) and `u_out` that of the output dtype. A wrong group, nibble, offset or split is
off by a sizeable fraction of `sum |x w|` and fails it.

As in `tests/test_kernels_triton.py`, the interpreter cases (`test_interp_*`) run in one child
pytest with `TRITON_INTERPRET=1` set before any kernel is JIT-ed. The interpreter keeps bfloat16
as raw 16-bit integers and its `tl.dot` multiplies those, and its float32 sums depend on an
output's place in the tile; this file's child sums the dot's products in float64 instead
(`_interpreter_exact_dot`), so bfloat16 runs and a row keeps its bits wherever it lands.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import Tensor

from tests.test_kernels_triton import INTERPRETED, compiled, interp, run_interpreter_suite

triton = pytest.importorskip("triton")

from pagedctl.kernels import configs, quant  # noqa: E402
from pagedctl.kernels import triton_quant as tq  # noqa: E402
from pagedctl.kernels.triton_splits import _COUNTERS  # noqa: E402

ROUNDOFF = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24}
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
ROWS = [1, 3, 17, 70]


def _interpreter_exact_dot() -> None:
    """Make the interpreter's `tl.dot` of float16, bfloat16 or float32 operands sum their
    products in float64, then round to the accumulator's dtype (idempotent).

    Its own dot multiplies bfloat16 operands' raw bits, and sums through numpy's BLAS, whose
    order depends on an output's place in the tile: a row moved to another place of its tile
    would change bits that the GPU's matrix instructions keep. In float64 a 16-bit operands'
    dot is exact, so every place gives the same bits (float32 operands: up to a tie of float64
    rounding, deterministic for the fixed inputs here)."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as ti

    builder = ti.InterpreterBuilder
    if getattr(builder, "_pagedctl_exact_dot", False):
        return
    dot = builder.create_dot

    def values(h) -> np.ndarray:
        if h.dtype.scalar == tl.bfloat16:
            return (h.data.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        return h.data.astype(np.float64)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if not all(h.dtype.scalar in (tl.float16, tl.bfloat16, tl.float32) for h in (a, b)):
            return dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        product = np.matmul(values(a), values(b)).astype(d.data.dtype)
        return ti.TensorHandle(product + d.data, d.dtype.scalar)

    builder.create_dot = create_dot
    builder._pagedctl_exact_dot = True


if INTERPRETED:
    _interpreter_exact_dot()


@compiled
def test_interpreter_suite() -> None:
    run_interpreter_suite(__file__)


# --- weights, inputs and the bound ----------------------------------------------------------


def make_weight(
    bits: int,
    group: int,
    shape: tuple[int, int],
    offsets: bool,
    scale_dtype: torch.dtype = torch.float16,
    seed: int = 0,
    device: str = "cpu",
) -> quant.QuantizedWeight:
    """A random weight quantized per group, its groups' magnitudes spread over 16x (so a group
    read in place of another is far off), with offsets or none (4 bits without: `q * s` only;
    8 bits with: random offsets on top of the symmetric rounding)."""
    gen = torch.Generator().manual_seed(seed)
    out, in_features = shape
    w = torch.randn(out, in_features, generator=gen) / in_features**0.5
    spread = 2.0 ** (4 * torch.rand(out, in_features // group, 1, generator=gen) - 2)
    w = (w.view(out, -1, group) * spread).view(out, in_features)
    qw = quant.quantize(w, bits, group, scale_dtype)
    if offsets and qw.offsets is None:
        extra = 0.02 * torch.randn(qw.scales.shape, generator=gen)
        qw = dataclasses.replace(qw, offsets=extra.to(scale_dtype))
    elif not offsets and qw.offsets is not None:
        qw = dataclasses.replace(qw, offsets=None)
    return qw.to(device)


def make_x(rows: int, in_features: int, dtype: torch.dtype, seed: int, device: str = "cpu"):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, in_features, generator=gen).to(device=device, dtype=dtype)


def check(
    x: Tensor,
    qw: quant.QuantizedWeight,
    bias: Tensor | None = None,
    tf32: bool = False,
    prepared: tq.TritonQuantWeight | None = None,
    what: str = "",
    **kwargs: object,
) -> Tensor:
    """`tq.linear` against `reference_linear` (in float32) within the module's bound (`what`
    names the call in a failure)."""
    out = tq.linear(x, prepared or tq.prepare(qw), bias, **kwargs)
    assert out.dtype == x.dtype and out.shape == (x.shape[0], qw.shape[0])
    b32 = None if bias is None else bias.float()
    exact = quant.reference_linear(x.float(), qw, b32).double()
    mag = x.double().abs() @ quant.dequantize(qw).to(x.device).double().abs().T
    if bias is not None:
        mag += bias.double().abs()
    u = 2.0**-11 if tf32 else ROUNDOFF[x.dtype]
    tol = (2 * u + x.shape[1] * 2.0**-24) * mag + 2 * ROUNDOFF[x.dtype] * exact.abs()
    err = (out.double() - exact).abs()
    worst = int((err / tol).argmax())
    past, at = int((err > tol).sum()), divmod(worst, out.shape[1])
    assert past == 0, (
        f"{what}: {past} outputs past the bound, worst {float(err.flatten()[worst]):.3g} vs "
        f"{float(tol.flatten()[worst]):.3g} at {at}"
    )
    return out


# --- interpreter: every path against the reference -------------------------------------------

# (bits, group (0: per-channel), in_features, offsets): steps that span several groups, a group
# spanning several steps, a last step past K, per-channel K of no power of two, groups of a
# multiple of 16 that is no power of 2 (as fusing rows of different group sizes can give)
CASES = [
    (4, 16, 80, True), (4, 32, 192, False), (4, 64, 128, True), (4, 128, 384, True),
    (4, 256, 512, True), (4, 0, 100, True), (4, 0, 256, False), (8, 16, 48, True),
    (8, 32, 96, False), (8, 128, 256, False), (8, 256, 256, True), (8, 0, 200, False),
    (8, 0, 128, True), (4, 96, 288, True), (8, 48, 144, False),
]  # fmt: skip
SCALE_DTYPES = [torch.float16, torch.bfloat16, torch.float32]


@interp
@pytest.mark.parametrize(("bits", "group", "in_features", "offsets"), CASES)
def test_interp_matches_reference(bits: int, group: int, in_features: int, offsets: bool) -> None:
    """200 output features (a ragged last column tile), rows 1, 3, 17 and 70 (ragged row tiles,
    decode and prefill configs), a bias on every other call; the `x` dtype and the scales' and
    offsets' (float16, bfloat16, float32) rotate over the calls and cases, so that every case
    runs each `x` dtype and every (rows, dtype) pair runs in several cases."""
    i = CASES.index((bits, group, in_features, offsets))
    qw = make_weight(bits, group or in_features, (200, in_features), offsets, SCALE_DTYPES[i % 3])
    prepared = tq.prepare(qw)
    for j, rows in enumerate(ROWS):
        dtype = DTYPES[(i + j) % 3]
        x = make_x(rows, in_features, dtype, seed=j)
        bias = make_x(1, 200, dtype, seed=100 + j)[0] if j % 2 else None
        check(x, qw, bias, prepared=prepared, what=f"{rows} rows, {dtype}")


@interp
@pytest.mark.parametrize("bits", [4, 8])
def test_interp_split_k_matches_and_repeats_bit_for_bit(bits: int) -> None:
    """Forced splits (uneven ones, more than there are steps) and the interpreter's own choice
    for a decode call (whose 4 column tiles leave its 8 SMs idle): each matches the reference,
    a repeat gives the same bits (the partials are summed in split order), and the arrival
    counters are left zero."""
    qw = make_weight(bits, 64, (200, 512), offsets=True, seed=bits)
    prepared = tq.prepare(qw)
    rows, dtype = (1, torch.float16) if bits == 4 else (5, torch.bfloat16)
    x = make_x(rows, 512, dtype, seed=rows)
    bias = make_x(1, 200, dtype, seed=7)[0]
    for split, runs in [(None, 8), (3, 3), (5, 4), (40, 8)]:  # of 8 steps
        assert tq.plan(rows, prepared, None, 8, split_k=split).split_k == runs, split
        out = check(x, qw, bias, prepared=prepared, split_k=split)
        if split is None:
            assert torch.equal(out, tq.linear(x, prepared, bias))
    assert int(_COUNTERS[torch.device("cpu")].count_nonzero()) == 0


@interp
@pytest.mark.parametrize(
    ("bits", "group", "dtype"),
    [(4, 32, torch.float16), (4, 32, torch.bfloat16), (8, 0, torch.float32)],
)
def test_interp_batch_invariant_rows_have_the_same_bits_alone(
    bits: int, group: int, dtype: torch.dtype
) -> None:
    """With `batch_invariant`, a row computed alone, at another place of its tile, or in a
    batch of any size has the same bits; the default path would have split the decode call."""
    qw = make_weight(bits, group or 256, (200, 256), offsets=True, seed=3)
    prepared = tq.prepare(qw)
    x = make_x(70, 256, dtype, seed=4)
    bias = make_x(1, 200, dtype, seed=5)[0]
    whole = check(x, qw, bias, prepared=prepared, batch_invariant=True)
    for rows in [(0, 1), (69, 70), (30, 65), (3, 70)]:
        part = tq.linear(x[slice(*rows)], prepared, bias, batch_invariant=True)
        assert torch.equal(part, whole[slice(*rows)]), rows
    narrow = make_weight(bits, group or 512, (200, 512), offsets=False, seed=6)
    prepared = tq.prepare(narrow)
    assert tq.plan(1, prepared, None, 8).split_k > 1
    x = make_x(9, 512, dtype, seed=8)
    whole = check(x, narrow, prepared=prepared, batch_invariant=True)
    assert torch.equal(tq.linear(x[4:5], prepared, batch_invariant=True), whole[4:5])


@interp
def test_interp_strided_inputs_and_empty_calls() -> None:
    """`x` a view with a row stride past its width, or stored column-major, and a call of no
    rows."""
    qw = make_weight(4, 32, (96, 128), offsets=True, seed=9)
    prepared = tq.prepare(qw)
    wide = make_x(20, 160, torch.float16, seed=10)
    check(wide[:, 16:144], qw, prepared=prepared)
    column_major = make_x(20, 128, torch.float16, seed=11).t().contiguous().t()
    check(column_major, qw, prepared=prepared)
    assert tq.linear(wide[:0, :128], prepared).shape == (0, 96)


@interp
@pytest.mark.parametrize(("bits", "group", "in_features", "offsets"), CASES[::2] + CASES[-1:])
def test_interp_dequantize_gives_the_reference_weight(
    bits: int, group: int, in_features: int, offsets: bool
) -> None:
    """`triton_dequant.dequantize` writes `quant.dequantize`'s weight bit for bit in float16 and
    float32 (ragged rows and features, groups spanning its tiles and inside them); in bfloat16
    within one unit of the last place (the interpreter casts float32 to bfloat16 by truncation,
    a GPU rounds to nearest)."""
    from pagedctl.kernels import triton_dequant

    i = CASES.index((bits, group, in_features, offsets))
    qw = make_weight(bits, group or in_features, (70, in_features), offsets, SCALE_DTYPES[i % 3])
    prepared = tq.prepare(qw)
    for dtype in DTYPES:
        got, want = triton_dequant.dequantize(prepared, dtype), quant.dequantize(qw, dtype)
        assert got.dtype == dtype
        if dtype == torch.bfloat16:
            units = (got.view(torch.int16).int() - want.view(torch.int16).int()).abs()
            assert int(units.max()) <= 1 and torch.equal(got.sign(), want.sign())
        else:
            assert torch.equal(got, want), dtype


@interp
def test_interp_many_rows_on_a_gpu_dequantize_and_run_the_float_matmul(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the device is a GPU of a family (the capability patched in), a call of at least
    its `DEQUANT_ROWS` rows dequantizes the weight once and runs `F.linear`, matching the
    reference; fewer rows, `batch_invariant` or a forced config keep the in-register kernel."""
    from pagedctl.kernels import triton_dequant

    monkeypatch.setattr(tq, "_device_info", lambda _: ((9, 0), 132))
    calls = []
    real = triton_dequant.dequantize
    monkeypatch.setattr(triton_dequant, "dequantize", lambda *a: calls.append(a) or real(*a))
    qw = make_weight(4, 32, (96, 128), offsets=True, seed=13)
    prepared = tq.prepare(qw)
    least = triton_dequant.DEQUANT_ROWS["sm90"]
    x = make_x(least, 128, torch.float32, seed=14)
    bias = make_x(1, 96, torch.float32, seed=15)[0]
    check(x, qw, bias, prepared=prepared)
    assert len(calls) == 1
    check(x[: least - 1], qw, bias, prepared=prepared)
    check(x, qw, bias, prepared=prepared, batch_invariant=True)
    check(x, qw, prepared=prepared, config=tq.INTERPRETER_CONFIGS[-1][1])
    assert len(calls) == 1


def _shipped_tiles() -> list[configs.MatmulConfig]:
    """The shipped configs' tile shapes, once each (the interpreter ignores warps and stages)."""
    shipped = [c for table in tq.CONFIGS.values() for _, c in table]
    shipped += tq.INVARIANT_CONFIGS.values()
    tiles = {(c.block_m, c.block_n, c.block_k): c for c in shipped}
    return [dataclasses.replace(c, num_stages=1) for c in tiles.values()]


@interp
@pytest.mark.parametrize(
    "cfg", _shipped_tiles(), ids=lambda c: f"{c.block_m}x{c.block_n}x{c.block_k}"
)
def test_interp_shipped_gpu_tiles_match_reference(cfg: configs.MatmulConfig) -> None:
    """The tile shapes the GPUs run (128 x 128 prefill tiles, 128-feature steps over 32-feature
    groups, 4-row decode tiles), interpreted and bounds-checked, split and not."""
    for bits, group, in_features in [(4, 32, 256), (8, 0, 192)]:
        qw = make_weight(bits, group or in_features, (150, in_features), offsets=True, seed=12)
        prepared = tq.prepare(qw)
        for rows, split in [(5, 1), (19, 2)]:
            x = make_x(rows, in_features, torch.float16, seed=rows)
            check(x, qw, prepared=prepared, config=cfg, split_k=split)


# --- no interpreter: arguments, the plan, cross-compilation -----------------------------------


@compiled
def test_prepare_transposes_the_scales_and_keeps_the_bytes() -> None:
    qw = make_weight(4, 32, (48, 128), offsets=True, scale_dtype=torch.bfloat16)
    p = tq.prepare(qw)
    assert p.shape == qw.shape == (48, 128) and p.nbytes == qw.nbytes
    assert torch.equal(p.qdata, qw.qdata) and p.scales.dtype == torch.bfloat16
    assert p.scales.shape == (4, 48) and p.scales.is_contiguous()
    assert torch.equal(p.scales, qw.scales.t()) and torch.equal(p.offsets, qw.offsets.t())
    assert tq.prepare(make_weight(8, 128, (48, 128), offsets=False)).offsets is None


@compiled
def test_bad_inputs_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    p = tq.prepare(make_weight(8, 32, (48, 128), offsets=False))
    with pytest.raises(ValueError, match=r"x must be \[rows, 128\]"):
        tq.linear(torch.zeros(2, 64), p)
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        tq.linear(torch.zeros(2, 128, dtype=torch.float64), p)
    for group in (40, 24):
        weight = quant.QuantizedWeight(
            8, group, torch.zeros(4, 120, dtype=torch.int8), torch.ones(4, 120 // group)
        )
        with pytest.raises(ValueError, match=f"group_size {group} is neither"):
            tq.prepare(weight)
    monkeypatch.setattr(tq, "_device_info", lambda _: ((7, 5), 40))
    with pytest.raises(ValueError, match=r"bfloat16 needs compute capability 8\.0"):
        tq.linear(torch.zeros(2, 128, dtype=torch.bfloat16), p)


def shaped(out_features: int, in_features: int) -> tq.TritonQuantWeight:
    """A 4-bit weight of this shape in groups of 128, its values unset (for the plan)."""
    qdata = torch.empty(out_features, in_features // 2, dtype=torch.uint8)
    return tq.TritonQuantWeight(4, 128, qdata, torch.empty(in_features // 128, out_features), None)


@compiled
@pytest.mark.parametrize(("capability", "sms"), [((7, 5), 40), ((8, 0), 108), ((9, 0), 132)])
def test_plan_splits_only_idle_decode_grids_and_never_leaves_a_split_empty(
    capability: tuple[int, int], sms: int
) -> None:
    """Over the layers of Qwen2.5-0.5B and Llama-3-8B and row counts 1 to 4096: rows tiles
    grow with the rows; a split only where the tiles leave SMs idle, each at least
    MIN_SPLIT_STEPS steps long, none empty, the grid at most SPLIT_PROGRAMS_PER_SM an SM; the
    batch-invariant plan is one per weight and never splits."""
    layers = [(1152, 896), (896, 896), (9728, 896), (896, 4864)]
    layers += [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
    for out_features, in_features in layers:
        p = shaped(out_features, in_features)
        invariant = {tq.plan(r, p, capability, sms, batch_invariant=True) for r in (1, 7, 4096)}
        assert len(invariant) == 1 and invariant.pop().split_k == 1
        block_m = 0
        for rows in (1, 2, 5, 16, 17, 64, 65, 256, 4096):
            cfg, block_k, split, per = tq.plan(rows, p, capability, sms)
            assert cfg.block_m >= block_m and block_k <= cfg.block_k
            block_m = cfg.block_m
            steps = -(-in_features // block_k)
            tiles = -(-rows // cfg.block_m) * -(-out_features // cfg.block_n)
            assert per * (split - 1) < steps <= per * split  # every split has steps
            if split > 1:
                assert tiles < sms and per >= tq.MIN_SPLIT_STEPS
                assert tiles * split <= tq.SPLIT_PROGRAMS_PER_SM * sms
    assert tq.plan(1, shaped(896, 896), capability, sms).split_k > 1  # Qwen2.5-0.5B's o_proj


SHARED_LIMITS = {"sm75": configs.SM75_SHARED_LIMIT, "sm80": 99 * 1024}  # sm_86/sm_89: 99 KB
TARGETS = {"sm75": 75, "sm80": 80, "sm90": 90}


@compiled
@pytest.mark.parametrize("fam", sorted(TARGETS))
def test_shipped_configs_compile_for_their_architecture(fam: str) -> None:
    """Every config of a family (its row buckets and its batch-invariant one), for two of: 4 bits
    in groups of 128 with offsets (split where the bucket may split), 8 bits per channel with a
    bias, 4 bits in groups of 32 with a ragged last step; `x` in float16 or float32 (sm_75, within
    its 64 KB of shared memory and on FMA dots, Triton issuing no MMA there, spilling no
    register), or float16, bfloat16 or float32 as TF32 (sm_80, within the 99 KB of sm_86/sm_89;
    sm_90, on warp-group MMA wherever the column tile fills one); the loads software-pipelined
    wherever the config has stages."""
    from benchmarks.quant_compile import ptxas_usage

    cc = TARGETS[fam]
    shipped = [(most, c) for most, c in tq.CONFIGS[fam]] + [(None, tq.INVARIANT_CONFIGS[fam])]
    dtypes = ["fp16", "fp32"] if fam == "sm75" else ["fp16", "bf16", "fp32"]
    variants = [(4, 128, 4096, True), (8, 4096, 4096, False), (4, 32, 4160, False)]
    for i, (most, cfg) in enumerate(shipped):
        for j in (i % 3, (i + 1) % 3):  # two variants a config, each variant in most configs
            bits, group, in_features, offsets = variants[j]
            dtype = dtypes[(i + j) % len(dtypes)]
            split = 4 if most is not None else 1
            steps = -(-in_features // cfg.block_k)
            launch = tq.Plan(cfg, cfg.block_k, split, -(-steps // split))
            weight = tq.meta_weight(4096, in_features, bits, group, offsets)
            kernel = tq.cross_compile(cc, launch, weight, dtype, bias=j == 1)
            ptx = kernel.asm["ptx"]
            if fam in SHARED_LIMITS:
                assert kernel.metadata.shared <= SHARED_LIMITS[fam], (cfg, bits, group)
            if fam == "sm75":  # FMA dots: the operands live in registers, none spilled
                assert "mma" not in ptx and "bf16" not in ptx
                assert ptxas_usage(ptx, cc, "sm_75")["spill_bytes"] == 0, cfg
            elif fam == "sm90" and cfg.block_n >= 64:
                assert "wgmma.mma_async" in ptx, cfg
            assert "cp.async" in ptx or cfg.num_stages == 1, cfg  # the loads are pipelined


@compiled
@pytest.mark.parametrize("fam", sorted(TARGETS))
def test_dequantize_kernel_compiles_for_every_family(fam: str) -> None:
    """`triton_dequant._dequant` for 4 bits with offsets and 8 bits without, writing float16
    (and bfloat16 from sm_80): within the family's shared memory, no bfloat16 on sm_75."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from pagedctl.kernels import triton_dequant as td

    cc = TARGETS[fam]
    target = GPUTarget("cuda", cc, 32)
    options = triton.compiler.make_backend(target).parse_options({"num_warps": 4})
    for bits, offsets, out in [(4, True, "fp16"), (8, False, "bf16" if cc >= 80 else "fp16")]:
        sig = {"q_ptr": "*u8" if bits == 4 else "*i8", "s_ptr": "*fp16", "o_ptr": "*fp16"}
        sig["w_ptr"] = f"*{out}"
        consts = dict(N=4096, K=4096, GROUP=128, BITS=bits, HAS_OFFSETS=offsets)
        consts.update(BLOCK_N=td.BLOCK_N, BLOCK_K=td.BLOCK_K)
        sig.update({name: "constexpr" for name in consts})
        source = ASTSource(
            td._dequant, sig, consts, {(i,): [["tt.divisibility", 16]] for i in range(4)}
        )
        kernel = triton.compile(source, target=target, options=options.__dict__)
        assert kernel.metadata.shared <= SHARED_LIMITS.get(fam, 227 * 1024), (bits, out)
        assert fam != "sm75" or "bf16" not in kernel.asm["ptx"]


# --- on a CUDA device -------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _gpu_dtypes() -> list[torch.dtype]:
    ok = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8
    return [torch.float16, torch.bfloat16, torch.float32] if ok else [torch.float16, torch.float32]


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize(
    ("bits", "group", "shape", "offsets"),
    [(4, 128, (4096, 4096), True), (8, 128, (1152, 896), False), (8, 0, (896, 4864), False),
     (4, 32, (9728, 896), True), (8, 16, (1000, 1040), True), (4, 0, (6144, 4096), True)],
)  # fmt: skip
def test_gpu_matches_reference(bits: int, group: int, shape: tuple[int, int], offsets: bool):
    """Model-sized layers on the device at decode and prefill sizes (split and not; from
    `DEQUANT_ROWS` rows dequantized, then cuBLAS), every dtype the device has (float32 as TF32
    from sm_80)."""
    qw = make_weight(bits, group or shape[1], shape, offsets, seed=1, device="cuda")
    prepared = tq.prepare(qw)
    tf32 = torch.cuda.get_device_capability()[0] >= 8
    for rows in (1, 16, 77, 256, 1024):  # 1024: dequantized, then cuBLAS
        for dtype in _gpu_dtypes():
            x = make_x(rows, shape[1], dtype, seed=rows, device="cuda")
            bias = make_x(1, shape[0], dtype, seed=2, device="cuda")[0]
            tf32_dot = tf32 and dtype == torch.float32
            check(x, qw, bias, tf32=tf32_dot, prepared=prepared, what=f"{rows} rows, {dtype}")


@pytest.mark.gpu
@cuda
def test_gpu_batch_invariant_rows_and_graph_replay() -> None:
    """On the device: a batch-invariant row alone has its bits in a batch of 300; a split-K
    decode call captured in a CUDA graph replays new inputs to the bits of eager calls and
    leaves the counters zero."""
    capability = torch.cuda.get_device_capability()
    dtype = torch.bfloat16 if capability >= (8, 0) else torch.float16
    qw = make_weight(4, 128, (4096, 4096), offsets=True, seed=3, device="cuda")
    prepared = tq.prepare(qw)
    x = make_x(300, 4096, dtype, seed=4, device="cuda")
    whole = tq.linear(x, prepared, batch_invariant=True)
    for rows in [(0, 1), (7, 8), (299, 300), (100, 180)]:
        part = tq.linear(x[slice(*rows)], prepared, batch_invariant=True)
        assert torch.equal(part, whole[slice(*rows)]), rows
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert tq.plan(1, prepared, capability, sms).split_k > 1
    static = x[:1].clone()
    tq.linear(static, prepared)  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tq.linear(static, prepared)
    for i in range(3):
        static.copy_(x[i : i + 1])
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, tq.linear(x[i : i + 1], prepared)), i
    check(x[2:3], qw, prepared=prepared)
    assert int(_COUNTERS[torch.device("cuda", 0)].count_nonzero()) == 0

"""The skinny projection kernel of decode batches (`kernels.triton_linear`), with its fused
RMSNorm and SwiGLU: against the separate ops under the CPU interpreter, where the engine sends
which rows, cross-compiled for sm_90 and sm_80, and at the real models' sizes on CUDA (`gpu`).

As in `tests/test_kernels_triton.py`, the interpreter cases (`test_interp_*`) run in one child
pytest process with `TRITON_INTERPRET=1` set before the kernels are JIT-ed.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

triton = pytest.importorskip("triton")

from pagedctl import kernels  # noqa: E402
from pagedctl.kernels import configs, reference  # noqa: E402
from pagedctl.kernels import triton_linear as tlin  # noqa: E402
from tests.test_kernels_fused import EPS, UNIT, gpu, gpu_dtypes, randn  # noqa: E402
from tests.test_kernels_triton import _compile, run_interpreter_suite  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interp = pytest.mark.skipif(not INTERPRETED, reason="runs in the interpreter child process")
compiled = pytest.mark.skipif(INTERPRETED, reason="runs in the parent process")


@compiled
def test_interpreter_suite() -> None:
    run_interpreter_suite(__file__)


def expected(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    norm_weight: Tensor | None,
    residual: Tensor | None,
    swiglu: bool,
) -> tuple[Tensor, Tensor | None]:
    """The separate ops (the reference norm, then the product in float64 rounded once, then
    SwiGLU in float64 of the rounded projections): (output, residual stream or None)."""
    summed = None
    h = x
    if norm_weight is not None:
        if residual is None:
            h = reference.rms_norm(x, norm_weight, EPS)
        else:
            h, summed = reference.rms_norm(x, norm_weight, EPS, residual)
    y = F.linear(h.double(), weight.double(), None if bias is None else bias.double())
    if not swiglu:
        return y.to(x.dtype), summed
    gate, up = y.to(x.dtype).double().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype), summed


def check(got: Tensor, want: Tensor) -> None:
    """Equal up to the reduction order and a rounding or two of the normalised input: float32
    within float32 noise, half types within a few units in the last place of the largest
    output."""
    assert got.dtype == want.dtype and got.shape == want.shape
    unit = UNIT[want.dtype] if want.dtype != torch.float32 else 2e-6
    scale = float(want.abs().max().clamp(min=1.0))
    torch.testing.assert_close(got.float(), want.float(), rtol=8 * unit, atol=8 * unit * scale)


def operands(rows: int, k: int, n: int, dtype: torch.dtype, seed: int, device: str = "cpu"):
    x = randn(rows, k + 8, dtype=dtype, seed=seed, device=device)[:, 3 : k + 3]  # strided rows
    residual = randn(rows, k, dtype=dtype, seed=seed + 1, device=device)
    norm_weight = 1 + randn(k, dtype=dtype, seed=seed + 2, device=device) / 4
    weight = (randn(n, k, dtype=torch.float32, seed=seed + 3, device=device) / k**0.5).to(dtype)
    bias = randn(n, dtype=dtype, seed=seed + 4, device=device)
    return x, residual, norm_weight, weight, bias


CASES = {  # name -> (bias, norm, residual, swiglu): each way the engine calls the kernel
    "plain": (False, False, False, False),
    "qkv_first_layer": (True, True, False, False),
    "qkv": (True, True, True, False),
    "gate_up": (False, True, True, True),
}


def run_case(case: str, rows: int, k: int, n: int, dtype: torch.dtype, device: str = "cpu"):
    has_bias, norm, res, swiglu = CASES[case]
    x, residual, norm_weight, weight, bias = operands(rows, k, n, dtype, rows + k, device)
    args = (
        bias if has_bias else None,
        norm_weight if norm else None,
        residual if res else None,
        swiglu,
    )
    cfg = configs.lookup_linear(tlin._device_info(x.device)[0])
    got, got_sum = tlin.skinny_linear(x, weight, args[0], cfg, args[1], EPS, args[2], swiglu)
    want, want_sum = expected(x, weight, *args)
    check(got, want)
    assert (got_sum is None) == (want_sum is None)
    if want_sum is not None:
        assert torch.equal(got_sum, want_sum)


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [1, 5, 16, 33])
@pytest.mark.parametrize("case", sorted(CASES))
def test_interp_skinny_linear_matches_the_separate_ops(
    case: str, rows: int, dtype: torch.dtype
) -> None:
    run_case(case, rows, k=96, n=80, dtype=dtype)  # K and N not multiples of their tiles


@interp
def test_interp_norm_linear_keeps_the_residual_stream() -> None:
    """Through the dispatcher: the first layer's residual stream is its input itself; later
    ones the sum, stored once however many programs the grid has."""
    x, residual, norm_weight, weight, bias = operands(3, 64, 200, torch.float32, 0)
    out, stream = kernels.norm_linear(x, None, norm_weight, EPS, weight, bias)
    assert stream is x
    out, stream = kernels.norm_linear(x, residual, norm_weight, EPS, weight, None, swiglu=True)
    assert out.shape == (3, 100) and torch.equal(stream, x + residual)


@compiled
def test_cpu_calls_take_the_plain_ops() -> None:
    x, residual, norm_weight, weight, bias = operands(4, 32, 48, torch.float32, 0)
    assert torch.equal(kernels.linear(x, weight, bias), F.linear(x, weight, bias))
    out, stream = kernels.norm_linear(x, residual, norm_weight, EPS, weight, None, swiglu=True)
    normed, want_stream = reference.rms_norm(x, norm_weight, EPS, residual)
    assert torch.equal(stream, want_stream)
    assert torch.equal(out, reference.silu_and_mul(F.linear(normed, weight)))


@compiled
def test_only_decode_sized_batches_of_a_measured_family_take_the_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PAGEDCTL_KERNELS", "triton")
    rows = configs.INTERPRETER_LINEAR.max_rows
    assert kernels._skinny_config(torch.zeros(rows, 8)) is configs.INTERPRETER_LINEAR
    assert kernels._skinny_config(torch.zeros(rows + 1, 8)) is None
    assert kernels._skinny_config(torch.zeros(0, 8)) is None
    assert configs.lookup_linear((9, 0)) is configs.LINEAR_CONFIGS["sm90"]
    assert configs.lookup_linear((7, 5)) is None and configs.lookup_linear((8, 6)) is None
    monkeypatch.setenv("PAGEDCTL_KERNELS", "reference")
    assert kernels._skinny_config(torch.zeros(1, 8)) is None


def test_block_n_gives_every_sm_a_program_while_it_can() -> None:
    assert tlin.block_n(4864, 132) == 32  # Qwen2.5-0.5B gate/up: 152 programs
    assert tlin.block_n(9728, 132) == 64
    assert tlin.block_n(1152, 132) == 16  # q/k/v: as many as there are
    assert tlin.block_n(896, 8) == 64


@compiled
@pytest.mark.parametrize("cc", [80, 90])
@pytest.mark.parametrize("case", sorted(CASES))
def test_skinny_linear_compiles(cc: int, case: str) -> None:
    has_bias, norm, res, swiglu = CASES[case]
    cfg = configs.LINEAR_CONFIGS["sm90"]
    ptrs = {n: "*bf16" for n in ["x_ptr", "res_ptr", "sum_ptr", "nw_ptr", "w_ptr", "b_ptr"]}
    ptrs["out_ptr"] = "*bf16"
    consts = dict(N=4864, K=896, NORM=norm, RESIDUAL=res, BIAS=has_bias, SWIGLU=swiglu)
    consts.update(BLOCK_M=64, BLOCK_N=32, BLOCK_K=cfg.block_k)
    launch = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    ptrs["eps"] = "fp32"
    kernel = _compile(tlin._skinny_linear, ptrs, consts, cc, launch)
    assert "mma" in kernel.asm["ptx"]


@gpu
@pytest.mark.parametrize("dtype", gpu_dtypes())
@pytest.mark.parametrize("rows", [1, 16, 64])
@pytest.mark.parametrize("case", sorted(CASES))
def test_gpu_skinny_linear_at_model_sizes(case: str, rows: int, dtype: torch.dtype) -> None:
    if configs.lookup_linear(torch.cuda.get_device_capability()) is None:
        pytest.skip("this GPU family keeps cuBLAS")
    k, n = {"plain": (4864, 896), "gate_up": (896, 2 * 4864)}.get(case, (896, 1152))
    run_case(case, rows, k, n, dtype, device="cuda")

"""Fused RMSNorm, rotary and SiLU-and-mul: the reference ops equal today's engine layer code bit
for bit; the Triton kernels match the reference (and, for rotary and SiLU-and-mul, a float64 result
rounded once) under the CPU interpreter; they cross-compile for sm_75 and sm_90; on CUDA (marked
`gpu`) they match at real sizes, past 2^31 elements, and inside a replayed CUDA graph.

As in `tests/test_kernels_triton.py`, the interpreter cases (`test_interp_*`) run in one child
pytest process with `TRITON_INTERPRET=1` set before the kernels are JIT-ed.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import Tensor, nn

triton = pytest.importorskip("triton")

from pagedctl import kernels  # noqa: E402
from pagedctl.engine.models.layers import GatedMLP, RMSNorm  # noqa: E402
from pagedctl.engine.models.rope import RopeConfig, RotaryEmbedding, apply_rotary  # noqa: E402
from pagedctl.kernels import reference  # noqa: E402
from pagedctl.kernels import triton_fused as tf  # noqa: E402
from tests.test_kernels_triton import _compile, run_interpreter_suite  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interp = pytest.mark.skipif(not INTERPRETED, reason="runs in the interpreter child process")
compiled = pytest.mark.skipif(INTERPRETED, reason="runs in the parent process")
EPS = 1e-6
UNIT = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}  # half ulp
LLAMA3 = RopeConfig("llama3", 500000.0, 32.0, 1.0, 4.0, 8192)


@compiled
def test_interpreter_suite() -> None:
    run_interpreter_suite(__file__)


# --- shared helpers --------------------------------------------------------------------------


def randn(*shape: int, dtype: torch.dtype, seed: int, device: str = "cpu") -> Tensor:
    """Normal(0, 2) values rounded to `dtype`."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return (2 * torch.randn(*shape, generator=gen, device=device)).to(dtype)


def qkv_views(
    tokens: int,
    heads: tuple[int, int],
    head_dim: int,
    dtype: torch.dtype,
    seed: int,
    device: str = "cpu",
) -> tuple[Tensor, Tensor, Tensor]:
    """q, k and the whole buffer: q, k are views of a fused qkv output whose rows carry padding."""
    q_size, kv_size = heads[0] * head_dim, heads[1] * head_dim
    qkv = randn(tokens, q_size + 2 * kv_size + 8, dtype=dtype, seed=seed, device=device)
    q = qkv[:, :q_size].view(tokens, heads[0], head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(tokens, heads[1], head_dim)
    return q, k, qkv


def same_view(view: Tensor, base: Tensor, other: Tensor) -> Tensor:
    """`view`'s elements of `base`, taken from `other` (contiguous, shaped like `base`)."""
    offset = view.storage_offset() - base.storage_offset()
    return other.as_strided(view.shape, view.stride(), other.storage_offset() + offset)


def rope_tables(
    head_dim: int, max_positions: int, dtype: torch.dtype, device: str = "cpu"
) -> tuple[Tensor, Tensor]:
    """The engine's cos/sin tables in `dtype` (computed in float32 on the CPU, then cast)."""
    rope = RotaryEmbedding(head_dim, max_positions, LLAMA3)
    return rope.cos.to(device, dtype), rope.sin.to(device, dtype)


def rotary_exact(x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
    """Float64 rotation of `x` by the table values, and each output's `|x1 c| + |x2 s|`."""
    c, s = cos[positions].double()[:, None], sin[positions].double()[:, None]
    x1, x2 = x.double().chunk(2, dim=-1)
    exact = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    return exact, torch.cat(((x1 * c).abs() + (x2 * s).abs(), (x2 * c).abs() + (x1 * s).abs()), -1)


def check_rotary(q: Tensor, k: Tensor, qkv: Tensor, cos: Tensor, sin: Tensor, pos: Tensor) -> None:
    """Triton rotary in place: the float64 rotation rounded once, within the reference's three
    roundings of the reference, and the rest of the fused buffer (v, row padding) untouched."""
    u = UNIT[q.dtype]
    before, want = qkv.clone(), qkv.clone()
    ref_q, ref_k = same_view(q, qkv, want), same_view(k, qkv, want)
    reference.rotary(ref_q, ref_k, cos, sin, pos)
    exact = [rotary_exact(x, cos, sin, pos) for x in (q, k)]
    tf.rotary(q, k, cos, sin, pos)
    for got, ref, (ex, mag) in zip((q, k), (ref_q, ref_k), exact, strict=True):
        err = (got.double() - ex).abs()
        assert bool((err <= u * ex.abs() + 2.0**-21 * mag + 1e-7).all()), float(err.max())
        assert bool(((got.double() - ref.double()).abs() <= 3 * u * mag + 1e-6).all())
    rotated = torch.zeros(qkv.shape, dtype=torch.bool, device=qkv.device)
    same_view(q, qkv, rotated).fill_(True)
    same_view(k, qkv, rotated).fill_(True)
    assert torch.equal(qkv[~rotated], before[~rotated])


def check_rotary_write_kv(
    tokens: int,
    heads: tuple[int, int],
    head_dim: int,
    dtype: torch.dtype,
    head_major: bool,
    device: str = "cpu",
) -> None:
    """Fused rotary + KV write == `tf.rotary`, then the reference `write_kv` of the rotated k
    and of v, bit for bit: q and k rotated in place, each kept slot's K/V row in the cache, the
    padding slots (-1) and every other cache entry untouched (NaN before and after)."""
    q, k, qkv = qkv_views(tokens, heads, head_dim, dtype, seed=tokens + heads[0], device=device)
    q_size, kv_size = heads[0] * head_dim, heads[1] * head_dim
    v = qkv[:, q_size + kv_size : q_size + 2 * kv_size].view(tokens, heads[1], head_dim)
    num_blocks, block_size = 5, 16
    if head_major:  # stored [blocks, heads, block_size, D], seen as [blocks, block_size, heads, D]
        store = torch.full((2, num_blocks, heads[1], block_size, head_dim), float("nan"))
        caches = store.to(device, dtype).transpose(2, 3)
    else:
        caches = torch.full((2, num_blocks, block_size, heads[1], head_dim), float("nan"))
        caches = caches.to(device, dtype)
    gen = torch.Generator().manual_seed(tokens)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[::3] = -1  # padding rows
    slots = slots.to(device)
    cos, sin = rope_tables(head_dim, 1000, dtype, device=device)
    pos = torch.randint(0, 1000, (tokens,), generator=gen).to(device)
    want_qkv, want_caches = qkv.clone(), caches.clone()
    want_q, want_k = same_view(q, qkv, want_qkv), same_view(k, qkv, want_qkv)
    want_v = same_view(v, qkv, want_qkv)
    tf.rotary(want_q, want_k, cos, sin, pos)
    reference.write_kv(want_k, want_v, want_caches[0], want_caches[1], slots)
    tf.rotary_write_kv(q, k, v, cos, sin, pos, caches[0], caches[1], slots)
    assert torch.equal(qkv, want_qkv)
    torch.testing.assert_close(caches, want_caches, rtol=0, atol=0, equal_nan=True)
    written = int((~caches[0].isnan()).all(-1).sum())
    assert written == int((slots >= 0).sum()) * heads[1]


def check_silu(x: Tensor) -> None:
    """Triton SiLU-and-mul == float64 rounded once, and within 3 roundings of the reference."""
    got, ref = tf.silu_and_mul(x), reference.silu_and_mul(x)
    assert got.dtype == x.dtype and got.shape == ref.shape
    gate, up = x.double().chunk(2, dim=-1)
    exact = torch.nn.functional.silu(gate) * up
    u = UNIT[x.dtype]
    err = (got.double() - exact).abs()
    assert bool((err <= (u + 2.0**-18) * exact.abs() + 1e-7).all()), float(err.max())
    assert bool(((got.double() - ref.double()).abs() <= 3 * u * exact.abs() + 1e-6).all())


def check_rms_norm(got: Tensor, ref: Tensor) -> None:
    """Triton == reference up to the mean's summation order: float32 within a few ulp; half
    types within two rounding steps and almost all elements bit-identical."""
    assert got.dtype == ref.dtype and got.shape == ref.shape and got.is_contiguous()
    if ref.dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=2e-6, atol=1e-6)
        return
    tol = 4 * UNIT[ref.dtype]
    torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=1e-5)
    assert float((got != ref).float().mean()) < 0.01


# --- reference == engine layer code, bit for bit (no Triton) ----------------------------------


@compiled
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("residual", [False, True])
def test_reference_rms_norm_is_engine_rmsnorm(dtype: torch.dtype, residual: bool) -> None:
    x, r = randn(2, 7, 576, dtype=dtype, seed=1)
    norm = RMSNorm(576, EPS).to(dtype)
    norm.weight.data.copy_(1 + randn(576, dtype=dtype, seed=2) / 4)
    with torch.no_grad():
        if residual:
            got, summed = reference.rms_norm(x, norm.weight, EPS, r)
            assert torch.equal(summed, x + r)
            assert torch.equal(got, norm(x + r))
        else:
            assert torch.equal(reference.rms_norm(x, norm.weight, EPS), norm(x))
        q, _, _ = qkv_views(5, (4, 2), 128, dtype, seed=3)  # Qwen3's per-head q norm
        head_norm = RMSNorm(128, EPS).to(dtype)
        assert torch.equal(reference.rms_norm(q, head_norm.weight, EPS), head_norm(q))


@compiled
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_reference_rotary_is_engine_apply_rotary(dtype: torch.dtype) -> None:
    q, k, qkv = qkv_views(6, (14, 2), 64, dtype, seed=4)
    cos, sin = rope_tables(64, 4096, dtype)
    positions = torch.tensor([0, 1, 17, 4095, 2048, 17])
    want_q = apply_rotary(q, cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))
    want_k = apply_rotary(k, cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))
    v_before = qkv[:, q.shape[1] * 64 + k.shape[1] * 64 :].clone()
    reference.rotary(q, k, cos, sin, positions)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(qkv[:, q.shape[1] * 64 + k.shape[1] * 64 :], v_before)


@compiled
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_reference_silu_and_mul_is_engine_gated_mlp(dtype: torch.dtype) -> None:
    mlp = GatedMLP(8, 1536)
    mlp.gate_up_proj, mlp.down_proj = nn.Identity(), nn.Identity()  # keep only silu(gate) * up
    x = randn(5, 2 * 1536, dtype=dtype, seed=5)
    assert torch.equal(reference.silu_and_mul(x), mlp(x))


# --- Triton under the interpreter ------------------------------------------------------------


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("size", [72, 576, 1280])
def test_interp_rms_norm_matches_reference(size: int, residual: bool, dtype: torch.dtype) -> None:
    x = randn(5, size + 24, dtype=dtype, seed=size)[:, 3 : size + 3]  # strided rows
    weight = 1 + randn(size, dtype=dtype, seed=1) / 4
    if not residual:
        check_rms_norm(tf.rms_norm(x, weight, EPS), reference.rms_norm(x, weight, EPS))
        return
    r = randn(5, size, dtype=dtype, seed=2)
    got, summed = tf.rms_norm(x, weight, EPS, r)
    want, want_sum = reference.rms_norm(x, weight, EPS, r)
    assert torch.equal(summed, want_sum) and summed.is_contiguous()
    check_rms_norm(got, want)


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("heads", "head_dim"), [((4, 2), 128), ((3, 1), 24)])
def test_interp_rms_norm_per_head_on_qkv_views(
    heads: tuple[int, int], head_dim: int, dtype: torch.dtype
) -> None:
    q, k, qkv = qkv_views(9, heads, head_dim, dtype, seed=head_dim)  # rows split across programs
    before = qkv.clone()
    weight = 1 + randn(head_dim, dtype=dtype, seed=1) / 4
    for x in (q, k):
        check_rms_norm(tf.rms_norm(x, weight, EPS), reference.rms_norm(x, weight, EPS))
    assert torch.equal(qkv, before)


@interp
def test_interp_rms_norm_float32_weight_promotes_like_the_reference() -> None:
    x, weight = (
        randn(3, 96, dtype=torch.float16, seed=0),
        1 + randn(96, dtype=torch.float32, seed=1),
    )
    check_rms_norm(tf.rms_norm(x, weight, 1e-5), reference.rms_norm(x, weight, 1e-5))


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("heads", "head_dim"), [((14, 2), 64), ((9, 3), 24), ((40, 8), 128)])
def test_interp_rotary_in_place_on_qkv_views(
    heads: tuple[int, int], head_dim: int, dtype: torch.dtype
) -> None:
    q, k, qkv = qkv_views(5, heads, head_dim, dtype, seed=heads[0])
    cos, sin = rope_tables(head_dim, 1000, dtype)
    check_rotary(q, k, qkv, cos, sin, torch.tensor([999, 0, 1, 513, 0]))


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("heads", "head_dim"), [((14, 2), 64), ((9, 3), 24)])
@pytest.mark.parametrize("head_major", [False, True])
def test_interp_rotary_write_kv_is_rotary_then_write_kv(
    heads: tuple[int, int], head_dim: int, dtype: torch.dtype, head_major: bool
) -> None:
    check_rotary_write_kv(7, heads, head_dim, dtype, head_major)


@interp
def test_interp_rotary_write_kv_dispatch_and_empty_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, qkv = qkv_views(0, (2, 1), 64, torch.float32, seed=0)
    caches = torch.zeros(2, 2, 16, 1, 64)
    tables = rope_tables(64, 8, torch.float32)
    empty = torch.zeros(0, dtype=torch.int64)
    tf.rotary_write_kv(q, k, k, *tables, empty, caches[0], caches[1], empty)
    assert not caches.any()
    # float16 rotary rounds differently in the two backends: the outputs tell which one ran
    q, k, qkv = qkv_views(3, (2, 1), 64, torch.float16, seed=2)
    v = qkv[:, 3 * 64 : 4 * 64].view(3, 1, 64)
    tables, pos, slots = rope_tables(64, 8, torch.float16), torch.tensor([7, 0, 3]), torch.arange(3)

    def run(op) -> tuple[Tensor, Tensor]:
        buf, cache = qkv.clone(), torch.zeros(2, 1, 16, 1, 64, dtype=torch.float16)
        views = [same_view(t, qkv, buf) for t in (q, k, v)]
        op(*views, *tables, pos, cache[0], cache[1], slots)
        return buf, cache

    runs = {}
    for backend in ("triton", "reference"):
        monkeypatch.setenv("PAGEDCTL_KERNELS", backend)
        runs[backend] = run(kernels.rotary_write_kv)
    for got, want in zip(runs["triton"], run(tf.rotary_write_kv), strict=True):
        assert torch.equal(got, want)
    for got, want in zip(runs["reference"], run(reference.rotary_write_kv), strict=True):
        assert torch.equal(got, want)
    assert not torch.equal(runs["triton"][1], runs["reference"][1])


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("size", [40, 1100])
def test_interp_silu_and_mul_matches_reference(size: int, dtype: torch.dtype) -> None:
    check_silu(randn(4, 2 * size, dtype=dtype, seed=size))
    check_silu(randn(3, 2 * size + 16, dtype=dtype, seed=1)[:, 16:])  # strided rows


@interp
def test_interp_empty_batches_launch_nothing() -> None:
    x, w = torch.zeros(0, 64), torch.ones(64)
    assert tf.rms_norm(x, w, EPS).shape == (0, 64)
    assert [t.shape for t in tf.rms_norm(x, w, EPS, x)] == [(0, 64), (0, 64)]
    assert tf.silu_and_mul(torch.zeros(0, 128)).shape == (0, 64)
    q, k, _ = qkv_views(0, (2, 1), 64, torch.float32, seed=0)
    tf.rotary(q, k, *rope_tables(64, 8, torch.float32), torch.zeros(0, dtype=torch.int64))


@interp
def test_interp_dispatch_through_kernels_package(monkeypatch: pytest.MonkeyPatch) -> None:
    # float16 SiLU-and-mul rounds differently in the two backends: the output tells which ran.
    x = randn(4, 2 * 300, dtype=torch.float16, seed=9)
    weight = randn(300, dtype=torch.float16, seed=1)
    q, k, qkv = qkv_views(3, (2, 1), 64, torch.float16, seed=2)
    tables, pos = rope_tables(64, 8, torch.float16), torch.tensor([7, 0, 3])
    monkeypatch.setenv("PAGEDCTL_KERNELS", "triton")
    triton_out = kernels.silu_and_mul(x)
    assert torch.equal(triton_out, tf.silu_and_mul(x))
    assert torch.equal(
        kernels.rms_norm(x[:, :300], weight, EPS), tf.rms_norm(x[:, :300], weight, EPS)
    )
    q2, k2, qkv2 = qkv_views(3, (2, 1), 64, torch.float16, seed=2)
    kernels.rotary(q, k, *tables, pos)
    tf.rotary(q2, k2, *tables, pos)
    assert torch.equal(qkv, qkv2)
    monkeypatch.setenv("PAGEDCTL_KERNELS", "reference")
    reference_out = kernels.silu_and_mul(x)
    assert torch.equal(reference_out, reference.silu_and_mul(x))
    assert not torch.equal(reference_out, triton_out)


# --- cross-compilation for Turing and Hopper (no GPU needed) ---------------------------------

SHAPES = [  # (hidden, intermediate, (heads, kv_heads), head_dim): Qwen2.5-0.5B, SmolLM2, Qwen3-8B
    (896, 4864, (14, 2), 64),
    (576, 1536, (9, 3), 64),
    (4096, 12288, (32, 8), 128),
]


def _pointers(names: str, dtype: str) -> dict[str, str]:
    return {name: f"*{dtype}" for name in names.split()}


def _launch(meta: dict[str, int]) -> tuple[dict[str, int], dict[str, int]]:
    """Split a `*_launch` dict into constexprs and launch options."""
    consts = dict(meta)
    return consts, {"num_warps": consts.pop("num_warps")}


@compiled
@pytest.mark.parametrize(("cc", "dtype"), [(75, "fp16"), (90, "fp16"), (90, "bf16")])
def test_fused_kernels_compile_for_sm75_and_sm90(cc: int, dtype: str) -> None:
    for hidden, inter, (heads, kv_heads), head_dim in SHAPES:
        consts, opts = _launch(tf.rms_norm_launch(hidden))
        consts.update(EPS=EPS, HAS_RESIDUAL=True)
        ptrs = _pointers("x_ptr w_ptr out_ptr res_ptr sum_ptr", dtype)
        kernel = _compile(tf._rms_norm, ptrs, consts, cc, opts)
        assert kernel.metadata.shared <= 64 * 1024
        consts, opts = _launch(tf.rms_norm_launch(head_dim, heads))  # per-head q norm
        consts.update(EPS=EPS, HAS_RESIDUAL=False, res_ptr=None, sum_ptr=None)
        _compile(tf._rms_norm, _pointers("x_ptr w_ptr out_ptr", dtype), consts, cc, opts)
        consts, opts = _launch(tf.rotary_launch(heads, kv_heads, head_dim))
        ptrs = {**_pointers("q_ptr k_ptr cos_ptr sin_ptr", dtype), "pos_ptr": "*i64"}
        _compile(tf._rotary, ptrs, consts, cc, opts)
        consts.update(BLOCK_SIZE=16, TRIGGER=cc >= 90)
        ptrs.update(_pointers("v_ptr k_cache_ptr v_cache_ptr", dtype), slot_ptr="*i64")
        _compile(tf._rotary_write_kv, ptrs, consts, cc, opts)
        consts, opts = _launch(tf.silu_and_mul_launch(inter))
        _compile(tf._silu_and_mul, _pointers("x_ptr out_ptr", dtype), consts, cc, opts)


@compiled
def test_launch_shapes_cover_sizes_with_masks() -> None:
    meta = tf.rms_norm_launch(896)
    assert (meta["BLOCK_H"], meta["BLOCK_R"], meta["num_warps"]) == (1024, 1, 4)
    assert tf.rms_norm_launch(8192)["num_warps"] == 8
    assert tf.rms_norm_launch(128, 16)["BLOCK_R"] == 8  # short rows share a program
    meta = tf.rotary_launch(40, 8, 128)
    assert (meta["HALF_PAD"], meta["Q_BLOCK_H"], meta["K_BLOCK_H"]) == (64, 16, 8)
    assert tf.rotary_launch(9, 3, 24)["HALF_PAD"] == 16
    assert tf.silu_and_mul_launch(4864)["BLOCK"] == tf.MAX_TILE


# --- penalties -------------------------------------------------------------------------------


def _penalty_case(vocab: int, device: str = "cpu") -> tuple:
    """Logits of 5 rows, 3 of them penalized (out of order) from pool rows of random counts and
    prompt masks, penalties of both signs and strengths."""
    gen = torch.Generator().manual_seed(7)
    logits = (torch.randn(5, vocab, generator=gen) * 4).to(device)
    counts = torch.randint(0, 4, (6, vocab), generator=gen, dtype=torch.int32)
    counts *= torch.rand(6, vocab, generator=gen) < 0.1  # most tokens never came
    prompt = torch.rand(6, vocab, generator=gen) < 0.05
    rows, pool = torch.tensor([4, 0, 2]), torch.tensor([5, 1, 3])
    rep, freq = torch.tensor([1.3, 0.7, 1.0]), torch.tensor([0.5, -1.0, 0.0])
    pres = torch.tensor([0.0, 1.5, -2.0])
    args = (rows, pool, counts, prompt, rep, freq, pres)
    return logits, tuple(a.to(device) for a in args)


@interp
@pytest.mark.parametrize("vocab", [300, 4099])
def test_interp_apply_penalties_matches_reference(vocab: int) -> None:
    """The Triton penalties on rows out of order, a ragged last block, rows left alone."""
    from pagedctl.kernels import triton_sample

    logits, args = _penalty_case(vocab)
    want = logits.clone()
    reference.apply_penalties(want, *args)
    got = logits.clone()
    triton_sample.apply_penalties(got, *args)
    assert torch.equal(got[[1, 3]], logits[[1, 3]]) and not torch.equal(want, logits)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@compiled
def test_reference_penalties_are_vllms_rule() -> None:
    """One row by hand: repetition on prompt or output tokens by sign, then the frequency and
    presence subtractions on output tokens only."""
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0, 1.0]])
    counts = torch.tensor([[0, 0, 3, 1, 0]], dtype=torch.int32)
    prompt = torch.tensor([[True, True, False, False, False]])
    one = torch.tensor([0])
    reference.apply_penalties(
        logits, one, one, counts, prompt, torch.tensor([2.0]), torch.tensor([0.5]),
        torch.tensor([0.25]),
    )  # fmt: skip
    assert logits[0].tolist() == [1.0, -4.0, 1.0 - 1.5 - 0.25, -4.0 - 0.5 - 0.25, 1.0]


# --- CUDA ------------------------------------------------------------------------------------


def gpu(test: object) -> object:
    """Mark a test `gpu` and skip it without a CUDA device."""
    needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
    return pytest.mark.gpu(needs_cuda(test))


def gpu_dtypes() -> list[torch.dtype]:
    """fp16 everywhere; bf16 where the GPU has it (compute capability >= 8)."""
    ok = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8
    return [torch.float16, torch.bfloat16] if ok else [torch.float16]


@gpu
@pytest.mark.parametrize("dtype", gpu_dtypes())
@pytest.mark.parametrize("tokens", [1, 7, 256, 4096])
def test_gpu_fused_ops_match_reference(tokens: int, dtype: torch.dtype) -> None:
    dev = "cuda"
    x, r = randn(2, tokens, 896, dtype=dtype, seed=tokens, device=dev)
    weight = 1 + randn(896, dtype=dtype, seed=1, device=dev) / 4
    check_rms_norm(tf.rms_norm(x, weight, EPS), reference.rms_norm(x, weight, EPS))
    got, summed = kernels.rms_norm(x, weight, EPS, r)
    want, want_sum = reference.rms_norm(x, weight, EPS, r)
    assert torch.equal(summed, want_sum)
    check_rms_norm(got, want)
    q, k, qkv = qkv_views(tokens, (14, 2), 64, dtype, seed=tokens, device=dev)
    cos, sin = rope_tables(64, 32768, dtype, device=dev)
    pos = torch.randint(0, 32768, (tokens,), device=dev)
    check_rotary(q, k, qkv, cos, sin, pos)
    check_silu(randn(tokens, 2 * 4864, dtype=dtype, seed=tokens, device=dev))
    for head_major in (False, True):
        check_rotary_write_kv(min(tokens, 80), (14, 2), 64, dtype, head_major, device=dev)


@gpu
@pytest.mark.parametrize("dtype", gpu_dtypes())
def test_gpu_large_rows_and_per_head_norm(dtype: torch.dtype) -> None:
    dev = "cuda"
    x = randn(64, 8192, dtype=dtype, seed=3, device=dev)
    weight = randn(8192, dtype=dtype, seed=4, device=dev)
    check_rms_norm(tf.rms_norm(x, weight, EPS), reference.rms_norm(x, weight, EPS))
    q, k, qkv = qkv_views(300, (32, 8), 128, dtype, seed=5, device=dev)
    head_weight = randn(128, dtype=dtype, seed=6, device=dev)
    for t in (q, k):
        check_rms_norm(tf.rms_norm(t, head_weight, EPS), reference.rms_norm(t, head_weight, EPS))
    cos, sin = rope_tables(128, 40960, dtype, device=dev)
    check_rotary(q, k, qkv, cos, sin, torch.randint(0, 40960, (300,), device=dev))


@gpu
def test_gpu_offsets_past_2_pow_31_elements() -> None:
    if torch.cuda.get_device_properties(0).total_memory < 40 * 2**30:
        pytest.skip("needs 40 GiB of GPU memory")
    dev, dtype, tail = "cuda", torch.float16, 1000
    x = torch.randn(2**31 // 8192 + 2000, 8192, device=dev).to(dtype)
    weight = torch.randn(8192, device=dev).to(dtype)
    check_rms_norm(tf.rms_norm(x, weight, EPS)[-tail:], reference.rms_norm(x[-tail:], weight, EPS))
    del x
    x = torch.randn(2**31 // 9728 + 2000, 9728, device=dev).to(dtype)
    assert torch.equal(tf.silu_and_mul(x)[-tail:], tf.silu_and_mul(x[-tail:].clone()))
    del x
    q, k, qkv = qkv_views(2**31 // 6144 + 2000, (32, 8), 128, dtype, seed=0, device=dev)
    assert qkv.numel() > 2**31
    cos, sin = rope_tables(128, 4096, dtype, device=dev)
    pos = torch.randint(0, 4096, (len(q),), device=dev)
    q_tail, k_tail = q[-tail:].clone(), k[-tail:].clone()
    tf.rotary(q, k, cos, sin, pos)
    tf.rotary(q_tail, k_tail, cos, sin, pos[-tail:])
    assert torch.equal(q[-tail:], q_tail) and torch.equal(k[-tail:], k_tail)


@gpu
def test_gpu_cuda_graph_capture_and_replay() -> None:
    dev, dtype, tokens = "cuda", gpu_dtypes()[-1], 256
    x, r = torch.zeros(2, tokens, 896, dtype=dtype, device=dev)
    weight = 1 + randn(896, dtype=dtype, seed=1, device=dev) / 4
    gate_up = torch.zeros(tokens, 2 * 4864, dtype=dtype, device=dev)
    q, k, qkv = qkv_views(tokens, (14, 2), 64, dtype, seed=0, device=dev)
    cos, sin = rope_tables(64, 4096, dtype, device=dev)
    pos = torch.zeros(tokens, dtype=torch.int64, device=dev)

    def step() -> tuple[Tensor, Tensor, Tensor]:
        normed, summed = kernels.rms_norm(x, weight, EPS, r)
        kernels.rotary(q, k, cos, sin, pos)
        return normed, summed, kernels.silu_and_mul(gate_up)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for trial in range(3):
        for buf in (x, r, gate_up, qkv):
            buf.copy_(randn(*buf.shape, dtype=dtype, seed=trial, device=dev))
        pos.copy_(torch.randint(0, 4096, (tokens,), device=dev))
        qkv_in = qkv.clone()
        graph.replay()
        torch.cuda.synchronize()
        want_norm, want_sum = tf.rms_norm(x, weight, EPS, r)
        assert torch.equal(outs[0], want_norm) and torch.equal(outs[1], want_sum)
        assert torch.equal(outs[2], tf.silu_and_mul(gate_up))
        q_in = qkv_in[:, : q.shape[1] * 64].view(q.shape)
        k_in = qkv_in[:, q.shape[1] * 64 : (q.shape[1] + k.shape[1]) * 64].view(k.shape)
        tf.rotary(q_in, k_in, cos, sin, pos)
        assert torch.equal(qkv, qkv_in)
        check_rms_norm(outs[0], reference.rms_norm(x, weight, EPS, r)[0])


@gpu
def test_gpu_apply_penalties_matches_reference() -> None:
    logits, args = _penalty_case(151_936, "cuda")
    want = logits.clone()
    reference.apply_penalties(want, *args)
    kernels.apply_penalties(logits, *args)
    torch.testing.assert_close(logits, want, rtol=1e-6, atol=1e-6)

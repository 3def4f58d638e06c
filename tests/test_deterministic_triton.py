"""`deterministic` on the Triton kernels: the batch-invariant matmul and attention under the CPU
interpreter (a row alone, in any batch, in any prefill chunk or as a decode row: the same bits),
the whole engine on them with emulated step graphs, and cross-compilation of the invariant
configs for sm_75/sm_80/sm_90.

The interpreter has no bfloat16 `tl.dot`, so its cases run float16 and float32; the GPU grid
(tests/test_deterministic_gpu.py) runs bfloat16 at real sizes.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from tests.interp_suite import row_independent_dot
from tests.test_kernels_reference import naive_attention
from tests.test_kernels_triton import (
    INTERPRETED,
    TARGETS,
    _attention_pointers,
    _compile,
    compiled,
    interp,
    run_interpreter_suite,
)

triton = pytest.importorskip("triton")

from pagedctl.kernels import PagedBatch, configs  # noqa: E402
from pagedctl.kernels import triton_attention as ta  # noqa: E402
from pagedctl.kernels import triton_matmul as tm  # noqa: E402


@compiled
def test_interpreter_suite() -> None:
    run_interpreter_suite(__file__)


@pytest.fixture(autouse=True)
def _row_independent_dot(monkeypatch):
    """Under the interpreter, each row of a `tl.dot` alone (`interp_suite.row_independent_dot`)."""
    if INTERPRETED:
        row_independent_dot(monkeypatch)


@interp
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("in_features", [150, 128])  # a ragged last step, whole steps
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_interp_a_matmul_row_has_the_same_bits_in_any_batch(dtype, in_features, bias):
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(200, in_features, generator=gen).to(dtype)
    b = torch.randn(200, generator=gen).to(dtype) if bias else None
    x = torch.randn(70, in_features, generator=gen).to(dtype)
    whole = tm.linear(x, weight, b)
    want = F.linear(x.double(), weight.double(), None if b is None else b.double())
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(whole.double(), want, atol=tol, rtol=tol)
    for rows in [(0, 1), (5, 6), (69, 70), (30, 65), (0, 33)]:  # alone, tile-crossing slices
        assert torch.equal(tm.linear(x[slice(*rows)], weight, b), whole[slice(*rows)]), rows
    assert tm.linear(x[:0], weight, b).shape == (0, 200)


def _sequences(dtype: torch.dtype, heads: tuple[int, int]):
    """Three sequences of 150 query rows on shuffled 16-token blocks, and a runner of the
    batch-invariant kernel over any of their (query rows, length) slices."""
    gen = torch.Generator().manual_seed(1)
    num_heads, kv_heads = heads
    k_cache = torch.randn(64, 16, kv_heads, 64, generator=gen).to(dtype)
    v_cache = torch.randn(64, 16, kv_heads, 64, generator=gen).to(dtype)
    tables = torch.randperm(64, generator=gen)[:36].view(3, 12).int()
    q = torch.randn(3, 150, num_heads, 64, generator=gen).to(dtype)

    def run(parts: list[tuple[int, int, int]], splits: int | None = None):
        """`(sequence, first row, last row + 1)` parts, each over keys up to its last row."""
        qs = torch.cat([q[s, a:b] for s, a, b in parts])
        q_lens = [b - a for _, a, b in parts]
        cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        lens = torch.tensor([b for _, _, b in parts], dtype=torch.int32)
        table = tables[[s for s, _, _ in parts]]
        batch = PagedBatch(table, lens, cu, max(q_lens), int(lens.max()))
        return ta.paged_attention(
            qs, k_cache, v_cache, batch, 0.125, num_splits=splits, batch_invariant=True
        )

    return q, k_cache, v_cache, tables, run


@interp
@pytest.mark.parametrize("heads", [(14, 2), (8, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_interp_an_attention_row_has_the_same_bits_alone_chunked_or_decoded(dtype, heads):
    q, k_cache, v_cache, tables, run = _sequences(dtype, heads)
    whole = run([(0, 0, 100)])  # a 100-token prefill alone
    pos = torch.arange(100)
    ks = [k_cache[tables[0][pos // 16].long(), pos % 16]]
    vs = [v_cache[tables[0][pos // 16].long(), pos % 16]]
    tol = 2e-5 if dtype == torch.float32 else 4e-3
    want = naive_attention(q[0, :100], ks, vs, [100])
    torch.testing.assert_close(whole.double(), want, atol=tol, rtol=tol)
    # the same rows as a chunk beside another sequence's prefill, and in other chunkings
    assert torch.equal(run([(1, 0, 30), (0, 40, 100)])[30:], whole[40:])
    assert torch.equal(run([(0, 64, 77), (2, 0, 5), (0, 0, 3)])[:13], whole[64:77])
    for p in (0, 63, 64, 99):  # a decode row alone, and among decode rows with a split hint
        alone = run([(0, p, p + 1)])
        assert torch.equal(alone, whole[p : p + 1]), p
        crowd = run([(1, 120, 121), (0, p, p + 1), (2, 6, 7)], splits=4)
        assert torch.equal(crowd[1:2], alone), p


@interp
def test_interp_the_engine_on_the_triton_kernels_answers_alike(tmp_path, monkeypatch):
    """A random-weight Llama in float16 on the kernels' path (emulated step graphs, whose
    padding rows and split hints real graphs have): probes alone, then in a mixed batch whose
    steps read a prefix a decoy cached, with prefill chunks of 16 tokens, and under preemption
    in a pool of 4-token blocks. Steps of at most 64 tokens keep the interpreter's graphs small."""
    from pagedctl.engine import LLM, SamplingParams
    from tests.tiny_models import save_llama

    monkeypatch.setenv("PAGEDCTL_KERNELS", "triton")
    save_llama(
        tmp_path, vocab_size=512, hidden_size=128, intermediate_size=320, num_attention_heads=8
    )
    rng = random.Random(1)
    prefix = list(range(100, 132))
    probes = [[rng.randrange(3, 512) for _ in range(n)] for n in (1, 21)] + [prefix + [5, 6]]
    crowd = [[rng.randrange(3, 512) for _ in range(rng.randrange(2, 60))] for _ in range(7)]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    sp = [greedy, SamplingParams(max_tokens=8, temperature=0.9, seed=5, ignore_eos=True), greedy]

    def engine(**settings) -> LLM:
        base = dict(device="cpu", dtype="float16", block_size=16, cuda_graphs="emulate")
        base |= dict(max_num_batched_tokens=64, deterministic=True)
        return LLM(str(tmp_path), **{**base, **settings})

    def tokens(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]):
        outs = llm.generate(prompts, params)
        assert all(o.error is None for o in outs), [o.error for o in outs]
        return [list(o.outputs[0].token_ids) for o in outs]

    llm = engine(enable_prefix_caching=False)  # each probe by itself, nothing cached
    assert not llm.runner._kv.is_contiguous()  # the kernels' head-major cache: their path
    want = [tokens(llm, [p], [s])[0] for p, s in zip(probes, sp, strict=True)]
    mixed, sp_mixed = crowd[:4] + probes + crowd[4:], [greedy] * 4 + sp + [greedy] * 3
    llm = engine()
    tokens(llm, [prefix + [9, 9]], [greedy])
    assert tokens(llm, mixed, sp_mixed)[4:7] == want, "in a mixed batch, the prefix cached"
    assert llm.stats["prefix_cache"]["hits"] > 0
    assert tokens(engine(max_num_batched_tokens=16), mixed, sp_mixed)[4:7] == want, "chunks"
    llm = engine(block_size=4, num_gpu_blocks_override=24, max_num_seqs=8)
    assert tokens(llm, mixed, sp_mixed)[4:7] == want, "under preemption"
    assert llm.stats["scheduler"]["num_preemptions"] > 0


# --- no interpreter: shapes and cross-compilation ------------------------------------------


@compiled
@pytest.mark.parametrize("fam", ["sm75", "sm80", "sm90"])
def test_decode_and_prefill_run_one_tile_shape(fam: str) -> None:
    capability = (TARGETS[fam] // 10, TARGETS[fam] % 10)
    for head_dim in (64, 128, 256):
        cfg = configs.lookup_invariant(capability, head_dim)
        for group in (1, 2, 3, 4, 7, 8, 16):
            decode = ta.tile_shape(group, True, cfg, batch_invariant=True)
            prefill = ta.tile_shape(group, False, cfg, batch_invariant=True)
            assert decode == (1, prefill[1]), (group, decode, prefill)


@compiled
def test_narrow_weights_take_narrower_column_tiles() -> None:
    cfg = configs.MATMUL_CONFIGS["sm90"]
    assert configs.matmul_block_n(cfg, 151936, 132) == cfg.block_n
    assert configs.matmul_block_n(cfg, 9728, 132) == cfg.block_n  # 76 tiles >= 66
    assert configs.matmul_block_n(cfg, 896, 132) == cfg.min_block_n  # never narrower
    assert configs.matmul_block_n(cfg, 1152, 132) == 32
    assert configs.matmul_block_n(cfg, 4096, 16) == 128  # a small GPU keeps the widest tiles


def _matmul_pointers(dtype: str) -> dict[str, str]:
    return {name: f"*{dtype}" for name in ("x_ptr", "w_ptr", "b_ptr", "out_ptr")}


@compiled
@pytest.mark.parametrize("fam", ["sm75", "sm80", "sm90"])
def test_the_invariant_kernels_compile_for_their_architecture(fam: str) -> None:
    cc = TARGETS[fam]
    cfg = configs.MATMUL_CONFIGS[fam]
    dtypes = ["fp16", "fp32"] if fam == "sm75" else ["fp16", "bf16", "fp32"]
    for dtype in dtypes:
        for n, k in [(896, 4864), (1000, 900)]:  # whole and ragged reduction steps
            prec = "ieee" if dtype == "fp32" else "tf32"
            consts = dict(N=n, K=k, HAS_BIAS=n == 1000, DOT_PREC=prec)
            consts.update(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k)
            launch = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
            kernel = _compile(tm._matmul, _matmul_pointers(dtype), consts, cc, launch)
            if fam == "sm75":
                assert kernel.metadata.shared <= configs.SM75_SHARED_LIMIT
    ptx = {}
    for decode in (True, False):
        att = configs.lookup_invariant((cc // 10, cc % 10), 64)
        block_q, block_m = ta.tile_shape(7, decode, att, batch_invariant=True)
        consts = dict(GROUP=7, HEAD_DIM=64, D_PAD=64, BLOCK_SIZE=16, BLOCK_Q=block_q)
        consts.update(BLOCK_M=block_m, TILE_N=att.tile_n, NUM_SPLITS=1, ONE_QBLOCK=decode)
        consts.update(DOT_PREC="tf32", FUSED_COMBINE=False, PDL=False, COLUMN_SUMS=False)
        # as `paged_attention` launches batch-invariant calls: no multiply-add contraction
        launch = {"num_warps": att.num_warps, "num_stages": att.num_stages}
        launch["enable_fp_fusion"] = False
        dtype = "fp16" if fam == "sm75" else "bf16"
        kernel = _compile(ta._attn_fwd, _attention_pointers(dtype), consts, cc, launch)
        ptx[decode] = kernel.asm["ptx"]
        if fam == "sm75":
            assert kernel.metadata.shared <= configs.SM75_SHARED_LIMIT
    # decode and prefill rows go through the same matrix instructions (Hopper's warp-group MMA
    # takes 64-row tiles, the shape both phases run)
    for op in ("wgmma.mma_async", "mma.sync"):
        assert (op in ptx[True]) == (op in ptx[False]), op
    assert fam != "sm90" or "wgmma.mma_async" in ptx[True]
    # and outside the matrix instructions, no fused multiply-add in either phase (Turing's
    # dots are themselves multiply-adds, the same in both)
    assert fam == "sm75" or not any("fma.rn.f32" in p for p in ptx.values())

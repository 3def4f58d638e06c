"""`deterministic` on a CUDA device at real sizes: the batch-invariant matmul and attention with
Qwen2.5-0.5B's shapes in bfloat16 and float16, then the engine grid of tests/test_deterministic.py
on the Qwen2.5-0.5B preset (dummy weights: nearly flat logits, so one changed bit flips a token)
with CUDA graphs, multi-step decode, swap and a job killed and resumed. Marked `gpu`; skipped
without CUDA.
"""

from __future__ import annotations

import gc
import random

import pytest
import torch
import torch.nn.functional as F

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PRESET = "qwen2.5-0.5b-instruct"
HEADS, KV_HEADS, HEAD_DIM = 14, 2, 64


def dtypes() -> list[torch.dtype]:
    """fp16 everywhere; bf16 where the GPU has it in hardware (compute capability >= 8)."""
    ok = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8
    return [torch.bfloat16, torch.float16] if ok else [torch.float16]


SHAPES = [(1152, 896), (896, 896), (9728, 896), (896, 4864), (151936, 896)]  # Qwen2.5-0.5B's


@pytest.mark.parametrize("dtype", dtypes())
@pytest.mark.parametrize("shape", SHAPES)
def test_a_matmul_row_has_the_same_bits_in_any_batch(dtype, shape):
    from pagedctl.kernels import triton_matmul as tm

    gen = torch.Generator(device="cuda").manual_seed(0)
    n, k = shape
    weight = (torch.randn(n, k, generator=gen, device="cuda") / k**0.5).to(dtype)
    x = torch.randn(600, k, generator=gen, device="cuda").to(dtype)
    whole = tm.linear(x, weight)
    want = F.linear(x.float(), weight.float())
    torch.testing.assert_close(whole.float(), want, atol=3e-2, rtol=3e-2)
    for rows in (1, 2, 3, 7, 16, 63, 64, 65, 127, 256, 511):
        assert torch.equal(tm.linear(x[:rows], weight), whole[:rows]), rows
    for i in (0, 5, 64, 599):
        assert torch.equal(tm.linear(x[i : i + 1], weight), whole[i : i + 1]), i
    assert torch.equal(tm.linear(x[300:], weight), whole[300:])


@pytest.mark.parametrize("dtype", dtypes())
def test_an_attention_row_has_the_same_bits_in_any_batch(dtype):
    """A 3,000-token sequence prefilled whole, in chunks of 512 and 777 beside other sequences'
    chunks, and decoded row by row alone and among 63 long decode rows (with split hints that
    the ordinary kernel would take)."""
    from pagedctl.kernels import PagedBatch
    from pagedctl.kernels import triton_attention as ta

    gen = torch.Generator(device="cuda").manual_seed(1)
    rng = random.Random(2)
    block, blocks_per_seq, seqs = 16, 256, 64
    pool = seqs * blocks_per_seq
    k_cache = torch.randn(pool, block, KV_HEADS, HEAD_DIM, generator=gen, device="cuda").to(dtype)
    v_cache = torch.randn(pool, block, KV_HEADS, HEAD_DIM, generator=gen, device="cuda").to(dtype)
    perm = torch.randperm(pool, generator=gen, device="cuda").int()
    tables = perm.view(seqs, blocks_per_seq)
    q = torch.randn(seqs, 3000, HEADS, HEAD_DIM, generator=gen, device="cuda").to(dtype)
    lengths = [3000] + [rng.randrange(1, 4000) for _ in range(seqs - 1)]

    def run(parts, splits=None):
        """`(sequence, first row, last row + 1)` parts, each over keys up to its last row."""
        qs = torch.cat([q[s, a % 3000 : a % 3000 + (b - a)] for s, a, b in parts])
        q_lens = [b - a for _, a, b in parts]
        cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        lens = torch.tensor([b for _, _, b in parts], dtype=torch.int32)
        table = tables[[s for s, _, _ in parts]]
        batch = PagedBatch(table, lens.cuda(), cu.cuda(), max(q_lens), int(lens.max()))
        return ta.paged_attention(
            qs, k_cache, v_cache, batch, HEAD_DIM**-0.5, num_splits=splits, batch_invariant=True
        )

    whole = run([(0, 0, 3000)])
    prefill = PagedBatch(
        tables[:1], torch.tensor([3000], dtype=torch.int32).cuda(),
        torch.tensor([0, 3000], dtype=torch.int32).cuda(), 3000, 3000,
    )  # fmt: skip
    ordinary = ta.paged_attention(q[0], k_cache, v_cache, prefill, HEAD_DIM**-0.5)
    torch.testing.assert_close(whole.float(), ordinary.float(), atol=2e-2, rtol=2e-2)
    for chunk in (512, 777):
        for start in range(0, 3000, chunk):
            end = min(start + chunk, 3000)
            beside = [(s, 0, min(chunk, lengths[s])) for s in (3, 9)]
            got = run([beside[0], (0, start, end), beside[1]])
            first = beside[0][2]
            assert torch.equal(got[first : first + end - start], whole[start:end]), (chunk, start)
    decodes = [(s, n - 1, n) for s, n in enumerate(lengths)]
    for pos in (0, 15, 16, 1000, 2999):
        alone = run([(0, pos, pos + 1)])
        assert torch.equal(alone, whole[pos : pos + 1]), pos
        crowd = [decodes[s] for s in range(1, seqs)]
        crowd.insert(17, (0, pos, pos + 1))
        for splits in (None, 8):
            assert torch.equal(run(crowd, splits)[17:18], alone), (pos, splits)


# --------------------------------------------------------------- the engine at real sizes


def _probes() -> list[list[int]]:
    rng = random.Random(1)
    prefix = list(range(1000, 1064))
    own = [[rng.randrange(3, 150000) for _ in range(n)] for n in (1, 7, 33, 90, 700)]
    return own + [prefix + [5, 6, 7], prefix + [rng.randrange(3, 150000) for _ in range(40)]]


def _crowd(n: int = 57) -> list[list[int]]:
    rng = random.Random(2)
    return [[rng.randrange(3, 150000) for _ in range(rng.randrange(2, 900))] for _ in range(n)]


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_engine_answers_a_request_alike_whatever_ran_beside_it(dtype, seeded):
    from pagedctl.engine import LLM, SamplingParams

    def params(n: int, first: int = 0) -> list[SamplingParams]:
        if not seeded:
            return [SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)] * n
        return [
            SamplingParams(max_tokens=32, temperature=0.9, seed=first + i, ignore_eos=True)
            for i in range(n)
        ]

    def engine(**settings) -> LLM:
        base = dict(device="cuda", dtype=dtype, deterministic=True, kv_cache_memory="4GiB")
        return LLM(PRESET, **{**base, **settings})

    def tokens(llm, prompts, sp):
        outs = llm.generate(prompts, sp)
        assert all(o.error is None for o in outs), [o.error for o in outs]
        return [list(o.outputs[0].token_ids) for o in outs]

    probes, crowd = _probes(), _crowd()
    n = len(probes)
    llm = engine(enable_prefix_caching=False)
    want = [tokens(llm, [p], [s])[0] for p, s in zip(probes, params(n), strict=True)]
    mixed = crowd[:30] + probes + crowd[30:]
    sp_mixed = params(len(crowd), first=1000)
    sp_mixed = sp_mixed[:30] + params(n) + sp_mixed[30:]
    runs = {
        "graphs, a batch of 64": {},
        "eager": {"cuda_graphs": False},
        "multi-step decode": {"num_scheduler_steps": 8},
        "prefill chunks of 40": {"max_num_batched_tokens": 40},
        "prefill chunks of 512": {"max_num_batched_tokens": 512},
        "preempted, recomputed": {"num_gpu_blocks_override": 160, "max_num_seqs": 32},
        "preempted, swapped": {
            "num_gpu_blocks_override": 160, "max_num_seqs": 32, "preemption_mode": "swap",
        },
    }  # fmt: skip
    for name, settings in runs.items():
        del llm  # one engine's pool at a time
        gc.collect()
        llm = engine(**settings)
        assert tokens(llm, mixed, sp_mixed)[30 : 30 + n] == want, name
        if name.startswith("preempted"):
            assert llm.stats["scheduler"]["num_preemptions"] > 0, name
        if name == "graphs, a batch of 64":  # a second pass reads every prompt from the cache
            assert tokens(llm, mixed, sp_mixed)[30 : 30 + n] == want, "from the prefix cache"
            assert llm.stats["prefix_cache"]["hits"] >= n


def test_a_job_killed_and_resumed_on_the_gpu_answers_as_one_run_alone(tmp_path):
    from tests.job_utils import answer_tokens, kill_midway, run, write_jsonl

    lines = []
    for i, p in enumerate(_probes() + _crowd(120)):
        body = {"prompt_token_ids": p, "max_tokens": 48, "ignore_eos": True, "logprobs": True}
        body |= {"temperature": 0.9, "seed": i} if i % 2 else {"temperature": 0.0}
        lines.append({"custom_id": f"r{i:03d}", **body})
    common = ["--model", PRESET, "--device", "cuda", "--dtype", "bfloat16", "--deterministic"]
    common += ["--kv-cache-memory", "4GiB", "-q"]
    r = run(write_jsonl(tmp_path / "ref.jsonl", lines), *common, "--max-num-seqs", "4")
    assert r.returncode == 0, r.stderr
    want = answer_tokens(tmp_path / "ref.out.jsonl")
    src = write_jsonl(tmp_path / "in.jsonl", lines)
    seen = kill_midway(src, 16, *common, "--max-num-seqs", "64", timeout=300)
    assert 16 <= seen < len(want), seen
    r = run(src, *common, "--max-num-seqs", "64")
    assert r.returncode == 0, r.stderr
    assert answer_tokens(tmp_path / "in.out.jsonl") == want

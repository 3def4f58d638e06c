"""`deterministic`: a request's tokens depend on the request alone, in 16-bit dtypes on the CPU.

A random-weight Llama (real safetensors, loaded in bfloat16 or float16) has nearly flat logits, so
its greedy and sampled tokens flip at the smallest change of a logit's bits: the strictest probe
there is. Each probe prompt is run alone in a fresh engine first; then the same prompts must give
the same tokens in a batch of 64 mixed ones, after another request cached their prefix, with
chunked prefill at two budgets, under forced preemption, with one thread instead of two, and in a
`pagedctl generate` job killed by SIGKILL and resumed. Greedy and seeded sampling each.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from pagedctl.engine import LLM, ConfigError, SamplingParams
from pagedctl.kernels import PagedBatch
from tests.job_utils import answer_tokens, kill_midway, run, write_jsonl
from tests.tiny_models import save_llama

PREFIX = list(range(100, 164))  # 64 tokens (4 blocks) the probes share with a decoy
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """Four layers, 8 query heads on 2 KV heads of 32, a 768-wide MLP: every op of a real model."""
    sizes = dict(vocab_size=1024, hidden_size=256, intermediate_size=768, num_hidden_layers=4)
    sizes |= dict(num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024)
    return save_llama(tmp_path_factory.mktemp("det") / "llama", **sizes)


def probes() -> list[list[int]]:
    rng = random.Random(1)
    own = [[rng.randrange(3, 1024) for _ in range(n)] for n in (1, 7, 33, 90)]
    return own + [PREFIX + [5, 6, 7], PREFIX + [rng.randrange(3, 1024) for _ in range(40)]]


def crowd(n: int = 58) -> list[list[int]]:
    rng = random.Random(2)
    return [[rng.randrange(3, 1024) for _ in range(rng.randrange(2, 160))] for _ in range(n)]


def params(seeded: bool, n: int, first_seed: int = 0) -> list[SamplingParams]:
    if not seeded:
        return [SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)] * n
    return [
        SamplingParams(max_tokens=NEW_TOKENS, temperature=0.9, seed=first_seed + i, ignore_eos=True)
        for i in range(n)
    ]


def engine(model: Path, dtype: str, **settings) -> LLM:
    base = {"device": "cpu", "dtype": dtype, "block_size": 16, "deterministic": True}
    return LLM(str(model), **{**base, **settings})


def tokens(llm: LLM, prompts: list[list[int]], sp: list[SamplingParams]) -> list[list[int]]:
    outs = llm.generate(prompts, sp)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return [list(o.outputs[0].token_ids) for o in outs]


def alone(model: Path, dtype: str, seeded: bool) -> list[list[int]]:
    """Each probe by itself, each in an engine of its own (nothing cached, nothing beside it)."""
    sp = params(seeded, len(probes()))
    return [tokens(engine(model, dtype), [p], [s])[0] for p, s in zip(probes(), sp, strict=True)]


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_request_gets_the_same_tokens_whatever_ran_beside_it(model, dtype, seeded):
    want = alone(model, dtype, seeded)
    n = len(want)
    sp = params(seeded, n)
    others = crowd()
    mixed = others[:30] + probes() + others[30:]
    sp_mixed = params(seeded, len(others), first_seed=1000)
    sp_mixed = sp_mixed[:30] + sp + sp_mixed[30:]

    llm = engine(model, dtype)
    got = tokens(llm, mixed, sp_mixed)[30 : 30 + n]
    assert got == want, "in a batch of 64"

    llm = engine(model, dtype)  # a decoy computes the shared prefix first
    tokens(llm, [PREFIX + [9, 9]], params(seeded, 1, first_seed=77))
    assert tokens(llm, probes(), sp) == want, "after another request cached the prefix"
    assert llm.stats["prefix_cache"]["hits"] > 0

    for budget in (16, 40):
        llm = engine(model, dtype, max_num_batched_tokens=budget)
        assert tokens(llm, mixed, sp_mixed)[30 : 30 + n] == want, f"prefill chunks of {budget}"

    llm = engine(model, dtype, num_gpu_blocks_override=24, max_num_seqs=16)
    assert tokens(llm, mixed, sp_mixed)[30 : 30 + n] == want, "under preemption"
    assert llm.stats["scheduler"]["num_preemptions"] > 0


def test_the_thread_count_does_not_change_the_tokens(model):
    want = alone(model, "bfloat16", seeded=False)
    before = torch.get_num_threads()
    try:
        llm = engine(model, "bfloat16", num_threads=1)
        got = tokens(llm, probes() + crowd(10), params(False, 16))[: len(want)]
    finally:
        torch.set_num_threads(before)
    assert got == want


def test_without_the_setting_the_projections_are_not_tiled(model):
    llm = engine(model, "bfloat16", deterministic=False)
    assert not any(getattr(m, "batch_invariant", False) for m in llm.model.modules())
    llm.reconfigure(deterministic=True)
    assert all(m.batch_invariant for m in llm.model.modules() if hasattr(m, "batch_invariant"))


REFUSED = "deterministic: PAGEDCTL_KERNELS=reference forces PyTorch's ops"


def test_cuda_with_the_reference_ops_refuses_it_before_loading_anything(model, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on a GPU machine
    monkeypatch.setenv("PAGEDCTL_KERNELS", "reference")
    with pytest.raises(ConfigError, match=REFUSED):
        LLM(str(model / "missing"), device="cuda", deterministic=True)


def test_a_scaled_out_job_is_refused_where_its_replicas_would_run(model, monkeypatch):
    pytest.importorskip("ray")
    from pagedctl.engine.scale_out.ray_replica import (
        describe,  # the probe task a pool runs on a replica
    )

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("PAGEDCTL_KERNELS", "reference")
    with pytest.raises(ConfigError, match=REFUSED):
        describe({"model": str(model / "missing"), "device": "cuda", "deterministic": True})


def _job_lines() -> list[dict]:
    lines = []
    for i, p in enumerate(probes() + crowd(42)):
        body = {
            "prompt_token_ids": p,
            "max_tokens": NEW_TOKENS,
            "ignore_eos": True,
            "logprobs": True,
        }  # fmt: skip  (no tokenizer: the tokens show as ids there)
        if i % 2:
            body |= {"temperature": 0.9, "seed": i}
        else:
            body |= {"temperature": 0.0}
        lines.append({"custom_id": f"r{i:02d}", **body})
    return lines


def test_a_job_killed_and_resumed_answers_as_one_run_alone(model, tmp_path):
    common = ["--model", model, "--device", "cpu", "--dtype", "bfloat16", "--deterministic", "-q"]
    ref_src = write_jsonl(tmp_path / "ref.jsonl", _job_lines())
    r = run(ref_src, *common, "--max-num-seqs", "3")
    assert r.returncode == 0, r.stderr
    want = answer_tokens(tmp_path / "ref.out.jsonl")

    src = write_jsonl(tmp_path / "in.jsonl", _job_lines())
    seen = kill_midway(src, 8, *common, "--max-num-seqs", "32")
    assert 8 <= seen < len(want), seen
    plain = [a for a in common if a != "--deterministic"]
    r = run(src, *plain, "--max-num-seqs", "32")  # the rest would lose the promise: refused
    assert r.returncode == 64 and "deterministic: recorded true, now (absent)" in r.stderr, r.stderr
    r = run(src, *common, "--max-num-seqs", "32")
    assert r.returncode == 0, r.stderr
    assert answer_tokens(tmp_path / "in.out.jsonl") == want


def test_the_bundled_model_answers_chat_prompts_alike_in_bfloat16():
    """The bundled SmolLM2 with its tokenizer: the chat prompts twice (the second pass reads
    every prompt's prefix from the cache) and a few alone, the same tokens each time."""
    import json

    from pagedctl import bundled_model

    lines = (Path(__file__).parents[1] / "recipes/data/chat-cpu.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    llm = LLM(str(bundled_model()), device="cpu", dtype="bfloat16", deterministic=True)
    chats = [r["messages"] for r in rows]
    sp = SamplingParams(max_tokens=32, temperature=0.0)
    first = [o.outputs[0].token_ids for o in llm.chat(chats, sp)]
    second = [o.outputs[0].token_ids for o in llm.chat(chats, sp)]
    assert llm.stats["prefix_cache"]["hits"] >= len(chats)
    assert second == first
    for i in (0, 7, 19):
        assert llm.chat([chats[i]], sp)[0].outputs[0].token_ids == first[i]


# ------------------------------------------------------------------------- the ops themselves


def _paged_case(seed: int = 0):
    """A prefill chunk (rows 40:100 of a 100-token sequence), two decode rows and a decode
    graph's padding row, over a shuffled pool of 16-token blocks, in bfloat16."""
    gen = torch.Generator().manual_seed(seed)
    blocks, heads, kv_heads, dim = 64, 6, 2, 32
    k_cache = torch.randn(blocks, 16, kv_heads, dim, generator=gen).bfloat16()
    v_cache = torch.randn(blocks, 16, kv_heads, dim, generator=gen).bfloat16()
    tables = torch.randperm(blocks, generator=gen)[:40].view(4, 10).int()
    seq_lens = torch.tensor([100, 300 // 2, 17, 0], dtype=torch.int32)
    cu = torch.tensor([0, 60, 61, 62, 63], dtype=torch.int32)
    q = torch.randn(63, heads, dim, generator=gen).bfloat16()
    return q, k_cache, v_cache, PagedBatch(tables, seq_lens, cu, 60, 150)


def test_the_attention_op_is_close_to_the_reference_and_tiles_alike_wide_or_not(monkeypatch):
    from pagedctl.kernels import batch_invariant, reference

    q, k, v, batch = _paged_case()
    scale = q.shape[-1] ** -0.5
    want = reference.paged_attention(q, k, v, batch, scale)
    wide = batch_invariant.paged_attention(q, k, v, batch, scale)
    torch.testing.assert_close(wide, want, atol=2e-2, rtol=2e-2)
    assert torch.equal(wide[62], torch.zeros_like(wide[62]))  # the padding row attends to nothing
    monkeypatch.setitem(batch_invariant._WIDE, q.shape[-1], False)
    assert torch.equal(batch_invariant.paged_attention(q, k, v, batch, scale), wide)


def test_a_row_of_the_attention_op_has_the_same_bits_alone():
    from pagedctl.kernels import batch_invariant

    q, k, v, batch = _paged_case()
    tables, lens = batch.block_tables, batch.seq_lens
    scale = q.shape[-1] ** -0.5
    both = batch_invariant.paged_attention(q, k, v, batch, scale)
    one = torch.tensor([0, 1], dtype=torch.int32)  # the 150-key decode row by itself
    alone_batch = PagedBatch(tables[1:2], lens[1:2], one, 1, 150)
    alone = batch_invariant.paged_attention(q[60:61], k, v, alone_batch, scale)
    assert torch.equal(alone, both[60:61])
    last = torch.tensor([0, 1], dtype=torch.int32)  # the chunk's last row as a decode row
    last_batch = PagedBatch(tables[:1], lens[:1], last, 1, 100)
    as_decode = batch_invariant.paged_attention(q[59:60], k, v, last_batch, scale)
    assert torch.equal(as_decode, both[59:60])


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_swiglu_row_has_the_same_bits_in_any_batch(dtype, threads):
    """Widths off the vector width (37, 300, 1000) and past one `silu` piece (20000)."""
    from pagedctl.kernels import reference, silu_and_mul

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for width in (37, 300, 1000, 1536, 20000):
            gen = torch.Generator().manual_seed(width)
            x = torch.randn(300, 2 * width, generator=gen).to(dtype)
            whole = silu_and_mul(x, batch_invariant=True)
            torch.testing.assert_close(whole, reference.silu_and_mul(x), atol=1e-6, rtol=1e-6)
            for rows in (1, 2, 3, 17, 33, 129):
                got = silu_and_mul(x[:rows].clone(), batch_invariant=True)
                assert torch.equal(got, whole[:rows]), (width, rows)
            for i in (0, 7, 150, 299):
                got = silu_and_mul(x[i : i + 1].clone(), batch_invariant=True)
                assert torch.equal(got, whole[i : i + 1]), (width, i)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_projection_row_has_the_same_bits_in_any_batch(dtype):
    from pagedctl.kernels import invariant_linear, pack_linear_weight

    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(1536, 576, generator=gen).to(dtype)
    x = torch.randn(300, 576, generator=gen).to(dtype)
    packed = pack_linear_weight(weight)
    alone = torch.cat([invariant_linear(x[i : i + 1], weight, packed) for i in range(40)])
    for rows in (2, 33, 64, 300):
        got = invariant_linear(x[:rows], weight, packed)
        assert torch.equal(got[:40], alone[: min(rows, 40)]), rows
    torch.testing.assert_close(got, torch.nn.functional.linear(x, weight), atol=0.5, rtol=2e-2)

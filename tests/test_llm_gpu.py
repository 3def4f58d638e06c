"""engine.LLM on a CUDA device (skipped without CUDA)."""

import dataclasses
import random

import pytest
import torch

from pagedctl.engine import SamplingParams
from pagedctl.engine.llm import LLM
from tests.tiny_models import save_tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@torch.no_grad()
@pytest.mark.parametrize("arch", ["qwen2", "mistral", "gemma2", "gemma3", "phi3"])
def test_tiny_model_greedy_matches_transformers_on_cuda(tmp_path, arch):
    """fp32 greedy through the Triton kernels and CUDA graphs; Mistral's and Gemma 2's prompts
    run past their window (Gemma 2: soft caps, the scaled embedding)."""
    hf = save_tiny_model(arch, tmp_path).to("cuda")
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (3, 20, 47, 90)]
    llm = LLM(str(tmp_path), device="cuda", dtype="float32", num_blocks=32, block_size=16)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    for prompt, out in zip(prompts, outs, strict=True):
        ids = torch.tensor([prompt], device="cuda")
        ref = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=16,
            do_sample=False,
            pad_token_id=0,
        )
        assert out.outputs[0].token_ids == ref[0, len(prompt) :].tolist()


@torch.no_grad()
def test_beam_search_matches_transformers_on_cuda(tmp_path):
    """Beam search with the Triton kernels and CUDA graphs, fp32: transformers' hypotheses on
    the same card, and the same ones with graphs off; a pool small enough to preempt groups."""
    from pagedctl.engine import BeamSearchParams

    hf = save_tiny_model("qwen2", tmp_path).to("cuda")
    rng = random.Random(1)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (5, 33, 70)]
    params = BeamSearchParams(beam_width=4, max_tokens=12, ignore_eos=True)
    runs = {}
    for name, settings in {
        "graphs": {},
        "eager": {"cuda_graphs": False},
        "small pool": {"num_blocks": 14},
    }.items():
        llm = LLM(str(tmp_path), device="cuda", dtype="float32", **{"num_blocks": 64,
                  "block_size": 16, "debug": True, **settings})  # fmt: skip
        outs = llm.beam_search(prompts, params)
        runs[name] = [[c.token_ids for c in o.outputs] for o in outs]
        if name == "small pool":
            assert llm.stats["scheduler"]["num_preemptions"] > 0
    assert runs["graphs"] == runs["eager"] == runs["small pool"]
    for prompt, beams in zip(prompts, runs["graphs"], strict=True):
        ids = torch.tensor([prompt], device="cuda")
        ref = hf.generate(
            ids, attention_mask=torch.ones_like(ids), num_beams=4, num_return_sequences=4,
            do_sample=False, max_new_tokens=12, early_stopping=False, length_penalty=1.0,
            pad_token_id=0, eos_token_id=None,
        )  # fmt: skip
        assert beams == ref[:, len(prompt) :].tolist()


def test_swap_preemption_matches_recompute_on_cuda(tmp_path):
    """Swapping through the pinned host pool, with CUDA graphs and multi-step decode, gives the
    greedy tokens (and beam hypotheses) of recompute and of a pool that never preempts, at
    blocks of 16 and 64; `auto` calibrates real costs on the card."""
    from pagedctl.engine import BeamSearchParams

    save_tiny_model("qwen2", tmp_path)
    rng = random.Random(3)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(3, 60))] for _ in range(24)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=rng.randint(20, 80), ignore_eos=True)
        for _ in prompts
    ]
    params[2] = SamplingParams(temperature=0.0, max_tokens=40, n=3, ignore_eos=True)
    params[5] = BeamSearchParams(beam_width=4, max_tokens=30, ignore_eos=True)
    for block_size, small in ((16, 24), (64, 7)):
        runs, stats = {}, {}
        for mode, blocks in (("unconstrained", 2000), ("recompute", small), ("swap", small),
                             ("auto", small)):  # fmt: skip
            llm = LLM(str(tmp_path), device="cuda", dtype="float32", num_blocks=blocks,
                      block_size=block_size, debug=True,
                      preemption_mode="recompute" if mode == "unconstrained" else mode)  # fmt: skip
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
            runs[mode] = [[c.token_ids for c in o.outputs] for o in outs]
            stats[mode] = llm.stats["swap"]
            if mode == "auto":
                costs = llm.scheduler.costs  # a tiny model's prefill may cost ~0 a token
                assert costs is not None and costs.swap_s(1) > 0  # a transfer takes time
            del llm
        assert runs["recompute"] == runs["swap"] == runs["auto"] == runs["unconstrained"]
        assert stats["swap"]["swap_outs"] > 0 and stats["swap"]["swap_ins"] > 0
        assert stats["swap"]["transfer_s"] > 0


def test_a_sampled_run_meets_no_kernel_that_start_up_did_not(tmp_path):
    """Graph capture (`capture_graphs`) and the sampler's warm-up meet every Triton kernel a
    plain sampled run uses, so its first `generate` compiles nothing and loads nothing from
    Triton's disk cache (a job's first sampled step waited 0.28 s for the sampler's kernels)."""
    import triton

    from pagedctl.kernels.triton_sample import _chunk_stats, _pick

    save_tiny_model("qwen2", tmp_path)
    for fn in (_chunk_stats, _pick):  # as in a fresh process, whatever ran before this test
        fn.device_caches.clear()
    llm = LLM(str(tmp_path), device="cuda", dtype="bfloat16", num_blocks=64, block_size=16)
    assert llm.capture_graphs() > 0  # otherwise each is captured (and compiled) on first use
    misses = []

    def on_miss(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
        misses.append(fn.name)
        return False

    before, triton.knobs.runtime.jit_cache_hook = triton.knobs.runtime.jit_cache_hook, on_miss
    try:
        rng = random.Random(3)
        prompts = [[rng.randrange(256) for _ in range(rng.randint(2, 40))] for _ in range(6)]
        params = SamplingParams(temperature=0.7, max_tokens=12, ignore_eos=True)
        outs = llm.generate(prompts, params)
    finally:
        triton.knobs.runtime.jit_cache_hook = before
    assert all(len(o.outputs[0].token_ids) == 12 for o in outs)
    assert misses == []


def test_kv_cache_is_sized_from_measured_memory():
    total = torch.cuda.get_device_properties(0).total_memory
    llm = LLM(
        "qwen2.5-0.5b-instruct",
        device="cuda",
        gpu_memory_utilization=0.3,
        max_num_batched_tokens=2048,
    )
    assert llm.dtype == torch.bfloat16
    kv = llm.scheduler.kv
    pool_bytes = kv.num_blocks * llm.layout.bytes_per_block(kv.block_size)
    assert 0 < pool_bytes < 0.3 * total
    rng = random.Random(1)
    prompts = [[rng.randrange(10000) for _ in range(rng.randint(50, 400))] for _ in range(48)]
    params = SamplingParams(temperature=0.8, max_tokens=32, ignore_eos=True, n=2, seed=3)
    torch.cuda.reset_peak_memory_stats()
    outs = llm.generate(prompts, params)
    assert all(o.ok and len(o.outputs) == 2 for o in outs)
    assert torch.cuda.max_memory_allocated() < 0.3 * total
    assert kv.num_free_blocks == kv.num_blocks


def _bundled_model() -> str | None:
    """The bundled model: a GGUF named by PAGEDCTL_TEST_GGUF, else the pulled default, else None."""
    import os

    from pagedctl.engine import model_is_installed as is_installed
    from pagedctl.models.bundled import default_model_dir

    path = os.environ.get("PAGEDCTL_TEST_GGUF")
    if path:
        return path
    return str(default_model_dir()) if is_installed(default_model_dir()) else None


BUNDLED_PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a CPU cache is.",
    "Give me three ideas for a rainy Sunday.",
    "How do I make green tea?",
    "What is 17 times 23?",
    "Translate 'thank you' into German.",
    "Name a famous bridge.",
)


def test_bundled_model_greedy_on_gpu_matches_the_cpu_path():
    """The Triton kernels (GPU, fp32) give the CPU reference path's greedy tokens on SmolLM2."""
    model = _bundled_model()
    if model is None:
        pytest.skip("the bundled model is not on this machine (set PAGEDCTL_TEST_GGUF)")
    chats = [[{"role": "user", "content": c}] for c in BUNDLED_PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=64)
    gpu = LLM(model, device="cuda", dtype="float32", num_blocks=512, quantization="none")
    cpu = LLM(model, device="cpu", dtype="float32", num_blocks=512, quantization="none")
    got = [o.outputs[0].token_ids for o in gpu.chat(chats, params)]
    want = [o.outputs[0].token_ids for o in cpu.chat(chats, params)]
    assert got == want


@torch.no_grad()
def test_cuda_graph_decode_matches_eager_steps(tmp_path):
    """Steps replayed from CUDA graphs (decode, mixed and few-sequence, padded to their buckets),
    and decode windows 4 steps deep, give the eager tokens through shrinking batches, preemption,
    a seeded sampled request and a prefix hit after a long history."""
    save_tiny_model("qwen2", tmp_path)
    rng = random.Random(2)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(2, 70))] for _ in range(37)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 40), ignore_eos=True)
        for _ in prompts
    ]
    params[5] = SamplingParams(temperature=0.9, max_tokens=30, seed=11, ignore_eos=True)
    long = [rng.randrange(256) for _ in range(480)]
    runs = {}
    for graphs, steps in ((True, 1), (False, 1), (True, 4)):
        llm = LLM(
            str(tmp_path),
            device="cuda",
            dtype="float32",
            num_blocks=40,  # 640 tokens for ~37 x 75: forces preemption
            block_size=16,
            max_num_seqs=24,
            cuda_graphs=graphs,
            num_scheduler_steps=steps,
        )
        assert (llm.runner.max_graph_batch > 0) == graphs
        runs[graphs, steps] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert llm.stats["scheduler"]["num_preemptions"] > 0
        assert llm.scheduler.kv.num_free_blocks == llm.scheduler.kv.num_blocks
        # a prefix hit: a few new tokens after ~480 cached ones (a few-sequence graph, its
        # attention split along the history)
        greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        for prompt in (long, long + [7, 8, 9]):  # one after the other: the second one hits
            runs[graphs, steps] += [o.outputs[0].token_ids for o in llm.generate([prompt], greedy)]
        kinds = llm.runner.step_counts
        assert (kinds["decode"] > 0 and kinds["mixed"] > 0) if graphs else set(kinds) == {"eager"}
        if graphs:
            assert kinds["few"] > 0, kinds
    assert runs[True, 1] == runs[False, 1] == runs[True, 4]
    assert [len(t) for t in runs[True, 1][: len(params)]] == [p.max_tokens for p in params]


def test_memory_figures_are_reported():
    llm = LLM("qwen2.5-0.5b-instruct", device="cuda", gpu_memory_utilization=0.3)
    m = llm.memory
    assert m["weights_bytes"] > 0.9e9  # ~0.5B parameters in bf16
    assert m["non_kv_bytes"] >= m["weights_bytes"]
    assert m["kv_cache_bytes"] == m["num_blocks"] * llm.layout.bytes_per_block(m["block_size"])
    assert m["non_kv_bytes"] + m["kv_cache_bytes"] <= 0.3 * m["total_bytes"]
    assert llm.scheduler.config.max_num_seqs == 1024  # a >= 70 GiB card
    assert llm.scheduler.config.max_num_batched_tokens == 16384


@torch.no_grad()
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_weights_on_cuda_run_the_rounded_weights_in_graphs(tmp_path, method):
    """Weights quantized at load run the Triton weight-only kernels in float16: close to a
    float model holding the rounded values, the same tokens with CUDA graphs as eager, and
    under `deterministic` a prompt's tokens alone equal its tokens in a crowd."""
    import shutil

    from safetensors.torch import load_file, save_file

    from pagedctl.kernels.quant import dequantize, quantize
    from tests.tiny_models import save_llama

    folder = save_llama(tmp_path / "tiny", hidden_size=256, intermediate_size=512)
    rounded = tmp_path / "rounded"
    shutil.copytree(folder, rounded)
    state = load_file(str(folder / "model.safetensors"))
    for name, w in state.items():
        if name.endswith("_proj.weight"):
            state[name] = dequantize(quantize(w, 8 if method == "int8" else 4, 128))
    save_file(state, str(rounded / "model.safetensors"), metadata={"format": "pt"})
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in (3, 20, 47, 90, 5, 61)]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    settings = dict(device="cuda", dtype="float16", num_blocks=64, block_size=16)

    def run(path, prompts, **extra):
        llm = LLM(str(path), **{**settings, **extra})
        return llm, [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]

    llm, graphs = run(folder, prompts, quantization=method)
    assert llm.quantization.method == method
    _, eager = run(folder, prompts, quantization=method, cuda_graphs=False)
    _, floats = run(rounded, prompts, quantization="none")
    assert graphs == eager
    pairs = [(a, b) for g, f in zip(graphs, floats, strict=True) for a, b in zip(g, f, strict=True)]
    assert sum(a == b for a, b in pairs) / len(pairs) >= 0.75, (graphs, floats)
    _, crowd = run(folder, prompts, quantization=method, deterministic=True)
    alone = [run(folder, [p], quantization=method, deterministic=True)[1][0] for p in prompts[:2]]
    assert crowd[:2] == alone


@torch.no_grad()
def test_sampling_fields_on_cuda_match_the_cpu_path(tmp_path):
    """Penalties (the Triton pass), biases, masks, min_tokens, top and prompt logprobs on CUDA
    with graphs and 4-step decode windows give the CPU path's greedy tokens, and logprobs within
    1e-3."""
    save_tiny_model("llama", tmp_path)
    rng = random.Random(5)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (4, 19, 40, 77)]
    params = SamplingParams(
        temperature=0.0, max_tokens=24, ignore_eos=True, presence_penalty=0.7,
        frequency_penalty=0.4, repetition_penalty=1.4, logit_bias={5: 2.0, 17: -3.0},
        min_tokens=6, stop_token_ids=[9], logprobs=True, top_logprobs=4, prompt_logprobs=2,
    )  # fmt: skip
    windowed = dataclasses.replace(params, logprobs=False, top_logprobs=0, prompt_logprobs=None)
    runs, plain = {}, {}
    for device, extra in (("cpu", {}), ("cuda", {"num_scheduler_steps": 4})):
        llm = LLM(str(tmp_path), device=device, dtype="float32", num_blocks=40, block_size=16,
                  **extra)  # fmt: skip
        runs[device] = llm.generate(prompts, params)
        plain[device] = [o.outputs[0].token_ids for o in llm.generate(prompts, windowed)]
    assert plain["cpu"] == plain["cuda"] == [o.outputs[0].token_ids for o in runs["cpu"]]
    for cpu, gpu in zip(runs["cpu"], runs["cuda"], strict=True):
        a, b = cpu.outputs[0], gpu.outputs[0]
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-3
        assert [[t for t, _ in row] for row in a.top_logprobs] == [
            [t for t, _ in row] for row in b.top_logprobs
        ]
        pairs = zip(cpu.prompt_logprobs[1:], gpu.prompt_logprobs[1:], strict=True)
        assert max(abs(x - y) for x, y in pairs) < 1e-3

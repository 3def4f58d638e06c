"""engine.LLM against transformers: greedy outputs token for token, through every engine path."""

import dataclasses
import random

import pytest

from pagedctl import bundled_model
from pagedctl.engine import ConfigError, SamplingParams
from pagedctl.engine.llm import LLM
from tests.tiny_models import LONGROPE_ORIGINAL, MISTRAL_WINDOW, hf_greedy, save_tiny_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3"]


@pytest.fixture(scope="module", params=FAMILIES)
def tiny(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf = save_tiny_model(request.param, folder)
    rng = random.Random(1)
    shared = [rng.randrange(256) for _ in range(40)]
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (5, 17, 33, 64)] + [
        shared + [rng.randrange(256) for _ in range(n)] for n in (3, 9, 20)
    ]
    expected = [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]
    return folder, prompts, expected


def run(folder, prompts, **engine_args):
    llm = LLM(str(folder), device="cpu", dtype="float32", **engine_args)
    outs = llm.generate(prompts, GREEDY)
    assert all(o.ok for o in outs), [o.error for o in outs]
    return [o.outputs[0].token_ids for o in outs], llm.stats


@pytest.mark.parametrize("block_size", [16, 32, 64])
def test_greedy_matches_transformers(tiny, block_size):
    folder, prompts, expected = tiny
    got, _ = run(folder, prompts, block_size=block_size, num_blocks=64)
    assert got == expected


def test_chunked_prefill_and_prefix_hits_match(tiny):
    folder, prompts, expected = tiny
    got, stats = run(folder, prompts, block_size=16, num_blocks=64, max_num_batched_tokens=8)
    assert got == expected
    assert stats["prefix_cache"]["hit_tokens"] > 0  # the shared-prefix prompts hit the cache


def test_forced_preemption_matches(tiny):
    folder, prompts, expected = tiny
    got, stats = run(folder, prompts, block_size=16, num_blocks=10, max_num_batched_tokens=64)
    assert got == expected
    assert stats["scheduler"]["num_preemptions"] > 0


def test_sliding_window_holds_the_window_and_one_block(tmp_path):
    """A Mistral sequence far longer than its window gives back the blocks no later query sees:
    prefilled 8 tokens a step, it never holds more than the window's blocks, the chunk's and
    one partial block; its tokens are still transformers'."""
    hf = save_tiny_model("mistral", tmp_path)
    prompt = [random.Random(2).randrange(256) for _ in range(150)]
    params = dataclasses.replace(GREEDY, max_tokens=40)
    expected = hf_greedy(hf, prompt, params.max_tokens)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", block_size=4, num_blocks=64,
              max_num_batched_tokens=8, debug=True)  # fmt: skip
    (out,) = llm.generate([prompt], params)
    assert out.outputs[0].token_ids == expected
    cache = llm.stats["prefix_cache"]
    assert cache["peak_used_blocks"] <= (MISTRAL_WINDOW + 8) // 4 + 1, cache
    assert cache["dropped_blocks"] >= (150 + 40 - MISTRAL_WINDOW - 8) // 4, cache


def test_longrope_takes_the_long_factors_where_sequences_may_pass_the_original_length(tmp_path):
    """Transformers switches LongRoPE's factors once a sequence passes the original length; the
    engine takes one table, the long one when max_model_len exceeds that length (vLLM's rule).
    Prompts past the original length are transformers' tokens with the default max_model_len;
    sequences within it are with max_model_len at the original length, also after reconfigure
    switches back from the long table."""
    hf = save_tiny_model("phi3-longrope", tmp_path)
    rng = random.Random(4)  # prompts whose answers each table changes (checked both ways)
    long_prompts = [[rng.randrange(256) for _ in range(n)] for n in (33, 40, 57)]
    short_prompts = [[rng.randrange(256) for _ in range(n)] for n in (9, 16, 20)]
    params = dataclasses.replace(GREEDY, max_tokens=LONGROPE_ORIGINAL - 20)  # 20 + 12 = 32
    want_long = [hf_greedy(hf, p, params.max_tokens) for p in long_prompts]
    want_short = [hf_greedy(hf, p, params.max_tokens) for p in short_prompts]
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", block_size=16, num_blocks=64)
    assert llm.model.model.rotary.long
    got = [o.outputs[0].token_ids for o in llm.generate(long_prompts, params)]
    assert got == want_long
    with_long = [o.outputs[0].token_ids for o in llm.generate(short_prompts, params)]
    assert with_long != want_short  # the tables differ: the long one is not transformers' here
    llm.reconfigure(max_model_len=LONGROPE_ORIGINAL)
    assert not llm.model.model.rotary.long
    got = [o.outputs[0].token_ids for o in llm.generate(short_prompts, params)]
    assert got == want_short


def test_dynamic_ntk_runs_unscaled_within_the_model_length_and_refuses_past_it(tmp_path):
    """Dynamic NTK rescales only past max_position_embeddings, which the engine never passes:
    its tokens are transformers'; asking for a longer max_model_len is refused before loading."""
    hf = save_tiny_model("llama-dynamic", tmp_path)
    rng = random.Random(4)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (7, 70)]
    want = [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]
    got, _ = run(tmp_path, prompts, block_size=16, num_blocks=64)
    assert got == want
    with pytest.raises(ConfigError, match="max_model_len=1024 exceeds the model's 512 positions"):
        LLM(str(tmp_path), device="cpu", max_model_len=1024)


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama-n")
    save_tiny_model("llama", folder)
    return folder


def test_parallel_samples_share_the_prompt_and_reproduce_with_a_seed(llama_folder):
    llm = LLM(str(llama_folder), device="cpu", block_size=4, num_blocks=64)
    prompt = list(range(10, 24))  # 14 tokens: 3 full blocks + 2 tokens in a shared partial block
    params = SamplingParams(n=4, seed=123, temperature=1.0, max_tokens=12, ignore_eos=True)
    llm.tracker.add(0, prompt, params, llm.scheduler)
    llm.step()  # the prompt is computed once, then forked
    running = llm.scheduler.running
    assert len(running) == 4
    assert all(s.block_table == running[0].block_table for s in running)
    pool = llm.scheduler.kv.pool
    assert [pool.blocks[i].ref_cnt for i in running[0].block_table] == [4, 4, 4, 4]
    assert llm.scheduler.stats.num_prefill_tokens == 14
    outs = []
    while llm.scheduler.has_unfinished():
        outs += llm.step()
    (first,) = outs
    samples = [c.token_ids for c in first.outputs]
    assert [c.index for c in first.outputs] == [0, 1, 2, 3]
    assert len({tuple(s) for s in samples}) == 4  # the samples differ
    # Same seed, a different batch around it (another request first): the same samples.
    llm2 = LLM(str(llama_folder), device="cpu", block_size=4, num_blocks=64)
    other = SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True)
    again = llm2.generate([list(range(50, 60)), prompt], [other, params])
    assert [c.token_ids for c in again[1].outputs] == samples
    assert llm2.scheduler.kv.num_free_blocks == 64


def test_bad_requests_fail_alone(llama_folder):
    llm = LLM(str(llama_folder), device="cpu", num_blocks=16, block_size=16, max_model_len=64)
    outs = llm.generate(
        [list(range(100)), [1, 2, 3], [999], "text without a tokenizer", {"prompt_token_ids": [5]}],
        SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
    )
    assert "max_model_len=64" in outs[0].error and outs[0].error_code == "prompt_too_long"
    assert outs[1].ok and len(outs[1].outputs[0].token_ids) == 4
    assert "outside the vocabulary" in outs[2].error
    assert outs[2].error_code == "token_out_of_vocab"
    assert "no tokenizer" in outs[3].error and outs[3].error_code == "no_tokenizer"
    assert outs[4].ok and outs[4].error_code is None
    assert [o.index for o in outs] == [0, 1, 2, 3, 4]


def test_should_stop_aborts_everything_in_flight(llama_folder):
    llm = LLM(str(llama_folder), device="cpu", num_blocks=32, block_size=16, max_num_seqs=4)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (1, 50, 50)]
    prompts = [[1, 2, 3], [4, 5, 6], [7, 8, 9]] * 4
    done = []
    for out in llm.stream(prompts, params * 4, should_stop=lambda: len(done) >= 1):
        done.append(out)
    # Requests 0 and 3 (1 token each) finish in the first step, and are delivered; the rest abort.
    assert [o.request_id for o in done] == ["0", "3"]
    sched = llm.scheduler
    assert not sched.has_unfinished() and len(llm.tracker) == 0
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    again = llm.generate([[1, 2, 3]], params[0])  # the engine is usable afterwards
    assert again[0].ok


CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a CPU cache is in two sentences.",
    "Give me three ideas for a rainy Sunday.",
    "How do I make a cup of green tea?",
    "What is 17 times 23? Show your steps.",
    "Translate 'thank you very much' into German.",
    "Name a famous bridge and say where it is.",
]


@pytest.fixture(scope="module")
def smol():
    return LLM(bundled_model(), device="cpu", dtype="float32", block_size=16, quantization="none")


def test_bundled_model_matches_transformers_on_chat_prompts(smol):
    """SmolLM2-135M-Instruct (the bundled default): 8 chat prompts, 64 greedy tokens each."""
    from transformers import AutoModelForCausalLM

    llm = smol
    params = SamplingParams(temperature=0.0, max_tokens=64)
    outs = llm.chat([[{"role": "user", "content": c}] for c in CHATS], params)
    hf = AutoModelForCausalLM.from_pretrained(llm.source.weights_dir, dtype="float32").eval()
    eos = set(llm.tracker.eos_token_ids)
    for out in outs:
        expected = hf_greedy(hf, out.prompt_token_ids, 64)
        cut = next((i + 1 for i, t in enumerate(expected) if t in eos), len(expected))
        assert out.outputs[0].token_ids == expected[:cut]
        assert out.outputs[0].text == llm.tokenizer.decode(expected[:cut], skip_special_tokens=True)
    assert "Paris" in outs[0].outputs[0].text


def test_stop_strings_logprobs_and_streaming(smol):
    chat = [{"role": "user", "content": CHATS[0]}]
    plain = smol.chat([chat], SamplingParams(temperature=0.0, max_tokens=32))[0].outputs[0]
    assert "Paris" in plain.text
    stopped = smol.chat(
        [chat], SamplingParams(temperature=0.0, max_tokens=32, stop=["Paris"], logprobs=True)
    )[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == "Paris"
    assert stopped.text == plain.text[: plain.text.index("Paris")]
    assert len(stopped.logprobs) == len(stopped.token_ids)
    assert all(lp <= 0.0 for lp in stopped.logprobs)
    # stream() yields each request when it finishes: the 2-token request comes first.
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (12, 2)]
    order = [o.request_id for o in smol.stream([[1, 2, 3], [4, 5, 6]], params)]
    assert order == ["1", "0"]


def test_reconfigure_rebuilds_the_pool_and_keeps_the_weights(llama_folder):
    prompts = [[(7 * i + j) % 90 + 3 for j in range(5 + 9 * i)] for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=12)
    llm = LLM(llama_folder, block_size=16, num_blocks=64, dtype="float32", device="cpu")
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    weights = llm.model.model.embed_tokens.weight
    llm.reconfigure(block_size=8, num_blocks=12, max_num_seqs=3)
    assert llm.model.model.embed_tokens.weight is weights
    assert (llm.scheduler.kv.num_blocks, llm.scheduler.kv.block_size) == (12, 8)
    assert llm.memory["num_blocks"] == 12 and llm.memory["block_size"] == 8
    assert llm.scheduler.config.max_num_seqs == 3
    again = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert again == first
    assert llm.stats["scheduler"]["num_preemptions"] > 0  # 12 blocks of 8 force preemption
    with pytest.raises(ConfigError, match="unknown engine setting 'blocksize'"):
        llm.reconfigure(blocksize=8)
    with pytest.raises(ConfigError, match="dtype cannot change without a new LLM"):
        llm.reconfigure(dtype="float16")


def test_graph_path_matches_eager_steps(llama_folder):
    """The graph paths (static buffers; decode batches padded to a bucket with inert rows, mixed
    prefill steps padded with inert tokens and sequences), emulated on the CPU, give the eager
    path's tokens through chunked prefill, shrinking batches, preemption and a seeded sampled
    request."""
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 90) for _ in range(rng.randint(2, 40))] for _ in range(21)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 24), ignore_eos=True)
        for _ in prompts
    ]
    params[5] = SamplingParams(temperature=0.9, max_tokens=20, seed=11, ignore_eos=True)
    runs = {}
    for graphs in ("emulate", False):
        llm = LLM(
            llama_folder,
            device="cpu",
            dtype="float32",
            num_blocks=24,
            block_size=8,
            max_num_seqs=12,
            max_num_batched_tokens=64,  # chunked prefill; mixed buckets up to 64 tokens
            cuda_graphs=graphs,
        )
        assert llm.runner.max_graph_batch == (12 if graphs else 0)
        runs[graphs] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        kinds = llm.runner.step_counts
        if graphs:
            assert kinds["decode"] > 0 and kinds["mixed"] > 0 and not kinds["eager"], kinds
            assert kinds["few"] > 0, kinds  # the last prefills, of a few sequences
        else:
            assert set(kinds) == {"eager"}
        assert llm.stats["scheduler"]["num_preemptions"] > 0
        assert llm.scheduler.kv.num_free_blocks == llm.scheduler.kv.num_blocks
    assert runs["emulate"] == runs[False]
    assert [len(t) for t in runs[False]] == [p.max_tokens for p in params]


def test_graph_choice_per_step(llama_folder):
    llm = LLM(
        llama_folder,
        device="cpu",
        num_blocks=64,
        max_num_seqs=40,
        max_num_batched_tokens=600,
        cuda_graphs="emulate",
    )
    runner = llm.runner
    assert runner.graphs.decode_sizes == [1, 2, 4, 8, 16, 32, 40]
    assert runner.graphs.mixed_sizes == [256, 512, 600]
    assert runner.graphs.pick(3, 3, decode=True) == ("decode", 4)
    assert runner.graphs.pick(33, 33, decode=True) == ("decode", 40)
    assert runner.graphs.few_sizes == [256, 512]
    assert runner.graphs.pick(3, 300, decode=False) == ("few", 512)  # split attention
    assert runner.graphs.pick(5, 300, decode=False) == ("mixed", 512)
    assert runner.graphs.pick(4, 513, decode=False) == ("mixed", 600)
    assert runner.graphs.pick(40, 600, decode=False) == ("mixed", 600)
    assert runner.graphs.pick(41, 41, decode=True) is None  # more sequences than any graph
    assert runner.graphs.pick(2, 601, decode=False) is None


def test_few_sequence_graphs_ask_for_split_attention(llama_folder, monkeypatch):
    """A prefill step of one sequence replays a few-sequence graph, whose attention calls ask
    for `FEW_SPLITS` programs per query block (a long history shared out over the SMs); the
    other graphs leave the split count to the kernel."""
    from pagedctl.engine.models import attention
    from pagedctl.engine.runner.step_graphs import FEW_SPLITS

    seen: list[int | None] = []
    real = attention.paged_attention

    def spy(*args, num_splits=None, **kwargs):
        seen.append(num_splits)
        return real(*args, num_splits=num_splits, **kwargs)

    monkeypatch.setattr(attention, "paged_attention", spy)
    llm = LLM(
        llama_folder,
        device="cpu",
        num_blocks=64,
        max_num_seqs=16,
        max_num_batched_tokens=512,
        cuda_graphs="emulate",
    )
    seen.clear()  # the captures
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.generate([[5] * 40], params)
    assert llm.runner.step_counts == {"few": 1}
    assert seen and set(seen) == {FEW_SPLITS}
    seen.clear()
    llm.generate([[6] * 3 for _ in range(9)], params)  # nine sequences: a mixed graph
    assert llm.runner.step_counts["mixed"] == 1 and set(seen) == {None}


def test_small_mixed_buckets_hold_as_many_sequences_as_tokens(llama_folder):
    """A mixed graph of t tokens has room for min(t, max_num_seqs) sequences (each brings a
    token at least), not the largest batch; a prefill step of 254 one-token prompts and one of
    two tokens (255 sequences, 256 tokens) fills the 256-token bucket and gives the eager path's
    tokens."""
    prompts = [[3 + i % 80] for i in range(254)] + [[5, 6]]
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    runs = {}
    for graphs in ("emulate", False):
        llm = LLM(
            llama_folder,
            device="cpu",
            dtype="float32",
            num_blocks=700,
            block_size=4,
            max_num_seqs=300,
            max_num_batched_tokens=600,
            cuda_graphs=graphs,
        )
        if graphs:
            seqs = [llm.runner.graphs.seqs_of(("mixed", t)) for t in (256, 512, 600)]
            assert seqs == [256, 300, 300]
            assert llm.runner.graphs.pick(256, 256, decode=False) == ("mixed", 256)
        runs[graphs] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        if graphs:
            assert llm.runner.step_counts["mixed"] > 0 and not llm.runner.step_counts["eager"]
    assert runs["emulate"] == runs[False]


@pytest.mark.parametrize("block_size", [4, 16])
def test_multi_step_decode_matches_single_steps(llama_folder, block_size):
    """`num_scheduler_steps=5` (decode windows run 5 tokens deep, one host synchronisation each)
    gives the tokens, finish reasons and pool accounting of single steps: greedy and seeded
    rows, EOS and max_tokens landing inside a window, preemption, the invariants checked."""
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 90) for _ in range(rng.randint(2, 30))] for _ in range(14)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 23), ignore_eos=i % 3 > 0)
        for i in range(len(prompts))
    ]
    params[3] = SamplingParams(temperature=0.8, max_tokens=17, seed=5, ignore_eos=True)
    runs = {}
    for k in (5, 1):
        llm = LLM(
            llama_folder,
            device="cpu",
            dtype="float32",
            num_blocks=120 // block_size + 4,
            block_size=block_size,
            max_num_seqs=8,
            cuda_graphs="emulate",
            num_scheduler_steps=k,
        )
        llm.scheduler.config = dataclasses.replace(llm.scheduler.config, debug=True)
        outs = llm.generate(prompts, params)
        runs[k] = [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]
        assert llm.scheduler.kv.num_free_blocks == llm.scheduler.kv.num_blocks
        if k > 1:
            assert llm.runner.step_counts["decode"] > 0
    assert runs[5] == runs[1]


def test_jit_clock_counts_chains_and_restores_tritons_hooks():
    """The start-up clock's view of Triton's JIT: the hooks Triton calls around a compile are
    counted per kernel, hooks set before are still called, and leaving restores them."""
    triton = pytest.importorskip("triton")
    from pagedctl.kernels import JitClock

    runtime = triton.knobs.runtime
    original = (runtime.jit_cache_hook, runtime.jit_post_compile_hook)
    calls = []
    runtime.jit_cache_hook = lambda **kw: calls.append("before") or False
    runtime.jit_post_compile_hook = lambda **kw: calls.append("after") or False
    theirs = (runtime.jit_cache_hook, runtime.jit_post_compile_hook)
    fn = type("Fn", (), {"name": "_attn_fwd"})()
    clock = JitClock()
    try:
        with clock, clock:  # nested: installed once
            assert runtime.jit_cache_hook is not theirs[0]
            for _ in range(2):
                assert runtime.jit_cache_hook(fn=fn, key=1) is False  # compile as usual
                runtime.jit_post_compile_hook(fn=fn, key=1)
        assert (runtime.jit_cache_hook, runtime.jit_post_compile_hook) == theirs
        assert clock.count == 2 and clock.by_kernel.keys() == {"_attn_fwd"}
        assert clock.seconds == pytest.approx(clock.by_kernel["_attn_fwd"]) and clock.seconds >= 0
        assert calls == ["before", "after"] * 2
        with JitClock(enabled=False):
            assert runtime.jit_cache_hook is theirs[0]
    finally:
        runtime.jit_cache_hook, runtime.jit_post_compile_hook = original

"""Our paged decoder against Hugging Face's forward on tiny random-weight models (fp32, CPU)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import transformers
from torch import Tensor
from transformers import (
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
)

from pagedctl.engine.models.attention import AttentionMetadata
from pagedctl.engine.models.llama import LlamaForCausalLM, WeightLoadError
from pagedctl.engine.models.registry import UnsupportedModelError, build_model
from pagedctl.engine.models.rope import RopeConfig, rope_config
from pagedctl.kernels import PagedBatch

TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
LLAMA3_ROPE = dict(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=64,
)
NO_SPECIAL_IDS = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)  # Phi-3's: 32000
YARN_ROPE = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64, beta_fast=16.0)
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(8)],
            "long_factor": [2.0**i for i in range(8)]}  # fmt: skip
CONFIGS = {
    "llama-gqa-untied": lambda: LlamaConfig(**TINY, tie_word_embeddings=False),
    "llama-mha-tied": lambda: LlamaConfig(
        **{**TINY, "num_key_value_heads": 4}, tie_word_embeddings=True
    ),
    "llama3-rope": lambda: LlamaConfig(**TINY, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE),
    "linear-rope": lambda: LlamaConfig(**TINY, rope_scaling={"rope_type": "linear", "factor": 3.0}),
    "yarn-rope": lambda: Qwen2Config(**TINY, rope_scaling=YARN_ROPE, tie_word_embeddings=True),
    "dynamic-rope": lambda: LlamaConfig(**TINY, rope_scaling={"rope_type": "dynamic", "factor": 4}),
    # LongRoPE past 32 positions; here its short factors (the prompts stay within 32)
    "phi3-longrope": lambda: Phi3Config(
        **TINY, **NO_SPECIAL_IDS, original_max_position_embeddings=32, rope_scaling=LONGROPE
    ),
    "qwen2-bias-tied": lambda: Qwen2Config(**TINY, tie_word_embeddings=True),
    "qwen3-qknorm-headdim32": lambda: Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=False),
    "mistral-window8": lambda: MistralConfig(**TINY, sliding_window=8),
    "gemma2-window6-softcaps": lambda: Gemma2Config(
        **{**TINY, "num_hidden_layers": 3},
        head_dim=32,
        query_pre_attn_scalar=24,
        sliding_window=6,
        attn_logit_softcapping=5.0,
        final_logit_softcapping=3.0,
    ),
    # local layers' RoPE base 100 against the global ones' 1M, linearly scaled
    "gemma3-window6-two-ropes": lambda: Gemma3TextConfig(
        **{**TINY, "num_hidden_layers": 7},
        head_dim=32,
        query_pre_attn_scalar=24,
        sliding_window=6,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        },
    ),
    "phi3-fused-window6": lambda: Phi3Config(**TINY, **NO_SPECIAL_IDS, sliding_window=6),
    "phi3-fused-gqa": lambda: Phi3Config(**TINY, **NO_SPECIAL_IDS, tie_word_embeddings=False),
    "qwen2-window-top-layer": lambda: Qwen2Config(
        **TINY, use_sliding_window=True, sliding_window=6, max_window_layers=1
    ),
}
HF_CLASSES = {
    "llama": transformers.LlamaForCausalLM,
    "qwen2": transformers.Qwen2ForCausalLM,
    "qwen3": transformers.Qwen3ForCausalLM,
    "mistral": transformers.MistralForCausalLM,
    "gemma2": transformers.Gemma2ForCausalLM,
    "gemma3_text": transformers.Gemma3ForCausalLM,
    "phi3": transformers.Phi3ForCausalLM,
}
PROMPT_LENS = (13, 7, 21)
ATOL = 1e-4


def make_pair(
    name: str, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> tuple[torch.nn.Module, LlamaForCausalLM]:
    """A randomised HF model (norms and biases too, so that every mapping matters) and ours."""
    torch.manual_seed(0)
    config = CONFIGS[name]()
    hf = HF_CLASSES[config.model_type](config).eval()
    with torch.no_grad():
        for pname, p in hf.named_parameters():
            if "norm" in pname:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.1)
    ours = LlamaForCausalLM(config, dtype, device)
    ours.load_weights(hf.state_dict().items())
    return hf.to(device), ours


def hf_logits(hf: torch.nn.Module, tokens: list[int]) -> Tensor:
    device = next(hf.parameters()).device
    with torch.no_grad():
        return hf(torch.tensor([tokens], device=device)).logits[0].float().cpu()


class PagedRun:
    """A minimal runner: sequences, shuffled block tables, a NaN-filled cache, flat varlen steps."""

    def __init__(self, model: LlamaForCausalLM, block_size: int, num_blocks: int = 64) -> None:
        self.model, self.block_size = model, block_size
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1)).tolist()
        weight = model.lm_head.weight
        shape = (num_blocks, block_size, model.num_kv_heads, model.head_dim)
        self.caches = [
            tuple(torch.full(shape, float("nan"), dtype=weight.dtype, device=weight.device)
                  for _ in range(2))
            for _ in range(model.num_layers)
        ]  # fmt: skip
        self.device = weight.device
        self.tokens: list[list[int]] = []
        self.tables: list[list[int]] = []
        self.done: list[int] = []
        self.logits: list[list[Tensor]] = []  # per sequence, one row per computed position

    def add(self, tokens: list[int], shared_blocks: list[int] | None = None) -> int:
        """Add a sequence; `shared_blocks` are full blocks of another sequence (a prefix hit)."""
        shared = list(shared_blocks or [])
        self.tokens.append(list(tokens))
        self.tables.append(shared)
        self.done.append(len(shared) * self.block_size)
        self.logits.append([])
        return len(self.tokens) - 1

    def step(self, work: dict[int, int]) -> None:
        """Compute `work[seq]` new tokens of each listed sequence in one flat batch."""
        ids, pos, slots, cu = [], [], [], [0]
        for seq, n in work.items():
            start, end, table = self.done[seq], self.done[seq] + n, self.tables[seq]
            assert n > 0 and end <= len(self.tokens[seq])
            while len(table) * self.block_size < end:
                table.append(self.free.pop())
            ids += self.tokens[seq][start:end]
            pos += range(start, end)
            slots += [table[p // self.block_size] * self.block_size + p % self.block_size
                      for p in range(start, end)]  # fmt: skip
            cu.append(cu[-1] + n)
        width = max(len(self.tables[s]) for s in work) + 2
        tables = [self.tables[s] + [10**9] * (width - len(self.tables[s])) for s in work]
        seq_lens = [self.done[s] + n for s, n in work.items()]
        dev, i32 = self.device, torch.int32
        batch = PagedBatch(
            torch.tensor(tables, dtype=i32, device=dev),
            torch.tensor(seq_lens, dtype=i32, device=dev), torch.tensor(cu, dtype=i32, device=dev),
            max(work.values()), max(seq_lens),
        )  # fmt: skip
        meta = AttentionMetadata(torch.tensor(slots, device=dev), batch)
        ids_t, pos_t = torch.tensor(ids, device=dev), torch.tensor(pos, device=dev)
        with torch.no_grad():
            hidden = self.model(ids_t, pos_t, self.caches, meta)
            logits = self.model.compute_logits(hidden).float().cpu()
        for (seq, n), rows in zip(work.items(), logits.split(list(work.values())), strict=True):
            self.done[seq] += n
            self.logits[seq].extend(rows)

    def check(self, hf: torch.nn.Module, seq: int, atol: float = ATOL) -> None:
        """Our logits of every position this sequence computed equal HF's on its full tokens."""
        done = self.done[seq]
        ref = hf_logits(hf, self.tokens[seq][:done])[done - len(self.logits[seq]) :]
        torch.testing.assert_close(torch.stack(self.logits[seq]), ref, atol=atol, rtol=0)


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(2)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in PROMPT_LENS]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefill_of_a_flat_batch_matches_hf(name: str) -> None:
    hf, ours = make_pair(name)
    run = PagedRun(ours, block_size=16)
    seqs = [run.add(p) for p in prompts()]
    run.step({s: len(run.tokens[s]) for s in seqs})
    for s in seqs:
        run.check(hf, s)


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_chunked_prefill_then_greedy_decode_matches_hf(name: str, block_size: int) -> None:
    hf, ours = make_pair(name)
    run = PagedRun(ours, block_size)
    seqs = [run.add(p) for p in prompts()]
    generated = dict.fromkeys(seqs, 0)
    while any(n < 4 for n in generated.values()):  # prompts in 1-3 chunks of 8, mixed w/ decodes
        work = {s: min(8, len(run.tokens[s]) - run.done[s]) for s in seqs if generated[s] < 4}
        run.step(work)
        for s in work:
            if run.done[s] == len(run.tokens[s]):
                run.tokens[s].append(int(run.logits[s][-1].argmax()))
                generated[s] += 1
    for s in seqs:
        run.check(hf, s)


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("name", ["llama-gqa-untied", "qwen3-qknorm-headdim32"])
def test_prefix_hit_reads_shared_blocks(name: str, block_size: int) -> None:
    hf, ours = make_pair(name)
    run = PagedRun(ours, block_size)
    a_tokens = torch.randint(0, 256, (2 * block_size + 3,)).tolist()
    a = run.add(a_tokens)
    run.step({a: len(a_tokens)})
    b = run.add(a_tokens[: 2 * block_size] + [1, 2, 3, 4, 5], shared_blocks=run.tables[a][:2])
    assert run.done[b] == 2 * block_size
    run.tokens[a].append(int(run.logits[a][-1].argmax()))
    run.step({b: 5, a: 1})  # B computes only its suffix; A decodes alongside
    run.tokens[a].append(int(run.logits[a][-1].argmax()))
    run.step({a: 1})  # A's shared blocks were not disturbed by B
    assert len(run.logits[b]) == 5
    run.check(hf, a)
    run.check(hf, b)


def test_build_model_rejects_unsupported_architectures() -> None:
    config = LlamaConfig(**TINY)
    config.architectures = ["MixtralForCausalLM"]
    with pytest.raises(UnsupportedModelError, match="MixtralForCausalLM"):
        build_model(config, torch.float32, "cpu")
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        build_model(transformers.GPT2Config(), torch.float32, "cpu")
    config.architectures = ["LlamaForCausalLM"]
    assert isinstance(build_model(config, torch.float32, "cpu"), LlamaForCausalLM)


def test_longrope_long_factors_match_transformers_past_the_original_length() -> None:
    """With a max_model_len past LongRoPE's 32 original positions the engine takes the long
    factors; transformers takes them for any sequence longer than 32: prompts of 40-60."""
    hf, ours = make_pair("phi3-longrope")
    ours.fit_max_model_len(256)
    run = PagedRun(ours, block_size=16)
    gen = torch.Generator().manual_seed(3)
    seqs = [run.add(torch.randint(0, 256, (n,), generator=gen).tolist()) for n in (40, 60)]
    run.step({s: len(run.tokens[s]) for s in seqs})
    for s in seqs:
        run.check(hf, s)
    ours.fit_max_model_len(32)  # the short table: transformers' within 32, not past it
    again = PagedRun(ours, block_size=16)
    seq = again.add(run.tokens[seqs[0]])
    again.step({seq: len(again.tokens[seq])})
    with pytest.raises(AssertionError):
        again.check(hf, seq)


def test_unsupported_rope_type_is_a_clear_error() -> None:
    scaling = {"rope_type": "proportional", "factor": 2.0}  # Gemma 4's
    with pytest.raises(UnsupportedModelError, match="'proportional' is not supported; supported: "
                       "default, linear, dynamic, yarn, longrope, llama3"):  # fmt: skip
        LlamaForCausalLM(LlamaConfig(**TINY, rope_scaling=scaling))


def test_phi_with_a_partial_rotary_embedding_is_refused_by_name() -> None:
    """Phi-4-mini's shape: RoPE over 3/4 of each head."""
    config = Phi3Config(**TINY, **NO_SPECIAL_IDS, partial_rotary_factor=0.75)
    with pytest.raises(UnsupportedModelError, match="partial rotary"):
        LlamaForCausalLM(config)


def test_yarn_scales_cos_and_sin_as_transformers_does() -> None:
    """yarn's attention factor (here 0.1 ln 4 + 1) multiplies the table, as transformers'."""
    _, ours = make_pair("yarn-rope")
    table = torch.sqrt(ours.model.rotary.cos**2 + ours.model.rotary.sin**2)
    torch.testing.assert_close(table, torch.full_like(table, 0.1 * math.log(4.0) + 1))


def test_rope_config_reads_old_and_new_attributes() -> None:
    old = SimpleNamespace(rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2.0})
    assert rope_config(old) == RopeConfig("linear", 5e5, 2.0)
    assert rope_config(SimpleNamespace(rope_theta=1e6, rope_scaling=None)) == RopeConfig(theta=1e6)
    new = LlamaConfig(**TINY, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE)
    assert rope_config(new) == RopeConfig("llama3", 500000.0, 8.0, 1.0, 4.0, 64)


def test_load_weights_lists_unknown_and_missing_names() -> None:
    hf, ours = make_pair("llama-gqa-untied")
    weights = dict(hf.state_dict())
    del weights["model.layers.1.mlp.up_proj.weight"]
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)  # ignored
    weights["model.layers.0.mlp.extra.weight"] = torch.ones(3)
    with pytest.raises(WeightLoadError) as err:
        ours.load_weights(weights.items())
    assert "model.layers.0.mlp.extra.weight" in str(err.value)
    assert "model.layers.1.mlp.up_proj.weight" in str(err.value)
    weights = dict(hf.state_dict())
    weights["model.norm.weight"] = torch.ones(65)
    with pytest.raises(WeightLoadError, match=r"model\.norm\.weight"):
        ours.load_weights(weights.items())


def test_missing_lm_head_falls_back_to_tied_embeddings() -> None:
    hf, ours = make_pair("llama-gqa-untied")
    weights = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    ours.load_weights(weights.items())
    assert ours.lm_head.weight is ours.model.embed_tokens.weight


def test_dtype_device_and_dummy_weights() -> None:
    config: PretrainedConfig = Qwen2Config(**TINY)
    model = LlamaForCausalLM(config, dtype=torch.bfloat16)
    assert torch.get_default_dtype() == torch.float32
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.rotary.cos.dtype == torch.bfloat16
    model.init_dummy_weights(seed=3)
    twin = LlamaForCausalLM(config, dtype=torch.bfloat16)
    twin.init_dummy_weights(seed=3)
    for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q), name
    layer = model.model.layers[0]
    assert torch.equal(layer.input_layernorm.weight, torch.ones(64, dtype=torch.bfloat16))
    assert float(layer.self_attn.qkv_proj.weight.detach().float().std()) == pytest.approx(
        0.02, rel=0.1
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 2e-4), (torch.bfloat16, 0.15)])
@pytest.mark.parametrize("name", ["llama3-rope", "qwen2-bias-tied", "qwen3-qknorm-headdim32"])
def test_cuda_matches_hf(name: str, dtype: torch.dtype, atol: float) -> None:
    hf, ours = make_pair(name, dtype, "cuda")
    run = PagedRun(ours, block_size=16)
    seqs = [run.add(p) for p in prompts()]
    run.step({seqs[0]: 8, seqs[2]: 8})  # a chunk of two prompts, then the rest with the other
    run.step({s: len(run.tokens[s]) - run.done[s] for s in seqs})
    for s in seqs:
        run.tokens[s].append(int(run.logits[s][-1].argmax()))
    run.step(dict.fromkeys(seqs, 1))
    for s in seqs:
        run.check(hf, s, atol)


@pytest.mark.parametrize(
    "name",
    ["mistral-window8", "gemma2-window6-softcaps", "gemma3-window6-two-ropes", "phi3-fused-gqa"],
)
def test_bfloat16_on_the_cpu_errs_as_transformers_bfloat16_does(name: str) -> None:
    """Each family's windows, norms and soft caps in bfloat16 (the CPU path, a chunked prefill):
    our logits stray from transformers' float32 ones by at most 1.5x what transformers' own
    bfloat16 model strays (Gemma's deep random stacks stray by ~0.2-0.9 either way)."""
    import copy

    hf, ours = make_pair(name, torch.bfloat16)
    hf16 = copy.deepcopy(hf).to(torch.bfloat16)
    run = PagedRun(ours, block_size=16)
    seqs = [run.add(p) for p in prompts()]
    run.step({seqs[0]: 8, seqs[2]: 8})
    run.step({s: len(run.tokens[s]) - run.done[s] for s in seqs})
    ours_err = theirs_err = 0.0
    for s in seqs:
        ref = hf_logits(hf, run.tokens[s])
        ours_err = max(ours_err, float((torch.stack(run.logits[s]) - ref).abs().max()))
        theirs_err = max(theirs_err, float((hf_logits(hf16, run.tokens[s]) - ref).abs().max()))
    assert 0 < ours_err <= 1.5 * theirs_err + 0.02, (ours_err, theirs_err)


def test_the_profile_prefill_stays_within_the_models_positions() -> None:
    """The memory profile's prefill of more tokens than the model has positions (Llama-3-8B:
    8,192 against a 16K token budget) runs as several sequences, each within the RoPE table,
    and each gives the hidden states that sequence gives alone."""
    from pagedctl.engine.sizing.profiling import prefill_forward
    from pagedctl.kernels import empty_kv_cache

    config = LlamaConfig(**{**TINY, "max_position_embeddings": 24})
    torch.manual_seed(0)
    ours = LlamaForCausalLM(config, torch.float32, "cpu")
    ours.init_dummy_weights(0)

    def caches(num_blocks: int):
        kv = empty_kv_cache(ours.num_layers, num_blocks, 4, ours.num_kv_heads, ours.head_dim,
                            torch.float32, torch.device("cpu"))  # fmt: skip
        return [(layer[0], layer[1]) for layer in kv]

    with torch.no_grad():
        many = prefill_forward(ours, caches(18), 60, 4, torch.device("cpu"))  # 24 + 24 + 12
        alone = prefill_forward(ours, caches(6), 24, 4, torch.device("cpu"))
    assert many.shape[0] == 60 and torch.isfinite(many).all()
    torch.testing.assert_close(many[:24], alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(many[24:48], alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(many[48:], alone[:12], rtol=1e-5, atol=1e-5)

"""`pagedctl capacity` model counting: KV bytes per token and weights of real configs, by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedctl.capacity.model import (
    ModelSpecError,
    activation_peak_bytes,
    dtype_bytes,
    params_from_config,
    resolve_footprint,
)
from pagedctl.engine.sizing.kv import layout_from_config_dict, sequences_in_pool
from tests.tiny_models import save_tiny_model

# Published configs (config.json fields that matter), as bare files: Mistral-Nemo has an explicit
# head_dim (128) that is not hidden / heads (160).
MISTRAL_NEMO = {
    "architectures": ["MistralForCausalLM"],
    "model_type": "mistral",
    "hidden_size": 5120,
    "head_dim": 128,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_hidden_layers": 40,
    "num_key_value_heads": 8,
    "vocab_size": 131072,
    "max_position_embeddings": 1024000,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
LLAMA_31_70B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_attention_heads": 64,
    "num_hidden_layers": 80,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
MISTRAL_7B_V03 = {
    "model_type": "mistral",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "vocab_size": 32768,
    "max_position_embeddings": 32768,
    "sliding_window": None,
    "tie_word_embeddings": False,
}
QWEN25_7B = {
    "model_type": "qwen2",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": False,
}

# Hand-computed: 2 (K, V) x layers x KV heads x head_dim x 2 bytes (fp16); parameters = embedding
# (x2 when untied) + layers x (q, k, v, o, 3 MLP matrices, 2 norms [, q/k/v biases, q/k norms])
# + final norm. They equal the published parameter counts.
CASES = {
    # 24 x (896*896+896 + 2*(128*896+128) + 896*896 + 3*896*4864 + 2*896) + 151936*896 + 896
    "qwen2.5-0.5b-instruct": (2 * 24 * 2 * 64 * 2, 494_032_768),
    # 16 x (2048*2048 + 2*512*2048 + 2048*2048 + 3*2048*8192 + 2*2048) + 128256*2048 + 2048
    "llama-3.2-1b": (2 * 16 * 8 * 64 * 2, 1_235_814_400),
    # untied: 32 x (4096*4096 + 2*1024*4096 + 4096*4096 + 3*4096*14336 + 2*4096)
    # + 2*128256*4096 + 4096
    "llama-3-8b": (2 * 32 * 8 * 128 * 2, 8_030_261_248),
    # Mistral-7B v0.1: 32 x (4096*4096 + 2*1024*4096 + 4096*4096 + 3*4096*14336 + 2*4096)
    # + 2*32000*4096 + 4096
    "mistral-7b": (2 * 32 * 8 * 128 * 2, 7_241_732_096),
    # Gemma-2-2B: 26 x (2304*2048 + 2*1024*2304 + 2048*2304 + 3*2304*9216 + 4*2304)
    # + 256000*2304 (tied) + 2304
    "gemma-2-2b": (2 * 26 * 4 * 256 * 2, 2_614_341_888),
    # Gemma-3-1B: 26 x (1152*1024 + 2*256*1152 + 1024*1152 + 3*1152*6912 + 4*1152 + 2*256)
    # + 262144*1152 (tied) + 1152
    "gemma-3-1b": (2 * 26 * 1 * 256 * 2, 999_885_952),
    # Phi-3-mini (fused qkv, gate_up): 32 x (3072*9216 + 3072*3072 + 16384*3072 + 8192*3072
    # + 2*3072) + 2*32064*3072 + 3072
    "phi-3-mini": (2 * 32 * 32 * 96 * 2, 3_821_079_552),
    # explicit head_dim 128 (hidden / heads = 64): 28 x (1024*2048 + 2*1024*1024 + 2048*1024
    # + 3*1024*3072 + 2*1024 + 2*128) + 151936*1024 + 1024
    "qwen3-0.6b": (2 * 28 * 8 * 128 * 2, 596_049_920),
    # 30 x (576*576 + 2*576*192 + 576*576 + 3*576*1536 + 2*576) + 49152*576 + 576
    "smollm2-135m-instruct": (2 * 30 * 3 * 64 * 2, 134_515_008),
}
FILES = {
    "mistral-nemo": (MISTRAL_NEMO, 2 * 40 * 8 * 128 * 2, 12_247_782_400),
    "llama-3.1-70b": (LLAMA_31_70B, 327_680, 70_553_706_496),  # 2*80*8*128*2, ecosystem.md
    "mistral-7b-v0.3": (MISTRAL_7B_V03, 2 * 32 * 8 * 128 * 2, 7_248_023_552),
    "qwen2.5-7b": (QWEN25_7B, 2 * 28 * 4 * 128 * 2, 7_615_616_512),
}


@pytest.mark.parametrize("preset", sorted(CASES))
def test_presets_bytes_per_token_and_params(preset: str) -> None:
    fp = resolve_footprint(preset)
    bpt, params = CASES[preset]
    assert fp.layout(2).bytes_per_token == bpt
    assert fp.num_params == params
    assert fp.params_source == "config"
    assert fp.weights_bytes(2) == 2 * params


@pytest.mark.parametrize("name", sorted(FILES))
def test_bare_config_files(tmp_path: Path, name: str) -> None:
    config, bpt, params = FILES[name]
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(config))
    fp = resolve_footprint(str(path))
    assert fp.layout(2).bytes_per_token == bpt
    assert fp.layout(4).bytes_per_token == 2 * bpt
    assert fp.num_params == params
    assert fp.notes == ()


def test_tied_embeddings_count_once() -> None:
    tied = resolve_footprint("qwen2.5-0.5b-instruct").config
    untied = {**tied, "tie_word_embeddings": False}
    assert params_from_config(untied) - params_from_config(tied) == 151936 * 896


def test_safetensors_headers_count_what_the_model_holds(tmp_path: Path) -> None:
    for arch in ("llama", "qwen3"):  # untied (lm_head stored) and tied
        folder = tmp_path / arch
        hf = save_tiny_model(arch, folder)
        fp = resolve_footprint(str(folder))
        assert fp.params_source == "safetensors headers"
        assert fp.num_params == sum(p.numel() for p in hf.parameters())
        assert fp.num_params == params_from_config(json.loads((folder / "config.json").read_text()))


def test_head_dim_null_falls_back_and_mla_is_refused() -> None:
    cfg = {"num_attention_heads": 8, "hidden_size": 512, "num_hidden_layers": 2, "head_dim": None}
    assert layout_from_config_dict(cfg).head_dim == 64
    assert layout_from_config_dict(cfg).num_kv_heads == 8  # no GQA field: every head
    with pytest.raises(ValueError, match="latent attention"):
        layout_from_config_dict({**cfg, "kv_lora_rank": 512})
    with pytest.raises(ValueError, match="num_hidden_layers"):
        layout_from_config_dict({"num_attention_heads": 8, "hidden_size": 512})


def test_notes_for_sliding_windows_and_unknown_types(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_text(json.dumps({**MISTRAL_7B_V03, "sliding_window": 4096, "model_type": "gemma"}))
    notes = " ".join(resolve_footprint(str(path)).notes)
    assert "sliding window 4096" not in notes  # gemma does not use it unless it says so
    assert "model_type 'gemma'" in notes
    path.write_text(json.dumps({**MISTRAL_7B_V03, "sliding_window": 4096}))
    footprint = resolve_footprint(str(path))
    assert footprint.kv_window == 4096  # every layer: section 2 counts the window's blocks
    assert "sliding window" not in " ".join(footprint.notes)
    qwen = {**MISTRAL_7B_V03, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}
    qwen |= {"use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 28}
    path.write_text(json.dumps(qwen))
    footprint = resolve_footprint(str(path))
    assert footprint.kv_window is None  # layers below 28 attend to everything
    assert "sliding window 4096 on some layers only" in " ".join(footprint.notes)


def test_unknown_model_and_bad_files(tmp_path: Path) -> None:
    with pytest.raises(ModelSpecError, match="not found"):
        resolve_footprint("no-such-model-anywhere")
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(ModelSpecError, match=r"not a folder, a \.gguf or a config"):
        resolve_footprint(str(tmp_path / "x.txt"))
    (tmp_path / "bad.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ModelSpecError, match="cannot count"):
        resolve_footprint(str(tmp_path / "bad.json"))


def test_dtype_auto_is_16_bit() -> None:
    assert dtype_bytes("auto", {"torch_dtype": "bfloat16"}) == ("bfloat16", 2)
    assert dtype_bytes("auto", {"torch_dtype": "float32"}) == ("float16", 2)
    assert dtype_bytes("fp32", {}) == ("float32", 4)
    with pytest.raises(ModelSpecError):
        dtype_bytes("int3", {})


def test_activation_estimate_by_hand() -> None:
    cfg = {"hidden_size": 64, "intermediate_size": 128, "vocab_size": 1000}
    # layer phase: 100 tokens x ((2*64 + 4*128) x 2 B + 2*64 x 4 B) = 100 x 1792
    assert activation_peak_bytes(cfg, 2, 100, 10) == 100 * 1792
    # logits phase wins with a large vocabulary: 100*64*2 + 10 rows x 10^6 x (2 + 4)
    assert activation_peak_bytes({**cfg, "vocab_size": 10**6}, 2, 100, 10) == 12800 + 6 * 10**7


def test_sequences_in_pool_with_a_shared_prefix() -> None:
    assert sequences_in_pool(100, 16, 64) == 25
    # 40 shared tokens = 2 full blocks held once; each 64-token sequence holds 4 - 2 of its own
    assert sequences_in_pool(100, 16, 64, shared_prefix_tokens=40) == (100 - 2) // 2
    # a prefix as long as the sequence still leaves the last block to the sequence
    assert sequences_in_pool(100, 16, 32, shared_prefix_tokens=32) == (100 - 1) // 1

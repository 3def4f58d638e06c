"""Tiny random-weight Hugging Face models saved as real safetensors folders, for engine tests."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
)

COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)

MISTRAL_WINDOW = 24
LONGROPE_ORIGINAL = 32  # the tiny LongRoPE model's original length


def tiny_config(arch: str) -> PretrainedConfig:
    """Configs for each supported family: Llama 3 RoPE scaling, Qwen2 biases, Qwen3 q/k norms,
    Mistral's sliding window (24 tokens: shorter than most test prompts), Gemma 2's local and
    global layers, norms and soft-capping."""
    if arch == "llama":
        return LlamaConfig(
            **COMMON,
            tie_word_embeddings=False,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            architectures=["LlamaForCausalLM"],
        )
    if arch == "qwen2":
        return Qwen2Config(**COMMON, tie_word_embeddings=True, architectures=["Qwen2ForCausalLM"])
    if arch == "qwen3":
        return Qwen3Config(
            **COMMON, head_dim=32, tie_word_embeddings=True, architectures=["Qwen3ForCausalLM"]
        )
    if arch == "mistral":
        return MistralConfig(
            **COMMON, sliding_window=MISTRAL_WINDOW, architectures=["MistralForCausalLM"]
        )
    if arch == "gemma2":  # local layers of the same window between global ones, soft-capped
        return Gemma2Config(
            **{**COMMON, "num_hidden_layers": 3}, head_dim=16, query_pre_attn_scalar=16,
            sliding_window=MISTRAL_WINDOW, architectures=["Gemma2ForCausalLM"],
        )  # fmt: skip
    if arch == "gemma3":  # five local layers (their own RoPE base) to a global one, q/k norms
        return Gemma3TextConfig(
            **{**COMMON, "num_hidden_layers": 7}, head_dim=16, query_pre_attn_scalar=16,
            sliding_window=MISTRAL_WINDOW, architectures=["Gemma3ForCausalLM"],
        )  # fmt: skip
    if arch == "phi3":  # fused qkv and gate_up tensors, a sliding window
        return Phi3Config(
            **COMMON, sliding_window=MISTRAL_WINDOW, tie_word_embeddings=False,
            architectures=["Phi3ForCausalLM"],
        )  # fmt: skip
    if arch == "phi3-longrope":  # Phi-3-128K's LongRoPE: short and long factors, 32 positions
        half = COMMON["hidden_size"] // COMMON["num_attention_heads"] // 2
        return Phi3Config(
            **COMMON, original_max_position_embeddings=LONGROPE_ORIGINAL,
            rope_scaling={"type": "longrope", "short_factor": [1.0 + 0.05 * i for i in range(half)],
                          "long_factor": [4.0 ** i for i in range(half)]},
            tie_word_embeddings=False, architectures=["Phi3ForCausalLM"],
        )  # fmt: skip
    if arch == "llama-dynamic":  # dynamic NTK: unscaled until max_position_embeddings
        return LlamaConfig(
            **COMMON, rope_scaling={"rope_type": "dynamic", "factor": 4.0},
            architectures=["LlamaForCausalLM"],
        )  # fmt: skip
    raise ValueError(arch)


def save_tiny_model(arch: str, folder: Path, seed: int = 0):
    """Build, save (safetensors) and return the Hugging Face model in fp32 eval mode."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch), torch_dtype=torch.float32)
    model.eval()
    model.save_pretrained(folder, safe_serialization=True)
    return model


def save_llama(folder: Path, seed: int = 0, **sizes: int) -> Path:
    """A random-weight Llama of `COMMON`'s sizes with `sizes` over them (`hidden_size=256`, ...),
    saved as safetensors; returns the folder."""
    config = LlamaConfig(**{**COMMON, **sizes}, architectures=["LlamaForCausalLM"])
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


@torch.no_grad()
def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Transformers' own greedy `generate` for one unpadded prompt."""
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()

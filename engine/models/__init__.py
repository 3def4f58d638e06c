"""Llama-family decoders (Llama, Qwen2, Qwen3) running on the paged KV cache."""

from .attention import AttentionMetadata, PagedAttention
from .layers import UnsupportedModelError
from .llama import (
    SUPPORTED_ARCHITECTURES,
    LlamaForCausalLM,
    ModelSpec,
    WeightLoadError,
    build_model,
    model_spec,
)

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "AttentionMetadata",
    "LlamaForCausalLM",
    "ModelSpec",
    "PagedAttention",
    "UnsupportedModelError",
    "WeightLoadError",
    "build_model",
    "model_spec",
]

"""Llama-family decoders (Llama, Qwen2, Qwen3) running on the paged KV cache."""

from pagedctl.engine.models.attention import AttentionMetadata, PagedAttention
from pagedctl.engine.models.layers import UnsupportedModelError
from pagedctl.engine.models.llama import (
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

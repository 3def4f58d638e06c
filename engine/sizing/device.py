"""Device and dtype choice, and how much memory the KV cache may take on this machine."""

from __future__ import annotations

import os

import torch

from ...kernels import batch_invariant_serves
from ..core.config import ConfigError, EngineConfig

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """'auto' picks the first CUDA device when there is one, else the CPU."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "device 'cuda' was asked for but torch sees no CUDA device; use --device cpu"
        )
    return dev


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """'auto': float32 on the CPU; bfloat16 on CUDA from compute capability 8.0, else float16."""
    if isinstance(dtype, torch.dtype):
        chosen = dtype
    elif dtype == "auto":
        if device.type != "cuda":
            return torch.float32
        return (
            torch.bfloat16 if torch.cuda.get_device_capability(device) >= (8, 0) else torch.float16
        )
    elif dtype in _DTYPES:
        chosen = _DTYPES[dtype]
    else:
        raise ValueError(f"unknown dtype {dtype!r}; use one of auto, {', '.join(sorted(_DTYPES))}")
    if (
        chosen == torch.bfloat16
        and device.type == "cuda"
        and torch.cuda.get_device_capability(device) < (8, 0)
    ):
        raise ValueError(
            "bfloat16 needs compute capability 8.0 or newer (e.g. not a T4); use float16"
        )
    return chosen


def system_memory_bytes() -> int:
    """Physical memory of this machine."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 * 2**30


def default_cpu_kv_bytes() -> int:
    """On the CPU the cache takes at most 4 GiB or a quarter of memory, whichever is smaller."""
    return min(4 * 2**30, system_memory_bytes() // 4)


def check_deterministic(config: EngineConfig, device: torch.device) -> None:
    """Refuse `deterministic` where no batch-invariant kernels exist, before anything loads."""
    if config.deterministic and not batch_invariant_serves(device):
        why = (
            "PAGEDCTL_KERNELS=reference forces PyTorch's ops, whose reductions change with the "
            "batch; unset it"
            if device.type == "cuda"
            else f"no batch-invariant kernels for {device.type} devices; run on cpu or cuda"
        )
        raise ConfigError(f"deterministic: {why}, or run without it")

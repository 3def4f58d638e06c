"""KV-cache arithmetic: bytes per token and per block, and how many blocks a memory budget buys.

Shared by the engine (sizing its pool at start-up) and by capacity planning.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1e3,
    "kb": 1e3,
    "m": 1e6,
    "mb": 1e6,
    "g": 1e9,
    "gb": 1e9,
    "t": 1e12,
    "tb": 1e12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(text: str | int | float) -> int:
    """'4GiB', '512MiB', '2.5GB', '1e9' or a number of bytes -> bytes."""
    if isinstance(text, int | float):
        value = int(text)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise ValueError(f"cannot read {text!r} as a size; use e.g. 4GiB, 512MiB, 2GB")
        value = int(float(m.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"a memory size must be positive, got {text!r}")
    return value


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


@dataclass(frozen=True)
class KVLayout:
    """The per-token KV footprint of a model: K and V for every layer and KV head."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int

    @classmethod
    def from_config(cls, hf_config: object, dtype_bytes: int = 2) -> KVLayout:
        """The layout of a Hugging Face model config (16-bit KV by default)."""
        from engine.models.layers import model_spec

        spec = model_spec(hf_config)
        return cls(spec.num_layers, spec.num_kv_heads, spec.head_dim, dtype_bytes)

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def bytes_per_block(self, block_size: int) -> int:
        return self.bytes_per_token * block_size

    def blocks_for_bytes(self, num_bytes: int, block_size: int) -> int:
        return num_bytes // self.bytes_per_block(block_size)


def max_concurrency(num_blocks: int, block_size: int, max_model_len: int) -> float:
    """Sequences of `max_model_len` tokens the pool holds at once (vLLM's start-up figure)."""
    return num_blocks / -(-max_model_len // block_size)

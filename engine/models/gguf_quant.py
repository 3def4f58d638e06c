"""GGUF tensors as they are stored: each quantized block type read into `QuantizedWeight`.

The integers, scales and offsets of a block become the layout's without changing a value
(`kernels.quant`): the scales of the K-quants are products of two stored numbers (a float16
super-block scale times a 6- or 8-bit sub-block scale), kept in float32, where they are exact.
gguf's own dequantizers (`gguf.quants.dequantize`) are the reference this is tested against.

    type   bits  group  w =                      bytes per weight (stored -> here)
    Q4_0   4     32     q d - 8 d                0.5625 -> 0.625
    Q4_1   4     32     q d + m                  0.625  -> 0.625
    Q4_K   4     32     q (d sc) - (dmin m)      0.5625 -> 0.75
    Q5_K   8     32     q (d sc) - (dmin m)      0.6875 -> 1.25
    Q6_K   8     16     q (d sc), q in [-32, 31] 0.8203 -> 1.25
    Q8_0   8     32     q d                      1.0625 -> 1.0625
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from ...kernels.quant import QuantizedWeight, pack_int4
from .registry import Family, UnsupportedModelError

if TYPE_CHECKING:
    from gguf import ReaderTensor

FLOAT_TYPES = ("F32", "F16", "BF16")
# Bytes a weight of each type takes once read (the table above, "here"): integers, scales, offsets.
HELD_BYTES = {
    "Q4_0": 0.625,
    "Q4_1": 0.625,
    "Q4_K": 0.75,
    "Q5_K": 1.25,
    "Q6_K": 1.25,
    "Q8_0": 1.0625,
}
QUANT_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")


class UnsupportedGGUFTypeError(UnsupportedModelError):
    """A GGUF tensor type pagedctl does not run as stored."""


def read_tensor(tensor: ReaderTensor) -> QuantizedWeight | torch.Tensor:
    """One GGUF tensor: a `QuantizedWeight` of a quantized 2-D tensor, else a float32 tensor,
    in Hugging Face's shape `[rows, columns]` (rows not yet un-permuted)."""
    kind = tensor.tensor_type.name
    shape = tuple(reversed(tensor.shape.tolist()))
    if kind in FLOAT_TYPES:
        from gguf.quants import dequantize

        values = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        return torch.from_numpy(np.array(values, dtype=np.float32))
    if kind not in QUANT_TYPES:
        raise UnsupportedGGUFTypeError(
            f"GGUF tensor {tensor.name} has type {kind}, which pagedctl does not run; supported: "
            f"{', '.join(QUANT_TYPES + FLOAT_TYPES)} (or --quantization none to dequantize any "
            "type gguf reads)"
        )
    if len(shape) != 2:
        raise UnsupportedGGUFTypeError(f"GGUF tensor {tensor.name}: {kind} of shape {shape}")
    rows, cols = shape
    blocks = np.array(tensor.data).view(np.uint8).reshape(rows, -1)  # a writable copy
    return _READERS[kind](blocks, rows, cols)


def _f16(raw: np.ndarray) -> torch.Tensor:
    """Little-endian float16 bytes `[..., 2]` as a float16 tensor `[...]`."""
    return torch.from_numpy(np.array(raw).view(np.float16)[..., 0])


def _as_blocks(blocks: np.ndarray, rows: int, cols: int, block: int) -> np.ndarray:
    """`[rows, bytes]` as `[rows, cols // block, bytes per block]`."""
    if cols % block:
        raise UnsupportedGGUFTypeError(f"a row of {cols} values is not whole blocks of {block}")
    return blocks.reshape(rows, cols // block, -1)


def _nibbles_halves(qs: np.ndarray) -> np.ndarray:
    """ggml's 4-bit order: byte j of a run holds value j (low nibble) and j + len (high)."""
    return np.concatenate((qs & 0x0F, qs >> 4), axis=-1)


def _q4_0(blocks: np.ndarray, rows: int, cols: int) -> QuantizedWeight:
    b = _as_blocks(blocks, rows, cols, 32)
    d = _f16(b[..., 0:2])
    q = torch.from_numpy(_nibbles_halves(b[..., 2:18]).reshape(rows, cols))
    return QuantizedWeight(4, 32, pack_int4(q), d, -8 * d)


def _q4_1(blocks: np.ndarray, rows: int, cols: int) -> QuantizedWeight:
    b = _as_blocks(blocks, rows, cols, 32)
    d, m = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    q = torch.from_numpy(_nibbles_halves(b[..., 4:20]).reshape(rows, cols))
    return QuantizedWeight(4, 32, pack_int4(q), d, m)


def _q8_0(blocks: np.ndarray, rows: int, cols: int) -> QuantizedWeight:
    b = _as_blocks(blocks, rows, cols, 32)
    q = torch.from_numpy(np.ascontiguousarray(b[..., 2:34]).view(np.int8).reshape(rows, cols))
    return QuantizedWeight(8, 32, q, _f16(b[..., 0:2]))


def _k_scales(b: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K super-blocks `[rows, n, bytes]`: scales and offsets `[rows, n * 8]` float32."""
    from gguf.quants import Q4_K

    rows, n = b.shape[:2]
    d = _f16(b[..., 0:2]).float()[..., None]
    dmin = _f16(b[..., 2:4]).float()[..., None]
    sc, m = Q4_K.get_scale_min(np.ascontiguousarray(b[..., 4:16]).reshape(rows * n, 12))
    sc = torch.from_numpy(sc.astype(np.float32)).view(rows, n, 8)
    m = torch.from_numpy(m.astype(np.float32)).view(rows, n, 8)
    return (d * sc).view(rows, n * 8), (-dmin * m).view(rows, n * 8)


def _q4_k(blocks: np.ndarray, rows: int, cols: int) -> QuantizedWeight:
    b = _as_blocks(blocks, rows, cols, 256)
    scales, offsets = _k_scales(b)
    qs = b[..., 16:144].reshape(rows, -1, 4, 32)  # 4 runs of 32 bytes: 64 values each
    q = torch.from_numpy(_nibbles_halves(qs).reshape(rows, cols))
    return QuantizedWeight(4, 32, pack_int4(q), scales, offsets)


def _q5_k(blocks: np.ndarray, rows: int, cols: int) -> QuantizedWeight:
    b = _as_blocks(blocks, rows, cols, 256)
    scales, offsets = _k_scales(b)
    qh = b[..., 16:48]  # bit i of byte l: the fifth bit of value l of sub-block i
    qs = b[..., 48:176].reshape(rows, -1, 4, 32)
    low = _nibbles_halves(qs).reshape(rows, -1, 8, 32)
    high = (qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1
    q = (low | (high << 4)).astype(np.int8).reshape(rows, cols)
    return QuantizedWeight(8, 32, torch.from_numpy(q), scales, offsets)


def _q6_k(blocks: np.ndarray, rows: int, cols: int) -> QuantizedWeight:
    b = _as_blocks(blocks, rows, cols, 256)
    ql = b[..., 0:128].reshape(rows, -1, 2, 2, 32)  # 2 halves of 128 values, 2 runs of 32 bytes
    qh = b[..., 128:192].reshape(rows, -1, 2, 1, 32)
    sc = np.ascontiguousarray(b[..., 192:208]).view(np.int8).astype(np.float32)
    d = _f16(b[..., 208:210]).float()[..., None]
    low = np.concatenate((ql & 0x0F, ql >> 4), axis=-2)  # [.., half, 4 quarters, 32]
    high = (qh >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3
    q = ((low | (high << 4)).astype(np.int8) - 32).reshape(rows, cols)
    scales = (d * torch.from_numpy(sc)).reshape(rows, cols // 16)
    return QuantizedWeight(8, 16, torch.from_numpy(q), scales)


_READERS = {
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q8_0": _q8_0,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
}


def held_bytes(path: Path, dtype_bytes: int) -> int:
    """Bytes the engine holds for a GGUF's tensors run as stored (float ones in a dtype of
    `dtype_bytes`), from its header alone: `HELD_BYTES` per quantized weight."""
    from gguf import GGUFReader

    total = 0.0
    for t in GGUFReader(path).tensors:
        if t.name == "rope_freqs.weight":
            continue  # read into the rotary table, not held
        numel = int(np.prod([int(d) for d in t.shape]))
        total += numel * HELD_BYTES.get(t.tensor_type.name, dtype_bytes)
    return int(total)


def check_types(path: Path) -> dict[str, int]:
    """The GGUF's tensor types and their counts; refuses a type not run as stored, by name,
    before anything is loaded."""
    from gguf import GGUFReader

    kinds: dict[str, int] = {}
    for t in GGUFReader(path).tensors:
        kinds[t.tensor_type.name] = kinds.get(t.tensor_type.name, 0) + 1
    bad = sorted(k for k in kinds if k not in QUANT_TYPES + FLOAT_TYPES)
    if bad:
        raise UnsupportedGGUFTypeError(
            f"{path.name} holds tensor types {', '.join(bad)}, which pagedctl does not run as "
            f"stored; supported: {', '.join(QUANT_TYPES + FLOAT_TYPES)}. Use --quantization none "
            "to dequantize it at load"
        )
    return kinds


def iter_gguf_weights(
    path: Path, num_heads: int, num_kv_heads: int, family: Family
) -> Iterator[tuple[str, QuantizedWeight | torch.Tensor]]:
    """`(Hugging Face name, weight)` of every tensor of a GGUF file, quantized ones as stored,
    q/k rows in Hugging Face's order where the family's converter permuted them, Gemma's norms
    without the 1 llama.cpp added."""
    from gguf import GGUFReader

    from .gguf import gguf_norm_offset, hf_tensor_name, unpermute_qk

    heads = {"attn_q": num_heads, "attn_k": num_kv_heads}
    unpermute = family.gguf_unpermute_qk
    for t in GGUFReader(path).tensors:
        name = hf_tensor_name(t.name, family)
        if t.name == "rope_freqs.weight":
            continue  # in config.json's rope_scaling (`gguf.llama3_rope_from_freqs`)
        if name is None:
            raise UnsupportedModelError(f"GGUF tensor {t.name!r} has no Hugging Face counterpart")
        w = read_tensor(t)
        part = t.name.split(".")[2] if t.name.startswith("blk.") else ""
        if unpermute and part in heads:
            order = unpermute_qk(np.arange(w.shape[0]), heads[part])
            w = w.rows(torch.from_numpy(order)) if isinstance(w, QuantizedWeight) else w[order]
        offset = gguf_norm_offset(family, t.name)
        if offset:  # norms are stored as floats
            w = w - offset
        yield name, w

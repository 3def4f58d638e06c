"""Quantized linear layers on the CPU (and anywhere the Triton kernels do not serve).

- 4 bits: torch's `_weight_int4pack_mm_for_cpu`, the weight repacked once into its layout
  (`Int4Packed`). It computes in bfloat16: a float32 model's activations are rounded to bfloat16
  on the way in, and the scales and offsets to bfloat16 too (8 significant bits; the 4-bit step
  they multiply is 1/15 of a group's range). It needs output rows in multiples of 16 and
  groups of 32, 64, 128 or 256; other 4-bit weights take the tiled path.
- 8 bits and the rest: `tiled_linear`, a few hundred output rows at a time dequantized into the
  activations' dtype and multiplied, so the float copy of a tile stays in the cache and the
  weight is read once, as int8.

Measured on a 2-core AVX2 machine (torch 2.13, the shapes of SmolLM2-135M): the int4 kernel is
~2x float32 MKL at one row and slower from ~16 rows on; the int8 tiled path matches float32 at
one row and is faster from 8 rows on (docs/quantization.md has the table).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .quant import QuantizedWeight, dequantize, integers

TILE_ROWS = 512  # output rows dequantized per matmul in `tiled_linear`
INT4_GROUPS = (32, 64, 128, 256)  # group sizes torch's CPU int4 matmul takes
INT4_ROW_MULTIPLE = 16


@dataclass(frozen=True)
class Int4Packed:
    """A 4-bit weight in the layout of torch's CPU int4 matmul.

    Attributes:
        packed: `_convert_weight_to_int4pack_for_cpu`'s uint8 `[out, in // 2]`.
        scales_and_zeros: bfloat16 `[in // group, out, 2]`: `w = (q - 8) * scale + zero`.
        group_size: input features per scale.
    """

    packed: Tensor
    scales_and_zeros: Tensor
    group_size: int

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales_and_zeros.nbytes


def int4_packs(weight: QuantizedWeight) -> bool:
    """Whether torch's CPU int4 matmul takes this weight."""
    out, _ = weight.shape
    return (
        weight.bits == 4
        and weight.group_size in INT4_GROUPS
        and out % INT4_ROW_MULTIPLE == 0
        and hasattr(torch, "_convert_weight_to_int4pack_for_cpu")
    )


def pack_int4(weight: QuantizedWeight) -> Int4Packed:
    """Repack a 4-bit weight for `int4_linear` (see `int4_packs`)."""
    q = integers(weight).to(torch.int32)
    packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
    scales = weight.scales.float()
    offsets = torch.zeros_like(scales) if weight.offsets is None else weight.offsets.float()
    zeros = offsets + 8 * scales  # torch's form: (q - 8) * scale + zero
    sz = torch.stack((scales.T, zeros.T), dim=-1).to(torch.bfloat16).contiguous()
    return Int4Packed(packed, sz, weight.group_size)


def int4_linear(x: Tensor, weight: Int4Packed, bias: Tensor | None = None) -> Tensor:
    """`x @ w.T (+ bias)` through torch's CPU int4 matmul, in bfloat16, returned in x's dtype."""
    y = torch._weight_int4pack_mm_for_cpu(
        x.to(torch.bfloat16), weight.packed, weight.group_size, weight.scales_and_zeros
    ).to(x.dtype)
    return y if bias is None else y + bias


def tiled_linear(
    x: Tensor, weight: QuantizedWeight, bias: Tensor | None = None, invariant: bool = False
) -> Tensor:
    """`x @ dequantize(weight).T (+ bias)`, `TILE_ROWS` output rows dequantized at a time into
    x's dtype. `invariant`: each tile's matmul through `batch_invariant.linear`, so a row's
    bits do not depend on the other rows of `x`."""
    from . import batch_invariant

    out_features, _ = weight.shape
    y = x.new_empty(x.shape[0], out_features)
    for start in range(0, out_features, TILE_ROWS):
        rows = slice(start, min(start + TILE_ROWS, out_features))
        tile = dequantize(_rows(weight, rows), x.dtype)
        b = None if bias is None else bias[rows]
        if invariant:
            y[:, rows] = batch_invariant.linear(x, tile, None, b)
        else:
            y[:, rows] = F.linear(x, tile, b)
    return y


def _rows(weight: QuantizedWeight, rows: slice) -> QuantizedWeight:
    offsets = None if weight.offsets is None else weight.offsets[rows]
    return QuantizedWeight(
        weight.bits, weight.group_size, weight.qdata[rows], weight.scales[rows], offsets
    )

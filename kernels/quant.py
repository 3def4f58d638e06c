"""Weights kept in integers: one layout every checkpoint format is read into, its reference.

A `QuantizedWeight` is a linear layer's weight `[out, in]` as small integers with a scale and an
offset per group of `group_size` consecutive input features of each output row:

    w[n, k] = q[n, k] * scales[n, k // group_size] + offsets[n, k // group_size]

- 4 bits: `q` unsigned in [0, 15], two per byte: `qdata` uint8 `[out, in // 2]`, input feature
  `2j` in the low nibble of byte `j`, `2j + 1` in the high one.
- 8 bits: `q` signed in [-128, 127]: `qdata` int8 `[out, in]`.

Every format maps onto it without changing a value: GGUF Q4_0 (`q * d - 8 d`), Q4_1
(`q * d + m`), Q4_K (`q * d sc - dmin m`), Q8_0, Q5_K and Q6_K (their 5/6-bit integers fit 8 bits),
AWQ and GPTQ (`(q - z) s`), compressed-tensors (`(q - z) s`). `offsets` None means zero.
`scales`/`offsets` keep the dtype the loader chose (float16 where the file's scales are float16,
float32 where a product of two stored numbers needs it); the kernels compute in float32.

`dequantize` is the reference every kernel is tested against; `quantize` makes one from a float
weight (min-max, asymmetric for 4 bits, symmetric for 8).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

BITS = (4, 8)


@dataclass(frozen=True)
class QuantizedWeight:
    """A linear weight `[out, in]` as integers, scales and offsets per group (module docstring).

    Attributes:
        bits: 4 or 8.
        group_size: input features per scale; divides `in_features`.
        qdata: uint8 `[out, in // 2]` (4 bits) or int8 `[out, in]` (8 bits).
        scales: `[out, in // group_size]`, float16/bfloat16/float32.
        offsets: like `scales`, or None for zero.
    """

    bits: int
    group_size: int
    qdata: Tensor
    scales: Tensor
    offsets: Tensor | None = None

    def __post_init__(self) -> None:
        if self.bits not in BITS:
            raise ValueError(f"bits must be one of {BITS}, got {self.bits}")
        out, width = self.qdata.shape
        in_features = width * 2 if self.bits == 4 else width
        want = torch.uint8 if self.bits == 4 else torch.int8
        if self.qdata.dtype != want:
            raise ValueError(f"{self.bits}-bit qdata must be {want}, got {self.qdata.dtype}")
        if self.group_size <= 0 or in_features % self.group_size:
            raise ValueError(
                f"group_size {self.group_size} does not divide in_features {in_features}"
            )
        groups = (out, in_features // self.group_size)
        for name in ("scales", "offsets"):
            t = getattr(self, name)
            if t is not None and tuple(t.shape) != groups:
                raise ValueError(f"{name} shape {tuple(t.shape)} != {groups} (out, groups)")

    @property
    def shape(self) -> tuple[int, int]:
        """`(out_features, in_features)` of the float weight."""
        out, width = self.qdata.shape
        return out, width * 2 if self.bits == 4 else width

    @property
    def nbytes(self) -> int:
        """Bytes of integers, scales and offsets."""
        extra = 0 if self.offsets is None else self.offsets.nbytes
        return self.qdata.nbytes + self.scales.nbytes + extra

    def to(self, device: torch.device | str) -> QuantizedWeight:
        """The same weight on `device`."""
        offsets = None if self.offsets is None else self.offsets.to(device)
        return QuantizedWeight(
            self.bits, self.group_size, self.qdata.to(device), self.scales.to(device), offsets
        )

    def rows(self, index: Tensor) -> QuantizedWeight:
        """The output rows `index` (an embedding lookup, a permutation)."""
        offsets = None if self.offsets is None else self.offsets[index]
        return QuantizedWeight(
            self.bits, self.group_size, self.qdata[index], self.scales[index], offsets
        )


def integers(weight: QuantizedWeight) -> Tensor:
    """`q` as int16 `[out, in]` (unpacked for 4 bits)."""
    if weight.bits == 8:
        return weight.qdata.to(torch.int16)
    low = (weight.qdata & 0xF).to(torch.int16)
    high = (weight.qdata >> 4).to(torch.int16)
    return torch.stack((low, high), dim=-1).flatten(-2)


def pack_int4(q: Tensor) -> Tensor:
    """Unsigned 4-bit integers `[out, in]` (any integer dtype) as `qdata` (uint8 `[out, in//2]`)."""
    if q.shape[-1] % 2:
        raise ValueError(f"in_features must be even to pack 4-bit integers, got {q.shape[-1]}")
    q = q.to(torch.uint8)
    return q[..., 0::2] | (q[..., 1::2] << 4)


def dequantize(weight: QuantizedWeight, dtype: torch.dtype = torch.float32) -> Tensor:
    """The float weight `[out, in]` in `dtype`, computed in float32."""
    q = integers(weight).float()
    out, in_features = weight.shape
    groups = q.view(out, in_features // weight.group_size, weight.group_size)
    w = groups * weight.scales.float()[..., None]
    if weight.offsets is not None:
        w = w + weight.offsets.float()[..., None]
    return w.view(out, in_features).to(dtype)


def quantize(
    weight: Tensor, bits: int, group_size: int, scale_dtype: torch.dtype = torch.float16
) -> QuantizedWeight:
    """Round a float weight `[out, in]` to integers per group (round to nearest).

    4 bits: asymmetric min-max (offset the group's minimum, 16 levels up to its maximum);
    8 bits: symmetric (scale `max|w| / 127`, no offset). A group of equal values keeps them.
    """
    out, in_features = weight.shape
    if in_features % group_size:
        raise ValueError(f"group_size {group_size} does not divide in_features {in_features}")
    w = weight.detach().float().view(out, in_features // group_size, group_size)
    if bits == 8:
        scale = w.abs().amax(-1) / 127
        scale = torch.where(scale > 0, scale, torch.ones_like(scale)).to(scale_dtype)
        q = torch.clamp(torch.round(w / scale.float()[..., None]), -128, 127)
        return QuantizedWeight(8, group_size, q.view(out, in_features).to(torch.int8), scale)
    if bits != 4:
        raise ValueError(f"bits must be one of {BITS}, got {bits}")
    low, high = w.amin(-1), w.amax(-1)
    scale = (high - low) / 15
    scale = torch.where(scale > 0, scale, torch.ones_like(scale)).to(scale_dtype)
    offset = low.to(scale_dtype)
    q = torch.round((w - offset.float()[..., None]) / scale.float()[..., None]).clamp(0, 15)
    return QuantizedWeight(4, group_size, pack_int4(q.view(out, in_features)), scale, offset)


def reference_linear(x: Tensor, weight: QuantizedWeight, bias: Tensor | None = None) -> Tensor:
    """`x @ dequantize(weight).T (+ bias)` in `x`'s dtype: what every kernel must match."""
    y = x.float() @ dequantize(weight).to(x.device).T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def concat_rows(weights: list[QuantizedWeight]) -> QuantizedWeight:
    """Stack weights of one input width along the output rows (a fused q/k/v or gate/up), each
    brought exactly to the widest bits and the finest group of the set: 4-bit integers fit 8
    bits, and a group's scale repeats over its finer groups. Scales in float32 unless all agree."""
    bits = max(w.bits for w in weights)
    group = math.gcd(*(w.group_size for w in weights))
    dtypes = {w.scales.dtype for w in weights}
    scale_dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
    with_offsets = any(w.offsets is not None for w in weights)
    qdata, scales, offsets = [], [], []
    for w in weights:
        repeat = w.group_size // group
        s = w.scales.to(scale_dtype).repeat_interleave(repeat, dim=1)
        o = torch.zeros_like(s) if w.offsets is None else w.offsets.to(scale_dtype)
        qdata.append(w.qdata if w.bits == bits else integers(w).to(torch.int8))
        scales.append(s)
        offsets.append(o.repeat_interleave(repeat, dim=1) if w.offsets is not None else o)
    return QuantizedWeight(
        bits,
        group,
        torch.cat(qdata),
        torch.cat(scales),
        torch.cat(offsets) if with_offsets else None,
    )

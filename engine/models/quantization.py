"""Which weights load as integers, and the stream of checkpoint tensors that gives them.

`plan_quantization` reads the `quantization` setting against a model source, before anything
is loaded: `checkpoint` takes the checkpoint's own (a GGUF's block types run as stored), `auto`
the same where it pays (see the function), `none` dequantizes, `int8`/`int4` quantize 16/32-bit
projection weights at load (groups of the first of `GROUP_SIZES` that divides a layer's width,
else one per row). `weight_stream` yields `(Hugging Face name, tensor or QuantizedWeight)` for
the model's `load_weights`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from ...kernels.quant import QuantizedWeight, quantize
from ..core.config import QUANTIZATIONS, ConfigError
from .weights import ModelSource, iter_weights

CPU_FLOAT_SHARE = 0.25  # of the machine's memory dequantized weights may take under `auto`
GROUP_SIZES = (128, 64, 32)  # of on-the-fly quantization, the first that divides the width
_PROJECTIONS = ("_proj.weight",)  # tensors on-the-fly quantization rounds (not embeddings, head)


@dataclass(frozen=True)
class QuantPlan:
    """How a model's weights load.

    Attributes:
        method: "none" (floats), "gguf" (a GGUF's blocks as stored), "int8" or "int4".
        source_types: a GGUF's tensor types and counts (empty otherwise).
    """

    method: str
    source_types: tuple[tuple[str, int], ...] = ()

    @property
    def quantized(self) -> bool:
        return self.method != "none"

    def describe(self) -> str:
        """A few words for the start-up line: `gguf Q4_1 x210, Q8_0 x1`, `int4 g128`."""
        if self.method == "gguf":
            types = ", ".join(f"{k} x{n}" for k, n in self.source_types)
            return f"gguf ({types})"
        if self.method in ("int8", "int4"):
            return f"{self.method} g{GROUP_SIZES[0]} (at load)"
        return "none"


def plan_quantization(
    source: ModelSource, setting: str, device: torch.device, dtype: torch.dtype
) -> QuantPlan:
    """The plan for `source` under the `quantization` setting on `device`; refuses what cannot
    be done (an unknown setting, a GGUF tensor type not run as stored) before anything loads.

    `auto` keeps a checkpoint's integers on CUDA. On the CPU it dequantizes where the float
    weights take at most `CPU_FLOAT_SHARE` of the machine's memory: torch's CPU int4 matmul
    is ~2x float32 at one row but slower from ~16 rows (a 2-core AVX2 machine; the 32-request
    chat job ran 0.8x), so integers pay on the CPU when memory is what is short."""
    if setting not in QUANTIZATIONS:
        raise ConfigError(
            f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {setting!r}"
        )
    if setting == "none":
        return QuantPlan("none")
    if source.gguf_file is not None and source.load_format != "dummy":
        from .gguf_quant import QUANT_TYPES, check_types

        types = check_types(source.gguf_file)
        if setting in ("auto", "checkpoint"):
            if not any(k in QUANT_TYPES for k in types):
                return QuantPlan("none")
            if setting == "auto" and device.type == "cpu" and _floats_fit(source, dtype):
                return QuantPlan("none")
            return QuantPlan("gguf", tuple(sorted(types.items())))
        raise ConfigError(
            f"{source.gguf_file.name} is already quantized; use --quantization auto (its own "
            f"blocks) or none, not {setting}"
        )
    if setting in ("auto", "checkpoint"):
        return QuantPlan("none")
    return QuantPlan(setting)


def _floats_fit(source: ModelSource, dtype: torch.dtype) -> bool:
    """Whether the source's weights, dequantized to `dtype`, take at most `CPU_FLOAT_SHARE`
    of this machine's memory."""
    from .registry import expected_weight_shapes

    elements = sum(math.prod(s) for s in expected_weight_shapes(source.hf_config).values())
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return elements * dtype.itemsize <= CPU_FLOAT_SHARE * total


def weight_stream(
    plan: QuantPlan, source: ModelSource, model: object, seed: int
) -> Iterator[tuple[str, Tensor | QuantizedWeight]]:
    """The checkpoint's tensors as the plan loads them (random ones for a dummy source)."""
    if plan.method == "gguf":
        from .gguf_quant import iter_gguf_weights

        spec = model.spec
        yield from iter_gguf_weights(
            source.gguf_file, spec.num_heads, spec.num_kv_heads, spec.family.gguf_unpermute_qk
        )
        return
    weights = model.dummy_weights(seed) if source.load_format == "dummy" else iter_weights(source)
    if plan.method in ("int8", "int4"):
        weights = _quantize_projections(weights, 8 if plan.method == "int8" else 4)
    yield from weights


def _quantize_projections(
    weights: Iterable[tuple[str, Tensor]], bits: int
) -> Iterator[tuple[str, Tensor | QuantizedWeight]]:
    for name, w in weights:
        if name.endswith(_PROJECTIONS) and w.dim() == 2:
            width = w.shape[1]
            group = next((g for g in GROUP_SIZES if width % g == 0), width)
            yield name, quantize(w, bits, group)
        else:
            yield name, w

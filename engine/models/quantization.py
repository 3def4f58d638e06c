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

from ...kernels.quant import QuantizedWeight, dequantize, quantize
from ..core.config import QUANTIZATIONS, ConfigError
from .quant_formats import CheckpointQuant, checkpoint_quant, read_layer
from .registry import UnsupportedModelError
from .weights import ModelSource, iter_weights, weight_files

CPU_FLOAT_SHARE = 0.25  # of the machine's memory dequantized weights may take under `auto`
GROUP_SIZES = (128, 64, 32)  # of on-the-fly quantization, the first that divides the width
_PROJECTIONS = ("_proj.weight",)  # tensors on-the-fly quantization rounds (not embeddings, head)


@dataclass(frozen=True)
class QuantPlan:
    """How a model's weights load.

    Attributes:
        method: "none" (floats), "gguf" (a GGUF's blocks as stored), "awq", "gptq",
            "compressed-tensors" (a folder's integers as stored), "int8" or "int4".
        source_types: a GGUF's tensor types and counts (empty otherwise).
        stored: a folder's own quantization (`quant_formats`), read as stored or, with
            method "none", dequantized.
    """

    method: str
    source_types: tuple[tuple[str, int], ...] = ()
    stored: CheckpointQuant | None = None

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
        if self.stored is not None:
            how = "dequantized" if self.method == "none" else "as stored"
            return f"{self.stored.describe()} ({how})"
        return "none"


def plan_quantization(
    source: ModelSource, setting: str, device: torch.device, dtype: torch.dtype
) -> QuantPlan:
    """The plan for `source` under the `quantization` setting on `device`; refuses what cannot
    be done (an unknown setting, a GGUF tensor type not run as stored) before anything loads.

    `auto` keeps a checkpoint's integers on CUDA. On the CPU it dequantizes where the float
    weights take at most `CPU_FLOAT_SHARE` of the machine's memory: float32 there gives
    transformers' tokens exactly, integers other answers (the bundled model's 32-request chat
    job: 15 of 32 identical, 1.17x the throughput on a 2-core AVX2 machine); `checkpoint`
    asks for the integers wherever they fit. Where memory is short, integers it is.
    """
    if setting not in QUANTIZATIONS:
        raise ConfigError(
            f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {setting!r}"
        )
    if setting == "none":
        return QuantPlan("none", stored=_folder_quant(source))
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
    stored = _folder_quant(source)
    if stored is not None:
        if setting in ("int8", "int4"):
            raise ConfigError(
                f"{source.name} is already quantized ({stored.describe()}); use --quantization "
                f"auto (its own integers) or none, not {setting}"
            )
        if setting == "auto" and device.type == "cpu" and _floats_fit(source, dtype):
            return QuantPlan("none", stored=stored)
        return QuantPlan(stored.method, stored=stored)
    if setting in ("auto", "checkpoint"):
        return QuantPlan("none")
    return QuantPlan(setting)


def _folder_quant(source: ModelSource) -> CheckpointQuant | None:
    """The `quantization_config` of a folder's config.json, checked (None without one)."""
    if source.load_format == "dummy":
        return None
    config = getattr(source.hf_config, "quantization_config", None)
    return checkpoint_quant({"quantization_config": config}) if config else None


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
    if plan.stored is not None:
        yield from _folder_weights(plan, source, model.dtype)
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


def _folder_weights(
    plan: QuantPlan, source: ModelSource, dtype: torch.dtype
) -> Iterator[tuple[str, Tensor | QuantizedWeight]]:
    """A quantized folder's tensors: each quantized layer's stored tensors read into one
    `QuantizedWeight` (`read_layer`) once all have come, dequantized to `dtype` under plan
    "none"; the other tensors as they are."""
    from safetensors import safe_open

    from .registry import expected_weight_shapes

    quant = plan.stored
    shapes = expected_weight_shapes(source.hf_config)
    files = weight_files(source.weights_dir)
    keys: dict[str, set[str]] = {}  # a quantized layer -> the suffixes the files hold for it
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                layer, _, suffix = key.rpartition(".")
                if suffix in quant.suffixes and quant.quantized(layer):
                    keys.setdefault(layer, set()).add(suffix)
    pending: dict[str, dict[str, Tensor]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118
                layer, _, suffix = key.rpartition(".")
                if layer not in keys:
                    yield key, f.get_tensor(key)
                    continue
                parts = pending.setdefault(layer, {})
                parts[suffix] = f.get_tensor(key)
                if parts.keys() == keys[layer]:
                    name = f"{layer}.weight"
                    if name not in shapes:
                        raise UnsupportedModelError(f"{layer}: a quantized layer the model lacks")
                    out_features, in_features = shapes[name]
                    w = read_layer(quant, layer, pending.pop(layer), out_features, in_features)
                    yield name, w if plan.method != "none" else dequantize(w, dtype)

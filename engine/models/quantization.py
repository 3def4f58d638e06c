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
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from ...kernels.quant import QuantizedWeight, dequantize, quantize
from ..core.config import QUANTIZATIONS, ConfigError
from .quant_formats import CheckpointQuant, checkpoint_quant, read_layer
from .registry import UnsupportedModelError
from .weights import ModelSource, iter_weights, weight_files

CUDA_FLOAT_SHARE = 0.5  # of a card's memory dequantized weights may take under `auto`
CPU_FLOAT_SHARE = 0.25  # of the machine's memory, on the CPU
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

    `auto` dequantizes where the float weights fit `float_budget` and keeps the integers where
    they do not (a 7B model on a 16 GB T4). On CUDA the Triton weight-only matmul loses to
    float16 `F.linear` at small models' shapes (results/quant-kernels-h100.md). On the CPU the
    integers run 1.17x float32 on the bundled model (results/quant-cpu.md), but float32 gives
    transformers' tokens and the same tokens whatever batch a request lands in, which a job
    resumed after a kill relies on; `checkpoint` asks for the integers wherever they load.
    """
    stored = _folder_quant(source)
    gguf = source.gguf_file if source.load_format != "dummy" else None
    types: dict[str, int] = {}
    if gguf is not None and setting != "none":
        from .gguf_quant import check_types

        types = check_types(gguf)
    own = own_quantization(gguf, stored, types) if types or gguf is None else "none"
    if own == "gguf":
        what = f"{gguf.name} is already quantized"
    else:
        what = f"{source.name} is already quantized ({stored.describe() if stored else own})"
    card = floats = None
    if setting == "auto" and own != "none":
        from .registry import expected_weight_shapes

        shapes = expected_weight_shapes(source.hf_config).values()
        floats = sum(math.prod(s) for s in shapes) * dtype.itemsize
        card = float_budget(device)
    method = choose_method(setting, own, what, floats, card)
    if method == "gguf":
        return QuantPlan("gguf", tuple(sorted(types.items())))
    return QuantPlan(method, stored=stored)


def choose_method(
    setting: str,
    own: str,
    what: str = "the checkpoint is already quantized",
    float_bytes: int | None = None,
    budget_bytes: int | None = None,
) -> str:
    """The `QuantPlan.method` of the `quantization` setting for a checkpoint whose own integers
    are `own` ("none" for floats): `auto` keeps them, except where the weights' `float_bytes`
    dequantized fit the device's `budget_bytes` (`float_budget`); `int8`/`int4` are refused for
    a checkpoint already quantized (`what` says which)."""
    if setting not in QUANTIZATIONS:
        raise ConfigError(
            f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {setting!r}"
        )
    if setting == "none" or (own == "none" and setting in ("auto", "checkpoint")):
        return "none"
    if setting in ("int8", "int4"):
        if own != "none":
            raise ConfigError(
                f"{what}; use --quantization auto (its own integers) or none, not {setting}"
            )
        return setting
    auto = setting == "auto" and budget_bytes is not None and float_bytes is not None
    return "none" if auto and float_bytes <= budget_bytes else own


def _folder_quant(source: ModelSource) -> CheckpointQuant | None:
    """The `quantization_config` of a folder's config.json, checked (None without one)."""
    if source.load_format == "dummy":
        return None
    config = getattr(source.hf_config, "quantization_config", None)
    return checkpoint_quant({"quantization_config": config}) if config else None


def own_quantization(
    gguf_file: Path | None,
    stored: CheckpointQuant | None,
    types: Mapping[str, int] | None = None,
) -> str:
    """The method of a checkpoint's own integers ("gguf", "awq", ...), or "none": a GGUF with
    quantized blocks (its types checked), else a folder's `quantization_config`."""
    if gguf_file is not None:
        from .gguf_quant import QUANT_TYPES, check_types

        types = types or check_types(gguf_file)  # the header read once where given
        return "gguf" if any(k in QUANT_TYPES for k in types) else "none"
    return stored.method if stored is not None else "none"


def float_budget(device: torch.device, card_bytes: int | None = None) -> int:
    """The most bytes of float weights `auto` dequantizes on a device: `CUDA_FLOAT_SHARE` of
    a card's memory (`card_bytes`, else the card's own), `CPU_FLOAT_SHARE` of the machine's."""
    if device.type == "cuda":
        total = card_bytes or torch.cuda.get_device_properties(device).total_memory
        return int(CUDA_FLOAT_SHARE * total)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(CPU_FLOAT_SHARE * total)


def planned_weights_bytes(
    shapes: Mapping[str, tuple[int, ...]],
    method: str,
    dtype_bytes: int,
    stored: CheckpointQuant | None = None,
    gguf_file: Path | None = None,
) -> int:
    """The bytes the engine holds for a model's weights (`shapes`: every tensor by its Hugging
    Face name, a tied head once) loaded by `method` (a `QuantPlan.method`), before loading:
    what `LlamaForCausalLM.weights_bytes` reports once loaded, up to the layout's rounding.

    Floats take `dtype_bytes` each. `int8`/`int4` at load: the projections' integers plus a
    float16 scale (and for 4 bits a float16 offset) per group (`GROUP_SIZES`). A folder's own
    integers: its bits plus its scales' 2 bytes and, where the layout keeps offsets (4 bits,
    or an asymmetric 8), 4 bytes per group. A GGUF: `gguf_quant.HELD_BYTES` per weight.
    """
    if method == "gguf":
        from .gguf_quant import held_bytes

        assert gguf_file is not None
        return held_bytes(gguf_file, dtype_bytes)
    total = 0.0
    for name, shape in shapes.items():
        numel = math.prod(shape)
        layer = name.removesuffix(".weight")
        if len(shape) != 2 or layer == name:
            total += numel * dtype_bytes
        elif method in ("int8", "int4") and name.endswith(_PROJECTIONS):
            bits, width = (8 if method == "int8" else 4), shape[1]
            group = next((g for g in GROUP_SIZES if width % g == 0), width)
            extra = 2 if bits == 8 else 4  # float16 scale, and offset for 4 bits
            total += numel * bits / 8 + numel / group * extra
        elif (
            stored is not None
            and method == stored.method
            and name.endswith((*_PROJECTIONS, "lm_head.weight"))
            and stored.quantized(layer)
        ):
            group = stored.group_size or shape[1]
            extra = 2 + (4 if stored.bits == 4 or not stored.symmetric else 0)
            total += numel * stored.bits / 8 + numel / group * extra
        else:
            total += numel * dtype_bytes
    return int(total)


def weight_stream(
    plan: QuantPlan, source: ModelSource, model: object, seed: int
) -> Iterator[tuple[str, Tensor | QuantizedWeight]]:
    """The checkpoint's tensors as the plan loads them (random ones for a dummy source)."""
    if plan.method == "gguf":
        from .gguf_quant import iter_gguf_weights

        spec = model.spec
        yield from iter_gguf_weights(
            source.gguf_file, spec.num_heads, spec.num_kv_heads, spec.family
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

"""Quantized checkpoint folders as AutoAWQ, AutoGPTQ/GPTQModel and llm-compressor write them.

Each writer takes a float state dict of a Llama-style model (Hugging Face names) and its config
dict, rounds the decoder's projections to nearest (min-max over each group, as each tool's
quantizer does before calibration refines it), and writes `config.json` with the tool's own
`quantization_config` and `model.safetensors` with the tool's packed tensors; every other tensor
(norms, embeddings, lm_head) is float16. It returns the dequantized weight of each quantized
layer by module name, in float32 computed exactly from the stored integers and scales, except
compressed-tensors', which the package's own decompressor computes (in the scale's dtype).

The packing is written from each tool's packing code, word by word, without the readers in
engine/models/quant_formats.py; the compressed-tensors folder is the package's own compressors'.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file
from torch import Tensor

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's GEMM: the output column in each nibble slot


def projections(state_dict: Mapping[str, Tensor]) -> list[str]:
    """Module names of the decoder layers' linear projections (not embeddings, not lm_head)."""
    return [
        n.removesuffix(".weight")
        for n, t in state_dict.items()
        if n.startswith("model.layers.") and n.endswith("_proj.weight") and t.dim() == 2
    ]


def _write(
    folder: Path,
    state_dict: Mapping[str, Tensor],
    config: Mapping[str, Any],
    quantization_config: Mapping[str, Any] | None,
    layers: Mapping[str, Mapping[str, Tensor]],
) -> None:
    """config.json and model.safetensors: `layers`' tensors in place of their `.weight`."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, t in state_dict.items():
        module = name.removesuffix(".weight")
        if module in layers:
            tensors |= {f"{module}.{k}": v.contiguous() for k, v in layers[module].items()}
        else:
            tensors[name] = t.detach().to(torch.float16).contiguous()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    full = {**config, "torch_dtype": "float16"}
    if quantization_config is not None:
        full["quantization_config"] = dict(quantization_config)
    (folder / "config.json").write_text(json.dumps(full, indent=2, sort_keys=True))


def _int32(words: Tensor) -> Tensor:
    """Unsigned 32-bit words held in int64 as int32 (the same bits)."""
    return torch.from_numpy(words.numpy().astype(np.uint32).view(np.int32))


def _pack_rows(values: Tensor, bits: int) -> Tensor:
    """AutoGPTQ's `pack`: `[n, cols]` as int64 words `[n * bits / 32, cols]`, word `r` holding
    rows `r * P + j` (P = 32 / bits) in its bits `[j bits, (j + 1) bits)`."""
    per = 32 // bits
    words = torch.zeros(values.shape[0] // per, values.shape[1], dtype=torch.int64)
    for j in range(per):
        words |= values[j::per].long() << (bits * j)
    return words


def _pack_awq(values: Tensor) -> Tensor:
    """AutoAWQ's `WQLinear_GEMM.from_linear`: 4-bit `[rows, cols]` as int32 `[rows, cols / 8]`,
    nibble `i` of word `c` holding column `8 c + AWQ_ORDER[i]`."""
    words = torch.zeros(values.shape[0], values.shape[1] // 8, dtype=torch.int64)
    for i, column in enumerate(AWQ_ORDER):
        words |= values[:, column::8].long() << (4 * i)
    return _int32(words)


def write_awq(
    folder: Path,
    state_dict: Mapping[str, Tensor],
    config: Mapping[str, Any],
    group_size: int = 32,
    modules_to_not_convert: list[str] | None = None,
) -> dict[str, Tensor]:
    """An AutoAWQ 4-bit GEMM checkpoint (`pseudo_quantize_tensor` with zero points, in float16);
    `modules_to_not_convert` are substrings of the module names kept float."""
    layers, expected = {}, {}
    for module in projections(state_dict):
        if any(key in module for key in modules_to_not_convert or ()):
            continue
        w = state_dict[f"{module}.weight"].detach().to(torch.float16)
        out, inp = w.shape
        g = inp if group_size == -1 else group_size
        groups = w.reshape(out, inp // g, g)
        high, low = groups.amax(-1, keepdim=True), groups.amin(-1, keepdim=True)
        scales = (high - low).clamp(min=1e-5) / 15
        zeros = (-torch.round(low / scales)).clamp(0, 15)
        q = torch.clamp(torch.round(groups / scales) + zeros, 0, 15)
        expected[module] = ((q - zeros).float() * scales.float()).reshape(out, inp)
        q, scales, zeros = q.reshape(out, inp).int(), scales[..., 0], zeros[..., 0].int()
        layers[module] = {
            "qweight": _pack_awq(q.T),
            "qzeros": _pack_awq(zeros.T),
            "scales": scales.T.contiguous(),
        }
    quantization_config = {  # AutoAWQ's AwqConfig.to_transformers_dict()
        "quant_method": "awq",
        "zero_point": True,
        "group_size": group_size,
        "bits": 4,
        "version": "gemm",
        "modules_to_not_convert": modules_to_not_convert,
    }
    _write(folder, state_dict, config, quantization_config, layers)
    return expected


def _gptq_params(x: Tensor, bits: int, sym: bool) -> tuple[Tensor, Tensor]:
    """AutoGPTQ's `Quantizer.find_params` over the last dim of float32 `x`: (scale, zero)."""
    maxq = 2**bits - 1
    low, high = x.amin(-1).clamp(max=0), x.amax(-1).clamp(min=0)
    if sym:
        high = torch.maximum(low.abs(), high)
        low = torch.where(low < 0, -high, low)
    empty = (low == 0) & (high == 0)
    low, high = torch.where(empty, -1.0, low), torch.where(empty, 1.0, high)
    scale = (high - low) / maxq
    zero = torch.full_like(scale, (maxq + 1) / 2) if sym else torch.round(-low / scale)
    return scale, zero


def write_gptq(
    folder: Path,
    state_dict: Mapping[str, Tensor],
    config: Mapping[str, Any],
    *,
    tool: str = "gptqmodel",
    bits: int = 4,
    group_size: int = 32,
    sym: bool = True,
    checkpoint_format: str = "gptq",
    desc_act: bool = False,
    static_groups: bool = False,
    dynamic: dict[str, dict] | None = None,
    positive_groups: bool = False,
) -> dict[str, Tensor]:
    """A GPTQ checkpoint as `tool` ("auto-gptq", always v1, or "gptqmodel") writes it.

    `desc_act` without `static_groups` forms the groups over a random column order (act-order:
    `g_idx` is not `k // group_size`); `dynamic` takes GPTQModel's "-:regex" skips;
    `positive_groups` makes each layer's first group non-negative, so asymmetric zeros of 0 occur.
    """
    if tool == "auto-gptq" and (checkpoint_format != "gptq" or dynamic):
        raise ValueError("AutoGPTQ writes only v1 without dynamic")
    skipped = [key[2:] for key in dynamic or {}]
    layers, expected = {}, {}
    generator = torch.Generator().manual_seed(0)
    for module in projections(state_dict):
        if any(re.match(pattern, module) for pattern in skipped):
            continue
        w = state_dict[f"{module}.weight"].detach().to(torch.float16).float()
        out, inp = w.shape
        g = inp if group_size == -1 else group_size
        if positive_groups:
            w[:, :g] = w[:, :g].abs()
        order = torch.arange(inp)
        if desc_act and not static_groups:
            order = torch.randperm(inp, generator=generator)
        g_idx = torch.empty(inp, dtype=torch.int32)
        g_idx[order] = torch.arange(inp, dtype=torch.int32) // g
        groups = w[:, order].reshape(out, inp // g, g)
        scale, zero = _gptq_params(groups, bits, sym)
        scale = scale.half()  # stored float16; the integers are rounded against it
        q = torch.clamp(
            torch.round(groups / scale.float()[..., None]) + zero[..., None], 0, 2**bits - 1
        )
        q_cols = torch.empty(out, inp)
        q_cols[:, order] = q.reshape(out, inp)
        z, s = zero[:, g_idx.long()], scale.float()[:, g_idx.long()]
        expected[module] = (q_cols - z) * s
        qzeros = _pack_rows(zero.int(), bits).T  # [groups, out * bits / 32]
        if checkpoint_format == "gptq":  # GPTQModel's v2 -> v1: minus one per value, per word
            qzeros = (qzeros - sum(1 << (bits * i) for i in range(32 // bits))) % 2**32
        layers[module] = {
            "qweight": _int32(_pack_rows(q_cols.int().T, bits)),
            "qzeros": _int32(qzeros.contiguous()),
            "scales": scale.T.contiguous(),
            "g_idx": g_idx,
        }
    quantization_config = _gptq_config(
        tool, bits, group_size, sym, checkpoint_format, desc_act, static_groups, dynamic
    )
    _write(folder, state_dict, config, quantization_config, layers)
    return expected


def _gptq_config(
    tool: str,
    bits: int,
    group_size: int,
    sym: bool,
    checkpoint_format: str,
    desc_act: bool,
    static_groups: bool,
    dynamic: dict[str, dict] | None,
) -> dict[str, Any]:
    """AutoGPTQ 0.7's `BaseQuantizeConfig.to_dict()` or GPTQModel 2's `QuantizeConfig.to_dict()`."""
    if tool == "auto-gptq":
        return {
            "bits": bits,
            "group_size": group_size,
            "damp_percent": 0.01,
            "desc_act": desc_act,
            "static_groups": static_groups,
            "sym": sym,
            "true_sequential": True,
            "model_name_or_path": None,
            "model_file_base_name": "model",
            "quant_method": "gptq",
            "checkpoint_format": "gptq",
        }
    written = {
        "bits": bits,
        "dynamic": dynamic,
        "group_size": group_size,
        "desc_act": desc_act,
        "sym": sym,
        "lm_head": False,
        "quant_method": "gptq",
        "checkpoint_format": checkpoint_format,
        "pack_dtype": "int32",
        "meta": {
            "quantizer": ["gptqmodel:2.2.0"],
            "uri": "https://github.com/modelcloud/gptqmodel",
            "damp_percent": 0.01,
            "damp_auto_increment": 0.0025,
            "static_groups": static_groups,
            "true_sequential": True,
            "mse": 0.0,
        },
    }
    return {k: v for k, v in written.items() if v not in (None, {})}


def write_compressed_tensors(
    folder: Path,
    state_dict: Mapping[str, Tensor],
    config: Mapping[str, Any],
    *,
    bits: int = 4,
    group_size: int | None = 32,
    symmetric: bool = True,
    fmt: str = "pack-quantized",
    ignore: Iterable[str] = ("lm_head",),
    dtype: torch.dtype = torch.float16,
) -> dict[str, Tensor]:
    """An llm-compressor W{bits}A16 checkpoint (min-max observer; `group_size` None: per channel)
    compressed by the compressed-tensors package's own compressor for `fmt`."""
    from compressed_tensors.compressors import BaseCompressor, ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
    )
    from compressed_tensors.quantization.utils import calculate_qparams
    from compressed_tensors.utils.match import match_name

    strategy = "group" if group_size else "channel"
    args = QuantizationArgs(
        num_bits=bits,
        type="int",
        symmetric=symmetric,
        strategy=strategy,
        group_size=group_size,
        observer="minmax",
    )
    scheme = QuantizationScheme(targets=["Linear"], weights=args, format=fmt)
    compressor = BaseCompressor.get_value_from_registry(fmt)
    layers, expected = {}, {}
    for module in projections(state_dict):
        if any(match_name(module, target) for target in ignore):
            continue
        w = state_dict[f"{module}.weight"].detach().to(dtype)
        out, inp = w.shape
        groups = w.reshape(out, inp // (group_size or inp), -1)
        scale, zero_point = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
        compressed = compressor.compress(
            {"weight": w, "weight_scale": scale, "weight_zero_point": zero_point}, scheme
        )
        layers[module] = compressed
        expected[module] = compressor.decompress(compressed, scheme)["weight"]
    quantization_config = QuantizationConfig(
        config_groups={"group_0": scheme},
        format=fmt,
        quantization_status="compressed",
        ignore=list(ignore),
    )
    _write(folder, state_dict, config, None, layers)
    ModelCompressor(quantization_config=quantization_config).update_config(str(folder))
    return expected

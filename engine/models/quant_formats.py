"""Quantized checkpoint folders (AWQ, GPTQ, compressed-tensors) read into `QuantizedWeight`.

`checkpoint_quant` reads config.json's `quantization_config` into a `CheckpointQuant`, or refuses
it naming what it is and what pagedctl reads; `read_layer` turns one linear layer's stored tensors
into the integer layout of `kernels.quant` without changing a value. Every format here stores
`w = (q - z) s`, which is `q s + (-z s)`: `scales` keep their stored dtype, `offsets` are
float32 (a small integer times a 16-bit float is exact there), None where all are zero
(symmetric 8-bit).

Layouts (`out`, `in`: the float weight's features; `g`: the group size, `in` per channel; `P`:
`32 // bits` values per int32 word, value `i` of a word in its bits `[i bits, (i + 1) bits)`):

    AWQ gemm     qweight int32 [in, out/8], qzeros int32 [in/g, out/8], scales [in/g, out];
                 the 8 values of a word are output columns 0 2 4 6 1 3 5 7 of its 8.
    GPTQ         qweight int32 [in/P, out] (packed along in), qzeros int32 [in/g, out/P],
                 scales [in/g, out], g_idx int32 [in]; v1 ("gptq") stores the zeros minus one.
    compressed-  pack-quantized: weight_packed int32 [out, in/P] (packed along in, signed q stored
    tensors      as q + 2^(bits-1)), weight_zero_point int32 [out/P, groups] (packed along out,
                 likewise; asymmetric only), weight_scale [out, groups], weight_shape [out, in].
                 naive-/int-quantized: weight int8 [out, in] and weight_zero_point int8, signed.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
from torch import Tensor

from ...kernels.quant import QuantizedWeight, pack_int4
from .registry import UnsupportedModelError

SUPPORTED = (
    "AWQ 4-bit (version gemm); GPTQ 4- and 8-bit (checkpoint_format gptq or gptq_v2); "
    "compressed-tensors W4A16 and W8A16 (int weights per group or channel, no activation "
    "quantization; format pack-quantized, naive-quantized or int-quantized)"
)
_CT_FORMATS = ("pack-quantized", "naive-quantized", "int-quantized")
_LM_HEAD = r"re:(.*\.)?lm_head$"
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_INTS = (torch.int8, torch.int16, torch.int32, torch.int64)


class UnsupportedQuantizationError(UnsupportedModelError):
    """A quantized checkpoint pagedctl does not read; the message names what it is and what
    pagedctl reads."""


@dataclass(frozen=True)
class CheckpointQuant:
    """How a checkpoint stores its quantized linear layers.

    Attributes:
        method: "awq", "gptq" or "compressed-tensors".
        format: the method's layout: "gemm" (AWQ), "gptq" (v1) or "gptq_v2" (GPTQ),
            "pack-quantized", "naive-quantized" or "int-quantized" (compressed-tensors).
        bits: 4 or 8.
        group_size: input features per scale; None: one scale per output row (per channel).
        symmetric: the zero point is the middle of the range (GPTQ stores it all the same).
        suffixes: the tensors a quantized layer `name` stores, as `name.<suffix>` (a bias is
            stored as an unquantized layer's is).
        optional: those of `suffixes` a layer may lack.
        targets, ignore: the linear layers stored quantized, in compressed-tensors' terms:
            "Linear" (every one), a module name, or "re:" and a regular expression matched
            from the name's start; a layer is quantized where a target matches and no ignore
            entry does.
    """

    method: str
    format: str
    bits: int
    group_size: int | None
    symmetric: bool
    suffixes: tuple[str, ...]
    optional: tuple[str, ...] = ()
    targets: tuple[str, ...] = ("Linear",)
    ignore: tuple[str, ...] = ()

    def quantized(self, module_name: str) -> bool:
        """Whether the linear layer `module_name` ("model.layers.0.mlp.down_proj", "lm_head")
        is stored quantized (embeddings never are in these formats: ask about linear layers)."""
        return any(_matches(module_name, t) for t in self.targets) and not any(
            _matches(module_name, i) for i in self.ignore
        )

    def describe(self) -> str:
        """A few words: `gptq gptq_v2 4-bit g128 symmetric`."""
        group = f"g{self.group_size}" if self.group_size else "per channel"
        kind = "symmetric" if self.symmetric else "asymmetric"
        return f"{self.method} {self.format} {self.bits}-bit {group} {kind}"


def _matches(name: str, pattern: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return pattern in ("Linear", name)


def _refuse(what: str, why: str = "") -> NoReturn:
    raise UnsupportedQuantizationError(
        f"{what} is not supported{f' ({why})' if why else ''}; pagedctl reads {SUPPORTED}"
    )


def checkpoint_quant(config: Mapping[str, Any]) -> CheckpointQuant | None:
    """How the checkpoint of `config` (its config.json) stores quantized layers; None: it has no
    `quantization_config`.

    Raises:
        UnsupportedQuantizationError: another method, version, format, bit width or scheme.
    """
    qc = config.get("quantization_config")
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    parsers = {"awq": _awq, "gptq": _gptq, "compressed-tensors": _compressed_tensors}
    if method not in parsers:
        _refuse(f"quantization method {method!r}")
    return parsers[method](qc)


def _bits(method: str, bits: Any, allowed: tuple[int, ...]) -> int:
    if bits not in allowed:
        _refuse(f"{method} {bits}-bit")
    return bits


def _group(method: str, group_size: Any) -> int | None:
    """A group size, None for -1 (per channel)."""
    if group_size == -1:
        return None
    if not isinstance(group_size, int) or group_size <= 0:
        _refuse(f"{method} group_size {group_size!r}")
    return group_size


def _awq(qc: Mapping[str, Any]) -> CheckpointQuant:
    """AutoAWQ's config (`version`, `zero_point`, `modules_to_not_convert`: substrings)."""
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        _refuse(f"AWQ version {version!r}", "its packing is not AutoAWQ's GEMM layout")
    backend = qc.get("backend", "autoawq")  # transformers' AwqConfig
    if backend != "autoawq":
        _refuse(f"AWQ backend {backend!r}")
    if not qc.get("zero_point", True):
        _refuse("AWQ without zero points (zero_point: false)")
    skipped = tuple(f"re:.*{re.escape(m)}" for m in qc.get("modules_to_not_convert") or ())
    return CheckpointQuant(
        "awq",
        "gemm",
        _bits("AWQ", qc.get("bits"), (4,)),
        _group("AWQ", qc.get("group_size", 128)),
        symmetric=False,
        suffixes=("qweight", "qzeros", "scales"),
        ignore=(_LM_HEAD, *skipped),
    )


def _gptq(qc: Mapping[str, Any]) -> CheckpointQuant:
    """AutoGPTQ's and GPTQModel's config (`checkpoint_format`, GPTQModel's `dynamic` skips and
    `lm_head`, optimum's `modules_in_block_to_quantize`). Act-order (`desc_act`) is read where
    its `g_idx` keeps groups of consecutive features (`static_groups`): see `read_layer`."""
    marlin = "marlin" if qc.get("is_marlin_format") else "gptq"  # AutoGPTQ before 0.7
    fmt = str(qc.get("checkpoint_format") or qc.get("format") or marlin).lower()
    if fmt not in ("gptq", "gptq_v2"):
        _refuse(f"GPTQ checkpoint_format {fmt!r}")
    if qc.get("pack_dtype", "int32") != "int32":
        _refuse(f"GPTQ pack_dtype {qc['pack_dtype']!r}")
    ignore = [] if qc.get("lm_head") else [_LM_HEAD]
    for key, override in (qc.get("dynamic") or {}).items():
        if not key.startswith("-:"):
            _refuse(f"GPTQModel per-module overrides (dynamic {key!r}: {override})")
        ignore.append(f"re:{key[2:]}")
    blocks = qc.get("modules_in_block_to_quantize")
    targets = [rf"re:.*\.{re.escape(m)}$" for b in blocks for m in b] if blocks else ["Linear"]
    return CheckpointQuant(
        "gptq",
        fmt,
        _bits("GPTQ", qc.get("bits"), (4, 8)),
        _group("GPTQ", qc.get("group_size", 128)),
        symmetric=bool(qc.get("sym", True)),
        suffixes=("qweight", "qzeros", "scales", "g_idx"),
        optional=() if qc.get("desc_act") else ("g_idx",),
        targets=tuple(targets),
        ignore=tuple(ignore),
    )


def _compressed_tensors(qc: Mapping[str, Any]) -> CheckpointQuant:
    """llm-compressor's config, parsed by the compressed-tensors package's `QuantizationConfig`
    (imported here: it imports transformers)."""
    for key in ("sparsity_config", "transform_config"):
        if qc.get(key):
            _refuse(f"compressed-tensors with a {key}")
    for name, group in (qc.get("config_groups") or {}).items():
        order = isinstance(group, dict) and (group.get("weights") or {}).get("actorder")
        if order in (True, "group", "dynamic"):
            _refuse(
                f"compressed-tensors act-order (config group {name!r}: actorder {order!r})",
                "its g_idx puts input features in groups out of order",
            )
    from compressed_tensors.quantization import QuantizationConfig
    from pydantic import ValidationError

    try:
        parsed = QuantizationConfig.model_validate(dict(qc))
    except ValidationError as e:
        errors = "; ".join(dict.fromkeys(x["msg"] for x in e.errors()))
        raise UnsupportedQuantizationError(
            f"compressed-tensors quantization_config does not parse ({errors}); pagedctl reads "
            f"{SUPPORTED}"
        ) from None
    if parsed.kv_cache_scheme is not None:
        _refuse("compressed-tensors KV-cache quantization (kv_cache_scheme)")
    kinds, targets = set(), []
    for name, scheme in parsed.config_groups.items():
        kinds.add(_ct_kind(name, scheme, parsed.format))
        targets += scheme.targets
    if len(kinds) > 1:
        _refuse(f"compressed-tensors mixed precision ({', '.join(sorted(map(str, kinds)))})")
    fmt, bits, group_size, symmetric = kinds.pop()
    weight = ("weight_packed", "weight_scale", "weight_shape")
    if fmt != "pack-quantized":
        weight = ("weight", "weight_scale")
    return CheckpointQuant(
        "compressed-tensors",
        fmt,
        bits,
        group_size,
        symmetric,
        suffixes=weight if symmetric else (*weight, "weight_zero_point"),
        targets=tuple(dict.fromkeys(targets)),
        ignore=tuple(parsed.ignore or ()),
    )


def _ct_kind(name: str, scheme: Any, default_format: str) -> tuple[str, int, int | None, bool]:
    """(format, bits, group size, symmetric) of one compressed-tensors config group."""
    where = f"config group {name!r}"
    for acts in (scheme.input_activations, scheme.output_activations):
        if acts is not None:
            _refuse(
                f"compressed-tensors activation quantization ({where}: {acts.type}"
                f"{acts.num_bits} activations, as in W8A8 and FP8 checkpoints)"
            )
    w = scheme.weights
    if w is None:
        _refuse(f"compressed-tensors {where} without weight quantization")
    if w.type != "int":
        _refuse(f"compressed-tensors {w.type}{w.num_bits} weights ({where})")
    bits = _bits("compressed-tensors", w.num_bits, (4, 8))
    if w.strategy not in ("group", "channel") or w.dynamic:
        _refuse(f"compressed-tensors {'dynamic' if w.dynamic else w.strategy} strategy ({where})")
    fmt = scheme.format or default_format
    if fmt not in _CT_FORMATS:
        _refuse(f"compressed-tensors format {fmt!r}")
    for target in scheme.targets:  # a class name: module names are dotted and lower-case
        if target != "Linear" and target[:1].isupper() and "." not in target:
            _refuse(f"compressed-tensors target {target!r}", "only Linear layers are read")
    return fmt, bits, w.group_size if w.strategy == "group" else None, bool(w.symmetric)


@dataclass(frozen=True)
class _Layer:
    """One layer's tensors with the shape each must have."""

    quant: CheckpointQuant
    name: str
    tensors: Mapping[str, Tensor]
    out: int
    inp: int
    group: int

    def get(self, suffix: str, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...]) -> Tensor:
        t = self.tensors[suffix]
        if tuple(t.shape) != shape or t.dtype not in dtypes:
            want = "/".join(str(d).removeprefix("torch.") for d in dtypes)
            raise ValueError(
                f"{self.name}.{suffix} is {str(t.dtype).removeprefix('torch.')} "
                f"{list(t.shape)}; a [{self.out}, {self.inp}] layer of "
                f"{self.quant.describe()} stores {want} {list(shape)}"
            )
        return t

    def words(self, features: int) -> int:
        """int32 words of `features` packed values."""
        if features * self.quant.bits % 32:
            raise ValueError(
                f"{self.name}: {features} features do not fill whole int32 words of "
                f"{self.quant.bits}-bit values"
            )
        return features * self.quant.bits // 32


def read_layer(
    quant: CheckpointQuant,
    name: str,
    tensors: Mapping[str, Tensor],
    out_features: int,
    in_features: int,
) -> QuantizedWeight:
    """One quantized linear layer as the engine's integer layout, every value as stored.

    Args:
        quant: the checkpoint's `checkpoint_quant`.
        name: the layer's module name, for messages.
        tensors: the layer's stored tensors by suffix (`quant.suffixes`).
        out_features, in_features: the float weight's shape, from the model's config.

    Runs on the tensors' device (move them first to unpack on an accelerator); `qdata` may be
    a view of a stored tensor where the format packs as the layout does (compressed-tensors
    4-bit, naive 8-bit).

    Raises:
        ValueError: a tensor missing, or of another dtype or shape than this layer's in the
            format (the message names the layer, the tensor, its shape and the expected one).
        UnsupportedQuantizationError: act-order GPTQ whose `g_idx` is not `k // group_size`.
    """
    missing = [s for s in quant.suffixes if s not in tensors and s not in quant.optional]
    if missing:
        raise ValueError(
            f"{name} has no {', '.join(missing)}; a layer of {quant.describe()} stores "
            f"{', '.join(quant.suffixes)}"
        )
    group = quant.group_size or in_features
    if in_features % group:
        raise ValueError(f"{name}: group_size {group} does not divide in_features {in_features}")
    layer = _Layer(quant, name, tensors, out_features, in_features, group)
    return _READERS[quant.method](layer)


def _unpack(words: Tensor, bits: int) -> Tensor:
    """Integer words `[..., n]` as their `32 // bits` unsigned values each, `[..., n * 32 // bits]`
    (value `i` of a word from its bits `i * bits` up)."""
    shifts = torch.arange(0, 32, bits, dtype=words.dtype, device=words.device)
    return ((words[..., None] >> shifts) & ((1 << bits) - 1)).flatten(-2)


def _bytes(words: Tensor) -> Tensor:
    """int32 words `[..., n]` as uint8 `[..., 4 n]`, each word's least significant byte first."""
    raw = words.reshape(-1).view(torch.uint8).view(*words.shape[:-1], -1)
    if sys.byteorder == "big":
        raw = raw.unflatten(-1, (-1, 4)).flip(-1).flatten(-2)
    return raw


def _qdata(words: Tensor, bits: int) -> Tensor:
    """`qdata` of int32 words `[out, in / P]` of unsigned values along the input features: their
    bytes as they are for 4 bits (value `2j` in the low nibble of byte `j`), shifted to signed for
    8 (`u - 128`)."""
    raw = _bytes(words)
    return raw if bits == 4 else (raw ^ 0x80).view(torch.int8)


def _canonical(
    layer: _Layer, qdata: Tensor, zeros: Tensor | int, scales: Tensor
) -> QuantizedWeight:
    """The layout of `w = (u - zeros) scales`: `qdata` the layout's integers of `u` (unsigned in
    `[0, 2^bits)`), `zeros` `[out, groups]` (or one for all) unsigned alike, `scales`
    `[out, groups]`."""
    middle = 128 if layer.quant.bits == 8 else 0  # 8-bit integers of the layout are signed
    zeros = zeros.float() if isinstance(zeros, Tensor) else float(zeros)
    offsets = (middle - zeros) * scales.float()
    return QuantizedWeight(
        layer.quant.bits,
        layer.group,
        qdata,
        scales.contiguous(),
        offsets if offsets.any() else None,
    )


def _read_awq(layer: _Layer) -> QuantizedWeight:
    out, groups = layer.out, layer.inp // layer.group
    qweight = layer.get("qweight", (layer.inp, layer.words(out)), (torch.int32,))
    qzeros = layer.get("qzeros", (groups, layer.words(out)), (torch.int32,))
    scales = layer.get("scales", (groups, out), _FLOATS)
    return _canonical(layer, pack_int4(_awq_columns(qweight)), _awq_columns(qzeros), scales.T)


def _awq_columns(words: Tensor) -> Tensor:
    """AWQ GEMM words `[rows, out / 8]` as uint8 values `[out, rows]`: column `j` of each 8 is
    the word's value `(0, 4, 1, 5, 2, 6, 3, 7)[j]` (AutoAWQ packs columns 0 2 4 6 1 3 5 7)."""
    rows = words.shape[0]
    raw = _bytes(words.T)  # [out / 8, rows * 4]: a word's 8 values in 4 bytes, low nibble first
    slots = torch.stack((raw & 0xF, raw >> 4), dim=-1).view(-1, rows, 8)
    return slots.permute(0, 2, 1)[:, [0, 4, 1, 5, 2, 6, 3, 7]].reshape(-1, rows)


def _read_gptq(layer: _Layer) -> QuantizedWeight:
    bits, out, groups = layer.quant.bits, layer.out, layer.inp // layer.group
    qweight = layer.get("qweight", (layer.words(layer.inp), out), (torch.int32,))
    qzeros = layer.get("qzeros", (groups, layer.words(out)), (torch.int32,))
    scales = layer.get("scales", (groups, out), _FLOATS)
    if "g_idx" in layer.tensors:
        g_idx = layer.get("g_idx", (layer.inp,), _INTS)
        consecutive = torch.arange(layer.inp, device=g_idx.device) // layer.group
        if not torch.equal(g_idx.long(), consecutive):
            _refuse(
                f"act-order GPTQ ({layer.name}.g_idx puts input features in groups out of "
                "order, desc_act without static_groups)",
                "groups must be runs of consecutive input features; quantize with "
                "desc_act=False or static_groups=True",
            )
    if layer.quant.format == "gptq":
        # v1 stores each zeros word minus one per value (0x11111111 for 4 bits) as one 32-bit
        # subtraction, a zero of 0 borrowing from the next value (GPTQModel's v2 -> v1;
        # AutoGPTQ's `zeros - 1` per value is the same where no zero is 0); one 32-bit addition
        # gives every zero back.
        ones = sum(1 << (bits * i) for i in range(32 // bits))
        qzeros = (qzeros.long() + ones) & 0xFFFFFFFF
    return _canonical(layer, _qdata(qweight.T, bits), _unpack(qzeros, bits).T, scales.T)


def _read_compressed(layer: _Layer) -> QuantizedWeight:
    quant, out, groups = layer.quant, layer.out, layer.inp // layer.group
    bits, half = quant.bits, 1 << (quant.bits - 1)
    scales = layer.get("weight_scale", (out, groups), _FLOATS)
    zeros: Tensor | int = half  # signed zero points of 0 when symmetric
    if quant.format == "pack-quantized":
        shape = layer.get("weight_shape", (2,), _INTS)
        if shape.tolist() != [out, layer.inp]:
            raise ValueError(
                f"{layer.name}.weight_shape is {shape.tolist()}; expected {[out, layer.inp]}"
            )
        packed = layer.get("weight_packed", (out, layer.words(layer.inp)), (torch.int32,))
        qdata = _qdata(packed, bits)
        if not quant.symmetric:
            zp = layer.get("weight_zero_point", (layer.words(out), groups), (torch.int32,))
            zeros = _unpack(zp.T, bits).T
    else:
        weight = layer.get("weight", (out, layer.inp), (torch.int8,))
        qdata = weight if bits == 8 else pack_int4(weight + half)
        if not quant.symmetric:
            zp = layer.get("weight_zero_point", (out, groups), _INTS)
            zeros = zp.to(torch.int16) + half
    return _canonical(layer, qdata, zeros, scales)


_READERS = {"awq": _read_awq, "gptq": _read_gptq, "compressed-tensors": _read_compressed}

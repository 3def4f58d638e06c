"""Quantized checkpoint folders (AWQ, GPTQ, compressed-tensors) read into `QuantizedWeight`.

Each format's folder is written by tests/quant_writers.py as its tool writes it; every layer read
back dequantizes to exactly the writer's weights (AWQ and GPTQ: float32 `(q - z) s` from the
stored integers; compressed-tensors: the package's own decompressor, in the scale's dtype, which
the float32 reference rounds to exactly: tolerance zero throughout). Hand-packed words pin each
layout's value order independently of the writers.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from pagedctl.engine.models.quant_formats import (
    SUPPORTED,
    CheckpointQuant,
    UnsupportedQuantizationError,
    checkpoint_quant,
    read_layer,
)
from pagedctl.engine.models.registry import UnsupportedModelError
from pagedctl.kernels.quant import dequantize, integers
from tests.quant_writers import projections, write_awq, write_compressed_tensors, write_gptq
from tests.tiny_models import tiny_config

WRITERS = {"awq": write_awq, "gptq": write_gptq, "ct": write_compressed_tensors}
CASES = {
    "awq-g32": ("awq", {}),
    "awq-per-channel": ("awq", {"group_size": -1}),
    "autogptq-4bit-sym": ("gptq", {"tool": "auto-gptq"}),
    "autogptq-8bit-sym": ("gptq", {"tool": "auto-gptq", "bits": 8}),
    "gptq-v1-4bit-asym-zero0": ("gptq", {"sym": False, "positive_groups": True}),
    "gptq-v1-8bit-asym-zero0": ("gptq", {"bits": 8, "sym": False, "positive_groups": True}),
    "gptq-v2-4bit-asym-zero0": (
        "gptq",
        {"sym": False, "positive_groups": True, "checkpoint_format": "gptq_v2"},
    ),
    "gptq-v2-8bit-per-channel": (
        "gptq",
        {"bits": 8, "sym": False, "group_size": -1, "checkpoint_format": "gptq_v2"},
    ),
    "gptq-desc-act-static-groups": ("gptq", {"desc_act": True, "static_groups": True}),
    "ct-w4a16-sym": ("ct", {}),
    "ct-w4a16-asym": ("ct", {"symmetric": False}),
    "ct-w4a16-asym-per-channel-bf16": (
        "ct",
        {"symmetric": False, "group_size": None, "dtype": torch.bfloat16},
    ),
    "ct-w8a16-sym-per-channel": ("ct", {"bits": 8, "group_size": None}),
    "ct-w8a16-asym": ("ct", {"bits": 8, "symmetric": False}),
    "ct-naive-8bit": ("ct", {"bits": 8, "group_size": None, "fmt": "naive-quantized"}),
    "ct-int-quantized-8bit-asym": ("ct", {"bits": 8, "symmetric": False, "fmt": "int-quantized"}),
    "ct-naive-4bit-asym": ("ct", {"symmetric": False, "fmt": "naive-quantized"}),
}


@pytest.fixture(scope="module")
def tiny():
    """A tiny Llama's float state dict and config dict."""
    config = tiny_config("llama")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    return model.state_dict(), json.loads(config.to_json_string())


def write_and_read(folder, tiny, writer, **options):
    """Write a folder, read its config and every quantized layer: (quant, expected weights, read
    weights, stored tensors)."""
    state_dict, config = tiny
    expected = WRITERS[writer](folder, state_dict, config, **options)
    quant = checkpoint_quant(json.loads((folder / "config.json").read_text()))
    stored = load_file(str(folder / "model.safetensors"))
    layers = {}
    for module in expected:
        tensors = {s: stored[f"{module}.{s}"] for s in quant.suffixes if f"{module}.{s}" in stored}
        layers[module] = read_layer(quant, module, tensors, *state_dict[f"{module}.weight"].shape)
    return quant, expected, layers, stored


@pytest.mark.parametrize("case", list(CASES))
def test_every_layer_reads_back_exactly(tmp_path, tiny, case):
    writer, options = CASES[case]
    quant, expected, layers, stored = write_and_read(tmp_path, tiny, writer, **options)
    assert len(expected) == 14  # 2 decoder layers x 7 projections
    for module, weight in layers.items():
        want = expected[module]
        assert torch.equal(dequantize(weight, want.dtype), want), module
        assert weight.bits == options.get("bits", 4)
    # every quantized layer stores exactly the format's tensors; the rest is float16
    for name, tensor in stored.items():
        module, _, suffix = name.rpartition(".")
        if module in expected:
            assert suffix in quant.suffixes, name
        else:
            assert tensor.dtype == torch.float16 and suffix in ("weight", "bias"), name
    linear = [*projections(tiny[0]), "lm_head"]
    assert [m for m in linear if quant.quantized(m)] == list(expected)


def test_quant_fields(tmp_path, tiny):
    awq = write_and_read(tmp_path / "awq", tiny, "awq")[0]
    assert (awq.method, awq.format, awq.bits, awq.group_size, awq.symmetric) == (
        "awq",
        "gemm",
        4,
        32,
        False,
    )
    assert awq.suffixes == ("qweight", "qzeros", "scales")
    gptq = write_and_read(tmp_path / "gptq", tiny, "gptq", bits=8, group_size=-1)[0]
    assert (gptq.method, gptq.format, gptq.bits, gptq.group_size, gptq.symmetric) == (
        "gptq",
        "gptq",
        8,
        None,
        True,
    )
    assert gptq.suffixes == ("qweight", "qzeros", "scales", "g_idx")
    ct = write_and_read(tmp_path / "ct", tiny, "ct", symmetric=False)[0]
    assert (ct.method, ct.format, ct.bits, ct.group_size, ct.symmetric) == (
        "compressed-tensors",
        "pack-quantized",
        4,
        32,
        False,
    )
    assert ct.suffixes == ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point")
    assert checkpoint_quant({"model_type": "llama"}) is None


def test_symmetric_8bit_has_no_offsets(tmp_path, tiny):
    _, _, layers, _ = write_and_read(tmp_path, tiny, "ct", bits=8, group_size=None)
    assert all(w.offsets is None for w in layers.values())
    _, _, layers, _ = write_and_read(tmp_path / "gptq", tiny, "gptq", bits=8)
    assert all(w.offsets is None for w in layers.values())


# Hand-packed words: value i of the word 0x76543210 is i.
WORD = 0x76543210


def test_awq_column_order():
    quant = CheckpointQuant("awq", "gemm", 4, None, False, ("qweight", "qzeros", "scales"))
    tensors = {
        "qweight": torch.tensor([[WORD], [0]], dtype=torch.int32),  # [in 2, out 8 / 8]
        "qzeros": torch.tensor([[WORD]], dtype=torch.int32),
        "scales": torch.ones(1, 8, dtype=torch.float16),
    }
    weight = read_layer(quant, "l", tensors, 8, 2)
    order = [0, 4, 1, 5, 2, 6, 3, 7]  # column j holds nibble order[j]
    assert integers(weight)[:, 0].tolist() == order
    assert integers(weight)[:, 1].tolist() == [0] * 8
    assert (-weight.offsets[:, 0]).tolist() == order  # zeros in the same order


@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
def test_gptq_packs_along_input_features(fmt):
    quant = CheckpointQuant("gptq", fmt, 4, None, False, ("qweight", "qzeros", "scales"))
    tensors = {
        "qweight": torch.tensor([[WORD] + [0] * 7], dtype=torch.int32),  # [in 8 / 8, out 8]
        "qzeros": torch.tensor([[0x21]], dtype=torch.int32),  # [1 group, out 8 / 8]
        "scales": torch.ones(1, 8, dtype=torch.float16),
    }
    weight = read_layer(quant, "l", tensors, 8, 8)
    assert integers(weight)[0].tolist() == list(range(8))
    assert integers(weight)[1:].eq(0).all()
    zeros = (-weight.offsets[:, 0]).tolist()
    assert zeros == ([2, 3] + [1] * 6 if fmt == "gptq" else [1, 2] + [0] * 6)  # v1: z - 1


def test_gptq_v1_zero_of_zero_borrows():
    """v1 zeros (2, 0) are stored as the 32-bit word 0x02 + 0x00 - 0x11 = 0xFFFFFFF1 (GPTQModel):
    value 0 reads 1 (0xF + 1 carries), value 1 reads 0 (0xF + 1 + carry is 0x10, masked)."""
    quant = CheckpointQuant("gptq", "gptq", 4, None, False, ("qweight", "qzeros", "scales"))
    stored = (0x02 - 0x11111111) % 2**32
    tensors = {
        "qweight": torch.zeros(1, 8, dtype=torch.int32),
        "qzeros": torch.tensor([[stored - 2**32]], dtype=torch.int32),
        "scales": torch.ones(1, 8, dtype=torch.float16),
    }
    zeros = (-read_layer(quant, "l", tensors, 8, 8).offsets[:, 0]).tolist()
    assert zeros == [2, 0, 0, 0, 0, 0, 0, 0]


def test_compressed_tensors_pack_order():
    quant = CheckpointQuant(
        "compressed-tensors",
        "pack-quantized",
        4,
        None,
        False,
        ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point"),
    )
    tensors = {
        "weight_packed": torch.tensor([[WORD]] * 8, dtype=torch.int32),  # [out 8, in 8 / 8]
        "weight_zero_point": torch.tensor([[WORD]], dtype=torch.int32),  # [out 8 / 8, 1]
        "weight_scale": torch.ones(8, 1, dtype=torch.float16),
        "weight_shape": torch.tensor([8, 8]),
    }
    weight = read_layer(quant, "l", tensors, 8, 8)
    assert integers(weight)[3].tolist() == list(range(8))  # stored q + 8: unsigned as is
    assert (-weight.offsets[:, 0]).tolist() == list(range(8))  # packed along the outputs


def test_act_order_g_idx_is_refused(tmp_path, tiny):
    with pytest.raises(UnsupportedQuantizationError, match="act-order") as e:
        write_and_read(tmp_path, tiny, "gptq", desc_act=True)
    assert "g_idx" in str(e.value) and "desc_act" in str(e.value) and SUPPORTED in str(e.value)


def test_desc_act_needs_g_idx(tmp_path, tiny):
    state_dict, config = tiny
    write_gptq(tmp_path, state_dict, config, desc_act=True, static_groups=True)
    quant = checkpoint_quant(json.loads((tmp_path / "config.json").read_text()))
    stored = load_file(str(tmp_path / "model.safetensors"))
    module = "model.layers.0.mlp.down_proj"
    tensors = {s: stored[f"{module}.{s}"] for s in ("qweight", "qzeros", "scales")}
    with pytest.raises(ValueError, match=rf"{re.escape(module)} has no g_idx"):
        read_layer(quant, module, tensors, 64, 128)


def _layer_tensors(tmp_path, tiny, writer, module, **options):
    quant, _, _, stored = write_and_read(tmp_path, tiny, writer, **options)
    return quant, {s: stored[f"{module}.{s}"] for s in quant.suffixes if f"{module}.{s}" in stored}


SHAPE_ERRORS = {
    "awq": r"\.qweight is int32 \[128, 8\]; a \[128, 128\] layer of awq gemm 4-bit g32 "
    r"asymmetric stores int32 \[128, 16\]$",
    "gptq": r"\.qweight is int32 \[16, 64\]; a \[128, 128\] layer of gptq gptq 4-bit g32 "
    r"symmetric stores int32 \[16, 128\]$",
    "ct": r"\.weight_scale is float16 \[64, 4\]; a \[128, 128\] layer of compressed-tensors "
    r"pack-quantized 4-bit g32 symmetric stores float16/bfloat16/float32 \[128, 4\]$",
}


@pytest.mark.parametrize("writer", list(SHAPE_ERRORS))
def test_mismatched_shapes_name_layer_tensor_and_shapes(tmp_path, tiny, writer):
    module = "model.layers.1.mlp.down_proj"  # [64, 128], read as [128, 128]
    quant, tensors = _layer_tensors(tmp_path, tiny, writer, module)
    with pytest.raises(ValueError, match=re.escape(module) + SHAPE_ERRORS[writer]):
        read_layer(quant, module, tensors, 128, 128)


def test_weight_shape_and_group_mismatches(tmp_path, tiny):
    module = "model.layers.1.mlp.down_proj"
    quant, tensors = _layer_tensors(tmp_path, tiny, "ct", module)
    wrong = tensors | {"weight_shape": torch.tensor([64, 96])}
    with pytest.raises(ValueError, match=r"down_proj\.weight_shape is \[64, 96\]; expected "):
        read_layer(quant, module, wrong, 64, 128)
    with pytest.raises(ValueError, match="down_proj: group_size 32 does not divide in_features 80"):
        read_layer(quant, module, tensors, 64, 80)
    per_channel = CheckpointQuant(
        "compressed-tensors", "pack-quantized", 4, None, True, tuple(tensors)
    )
    packed = {
        "weight_packed": torch.zeros(8, 1, dtype=torch.int32),
        "weight_scale": torch.ones(8, 1, dtype=torch.float16),
        "weight_shape": torch.tensor([8, 4]),
    }
    with pytest.raises(ValueError, match=r"^l: 4 features do not fill whole int32 words of 4-bit"):
        read_layer(per_channel, "l", packed, 8, 4)


def test_wrong_dtype_and_missing_tensor(tmp_path, tiny):
    module = "model.layers.0.self_attn.o_proj"
    quant, tensors = _layer_tensors(tmp_path, tiny, "awq", module)
    wrong = tensors | {"qzeros": tensors["qzeros"].long()}
    with pytest.raises(ValueError, match=r"o_proj\.qzeros is int64 \[2, 8\]; .* stores int32"):
        read_layer(quant, module, wrong, 64, 64)
    missing = {k: v for k, v in tensors.items() if k != "scales"}
    with pytest.raises(
        ValueError, match=r"o_proj has no scales; .* stores qweight, qzeros, scales"
    ):
        read_layer(quant, module, missing, 64, 64)


def test_ignore_lists(tmp_path, tiny):
    """Each tool's own skip rule (AWQ substrings, GPTQModel's "-:" regexes, compressed-tensors'
    names and "re:" regexes) keeps those layers float, and `quantized` says so."""
    linear = [*projections(tiny[0]), "lm_head"]
    cases = [
        ("awq", {"modules_to_not_convert": ["down_proj", "layers.1.self_attn"]}),
        ("gptq", {"dynamic": {r"-:model\.layers\.1\..*": {}, "-:.*gate_proj": {}}}),
        (
            "ct",
            {
                "ignore": [
                    "lm_head",
                    r"re:.*layers\.0\.self_attn\.[qk]_proj$",
                    "model.layers.1.mlp.up_proj",
                ]
            },
        ),
    ]
    for writer, options in cases:
        quant, expected, _, stored = write_and_read(tmp_path / writer, tiny, writer, **options)
        kept = [m for m in linear if not quant.quantized(m)]
        assert kept == [m for m in linear if m not in expected]
        assert 1 < len(kept) < len(linear) - 1, writer
        assert all(stored[f"{m}.weight"].dtype == torch.float16 for m in kept)


def test_gptq_lm_head_and_block_modules():
    base = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    assert not checkpoint_quant({"quantization_config": base}).quantized("lm_head")
    with_head = checkpoint_quant({"quantization_config": base | {"lm_head": True}})
    assert with_head.quantized("lm_head")
    blocks = [["self_attn.q_proj", "self_attn.k_proj"], ["mlp.down_proj"]]
    some = checkpoint_quant(
        {"quantization_config": base | {"modules_in_block_to_quantize": blocks}}
    )
    assert some.quantized("model.layers.3.self_attn.k_proj")
    assert some.quantized("model.layers.3.mlp.down_proj")
    assert not some.quantized("model.layers.3.self_attn.v_proj")
    assert not some.quantized("lm_head")


AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm", "zero_point": True}
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False}


def ct(weights=None, acts=None, fmt="pack-quantized", **extra):
    """A compressed-tensors quantization_config of one group."""
    weights = {
        "num_bits": 4,
        "type": "int",
        "symmetric": True,
        "strategy": "group",
        "group_size": 128,
    } | (weights or {})
    group = {"targets": ["Linear"], "weights": weights, "input_activations": acts}
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "ignore": ["lm_head"],
        "config_groups": {"group_0": group},
    } | extra


INT8_ACTS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
FP8 = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "group_size": None}
FP8_ACTS = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True}


@pytest.mark.parametrize(
    ("quantization_config", "named"),
    [
        (
            {"quant_method": "bitsandbytes", "load_in_4bit": True},
            "quantization method 'bitsandbytes'",
        ),
        ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "quantization method 'fp8'"),
        ({"quant_method": "exl2"}, "quantization method 'exl2'"),
        (AWQ | {"version": "gemv"}, "AWQ version 'gemv'"),
        (AWQ | {"version": "GEMV_FAST"}, "AWQ version 'gemv_fast'"),
        (AWQ | {"version": "marlin"}, "AWQ version 'marlin'"),
        (AWQ | {"version": "exllama"}, "AWQ version 'exllama'"),
        (AWQ | {"version": "ipex"}, "AWQ version 'ipex'"),
        (AWQ | {"bits": 8}, "AWQ 8-bit"),
        (AWQ | {"zero_point": False}, "AWQ without zero points"),
        (AWQ | {"backend": "llm-awq"}, "AWQ backend 'llm-awq'"),
        (AWQ | {"group_size": 0}, "AWQ group_size 0"),
        (GPTQ | {"bits": 3}, "GPTQ 3-bit"),
        (GPTQ | {"bits": 2}, "GPTQ 2-bit"),
        (GPTQ | {"checkpoint_format": "marlin"}, "GPTQ checkpoint_format 'marlin'"),
        (GPTQ | {"checkpoint_format": "bitblas"}, "GPTQ checkpoint_format 'bitblas'"),
        (GPTQ | {"is_marlin_format": True}, "GPTQ checkpoint_format 'marlin'"),
        (GPTQ | {"pack_dtype": "int16"}, "GPTQ pack_dtype 'int16'"),
        (GPTQ | {"dynamic": {r"+:.*down_proj": {"bits": 8}}}, "GPTQModel per-module overrides"),
        (
            ct(acts=INT8_ACTS),
            "compressed-tensors activation quantization (config group 'group_0': int8 activations",
        ),
        (
            ct({"num_bits": 8, "symmetric": True}, INT8_ACTS, fmt="int-quantized"),
            "activation quantization",
        ),
        (ct(FP8, FP8_ACTS, fmt="float-quantized"), "float8 activations"),
        (ct(FP8, fmt="float-quantized"), "compressed-tensors float8 weights"),
        (ct({"num_bits": 2}), "compressed-tensors 2-bit"),
        (ct({"num_bits": 3}), "compressed-tensors 3-bit"),
        (ct({"strategy": "tensor", "group_size": None}), "compressed-tensors tensor strategy"),
        (
            ct({"strategy": "block", "group_size": None, "block_structure": [128, 128]}),
            "compressed-tensors block strategy",
        ),
        (ct(fmt="marlin-24"), "compressed-tensors format 'marlin-24'"),
        (ct(fmt="dense"), "compressed-tensors format 'dense'"),
        (
            ct(kv_cache_scheme=FP8_ACTS | {"strategy": "tensor", "dynamic": False}),
            "compressed-tensors KV-cache quantization",
        ),
        (ct(sparsity_config={"format": "sparse-24-bitmask"}), "with a sparsity_config"),
        (ct(transform_config={"config_groups": {"R1": {}}}), "with a transform_config"),
        (
            ct({"actorder": "group"}),
            "compressed-tensors act-order (config group 'group_0': actorder 'group')",
        ),
        (
            ct()
            | {
                "config_groups": {
                    "a": {
                        "targets": [r"re:.*mlp.*"],
                        "weights": ct()["config_groups"]["group_0"]["weights"],
                    },
                    "b": {
                        "targets": [r"re:.*self_attn.*"],
                        "weights": ct({"num_bits": 8})["config_groups"]["group_0"]["weights"],
                    },
                }
            },
            "compressed-tensors mixed precision",
        ),
        (
            ct()
            | {
                "config_groups": {
                    "g": {
                        "targets": ["Embedding"],
                        "weights": ct()["config_groups"]["group_0"]["weights"],
                    }
                }
            },
            "compressed-tensors target 'Embedding'",
        ),
        (ct({"observer_kwargs_typo": 1}), "compressed-tensors quantization_config does not parse"),
    ],
)
def test_refusals_name_the_thing_and_the_supported_list(quantization_config, named):
    with pytest.raises(UnsupportedQuantizationError) as e:
        checkpoint_quant({"quantization_config": quantization_config})
    assert named in str(e.value)
    assert SUPPORTED in str(e.value)
    assert isinstance(e.value, UnsupportedModelError)


def test_tools_configs_read_as_written():
    """Configs as the tools write them beside the ones the writers make: GPTQModel 4's `format`
    key, a preset compressed-tensors group, per-group formats under `mixed-precision`."""
    gptqmodel4 = GPTQ | {"format": "gptq_v2", "method": "gptq", "checkpoint_format": "gptq_v2"}
    assert checkpoint_quant({"quantization_config": gptqmodel4}).format == "gptq_v2"
    preset = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"W8A16": ["Linear"]},
        "ignore": ["lm_head"],
    }
    quant = checkpoint_quant({"quantization_config": preset})
    preset_weights = preset_name_to_scheme("W8A16", ["Linear"]).weights  # its version's preset
    group_size = preset_weights.group_size if preset_weights.strategy == "group" else None
    assert (quant.bits, quant.group_size, quant.symmetric) == (8, group_size, True)
    per_group = ct(fmt="mixed-precision")
    per_group["config_groups"]["group_0"]["format"] = "naive-quantized"
    assert checkpoint_quant({"quantization_config": per_group}).format == "naive-quantized"

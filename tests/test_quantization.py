"""Quantized weights: the integer layout, GGUF blocks read as stored, the CPU kernels, the
`quantization` setting end to end (tiny GGUFs written by the test, the bundled model)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from pagedctl import bundled_model
from pagedctl.engine import LLM, SamplingParams
from pagedctl.engine.core.config import ConfigError
from pagedctl.engine.models import gguf_quant
from pagedctl.engine.models.llama import WeightLoadError
from pagedctl.kernels import quant_cpu
from pagedctl.kernels.quant import (
    QuantizedWeight,
    concat_rows,
    dequantize,
    integers,
    quantize,
    reference_linear,
)
from tests.test_default_model import tiny_model, write_gguf
from tests.tiny_models import save_llama

QUANT = (256, 512)  # hidden, intermediate: whole K-quant super-blocks of 256


def random_blocks(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int) -> np.ndarray:
    """Blocks of random integers with small float16 scales: any bytes are a valid block of
    these types once their float16 fields are finite."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    scale = (rng.random((rows, cols // block)) * 2e-4).astype(np.float16).view(np.uint8)
    fields = {"Q6_K": [208]}.get(
        qtype.name, [0, 2] if qtype.name in ("Q4_1", "Q4_K", "Q5_K") else [0]
    )
    for at in fields:
        raw[..., at : at + 2] = scale.reshape(rows, -1, 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("kind", gguf_quant.QUANT_TYPES)
def test_gguf_blocks_read_exactly_as_gguf_dequantizes_them(kind: str) -> None:
    qtype = GGMLQuantizationType[kind]
    raw = random_blocks(qtype, 48, 512, seed=len(kind))
    weight = gguf_quant._READERS[kind](raw, 48, 512)
    want = gguf_dequantize(raw, qtype).reshape(48, 512)
    assert np.array_equal(dequantize(weight).numpy(), want)
    # Rows permuted (the q/k un-permute) stay exact.
    order = torch.randperm(48)
    assert np.array_equal(dequantize(weight.rows(order)).numpy(), want[order.numpy()])


def test_layout_refuses_inconsistent_shapes() -> None:
    with pytest.raises(ValueError, match="group_size 48 does not divide"):
        QuantizedWeight(4, 48, torch.zeros(4, 32, dtype=torch.uint8), torch.ones(4, 1))
    with pytest.raises(ValueError, match="scales shape"):
        QuantizedWeight(8, 32, torch.zeros(4, 64, dtype=torch.int8), torch.ones(4, 1))
    with pytest.raises(ValueError, match=r"must be torch\.uint8"):
        QuantizedWeight(4, 32, torch.zeros(4, 32, dtype=torch.int8), torch.ones(4, 2))


def test_concat_rows_promotes_bits_and_groups_exactly() -> None:
    torch.manual_seed(0)
    a = quantize(torch.randn(32, 128), 4, 64)
    b = quantize(torch.randn(16, 128), 8, 32)
    joined = concat_rows([a, b])
    assert (joined.bits, joined.group_size) == (8, 32)
    assert torch.equal(dequantize(joined), torch.cat([dequantize(a), dequantize(b)]))


@pytest.mark.parametrize(("bits", "group"), [(4, 32), (4, 128), (8, 32), (8, 16), (8, 256)])
def test_cpu_kernels_match_the_reference(bits: int, group: int) -> None:
    torch.manual_seed(bits + group)
    w = quantize(torch.randn(96, 256) * 0.05, bits, group)
    x, bias = torch.randn(7, 256), torch.randn(96)
    want = reference_linear(x, w, bias)
    tiled = quant_cpu.tiled_linear(x, w, bias)
    assert torch.allclose(tiled, want, atol=1e-5, rtol=1e-5)
    if quant_cpu.int4_packs(w):
        got = quant_cpu.int4_linear(x, quant_cpu.pack_int4(w), bias)
        # bfloat16 activations and scales: ~3 significant digits of a sum of 256 products.
        assert torch.allclose(got, want, atol=0.05, rtol=0.02), (got - want).abs().max()


def test_cpu_int4_matmul_rows_do_not_depend_on_the_batch() -> None:
    """`quantized_linear(batch_invariant=True)` relies on torch's CPU int4 matmul computing a
    row alone; this fails if a torch release changes that."""
    torch.manual_seed(0)
    packed = quant_cpu.pack_int4(quantize(torch.randn(192, 512) * 0.05, 4, 32))
    x = torch.randn(70, 512)
    full = quant_cpu.int4_linear(x, packed)
    for start, rows in ((0, 1), (5, 3), (10, 17), (40, 30)):
        assert torch.equal(
            quant_cpu.int4_linear(x[start : start + rows], packed), full[start : start + rows]
        )


def _quantized_gguf(path: Path, kind: str, arch: str = "llama") -> Path:
    """A tiny model's GGUF whose projections and embedding are `kind` blocks: the model's own
    weights quantized by gguf where it has a quantizer (Q4_0, Q4_1, Q8_0), random blocks of
    the type otherwise (the K-quants)."""
    qtype = GGMLQuantizationType[kind]
    hidden, inter = QUANT
    model = tiny_model(arch, hidden_size=hidden, intermediate_size=inter, head_dim=64)

    def quant(name: str, w: np.ndarray):
        if w.ndim != 2 or "norm" in name:
            return None
        if kind in ("Q4_0", "Q4_1", "Q8_0"):
            return gguf_quantize(w.astype(np.float32), qtype), qtype
        return random_blocks(qtype, *w.shape, seed=hash(name) % 2**32), qtype

    return write_gguf(path, model, quant=quant)


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def _agreement(got: list[list[int]], want: list[list[int]]) -> float:
    """The share of positions whose tokens agree."""
    pairs = [(a, b) for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True)]
    return sum(a == b for a, b in pairs) / len(pairs)


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PAGEDCTL_HOME", str(tmp_path / "home"))
    return tmp_path


PROMPTS = [[5, 9, 44, 101, 7], [200, 3, 3, 17], [60, 61, 62, 63, 64, 65, 66], [250, 1, 99]]


@pytest.mark.parametrize("kind", gguf_quant.QUANT_TYPES)
def test_a_quantized_gguf_runs_as_stored_like_its_dequantized_model(home: Path, kind: str) -> None:
    path = _quantized_gguf(home / f"tiny-{kind}.gguf", kind)
    settings = dict(device="cpu", dtype="float32", num_gpu_blocks_override=64)
    packed = LLM(str(path), quantization="checkpoint", **settings)
    floats = LLM(str(path), quantization="none", **settings)
    assert packed.quantization.method == "gguf" and floats.quantization.method == "none"
    assert packed.memory["weights_bytes"] < 0.45 * floats.memory["weights_bytes"]
    got, want = _greedy(packed, PROMPTS), _greedy(floats, PROMPTS)
    # The float model holds the same values (float16, exact for these blocks); the 4-bit
    # kernel rounds activations to bfloat16, so a near-tie may flip late in a sequence.
    agree = _agreement(got, want)
    assert agree >= 0.75, (kind, agree, got, want)
    assert got[0][:4] == want[0][:4]


def test_a_gemma3_gguf_runs_as_stored_like_its_dequantized_model(home: Path) -> None:
    """Gemma's GGUF norms (1 + weight as llama.cpp writes them) on the quantized-as-stored path:
    the same tokens as the dequantized conversion."""
    path = _quantized_gguf(home / "tiny-gemma3.gguf", "Q8_0", arch="gemma3_text")
    settings = dict(device="cpu", dtype="float32", num_gpu_blocks_override=64)
    packed = LLM(str(path), quantization="checkpoint", **settings)
    floats = LLM(str(path), quantization="none", **settings)
    assert packed.quantization.method == "gguf"
    got, want = _greedy(packed, PROMPTS), _greedy(floats, PROMPTS)
    assert _agreement(got, want) >= 0.75, (got, want)
    assert got[0][:4] == want[0][:4]


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_int8_and_int4_at_load_run_the_rounded_weights(tmp_path: Path, method: str) -> None:
    """Quantizing at load equals running a float model whose projections hold the rounded
    values (made here with `quantize` then `dequantize`): the same weights, only the kernels'
    arithmetic differs."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder = save_llama(tmp_path / "tiny", hidden_size=256, intermediate_size=512)
    rounded = tmp_path / "rounded"
    shutil.copytree(folder, rounded)
    bits = 8 if method == "int8" else 4
    state = load_file(str(folder / "model.safetensors"))
    for name, w in state.items():
        if name.endswith("_proj.weight"):
            state[name] = dequantize(quantize(w, bits, 128))
    save_file(state, str(rounded / "model.safetensors"), metadata={"format": "pt"})
    settings = dict(device="cpu", dtype="float32", num_gpu_blocks_override=64)
    base = LLM(str(rounded), quantization="none", **settings)
    llm = LLM(str(folder), quantization=method, **settings)
    assert llm.quantization.method == method
    assert llm.memory["weights_bytes"] < base.memory["weights_bytes"]
    got, want = _greedy(llm, PROMPTS), _greedy(base, PROMPTS)
    agree = _agreement(got, want)
    assert agree >= 0.75, (method, agree, got, want)


def test_an_unsupported_gguf_type_is_refused_by_name_before_loading(home: Path) -> None:
    qtype = GGMLQuantizationType.Q5_0

    def quant(name: str, w: np.ndarray):
        return (gguf_quantize(w, qtype), qtype) if name == "blk.0.ffn_up.weight" else None

    path = write_gguf(home / "q5_0.gguf", tiny_model("llama", hidden_size=64), quant=quant)
    with pytest.raises(gguf_quant.UnsupportedGGUFTypeError, match=r"Q5_0.*supported: Q4_0"):
        LLM(str(path), quantization="checkpoint", device="cpu")
    # none dequantizes any type gguf reads
    assert LLM(str(path), quantization="none", device="cpu").quantization.method == "none"


def test_requantizing_a_quantized_gguf_is_refused(home: Path) -> None:
    path = _quantized_gguf(home / "q8.gguf", "Q8_0")
    with pytest.raises(ConfigError, match="already quantized"):
        LLM(str(path), quantization="int4", device="cpu")


def test_a_quantized_weight_of_the_wrong_shape_is_named() -> None:
    from pagedctl.engine.models.registry import build_model
    from tests.tiny_models import tiny_config

    model = build_model(tiny_config("llama"), torch.float32, "cpu", quantized=True)
    wrong = quantize(torch.randn(64, 32), 4, 32)
    with pytest.raises(WeightLoadError, match=r"q_proj.weight: checkpoint quantized weight"):
        model.load_weights([("model.layers.0.self_attn.q_proj.weight", wrong)])


def test_the_bundled_model_runs_its_q4_1_blocks_close_to_the_dequantized_model() -> None:
    settings = dict(device="cpu", dtype="float32", num_gpu_blocks_override=256)
    packed = LLM(bundled_model(), quantization="checkpoint", **settings)
    floats = LLM(bundled_model(), quantization="none", **settings)
    sixteen_bit = sum(p.numel() for p in floats.model.parameters()) * 2
    assert packed.memory["weights_bytes"] < 0.40 * sixteen_bit
    prompts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Water boils at a temperature of",
        "The three primary colors are",
    ]
    params = SamplingParams(max_tokens=16, temperature=0.0)
    got = [o.outputs[0].token_ids for o in packed.generate(prompts, params)]
    want = [o.outputs[0].token_ids for o in floats.generate(prompts, params)]
    # Same weights, bfloat16 activations in the 4-bit matmul: at least 3 of 4 answers agree on
    # their first 8 tokens.
    assert sum(g[:8] == w[:8] for g, w in zip(got, want, strict=True)) >= 3, (got, want)


def test_integers_unpack_what_pack_wrote() -> None:
    q = torch.randint(0, 16, (8, 64))
    w = QuantizedWeight(4, 32, (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8), torch.ones(8, 2))
    assert torch.equal(integers(w), q.to(torch.int16))


FOLDERS = {
    "awq": ("awq", {}),
    "gptq-4bit": ("gptq", {}),
    "gptq-8bit": ("gptq", {"bits": 8}),
    "ct-w4a16": ("ct", {}),
    "ct-w8a16": ("ct", {"bits": 8, "group_size": None}),
}


@pytest.mark.parametrize("case", list(FOLDERS))
def test_a_quantized_folder_runs_as_stored_like_its_dequantized_model(
    tmp_path: Path, case: str
) -> None:
    """A folder written as AutoAWQ, GPTQModel or llm-compressor write it: its integers as stored
    against the same integers dequantized at load."""
    import json

    from transformers import AutoModelForCausalLM, LlamaConfig

    from tests.quant_writers import write_awq, write_compressed_tensors, write_gptq
    from tests.tiny_models import COMMON

    writer, options = FOLDERS[case]
    config = LlamaConfig(
        **{**COMMON, "hidden_size": 256, "intermediate_size": 512},
        architectures=["LlamaForCausalLM"],
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    write = {"awq": write_awq, "gptq": write_gptq, "ct": write_compressed_tensors}[writer]
    write(tmp_path, model.state_dict(), json.loads(config.to_json_string()), **options)
    settings = dict(device="cpu", dtype="float32", num_gpu_blocks_override=64)
    packed = LLM(str(tmp_path), quantization="checkpoint", **settings)
    floats = LLM(str(tmp_path), quantization="none", **settings)
    assert packed.quantization.method == packed.quantization.stored.method
    assert floats.quantization.method == "none"
    assert packed.memory["weights_bytes"] < floats.memory["weights_bytes"]
    got, want = _greedy(packed, PROMPTS), _greedy(floats, PROMPTS)
    assert _agreement(got, want) >= 0.75, (case, got, want)


def test_requantizing_a_quantized_folder_is_refused(tmp_path: Path) -> None:
    import json

    from transformers import AutoModelForCausalLM

    from tests.quant_writers import write_awq
    from tests.tiny_models import tiny_config

    config = tiny_config("llama")
    write_awq(tmp_path, AutoModelForCausalLM.from_config(config).state_dict(),
              json.loads(config.to_json_string()))  # fmt: skip
    with pytest.raises(ConfigError, match="already quantized"):
        LLM(str(tmp_path), quantization="int8", device="cpu")


def test_auto_dequantizes_what_fits_and_keeps_the_integers_of_what_does_not(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`auto` by device: float weights within a quarter of the machine's memory (CPU) or half
    the card's (CUDA) are dequantized, larger ones keep their integers (the card's memory and
    the CPU share faked here: the rule reads only those)."""
    from types import SimpleNamespace

    from pagedctl.engine.models import quantization
    from pagedctl.engine.models.quantization import plan_quantization
    from pagedctl.engine.models.source import resolve_model

    source = resolve_model(str(_quantized_gguf(home / "tiny-Q8_0.gguf", "Q8_0")))
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert plan_quantization(source, "auto", cpu, torch.float32).method == "none"
    assert plan_quantization(source, "checkpoint", cpu, torch.float32).method == "gguf"
    monkeypatch.setattr(quantization, "CPU_FLOAT_SHARE", 1e-12)
    assert plan_quantization(source, "auto", cpu, torch.float32).method == "gguf"
    for total, method in [(2**40, "none"), (2**10, "gguf")]:
        card = SimpleNamespace(total_memory=total)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _d, card=card: card)
        assert plan_quantization(source, "auto", cuda, torch.float16).method == method, total
        assert plan_quantization(source, "checkpoint", cuda, torch.float16).method == "gguf"


def _held_bytes(llm_plan, source, dtype_bytes: int) -> int:
    """What the loader yields for `source`: the QuantizedWeights' bytes and floats at
    `dtype_bytes` each."""
    from types import SimpleNamespace

    from pagedctl.engine.models.layers import model_spec
    from pagedctl.engine.models.quantization import weight_stream

    model = SimpleNamespace(spec=model_spec(source.hf_config), dtype=torch.float16)
    total = 0
    for _, w in weight_stream(llm_plan, source, model, 0):
        total += w.nbytes if isinstance(w, QuantizedWeight) else w.numel() * dtype_bytes
    return total


@pytest.mark.parametrize("case", ["Q4_0", "Q4_K", "Q6_K", "int8", "int4", *FOLDERS])
def test_planned_weight_bytes_are_what_the_loader_yields(home: Path, case: str) -> None:
    """`planned_weights_bytes` (what `pagedctl capacity` counts before anything loads) against
    the bytes of the weights the loader yields, exactly."""
    import json

    from transformers import AutoModelForCausalLM, LlamaConfig

    from pagedctl.engine.models.quantization import plan_quantization, planned_weights_bytes
    from pagedctl.engine.models.registry import expected_weight_shapes
    from pagedctl.engine.models.source import resolve_model
    from tests.quant_writers import write_awq, write_compressed_tensors, write_gptq
    from tests.tiny_models import COMMON

    if case.startswith("Q"):
        path = _quantized_gguf(home / f"tiny-{case}.gguf", case)
    elif case in ("int8", "int4"):
        path = save_llama(home / "tiny", hidden_size=256, intermediate_size=512)
    else:
        writer, options = FOLDERS[case]
        config = LlamaConfig(
            **{**COMMON, "hidden_size": 256, "intermediate_size": 512},
            architectures=["LlamaForCausalLM"],
        )
        torch.manual_seed(0)
        state = AutoModelForCausalLM.from_config(config).state_dict()
        write = {"awq": write_awq, "gptq": write_gptq, "ct": write_compressed_tensors}[writer]
        path = home / case
        write(path, state, json.loads(config.to_json_string()), **options)
    source = resolve_model(str(path))
    setting = case if case in ("int8", "int4") else "checkpoint"
    plan = plan_quantization(source, setting, torch.device("cpu"), torch.float16)
    assert plan.method != "none"
    shapes = expected_weight_shapes(source.hf_config)
    want = _held_bytes(plan, source, 2)
    got = planned_weights_bytes(shapes, plan.method, 2, plan.stored, source.gguf_file)
    assert got == want, (case, got, want)

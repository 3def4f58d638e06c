"""The model family registry: torch-free, agreeing with transformers, the one list of what runs."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from transformers import CONFIG_MAPPING

from pagedctl.engine.models.config import ModelConfig
from pagedctl.engine.models.registry import (
    FAMILIES,
    UnsupportedModelError,
    build_model,
    family_of,
    gguf_family,
    planning_family,
)

TINY = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def test_registry_config_and_kv_planning_load_without_torch() -> None:
    code = (
        "import sys\n"
        "class NoTorch:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'torch':\n"
        "            raise ImportError('imported torch: ' + name)\n"
        "sys.meta_path.insert(0, NoTorch())\n"
        "from pagedctl.engine.models.config import ModelConfig\n"
        "from pagedctl.engine.sizing.kv import layout_from_config_dict\n"
        "cfg = {'model_type': 'qwen3', 'num_attention_heads': 16, 'hidden_size': 1024,\n"
        "       'num_hidden_layers': 28, 'num_key_value_heads': 8}\n"
        "assert ModelConfig(cfg).head_dim == 128\n"
        "assert layout_from_config_dict(cfg).head_dim == 128\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_config_defaults_are_transformers_own(model_type: str) -> None:
    """Every default a family lists is its transformers config class's, where that class has the
    field (transformers 5 keeps rope_scaling inside rope_parameters)."""
    theirs = CONFIG_MAPPING[model_type]()
    ours = ModelConfig({"model_type": model_type})
    for name in FAMILIES[model_type].config_defaults:
        if name != "rope_scaling" and hasattr(theirs, name):
            assert getattr(ours, name) == getattr(theirs, name), name
    mine, their = ours.rope_parameters, theirs.rope_parameters
    if "sliding_attention" in their:  # Gemma 3: one mapping per layer type
        assert mine == their
    else:
        assert mine["rope_theta"] == their["rope_theta"]


def test_build_model_takes_the_class_from_the_spec() -> None:
    runs = [f for f in FAMILIES.values() if f.model_class]
    for family in runs:
        config = CONFIG_MAPPING[family.model_type](**TINY, architectures=[*family.architectures])
        model = build_model(config, torch.float32, "cpu")
        assert f"{type(model).__module__}.{type(model).__name__}".endswith(family.model_class)
        assert model.spec.family is family_of(config) is family
    names = ", ".join(a for f in runs for a in f.architectures)
    with pytest.raises(UnsupportedModelError, match=f"pagedctl runs {names}$"):
        family_of(CONFIG_MAPPING["gpt2"]())


def test_mistral_runs_with_its_window_and_unknown_types_plan_as_a_llama() -> None:
    mistral = CONFIG_MAPPING["mistral"](**TINY, architectures=["MistralForCausalLM"])
    assert family_of(mistral) is planning_family("mistral") is FAMILIES["mistral"]
    assert FAMILIES["mistral"].sliding_window(mistral) == 4096  # MistralConfig's default
    assert FAMILIES["mistral"].layer_windows(mistral) == (4096,) * TINY["num_hidden_layers"]
    three = {**TINY, "num_hidden_layers": 3}
    qwen2 = CONFIG_MAPPING["qwen2"](
        **three, use_sliding_window=True, sliding_window=8, max_window_layers=1
    )
    assert FAMILIES["qwen2"].layer_windows(qwen2) == (None, 8, 8)  # from transformers' layer_types
    raw = ModelConfig({"model_type": "qwen2", **three, "use_sliding_window": True,
                       "sliding_window": 8, "max_window_layers": 1})  # fmt: skip
    assert FAMILIES["qwen2"].layer_windows(raw) == (None, 8, 8)  # config.json: the same rule
    assert FAMILIES["qwen2"].layer_windows(CONFIG_MAPPING["qwen2"](**three)) == (None,) * 3
    assert planning_family("gemma") is FAMILIES["llama"]
    assert gguf_family("qwen3") is FAMILIES["qwen3"]
    with pytest.raises(
        UnsupportedModelError, match="converts llama, qwen2, qwen3, gemma2, gemma3 "
    ):
        gguf_family("mistral")
    # Gemma 3's config.json: five local layers to a global one (`sliding_window_pattern`)
    gemma3 = ModelConfig({"model_type": "gemma3_text", **TINY, "num_hidden_layers": 7,
                          "sliding_window": 8})  # fmt: skip
    assert FAMILIES["gemma3_text"].layer_windows(gemma3) == (8,) * 5 + (None, 8)
    assert gemma3.rope_parameters["sliding_attention"]["rope_theta"] == 10_000.0

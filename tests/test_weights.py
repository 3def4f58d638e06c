"""Model sources: folders (sharded or not), presets, the offline HF cache, errors, `models list`."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import huggingface_hub
import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

from pagedctl.engine.models.config import ModelConfig
from pagedctl.engine.models.layers import model_spec
from pagedctl.engine.models.registry import UnsupportedModelError, expected_weight_shapes
from pagedctl.engine.models.rope import RopeConfig
from pagedctl.engine.models.source import resolve_model
from pagedctl.engine.models.weights import (
    ModelNotFoundError,
    PickleCheckpointError,
    cached_hf_models,
    iter_weights,
    load_tokenizer,
)
from pagedctl.engine.sizing.kv import KVLayout

TINY = {
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}
CONFIGS = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}
VARIANTS = {
    "llama": ("llama", {}),
    "llama-biases-untied": (
        "llama",
        {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": False},
    ),
    "qwen2": ("qwen2", {}),
    "qwen3-head-dim-16": ("qwen3", {"head_dim": 16}),
}


def tiny_model(kind: str, **overrides: object) -> PreTrainedModel:
    torch.manual_seed(0)
    config = CONFIGS[kind](**(TINY | {"tie_word_embeddings": True} | overrides))
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def save_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["<unk>", "<eos>", "hello", "paged", "world"])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>").save_pretrained(folder)


@pytest.fixture(autouse=True)
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDCTL_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf"))


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_folder_yields_hf_names_shapes_and_values(
    tmp_path: Path, variant: str, sharded: bool
) -> None:
    kind, overrides = VARIANTS[variant]
    model = tiny_model(kind, **overrides)
    folder = tmp_path / "model"
    model.save_pretrained(
        folder, safe_serialization=True, max_shard_size="8KB" if sharded else "1GB"
    )
    assert (folder / "model.safetensors.index.json").is_file() == sharded

    source = resolve_model(str(folder))

    assert (source.load_format, source.weights_dir, source.tokenizer_dir) == (
        "safetensors",
        folder,
        None,
    )
    assert type(source.hf_config.to_transformers()) is CONFIGS[kind]
    weights = dict(iter_weights(source))
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    assert weights.keys() == state.keys()
    assert all(torch.equal(weights[k], state[k]) for k in state)
    shapes = {k: tuple(v.shape) for k, v in weights.items()}
    assert shapes == expected_weight_shapes(source.hf_config)


def test_expected_shapes_spell_out_qwen3_head_dim() -> None:
    config = Qwen3Config(**TINY, head_dim=16)
    shapes = expected_weight_shapes(config)
    assert shapes["model.layers.1.self_attn.q_proj.weight"] == (64, 32)
    assert shapes["model.layers.1.self_attn.k_proj.weight"] == (32, 32)
    assert shapes["model.layers.1.self_attn.o_proj.weight"] == (32, 64)
    assert shapes["model.layers.1.self_attn.k_norm.weight"] == (16,)
    assert KVLayout.from_config(config).bytes_per_token == 2 * 2 * 2 * 16 * 2


def test_tokenizer_folder_and_dummy_over_a_folder(tmp_path: Path) -> None:
    folder = tmp_path / "model"
    tiny_model("llama").save_pretrained(folder)
    save_tokenizer(folder)

    source = resolve_model(str(folder))
    assert source.tokenizer_dir == folder
    assert load_tokenizer(source).encode("hello paged world") == [2, 3, 4]

    dummy = resolve_model(str(folder), load_format="dummy")
    assert (dummy.load_format, dummy.weights_dir, dummy.tokenizer_dir) == ("dummy", None, folder)
    with pytest.raises(ValueError, match="dummy"):
        next(iter_weights(dummy))


def test_dummy_needs_only_a_config(tmp_path: Path) -> None:
    folder = tmp_path / "config-only"
    tiny_model("qwen2").config.save_pretrained(folder)
    with pytest.raises(ModelNotFoundError, match=r"no \*\.safetensors weights.*'dummy'"):
        resolve_model(str(folder))
    assert resolve_model(str(folder), "dummy").hf_config.hidden_size == 32


# name -> (architecture, layers, hidden, heads, kv heads, head_dim, vocab, KV bytes per token)
PRESETS = {
    "qwen2.5-0.5b-instruct": ("Qwen2ForCausalLM", 24, 896, 14, 2, 64, 151936, 12288),
    "qwen3-0.6b": ("Qwen3ForCausalLM", 28, 1024, 16, 8, 128, 151936, 114688),
    "llama-3.2-1b": ("LlamaForCausalLM", 16, 2048, 32, 8, 64, 128256, 32768),
    "llama-3-8b": ("LlamaForCausalLM", 32, 4096, 32, 8, 128, 128256, 131072),
    "mistral-7b": ("MistralForCausalLM", 32, 4096, 32, 8, 128, 32000, 131072),
    "gemma-2-2b": ("Gemma2ForCausalLM", 26, 2304, 8, 4, 256, 256000, 106496),
    "gemma-3-1b": ("Gemma3ForCausalLM", 26, 1152, 4, 1, 256, 262144, 26624),
    "phi-3-mini": ("Phi3ForCausalLM", 32, 3072, 32, 32, 96, 32064, 393216),
    "smollm2-135m-instruct": ("LlamaForCausalLM", 30, 576, 9, 3, 64, 49152, 23040),
}


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_resolve_to_dummy_with_published_shapes(name: str) -> None:
    source = resolve_model(name)
    c = source.hf_config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    got = (c.architectures[0], c.num_hidden_layers, c.hidden_size, c.num_attention_heads)
    got += (c.num_key_value_heads, head_dim, c.vocab_size, KVLayout.from_config(c).bytes_per_token)
    assert got == PRESETS[name]
    assert (source.load_format, source.weights_dir, source.tokenizer_dir) == ("dummy", None, None)
    assert c.tie_word_embeddings == (name not in ("llama-3-8b", "mistral-7b", "phi-3-mini"))
    with pytest.raises(ModelNotFoundError, match="no tokenizer"):
        load_tokenizer(source)
    with pytest.raises(ModelNotFoundError, match="without weights"):
        resolve_model(name, load_format="safetensors")


def test_preset_rope_and_special_ids() -> None:
    llama = resolve_model("llama-3.2-1b").hf_config
    assert model_spec(llama).rope == RopeConfig("llama3", 500000.0, 32.0, 1.0, 4.0, 8192)
    assert (llama.bos_token_id, llama.eos_token_id, llama.max_position_embeddings) == (
        128000,
        128001,
        131072,
    )
    qwen3 = resolve_model("qwen3-0.6b").hf_config
    assert (
        model_spec(qwen3).rope.theta,
        qwen3.rms_norm_eps,
        qwen3.max_position_embeddings,
    ) == (
        1000000,
        1e-6,
        40960,
    )
    smol = resolve_model("smollm2-135m-instruct").hf_config
    assert (smol.bos_token_id, smol.eos_token_id, smol.pad_token_id) == (1, 2, 2)
    assert model_spec(smol).rope.theta == 100000


def test_user_presets_and_json_files(tmp_path: Path) -> None:
    presets = tmp_path / "home" / "models" / "presets"
    presets.mkdir(parents=True)
    config = tiny_model("llama").config.to_dict()
    (presets / "my-tiny.json").write_text(json.dumps(config))
    (presets / "qwen3-0.6b.json").write_text(json.dumps(config))  # replaces the bundled one
    assert resolve_model("my-tiny").hf_config.hidden_size == 32
    assert resolve_model("qwen3-0.6b").hf_config.model_type == "llama"
    source = resolve_model(str(presets / "my-tiny.json"))
    assert (source.load_format, source.hf_config.num_hidden_layers) == ("dummy", 2)


def test_missing_model_lists_everything_tried(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model(str(tmp_path / "nowhere"))
    message = str(err.value)
    for needle in (
        str(tmp_path / "nowhere"),
        "engine/models/presets",
        "models/presets",
        "qwen3-0.6b",
        "Hugging Face cache",
        str(tmp_path / "hf"),
    ):
        assert needle in message
    known = r"known: gemma-2-2b, gemma-3-1b, llama-3-8b, llama-3\.2-1b, mistral-7b, phi-3-mini, "
    with pytest.raises(ModelNotFoundError, match=known):
        resolve_model("org/not-cached")


def test_unsupported_architecture_names_it_and_the_supported_ones(tmp_path: Path) -> None:
    folder = tmp_path / "gpt2"
    GPT2Config(n_layer=1, architectures=["GPT2LMHeadModel"]).save_pretrained(folder)
    with pytest.raises(UnsupportedModelError) as err:
        resolve_model(str(folder))
    assert "'GPT2LMHeadModel' is not supported" in str(err.value)
    assert "LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM" in str(err.value)
    with pytest.raises(UnsupportedModelError, match="'GPT2LMHeadModel'"):
        resolve_model(str(folder), load_format="dummy")


def test_pickle_checkpoints_are_refused_unread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "pickled"
    model = tiny_model("llama")
    model.config.save_pretrained(folder)
    torch.save(model.state_dict(), folder / "pytorch_model.bin")
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("a pickle was loaded"))
    with pytest.raises(PickleCheckpointError) as err:
        resolve_model(str(folder))
    assert "pytorch_model.bin" in str(err.value)
    assert "Convert to safetensors" in str(err.value)
    assert isinstance(err.value, UnsupportedModelError)


def test_missing_shard_and_other_bad_inputs(tmp_path: Path) -> None:
    folder = tmp_path / "sharded"
    tiny_model("llama").save_pretrained(folder, max_shard_size="8KB")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    lost = sorted(set(index["weight_map"].values()))[1]
    (folder / lost).unlink()
    with pytest.raises(ModelNotFoundError, match=re.escape(f"missing: {lost}")):
        resolve_model(str(folder))
    notes = tmp_path / "notes.txt"
    notes.write_text("not a model")
    with pytest.raises(ModelNotFoundError, match="is a file; pass the folder"):
        resolve_model(str(notes))
    with pytest.raises(ValueError, match="load_format must be one of auto, safetensors, dummy"):
        resolve_model("qwen3-0.6b", load_format="pt")


def hf_cache_add(cache: Path, repo_id: str, folder: Path) -> Path:
    """Lay `folder` out as the HF hub cache does: blobs, a snapshot of symlinks, refs/main."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for file in folder.iterdir():
        blob = repo / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        blob.write_bytes(file.read_bytes())
        (snapshot / file.name).symlink_to(blob)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snapshot


def test_hf_cache_offline(tmp_path: Path) -> None:
    cache = tmp_path / "hf"
    tiny_model("qwen3").save_pretrained(tmp_path / "q3")
    snapshot = hf_cache_add(cache, "org/tiny-qwen3", tmp_path / "q3")
    GPT2Config(n_layer=1, architectures=["GPT2LMHeadModel"]).save_pretrained(tmp_path / "g")
    hf_cache_add(cache, "org/gpt2", tmp_path / "g")

    source = resolve_model("org/tiny-qwen3")
    assert (source.load_format, source.weights_dir) == ("safetensors", snapshot)
    assert len(dict(iter_weights(source))) == len(expected_weight_shapes(source.hf_config))
    assert [(m.repo_id, m.snapshot) for m in cached_hf_models()] == [("org/tiny-qwen3", snapshot)]
    assert cached_hf_models()[0].size_bytes > 0


def test_cli_models_list(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from pagedctl.cli import app

    tiny_model("qwen3").save_pretrained(tmp_path / "q3")
    hf_cache_add(tmp_path / "hf", "org/tiny-qwen3", tmp_path / "q3")
    result = CliRunner().invoke(app, ["models", "list"], env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    row = next(line for line in lines if "SmolLM2-135M-Instruct" in line)
    assert "default, not pulled" in row
    row = next(line for line in lines if "qwen3-0.6b" in line)
    cells = [cell.strip() for cell in row.split("│")]
    assert cells[2:9] == [
        "preset (dummy)",
        "Qwen3ForCausalLM",
        "28",
        "1024",
        "16/8",
        "114,688",
        "-",
    ]
    row = next(line for line in lines if "org/tiny-qwen3" in line)
    assert "HF cache" in row and "Qwen3ForCausalLM" in row


def _reads(cfg) -> tuple:
    """Everything the engine reads from a config: the model's spec, weight shapes, the special
    ids and the context length."""
    ids = tuple(getattr(cfg, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id"))
    rope = {k: v for k, v in cfg.rope_parameters.items() if v is not None}
    return (model_spec(cfg), expected_weight_shapes(cfg), ids, cfg.max_position_embeddings, rope)


@pytest.mark.parametrize("name", list(PRESETS))
def test_model_config_reads_as_transformers_does(name: str) -> None:
    """The engine's own config reader agrees with transformers' config on every preset, and
    with fields dropped from config.json (each family's defaults)."""
    import random

    raw = ModelConfig.from_file(resolve_model.__globals__["list_presets"]()[name]).to_dict()
    optional = [k for k in raw if k not in ("model_type", "architectures")]
    rng = random.Random(name)
    for trial in range(12):
        dropped = rng.sample(optional, k=rng.randint(0, len(optional))) if trial else []
        if "hidden_size" in dropped or "num_attention_heads" in dropped:  # head_dim must divide
            dropped = [k for k in dropped if k not in ("hidden_size", "head_dim")]
        kept = {k: v for k, v in raw.items() if k not in dropped}
        ours = ModelConfig(kept)
        try:
            theirs = ours.to_transformers()
        except (ValueError, KeyError):  # a combination transformers itself refuses
            continue
        assert _reads(ours) == _reads(theirs), sorted(dropped)


def test_a_preset_job_does_not_import_transformers(tmp_path: Path) -> None:
    import subprocess
    import sys

    code = (
        "import sys; from pagedctl.engine import LLM; "
        "llm = LLM('tiny-llama', load_format='dummy', device='cpu', num_gpu_blocks_override=64); "
        "print(llm.generate([{'prompt_token_ids': [1, 2, 3]}])[0].outputs[0].token_ids[:1]); "
        "print('transformers' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split()[-1] == "False", out.stdout

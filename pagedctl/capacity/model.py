"""What a model costs before it is loaded: KV bytes per token, weight bytes, an activation peak.

Nothing is built and no weight is read: the config comes from `config.json` (a folder, a bare
file, a preset in `recipes/models/` or the offline Hugging Face cache) and the parameter count
from the safetensors headers when there are weights, else from the config's shapes.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace

from pagedctl.engine import KVLayout, layout_from_config_dict, planning_family

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
_DTYPE_ALIASES = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16"}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
_MAX_HEADER = 100 * 2**20  # a safetensors header larger than this is not a header


class ModelSpecError(ValueError):
    """The model cannot be found or counted; the message says what to pass instead."""


@dataclass(frozen=True)
class ModelFootprint:
    """The shape facts capacity planning needs, read from a config (and safetensors headers).

    Attributes:
        name: what the user named.
        config: the raw `config.json` mapping (its `text_config` for nested configs).
        num_params: parameters the engine holds (a tied `lm_head` counted once).
        params_source: "safetensors headers" or "config".
        tokenizer_dir: a folder with tokenizer files, or None.
        notes: caveats about the count, printed under the tables.
        gguf_file: the GGUF the model's folder keeps (its quantized blocks), or None.
    """

    name: str
    config: dict
    num_params: int
    params_source: str
    tokenizer_dir: Path | None = None
    notes: tuple[str, ...] = field(default=())
    gguf_file: Path | None = None

    def layout(self, dtype_bytes: int) -> KVLayout:
        return layout_from_config_dict(self.config, dtype_bytes)

    def weights_bytes(self, dtype_bytes: int, method: str = "none") -> int:
        """Weights as the engine holds them loaded by `method` (a `--quantization` choice, after
        `auto` is decided: `quantization`): every parameter in the run's dtype for none, else
        the packed bytes (`engine.planned_weights_bytes`)."""
        if method == "none":
            return self.num_params * dtype_bytes
        from pagedctl.engine import planned_weights_bytes

        return planned_weights_bytes(
            self.weight_shapes(), method, dtype_bytes, self.stored_quant, self.gguf_file
        )

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the engine holds, by its Hugging Face name (a tied head once)."""
        from pagedctl.engine import expected_weight_shapes

        family = planning_family(self.config.get("model_type"))
        return expected_weight_shapes(SimpleNamespace(**self.config), family)

    @property
    def stored_quant(self):
        """The checkpoint's `quantization_config`, checked (`engine.checkpoint_quant`), or None."""
        from pagedctl.engine import checkpoint_quant

        qc = self.config.get("quantization_config")
        return checkpoint_quant({"quantization_config": qc}) if qc else None

    def own_quantization(self) -> str:
        """The method of the checkpoint's own integers ("gguf", "awq", ...), or "none"."""
        from pagedctl.engine import own_quantization

        return own_quantization(self.gguf_file, self.stored_quant)

    @property
    def kv_window(self) -> int | None:
        """The sliding window every layer attends within (a sequence then holds only its
        window's blocks), or None where some layer attends to the whole history."""
        family = planning_family(self.config.get("model_type"))
        try:
            return family.kv_window(SimpleNamespace(**self.config))
        except (AttributeError, ValueError):
            return None

    @property
    def max_positions(self) -> int:
        return int(self.config.get("max_position_embeddings") or 4096)


def dtype_bytes(dtype: str, config: dict) -> tuple[str, int]:
    """(dtype name, bytes per element) of the KV cache and weights on a GPU.

    "auto" is the config's 16-bit dtype, and float16 for a float32 config: what the engine
    picks on CUDA (bfloat16 from compute capability 8.0, float16 before; both are 2 bytes).
    """
    name = _DTYPE_ALIASES.get(dtype, dtype)
    if name == "auto":
        declared = config.get("torch_dtype") or config.get("dtype") or "bfloat16"
        name = declared if declared in ("float16", "bfloat16") else "float16"
    if name not in DTYPE_BYTES:
        raise ModelSpecError(f"unknown dtype {dtype!r}; use auto, float16, bfloat16 or float32")
    return name, DTYPE_BYTES[name]


def resolve_footprint(model: str) -> ModelFootprint:
    """Find `model` (folder, config file, preset or cached Hugging Face id) and count it."""
    from pagedctl.engine import list_presets, resolve_model

    path = Path(model).expanduser()
    if path.is_dir():
        return _from_folder(model, path)
    if path.is_file() and path.suffix == ".gguf":
        source = resolve_model(model)  # converted once into the cache
        return replace(_from_folder(model, source.weights_dir), gguf_file=source.gguf_file)
    if path.is_file():
        if path.suffix != ".json":
            raise ModelSpecError(f"{path} is not a folder, a .gguf or a config.json file")
        return _from_config(model, _read_config(path), None)
    presets = list_presets()
    if model in presets:
        return _from_config(model, _read_config(presets[model]), None)
    try:
        source = resolve_model(model)
    except ValueError:
        source = None
    if source is not None and source.weights_dir is not None:
        return _from_folder(model, source.weights_dir)
    raise ModelSpecError(
        f"model {model!r} not found: give a folder with config.json, a config .json file, a "
        f"cached Hugging Face id or a preset ({', '.join(sorted(presets))})"
    )


def _read_config(path: Path) -> dict:
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelSpecError(f"cannot read {path}: {e}") from None
    if not isinstance(raw, dict):
        raise ModelSpecError(f"{path} is not a config object")
    return raw


def _from_folder(name: str, folder: Path) -> ModelFootprint:
    raw = _read_config(folder / "config.json") if (folder / "config.json").is_file() else None
    if raw is None:
        raise ModelSpecError(f"{folder} has no config.json")
    tok = folder if any((folder / f).is_file() for f in _TOKENIZER_FILES) else None
    files = sorted(folder.glob("*.safetensors"))
    if raw.get("quantization_config") and "text_config" in raw:
        raw = {**raw["text_config"], "quantization_config": raw["quantization_config"]}
    if not files or raw.get("quantization_config"):  # packed words count no parameters
        return replace(_from_config(name, raw, tok), gguf_file=_kept_gguf(folder))
    cfg = raw.get("text_config") or raw
    tied = bool(cfg.get("tie_word_embeddings", raw.get("tie_word_embeddings", False)))
    shapes = safetensors_shapes(files)
    count = sum(math.prod(s) for n, s in shapes.items() if not (tied and n == "lm_head.weight"))
    gguf = _kept_gguf(folder)
    return ModelFootprint(name, cfg, count, "safetensors headers", tok, _notes(cfg), gguf)


def _kept_gguf(folder: Path) -> Path | None:
    """The GGUF a converted folder keeps beside its safetensors, as the engine finds it."""
    from pagedctl.engine import resolve_model

    try:
        return resolve_model(str(folder)).gguf_file
    except ValueError:
        return None


def _from_config(name: str, raw: dict, tokenizer_dir: Path | None) -> ModelFootprint:
    cfg = raw.get("text_config") or raw
    try:
        layout_from_config_dict(cfg)
        count = params_from_config(cfg)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ModelSpecError(f"{name}: cannot count this config: {e}") from None
    return ModelFootprint(name, cfg, count, "config", tokenizer_dir, _notes(cfg))


def _notes(cfg: dict) -> tuple[str, ...]:
    notes = []
    kind = cfg.get("model_type")
    family = planning_family(kind)
    if family.model_type != kind:
        notes.append(
            f"model_type {kind!r}: weights counted as a Llama-style decoder; give "
            "--non-kv-memory for an exact budget"
        )
    if cfg.get("num_experts") or cfg.get("num_local_experts"):
        notes.append("mixture of experts: the weight count from the config is not exact")
    window = family.sliding_window(SimpleNamespace(**cfg))
    try:
        every = family.kv_window(SimpleNamespace(**cfg)) is not None
    except (AttributeError, ValueError):
        every = False
    if window and not every:  # a window on every layer is shown in section 2
        notes.append(
            f"sliding window {window} on some layers only: the others attend to every "
            "token, so a sequence holds all its blocks"
        )
    return tuple(notes)


def params_from_config(cfg: dict) -> int:
    """Parameters of a checkpoint with this config: the tensors of its `planning_family` (a
    Llama's for a model_type the engine does not know)."""
    from pagedctl.engine import expected_weight_shapes

    shapes = expected_weight_shapes(SimpleNamespace(**cfg), planning_family(cfg.get("model_type")))
    return sum(math.prod(s) for s in shapes.values())


def safetensors_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from the JSON headers of safetensors files; no tensor data is read."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        with open(file, "rb") as f:
            head = f.read(8)
            size = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            if not 0 < size <= _MAX_HEADER:
                raise ModelSpecError(f"{file} is not a safetensors file")
            try:
                header = json.loads(f.read(size))
            except ValueError:
                raise ModelSpecError(f"{file} has an unreadable safetensors header") from None
        for key, meta in header.items():
            if key != "__metadata__":
                shapes[key] = tuple(meta["shape"])
    return shapes


def activation_peak_bytes(config: dict, dtype_bytes: int, num_tokens: int, logit_rows: int) -> int:
    """Estimated activation peak of the engine's profile step (one prefill of `num_tokens`).

    The larger of the two phases, per token of the step: a decoder layer's MLP (residual and
    normed input, float32 norm temporaries, the fused gate/up output, its activation and the
    product: 2h + 4i elements plus 2h float32), and the logits of `logit_rows` rows (the model's
    dtype, then float32) beside the last hidden states. Kernel workspaces are not counted.
    """
    h, i = config["hidden_size"], config["intermediate_size"]
    vocab = config["vocab_size"]
    layer = num_tokens * ((2 * h + 4 * i) * dtype_bytes + 2 * h * 4)
    rows = min(logit_rows, num_tokens)
    logits = num_tokens * h * dtype_bytes + rows * vocab * (dtype_bytes + 4)
    return max(layer, logits)

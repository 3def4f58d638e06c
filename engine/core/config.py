"""Engine configuration: `EngineConfig`, the one source of every engine setting.

Each field carries its type, default, unit, valid range and help text (`Setting`). `LLM(**kwargs)`
takes the fields; the command line's flags, the recipes' `engine:` keys and the sweep's axes are
generated from them, so adding a setting is one edit here. A config is checked when it is built,
before any model is loaded. `CacheConfig` and `SchedulerConfig` are the resolved, internal halves
the engine builds from it once the device is known.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from .units import parse_bytes

BIG_CARD_BYTES = 70 * 2**30  # a card this large gets a serving engine's step limits
DTYPES = ("auto", "float32", "float16", "bfloat16")
LOAD_FORMATS = ("auto", "safetensors", "dummy")
QUANTIZATIONS = ("auto", "checkpoint", "none", "int8", "int4")


class ConfigError(ValueError):
    """An engine setting that cannot be used as given; the message names it and what it takes."""


@dataclass(frozen=True)
class Setting:
    """What the rest of pagedctl knows about one field of `EngineConfig`.

    Attributes:
        help: one line for `--help`, recipes and docs.
        kind: "int", "float", "bool", "str", "bytes" (a size such as "4GiB") or "choice".
        unit: shown after the default ("tokens", "blocks", "fraction of device memory").
        low, high: inclusive bounds of a number (`low_open`: the low bound is excluded).
        choices: the values a "choice" takes.
        aliases: other names accepted everywhere (the short names of earlier versions).
        short: the name tables and labels show (default: the field's name).
        auto: what None means when it is the default ("the device's", "the model's").
        load: changing it needs the model loaded anew (no sweep axis, no `reconfigure`).
    """

    help: str
    kind: str
    unit: str = ""
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    choices: tuple[Any, ...] = ()
    aliases: tuple[str, ...] = ()
    short: str = ""
    auto: str = ""
    load: bool = False


def setting(default: Any, help: str, kind: str, **info: Any) -> Any:
    """A dataclass field whose metadata is its `Setting`."""
    return field(default=default, metadata={"setting": Setting(help, kind, **info)})


@dataclass(frozen=True)
class EngineConfig:
    """Every engine setting, checked when built. See `Setting` for what a field's metadata says."""

    model: str | None = setting(
        None,
        "Model: a Hugging Face folder, a .gguf file, a preset (dummy weights) or a model id in "
        "the local Hugging Face cache.",
        "str",
        auto="the bundled SmolLM2-135M-Instruct",
        load=True,
    )
    served_model_name: str | None = setting(
        None, "Model name written into results.", "str", auto="the model's name", load=True
    )
    load_format: str = setting(
        "auto",
        "auto, safetensors, or dummy (random weights of the model's config).",
        "choice",
        choices=LOAD_FORMATS,
        load=True,
    )
    quantization: str = setting(
        "auto",
        "Weights as integers: checkpoint (the checkpoint's own, e.g. a GGUF's blocks, as "
        "stored), auto (none where float weights take at most a quarter of the CPU's memory or "
        "half the card's, else checkpoint), none (dequantize to --dtype), "
        "int8 or int4 (from 16/32-bit weights at load, groups of 128).",
        "choice",
        choices=QUANTIZATIONS,
        load=True,
    )
    dtype: str = setting(
        "auto",
        "Weights and KV cache: auto (bf16 on CUDA 8.0+, fp16 before, fp32 on the CPU), float32, "
        "float16 or bfloat16.",
        "choice",
        choices=DTYPES,
        load=True,
    )
    device: str = setting("auto", "auto, cpu, cuda or cuda:N.", "str", load=True)
    seed: int = setting(
        0, "Seed of the dummy weights, of unseeded sampling and of the block hashes.", "int",
        low=0, load=True,
    )  # fmt: skip
    block_size: int = setting(16, "KV block size.", "int", unit="tokens", low=1)
    num_gpu_blocks_override: int | None = setting(
        None,
        "KV blocks in the pool, instead of sizing it from memory.",
        "int",
        unit="blocks",
        low=1,
        aliases=("num_blocks",),
        short="num_blocks",
        auto="sized from memory",
    )
    kv_cache_memory_bytes: int | str | None = setting(
        None,
        "KV cache size, e.g. 4GiB or 512MiB (overrides --gpu-memory-utilization).",
        "bytes",
        aliases=("kv_cache_memory",),
        short="kv_cache_memory",
        auto="sized from memory",
    )
    gpu_memory_utilization: float = setting(
        0.9,
        "CUDA: the fraction of the device's total memory this process may use for weights, "
        "activations and the KV cache together.",
        "float",
        unit="fraction",
        low=0.0,
        low_open=True,
        high=1.0,
        aliases=("gpu_mem",),
        short="gpu_mem",
    )
    max_num_seqs: int | None = setting(
        None,
        "Most sequences running at once.",
        "int",
        low=1,
        auto="1,024 on a CUDA card of 70 GiB or more, else 256",
    )
    max_num_batched_tokens: int | None = setting(
        None,
        "Token budget of one step; longer prefills are chunked.",
        "int",
        unit="tokens",
        low=1,
        auto="16,384 on a CUDA card of 70 GiB or more, 8,192 on smaller ones, 2,048 on the CPU",
    )
    max_model_len: int | None = setting(
        None,
        "Longest sequence, prompt and output.",
        "int",
        unit="tokens",
        low=1,
        auto="the model's, capped by the pool",
    )
    enable_prefix_caching: bool = setting(
        True,
        "Share the KV blocks of common prefixes between requests.",
        "bool",
        aliases=("prefix_caching",),
        short="prefix_caching",
    )
    cuda_graphs: bool | str = setting(
        True,
        "CUDA: replay steps from CUDA graphs captured per batch size; ignored on the CPU, "
        "which has none ('emulate' runs the same path without CUDA, for tests).",
        "bool",
        choices=("emulate",),
    )
    num_scheduler_steps: int = setting(
        8,
        "Decode steps run back to back per scheduling round where a decode graph exists (one "
        "host synchronisation a round); 1 schedules every step.",
        "int",
        low=1,
    )
    num_threads: int | None = setting(
        None,
        "CPU threads of each torch operation (OMP_NUM_THREADS, when set, replaces the automatic "
        "choice).",
        "int",
        low=1,
        aliases=("threads",),
        short="threads",
        auto="the CPUs free of other work; on CUDA, torch's",
    )
    preemption_mode: str = setting(
        "recompute",
        "How a preempted sequence gets its KV back: recompute it, swap it to host memory and "
        "back, or auto (per victim, whichever the costs timed at start-up say is cheaper).",
        "choice",
        choices=("recompute", "swap", "auto"),
    )
    swap_space: float = setting(
        4.0,
        "Host memory (pinned on CUDA) for swapped-out KV blocks, with --preemption-mode swap "
        "or auto.",
        "float",
        unit="GiB",
        low=0.0,
    )
    deterministic: bool = setting(
        False,
        "Batch-invariant kernels: a request's greedy or seeded output depends on the request "
        "alone, not on what ran beside it, in every dtype (slower).",
        "bool",
    )
    debug: bool = setting(
        False,
        "Check the KV allocator's invariants (free and referenced blocks, reference counts, "
        "each sequence's block table) after every step and stop at the first broken one "
        "(slower); generate then prints the traceback, as it does for any unexpected error.",
        "bool",
    )

    def __post_init__(self) -> None:
        for f in fields(self):
            check_value(f.name, getattr(self, f.name))

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], where: str = "engine") -> EngineConfig:
        """A config from settings by any of their names; an unknown name is an error."""
        return cls(**canonical(values, where))

    def replace(self, **changes: Any) -> EngineConfig:
        """A copy with `changes` (by any of the settings' names) applied and checked."""
        return dataclasses.replace(self, **canonical(changes, "engine"))

    def given(self) -> dict[str, Any]:
        """The settings that differ from their defaults, by name."""
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if getattr(self, f.name) != f.default
        }


SETTINGS: dict[str, Setting] = {f.name: f.metadata["setting"] for f in fields(EngineConfig)}
DEFAULTS: dict[str, Any] = {f.name: f.default for f in fields(EngineConfig)}
ALIASES: dict[str, str] = {a: name for name, s in SETTINGS.items() for a in s.aliases}
NAMES: tuple[str, ...] = tuple(SETTINGS)
RUNTIME_NAMES: tuple[str, ...] = tuple(n for n, s in SETTINGS.items() if not s.load)


def short_name(name: str) -> str:
    """The name a table or a label shows for a setting."""
    return SETTINGS[name].short or name


def canonical(values: Mapping[str, Any], where: str) -> dict[str, Any]:
    """`values` keyed by the settings' own names (aliases resolved), each checked."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        name = ALIASES.get(key, key)
        if name not in SETTINGS:
            raise ConfigError(f"{where}: unknown engine setting {key!r}; known: {', '.join(NAMES)}")
        if name in out:
            raise ConfigError(f"{where}: {name} given twice (as {key!r} and another name)")
        out[name] = coerce(name, value, where)
    return out


def coerce(name: str, value: Any, where: str = "engine") -> Any:
    """A value for setting `name`, from a recipe or a flag: "on"/"off" as booleans, checked."""
    s = SETTINGS[name]
    if s.kind == "bool" and isinstance(value, str) and value.lower() in _BOOL_WORDS:
        value = _BOOL_WORDS[value.lower()]
    if s.kind == "float" and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if s.kind == "str" and isinstance(value, os.PathLike):
        value = os.fspath(value)
    try:
        check_value(name, value)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    return value


_BOOL_WORDS = {"on": True, "true": True, "yes": True, "off": False, "false": False, "no": False}


def check_value(name: str, value: Any) -> None:
    """Raise ConfigError unless `value` is one that setting `name` takes (None: its default)."""
    s = SETTINGS[name]
    if value is None:
        if DEFAULTS[name] is not None:
            raise ConfigError(f"{name} needs a value (its default is {DEFAULTS[name]!r})")
        return
    if value in s.choices and type(value) is type(s.choices[0]):
        return
    if not _is_kind(s.kind, value):
        raise ConfigError(f"{name} must be {describe(name)}, got {value!r}")
    if s.kind == "bytes":
        try:
            parse_bytes(value)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{name}: {e}") from None
    if s.kind in ("int", "float"):
        below = value <= s.low if s.low_open else value < s.low if s.low is not None else False
        if below or (s.high is not None and value > s.high):
            raise ConfigError(f"{name} must be {describe(name)}, got {value!r}")


def _is_kind(kind: str, value: Any) -> bool:
    if isinstance(value, bool):
        return kind == "bool"
    return {
        "int": isinstance(value, int),
        "float": isinstance(value, int | float),
        "bytes": isinstance(value, int | str),
        "str": isinstance(value, str),
        "choice": False,
        "bool": False,
    }[kind]


def describe(name: str) -> str:
    """What a setting takes, in words: "an integer >= 1", "a number in (0, 1]", ...."""
    s = SETTINGS[name]
    if s.kind == "choice":
        return "one of " + ", ".join(map(str, s.choices))
    if s.kind == "bool":
        return "on or off (true or false)" + "".join(f" or {c!r}" for c in s.choices)
    if s.kind == "bytes":
        return "a size in bytes, e.g. 4GiB"
    if s.kind == "str":
        return "a string"
    noun = "an integer" if s.kind == "int" else "a number"
    if s.low is not None and s.high is not None:
        return f"{noun} in {'(' if s.low_open else '['}{s.low:g}, {s.high:g}]"
    if s.low is not None:
        return f"{noun} {'>' if s.low_open else '>='} {s.low:g}"
    return noun


def show_default(name: str) -> str:
    """A setting's default as help text shows it."""
    s, default = SETTINGS[name], DEFAULTS[name]
    if default is None:
        return s.auto or "none"
    if isinstance(default, bool):
        return "on" if default else "off"
    return f"{default} {s.unit}".strip() if s.unit and s.unit != "fraction" else str(default)


@dataclass(frozen=True)
class CacheConfig:
    """Shape and policy of the paged KV cache, once the pool is sized.

    Attributes:
        block_size: tokens per KV block.
        num_blocks: blocks in the pool.
        enable_prefix_caching: reuse full blocks across sequences through chained block hashes.
        hash_seed: root of the hash chain; fixed so that results are reproducible run to run.
        num_host_blocks: blocks of the host pool that swapped-out sequences hold (0: none).
        sliding_window: the window every layer of the model attends within (`ModelSpec.kv_window`):
            a sequence gives back each block whose keys no later query sees. None: none.
    """

    block_size: int = DEFAULTS["block_size"]
    num_blocks: int = 1024
    enable_prefix_caching: bool = DEFAULTS["enable_prefix_caching"]
    hash_seed: int = 0
    num_host_blocks: int = 0
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one scheduler step, once the device's defaults are filled in.

    Attributes:
        max_num_batched_tokens: token budget of one step (prefill chunks and decodes together).
        max_num_seqs: most sequences running at once.
        max_model_len: longest sequence (prompt + output) in tokens.
        debug: check the allocator invariants after every step (cheap, but not free).
        preemption_mode: "recompute", "swap" or "auto" (see `engine.swap`).
    """

    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    max_model_len: int = 4096
    debug: bool = False
    preemption_mode: str = "recompute"

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        modes = SETTINGS["preemption_mode"].choices
        if self.preemption_mode not in modes:
            raise ValueError(f"preemption_mode must be one of {modes}: {self.preemption_mode!r}")


def default_step_limits(device_type: str, total_bytes: int = 0) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) when the user gives neither: vLLM's defaults for a
    large card (16,384 / 1,024), 8,192 / 256 on smaller CUDA cards (a T4), 2,048 / 256 on the CPU.
    """
    if device_type != "cuda":
        return 2048, 256
    return (16384, 1024) if total_bytes >= BIG_CARD_BYTES else (8192, 256)

"""Benchmark recipes: one YAML file names the model, the engine settings, a synthetic workload and
the peers that run it in the same process (`pagedctl bench --recipe FILE`).

The workload is nano-bench, the throughput benchmark nano-vllm made common: `num_requests`
prompts of random token ids drawn from `token_ids` (half-open), prompt lengths and `max_tokens`
uniform in the closed ranges `prompt_len` and `output_len`, all from one `random.Random(seed)`;
EOS is ignored on every side, so each request produces exactly its `max_tokens`.
A long tail: `long_fraction` of the requests (chosen by the same generator, after the rest is
drawn) take `max_tokens` uniform in `long_output_len` instead.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedctl.engine import SETTINGS, ConfigError, EngineConfig, canonical_settings
from pagedctl.recipe_file import RecipeError, read_recipe

PEERS = ("hf-generate", "hf-static", "hf-continuous", "vllm")
TOP_KEYS = ("name", "engine", "workload", "peers")  # and any engine setting, e.g. model
WORKLOAD_KEYS = (
    "num_requests",
    "prompt_len",
    "output_len",
    "token_ids",
    "seed",
    "temperature",
    "long_fraction",
    "long_output_len",
)
PEER_KEYS = {
    "hf-generate": ("batch_size", "attn_implementation"),
    "hf-static": ("batch_size", "attn_implementation", "compile", "warmup_new_tokens"),
    "hf-continuous": (
        "page_size",
        "use_cuda_graph",
        "num_blocks",
        "max_batch_tokens",
        "max_memory_percent",
        "attn_implementation",
        "time_limit_s",
    ),
    # python: the interpreter that has vLLM; engine: vllm.LLM keyword arguments; env: variables
    # of its process (VLLM_CPU_KVCACHE_SPACE, ...); timeout_s: the longest wait for an answer
    "vllm": ("python", "engine", "env", "timeout_s"),
}


@dataclass(frozen=True)
class WorkloadSpec:
    """How to draw the requests (see the module docstring)."""

    num_requests: int = 256
    prompt_len: tuple[int, int] = (100, 1024)
    output_len: tuple[int, int] = (100, 1024)
    token_ids: tuple[int, int] = (0, 10000)
    seed: int = 0
    temperature: float = 0.6
    long_fraction: float = 0.0
    long_output_len: tuple[int, int] | None = None


@dataclass(frozen=True)
class Workload:
    """The drawn requests: prompt token ids and each one's `max_tokens`."""

    prompts: list[list[int]]
    max_tokens: list[int]
    temperature: float

    @property
    def prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))

    @property
    def output_tokens(self) -> int:
        return sum(self.max_tokens)


@dataclass
class BenchRecipe:
    """A checked benchmark recipe: pagedctl's engine settings, the workload, the peers'."""

    name: str
    config: EngineConfig = field(default_factory=EngineConfig)
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    peers: dict[str, dict[str, Any]] = field(default_factory=dict)

    # Every side runs the same model on the same device, in the same dtype, from the same seed.
    model = property(lambda self: self.config.model)
    load_format = property(lambda self: self.config.load_format)
    device = property(lambda self: self.config.device)
    dtype = property(lambda self: self.config.dtype)
    seed = property(lambda self: self.config.seed)


def make_workload(spec: WorkloadSpec) -> Workload:
    """Draw the prompts first, then the output lengths, from one generator (as nano-vllm does)."""
    rng = random.Random(spec.seed)
    lo, hi = spec.token_ids
    prompts = [
        [rng.randrange(lo, hi) for _ in range(rng.randint(*spec.prompt_len))]
        for _ in range(spec.num_requests)
    ]
    max_tokens = [rng.randint(*spec.output_len) for _ in range(spec.num_requests)]
    if spec.long_fraction and spec.long_output_len:
        chosen = rng.sample(range(spec.num_requests), round(spec.long_fraction * spec.num_requests))
        for i in sorted(chosen):
            max_tokens[i] = rng.randint(*spec.long_output_len)
    return Workload(prompts, max_tokens, spec.temperature)


def parse_peers(text: str) -> list[str]:
    """`--peer a,b`: known peer names, in the given order; "none" runs pagedctl alone."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if names == ["none"]:
        return []
    unknown = [n for n in names if n not in PEERS]
    if unknown or not names:
        raise RecipeError(f"unknown peer(s) {unknown or text!r}; choose from {', '.join(PEERS)}")
    return list(dict.fromkeys(names))


def load_bench_recipe(path: Path) -> BenchRecipe:
    """Read and check a benchmark recipe; a typo in a key is an error, not a silent default."""
    doc = read_recipe(path)
    top = {k: v for k, v in doc.items() if k not in SETTINGS}
    _check_keys(path, "recipe", top, (*TOP_KEYS, "or an engine setting"))
    section = doc.get("engine") or {}
    if not isinstance(section, dict):
        raise RecipeError(f"recipe {path}: section 'engine' must be a mapping")
    engine = {k: v for k, v in doc.items() if k in SETTINGS}
    try:
        config = EngineConfig(**canonical_settings({**engine, **section}, f"recipe {path}, engine"))
    except ConfigError as e:
        raise RecipeError(str(e)) from None
    work = doc.get("workload") or {}
    if not isinstance(work, dict):
        raise RecipeError(f"recipe {path}: section 'workload' must be a mapping")
    _check_keys(path, "workload", work, WORKLOAD_KEYS)
    peers = doc.get("peers") or {}
    if not isinstance(peers, dict):
        raise RecipeError(f"recipe {path}: 'peers' must map peer names to their settings")
    _check_keys(path, "peers", peers, PEERS)
    for name, settings in peers.items():
        if settings is not None and not isinstance(settings, dict):
            raise RecipeError(f"recipe {path}: settings of peer {name!r} must be a mapping")
        _check_keys(path, f"peer {name}", settings or {}, PEER_KEYS[name])
    return BenchRecipe(
        name=str(doc.get("name") or path.stem),
        config=config,
        workload=_workload(path, work),
        peers={name: dict(settings or {}) for name, settings in peers.items()},
    )


def _check_keys(path: Path, where: str, doc: dict, known: tuple[str, ...]) -> None:
    unknown = sorted(map(str, set(doc) - set(known)))
    if unknown:
        raise RecipeError(
            f"recipe {path}: unknown {where} keys {unknown}; known: {', '.join(known)}"
        )


def _int(path: Path, key: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise RecipeError(f"recipe {path}: {key} must be an integer >= {low}, got {value!r}")
    return value


def _range(path: Path, key: str, value: Any, low: int, half_open: bool = False) -> tuple[int, int]:
    ok = isinstance(value, list | tuple) and len(value) == 2
    if ok:
        a, b = (_int(path, key, v, low) for v in value)
        if a < b or (a == b and not half_open):
            return a, b
    raise RecipeError(
        f"recipe {path}: workload {key} must be [low, high] integers >= {low} with low "
        f"{'<' if half_open else '<='} high, got {value!r}"
    )


def _workload(path: Path, w: dict) -> WorkloadSpec:
    d = WorkloadSpec()
    temperature = w.get("temperature", d.temperature)
    if isinstance(temperature, bool) or not isinstance(temperature, int | float) or temperature < 0:
        raise RecipeError(f"recipe {path}: workload temperature must be >= 0, got {temperature!r}")
    fraction = w.get("long_fraction", d.long_fraction)
    if (
        isinstance(fraction, bool)
        or not isinstance(fraction, int | float)
        or not 0 <= fraction <= 1
    ):
        raise RecipeError(
            f"recipe {path}: workload long_fraction must be in [0, 1], got {fraction!r}"
        )
    long_len = w.get("long_output_len")
    if long_len is not None:
        long_len = _range(path, "long_output_len", long_len, 1)
    if fraction and long_len is None:
        raise RecipeError(f"recipe {path}: workload long_fraction needs long_output_len")
    return WorkloadSpec(
        long_fraction=float(fraction),
        long_output_len=long_len,
        num_requests=_int(path, "num_requests", w.get("num_requests", d.num_requests), 1),
        prompt_len=_range(path, "prompt_len", w.get("prompt_len", d.prompt_len), 1),
        output_len=_range(path, "output_len", w.get("output_len", d.output_len), 1),
        token_ids=_range(path, "token_ids", w.get("token_ids", d.token_ids), 0, half_open=True),
        seed=_int(path, "seed", w.get("seed", d.seed), 0),
        temperature=float(temperature),
    )

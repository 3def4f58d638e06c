"""The paged engine as a library: `LLM` runs requests on a model through a paged KV cache.

Its public surface is what this module exports; the allocator classes are part of it because
`pagedctl capacity` simulates on them (the real allocator, not a copy). Names load on first use,
so reading a setting (`pagedctl.engine.config`) or the CLI's `--help` never imports torch.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

# torch gives its loggers their level (WARNING) at the very end of `import torch`. A signal that
# ends the process inside that import (SIGTERM while a job loads the model) leaves them unset, and
# the exit hooks torch had registered by then (FakeTensor's cache statistics, at INFO) would log
# through the application's handlers. torch's own default, set before torch is imported:
if logging.getLogger("torch").level == logging.NOTSET:
    logging.getLogger("torch").setLevel(logging.WARNING)

# name -> module of this package that defines it, or (module, its name there) where the name
# there is too plain for the package's surface. The CLI imports these and nothing behind them
# (tests/test_layering.py): a module moved inside the engine changes this table only.
_EXPORTS: dict[str, str | tuple[str, str]] = {
    # running requests
    "LLM": "llm",
    "BeamSearchParams": "beam_search",
    "CompletionOutput": "outputs",
    "MIN_MAX_TOKENS": "sampling_params",
    "ReplicaPool": "ray_data",
    "RequestOutput": "outputs",
    "SamplingParams": "sampling_params",
    "TokenBytes": "token_bytes",
    # settings (one source: EngineConfig's fields)
    "CacheConfig": "config",
    "ConfigError": "config",
    "ENGINE_DEFAULTS": ("config", "DEFAULTS"),
    "EngineConfig": "config",
    "RUNTIME_SETTING_NAMES": ("config", "RUNTIME_NAMES"),
    "SETTINGS": "config",
    "SETTING_ALIASES": ("config", "ALIASES"),
    "SETTING_NAMES": ("config", "NAMES"),
    "SchedulerConfig": "config",
    "Setting": "config",
    "canonical_settings": ("config", "canonical"),
    "coerce_setting": ("config", "coerce"),
    "default_step_limits": "config",
    "describe_setting": ("config", "describe"),
    "setting_default": ("config", "show_default"),
    "setting_short_name": ("config", "short_name"),
    # the allocator and scheduler (capacity simulates on the real ones)
    "BlockPool": "block_pool",
    "FreeKVCacheBlockQueue": "block_pool",
    "KVCacheBlock": "block_pool",
    "KVCacheManager": "kv_cache_manager",
    "PrefixCacheStats": "kv_cache_manager",
    "Scheduler": "scheduler",
    "SchedulerOutput": "scheduler",
    "SchedulerStats": "scheduler",
    "Sequence": "sequence",
    "SequenceStatus": "sequence",
    "cdiv": "kv_sizing",
    "host_blocks": "swap",
    # sizing
    "KVLayout": "kv_sizing",
    "format_bytes": "kv_sizing",
    "kv_budget_bytes": "kv_sizing",
    "layout_from_config_dict": "kv_sizing",
    "max_concurrency": "kv_sizing",
    "parse_bytes": "kv_sizing",
    "sequences_in_pool": "kv_sizing",
    "default_cpu_kv_bytes": "device",
    "resolve_device": "device",
    "resolve_dtype": "device",
    # models: where they come from, their configs and weights
    "GGUFConversionError": "gguf",
    "ModelNotFoundError": "weights",
    "UnsupportedModelError": "weights",
    "before_engine": "startup",
    "cached_hf_models": "weights",
    "convert_gguf": "gguf",
    "expected_weight_shapes": "weights",
    "install_model": ("model_cache", "install"),
    "list_presets": "model_source",
    "load_config": "weights",
    "load_tokenizer": "weights",
    "model_cache_dir": ("model_cache", "cache_dir"),
    "model_is_installed": ("model_cache", "is_installed"),
    "model_spec": "models",
    "resolve_model": "model_source",
    "sha256_file": "gguf",
    "update_manifest": "gguf",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    where = _EXPORTS.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attr = where if isinstance(where, tuple) else (where, name)
    return getattr(importlib.import_module(f"{__name__}.{module}"), attr)


def __dir__() -> list[str]:
    return [*globals(), *__all__]

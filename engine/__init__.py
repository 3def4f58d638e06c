"""The paged engine as a library: `LLM` runs requests on a model through a paged KV cache.

Its public surface is what this module exports; the allocator classes are part of it because
`pagedctl capacity` simulates on them (the real allocator, not a copy). Names load on first use,
so reading a setting (`pagedctl.engine.core.config`) or the CLI's `--help` never imports torch.
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
    "BEAM_ONLY_FIELDS": "core.beam_search",
    "BeamSearchParams": "core.beam_search",
    "ClusterUnavailable": "scale_out",
    "CompletionOutput": "outputs",
    "Engine": "protocol",
    "MAX_LOGPROBS": "core.sampling_params",
    "MIN_MAX_TOKENS": "core.sampling_params",
    "ReplicaPool": "scale_out.ray_data",
    "ReplicaShare": "protocol",
    "Replicas": "protocol",
    "RequestOutput": "outputs",
    "SAMPLING_FIELDS": "core.sampling_params",
    "SamplingField": "core.sampling_fields",
    "SamplingParams": "core.sampling_params",
    "TokenBytes": "token_bytes",
    # settings (one source: EngineConfig's fields)
    "CacheConfig": "core.config",
    "ConfigError": "core.config",
    "ENGINE_DEFAULTS": ("core.config", "DEFAULTS"),
    "EngineConfig": "core.config",
    "RUNTIME_SETTING_NAMES": ("core.config", "RUNTIME_NAMES"),
    "QUANTIZATIONS": "core.config",
    "SETTINGS": "core.config",
    "SETTING_ALIASES": ("core.config", "ALIASES"),
    "SETTING_NAMES": ("core.config", "NAMES"),
    "SchedulerConfig": "core.config",
    "Setting": "core.config",
    "canonical_settings": ("core.config", "canonical"),
    "coerce_setting": ("core.config", "coerce"),
    "default_step_limits": "core.config",
    "describe_setting": ("core.config", "describe"),
    "setting_default": ("core.config", "show_default"),
    "setting_short_name": ("core.config", "short_name"),
    # the allocator and scheduler (capacity simulates on the real ones)
    "BlockPool": "core.block_pool",
    "FreeKVCacheBlockQueue": "core.block_pool",
    "KVCacheBlock": "core.block_pool",
    "KVCacheManager": "core.kv_cache_manager",
    "PrefixCacheStats": "core.kv_cache_manager",
    "Scheduler": "core.scheduler",
    "SchedulerOutput": "core.scheduler",
    "SchedulerStats": "core.scheduler",
    "Sequence": "core.sequence",
    "SequenceStatus": "core.sequence",
    "host_blocks": "core.swap",
    # units: blocks by ceiling division, byte sizes read and written
    "cdiv": "core.units",
    "format_bytes": "core.units",
    "parse_bytes": "core.units",
    # sizing
    "KVLayout": "sizing.kv",
    "kv_budget_bytes": "sizing.kv",
    "layout_from_config_dict": "sizing.kv",
    "max_concurrency": "sizing.kv",
    "sequences_in_pool": "sizing.kv",
    "default_cpu_kv_bytes": "sizing.device",
    "resolve_device": "sizing.device",
    "resolve_dtype": "sizing.device",
    # models: where they come from, their configs and weights
    "GGUFConversionError": "models.gguf",
    "ModelNotFoundError": "models.weights",
    "UnsupportedModelError": "models.registry",
    "before_engine": "runner.startup",
    "cached_hf_models": "models.weights",
    "convert_gguf": "models.gguf",
    "expected_weight_shapes": "models.registry",
    "install_model": ("models.cache", "install"),
    "list_presets": "models.source",
    "load_config": "models.weights",
    "load_tokenizer": "models.weights",
    "model_cache_dir": ("models.cache", "cache_dir"),
    "model_is_installed": ("models.cache", "is_installed"),
    "model_spec": "models.layers",
    "planning_family": "models.registry",
    "float_budget": "models.quantization",
    "checkpoint_quant": "models.quant_formats",
    "choose_quantization": ("models.quantization", "choose_method"),
    "own_quantization": "models.quantization",
    "plan_quantization": "models.quantization",
    "planned_weights_bytes": "models.quantization",
    "resolve_model": "models.source",
    "sha256_file": "models.gguf",
    "update_manifest": "models.gguf",
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

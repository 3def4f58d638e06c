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

_EXPORTS = {  # name -> module of this package that defines it
    "LLM": "llm",
    "BeamSearchParams": "beam_search",
    "BlockPool": "block_pool",
    "CacheConfig": "config",
    "CompletionOutput": "outputs",
    "ConfigError": "config",
    "EngineConfig": "config",
    "FreeKVCacheBlockQueue": "block_pool",
    "KVCacheBlock": "block_pool",
    "KVCacheManager": "kv_cache_manager",
    "ModelNotFoundError": "weights",
    "PrefixCacheStats": "kv_cache_manager",
    "RequestOutput": "outputs",
    "SamplingParams": "sampling_params",
    "Scheduler": "scheduler",
    "SchedulerConfig": "config",
    "SchedulerOutput": "scheduler",
    "SchedulerStats": "scheduler",
    "Sequence": "sequence",
    "SequenceStatus": "sequence",
    "Setting": "config",
    "UnsupportedModelError": "weights",
    "resolve_model": "model_source",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def __dir__() -> list[str]:
    return [*globals(), *__all__]

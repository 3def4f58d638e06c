"""The paged engine as a library: `LLM` runs requests on a model through a paged KV cache.

Its public surface is what this module exports; the allocator classes are part of it because
`pagedctl capacity` simulates on them (the real allocator, not a copy).
"""

from pagedctl.engine.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from pagedctl.engine.config import (
    CacheConfig,
    ConfigError,
    EngineConfig,
    SchedulerConfig,
    Setting,
)
from pagedctl.engine.kv_cache_manager import KVCacheManager, PrefixCacheStats
from pagedctl.engine.llm import LLM
from pagedctl.engine.model_source import resolve_model
from pagedctl.engine.outputs import CompletionOutput, RequestOutput
from pagedctl.engine.sampling_params import SamplingParams
from pagedctl.engine.scheduler import Scheduler, SchedulerOutput, SchedulerStats
from pagedctl.engine.sequence import Sequence, SequenceStatus
from pagedctl.engine.weights import ModelNotFoundError, UnsupportedModelError

__all__ = [
    "LLM",
    "BlockPool",
    "CacheConfig",
    "CompletionOutput",
    "ConfigError",
    "EngineConfig",
    "FreeKVCacheBlockQueue",
    "KVCacheBlock",
    "KVCacheManager",
    "ModelNotFoundError",
    "PrefixCacheStats",
    "RequestOutput",
    "SamplingParams",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SchedulerStats",
    "Sequence",
    "SequenceStatus",
    "Setting",
    "UnsupportedModelError",
    "resolve_model",
]

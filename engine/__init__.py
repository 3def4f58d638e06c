"""The paged engine: allocator, prefix cache, scheduler (and, later, the model runner and `LLM`)."""

from engine.block_hash import BlockHash, hash_block_tokens
from engine.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from engine.config import CacheConfig, SchedulerConfig
from engine.kv_cache_manager import KVCacheManager, PrefixCacheStats
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput, SchedulerStats
from engine.sequence import Sequence, SequenceStatus

__all__ = [
    "BlockHash",
    "BlockPool",
    "CacheConfig",
    "FreeKVCacheBlockQueue",
    "KVCacheBlock",
    "KVCacheManager",
    "PrefixCacheStats",
    "SamplingParams",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SchedulerStats",
    "Sequence",
    "SequenceStatus",
    "hash_block_tokens",
]

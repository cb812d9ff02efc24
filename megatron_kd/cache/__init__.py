"""Teacher top-K cache: a Zarr v3 store keyed by global sample index, one partition per DP rank."""

from megatron_kd.cache.codec import CacheBusyError, CacheError, CacheWriteError
from megatron_kd.cache.layout import PartitionLayout
from megatron_kd.cache.meta import SCHEMA_VERSION, CacheMeta
from megatron_kd.cache.reader import CacheReader
from megatron_kd.cache.writer import CacheWriter

__all__ = ["SCHEMA_VERSION", "CacheBusyError", "CacheError", "CacheWriteError", "CacheMeta", "CacheReader", "CacheWriter", "PartitionLayout"]

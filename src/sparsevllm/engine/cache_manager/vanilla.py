"""vanilla: dense attention over the whole cache — the correctness and speed baseline."""
from sparsevllm.engine.cache_manager.base import CacheManager


class VanillaCacheManager(CacheManager):
    """Every hook keeps CacheManager's dense default."""
    method_name = "vanilla"

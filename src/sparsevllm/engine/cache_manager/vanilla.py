"""vanilla: dense attention over the whole cache — the correctness and speed baseline."""
from sparsevllm.engine.cache_manager.base import CacheManager
from sparsevllm.method_registry import register_method


@register_method("vanilla")
class VanillaCacheManager(CacheManager):
    """Every hook keeps CacheManager's dense default."""

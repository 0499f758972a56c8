"""vanilla: dense attention over the whole cache — the correctness and speed baseline."""
from sparsevllm.engine.cache_manager.base import CacheManager, Capabilities


class VanillaCacheManager(CacheManager):
    """Every hook keeps CacheManager's dense default."""
    method_name = "vanilla"
    request_knobs = ()   # every request is dense already
    # KV heads split across ranks; nothing is shared across heads.
    capabilities = Capabilities(tensor_parallel=True)

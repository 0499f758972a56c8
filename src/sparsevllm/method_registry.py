"""Method name -> cache-manager class, and the parsing of LLM(...)'s flat knobs into a validated
EngineConfig. The class carries its config dataclass, prefill policy and capabilities; the registry
is what LLM(), the benchmark and the regression harness enumerate. Adding a method: its module in
engine/cache_manager/ and one entry below.

A class is imported when it is first asked for: a cache manager pulls in torch and the kernels,
and naming the methods (every --help does) must not. Imports run one way: config <- cache managers
<- this module, so nothing below imports it back.
"""
import difflib
import importlib
from typing import TYPE_CHECKING

from sparsevllm.config import ENGINE_KNOBS, EngineConfig

if TYPE_CHECKING:
    from sparsevllm.engine.cache_manager.base import CacheManager

REGISTRY = {
    "vanilla": "sparsevllm.engine.cache_manager.vanilla:VanillaCacheManager",
    "snapkv": "sparsevllm.engine.cache_manager.snapkv:SnapKVCacheManager",
    "quest": "sparsevllm.engine.cache_manager.quest:QuestCacheManager",
    "omnikv": "sparsevllm.engine.cache_manager.omnikv:OmniKVCacheManager",
    "deltakv": "sparsevllm.engine.cache_manager.deltakv:DeltaKVCacheManager",
    "hisparse": "sparsevllm.engine.cache_manager.hisparse:HiSparseCacheManager",
}


def available_methods() -> list[str]:
    return sorted(REGISTRY)


def get_method(name: str) -> "type[CacheManager]":
    if not isinstance(name, str) or name not in REGISTRY:
        raise ValueError(f"unknown vllm_sparse_method {name!r}; registered methods: {', '.join(sorted(REGISTRY))}")
    module, cls = REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls)


def methods() -> "dict[str, type[CacheManager]]":
    return {name: get_method(name) for name in REGISTRY}


def method_knob_owners() -> dict[str, str]:
    """Every method knob -> the method that owns it (knobs are flat LLM(...) keyword arguments)."""
    return {knob: name for name, cls in methods().items() for knob in cls.config_cls.knob_names()}


def make_config(model: str | None = None, vllm_sparse_method: str | None = None, **knobs) -> EngineConfig:
    """Split flat knobs into engine and method config and validate both; loads nothing.
    `sparse_method` is an alias of `vllm_sparse_method`; giving both with different values is an error."""
    if "sparse_method" in knobs:
        alias = knobs.pop("sparse_method")
        if vllm_sparse_method is not None and vllm_sparse_method != alias:
            raise ValueError(f"vllm_sparse_method={vllm_sparse_method!r} and its alias sparse_method={alias!r} "
                             "disagree; give one of them")
        vllm_sparse_method = alias
    method_cls = get_method("vanilla" if vllm_sparse_method is None else vllm_sparse_method)
    own = set(method_cls.config_cls.knob_names())
    owners = method_knob_owners()
    engine_kw, method_kw = {}, {}
    for key, value in knobs.items():
        if key in ENGINE_KNOBS:
            engine_kw[key] = value
        elif key in own:
            method_kw[key] = value
        elif key in owners:
            raise ValueError(f"knob {key!r} belongs to method {owners[key]!r}, "
                             f"but vllm_sparse_method={method_cls.method_name!r}")
        else:
            known = ENGINE_KNOBS + sorted(owners)
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; valid knobs: {', '.join(known)}"
            raise ValueError(f"unknown knob {key!r}{hint}")
    cfg = EngineConfig(model=model, vllm_sparse_method=method_cls.method_name,
                       method_config=method_cls.config_cls(**method_kw), method=method_cls, **engine_kw)
    cfg.validate()
    if cfg.kv_cache_dtype != "auto" and not method_cls.capabilities.fp8_kv_cache:
        raise ValueError(f"kv_cache_dtype={cfg.kv_cache_dtype!r} is not supported by vllm_sparse_method="
                         f"{method_cls.method_name!r} yet; valid: auto")
    return cfg

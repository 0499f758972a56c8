"""Method name -> cache-manager class, and the parsing of LLM(...)'s flat knobs into a validated
EngineConfig. The class carries its config dataclass, prefill policy and capabilities; the registry
is what LLM(), the benchmark and the regression harness enumerate. Adding a method: its module in
engine/cache_manager/ and one entry below.

A class is imported when it is first asked for: a cache manager pulls in torch and the kernels,
and naming the methods (every --help does) must not. Imports run one way: config <- cache managers
<- this module, so nothing below imports it back.
"""
import copy
import dataclasses
import difflib
import importlib
from typing import TYPE_CHECKING

from sparsevllm.config import AUTO_KNOBS, ENGINE_KNOBS, EngineConfig
from sparsevllm.sparse_params import RequestSparsity, SparseParams

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


# vllm_sparse_method="auto" is no method of its own: the engine runs auto_method's cache manager,
# whose per-request budgets make a short request a dense row (request_sparsity below).
AUTO = "auto"


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
    auto = vllm_sparse_method == AUTO
    if auto:
        method_cls = auto_method(knobs.get("auto_method", EngineConfig.auto_method))
        if knobs.get("tensor_parallel_size", 1) != 1:
            raise ValueError("vllm_sparse_method='auto' does not support tensor_parallel_size > 1 yet (the "
                             "followers would need each request's choice); use tensor_parallel_size=1")
    else:
        method_cls = get_method("vanilla" if vllm_sparse_method is None else vllm_sparse_method)
        for knob in AUTO_KNOBS:
            if knob in knobs:
                raise ValueError(f"knob {knob!r} belongs to vllm_sparse_method='auto', but vllm_sparse_method="
                                 f"{method_cls.method_name!r}")
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
    cfg = EngineConfig(model=model, vllm_sparse_method=AUTO if auto else method_cls.method_name,
                       method_config=method_cls.config_cls(**method_kw), method=method_cls, **engine_kw)
    cfg.validate()
    if cfg.kv_cache_dtype != "auto" and not method_cls.capabilities.fp8_kv_cache:
        raise ValueError(f"kv_cache_dtype={cfg.kv_cache_dtype!r} is not supported by vllm_sparse_method="
                         f"{method_cls.method_name!r} yet; valid: auto")
    return cfg


def auto_method(name) -> "type[CacheManager]":
    """auto_method's class: a registered method that takes per-request budgets (a dense row beside
    sparse ones), not vanilla."""
    cls = get_method(name) if isinstance(name, str) and name in REGISTRY else None
    if cls is None or cls.request_knobs is None or cls.method_name == "vanilla":
        mixable = [n for n, c in methods().items() if c.request_knobs is not None and n != "vanilla"]
        raise ValueError(f"auto_method={name!r} is invalid; valid: {' | '.join(mixable)} (a method that takes "
                         "per-request budgets, so short requests decode densely in the same batch)")
    return cls


def request_sparsity(config: EngineConfig, sparse: SparseParams | None, prompt_len: int,
                     name: str = "sparse_params") -> RequestSparsity:
    """What one request decodes with, in an engine of `config`: its SparseParams (None: the
    engine's default) resolved against the engine's method. Raises ValueError naming the field
    (`name`.method, or the knob, with the message make_config gives at launch); the engine fails
    that request alone. prompt_len decides "auto" (dense below auto_dense_below tokens)."""
    cls, engine_method = config.method, config.vllm_sparse_method
    if sparse is not None and not isinstance(sparse, SparseParams):
        raise TypeError(f"{name} must be SparseParams, got {type(sparse).__name__}")
    method = engine_method if sparse is None or sparse.method is None else sparse.method
    knobs = {} if sparse is None else dict(sparse.knobs)
    if (method != engine_method or knobs) and cls.request_knobs is None:
        raise ValueError(f"{name}: vllm_sparse_method={engine_method!r} takes no per-request sparsity: it owns its "
                         "KV pool's layout, which dense rows and other budgets cannot share yet; send the request "
                         "without one (the engine-wide knobs apply)")
    if (method != engine_method or knobs) and config.tensor_parallel_size > 1:
        raise ValueError(f"{name}: per-request sparsity does not support tensor_parallel_size > 1 yet (the "
                         "followers replay the engine's knobs); send the request without one")
    own = cls.method_name
    choices = ["vanilla", own] + ([AUTO] if engine_method == AUTO else [])
    if method not in choices:
        why = ("mixing two different sparse methods in one engine is not built yet" if method in REGISTRY
               else "it is no registered method")
        raise ValueError(f"{name}.method={method!r} is invalid here: this engine runs vllm_sparse_method="
                         f"{engine_method!r}" + (f" (auto_method={own!r})" if engine_method == AUTO else "")
                         + f"; a request may choose {' | '.join(dict.fromkeys(choices))} ({why})")
    if method == "vanilla" and knobs:
        raise ValueError(f"{name}: method 'vanilla' takes no knobs, got {', '.join(sorted(knobs))}")
    allowed = cls.request_knobs or ()
    owners = method_knob_owners()
    for key in knobs:
        if key in allowed:
            continue
        if key in cls.config_cls.knob_names():
            per = f"per-request knobs of {own}: {', '.join(allowed)}" if allowed else f"{own} has no per-request knobs"
            raise ValueError(f"{name}: knob {key!r} cannot be set per request ({per}); set it at launch")
        if key in owners:
            raise ValueError(f"{name}: knob {key!r} belongs to method {owners[key]!r}, but this request runs {own!r}")
        if key in ENGINE_KNOBS:
            raise ValueError(f"{name}: {key!r} is an engine knob, set at launch, not per request")
        close = difflib.get_close_matches(key, list(allowed), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else f"; per-request knobs of {own}: {', '.join(allowed)}"
        raise ValueError(f"{name}: unknown knob {key!r}{hint}")
    method_config = config.method_config
    if knobs:
        method_config = dataclasses.replace(method_config, **knobs)
        try:   # the launch's own checks, on a copy: a knob's validation may set engine knobs (QuEST's page size)
            method_config.validate(copy.copy(config))
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
    policy = None
    if method == AUTO:
        dense = prompt_len < config.auto_dense_below
        policy = (f"auto: prompt of {prompt_len} tokens {'<' if dense else '>='} auto_dense_below="
                  f"{config.auto_dense_below}")
        method = "vanilla" if dense else own
    if method == "vanilla":
        return RequestSparsity("vanilla", None, {}, policy)
    return RequestSparsity(own, method_config, {k: getattr(method_config, k) for k in allowed}, policy)

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
# An engine with mixed_methods builds this composite: one manager per hosted method over one pool.
MIXED = "sparsevllm.engine.cache_manager.mixed:MixedCacheManager"


def available_methods() -> list[str]:
    return sorted(REGISTRY)


def get_method(name: str) -> "type[CacheManager]":
    if not isinstance(name, str) or name not in REGISTRY:
        raise ValueError(f"unknown vllm_sparse_method {name!r}; registered methods: {', '.join(sorted(REGISTRY))}")
    return get_class(REGISTRY[name])


def get_class(path: str) -> type:
    module, cls = path.split(":")
    return getattr(importlib.import_module(module), cls)


def methods() -> "dict[str, type[CacheManager]]":
    return {name: get_method(name) for name in REGISTRY}


def method_knob_owners() -> dict[str, str]:
    """Every method knob -> the method that owns it (knobs are flat LLM(...) keyword arguments)."""
    return {knob: name for name, cls in methods().items() for knob in cls.config_cls.knob_names()}


def make_config(model: str | None = None, vllm_sparse_method: str | None = None, **knobs) -> EngineConfig:
    """Split flat knobs into engine and method config and validate both; loads nothing.
    `sparse_method` is an alias of `vllm_sparse_method`; giving both with different values is an error.
    With mixed_methods the engine hosts those methods too, and takes every hosted method's knobs."""
    if "sparse_method" in knobs:
        alias = knobs.pop("sparse_method")
        if vllm_sparse_method is not None and vllm_sparse_method != alias:
            raise ValueError(f"vllm_sparse_method={vllm_sparse_method!r} and its alias sparse_method={alias!r} "
                             "disagree; give one of them")
        vllm_sparse_method = alias
    auto = vllm_sparse_method == AUTO
    if auto:
        method_cls = auto_method(knobs.get("auto_method", EngineConfig.auto_method))
    else:
        method_cls = get_method("vanilla" if vllm_sparse_method is None else vllm_sparse_method)
        for knob in AUTO_KNOBS:
            if knob in knobs:
                raise ValueError(f"knob {knob!r} belongs to vllm_sparse_method='auto', but vllm_sparse_method="
                                 f"{method_cls.method_name!r}")
    mixed = mixed_classes(knobs.get("mixed_methods"), method_cls)
    hosted = ([method_cls] if method_cls.method_name != "vanilla" else []) + mixed
    own = {knob: cls.method_name for cls in hosted for knob in cls.config_cls.knob_names()}
    owners = method_knob_owners()
    engine_kw, method_kw = {}, {cls.method_name: {} for cls in hosted}
    for key, value in knobs.items():
        if key in ENGINE_KNOBS:
            engine_kw[key] = value
        elif key in own:
            method_kw[own[key]][key] = value
        elif key in owners:
            runs = f"vllm_sparse_method={method_cls.method_name!r}"
            if mixed:
                runs += f" with mixed_methods={[c.method_name for c in mixed]!r}"
            raise ValueError(f"knob {key!r} belongs to method {owners[key]!r}, but {runs}")
        else:
            known = ENGINE_KNOBS + sorted(owners)
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; valid knobs: {', '.join(known)}"
            raise ValueError(f"unknown knob {key!r}{hint}")
    configs = {cls.method_name: cls.config_cls(**method_kw[cls.method_name]) for cls in hosted}
    method_config = configs.get(method_cls.method_name) or method_cls.config_cls()
    cfg = EngineConfig(model=model, vllm_sparse_method=AUTO if auto else method_cls.method_name,
                       method_config=method_config, method=get_class(MIXED) if mixed else method_cls,
                       hosted={cls.method_name: (cls, configs[cls.method_name]) for cls in hosted}, **engine_kw)
    for cls in mixed:   # before the engine's checks: a method may dictate an engine knob (QuEST's page size)
        configs[cls.method_name].validate(cfg)
    cfg.validate()
    for cls in [method_cls] + mixed:   # an engine hosting several methods can do what each of them can
        if cfg.kv_cache_dtype != "auto" and not cls.capabilities.fp8_kv_cache:
            raise ValueError(f"kv_cache_dtype={cfg.kv_cache_dtype!r} is not supported by vllm_sparse_method="
                             f"{cls.method_name!r} yet; valid: auto")
        if cfg.tensor_parallel_size > 1 and not cls.capabilities.tensor_parallel:
            raise ValueError(f"vllm_sparse_method={cls.method_name!r} does not support "
                             f"tensor_parallel_size={cfg.tensor_parallel_size} yet; use tensor_parallel_size=1")
    quest = cfg.hosted.get("quest")
    if mixed and "omnikv" in cfg.hosted and quest is not None and quest[1].quest_selection == "query_head":
        # A mixed layer's one decode view is per KV head at most where an OmniKV filter layer's
        # attention reports its token scores (one writer per KV head and token).
        raise ValueError("quest_selection='query_head' cannot be mixed with omnikv (mixed_methods): a mixed "
                         "decode view that reports OmniKV's token scores is per KV head at most; valid here: "
                         "kv_head | shared")
    return cfg


def mixable() -> list[str]:
    """The sparse methods one engine may host together (over one paged pool): those taking per-request sparsity."""
    return [n for n, c in methods().items() if c.request_knobs is not None and n != "vanilla"]


def mixed_classes(names, method_cls) -> "list[type[CacheManager]]":
    """mixed_methods' classes, the engine's own method and vanilla left out (always hosted)."""
    if names is None:
        return []
    valid = f"None or a list of {' | '.join(mixable())} (vanilla and vllm_sparse_method's are always hosted)"
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"mixed_methods={names!r} is invalid; valid: {valid}")
    out = []
    for name in names:
        if name in ("vanilla", method_cls.method_name):
            continue
        if name not in mixable():
            why = "it owns its KV pool's layout, which other methods cannot share" if name in REGISTRY else \
                "it is no registered method"
            raise ValueError(f"mixed_methods={names!r} is invalid: {name!r} cannot be mixed ({why}); valid: {valid}")
        cls = get_method(name)
        if cls not in out:
            out.append(cls)
    if out and method_cls.request_knobs is None:
        raise ValueError(f"vllm_sparse_method={method_cls.method_name!r} cannot host mixed_methods={names!r}: it owns "
                         "its KV pool's layout, which other methods cannot share")
    return out


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
    engine's default) resolved against the methods the engine hosts (its own, mixed_methods',
    vanilla). Raises ValueError naming the field (`name`.method, or the knob, with the message
    make_config gives at launch); the engine fails that request alone. prompt_len decides "auto"
    (dense below auto_dense_below tokens)."""
    cls, engine_method = config.method, config.vllm_sparse_method
    if sparse is not None and not isinstance(sparse, SparseParams):
        raise TypeError(f"{name} must be SparseParams, got {type(sparse).__name__}")
    method = engine_method if sparse is None or sparse.method is None else sparse.method
    knobs = {} if sparse is None else dict(sparse.knobs)
    if (method != engine_method or knobs) and cls.request_knobs is None:
        raise ValueError(f"{name}: vllm_sparse_method={engine_method!r} takes no per-request sparsity: it owns its "
                         "KV pool's layout, which dense rows and other budgets cannot share yet; send the request "
                         "without one (the engine-wide knobs apply)")
    default = config.auto_method if engine_method == AUTO else engine_method   # the engine's own sparse method
    choices = list(dict.fromkeys(["vanilla", *config.hosted] + ([AUTO] if engine_method == AUTO else [])))
    if method not in choices:
        if method in mixable():
            why = f"this engine does not host it: launch with mixed_methods=[{method!r}] to mix it"
        elif method in REGISTRY:
            why = "it owns its KV pool's layout, which other methods cannot share"
        else:
            why = "it is no registered method"
        raise ValueError(f"{name}.method={method!r} is invalid here: this engine runs vllm_sparse_method="
                         f"{engine_method!r}" + (f" (auto_method={default!r})" if engine_method == AUTO else "")
                         + f"; a request may choose {' | '.join(choices)} ({why})")
    if method == "vanilla" and knobs:
        raise ValueError(f"{name}: method 'vanilla' takes no knobs, got {', '.join(sorted(knobs))}")
    target = default if method == AUTO else method
    if target == "vanilla":
        return RequestSparsity("vanilla", None, {}, None)
    target_cls, method_config = config.hosted[target]
    allowed = target_cls.request_knobs or ()
    owners = method_knob_owners()
    for key in knobs:
        if key in allowed:
            continue
        if key in target_cls.config_cls.knob_names():
            per = (f"per-request knobs of {target}: {', '.join(allowed)}" if allowed
                   else f"{target} has no per-request knobs")
            raise ValueError(f"{name}: knob {key!r} cannot be set per request ({per}); set it at launch")
        if key in owners:
            raise ValueError(f"{name}: knob {key!r} belongs to method {owners[key]!r}, but this request runs {target!r}")
        if key in ENGINE_KNOBS:
            raise ValueError(f"{name}: {key!r} is an engine knob, set at launch, not per request")
        close = difflib.get_close_matches(key, list(allowed), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else f"; per-request knobs of {target}: {', '.join(allowed)}"
        raise ValueError(f"{name}: unknown knob {key!r}{hint}")
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
        if dense:
            return RequestSparsity("vanilla", None, {}, policy)
    return RequestSparsity(target, method_config, {k: getattr(method_config, k) for k in allowed}, policy)


def sparsity_to_send(setting: RequestSparsity | None) -> tuple | None:
    """A request's resolved choice as rank 0 sends it to the tensor-parallel followers with the
    request: its method and knobs (small, picklable), "auto"'s decision already taken. The follower
    rebuilds it with `sparsity_received`, the same resolution, so every rank decodes the row alike."""
    if setting is None:
        return None
    return setting.method, dict(setting.knobs), setting.policy, setting.compacted


def sparsity_received(config: EngineConfig, sent: tuple | None, prompt_len: int) -> RequestSparsity | None:
    """A follower's RequestSparsity for what rank 0 sent (`sparsity_to_send`); rank 0 validated it."""
    if sent is None:
        return None
    method, knobs, policy, compacted = sent
    setting = request_sparsity(config, SparseParams(method, **knobs), prompt_len)
    return dataclasses.replace(setting, policy=policy, compacted=compacted)

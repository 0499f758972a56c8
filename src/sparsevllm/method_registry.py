"""Method name -> cache-manager class. The class carries its config dataclass, prefill policy and
capabilities; the registry is what LLM(), the benchmark and the regression harness enumerate."""
from sparsevllm.engine.cache_manager.base import CacheManager

_METHODS: dict[str, type[CacheManager]] = {}


def register_method(name: str):
    def wrap(cls: type[CacheManager]) -> type[CacheManager]:
        if name in _METHODS:
            raise ValueError(f"sparse method {name!r} is registered twice")
        cls.method_name = name
        _METHODS[name] = cls
        return cls
    return wrap


def _load_builtin_methods() -> None:
    # Importing the modules runs their @register_method decorators.
    from sparsevllm.engine.cache_manager import vanilla  # noqa: F401
    from sparsevllm.engine.cache_manager import snapkv  # noqa: F401
    from sparsevllm.engine.cache_manager import quest  # noqa: F401


def available_methods() -> list[str]:
    _load_builtin_methods()
    return sorted(_METHODS)


def get_method(name: str) -> type[CacheManager]:
    _load_builtin_methods()
    if not isinstance(name, str) or name not in _METHODS:
        raise ValueError(f"unknown vllm_sparse_method {name!r}; registered methods: {', '.join(sorted(_METHODS))}")
    return _METHODS[name]


def method_knob_owners() -> dict[str, str]:
    """Every method knob -> the method that owns it (knobs are flat LLM(...) keyword arguments)."""
    _load_builtin_methods()
    owners = {}
    for name, cls in _METHODS.items():
        for knob in cls.config_cls.knob_names():
            owners[knob] = name
    return owners

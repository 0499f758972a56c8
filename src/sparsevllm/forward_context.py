"""The one module-global of the forward pass: the current step and the cache manager serving it.

Attention layers sit deep inside model code that must not know about steps or methods, so they
read the step here instead of receiving it as an argument. The SparseController sets and clears it.
"""
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sparsevllm.engine.cache_manager.base import CacheManager
from sparsevllm.engine.step import StepState

if TYPE_CHECKING:  # the controller imports this module
    from sparsevllm.engine.sparse_controller import SparseController


@dataclass
class ForwardContext:
    step: StepState
    cache_manager: CacheManager
    controller: "SparseController"


_context: ForwardContext | None = None


def set_forward_context(ctx: ForwardContext | None) -> None:
    global _context
    _context = ctx


def get_forward_context() -> ForwardContext:
    assert _context is not None, "attention ran outside an engine step"
    return _context

"""The forward's per-step, per-layer transient state, and cross-layer hand-off.

begin(step): publish the step to the attention layers; layers may hand tensors to later layers of
the same step through put/get (OmniKV's filter layer -> the sparse layers after it); end(): clear
that transient state. Persistent per-request metadata never lives here: it belongs to the cache
manager, whose after-forward hook (`on_step_end`) the engine calls once per step.
"""
from sparsevllm.engine.cache_manager.base import CacheManager
from sparsevllm.engine.step import StepState
from sparsevllm.forward_context import ForwardContext, set_forward_context


class SparseController:
    def __init__(self, cache_manager: CacheManager):
        self.cache_manager = cache_manager
        self._shared: dict[str, object] = {}

    def begin(self, step: StepState) -> None:
        self._shared.clear()
        set_forward_context(ForwardContext(step, self.cache_manager, self))

    def put(self, key: str, value) -> None:
        """Hand a value (tensors, e.g. a selection) to later layers of this step."""
        self._shared[key] = value

    def get(self, key: str):
        return self._shared.get(key)

    def end(self) -> None:
        set_forward_context(None)
        self._shared.clear()

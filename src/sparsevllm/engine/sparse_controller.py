"""The per-step lifecycle around the model forward, and cross-layer hand-off.

begin(step): publish the step to the attention layers; layers may hand tensors to later layers of
the same step through put/get (OmniKV's filter layer -> the sparse layers after it); end(step):
clear that transient state and let the method evict/compact/compress (`on_step_end`). Persistent
per-request metadata never lives here: it belongs to the cache manager.
"""
import torch

from sparsevllm.forward_context import ForwardContext, set_forward_context


class SparseController:
    def __init__(self, cache_manager):
        self.cache_manager = cache_manager
        self._shared: dict[str, torch.Tensor] = {}

    def begin(self, step) -> None:
        self._shared.clear()
        set_forward_context(ForwardContext(step, self.cache_manager, self))

    def put(self, key: str, value: torch.Tensor) -> None:
        self._shared[key] = value

    def get(self, key: str) -> torch.Tensor | None:
        return self._shared.get(key)

    def end(self, step, run_step_end: bool = True) -> None:
        """run_step_end is False only for CUDA-graph warm-up and capture, whose steps are padding."""
        set_forward_context(None)
        self._shared.clear()
        if run_step_end:
            self.cache_manager.on_step_end(step)

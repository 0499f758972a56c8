"""How sparse one request decodes: SparseParams(method=None, **knobs), beside SamplingParams.

A request without one decodes with the engine's method and knobs. With one it may choose
"vanilla" (it attends densely, in the same batch as the sparse requests), the engine's own method
or one the engine hosts beside it (LLM(..., mixed_methods=[...])) with its own budget (the method's
per-request knobs, `CacheManager.request_knobs`), or, in an
engine launched with vllm_sparse_method="auto", "auto" (the engine's policy: dense while the
prompt is short). Types are checked here; the knobs are checked against the engine when the
request arrives (`method_registry.request_sparsity`), with the same messages as at launch, and a
request with a bad one fails alone. Torch-free: `import sparsevllm` loads this module.
"""
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sparsevllm.config import MethodConfig


class SparseParamsError(ValueError):
    """A SparseParams field with a bad type; `field` names it (the server's error names `sparse`)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


class SparseParams:
    """method: None (the engine's default for this request), "vanilla", the engine's method, a method
    in its mixed_methods, or "auto" (in an "auto" engine). knobs: the method's per-request knobs, e.g. quest_token_budget."""

    def __init__(self, method: str | None = None, **knobs):
        if method is not None and not isinstance(method, str):
            raise SparseParamsError("method", f"SparseParams.method must be None or a method name (a string), "
                                              f"got {method!r}")
        self.method = method
        self.knobs = dict(knobs)

    def __repr__(self) -> str:
        args = ([f"method={self.method!r}"] if self.method is not None else []) + \
            [f"{k}={v!r}" for k, v in self.knobs.items()]
        return f"SparseParams({', '.join(args)})"

    def __eq__(self, other) -> bool:
        return isinstance(other, SparseParams) and (self.method, self.knobs) == (other.method, other.knobs)


@dataclass(frozen=True)
class RequestSparsity:
    """What a request decodes with, resolved when it arrives and kept on its Sequence (`seq.sparse`).
    method: "vanilla" (a dense row) or the hosted method whose cache manager runs it; config: that
    method's knobs for this request (the engine's, with the request's per-request knobs over
    them), None for a dense row; knobs: the per-request knobs in force (reported in metrics);
    policy: why "auto" chose this, else None; compacted: set when "auto" compacted the request's KV
    under memory pressure (engine/cache_manager/pressure.py), which makes it a dense row over what
    it kept: {"tokens_before", "tokens_after", "at_output_token"}."""
    method: str
    config: "MethodConfig | None"
    knobs: dict = field(default_factory=dict)
    policy: str | None = None
    compacted: dict | None = None

    @property
    def dense(self) -> bool:
        return self.config is None

    def report(self) -> dict:
        """RequestOutput.metrics["sparse"]."""
        out = {"method": self.method, "knobs": dict(self.knobs)}
        if self.policy is not None:
            out["policy"] = self.policy
        if self.compacted is not None:
            out["compacted"] = dict(self.compacted)
        return out

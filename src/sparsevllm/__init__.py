"""Sparse-vLLM: a sparse-first LLM inference engine for long-context serving."""
import os as _os

# Tokenizers' thread pool deadlocks with forked benchmark/harness workers; the engine needs no
# tokenizer parallelism.
_os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from sparsevllm.method_registry import available_methods  # noqa: E402
from sparsevllm.sampling_params import SamplingParams  # noqa: E402
from sparsevllm.sparse_params import SparseParams  # noqa: E402

__all__ = ["LLM", "SamplingParams", "SparseParams", "available_methods"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM brings torch and the engine: imported on first use, so `python -m sparsevllm --help` and
    # the other entry points' help answer without them.
    if name == "LLM":
        from sparsevllm.llm import LLM
        return LLM
    raise AttributeError(f"module 'sparsevllm' has no attribute {name!r}")

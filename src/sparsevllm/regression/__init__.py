"""Regression task harness: accuracy of every sparse method against vanilla on long-context
tasks, through the public `LLM` API. Run it with `python -m sparsevllm.regression`."""

from sparsevllm.regression.runner import DEFAULT_TASKS, RunConfig, Runner
from sparsevllm.regression.tasks import SYNTHETIC_TASKS
from sparsevllm.regression.variants import expand_variants

__all__ = ["DEFAULT_TASKS", "RunConfig", "Runner", "SYNTHETIC_TASKS", "expand_variants"]

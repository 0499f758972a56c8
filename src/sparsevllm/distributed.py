"""Tensor-parallel helpers shared by the engine and the cache managers (issue #17 groundwork).

A selection shared across heads (OmniKV's token set, QuEST `shared` pages) must be the same on every
rank although each rank scores only its own KV heads: ranks combine their scores with one all-reduce
(max, matching the max over heads a single GPU takes) before top-k, so every rank attends the same
tokens and frees the same pages.
"""
import torch
import torch.distributed as dist


def tp_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def combine_shared_scores(scores: torch.Tensor) -> torch.Tensor:
    """In place max over ranks of per-rank scores (already max-reduced over the rank's heads)."""
    if tp_size() > 1:
        dist.all_reduce(scores, op=dist.ReduceOp.MAX)
    return scores


def check_kv_heads(num_kv_heads: int, num_heads: int, tensor_parallel_size: int) -> None:
    """Raise before any weights load: each rank owns whole KV heads (and their query groups)."""
    if num_kv_heads % tensor_parallel_size or num_heads % tensor_parallel_size:
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} must divide the model's KV heads "
                         f"({num_kv_heads}) and attention heads ({num_heads}); each rank owns whole KV heads")

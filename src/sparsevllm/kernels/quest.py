"""Quest's own kernel: a decode step's store and page scores in one launch.

store_and_score: a decode step's rope_store (RoPE, the cache write, the page bounds) done by the
page-scoring kernel's programs (kernels/page_bounds.py: the first block's program of each request
and KV head writes; every program rotates the query heads it scores with), one launch a layer less.
Nothing in the launch reads what it writes: a decode token lands in its request's current page,
never a candidate. The page bounds and their scores are kernels/page_bounds.py's, the selection
kernels/page_select.py's, shared with HiSparse.
"""
import torch

from sparsevllm.kernels.common import use_triton
from sparsevllm.kernels.page_bounds import bound_scores_ref, launch_bound_scores
from sparsevllm.kernels.rope_store import rope_store_ref


def store_and_score_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                        cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        slot_mapping: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor,
                        block_tables: torch.Tensor, cache_lens: torch.Tensor, page_size: int, selection: str,
                        q_out: torch.Tensor, k_out: torch.Tensor, row_budgets: torch.Tensor | None = None) -> torch.Tensor:
    """A decode step's rope_store (with the page bounds) and then bound_scores, as one call: q, k, v
    [B, H, D] before RoPE, one token per request; q_out / k_out receive q and k after RoPE (the
    attention's query); returns the scores. The order does not matter to the scores: the page a
    decode token lands in is its request's current page, which is never a candidate."""
    q_rot, k_rot = rope_store_ref(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
                                  kmin, kmax, page_size)
    q_out.copy_(q_rot)
    k_out.copy_(k_rot)
    return bound_scores_ref(q_out, kmin, kmax, block_tables, cache_lens, page_size, selection, row_budgets)


def store_and_score_triton(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, kmin, kmax,
                           block_tables, cache_lens, page_size, selection, q_out, k_out, row_budgets=None):
    """Same contract as store_and_score_ref, in the scoring kernel's one launch."""
    assert kmin.dtype == k_cache.dtype and q_out.shape == q.shape and q_out.stride(-1) == 1
    return launch_bound_scores(q_out, kmin, kmax, block_tables, cache_lens, page_size, selection,
                               (q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, k_out), row_budgets)


def store_and_score(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, kmin, kmax,
                    block_tables, cache_lens, page_size, selection, q_out, k_out, row_budgets=None):
    fn = store_and_score_triton if use_triton(q) else store_and_score_ref
    return fn(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, kmin, kmax,
              block_tables, cache_lens, page_size, selection, q_out, k_out, row_budgets)


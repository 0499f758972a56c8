"""Memory pressure under vllm_sparse_method="auto": free pages by compacting a running request's KV
(SnapKV-style eviction) instead of preempting it and recomputing it (docs/design.md, section 11).

When a decode step finds no page for a running request, the scheduler asks `compact_victim` for the
running request whose compaction frees the most pages, and `compact` keeps C = auto_compact_capacity
of its stored tokens per layer and KV head: the last w = PRESSURE_WINDOW tokens, and the top C - w
of the others by SnapKV's window scores (summed softmax of the window's queries over the tokens
before them, causal, max-pooled with kernel 7: kernels/snapkv.py). The kept K/V move to fresh pages
(slot i of head h holds head h's i-th kept token, as SnapKV's prompt compaction does), the old
pages go back to the allocator, seq.cache_len becomes C; the logical length (RoPE positions) is
unchanged. The request then decodes densely over what it kept (a dense row: its C tokens are what
a sparse method would have narrowed a long context to, and no method's per-page metadata describes
the moved tokens) and metrics["sparse"]["compacted"] says when and how much.

Deviation from SnapKV: the window's queries of decoded tokens are not stored, so the scores use the
window's keys (after RoPE) as stand-in queries, one per KV head (no per-query-head average). It
costs no memory and no extra pass; the keys of a token are a proxy for what it attends to, not its
query. A token after the window's position is never read (causal scores).

Compacted pages are never named for the prefix cache (PageTables.replace), and the cache length
no longer equals the logical length, so commit never names the request's later pages either.
"""
import dataclasses
import logging

import torch

from sparsevllm.config import PRESSURE_WINDOW
from sparsevllm.engine.sequence import Sequence
from sparsevllm.engine.staging import to_device
from sparsevllm.kernels.snapkv import select_kept, window_scores

logger = logging.getLogger(__name__)

KERNEL_SIZE = 7   # SnapKV's default pooling (max, kernel 7)


def pages_freed(cm, seq: Sequence, capacity: int) -> int:
    """Pages compacting seq to capacity tokens returns to the allocator (0: not a candidate). Only a
    decoding request whose cache is still raw (never compacted) and longer than capacity; pages it
    shares (prefix hits held by others) stay taken."""
    if seq.in_prefill or seq.cache_len != seq.num_computed_tokens or seq.cache_len <= capacity:
        return 0
    own = sum(1 for page in cm.tables[seq.seq_id] if cm.allocator.refcount[page] == 1)
    return max(0, own - cm.pages_for(capacity))


def compact_victim(cm, running: list[Sequence], capacity: int) -> Sequence | None:
    """The running request whose compaction frees the most pages (the latest admitted on a tie, as
    preemption picks it), or None."""
    best, freed = None, 0
    for seq in running:
        n = pages_freed(cm, seq, capacity)
        if n and n >= freed:
            best, freed = seq, n
    return best


def compact(cm, seq: Sequence, capacity: int) -> None:
    """Keep capacity of seq's cache_len stored tokens per layer and KV head (module docstring)."""
    n, C, P, w = seq.cache_len, capacity, cm.page_size, PRESSURE_WINDOW
    dev = cm.device
    old = cm.tables[seq.seq_id]
    table = to_device(old, dev, torch.int32)
    pos = torch.arange(n - w, n, device=dev)
    window_slots = table[pos // P].long() * P + pos % P
    kept = []
    for layer in range(cm.num_layers):
        k_cache = cm.pool.layer(layer)[0]
        k_scale = cm.pool.scales(layer)[0]
        q = k_cache[window_slots]   # [w, H_kv, D]: the window's keys as its queries (a deviation)
        if k_scale is not None:     # an FP8 cache: the keys attention reads
            q = (q.float() * k_scale[window_slots].unsqueeze(-1)).to(cm.dtype)
        scores = window_scores(q.to(cm.dtype), k_cache, table, n, P, cm.head_dim ** -0.5, k_scale)
        kept.append(select_kept(scores, w, C, KERNEL_SIZE, "max"))
    kept = torch.stack(kept)                                           # [layers, H_kv, C] cache positions
    src = (table.long()[kept // P] * P + kept % P).transpose(1, 2)     # [layers, C, H_kv] old slots
    heads = torch.arange(cm.num_kv_heads, device=dev)
    layers = torch.arange(cm.num_layers, device=dev)[:, None, None]
    stored = [x for x in (cm.pool.k, cm.pool.v, cm.pool.k_scale, cm.pool.v_scale) if x is not None]
    # Gather every layer first: the fresh pages may be the ones just released.
    kept_tokens = [x[layers, src, heads] for x in stored]
    for page in reversed(old):
        cm.allocator.release(page)
    new = [cm.allocator.allocate() for _ in range(cm.pages_for(C))]
    slot = torch.arange(C, device=dev)
    dst = (to_device(new, dev)[slot // P] * P + slot % P)[None, :, None]
    for x, kept_x in zip(stored, kept_tokens):
        x[layers, dst, heads] = kept_x
    cm.tables.replace(seq, new)
    seq.cache_len = C
    # From now on a dense row over its kept tokens; its own RequestSparsity (samples share theirs).
    seq.sparse = dataclasses.replace(seq.sparse, method="vanilla", config=None, knobs={},
                                     compacted={"tokens_before": n, "tokens_after": C,
                                                "at_output_token": seq.num_generated})
    logger.info("request %d: compacted from %d to %d tokens (memory pressure)", seq.seq_id, n, C)

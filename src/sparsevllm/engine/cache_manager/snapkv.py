"""snapkv: keep the prompt tokens the last prompt queries attend to, evict the rest, once.

Paper: SnapKV, "LLM Knows What You are Looking for Before Generation" (arXiv 2404.14469); official
code FasterDecoding/SnapKV. When the last prefill chunk of a prompt of L > C tokens has run, in
every layer:
    score[h, j] = mean over the query heads of KV group h of
                  sum over window queries i of softmax_j(q_i . k_j / sqrt(d))   (fp32, causal)
for the w window queries (prompt positions L - w .. L - 1) and all L prompt keys (after RoPE);
the prefix scores (j < L - w) are 1-D pooled (odd kernel k, stride 1, same padding; max or avg),
the top C - w prefix tokens per KV head are kept together with the whole window, and everything
else is evicted: the kept K/V move into ceil(C / P) fresh pages (slot i of head h holds head h's
i-th kept token, so one block table serves every head and decode is the dense default), the prompt
pages are released. Decode appends after the C kept tokens; RoPE positions stay logical
(seq.num_computed_tokens = L + t), only seq.cache_len shrinks. No further eviction during decode
(official). Prompts of L <= C are untouched: outputs equal vanilla's.

Defaults (official LongBench configs, as METHODS.md fixes them): C = 2048, w = 32, k = 7, max pooling
(the official monkeypatch's own fallbacks are k = 5 and avg pooling; both poolings are a knob).

Deviations from the official code:
- GQA: the official code selects per query head after repeat_kv, which stores H_q / H_kv copies
  of the kept KV. We select per KV head with the window scores averaged over the group's query
  heads (as kvpress does), so the cache keeps its GQA size.
- The summed window probabilities stay fp32 through pooling and top-k (the official code casts
  the softmax back to the model dtype first); equal pooled scores at the cut (max-pooling plateaus)
  go to the earlier position, where torch.topk's choice differs between CPU and GPU.
- The scores use the model's 1/sqrt(head_dim) attention scale (observe_prefill_queries does not
  receive the layer's scale; every supported architecture uses that scale).

Engine interplay:
- Chunked prefill: the prompt stays raw until its last chunk; `chunk_size` keeps the whole window
  in that chunk and makes it end exactly at the prompt's end. If a step has too little token budget
  left for the window, the request gets 0 tokens in that step (today's scheduler then preempts a
  running request, which is recomputed with unchanged output; rare: it needs a step budget already
  spent down to less than w by earlier requests).
- Prefix caching: raw prompt pages are named and shared as usual, but prefix hits of a long prompt
  stop before its window (the window's queries must be recomputed). The prompt's full raw pages are
  named before they are released, so a later identical prompt still hits them. Compacted pages are
  never named (commit names only raw caches) and compaction never writes into a shared page: a
  request's kept tokens go to pages of its own even where its prompt pages are shared hits, so
  admission also asks for those (`can_admit`), and the chunk that ends a prompt keeps the pages its
  compaction needs free from the rest of its step (`reserve`): a compaction always finds them.
- Preemption: a preempted request is recomputed from prompt + generated tokens. The chunk that ends
  at the prompt's end compacts exactly as the first time; the generated tokens are then prefilled
  over the compacted cache, which is the attention they had in decode, so outputs stay the same up
  to floating-point order (not guaranteed bit-exact: prefill and decode kernels sum differently).
"""
import logging
from dataclasses import dataclass, field

import torch

from sparsevllm.config import EngineConfig, MethodConfig, is_int
from sparsevllm.engine.cache_manager.base import CacheManager, Capabilities
from sparsevllm.engine.sequence import Sequence
from sparsevllm.engine.staging import to_device
from sparsevllm.engine.step import StepState
from sparsevllm.kernels.decode_attention import decode_attention
from sparsevllm.kernels.snapkv import select_kept, window_scores
from sparsevllm.models.config import ModelConfig

logger = logging.getLogger(__name__)

POOLINGS = ("max", "avg")


@dataclass
class SnapKVConfig(MethodConfig):
    snapkv_capacity: int = 2048      # C: tokens kept per KV head, window included
    snapkv_window_size: int = 32     # w: observation window (last prompt queries), always kept
    snapkv_kernel_size: int = 7      # k: pooling kernel over positions (odd)
    snapkv_pooling: str = "max"      # max | avg

    def validate(self, engine: EngineConfig) -> None:
        need = self.need
        need(is_int(self.snapkv_window_size) and self.snapkv_window_size >= 1, "snapkv_window_size",
             "an integer >= 1")
        need(is_int(self.snapkv_capacity) and self.snapkv_capacity > self.snapkv_window_size, "snapkv_capacity",
             f"an integer > snapkv_window_size ({self.snapkv_window_size})")
        need(is_int(self.snapkv_kernel_size) and self.snapkv_kernel_size >= 1 and self.snapkv_kernel_size % 2 == 1,
             "snapkv_kernel_size", "an odd integer >= 1")
        need(self.snapkv_pooling in POOLINGS, "snapkv_pooling", " | ".join(POOLINGS))
        # The window must fit one prefill chunk, or a long prompt could never finish its prefill.
        for knob in ("chunk_prefill_size", "max_num_batched_tokens"):
            value = getattr(engine, knob)
            if is_int(value) and value < self.snapkv_window_size:
                raise ValueError(f"{knob}={value} is smaller than snapkv_window_size={self.snapkv_window_size}; "
                                 "the observation window must fit in one prefill chunk")


@dataclass
class _Compaction:
    """A request whose prompt ends in this prefill step: its window rows and per-layer kept positions."""
    seq: Sequence
    index: int           # the request's row in the step's block tables
    row_end: int         # one past its last query row in the step's q
    window: int
    kept: list[torch.Tensor] = field(default_factory=list)   # per layer [H_kv, C] int64
    recall: list[torch.Tensor] = field(default_factory=list)  # per layer (recall, error), when measured


class SnapKVCacheManager(CacheManager):
    method_name = "snapkv"
    # Kept tokens are chosen per KV head, locally; which pages are freed and allocated depends only
    # on page counts and refcounts, which every rank replays identically (see tensor_parallel.py).
    capabilities = Capabilities(tensor_parallel=True)
    config_cls = SnapKVConfig
    request_knobs = ("snapkv_capacity",)   # compaction is per request, on the host: its own C
    recall_definition = ("at compaction time (decode attends every token it keeps and is not measured): per layer, "
                         "the observation window's queries' share of their softmax mass over the whole prompt "
                         "(causal, per query head, averaged over heads and window queries) on the tokens kept "
                         "for their KV head, and the relative error of their attention output over the kept "
                         "tokens; prompts within snapkv_capacity are untouched and not measured")

    def __init__(self, *args):
        super().__init__(*args)
        knobs = self.method_config
        self.capacity, self.window = knobs.snapkv_capacity, knobs.snapkv_window_size
        self.kernel_size, self.pooling = knobs.snapkv_kernel_size, knobs.snapkv_pooling
        self.scale = self.head_dim ** -0.5
        self._compacted_now: set[int] = set()   # compacted by this step's on_step_end, not yet committed
        self._evicted: dict[int, int] = {}      # live request -> tokens it evicted
        self._compacting: dict[int, Sequence] = {}   # requests whose chunk this step ends their prompt
        self.num_compactions = 0
        self.evicted_tokens_total = 0

    @classmethod
    def decode_kv_tokens_read(cls, config: EngineConfig, model_config: ModelConfig, prompt_len: int,
                              cache_len: int) -> float:
        """After prefill a request keeps snapkv_capacity prompt tokens; decode tokens append."""
        return min(prompt_len, config.method_config.snapkv_capacity) + (cache_len - prompt_len)

    @classmethod
    def kv_tokens_held(cls, config: EngineConfig, model_config: ModelConfig, prompt_len: int,
                       output_len: int) -> int | None:
        return None   # the peak depends on when eviction runs relative to the other requests' prefill

    def capacity_of(self, seq: Sequence) -> int | None:
        """seq's capacity C: its own snapkv_capacity (SparseParams) or the engine's; None for a
        request that decodes densely (it chose vanilla, or "auto" did): it is never compacted."""
        knobs = self.request_config(seq)
        return None if knobs is None else knobs.snapkv_capacity

    def _evicts(self, seq: Sequence) -> bool:
        capacity = self.capacity_of(seq)
        return capacity is not None and seq.num_prompt_tokens > capacity

    # ---- scheduler-facing ------------------------------------------------------------------------
    def chunk_size(self, seq: Sequence, max_tokens: int) -> int:
        n = min(seq.num_uncomputed_tokens, max_tokens)
        start, end = seq.num_computed_tokens, seq.num_prompt_tokens
        if not self._evicts(seq) or start >= end:
            return n
        n = min(n, end - start)   # the compacting chunk ends exactly at the prompt's end
        window_start = end - self.window
        if start < window_start < start + n < end:
            n = window_start - start   # stop before the window: the next chunk holds all of it
        elif start == window_start and n < self.window:
            n = 0                      # the window does not fit this step's budget: wait
        return n

    def cached_prefix(self, seq: Sequence) -> list[int]:
        pages = super().cached_prefix(seq)
        if self._evicts(seq):
            # Hits may not reach into the window: its queries are needed to score the prompt.
            pages = pages[:(seq.num_prompt_tokens - self.window) // self.page_size]
        return pages

    def can_admit(self, seq: Sequence) -> bool:
        """The base rule (the whole sequence fits beside its prefix-cache hits), and room for what
        the request holds after compaction: its C kept tokens and the tokens after its prompt, all
        in pages of its own, also where its prompt's pages are hits shared with live requests (a
        recompute after preemption with such hits used to be admitted, compact, find no page for
        its generated tokens, be preempted and admitted again, every step, starving every decode)."""
        if not super().can_admit(seq):
            return False
        if not self._evicts(seq):
            return True
        after = self.capacity_of(seq) + self.seq_admit_len(seq) - seq.num_prompt_tokens   # admit_len: + 1 if it decodes
        return self.pages_for(after) <= self.allocator.num_free

    def _shortfall(self, seq: Sequence, new_pages: int = 0) -> int:
        """Free pages seq's compaction needs at the step's end: it moves the C kept tokens into fresh
        pages and releases the prompt's, but a page it shares (a prefix hit held by a live request,
        or one a later request of the step hits) stays taken."""
        own = sum(1 for page in self.tables[seq.seq_id] if self.allocator.refcount[page] == 1) + new_pages
        return max(0, self.pages_for(self.capacity_of(seq)) - own)

    def reserve(self, seq: Sequence, num_new_tokens: int) -> bool:
        """The base rule, and the pages the compactions of this step need stay free: a chunk that
        ends a prompt keeps them from the chunks and admissions scheduled after it (they used to
        take them, and the request then kept its whole prompt: SnapKV silently off, its tokens
        depending on the batch). Shortfalls are counted now, as later prefix hits raise them."""
        start = seq.num_computed_tokens
        compacts = self._evicts(seq) and seq.cache_len == start and start + num_new_tokens == seq.num_prompt_tokens
        new_pages = max(0, self.pages_for(seq.cache_len + num_new_tokens) - len(self.tables[seq.seq_id]))
        kept_free = self.promised_pages(seq)
        if compacts:
            kept_free += self._shortfall(seq, new_pages)
        if new_pages + kept_free > self.allocator.num_free:
            return False
        taken = super().reserve(seq, num_new_tokens)
        assert taken
        if compacts:
            self._compacting[seq.seq_id] = seq
        return True

    def promised_pages(self, seq: Sequence) -> int:
        """The pages the compactions of this step (their chunks reserved, others than seq's) need free."""
        return sum(self._shortfall(s) for s in self._compacting.values() if s is not seq)

    def free(self, seq: Sequence) -> None:
        super().free(seq)
        self._evicted.pop(seq.seq_id, None)
        self._compacted_now.discard(seq.seq_id)
        self._compacting.pop(seq.seq_id, None)

    def commit(self, seq: Sequence, num_new_tokens: int) -> None:
        if seq.seq_id in self._compacted_now:
            # on_step_end already set cache_len = C; the logical length still advances to L.
            self._compacted_now.discard(seq.seq_id)
            seq.num_computed_tokens += num_new_tokens
            return
        super().commit(seq, num_new_tokens)

    def memory_accounting(self) -> dict:
        acc = super().memory_accounting()
        evicted = sum(self._evicted.values())
        acc.update(evicted_tokens=evicted, evicted_bytes=evicted * acc["kv_page_bytes"] // self.page_size,
                   evicted_tokens_total=self.evicted_tokens_total, compactions=self.num_compactions)
        return acc

    # ---- per step --------------------------------------------------------------------------------
    def on_step_begin(self, step: StepState) -> None:
        """The requests whose prompt this prefill step ends: their compaction, filled by every layer's
        observe_prefill_queries and run by on_step_end."""
        if not step.is_prefill:
            return
        compactions, row_end = [], 0
        for i, (seq, n) in enumerate(zip(step.seqs, step.num_tokens)):
            row_end += n
            start = seq.num_computed_tokens
            if self._evicts(seq) and start + n == seq.num_prompt_tokens and seq.cache_len == start:
                window = min(self.window, n)
                if window < self.window:  # chunk_size prevents this; prefix hits are capped too
                    logger.warning("request %d: only %d of the %d window queries in its last prompt chunk",
                                   seq.seq_id, window, self.window)
                compactions.append(_Compaction(seq, i, row_end, window))
        step.scratch["snapkv.compactions"] = compactions

    def observe_prefill_queries(self, layer_id: int, q: torch.Tensor, step: StepState) -> None:
        k_cache, _ = self.pool.layer(layer_id)
        for c in step.scratch["snapkv.compactions"]:
            scores = window_scores(q[c.row_end - c.window:c.row_end], k_cache, step.block_tables[c.index],
                                   c.seq.num_prompt_tokens, self.page_size, self.scale, self.pool.scales(layer_id)[0])
            # Select now rather than at step end: [H_kv, C] indices per layer instead of [H_kv, L] scores.
            c.kept.append(select_kept(scores, c.window, self.capacity_of(c.seq), self.kernel_size, self.pooling))
            if step.recall is not None:
                c.recall.append(self._window_recall(layer_id, q[c.row_end - c.window:c.row_end],
                                                    step.block_tables[c.index], c.seq.num_prompt_tokens, c.kept[-1]))

    def on_step_end(self, step: StepState) -> None:
        for c in step.scratch.get("snapkv.compactions", []):
            if len(c.kept) == self.num_layers:
                self._compact(c.seq, torch.stack(c.kept))
                if c.recall:   # the compaction's measurement reaches the request with the step's tokens
                    step.recall.stats[c.index] = torch.cat([torch.stack(c.recall), torch.ones(self.num_layers, 1,
                                                            device=self.device)], dim=1)
                    step.recall.rows.append(c.index)
            self._compacting.pop(c.seq.seq_id, None)

    def _window_recall(self, layer_id: int, q: torch.Tensor, table: torch.Tensor, length: int,
                       kept: torch.Tensor) -> torch.Tensor:
        """The window queries q [w, H_q, D] (positions length - w ..) attend, causally, once over the
        whole prompt and once over the kept tokens kept [H_kv, C] (ascending, the window last): the
        mean over queries and heads of exp(lse_kept - lse_prompt), their mass share, and of the
        outputs' relative error -> [2] fp32. Decode attention does both passes: a row per query."""
        w, Hq, _ = q.shape
        C, P = kept.shape[1], self.page_size
        (k_cache, v_cache), (k_scale, v_scale) = self.pool.layer(layer_id), self.pool.scales(layer_id)
        below = torch.arange(w, device=q.device, dtype=torch.int32).view(w, 1) + 1 - w   # causal: query i sees i - w + 1 more
        dense_table = table.view(1, 1, -1).expand(w, 1, table.shape[0])
        slots = (table.long()[kept // P] * P + kept % P).to(torch.int32)                # [H_kv, C]
        kept_table = slots.unsqueeze(0).expand(w, -1, -1)
        kept_lens = (C + below).expand(w, kept.shape[0]).contiguous()
        lse, lse_dense = (torch.empty(w, Hq, dtype=torch.float32, device=q.device) for _ in range(2))
        out = decode_attention(q, k_cache, v_cache, kept_table, kept_lens, 1, self.scale, None, k_scale, v_scale,
                               lse_out=lse).float()
        dense = decode_attention(q, k_cache, v_cache, dense_table, (length + below).contiguous(), P, self.scale, None,
                                 k_scale, v_scale, lse_out=lse_dense).float()
        recall = torch.exp(lse - lse_dense).clamp(max=1.0).mean()
        error = ((out - dense).flatten(1).norm(dim=1) / dense.flatten(1).norm(dim=1).clamp(min=1e-30)).mean()
        return torch.stack([recall, error])

    # ---- compaction ------------------------------------------------------------------------------
    def _stored(self, layer: int) -> list[torch.Tensor]:
        """What a token is stored as in one layer: K and V, and their scales in an FP8 pool."""
        return [x for x in (*self.pool.layer(layer), *self.pool.scales(layer)) if x is not None]

    def _compact(self, seq: Sequence, kept: torch.Tensor) -> None:
        """kept: [num_layers, H_kv, C] ascending prompt positions. Move them to fresh pages, release the
        prompt's pages, point the request at the new ones; cache_len = C, the logical length is untouched."""
        L, C, P = seq.num_prompt_tokens, kept.shape[-1], self.page_size
        old = self.tables[seq.seq_id]
        need = self.pages_for(C)
        releasable = sum(1 for p in old if self.allocator.refcount[p] == 1)
        assert self.allocator.num_free + releasable >= need, "reserve keeps the pages of a compaction free"
        self.tables.name_full_pages(seq, L)  # a later equal prompt can reuse them
        dev = self.device
        old_t = to_device(old, dev)
        src = (old_t[kept // P] * P + kept % P).transpose(1, 2)            # [layers, C, H_kv] old slots
        heads = torch.arange(self.num_kv_heads, device=dev)
        pos = torch.arange(C, device=dev)
        if self.allocator.num_free >= need:
            # Fresh pages first: old and new slots are disjoint, so copy layer by layer (small temporaries).
            new = [self.allocator.allocate() for _ in range(need)]
            dst = (to_device(new, dev)[pos // P] * P + pos % P)[:, None]
            for layer in range(self.num_layers):
                for x in self._stored(layer):   # K, V (and their FP8 scales, moved with them)
                    x[dst, heads] = x[src[layer], heads]
            for page in reversed(old):
                self.allocator.release(page)
        else:
            # The pool is full: gather every layer first, since the new pages may be the released ones.
            layers = torch.arange(self.num_layers, device=dev)[:, None, None]
            stored = [x for x in (self.pool.k, self.pool.v, self.pool.k_scale, self.pool.v_scale) if x is not None]
            kept_tokens = [x[layers, src, heads] for x in stored]
            for page in reversed(old):
                self.allocator.release(page)
            new = [self.allocator.allocate() for _ in range(need)]
            dst = (to_device(new, dev)[pos // P] * P + pos % P)[None, :, None]
            for x, kept_x in zip(stored, kept_tokens):
                x[layers, dst, heads] = kept_x
        self.tables.replace(seq, new)
        seq.cache_len = C
        self._compacted_now.add(seq.seq_id)
        self._evicted[seq.seq_id] = L - C
        self.num_compactions += 1
        self.evicted_tokens_total += L - C

"""quest: query-aware page selection at decode time (Tang et al., "Quest: Query-Aware Sparsity for
Efficient Long-Context LLM Inference", ICML 2024, arXiv 2406.10774; code: mit-han-lab/Quest).

What it computes. For every page (P tokens) of every layer and KV head, the channel-wise min and
max of the stored post-RoPE keys, refreshed whenever a prefill chunk or a decode token is written
into the page (the last, partial page in place). At each decode step and layer, page p of a
request scores sum_c max(q_c * max_c, q_c * min_c), an upper bound on q . k for any key in the
page; with a page budget n = max(3, token_budget // P) attention reads the current (last) page and
the n - 1 other pages of highest score, in logical order. A request of <= n pages attends densely,
and so do prefill and the first `quest_skip_layers` layers (the paper keeps layers 0 and 1 dense:
their attention is not sparse enough for the bound to pick well). Nothing is evicted: Quest saves
bandwidth, not memory (the metadata costs 2 / (2 P) = 1/P of the raw KV).

How a sparse decode layer runs: store_kv does RoPE, the cache write and the page-bound update inside
the page-scoring launch (store_and_score) and leaves the scores on the step; build_decode_view then
selects (select_pages): two launches before the attention instead of three.

Where we differ from the official code, and why:
- GQA: the official kernels (written for multi-head models) select a page set per query head.
  `quest_selection` picks the rows: "kv_head" (default, as METHODS.md fixes it) selects one set
  per KV head with the bound summed over the query heads of its group (a DecodeView with
  G = H_kv), so the decode kernel reads each selected page once for the whole group; "query_head"
  is the official per-head selection (G = H_q: each query head reads its own pages, a group reads
  up to group-size times the budget); "shared" sums over all heads and shares one set (G = 1).
  Summing over a group lets heads with large logits outvote a retrieval head: on SmolLM2 (3 query
  heads per KV head) a needle page that one head gives 91% of its attention ranked 23rd by its
  group's summed bound (see regression/README.md for the accuracy each choice gets).
- The page size is the engine's KV page size (one knob, 16 by default as in the paper), so the
  metadata is indexed by physical page: pages shared through the prefix cache share their
  metadata, which is exact because their content is identical. Only prompt pages are shared: a
  generated token's KV comes from the sparse decode, not what a miss would prefill
  (`dense_decode=False`).
- Layers below `quest_skip_layers` keep no metadata at all.
- FP8 KV cache: the page bounds are those of the dequantized keys (the keys attention reads, so
  the bound stays an upper bound of the logits it computes; prefill recomputes a page from the
  pool, where only those exist), kept in the model dtype. The store runs as its own rope_store
  launch: the fused store-and-score launch and the qkv epilogue write no scales.
- Preemption recomputes prompt + generated tokens by (dense) prefill, so the generated tokens'
  K/V in the sparse layers come from dense attention instead of the page selection they were
  decoded with: a preempted request's continuation can differ from an uninterrupted run from the
  preemption on (the tokens before it are kept). The official code has no preemption.
"""
import os
from dataclasses import dataclass

import numpy as np
import torch

from sparsevllm.config import EngineConfig, MethodConfig, is_int
from sparsevllm.distributed import combine_shared_scores
from sparsevllm.engine.cache_manager.base import CacheManager, Capabilities
from sparsevllm.engine.staging import to_device
from sparsevllm.engine.step import DecodeView, StepState, StoreTarget
from sparsevllm.kernels.page_bounds import SELECTIONS, bound_scores, page_bounds
from sparsevllm.kernels.page_select import DENSE_PAGES, select_pages
from sparsevllm.kernels.quest import store_and_score
from sparsevllm.kernels.rope_store import rope_store
from sparsevllm.models.config import ModelConfig

# A scoring layer's decode store (RoPE, the cache write, the page bounds) runs inside the page-scoring
# launch instead of a launch of its own; SPARSEVLLM_QUEST_FUSED_STORE=0 keeps the separate launch (A/B).
FUSED_STORE = os.environ.get("SPARSEVLLM_QUEST_FUSED_STORE", "1") != "0"


@dataclass
class QuestConfig(MethodConfig):
    quest_token_budget: int = 2048          # tokens attended per decode step, current page included
    quest_page_size: int | None = None      # None: the engine's page_size
    quest_skip_layers: int = 2              # the first layers stay dense
    quest_selection: str = "kv_head"        # page-set rows: kv_head | query_head (official) | shared

    def validate(self, engine: EngineConfig) -> None:
        p = self.quest_page_size
        if p is not None:
            self.need(is_int(p) and p >= 1 and p & (p - 1) == 0, "quest_page_size",
                      "None (the engine's page_size) or a power of two >= 1")
            # Quest pages are the engine's KV pages. An engine page_size left at its default follows
            # the method; an explicit different one is a contradiction.
            if engine.page_size == EngineConfig.__dataclass_fields__["page_size"].default:
                engine.page_size = p
            elif engine.page_size != p:
                raise ValueError(f"quest_page_size={p} contradicts page_size={engine.page_size}: Quest pages "
                                 "are the KV pages; set one of them, or both to the same value")
        page = engine.page_size if isinstance(engine.page_size, int) else 1
        self.need(is_int(self.quest_token_budget) and self.quest_token_budget >= page, "quest_token_budget",
                  f"an integer >= page_size ({page})")
        self.need(is_int(self.quest_skip_layers) and self.quest_skip_layers >= 0, "quest_skip_layers",
                  "an integer >= 0")
        self.need(self.quest_selection in SELECTIONS, "quest_selection", " | ".join(SELECTIONS))


class QuestCacheManager(CacheManager):
    method_name = "quest"
    # kv_head / query_head selections are per head, local to a rank; `shared` sums its bounds over
    # every rank's heads (one all-reduce per sparse layer) so all ranks pick the same pages.
    capabilities = Capabilities(tensor_parallel=True, dense_decode=False)
    config_cls = QuestConfig
    request_knobs = ("quest_token_budget",)   # a page budget per request: a decode extra, one per row
    recall_definition = ("exact: per sparse layer, the share of the dense softmax mass (every token the request "
                         "holds, per query head, averaged over heads) on the selected pages; layers below "
                         "quest_skip_layers and requests within the page budget are dense and not measured")

    def __init__(self, *args):
        super().__init__(*args)
        knobs = self.method_config
        self.skip_layers = knobs.quest_skip_layers
        self.budget_pages = max(3, knobs.quest_token_budget // self.page_size)   # the engine's; a request may set its own
        self.selection = knobs.quest_selection
        self.fused_store = FUSED_STORE and self.kv_dtype == self.dtype   # the fused launch writes no FP8 scales
        # Indexed [layer, physical page, KV head, channel]; min/max of stored values are exact in
        # the model dtype. (A head-major layout, for longer contiguous reads when scoring, was
        # measured on the H200 at 128K x 4: no change, 1.44 ms a step either way.)
        shape = (self.num_layers - self.skip_layers, self.num_pages, self.num_kv_heads, self.head_dim)
        self.kmin = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.kmax = torch.zeros(shape, dtype=self.dtype, device=self.device)

    @classmethod
    def validate_model(cls, config: EngineConfig, model_config: ModelConfig) -> None:
        s, num_layers = config.method_config.quest_skip_layers, model_config.num_hidden_layers
        if s > num_layers:
            raise ValueError(f"quest_skip_layers={s} is out of range for a model of {num_layers} layers; "
                             f"valid: an integer in [0, {num_layers}] ({num_layers}: every layer dense)")

    @classmethod
    def bytes_per_page(cls, config: EngineConfig, num_layers, num_kv_heads, head_dim, dtype) -> int:
        sparse_layers = num_layers - config.method_config.quest_skip_layers
        meta = 2 * sparse_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
        return super().bytes_per_page(config, num_layers, num_kv_heads, head_dim, dtype) + meta

    @classmethod
    def decode_kv_tokens_read(cls, config: EngineConfig, model_config: ModelConfig, prompt_len: int,
                              cache_len: int) -> float:
        """The first quest_skip_layers layers read everything; the others read the page bounds (a min
        and a max key per page: cache_len / P token-equivalents of K + V) plus the budget."""
        knobs, num_layers = config.method_config, model_config.num_hidden_layers
        skip = knobs.quest_skip_layers
        budget = max(3, knobs.quest_token_budget // config.page_size) * config.page_size
        sparse = min(budget, cache_len) + cache_len / config.page_size
        return (skip * cache_len + (num_layers - skip) * sparse) / num_layers

    def memory_accounting(self) -> dict:
        acc = super().memory_accounting()
        acc["metadata_bytes"] = self.kmin.nbytes + self.kmax.nbytes
        return acc

    def budget_pages_of(self, seq) -> int:
        """seq's page budget: its own quest_token_budget (SparseParams) or the engine's; DENSE_PAGES
        for a request that decodes densely (it chose vanilla, or "auto" did)."""
        knobs = self.request_config(seq)
        return DENSE_PAGES if knobs is None else max(3, knobs.quest_token_budget // self.page_size)

    def on_step_begin(self, step: StepState) -> None:
        if step.is_prefill:   # per page the step writes into, the slot of the last token it writes there
            slots = [self.last_slots(seq, n)[1] for seq, n in zip(step.seqs, step.num_tokens)]
            step.extras["quest_last_slots"] = to_device(np.concatenate(slots), self.device)
            return
        # Each row's own page budget: requests of different budgets (and dense ones) in one selection.
        budgets = [self.budget_pages_of(seq) for seq in step.seqs]
        step.extras["quest_budget_pages"] = to_device(np.array(budgets, dtype=np.int32), self.device, torch.int32)
        # Every row within its budget (short contexts, dense rows): the selection would keep every page.
        step.scratch["quest.dense"] = all(self.pages_for(seq.cache_len + 1) <= n for seq, n in zip(step.seqs, budgets))

    def graph_variants(self) -> tuple[str, ...]:
        # "dense": the decode graph without the page scoring and selection, for steps whose rows are all
        # within their budgets ("auto"'s short requests, a short batch): the general graph always scores.
        return ("", "dense")

    def graph_variant(self, step: StepState) -> str:
        return "dense" if step.scratch.get("quest.dense") else ""

    def graph_extras(self, max_batch_size: int) -> dict[str, torch.Tensor]:
        # Padding rows (length 1) are within any budget.
        return {"quest_budget_pages": torch.full((max_batch_size,), 3, dtype=torch.int32, device=self.device)}

    def _scores(self, layer_id: int, step: StepState) -> bool:
        """Whether this decode layer scores pages: a sparse layer of a step whose rows are not all within
        their budgets. Eagerly the step's host fact says so (`quest.dense`; also where a mixed engine
        hosts QuEST and runs no variant); a captured step has none: the general graph always scores,
        the "dense" one never."""
        return (not step.is_prefill and layer_id >= self.skip_layers and step.graph_variant != "dense"
                and not step.scratch.get("quest.dense", False))

    def store_kv(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 cos_sin_cache: torch.Tensor, step: StepState) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_id < self.skip_layers or step.is_prefill:
            return super().store_kv(layer_id, q, k, v, cos_sin_cache, step)
        if self.fused_store and self._scores(layer_id, step):
            # One launch rotates q and k, writes the token, folds its key into its page's bounds and
            # scores the request's pages with the rotated q; build_decode_view selects from the scores.
            i = layer_id - self.skip_layers
            k_cache, v_cache = self.pool.layer(layer_id)
            q_out, k_out = torch.empty_like(q), torch.empty_like(k)
            step.scratch[f"quest.{layer_id}"] = store_and_score(
                q, k, v, step.positions, cos_sin_cache, k_cache, v_cache, step.slot_mapping, self.kmin[i],
                self.kmax[i], step.block_tables, step.cache_lens, self.page_size, self.selection, q_out, k_out,
                step.extras["quest_budget_pages"])
            return q_out, k_out
        # Decode writes one token per request into a page no other request writes: the write
        # itself folds the new key into its page's min/max (the page's first slot resets them).
        i = layer_id - self.skip_layers
        k_cache, v_cache = self.pool.layer(layer_id)
        return rope_store(q, k, v, step.positions, cos_sin_cache, k_cache, v_cache, step.slot_mapping, self.kmin[i],
                          self.kmax[i], self.page_size, *self.pool.scales(layer_id))

    def store_target(self, layer_id: int, step: StepState) -> StoreTarget | None:
        """What store_kv writes: dense layers the pool alone; sparse layers also fold the new key into
        its page's bounds, unless the scoring launch stores the token itself (FUSED_STORE: None). None
        for an FP8 cache: the epilogue writes no scales."""
        if step.is_prefill or (self.fused_store and self._scores(layer_id, step)) or self.kv_dtype != self.dtype:
            return None
        k_cache, v_cache = self.pool.layer(layer_id)
        if layer_id < self.skip_layers:
            return StoreTarget(k_cache, v_cache, step.slot_mapping, step.positions)
        i = layer_id - self.skip_layers
        return StoreTarget(k_cache, v_cache, step.slot_mapping, step.positions, page_min=self.kmin[i],
                           page_max=self.kmax[i], page_size=self.page_size)

    def on_kv_stored(self, layer_id: int, k: torch.Tensor, v: torch.Tensor, step: StepState) -> None:
        if layer_id < self.skip_layers or not step.is_prefill:
            return
        # A prefill chunk may write many tokens into one page: recompute each page it touched.
        i = layer_id - self.skip_layers
        page_bounds(self.pool.layer(layer_id)[0], step.extras["quest_last_slots"], self.kmin[i], self.kmax[i],
                    self.page_size, self.pool.scales(layer_id)[0])

    def recall_view(self, layer_id: int, step: StepState) -> DecodeView | None:
        return CacheManager.build_decode_view(self, layer_id, None, step) if self._scores(layer_id, step) else None

    def build_decode_view(self, layer_id: int, q: torch.Tensor, step: StepState) -> DecodeView:
        if not self._scores(layer_id, step):
            return super().build_decode_view(layer_id, q, step)
        i = layer_id - self.skip_layers
        scores = step.scratch.pop(f"quest.{layer_id}", None)   # store_kv's fused launch scored the pages
        if scores is None:
            scores = bound_scores(q, self.kmin[i], self.kmax[i], step.block_tables, step.cache_lens,
                                  self.page_size, self.selection, step.extras["quest_budget_pages"])
        if self.selection == "shared":
            scores = combine_shared_scores(scores, op="sum")   # the sum over every rank's heads (-inf stays -inf)
        table, lengths = select_pages(scores, step.block_tables, step.cache_lens, self.page_size,
                                      step.extras["quest_budget_pages"])
        k_cache, v_cache = self.pool.layer(layer_id)
        k_scale, v_scale = self.pool.scales(layer_id)
        return DecodeView(k_cache, v_cache, table, lengths, self.page_size, k_scale=k_scale, v_scale=v_scale)

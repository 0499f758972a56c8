"""mixed: one engine hosting several sparse methods (LLM(..., mixed_methods=[...])), whose requests
decode in the same batch, one attention launch a layer (issue #51, phase 2; docs/design.md, section 11).

The composite owns the one paged pool, its allocator and the block tables, and builds one manager
per hosted method over them (`CacheManager(..., shared=self)`): each keeps its own metadata (QuEST's
page bounds, sized by the shared pool) and state (SnapKV's compactions). A request's method
(`seq.sparse.method`) picks the manager of its host hooks (chunk_size, cached_prefix, can_admit,
allocate, reserve, free, commit); a vanilla row gets the dense defaults. Pages one manager promised
to work of the step (SnapKV's compactions, `promised_pages`) stay free from every other reserve.

Every manager sees every step (on_step_begin, on_kv_stored, observe_prefill_queries, on_step_end):
each acts on its own rows, a row of another method being a dense row to it (`request_config` is
None there), so per-page metadata is kept for every page whoever wrote it (a prefix hit across
methods finds it). At most one hosted method writes the cache itself (`store_kv`; QuEST folds the
page bounds into the write): that one writes for every row.

A decode layer: each manager builds its view over the batch with the other methods' rows at
length 0 (a copy of the step whose cache_lens are masked, so their kernels skip those rows), and the
views are merged into one DecodeView read by one attention launch. Where every manager's view is
its block table (a dense layer for all of them) the merge is the paged dense view itself, token
scores included (an OmniKV filter layer); elsewhere the common form is token slots (page size 1),
G the widest grouping among the views (H_kv where QuEST selects per KV head): page views are
expanded to their slots, a token view (OmniKV's sparse layers) is one already, a G = 1 row is
repeated over the heads, and each row takes its own method's entries. Static shapes and tensor
ops only, so one captured graph serves any mix (`mixed_rows`, each row's manager, is a decode
extra). The expansion writes B x G x (table width x P) int32 a merged layer, under graphs the
max_model_len width: a decode kernel taking a page size per row would avoid it (not built).
"""
import dataclasses

import numpy as np
import torch

from sparsevllm.config import EngineConfig
from sparsevllm.engine.cache_manager.base import CacheManager, Capabilities
from sparsevllm.engine.sequence import Sequence
from sparsevllm.engine.staging import to_device
from sparsevllm.engine.step import DecodeView, StepState, StoreTarget
from sparsevllm.models.config import ModelConfig

DENSE_ROW = 0   # mixed_rows of a vanilla row (and of CUDA-graph padding); hosted manager i is i + 1


def member_config(config: EngineConfig, name: str) -> EngineConfig:
    """The engine's config as one hosted method sees it: its own class and knobs."""
    cls, method_config = config.hosted[name]
    return dataclasses.replace(config, vllm_sparse_method=name, method=cls, method_config=method_config,
                               mixed_methods=None, hosted={name: config.hosted[name]})


def hosted_classes(config: EngineConfig) -> list[type[CacheManager]]:
    return [cls for cls, _ in config.hosted.values()]


class MixedCacheManager(CacheManager):
    method_name = "mixed"
    request_knobs = ()   # each request's method and knobs are resolved against config.hosted
    # Combined from the hosted methods per engine (an instance attribute set in __init__).
    capabilities = Capabilities(dense_decode=False)
    recall_definition = "each request's own method's (metrics['sparse']['method'] names it); vanilla rows are dense"

    def __init__(self, config: EngineConfig, model_config: ModelConfig, num_kv_heads: int, num_pages: int,
                 dtype: torch.dtype, device: torch.device):
        classes = hosted_classes(config)
        caps = [c.capabilities for c in classes]
        self.capabilities = Capabilities(
            cuda_graph=all(c.cuda_graph for c in caps), prefix_cache=all(c.prefix_cache for c in caps),
            tensor_parallel=all(c.tensor_parallel for c in caps), dense_decode=all(c.dense_decode for c in caps),
            fp8_kv_cache=all(c.fp8_kv_cache for c in caps))
        super().__init__(config, model_config, num_kv_heads, num_pages, dtype, device)
        self.members = [cls(member_config(config, name), model_config, num_kv_heads, num_pages, dtype, device, self)
                        for name, (cls, _) in config.hosted.items()]
        self.index = {m.method_name: i + 1 for i, m in enumerate(self.members)}
        writers = [m for m in self.members if type(m).store_kv is not CacheManager.store_kv]
        if len(writers) > 1:
            raise ValueError(f"mixed_methods: {' and '.join(m.method_name for m in writers)} both write the KV "
                             "cache themselves (store_kv); one engine cannot host both")
        # The one manager that stores K/V for every row: the method that folds metadata into the write.
        self.writer = writers[0] if writers else self.members[0]
        default = config.auto_method if config.vllm_sparse_method == "auto" else config.vllm_sparse_method
        self.default = self.index.get(default, DENSE_ROW)

    # ---- sizing: the shared pool and every hosted method's metadata ------------------------------
    @classmethod
    def bytes_per_page(cls, config: EngineConfig, num_layers, num_kv_heads, head_dim, dtype) -> int:
        raw = CacheManager.bytes_per_page(config, num_layers, num_kv_heads, head_dim, dtype)
        return raw + sum(c.bytes_per_page(member_config(config, c.method_name), num_layers, num_kv_heads, head_dim,
                                          dtype) - raw for c in hosted_classes(config))

    @classmethod
    def fixed_device_bytes(cls, config: EngineConfig, num_layers, num_kv_heads, head_dim, dtype) -> int:
        return sum(c.fixed_device_bytes(member_config(config, c.method_name), num_layers, num_kv_heads, head_dim,
                                        dtype) for c in hosted_classes(config))

    @classmethod
    def validate_model(cls, config: EngineConfig, model_config: ModelConfig) -> None:
        for c in hosted_classes(config):
            c.validate_model(member_config(config, c.method_name), model_config)

    @classmethod
    def _default_class(cls, config: EngineConfig) -> tuple[type[CacheManager], EngineConfig]:
        name = config.auto_method if config.vllm_sparse_method == "auto" else config.vllm_sparse_method
        return (config.hosted[name][0], member_config(config, name)) if name in config.hosted else (CacheManager, config)

    @classmethod
    def decode_kv_tokens_read(cls, config: EngineConfig, model_config: ModelConfig, prompt_len: int,
                              cache_len: int) -> float:
        """A request of the engine's default method (the benchmark's requests carry no SparseParams)."""
        c, cfg = cls._default_class(config)
        return c.decode_kv_tokens_read(cfg, model_config, prompt_len, cache_len)

    @classmethod
    def kv_tokens_held(cls, config: EngineConfig, model_config: ModelConfig, prompt_len: int,
                       output_len: int) -> int | None:
        c, cfg = cls._default_class(config)
        return c.kv_tokens_held(cfg, model_config, prompt_len, output_len)

    def memory_accounting(self) -> dict:
        acc = super().memory_accounting()
        for m in self.members:
            for key, value in m.memory_accounting().items():
                if key == "metadata_bytes":
                    acc[key] += value
                else:
                    acc.setdefault(key, value)
        return acc

    # ---- host hooks: each request's own method ---------------------------------------------------
    def _row(self, seq: Sequence) -> int:
        return self.default if seq.sparse is None else self.index.get(seq.sparse.method, DENSE_ROW)

    def _owner(self, seq: Sequence) -> CacheManager | None:
        """The manager of seq's method; None for a vanilla row (the dense defaults)."""
        row = self._row(seq)
        return self.members[row - 1] if row != DENSE_ROW else None

    def request_error(self, prompt_len: int, max_tokens: int) -> str | None:
        return next((e for m in self.members if (e := m.request_error(prompt_len, max_tokens))), None)

    def chunk_size(self, seq: Sequence, max_tokens: int) -> int:
        m = self._owner(seq)
        return m.chunk_size(seq, max_tokens) if m else super().chunk_size(seq, max_tokens)

    def cached_prefix(self, seq: Sequence) -> list[int]:
        m = self._owner(seq)
        return m.cached_prefix(seq) if m else super().cached_prefix(seq)

    def can_admit(self, seq: Sequence) -> bool:
        m = self._owner(seq)
        return m.can_admit(seq) if m else super().can_admit(seq)

    def allocate(self, seq: Sequence) -> None:
        m = self._owner(seq)
        return m.allocate(seq) if m else super().allocate(seq)

    def reserve(self, seq: Sequence, num_new_tokens: int) -> bool:
        m = self._owner(seq)
        promised = sum(x.promised_pages(seq) for x in self.members if x is not m)
        if promised:   # the other methods' promises (a SnapKV compaction this step) stay free
            new_pages = self.pages_for(seq.cache_len + num_new_tokens) - len(self.tables[seq.seq_id])
            if max(0, new_pages) + promised > self.allocator.num_free:
                return False
        return m.reserve(seq, num_new_tokens) if m else super().reserve(seq, num_new_tokens)

    def promised_pages(self, seq: Sequence) -> int:
        return sum(m.promised_pages(seq) for m in self.members)

    def free(self, seq: Sequence) -> None:
        m = self._owner(seq)
        return m.free(seq) if m else super().free(seq)

    def commit(self, seq: Sequence, num_new_tokens: int) -> None:
        m = self._owner(seq)
        return m.commit(seq, num_new_tokens) if m else super().commit(seq, num_new_tokens)

    # ---- per step: every method sees every step ---------------------------------------------------
    def on_step_begin(self, step: StepState) -> None:
        for m in self.members:
            m.on_step_begin(step)
        if not step.is_prefill:
            rows = np.array([self._row(seq) for seq in step.seqs], dtype=np.int32)
            step.extras["mixed_rows"] = to_device(rows, self.device, torch.int32)

    def graph_extras(self, max_batch_size: int) -> dict[str, torch.Tensor]:
        extras = {}
        for m in self.members:
            extras.update(m.graph_extras(max_batch_size))
        # Padding rows are dense rows (length 1).
        extras["mixed_rows"] = torch.full((max_batch_size,), DENSE_ROW, dtype=torch.int32, device=self.device)
        return extras

    def on_step_end(self, step: StepState) -> None:
        for m in self.members:
            m.on_step_end(step)

    # ---- per layer ---------------------------------------------------------------------------------
    def store_kv(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 cos_sin_cache: torch.Tensor, step: StepState) -> tuple[torch.Tensor, torch.Tensor]:
        return self.writer.store_kv(layer_id, q, k, v, cos_sin_cache, step)

    def store_target(self, layer_id: int, step: StepState) -> StoreTarget | None:
        return self.writer.store_target(layer_id, step)

    def on_kv_stored(self, layer_id: int, k: torch.Tensor, v: torch.Tensor, step: StepState) -> None:
        for m in self.members:
            m.on_kv_stored(layer_id, k, v, step)

    def observe_prefill_queries(self, layer_id: int, q: torch.Tensor, step: StepState) -> None:
        for m in self.members:
            m.observe_prefill_queries(layer_id, q, step)

    def _rows_of(self, step: StepState, row: int) -> StepState:
        """The step as hosted manager `row` sees it in a decode layer: the other methods' rows have
        length 0, so its selection kernels skip them (made once a step, in its scratch)."""
        key = f"mixed.step{row}"
        if key not in step.scratch:
            mine = step.extras["mixed_rows"] == row
            step.scratch[key] = dataclasses.replace(step, cache_lens=torch.where(mine, step.cache_lens, 0))
        return step.scratch[key]

    def build_decode_view(self, layer_id: int, q: torch.Tensor, step: StepState) -> DecodeView:
        views = [(i + 1, m.build_decode_view(layer_id, q, self._rows_of(step, i + 1)))
                 for i, m in enumerate(self.members)]
        return self._merge(layer_id, step, views, dense_rows=True)

    def recall_view(self, layer_id: int, step: StepState) -> DecodeView | None:
        views = [(i + 1, m.recall_view(layer_id, self._rows_of(step, i + 1))) for i, m in enumerate(self.members)]
        views = [(row, view) for row, view in views if view is not None]
        return self._merge(layer_id, step, views, dense_rows=False) if views else None

    def _paged_dense(self, view: DecodeView, step: StepState) -> bool:
        """Whether view reads the step's block table itself (a layer this method attends densely)."""
        return (view.page_size == self.page_size and view.table.shape[1] == 1
                and view.table.data_ptr() == step.block_tables.data_ptr())

    def _merge(self, layer_id: int, step: StepState, views: list[tuple[int, DecodeView]],
               dense_rows: bool) -> DecodeView:
        """One DecodeView from the hosted managers' views (each over its own rows), row by row;
        dense_rows: vanilla rows read their block table (a decode view), else they are not measured
        (a recall view: length 0), and so are rows of managers that gave no view."""
        k_cache, v_cache = self.pool.layer(layer_id)
        k_scale, v_scale = self.pool.scales(layer_id)
        assert all(v.k_cache.data_ptr() == k_cache.data_ptr() for _, v in views), "hosted views read the shared pool"
        scores = [v.token_scores for _, v in views if v.token_scores is not None]
        assert len(scores) <= 1, "one hosted method reports token scores per layer"
        token_scores = scores[0] if scores else None
        rows = step.extras["mixed_rows"]
        B = rows.shape[0]
        lengths = step.cache_lens if dense_rows else torch.zeros_like(step.cache_lens)
        lengths = torch.where(rows == DENSE_ROW, lengths, 0).view(B, 1)
        if all(self._paged_dense(v, step) for _, v in views):   # every row reads its block table
            for row, v in views:
                lengths = torch.where((rows == row).view(B, 1), v.lengths, lengths)
            return DecodeView(k_cache, v_cache, step.block_tables.unsqueeze(1), lengths.contiguous(), self.page_size,
                              token_scores, k_scale, v_scale)
        width = step.block_tables.shape[1] * self.page_size
        G = max(v.table.shape[1] for _, v in views)
        table = self._slots(step.block_tables.unsqueeze(1), self.page_size, width, G)
        lengths = lengths.expand(B, G)
        for row, v in views:
            mine = (rows == row).view(B, 1)
            table = torch.where(mine.view(B, 1, 1), self._slots(v.table, v.page_size, width, G), table)
            lengths = torch.where(mine, self._groups(v.lengths, G), lengths)
        return DecodeView(k_cache, v_cache, table.contiguous(), lengths.contiguous(), 1, token_scores, k_scale, v_scale)

    @staticmethod
    def _groups(x: torch.Tensor, G: int) -> torch.Tensor:
        """[B, g, ...] rows -> [B, G, ...]: a set shared by all heads (g = 1) repeated, a set per KV
        head repeated over its query heads (g = H_kv, G = H_q)."""
        g = x.shape[1]
        if g == G:
            return x
        if g == 1:
            return x.expand(x.shape[0], G, *x.shape[2:])
        return x.repeat_interleave(G // g, dim=1)

    def _slots(self, table: torch.Tensor, page_size: int, width: int, G: int) -> torch.Tensor:
        """A view's table [B, g, N] of pages of page_size -> [B, G, width] int32 token slots in the
        same order (entries past a row's length are never read)."""
        if page_size != 1:
            assert table.shape[2] * page_size >= width
            pos = torch.arange(width, device=table.device, dtype=torch.int32)
            table = table[:, :, pos // page_size] * page_size + pos % page_size
        assert table.shape[2] == width, "a token view is as wide as the block table's slots"
        return self._groups(table.to(torch.int32), G)

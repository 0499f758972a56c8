"""hisparse: every page in host memory, a hot buffer on the GPU (SGLang's HiSparse and its "sparse
with HiCache" retrievable-algorithm interface).

What it computes. A long request (prompt >= `hisparse_min_prompt_len` whose KV outgrows the hot
buffer) keeps all its KV pages in a pinned host pool (`engine/host_pool.py`): the prompt's chunks
are written there as prefill stores them (on a copy stream, beside the forward) and every decode
token is written through to its host slot by the step itself. After prefill the device keeps, per
request, `hisparse_device_pages` pages: one holds the current page (decode writes there), the others
are a per-layer LRU buffer of host pages. Per decode step and layer the Quest bound over per-page
key min/max (kept on the GPU for the whole history, indexed by host page) picks the top
`hisparse_token_budget` tokens' pages, plus the `hisparse_recent_pages` before the current page and
the current page; pages already in the buffer are hits, misses evict the least recently used
unwanted entries and are copied from host memory by a Triton kernel that reads it directly, inside
the CUDA graph. Attention reads the buffer through the DecodeView. Requests whose KV fits the buffer,
and short prompts, stay dense and never touch the host (the fast path).

Granularity: one page set per request and layer, its bound summed over every query head (Quest's
"shared" selection). The buffer is per request and layer, so a wanted page moves all its KV heads
in one contiguous copy; a set per KV head would need a buffer holding the union of H_kv sets (up
to H_kv times the PCIe traffic and buffer) for the same budget.

Invariants: a buffer entry is only ever evicted after its host copy is complete — prompt copies run
on the copy stream, and the compute stream waits for it before the next decode step; decode tokens
reach the host in the same stream before any later eviction. Device, host and row allocators return
to their initial state when a request ends.

Deviations from SGLang: the current page has its own device page rather than an LRU entry (its
slot is known on the host when the step is built); no prefix caching (a request's pages are its own
host pages); during prefill a request holds its whole prompt on the device (chunked prefill attends
densely over it), so the GPU bounds how many prompts prefill at once, not how many requests decode.
Preemption recomputes prompt + generated tokens by (dense) prefill, so an offloaded request's
generated tokens get K/V from dense attention instead of the page selection they were decoded with:
its continuation can differ from an uninterrupted run from the preemption on.
"""
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from sparsevllm.config import EngineConfig, MethodConfig, is_int, is_number
from sparsevllm.engine.cache_manager.base import Capabilities, CacheManager
from sparsevllm.engine.host_pool import GiB, HostPool, check_host_memory
from sparsevllm.engine.kv_pool import kv_storage_dtype
from sparsevllm.engine.sequence import Sequence
from sparsevllm.engine.staging import to_device
from sparsevllm.engine.step import DecodeView, StepState
from sparsevllm.kernels.hisparse import copy_pages, host_store, swap_plan
from sparsevllm.kernels.page_bounds import bound_scores, page_bounds
from sparsevllm.kernels.page_select import select_pages
from sparsevllm.models.config import ModelConfig


@dataclass
class HiSparseConfig(MethodConfig):
    hisparse_token_budget: int = 2048        # top-k tokens per decode step, recent and current pages apart
    hisparse_recent_pages: int = 4           # pages before the current one, always attended
    hisparse_device_pages: int | None = None  # hot pages per request and layer; None: 2 x top-k + recent + 1
    hisparse_min_prompt_len: int = 2048      # shorter prompts stay dense
    hisparse_host_memory_gb: float = 8.0     # pinned host pool

    def validate(self, engine: EngineConfig) -> None:
        need = self.need
        P = engine.page_size if is_int(engine.page_size) and engine.page_size >= 1 else 1
        need(is_int(self.hisparse_token_budget) and self.hisparse_token_budget >= P, "hisparse_token_budget",
             f"an integer >= page_size ({P})")
        need(is_int(self.hisparse_recent_pages) and self.hisparse_recent_pages >= 0, "hisparse_recent_pages",
             "an integer >= 0")
        need(is_int(self.hisparse_min_prompt_len) and self.hisparse_min_prompt_len >= 1, "hisparse_min_prompt_len",
             "an integer >= 1")
        view = self.hisparse_token_budget // P + self.hisparse_recent_pages + 1
        d = self.hisparse_device_pages
        need(d is None or (is_int(d) and d >= view), "hisparse_device_pages",
             f"None or an integer >= top-k pages + recent pages + 1 ({view})")
        gb = self.hisparse_host_memory_gb
        need(is_number(gb) and gb > 0, "hisparse_host_memory_gb",
             "a positive number of GiB")
        check_host_memory("hisparse_host_memory_gb", gb)

    def view_pages(self, page_size: int) -> int:
        return self.hisparse_token_budget // page_size + self.hisparse_recent_pages + 1

    def device_pages(self, page_size: int) -> int:
        d = self.hisparse_device_pages
        return d if d is not None else 2 * (self.hisparse_token_budget // page_size) + self.hisparse_recent_pages + 1


class HiSparseCacheManager(CacheManager):
    method_name = "hisparse"
    config_cls = HiSparseConfig
    recall_definition = ("exact: per layer of an offloaded request, the share of the dense softmax mass over its "
                         "host copy of every token (per query head, averaged over heads; the dense pass reads "
                         "pinned host memory) on the pages its hot buffer attends; requests on the fast path "
                         "(short, or within the hot buffer) are dense and not measured")
    # Not under tensor parallelism yet: its one page set per request and layer would need the page
    # bounds summed across ranks (combine_shared_scores) and a host pool per rank; untested.
    capabilities = Capabilities(cuda_graph=True, prefix_cache=False, tensor_parallel=False)

    def __init__(self, *args):
        super().__init__(*args)
        config, knobs, P = self.config, self.method_config, self.page_size
        num_layers, num_kv_heads, head_dim = self.num_layers, self.num_kv_heads, self.head_dim
        num_pages, dtype, device = self.num_pages, self.dtype, self.device
        self.view_pages = knobs.view_pages(P)
        self.recent_pages = knobs.hisparse_recent_pages
        self.device_pages = knobs.device_pages(P)
        host_pages = self._host_pages(config, num_layers, num_kv_heads, head_dim, dtype)
        if host_pages < 1:
            page_bytes = HostPool.bytes_per_page(num_layers, P, num_kv_heads, head_dim, self.kv_dtype)
            raise ValueError(f"hisparse_host_memory_gb={knobs.hisparse_host_memory_gb} holds no page of "
                             f"{page_bytes} bytes; valid: at least {page_bytes / GiB:.6f}")
        self.host = HostPool(num_layers, host_pages, P, num_kv_heads, head_dim, self.kv_dtype,
                             pin=device.type == "cuda")
        # Page bounds indexed by host page (the device forgets a page, the scorer must not); the
        # last row is a trash page that padding rows write into.
        self.trash = host_pages
        shape = (num_layers, host_pages + 1, num_kv_heads, head_dim)
        self.kmin = torch.zeros(shape, dtype=dtype, device=device)
        self.kmax = torch.zeros(shape, dtype=dtype, device=device)
        # Quest's min/max kernel indexes by device page: it writes here, then rows move to kmin/kmax.
        self.scratch_min = torch.zeros(num_pages, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.scratch_max = torch.zeros_like(self.scratch_min)
        # Per buffer row (one per offloaded request, the last one a dummy for dense requests and
        # padding): its host table, and per layer the LRU entries' host page (-1 empty) and last use.
        R, E = config.max_num_seqs + 1, self.device_pages - 1
        self.dummy_row = R - 1
        # As wide as the longest request, as Quest's graph-width tables: the selection kernel holds a
        # row in registers, so one page more would double its block.
        width = self.pages_for(config.max_model_len)
        self.host_tables = torch.full((R, width), self.trash, dtype=torch.int32, device=device)
        self.offloaded = torch.zeros(R, dtype=torch.bool, device=device)
        self.buf_key = torch.full((num_layers, R, E), -1, dtype=torch.int32, device=device)
        self.buf_last = torch.full((num_layers, R, E), -1, dtype=torch.int32, device=device)
        self.buf_phys = torch.zeros((R, E), dtype=torch.int32, device=device)
        self.free_rows = list(range(R - 1))
        self.row_of: dict[int, int] = {}
        self.host_pages_of: dict[int, np.ndarray] = {}
        self.hot_of: dict[int, list[int]] = {}     # E LRU pages, then the current page
        self.decoding: set[int] = set()            # offloaded requests past their prefill
        self.prefilling: dict[int, Sequence] = {}  # offloaded requests still prefilling
        self.swap_stats = torch.zeros(2, dtype=torch.int64, device=device)   # wanted pages, misses
        # memory_accounting reads a pinned copy refreshed after each step: the benchmark samples it
        # every step, and reading the device counters would synchronise (a step stale is fine).
        self.swap_stats_host = self.swap_stats if device.type != "cuda" else torch.zeros(2, dtype=torch.int64,
                                                                                         pin_memory=True)
        self.clock = 0
        self.decode_steps = 0
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.copies_pending = False

    # ---- sizing and roofline ---------------------------------------------------------------------
    @classmethod
    def bytes_per_page(cls, config: EngineConfig, num_layers, num_kv_heads, head_dim, dtype) -> int:
        scratch = 2 * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
        return super().bytes_per_page(config, num_layers, num_kv_heads, head_dim, dtype) + scratch

    @classmethod
    def _host_pages(cls, config: EngineConfig, num_layers, num_kv_heads, head_dim, dtype) -> int:
        page_bytes = HostPool.bytes_per_page(num_layers, config.page_size, num_kv_heads, head_dim,
                                             kv_storage_dtype(config.kv_cache_dtype, dtype))
        return int(config.method_config.hisparse_host_memory_gb * GiB) // page_bytes

    @classmethod
    def fixed_device_bytes(cls, config: EngineConfig, num_layers, num_kv_heads, head_dim, dtype) -> int:
        """The page bounds of every host page (plus the trash page), min and max."""
        host_pages = cls._host_pages(config, num_layers, num_kv_heads, head_dim, dtype)
        return 2 * num_layers * (host_pages + 1) * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @classmethod
    def _sparse(cls, config: EngineConfig, prompt_len: int, total_len: int) -> bool:
        knobs, P = config.method_config, config.page_size
        return prompt_len >= knobs.hisparse_min_prompt_len and -(-total_len // P) > knobs.device_pages(P)

    @classmethod
    def decode_kv_tokens_read(cls, config: EngineConfig, model_config: ModelConfig, prompt_len: int,
                              cache_len: int) -> float:
        """An offloaded request reads the view's pages and the page bounds (1/P of the context);
        misses cross PCIe on top of that (see memory_accounting)."""
        if not cls._sparse(config, prompt_len, cache_len):
            return cache_len
        P = config.page_size
        return min(config.method_config.view_pages(P) * P, cache_len) + cache_len / P

    @classmethod
    def kv_tokens_held(cls, config: EngineConfig, model_config: ModelConfig, prompt_len: int,
                       output_len: int) -> int | None:
        """Device tokens while decoding; prefill holds the whole prompt for a while."""
        if not cls._sparse(config, prompt_len, prompt_len + output_len):
            return prompt_len + output_len
        return config.method_config.device_pages(config.page_size) * config.page_size

    # ---- scheduler-facing ------------------------------------------------------------------------
    def _total_len(self, seq: Sequence) -> int:
        return min(seq.num_prompt_tokens + seq.params.max_tokens, self.config.max_model_len)

    def _wants_host(self, seq: Sequence) -> bool:
        return self._sparse(self.config, seq.num_prompt_tokens, self._total_len(seq))

    def request_error(self, prompt_len: int, max_tokens: int) -> str | None:
        total = min(prompt_len + max_tokens, self.config.max_model_len)
        if not self._sparse(self.config, prompt_len, total):
            return None
        if self.pages_for(total) > self.host.num_pages:
            return (f"request of {total} tokens (prompt + max_tokens) needs {self.pages_for(total)} host pages, "
                    f"the host pool holds {self.host.num_pages}; raise hisparse_host_memory_gb")
        prefill_pages = self.pages_for(self.admit_len(prompt_len, prompt_len, max_tokens))
        if prefill_pages + self.device_pages > self.num_pages:
            return (f"prompt of {prompt_len} tokens needs {prefill_pages} KV pages to prefill plus "
                    f"{self.device_pages} hot pages, the pool holds {self.num_pages}; raise num_kv_pages")
        return None

    def can_admit(self, seq: Sequence) -> bool:
        if not self._wants_host(seq):
            return super().can_admit(seq)
        # Prefill holds the prompt on the device next to the hot pages; the host holds everything.
        # Pages other offloaded prompts still need to finish prefilling are promised: admitting
        # against them would preempt a prompt half-way, and its chunks would be computed twice.
        promised = sum(max(0, self.pages_for(self.seq_admit_len(s)) - len(self.tables[sid]))
                       for sid, s in self.prefilling.items())
        return (bool(self.free_rows) and self.pages_for(self._total_len(seq)) <= self.host.num_free
                and self.pages_for(self.seq_admit_len(seq)) + self.device_pages + promised
                <= self.allocator.num_free)

    def allocate(self, seq: Sequence) -> None:
        super().allocate(seq)
        if not self._wants_host(seq):
            return
        sid, row = seq.seq_id, self.free_rows.pop()
        self.row_of[sid] = row
        pages = np.asarray(self.host.allocate(self.pages_for(self._total_len(seq))), dtype=np.int32)
        self.host_pages_of[sid] = pages
        self.host_tables[row, :len(pages)] = to_device(pages, self.device, torch.int32)
        self.hot_of[sid] = [self.allocator.allocate() for _ in range(self.device_pages)]
        self.prefilling[sid] = seq

    def reserve(self, seq: Sequence, num_new_tokens: int) -> bool:
        if seq.seq_id not in self.decoding:
            return super().reserve(seq, num_new_tokens)
        # Decode writes into the request's current device page, whichever logical page that is.
        P, arr = self.page_size, self.tables.arrays[seq.seq_id]
        arr[seq.cache_len // P:self.pages_for(seq.cache_len + num_new_tokens)] = self.hot_of[seq.seq_id][-1]
        return True

    def free(self, seq: Sequence) -> None:
        sid = seq.seq_id
        if sid in self.row_of:
            row = self.row_of.pop(sid)
            self.decoding.discard(sid)
            self.prefilling.pop(sid, None)
            for page in self.hot_of.pop(sid):
                self.allocator.release(page)
            self.host.release(self.host_pages_of.pop(sid).tolist())
            self.offloaded[row] = False
            self.buf_key[:, row] = -1
            self.buf_last[:, row] = -1
            self.host_tables[row] = self.trash
            self.free_rows.append(row)
        super().free(seq)

    def commit(self, seq: Sequence, num_new_tokens: int) -> None:
        super().commit(seq, num_new_tokens)
        if seq.seq_id in self.row_of and seq.seq_id not in self.decoding and \
                seq.num_computed_tokens >= len(seq.token_ids):
            self._to_hot_buffer(seq)

    def _to_hot_buffer(self, seq: Sequence) -> None:
        """Prefill is done: keep the last full pages (as LRU entries) and the partial page (as the
        current page) in the hot pages, give the prompt's device pages back."""
        sid, P, E = seq.seq_id, self.page_size, self.device_pages - 1
        row, hot, table = self.row_of[sid], self.hot_of[sid], list(self.tables[sid])
        full, partial = divmod(seq.cache_len, P)
        kept = min(E, full)
        src = table[full - kept:full] + ([table[full]] if partial else [])
        dst = hot[:kept] + ([hot[E]] if partial else [])
        if src:
            offs = torch.arange(P, device=self.device)
            s = (to_device(src, self.device).unsqueeze(1) * P + offs).flatten()
            d = (to_device(dst, self.device).unsqueeze(1) * P + offs).flatten()
            for x in (self.pool.k, self.pool.v, self.pool.k_scale, self.pool.v_scale):
                if x is not None:   # K, V and, in an FP8 pool, their scales
                    x[:, d] = x[:, s]
        keys = np.full(E, -1, dtype=np.int32)
        keys[:kept] = self.host_pages_of[sid][full - kept:full]
        self.buf_key[:, row] = to_device(keys, self.device, torch.int32)
        self.buf_last[:, row] = to_device(np.where(keys >= 0, 0, -1), self.device, torch.int32)
        self.buf_phys[row] = to_device(hot[:E], self.device, torch.int32)
        self.offloaded[row] = True
        for page in table:
            self.allocator.release(page)
        self.tables.replace(seq, [])
        self.prefilling.pop(sid)
        self.decoding.add(sid)

    def memory_accounting(self) -> dict:
        acc = super().memory_accounting()
        wanted, misses = self.swap_stats_host.tolist()
        page_bytes = self.host.nbytes // self.host.num_pages
        layer_page_bytes = page_bytes // self.num_layers
        steps = max(self.decode_steps, 1)
        acc.update(
            metadata_bytes=self.kmin.nbytes + self.kmax.nbytes + self.scratch_min.nbytes + self.scratch_max.nbytes,
            host_pool_bytes=self.host.nbytes, host_used_bytes=(self.host.num_pages - self.host.num_free) * page_bytes,
            hot_pages_per_request=self.device_pages, offloaded_requests=len(self.row_of),
            hit_rate=None if wanted == 0 else 1.0 - misses / wanted, swapped_in_pages=misses,
            decode_steps_offloaded=self.decode_steps,
            pcie_bytes_per_decode_step=misses * layer_page_bytes / steps)
        return acc

    # ---- per step --------------------------------------------------------------------------------
    def on_step_begin(self, step: StepState) -> None:
        seqs = step.seqs
        if step.is_prefill:
            self._prefill_extras(step)
            return
        if self.copies_pending:   # prompt pages reach the host before any decode step swaps or evicts
            torch.cuda.current_stream(self.device).wait_stream(self.copy_stream)
            self.copies_pending = False
        # A request with host pages has its row also before it is offloaded (the last token of a
        # recompute after preemption runs as a decode step while the prompt is still on the device):
        # decode writes through to host for every such row, the view is sparse for offloaded ones only.
        rows = [self.row_of.get(s.seq_id, self.dummy_row) for s in seqs]
        self.clock += 1
        if any(s.seq_id in self.decoding for s in seqs):
            self.decode_steps += 1
        step.extras["hisparse_rows"] = to_device(rows, self.device)
        step.extras["hisparse_clock"] = to_device([self.clock] * len(seqs), self.device, torch.int32)

    def _prefill_extras(self, step: StepState) -> None:
        P, T = self.page_size, sum(step.num_tokens)
        host_slots = np.full(T, -1, dtype=np.int64)
        last_slots, last_host, off = [], [], 0
        for seq, n in zip(step.seqs, step.num_tokens):
            if seq.seq_id in self.row_of:
                hp = self.host_pages_of[seq.seq_id].astype(np.int64)
                stored = np.arange(seq.cache_len, seq.cache_len + n)
                host_slots[off:off + n] = hp[stored // P] * P + stored % P
                pages, slots = self.last_slots(seq, n)
                last_slots.append(slots)
                last_host.append(hp[pages])
            off += n
        if last_slots:
            step.extras["hisparse_host_slots"] = to_device(host_slots, self.device)
            step.extras["hisparse_last_slots"] = to_device(np.concatenate(last_slots), self.device)
            step.extras["hisparse_last_host"] = to_device(np.concatenate(last_host), self.device)

    def on_step_end(self, step: StepState) -> None:
        if not step.is_prefill and self.swap_stats_host is not self.swap_stats:
            self.swap_stats_host.copy_(self.swap_stats, non_blocking=True)

    def graph_extras(self, max_batch_size: int) -> dict[str, torch.Tensor]:
        return {"hisparse_rows": torch.full((max_batch_size,), self.dummy_row, dtype=torch.int64, device=self.device),
                "hisparse_clock": torch.zeros(max_batch_size, dtype=torch.int32, device=self.device)}

    # ---- per layer -------------------------------------------------------------------------------
    def _bounds_from_pool(self, layer_id: int, dev_slots: torch.Tensor, host_pages: torch.Tensor) -> None:
        """Recompute the min/max of the device pages holding dev_slots (-1: none) with page_bounds
        and file them under their host pages."""
        page_bounds(self.pool.layer(layer_id)[0], dev_slots, self.scratch_min, self.scratch_max, self.page_size,
                    self.pool.scales(layer_id)[0])
        dev_pages = (dev_slots // self.page_size).clamp(min=0)
        self.kmin[layer_id].index_copy_(0, host_pages, self.scratch_min.index_select(0, dev_pages))
        self.kmax[layer_id].index_copy_(0, host_pages, self.scratch_max.index_select(0, dev_pages))

    @staticmethod
    def _none_in(step: StepState, ids) -> bool:
        """An eager decode step none of whose requests is in ids (offloaded: `decoding`; with host
        pages: `row_of`). CUDA-graph capture has no seqs, so graphs always hold the full path."""
        return bool(step.seqs) and all(s is not None and s.seq_id not in ids for s in step.seqs)

    def on_kv_stored(self, layer_id: int, k: torch.Tensor, v: torch.Tensor, step: StepState) -> None:
        host_k, host_v = self.host.layer(layer_id)
        host_ks, host_vs = self.host.scales(layer_id)
        if step.is_prefill:
            if "hisparse_host_slots" not in step.extras:
                return
            self._bounds_from_pool(layer_id, step.extras["hisparse_last_slots"], step.extras["hisparse_last_host"])
            slots = step.extras["hisparse_host_slots"]
            if self.copy_stream is None:
                host_store(k, v, host_k, host_v, slots, host_ks, host_vs)
                return
            # The prompt's copy to host overlaps the rest of the forward; decode waits for it.
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.copy_stream):
                host_store(k, v, host_k, host_v, slots, host_ks, host_vs)
            for t in (k, v, slots):
                t.record_stream(self.copy_stream)
            self.copies_pending = True
            return
        if self._none_in(step, self.row_of):
            return   # an eager decode step without host-backed requests
        # Decode: write the new token through to its host slot, then refresh its page's bounds, for
        # every request with host pages (rows without any hold the trash page: dense requests, padding).
        rows = step.extras["hisparse_rows"]
        pos = step.positions
        host_page = self.host_tables[rows, pos // self.page_size].long()
        active = (host_page != self.trash) & (step.slot_mapping >= 0)
        host_store(k, v, host_k, host_v, torch.where(active, host_page * self.page_size + pos % self.page_size, -1),
                   host_ks, host_vs)
        self._bounds_from_pool(layer_id, torch.where(active, step.slot_mapping, -1),
                               torch.where(active, host_page, self.trash))

    def build_decode_view(self, layer_id: int, q: torch.Tensor, step: StepState) -> DecodeView:
        # Static branches: tables too short to select from, eager steps with no offloaded request.
        if self.host_tables.shape[1] <= self.view_pages or self._none_in(step, self.decoding):
            return super().build_decode_view(layer_id, q, step)
        P, n = self.page_size, self.view_pages
        rows, lens = step.extras["hisparse_rows"], step.cache_lens
        htab = self.host_tables[rows]
        active = self.offloaded[rows] & (step.slot_mapping >= 0)
        scores = bound_scores(q, self.kmin[layer_id], self.kmax[layer_id], htab, lens, P, "shared")
        if self.recent_pages:   # recent pages always win the top-k
            current = ((lens.long() - 1) // P).unsqueeze(1)
            idx = torch.arange(htab.shape[1], device=q.device).unsqueeze(0)
            recent = (idx >= current - self.recent_pages) & (idx < current)
            scores.masked_fill_(recent.unsqueeze(1), float("inf"))
        want, view_lens = select_pages(scores, htab, lens, P, n)
        want, view_lens = want[:, 0], view_lens[:, 0]
        k_cache, v_cache = self.pool.layer(layer_id)
        table, src = swap_plan(want, view_lens, rows, active, step.slot_mapping // P, step.extras["hisparse_clock"],
                               self.buf_key[layer_id], self.buf_last[layer_id], self.buf_phys, P)
        host_k, host_v = self.host.layer(layer_id)
        copy_pages(host_k, host_v, k_cache, v_cache, src, table, P)
        k_scale, v_scale = self.pool.scales(layer_id)
        if k_scale is not None:   # FP8: the pages' scales follow them, as a cache of one element a head
            host_ks, host_vs = self.host.scales(layer_id)
            copy_pages(host_ks.unsqueeze(-1), host_vs.unsqueeze(-1), k_scale.unsqueeze(-1), v_scale.unsqueeze(-1),
                       src, table, P)
        wanted = torch.where(active, (view_lens + P - 1) // P - 1, 0).sum()
        self.swap_stats += torch.stack([wanted, (src >= 0).sum()])
        # One view for the batch: offloaded rows read their hot pages, dense rows their block table.
        bt = step.block_tables
        W = max(bt.shape[1], n)
        tab = torch.where(active.unsqueeze(1), F.pad(table, (0, W - n)), F.pad(bt, (0, W - bt.shape[1])))
        lengths = torch.where(active, view_lens, lens)
        return DecodeView(k_cache, v_cache, tab.to(torch.int32).unsqueeze(1).contiguous(),
                          lengths.to(torch.int32).unsqueeze(1).contiguous(), P, k_scale=k_scale, v_scale=v_scale)

    def recall_view(self, layer_id: int, step: StepState) -> DecodeView | None:
        """Every page an offloaded request holds, read from its host copy (decode writes through
        before attention, so the current token is there too); other rows are dense: length 0."""
        if self.host_tables.shape[1] <= self.view_pages or self._none_in(step, self.decoding):
            return None
        rows = step.extras["hisparse_rows"]
        active = self.offloaded[rows] & (step.slot_mapping >= 0)
        host_k, host_v = self.host.layer(layer_id)
        lengths = torch.where(active, step.cache_lens, 0).to(torch.int32)
        table = self.host_tables[rows]
        table = torch.where(table == self.trash, 0, table)   # the trash page has no host storage
        host_ks, host_vs = self.host.scales(layer_id)
        return DecodeView(host_k, host_v, table.unsqueeze(1), lengths.unsqueeze(1), self.page_size,
                          k_scale=host_ks, v_scale=host_vs)

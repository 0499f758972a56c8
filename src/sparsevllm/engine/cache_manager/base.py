"""CacheManager: the hook contract every sparse method implements, with dense (vanilla) defaults.

Per step the engine calls `prepare_step` once; per layer the generic Attention calls `store_kv`,
`on_kv_stored`, then `observe_prefill_queries` + `prefill_view` (prefill) or `build_decode_view`
(decode); after the forward
the controller calls `on_step_end`. The scheduler only asks `can_admit` / `allocate` / `reserve` /
`free`. A method subclasses this, declares its knobs (`config_cls`), its prefill policy and its
capabilities, and overrides the hooks it needs. Everything a decode hook does must be tensor work
on `StepState` fields (no host syncs), because decode steps are captured into CUDA graphs.
"""
from dataclasses import dataclass, field

import numpy as np
import torch

from sparsevllm.config import EngineConfig, MethodConfig
from sparsevllm.engine.kv_pool import KVPool, PageAllocator, page_hash
from sparsevllm.engine.sequence import Sequence
from sparsevllm.engine.staging import HostStaging
from sparsevllm.kernels.kv_store import store_kv


@dataclass
class Capabilities:
    cuda_graph: bool = True        # decode hooks are capturable
    prefix_cache: bool = True      # full raw pages may be shared between requests
    tensor_parallel: bool = False


@dataclass
class DecodeView:
    """What one decode attention reads: row (b, g) covers pages table[b, g, :ceil(len / P)] of
    k_cache / v_cache. G = 1 (shared by all KV heads), H_kv (one set per KV head) or H_q (one set
    per query head: a GQA group's query heads then read their KV head's pages separately)."""
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    table: torch.Tensor      # [B, G, N] int32
    lengths: torch.Tensor    # [B, G] int32
    page_size: int


@dataclass
class PrefillView:
    """What prefill attention reads: the chunk's queries attend to keys [0, context_lens[i]) of
    request i through its block table (prefix + the chunk itself, already stored)."""
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor   # [B, N] int32
    context_lens: torch.Tensor   # [B] int32
    page_size: int


@dataclass
class StepState:
    """Everything one forward step needs, built once by `prepare_step` and passed down."""
    is_prefill: bool
    seqs: list[Sequence]
    num_tokens: list[int]            # new tokens per request this step
    input_ids: torch.Tensor          # [T]
    positions: torch.Tensor          # [T] logical (RoPE) positions
    slot_mapping: torch.Tensor       # [T] pool slot of each new token, -1 = write nowhere
    block_tables: torch.Tensor       # [B, N] int32, padded with 0
    context_lens: torch.Tensor       # [B] int32: cache length after this step's tokens are stored
    cu_seqlens_q: torch.Tensor       # [B+1] int32 (prefill)
    max_seqlen_q: int = 1
    has_prefix: bool = False         # prefill: some chunk attends to earlier stored tokens
    logits_indices: torch.Tensor | None = None   # rows whose logits are computed (last token of each seq)
    # Method-owned per-step tensors (e.g. selection buffers). The model runner copies them into
    # static CUDA-graph buffers like every other tensor field.
    extras: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return len(self.seqs)


class CacheManager:
    config_cls: type[MethodConfig] = MethodConfig
    prefill_policy: str = "chunked"          # or "full_prompt": the method needs the whole prompt in one step
    capabilities: Capabilities = Capabilities()
    method_name: str = "base"

    def __init__(self, config: EngineConfig, num_layers: int, num_kv_heads: int, head_dim: int,
                 num_pages: int, dtype: torch.dtype, device: torch.device):
        self.config = config
        self.method_config = config.method_config
        self.page_size = config.page_size
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.device = device
        self.pool = KVPool(num_layers, num_pages, self.page_size, num_kv_heads, head_dim, dtype, device)
        self.allocator = PageAllocator(num_pages)
        self.block_tables: dict[int, list[int]] = {}
        # The same tables as int32 arrays, so building a step's [B, N] table is B row copies rather
        # than N Python ints per request (at 128K context that is thousands per step).
        self._table_arrays: dict[int, np.ndarray] = {}
        self._hash_memo: dict[int, list[int]] = {}
        self.staging = HostStaging(torch.device(device))
        self.prefix_caching = config.enable_prefix_caching and self.capabilities.prefix_cache

    # ---- sizing -----------------------------------------------------------------------------
    @classmethod
    def bytes_per_page(cls, config: EngineConfig, num_layers, num_kv_heads, head_dim, dtype) -> int:
        """Device bytes one page costs, metadata included; used to size the pool from memory."""
        return KVPool.bytes_per_page(num_layers, config.page_size, num_kv_heads, head_dim, dtype)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    # ---- capacity and lifecycle (scheduler-facing) --------------------------------------------
    def _prefix_hashes(self, seq: Sequence) -> list[int]:
        """Chained hashes of the full pages of seq's tokens that prefill may skip (never the last
        token: its logits are needed). Memoised per request: a long prompt waiting at the head of
        the queue is asked about every step, and its tokens only ever grow at the end."""
        hashes = self._hash_memo.setdefault(seq.seq_id, [])
        P = self.page_size
        for i in range(len(hashes), (len(seq) - 1) // P):
            hashes.append(page_hash(seq.token_ids[i * P:(i + 1) * P], hashes[-1] if hashes else -1))
        return hashes[:(len(seq) - 1) // P]

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        pages = []
        if self.prefix_caching:
            for h in self._prefix_hashes(seq):
                page = self.allocator.lookup(h)
                if page is None:
                    break
                pages.append(page)
        return pages

    def chunk_size(self, seq: Sequence, max_tokens: int) -> int:
        """How many of seq's uncomputed tokens the next prefill step runs, given at most max_tokens.
        A "full_prompt" method takes the whole remainder at once, whatever the budget; a method may
        also shape chunks (SnapKV keeps its observation window inside the last chunk)."""
        if self.prefill_policy == "full_prompt":
            return seq.num_uncomputed_tokens
        return min(seq.num_uncomputed_tokens, max_tokens)

    def can_admit(self, seq: Sequence) -> bool:
        """Admit only if the whole current sequence fits, so its prefill never has to preempt."""
        hits = self._cached_prefix(seq)
        revived = sum(1 for p in hits if self.allocator.refcount[p] == 0)
        needed = self.pages_for(len(seq) + 1) - len(hits) + revived
        return needed <= self.allocator.num_free

    def allocate(self, seq: Sequence) -> None:
        """Give an admitted request its table; prefix-cache hits become already-computed tokens."""
        assert seq.seq_id not in self.block_tables
        hits = self._cached_prefix(seq)
        for page in hits:
            self.allocator.share(page)
        self.block_tables[seq.seq_id] = list(hits)
        arr = np.zeros(self.pages_for(self.config.max_model_len) + 1, dtype=np.int32)
        arr[:len(hits)] = hits
        self._table_arrays[seq.seq_id] = arr
        seq.num_computed_tokens = seq.cache_len = len(hits) * self.page_size

    def reserve(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make room for num_new_tokens more stored tokens; False (nothing taken) if the pool is short."""
        table = self.block_tables[seq.seq_id]
        need = self.pages_for(seq.cache_len + num_new_tokens) - len(table)
        if need <= 0:
            return True
        if need > self.allocator.num_free:
            return False
        start = len(table)
        table.extend(self.allocator.allocate() for _ in range(need))
        self._table_arrays[seq.seq_id][start:len(table)] = table[start:]
        return True

    def free(self, seq: Sequence) -> None:
        # Release the tail first so that, among cached pages, prefixes outlive their suffixes.
        for page in reversed(self.block_tables.pop(seq.seq_id, [])):
            self.allocator.release(page)
        self._table_arrays.pop(seq.seq_id, None)
        if seq.is_finished:
            self._hash_memo.pop(seq.seq_id, None)

    def commit(self, seq: Sequence, num_new_tokens: int) -> None:
        """After a step stored num_new_tokens for seq: advance the counters and name newly full pages.
        Runs after the forward and after on_step_end."""
        old = seq.cache_len
        seq.num_computed_tokens += num_new_tokens
        seq.cache_len += num_new_tokens
        if seq.cache_len == seq.num_computed_tokens:  # only raw caches can be named by their tokens
            self.name_full_pages(seq, old, seq.cache_len)

    def name_full_pages(self, seq: Sequence, start: int, end: int) -> None:
        """Enter the full raw pages holding tokens [start, end) into the prefix cache (chained hashes)."""
        if not self.prefix_caching:
            return
        P, table = self.page_size, self.block_tables[seq.seq_id]
        for i in range(start // P, end // P):
            prev = self.allocator.hash_of[table[i - 1]] if i > 0 else -1
            if i > 0 and prev < 0:
                break  # the chain is broken (previous page unnamed); later pages cannot be named
            self.allocator.register(table[i], page_hash(seq.token_ids[i * P:(i + 1) * P], prev))

    def memory_accounting(self) -> dict:
        page_bytes = self.pool.nbytes // self.num_pages
        used = self.num_pages - self.allocator.num_free
        return {"kv_pool_bytes": self.pool.nbytes, "kv_used_bytes": used * page_bytes,
                "kv_peak_used_bytes": self.allocator.peak_used * page_bytes,
                "kv_page_bytes": page_bytes, "num_pages": self.num_pages, "used_pages": used,
                "metadata_bytes": 0}

    # ---- per step (model-runner-facing) -------------------------------------------------------
    def prepare_step(self, seqs: list[Sequence], num_tokens: list[int], is_prefill: bool) -> StepState:
        P, B, T = self.page_size, len(seqs), sum(num_tokens)
        width = max(len(self.block_tables[s.seq_id]) for s in seqs)
        # Every integer input of the step goes into one (pinned) host buffer and crosses to the
        # device in one copy, already in the dtypes the kernels take: per-tensor copies and casts
        # cost more than the decode step's own host work at small batch.
        n64, n32 = 4 * T + B, B * width + 2 * B + 1          # int64: ids, pos, slots, logits rows
        raw = self.staging.host(8 * n64 + 4 * n32)
        i64, i32 = raw[:8 * n64].view(np.int64), raw[8 * n64:].view(np.int32)
        ids, pos, slots, rows = i64[:T], i64[T:2 * T], i64[2 * T:3 * T], i64[3 * T:3 * T + B]
        ctx, cu, tables = i32[:B], i32[B:2 * B + 1], i32[2 * B + 1:].reshape(B, width)
        cu[0], off = 0, 0
        for i, (seq, n) in enumerate(zip(seqs, num_tokens)):
            start = seq.num_computed_tokens
            ids[off:off + n] = seq.token_ids[start:start + n]
            pos[off:off + n] = np.arange(start, start + n)
            stored = np.arange(seq.cache_len, seq.cache_len + n)
            arr = self._table_arrays[seq.seq_id]
            slots[off:off + n] = arr[stored // P].astype(np.int64) * P + stored % P
            tables[i] = arr[:width]
            ctx[i] = seq.cache_len + n
            off += n
            cu[i + 1] = off
        rows[:] = cu[1:] - 1
        has_prefix = bool((ctx != np.asarray(num_tokens)).any())
        dev = self.staging.upload(raw)
        d64, d32 = dev[:8 * n64].view(torch.int64), dev[8 * n64:].view(torch.int32)
        return StepState(
            is_prefill=is_prefill, seqs=seqs, num_tokens=list(num_tokens),
            input_ids=d64[:T], positions=d64[T:2 * T], slot_mapping=d64[2 * T:3 * T],
            block_tables=d32[2 * B + 1:].view(B, width), context_lens=d32[:B], cu_seqlens_q=d32[B:2 * B + 1],
            max_seqlen_q=max(num_tokens), has_prefix=has_prefix, logits_indices=d64[3 * T:3 * T + B])

    def graph_extras(self, max_batch_size: int) -> dict[str, torch.Tensor]:
        """Static buffers for the method's StepState.extras (first dim = batch), used by CUDA graphs."""
        return {}

    # ---- per layer (Attention-facing) ---------------------------------------------------------
    def store_kv(self, layer_id: int, k: torch.Tensor, v: torch.Tensor, step: StepState) -> None:
        k_cache, v_cache = self.pool.layer(layer_id)
        store_kv(k, v, k_cache, v_cache, step.slot_mapping)

    def on_kv_stored(self, layer_id: int, k: torch.Tensor, v: torch.Tensor, step: StepState) -> None:
        """Update method metadata after the write (Quest: page min/max). Dense: nothing."""

    def observe_prefill_queries(self, layer_id: int, q: torch.Tensor, step: StepState) -> None:
        """See a prefill chunk's queries (q: [T, H_q, D], after RoPE; the chunk's K/V are already
        stored), e.g. to score prompt tokens from an observation window (SnapKV). Prefill math is
        unchanged. Dense: nothing."""

    def prefill_view(self, layer_id: int, step: StepState) -> PrefillView:
        k_cache, v_cache = self.pool.layer(layer_id)
        return PrefillView(k_cache, v_cache, step.block_tables, step.context_lens, self.page_size)

    def build_decode_view(self, layer_id: int, q: torch.Tensor, step: StepState) -> DecodeView:
        """Query-aware selection happens here (q: [B, H_q, D]). Dense: the block table itself."""
        k_cache, v_cache = self.pool.layer(layer_id)
        return DecodeView(k_cache, v_cache, step.block_tables.unsqueeze(1), step.context_lens.unsqueeze(1),
                          self.page_size)

    def on_step_end(self, step: StepState) -> None:
        """Eviction, compaction or compression after the forward, outside CUDA graphs. Runs before
        `commit` advances the step's counters."""

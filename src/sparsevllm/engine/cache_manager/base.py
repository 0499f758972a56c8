"""CacheManager: the hooks every sparse method implements, with dense (vanilla) defaults.

docs/design.md is the contract: who calls each hook, when, and what it may do (section 4), the
step's lifecycle (section 3) and the rules for CUDA graphs, overlapped scheduling and tensor
parallelism (section 6). In short: the scheduler asks for capacity (`can_admit`, `allocate`,
`reserve`, `free`); the runner builds each step and calls `on_step_begin`; the generic Attention
calls the per-layer hooks (`store_kv`, `on_kv_stored`, `observe_prefill_queries`, `prefill_view`,
`build_decode_view`); the engine calls `on_step_end`, then `commit` per request. What one hook hands
a later hook of the same step lives on the step (`step.extras`, `step.scratch`); host hooks never
read token ids of the step in flight and never synchronise; decode hooks are tensor work only (they
are captured into CUDA graphs); host decisions follow from counters, refcounts and token ids alone,
so tensor-parallel ranks replaying them agree.

A method subclasses CacheManager, declares its knobs (`config_cls`), its prefill policy, its
capabilities and what one decode step reads (`decode_kv_tokens_read`, for the benchmark's
roofline), and overrides the hooks it needs.
"""
from dataclasses import dataclass

import numpy as np
import torch

from sparsevllm.config import EngineConfig, MethodConfig
from sparsevllm.engine.cache_manager import pressure
from sparsevllm.engine.kv_pool import KVPool, PageAllocator, PageTables, kv_storage_dtype
from sparsevllm.engine.sequence import Sequence
from sparsevllm.engine.step import DecodeView, PrefillView, StepState, StoreTarget
from sparsevllm.kernels.rope_store import rope_store
from sparsevllm.models.config import ModelConfig


@dataclass
class Capabilities:
    cuda_graph: bool = True        # decode hooks are capturable
    prefix_cache: bool = True      # full raw pages may be shared between requests
    tensor_parallel: bool = False  # runs with tensor_parallel_size > 1 (else a clear ValueError)
    # Decode attends to every stored token, so a generated token's KV equals what prefill computes
    # for it and its pages may be shared. False for a sparse decode view: the later layers of a
    # generated token saw fewer tokens, and only prompt pages enter the prefix cache.
    dense_decode: bool = True
    # Runs with kv_cache_dtype="fp8" (else a clear ValueError naming the knob at launch).
    fp8_kv_cache: bool = True


class CacheManager:
    config_cls: type[MethodConfig] = MethodConfig
    prefill_policy: str = "chunked"          # or "full_prompt": the method needs the whole prompt in one step
    capabilities: Capabilities = Capabilities()
    method_name: str = "base"                # the registry name, set by each method
    # The knobs a request may set for itself (SparseParams; its budget), read through
    # `request_config(seq)`; () : none, but a request may still choose "vanilla" (a dense row in the
    # same batch). None: the method takes no per-request sparsity at all (it owns its pool's layout:
    # DeltaKV, HiSparse), and a request asking for any is refused when it arrives.
    request_knobs: tuple[str, ...] | None = None
    # What metrics["attention_recall"] means for this method (docs/design.md, section 10).
    recall_definition: str = ("dense: every layer attends every token the request holds; recall 1.0 and "
                              "output error 0.0 exactly, no layer is measured")

    def __init__(self, config: EngineConfig, model_config: ModelConfig, num_kv_heads: int, num_pages: int,
                 dtype: torch.dtype, device: torch.device, shared: "CacheManager | None" = None):
        """num_kv_heads: this rank's KV heads; num_pages: the pool's size in pages of bytes_per_page.
        shared: the composite of an engine hosting several methods (mixed_methods, engine/cache_manager/
        mixed.py), whose pool, allocator and block tables this manager uses instead of its own; its
        metadata per page is then sized by the shared pool."""
        self.config, self.model_config = config, model_config
        self.method_config = config.method_config
        self.page_size = config.page_size
        self.num_layers, self.head_dim = model_config.num_hidden_layers, model_config.head_dim
        self.num_kv_heads = num_kv_heads
        self.dtype, self.device = dtype, device
        self.kv_dtype = kv_storage_dtype(config.kv_cache_dtype, dtype)   # what the KV is stored in
        if shared is not None:
            self.pool, self.allocator, self.tables = shared.pool, shared.allocator, shared.tables
            return
        num_pages = self.allocate_storage(num_pages)
        self.allocator = PageAllocator(num_pages)
        self.tables = PageTables(self.allocator, self.page_size, self.pages_for(config.max_model_len) + 1,
                                 config.enable_prefix_caching and self.capabilities.prefix_cache)

    def allocate_storage(self, num_pages: int) -> int:
        """Allocate the method's KV storage from a budget of num_pages x bytes_per_page bytes and
        return how many pages its paged pool `self.pool` has (the allocator's and the block tables'
        pages). A method with metadata per page adds it here; one that owns its layout (DeltaKV)
        builds it here. Dense: every layer raw, num_pages pages."""
        self.pool = KVPool(self.num_layers, num_pages, self.page_size, self.num_kv_heads, self.head_dim,
                           self.kv_dtype, self.device)
        return num_pages

    # ---- sizing -----------------------------------------------------------------------------
    @classmethod
    def bytes_per_page(cls, config: EngineConfig, num_layers, num_kv_heads, head_dim, dtype) -> int:
        """Device bytes one page costs, metadata included; used to size the pool from memory. dtype is
        the model's; the KV itself is stored in kv_storage_dtype(config.kv_cache_dtype, dtype)."""
        return KVPool.bytes_per_page(num_layers, config.page_size, num_kv_heads, head_dim,
                                     kv_storage_dtype(config.kv_cache_dtype, dtype))

    @classmethod
    def fixed_device_bytes(cls, config: EngineConfig, num_layers, num_kv_heads, head_dim, dtype) -> int:
        """Device bytes the method allocates whatever the pool size (HiSparse's page bounds for its
        whole host pool); taken off the memory budget before the pool is sized. Dense: none."""
        return 0

    @classmethod
    def validate_model(cls, config: EngineConfig, model_config: ModelConfig) -> None:
        """Check the method's knobs against the model's shape (layer ids, head counts), after its
        config.json is read and before any weight loads; raise ValueError naming the knob. Dense:
        nothing to check."""

    @classmethod
    def decode_kv_tokens_read(cls, config: EngineConfig, model_config: ModelConfig, prompt_len: int,
                              cache_len: int) -> float:
        """KV tokens one decode step of one request reads over a cache of cache_len tokens (prompt
        prompt_len), averaged over layers, metadata counted in token-sized units (one token: K + V of
        one layer, 2 x num_key_value_heads x head_dim elements of model_config): the benchmark's
        roofline. Dense: everything."""
        return cache_len

    @classmethod
    def kv_tokens_held(cls, config: EngineConfig, model_config: ModelConfig, prompt_len: int,
                       output_len: int) -> int | None:
        """Device KV tokens one request holds at its peak, in the same token-sized units (the
        benchmark checks a case fits); None when it cannot be known ahead."""
        return prompt_len + output_len

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def admit_len(self, num_tokens: int, num_prompt_tokens: int, max_tokens: int) -> int:
        """Tokens a request of num_tokens (prompt + what it generated before a preemption) stores up
        to its first decode step: its tokens, and the KV of the token prefill samples, unless that
        token is its last (max_tokens or max_model_len reached): then no decode step ever runs, and
        a prompt that exactly fills the pool with max_tokens=1 fits."""
        last = min(num_prompt_tokens + max_tokens, self.config.max_model_len)
        return num_tokens + 1 if num_tokens + 1 < last else num_tokens

    def request_config(self, seq: Sequence) -> MethodConfig | None:
        """The knobs seq decodes with: its own (SparseParams, resolved when it arrived), the engine's
        when it has none, or None where this manager's method is not what it decodes with (it chose
        vanilla, "auto" did, or, in an engine hosting several methods, it runs another one)."""
        if seq.sparse is None:
            return self.method_config
        return seq.sparse.config if seq.sparse.method == self.method_name else None

    def seq_admit_len(self, seq: Sequence) -> int:
        return self.admit_len(len(seq), seq.num_prompt_tokens, seq.params.max_tokens)

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    # ---- capacity and lifecycle (scheduler-facing) --------------------------------------------
    def chunk_size(self, seq: Sequence, max_tokens: int) -> int:
        """How many of seq's uncomputed tokens the next prefill step runs, given at most max_tokens.
        A "full_prompt" method takes the whole remainder at once, whatever the budget; a method may
        also shape chunks (SnapKV keeps its observation window inside the last chunk)."""
        if self.prefill_policy == "full_prompt":
            return seq.num_uncomputed_tokens
        return min(seq.num_uncomputed_tokens, max_tokens)

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """Pages of seq's prefix that prefill may skip (prefix-cache hits); none for a request that
        wants its prompt's log-probabilities, which needs every prompt position computed."""
        if seq.params.prompt_logprobs is not None:
            return []
        return self.tables.cached_prefix(seq)

    def request_error(self, prompt_len: int, max_tokens: int) -> str | None:
        """Why a request of prompt_len + max_tokens can never be served (checked when it arrives, so
        it fails alone with this message instead of waiting forever), or None. A method with its
        own capacity (HiSparse's host pool) checks it here. Dense: the engine's pool check suffices."""
        return None

    def can_admit(self, seq: Sequence) -> bool:
        """Admit only if the whole current sequence fits, so its prefill never has to preempt."""
        hits = self.cached_prefix(seq)
        revived = sum(1 for p in hits if self.allocator.refcount[p] == 0)
        needed = self.pages_for(self.seq_admit_len(seq)) - len(hits) + revived
        return needed <= self.allocator.num_free

    def allocate(self, seq: Sequence) -> None:
        """Give an admitted request its table; prefix-cache hits become already-computed tokens."""
        hits = self.cached_prefix(seq)
        self.tables.open(seq, hits)
        seq.num_computed_tokens = seq.cache_len = len(hits) * self.page_size

    def reserve(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make room for num_new_tokens more stored tokens; False (nothing taken) if the pool is short."""
        return self.tables.grow(seq, seq.cache_len + num_new_tokens)

    def free(self, seq: Sequence) -> None:
        self.tables.close(seq)

    def compact_under_pressure(self, seq: Sequence, capacity: int) -> None:
        """"auto" under memory pressure: keep capacity of seq's stored tokens per layer and KV head
        (cache_manager/pressure.py). A host decision of its own, so tensor-parallel followers replay
        it (each rank scores its own KV heads; the pages taken and freed follow from the counters)."""
        pressure.compact(self, seq, capacity)

    def promised_pages(self, seq: Sequence) -> int:
        """Free pages this manager has promised to work of the current step other than seq's (SnapKV:
        the compactions its reserve admitted), which a reserve of any request must leave free; in
        an engine hosting several methods the composite adds them to every other method's reserve.
        Dense: none."""
        return 0

    def commit(self, seq: Sequence, num_new_tokens: int) -> None:
        """A launched step stores num_new_tokens for seq: advance the counters and name the full
        raw pages whose tokens are known. Runs after the forward was issued and after on_step_end."""
        seq.num_computed_tokens += num_new_tokens
        seq.cache_len += num_new_tokens
        if seq.cache_len == seq.num_computed_tokens:  # only raw caches can be named by their tokens
            # (a hit must equal a miss: with a sparse decode, only the prompt's KV is what prefill computes)
            end = seq.cache_len if self.capabilities.dense_decode else min(seq.cache_len, seq.num_prompt_tokens)
            self.tables.name_full_pages(seq, end)

    def memory_accounting(self) -> dict:
        page_bytes = self.pool.nbytes // self.num_pages
        used = self.num_pages - self.allocator.num_free
        return {"kv_pool_bytes": self.pool.nbytes, "kv_used_bytes": used * page_bytes,
                "kv_peak_used_bytes": self.allocator.peak_used * page_bytes,
                "kv_page_bytes": page_bytes, "num_pages": self.num_pages, "used_pages": used,
                "metadata_bytes": 0}

    # ---- per step (engine-facing) -------------------------------------------------------------
    def on_step_begin(self, step: StepState) -> None:
        """The step's generic inputs are built (host counters not yet advanced: `seq.cache_len` is
        where this step's tokens start): add the method's per-step tensors to `step.extras` (decode
        ones also declared in `graph_extras`) and its per-step state to `step.scratch`. Host work
        only, or tensor work queued before the forward; never a device sync. Dense: nothing."""

    def last_slots(self, seq: Sequence, num_new_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """The pages (logical indices) this step's num_new_tokens tokens of seq are stored into, and
        per page the slot of the last of them there: a method that keeps per-page metadata
        recomputes each such page from it (a prefill chunk writes many tokens into one page)."""
        P, start, end = self.page_size, seq.cache_len, seq.cache_len + num_new_tokens
        pages = np.arange(start // P, (end - 1) // P + 1)
        last = np.minimum((pages + 1) * P, end) - 1
        return pages, self.tables.arrays[seq.seq_id][pages].astype(np.int64) * P + last % P

    def graph_extras(self, max_batch_size: int) -> dict[str, torch.Tensor]:
        """Static buffers for the method's StepState.extras (first dim = batch), used by CUDA graphs."""
        return {}

    def graph_variants(self) -> tuple[str, ...]:
        """Names of the decode graphs captured per batch bucket ("" = the general one, always first): a
        method whose decode can skip work on a host fact of the step (every row within its budget)
        captures that path too, since a captured graph holds no host branch."""
        return ("",)

    def graph_variant(self, step: StepState) -> str:
        """After `on_step_begin` of a decode step: which of `graph_variants` this step runs (eagerly too:
        hooks read `step.graph_variant`). It must compute what the general one would."""
        return ""

    # ---- per layer (Attention-facing) ---------------------------------------------------------
    def store_kv(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 cos_sin_cache: torch.Tensor, step: StepState) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q and k to the step's positions (RoPE) and write k, v into the cache, in one
        kernel. q, k arrive before RoPE; returns (q, k) after it."""
        k_cache, v_cache = self.pool.layer(layer_id)
        k_scale, v_scale = self.pool.scales(layer_id)
        return rope_store(q, k, v, step.positions, cos_sin_cache, k_cache, v_cache, step.slot_mapping,
                          k_scale=k_scale, v_scale=v_scale)

    def store_target(self, layer_id: int, step: StepState) -> StoreTarget | None:
        """Where a decode step's projection may write K/V itself instead of `store_kv` (RoPE and the
        write in the qkv GEMM's epilogue: one launch a layer fewer), or None to keep `store_kv`.
        The write must be exactly what `store_kv` would do; a manager that overrides `store_kv`
        gets None here unless it overrides this too; so does an FP8 cache (the epilogue writes no
        scales: rope_store quantizes, one launch a layer more). Dense: the pool layer and the step's slots."""
        if step.is_prefill or type(self).store_kv is not CacheManager.store_kv or self.kv_dtype != self.dtype:
            return None
        k_cache, v_cache = self.pool.layer(layer_id)
        return StoreTarget(k_cache, v_cache, step.slot_mapping, step.positions)

    def on_kv_stored(self, layer_id: int, k: torch.Tensor, v: torch.Tensor, step: StepState) -> None:
        """Update method metadata after the write (k after RoPE). Dense: nothing."""

    def observe_prefill_queries(self, layer_id: int, q: torch.Tensor, step: StepState) -> None:
        """See a prefill chunk's queries (q: [T, H_q, D], after RoPE; the chunk's K/V are already
        stored), e.g. to score prompt tokens from an observation window (SnapKV). Prefill math is
        unchanged. Dense: nothing."""

    def prefill_view(self, layer_id: int, step: StepState) -> PrefillView:
        k_cache, v_cache = self.pool.layer(layer_id)
        return PrefillView(k_cache, v_cache, step.block_tables, step.cache_lens, self.page_size,
                           *self.pool.scales(layer_id))

    def build_decode_view(self, layer_id: int, q: torch.Tensor, step: StepState) -> DecodeView:
        """Query-aware selection happens here (q: [B, H_q, D]). Dense: the block table itself."""
        k_cache, v_cache = self.pool.layer(layer_id)
        k_scale, v_scale = self.pool.scales(layer_id)
        return DecodeView(k_cache, v_cache, step.block_tables.unsqueeze(1), step.cache_lens.unsqueeze(1),
                          self.page_size, k_scale=k_scale, v_scale=v_scale)

    def recall_view(self, layer_id: int, step: StepState) -> DecodeView | None:
        """On a decode step that measures attention recall (step.recall; it runs eagerly): a
        DecodeView over every token each request holds in this layer, with the keys the method's
        view reads (its tokens a subset of these), or None where the layer attends densely already
        (nothing to measure); a row of length 0 is not measured. Dense: None."""
        return None

    def on_step_end(self, step: StepState) -> None:
        """Eviction, compaction or compression after the forward was issued (on the host, outside
        CUDA graphs; device work it queues runs after the forward). Runs before `commit`."""

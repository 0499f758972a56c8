"""Paged KV storage, the page allocator, the requests' block tables and the prefix cache.

The pool holds, per layer, K and V as [num_pages * page_size, H_kv, D]: the slot of logical token t
of a request is table[t // P] * P + t % P. Full pages of raw prompt/decode KV are named by a chained
xxhash (hash of the previous page's hash and this page's tokens), so equal prefixes map to equal
pages and are shared by refcount. A freed page keeps its hash until it is reused, which is what
makes a later request with the same prefix a hit.

FP8 (kv_cache_dtype="fp8"): K and V are stored as float8_e4m3fn with one fp32 scale per stored
token and KV head, for K and for V (k_scale, v_scale: [num_layers, num_slots, H_kv]); the value is
x * scale. The scale is amax(|x|) / 448 over the token's D channels, written with the token by the
store (kernels/rope_store.py) and never revised, so nothing is ever requantized: a prefill chunk, a
decode token, SnapKV's compaction, HiSparse's host copies move tokens and their scales together.
Why this granularity: measured on the CPU with the embedded SmolLM2 (fp32), teacher-forced decode of
32 tokens after 4 prompts each of 1K and 2K tokens, against the model dtype (docs/performance.md;
`PYTHONPATH=src python scripts/benchmarks/fp8_granularity.py --lengths 1024,2048 --samples 4`):
mean |delta log p| / KL per token: one scale per tensor (1.0, vLLM's default without calibrated
scales) 0.115 / 0.0162; a static scale per layer and KV head (calibrated on the very samples, the best
case of static scales) 0.111 / 0.0168; a scale per token and KV head 0.083 / 0.0093, the most
accurate (K and V entries far below a head's largest fall under E4M3's normal range under a shared
scale, and lose their precision there). It needs no calibration, costs 8 bytes a token and KV head
(3% of the FP8 KV at D = 128, 6% at D = 64) and one multiply per logit column and value row in the
attention; a per-page scale would have to requantize a page as it fills. Its speed is measured on
the GPU by scripts/benchmarks/fp8_evidence.sh.
"""
from collections import OrderedDict, deque

import numpy as np
import torch
import xxhash

from sparsevllm.engine.sequence import Sequence


FP8 = torch.float8_e4m3fn


def bytes_per_token_head(head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one token's K (or V) of one KV head as stored: its elements, and its fp32 scale in FP8."""
    return head_dim * torch.empty((), dtype=dtype).element_size() + (4 if dtype == FP8 else 0)


def kv_storage_dtype(kv_cache_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """The element type KV is stored in: the model dtype ("auto") or float8_e4m3fn ("fp8", "fp8_e4m3")."""
    return dtype if kv_cache_dtype == "auto" else FP8


def page_hash(token_ids: list[int], prev_hash: int) -> int:
    h = xxhash.xxh64()
    h.update(prev_hash.to_bytes(8, "little", signed=True))
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.intdigest() >> 1  # keep it a non-negative int64 so -1 can mean "no hash"


class KVPool:
    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        self.num_pages, self.page_size = num_pages, page_size
        shape = (num_layers, num_pages * page_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.k_scale = self.v_scale = None
        if dtype == FP8:
            self.k_scale = torch.ones(shape[:3], dtype=torch.float32, device=device)
            self.v_scale = torch.ones(shape[:3], dtype=torch.float32, device=device)

    def layer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer_id], self.v[layer_id]

    def scales(self, layer_id: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The layer's K and V scales [num_slots, H_kv] of an FP8 pool; (None, None) otherwise."""
        if self.k_scale is None:
            return None, None
        return self.k_scale[layer_id], self.v_scale[layer_id]

    @property
    def nbytes(self) -> int:
        scales = 0 if self.k_scale is None else self.k_scale.nbytes + self.v_scale.nbytes
        return self.k.nbytes + self.v.nbytes + scales

    @staticmethod
    def bytes_per_page(num_layers, page_size, num_kv_heads, head_dim, dtype) -> int:
        return 2 * num_layers * page_size * num_kv_heads * bytes_per_token_head(head_dim, dtype)


class PageAllocator:
    """Free pages, refcounts and the hash -> page map of the prefix cache."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self.refcount = [0] * num_pages
        self.hash_of = [-1] * num_pages
        self.page_of: dict[int, int] = {}
        self.free_clean: deque[int] = deque(range(num_pages))
        # Freed pages that still hold a hashed prefix, oldest first: reused last, revived on a hit.
        self.free_cached: OrderedDict[int, None] = OrderedDict()
        self.peak_used = 0  # most pages referenced at once since the last reset_peak()

    @property
    def num_free(self) -> int:
        return len(self.free_clean) + len(self.free_cached)

    def allocate(self) -> int:
        if self.free_clean:
            page = self.free_clean.popleft()
        else:
            page, _ = self.free_cached.popitem(last=False)
            del self.page_of[self.hash_of[page]]
            self.hash_of[page] = -1
        self.refcount[page] = 1
        self.peak_used = max(self.peak_used, self.num_pages - self.num_free)
        return page

    def share(self, page: int) -> None:
        """Take another reference to a cached page (a prefix-cache hit)."""
        if self.refcount[page] == 0:
            del self.free_cached[page]
            self.peak_used = max(self.peak_used, self.num_pages - self.num_free)
        self.refcount[page] += 1

    def release(self, page: int) -> None:
        assert self.refcount[page] > 0, f"page {page} released twice"
        self.refcount[page] -= 1
        if self.refcount[page] == 0:
            if self.hash_of[page] >= 0:
                self.free_cached[page] = None
            else:
                self.free_clean.append(page)

    def reset_peak(self) -> None:
        self.peak_used = self.num_pages - self.num_free

    def lookup(self, h: int) -> int | None:
        return self.page_of.get(h)

    def register(self, page: int, h: int) -> None:
        """Name a full page by its prefix hash. A page already named, or a hash already held by
        another live page, stays as it is (the first copy serves later hits)."""
        if self.hash_of[page] >= 0 or h in self.page_of:
            return
        self.hash_of[page] = h
        self.page_of[h] = page

    def is_idle(self) -> bool:
        """True when no page is referenced: the state every request must leave behind."""
        return self.num_free == self.num_pages and not any(self.refcount)


class PageTables:
    """Every request's block table over one PageAllocator, and the prefix-cache naming of its pages.

    Tables are kept twice: as lists (what the allocator hands out) and as int32 arrays, so building
    a step's [B, N] table is B row copies rather than N Python ints per request (at 128K context
    that is thousands per step). A request's pages are named in order as their tokens become known
    and stored; `named` counts them.
    """

    def __init__(self, allocator: PageAllocator, page_size: int, max_pages: int, prefix_caching: bool):
        self.allocator, self.page_size = allocator, page_size
        self.max_pages = max_pages
        self.prefix_caching = prefix_caching
        self.tables: dict[int, list[int]] = {}
        self.arrays: dict[int, np.ndarray] = {}
        self.named: dict[int, int] = {}
        # Chained hashes of each request's full pages, memoised: a long prompt waiting at the head
        # of the queue is asked about every step, and its tokens only ever grow at the end.
        self._hashes: dict[int, list[int]] = {}

    def __getitem__(self, seq_id: int) -> list[int]:
        return self.tables[seq_id]

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self.tables

    def page_hashes(self, seq: Sequence, num_pages: int) -> list[int]:
        hashes = self._hashes.setdefault(seq.seq_id, [])
        P = self.page_size
        for i in range(len(hashes), num_pages):
            hashes.append(page_hash(seq.token_ids[i * P:(i + 1) * P], hashes[-1] if hashes else -1))
        return hashes[:num_pages]

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """Pages of the longest cached prefix of seq's known tokens; never the page of the last
        token, whose logits are needed."""
        pages = []
        if self.prefix_caching:
            for h in self.page_hashes(seq, (len(seq.token_ids) - 1) // self.page_size):
                page = self.allocator.lookup(h)
                if page is None:
                    break
                pages.append(page)
        return pages

    def open(self, seq: Sequence, hits: list[int]) -> None:
        """Start seq's table with the prefix-cache hits (shared, already named)."""
        assert seq.seq_id not in self.tables
        for page in hits:
            self.allocator.share(page)
        self.tables[seq.seq_id] = list(hits)
        arr = np.zeros(self.max_pages, dtype=np.int32)
        arr[:len(hits)] = hits
        self.arrays[seq.seq_id] = arr
        self.named[seq.seq_id] = len(hits)

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Make the table hold num_tokens stored tokens; False (nothing taken) if the pool is short."""
        table = self.tables[seq.seq_id]
        need = -(-num_tokens // self.page_size) - len(table)
        if need <= 0:
            return True
        if need > self.allocator.num_free:
            return False
        start = len(table)
        table.extend(self.allocator.allocate() for _ in range(need))
        self.arrays[seq.seq_id][start:len(table)] = table[start:]
        return True

    def replace(self, seq: Sequence, pages: list[int]) -> None:
        """Point seq at other pages (a method that rewrote its KV); the caller released the old ones.
        Rewritten pages are never named."""
        old = self.tables[seq.seq_id]
        arr = self.arrays[seq.seq_id]
        arr[:len(old)] = 0
        arr[:len(pages)] = pages
        self.tables[seq.seq_id] = list(pages)
        self.named[seq.seq_id] = len(pages)

    def close(self, seq: Sequence) -> None:
        # Release the tail first so that, among cached pages, prefixes outlive their suffixes.
        for page in reversed(self.tables.pop(seq.seq_id, [])):
            self.allocator.release(page)
        self.arrays.pop(seq.seq_id, None)
        self.named.pop(seq.seq_id, None)
        if seq.is_finished:
            self._hashes.pop(seq.seq_id, None)

    def name_full_pages(self, seq: Sequence, end: int) -> None:
        """Enter the full pages holding stored tokens [0, end) into the prefix cache, as far as
        their tokens are known (under overlapped scheduling the last one may still be sampling)."""
        if not self.prefix_caching:
            return
        start, stop = self.named[seq.seq_id], min(end, len(seq.token_ids)) // self.page_size
        if stop <= start:
            return
        table = self.tables[seq.seq_id]
        for i, h in enumerate(self.page_hashes(seq, stop)[start:], start):
            self.allocator.register(table[i], h)
        self.named[seq.seq_id] = stop

"""Paged KV storage, the page allocator and the prefix cache.

The pool holds, per layer, K and V as [num_pages * page_size, H_kv, D]: the slot of logical token t
of a request is table[t // P] * P + t % P. Full pages of raw prompt/decode KV are named by a chained
xxhash (hash of the previous page's hash and this page's tokens), so equal prefixes map to equal
pages and are shared by refcount. A freed page keeps its hash until it is reused, which is what
makes a later request with the same prefix a hit.
"""
from collections import OrderedDict, deque

import numpy as np
import torch
import xxhash


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

    def layer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer_id], self.v[layer_id]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    @staticmethod
    def bytes_per_page(num_layers, page_size, num_kv_heads, head_dim, dtype) -> int:
        return 2 * num_layers * page_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


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

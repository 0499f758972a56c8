"""A KV tier in host memory: paged K/V tensors in pinned RAM and a free-list of their pages.

Pages have the device pool's layout per layer ([num_layers, num_pages * page_size, H_kv, D]), so a
page is one contiguous run of page_size * H_kv * D values in each layer and a copy between the tiers
is a plain row copy. On a GPU machine the memory is pinned: DMA copies need it, and a Triton kernel
reads and writes it directly through its pointer (unified virtual addressing). Any method that
offloads KV can own one (HiSparse keeps every page here; OmniKV's offload option could too).
"""
import weakref
from collections import deque

import torch

from sparsevllm.engine.kv_pool import FP8, bytes_per_token_head

GiB = 1 << 30


def mem_available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (None where there is no such file)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_host_memory(knob: str, gib: float) -> None:
    """Raise ValueError naming the knob if gib GiB cannot be taken from the machine's free RAM."""
    avail = mem_available_bytes()
    if avail is not None and gib * GiB > avail:
        raise ValueError(f"{knob}={gib} GiB does not fit the host's available memory "
                         f"({avail / GiB:.1f} GiB MemAvailable); valid: a positive number below that")


def pin_in_place(t: torch.Tensor) -> None:
    """Page-lock t's memory and map it for the GPU. torch's pin_memory allocator rounds a request up
    to a power of two (a 100 GiB pool would take 128); registering an ordinary allocation takes
    exactly its size. Mapped + portable: every device reads it through the same pointer."""
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(t.data_ptr(), t.nbytes, 3)   # cudaHostRegisterPortable | Mapped
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {t.nbytes / GiB:.1f} GiB failed ({err}); lower the host pool size")


def unpin(ptrs: list[int]) -> None:
    for ptr in ptrs:
        torch.cuda.cudart().cudaHostUnregister(ptr)


class HostPool:
    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, pin: bool):
        self.num_pages, self.page_size = num_pages, page_size
        shape = (num_layers, num_pages * page_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype)
        self.v = torch.zeros(shape, dtype=dtype)
        # FP8: each token's K and V scales per KV head travel with it (engine/kv_pool.py)
        self.k_scale = torch.ones(shape[:3]) if dtype == FP8 else None
        self.v_scale = torch.ones(shape[:3]) if dtype == FP8 else None
        self._tensors = [t for t in (self.k, self.v, self.k_scale, self.v_scale) if t is not None]
        if pin:
            for t in self._tensors:
                pin_in_place(t)
            # Unregister when the pool dies, before its tensors free the memory.
            weakref.finalize(self, unpin, [t.data_ptr() for t in self._tensors])
        self.free_pages: deque[int] = deque(range(num_pages))

    @staticmethod
    def bytes_per_page(num_layers, page_size, num_kv_heads, head_dim, dtype) -> int:
        return 2 * num_layers * page_size * num_kv_heads * bytes_per_token_head(head_dim, dtype)

    def layer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer_id], self.v[layer_id]

    def scales(self, layer_id: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The layer's K and V scales [num_slots, H_kv] of an FP8 pool; (None, None) otherwise."""
        if self.k_scale is None:
            return None, None
        return self.k_scale[layer_id], self.v_scale[layer_id]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self._tensors)

    @property
    def num_free(self) -> int:
        return len(self.free_pages)

    def allocate(self, n: int) -> list[int]:
        assert n <= len(self.free_pages), "host pool exhausted (admission should have waited)"
        return [self.free_pages.popleft() for _ in range(n)]

    def release(self, pages: list[int]) -> None:
        self.free_pages.extend(pages)

    def is_idle(self) -> bool:
        return len(self.free_pages) == self.num_pages

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
        if pin:
            for t in (self.k, self.v):
                pin_in_place(t)
            # Unregister when the pool dies, before its tensors free the memory.
            weakref.finalize(self, unpin, [self.k.data_ptr(), self.v.data_ptr()])
        self.free_pages: deque[int] = deque(range(num_pages))

    @staticmethod
    def bytes_per_page(num_layers, page_size, num_kv_heads, head_dim, dtype) -> int:
        return 2 * num_layers * page_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def layer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer_id], self.v[layer_id]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

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

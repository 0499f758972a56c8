"""Pinned host memory for what crosses to the device on the step path, so no copy waits for it.

A step's inputs (token ids, positions, slots, block tables, ...) are written on the host into one
buffer and cross to the device in one copy. From pageable memory that copy is staged by the
driver and blocks the host; from pinned memory it is a plain DMA the host does not wait for, so
the next graph launch follows sooner. Buffers are reused in a ring, and a buffer is written again
only after the copy that last read it has finished (its event), so nothing in flight is
overwritten even when the host runs ahead of the device.
"""
import numpy as np
import torch


class HostStaging:
    def __init__(self, device: torch.device, ring: int = 4):
        self.device = device
        self.pinned = device.type == "cuda"
        self.buffers: list[torch.Tensor | None] = [None] * ring
        self.events: list[torch.cuda.Event | None] = [None] * ring
        self.next = 0

    def host(self, nbytes: int) -> np.ndarray:
        """A writable uint8 array of nbytes for the next upload (8-byte aligned)."""
        if not self.pinned:
            return np.empty(nbytes, dtype=np.uint8)
        i = self.next
        if self.events[i] is not None:
            self.events[i].synchronize()
        if self.buffers[i] is None or self.buffers[i].numel() < nbytes:
            self.buffers[i] = torch.empty(max(nbytes, 1 << 16), dtype=torch.uint8, pin_memory=True)
        return self.buffers[i][:nbytes].numpy()

    def upload(self, host: np.ndarray) -> torch.Tensor:
        """The array from `host()` as a uint8 device tensor (CPU: the same memory)."""
        if not self.pinned:
            return torch.from_numpy(host)
        i = self.next
        self.next = (i + 1) % len(self.buffers)
        dev = self.buffers[i][:host.nbytes].to(self.device, non_blocking=True)
        self.events[i] = torch.cuda.Event()
        self.events[i].record()
        return dev


def to_device(values, device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A small host list or array as a device tensor without waiting for the device: a plain copy
    from pageable memory synchronises the stream, which would stall overlapped scheduling. (The
    pinned buffer comes from torch's caching host allocator, which keeps it until the copy is done.)"""
    t = torch.as_tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)

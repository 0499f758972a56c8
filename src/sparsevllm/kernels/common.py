"""What every kernel module shares: the optional Triton import and the dispatch rule.

Triton is optional (CPU installs may lack it). Without it, `jit` leaves the kernel as a plain
function that is never called and `tl.constexpr` still resolves, so the modules import and the
dispatchers fall back to the torch references.
"""
import os
import types

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None
    tl = types.SimpleNamespace(constexpr=int)
    jit = lambda fn: fn  # noqa: E731
else:
    jit = triton.jit


def use_triton(x: torch.Tensor) -> bool:
    """CUDA tensors go to the Triton kernels, everything else to the references."""
    return triton is not None and x.is_cuda


def upcast_loads(dtype: torch.dtype) -> bool:
    """Whether kernels cast half-precision loads to fp32 before tl.dot.

    Triton's interpreter computes bf16/fp16 math wrongly, so under TRITON_INTERPRET every load is
    widened; on the GPU half inputs go to the tensor cores as they are (fp32 accumulation).
    """
    return os.environ.get("TRITON_INTERPRET") == "1" or dtype == torch.float32


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs would silently drop to tf32 on tensor cores; keep them exact like the reference.
    return "ieee" if dtype == torch.float32 else "tf32"


def pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()

"""What every kernel module shares: the optional Triton import and the dispatch rule.

Triton is optional (CPU installs may lack it). Without it, `jit` leaves the kernel as a plain
function that is never called and `tl.constexpr` still resolves, so the modules import and the
dispatchers fall back to the torch references.
"""
import functools
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
    gdc_wait = gdc_launch_dependents = prefetch_l2 = None
else:
    jit = triton.jit
    try:
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    except ImportError:   # an older Triton: pdl() says no
        gdc_wait = gdc_launch_dependents = None

    @jit
    def prefetch_l2(ptrs):
        """Ask L2 for the lines at `ptrs` (one pointer a 128-byte line is enough); nothing returned."""
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1)


# FP8 KV cache (engine/kv_pool.py): float8_e4m3fn's largest finite value. A stored token's K (V) of
# one KV head is x / scale with scale = amax(|x|) / FP8_MAX over its D channels (1 for a zero vector).
FP8_MAX = 448.0


def quantize_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [..., D] -> (x / scale in float8_e4m3fn, scale [...] fp32), one scale per vector."""
    amax = x.float().abs().amax(-1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (x.float() / scale.unsqueeze(-1)).to(torch.float8_e4m3fn), scale


def use_triton(x: torch.Tensor) -> bool:
    """CUDA tensors go to the Triton kernels, everything else to the references."""
    return triton is not None and x.is_cuda


def pdl() -> bool:
    """Whether kernels launch as programmatic dependent launches (griddepcontrol, Hopper and newer):
    a kernel starts while the one before drains and waits for its output in `gdc_wait`. Not under
    the interpreter (no PTX there), not where Triton lacks it, not where the device predates sm_90,
    not with SPARSEVLLM_PDL=0 (to measure what it brings)."""
    return os.environ.get("TRITON_INTERPRET") != "1" and _pdl_device()


@functools.cache
def _pdl_device() -> bool:
    return (gdc_wait is not None and os.environ.get("SPARSEVLLM_PDL", "1") != "0" and torch.cuda.is_available()
            and torch.cuda.get_device_capability()[0] >= 9)


def sm_count(device: torch.device) -> int | None:
    """The device's SM count (cached); None off CUDA, where each caller picks its own stand-in."""
    if device.type != "cuda":
        return None
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


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

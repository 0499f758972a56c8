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
    gdc_wait = gdc_launch_dependents = prefetch_l2 = e4m3_tile = None
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

    @jit
    def _e4m3_byte(w, shift: tl.constexpr):
        """Byte `shift / 8` of each int32 word as an e4m3 value widened to fp16 (exact)."""
        return ((w >> shift) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)

    @jit
    def e4m3_tile(ptr, slot, kvh, stride_s, stride_h, tok_ok, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_D: tl.constexpr, ASM: tl.constexpr):
        """The [BLOCK_N, BLOCK_D] fp16 tile of an e4m3 cache's tokens `slot` (KV head kvh), read as int32
        words and widened in registers (exact): an FP8 dot operand then takes a 16-bit one's path through
        shared memory (decode_attention's FP8_V_WORDS says why). ASM: two native converts a word
        (cvt.rn.f16x2.e4m3x2); the interpreter, which runs no PTX, takes the same values byte by byte."""
        words = tl.arange(0, BLOCK_D // 4)
        w = tl.load(ptr.to(tl.pointer_type(tl.int32)) + slot[:, None] * (stride_s // 4) + kvh * (stride_h // 4)
                    + words[None, :], mask=tok_ok[:, None] & (words[None, :] < HEAD_DIM // 4), other=0)
        if ASM:
            b0, b1, b2, b3 = tl.inline_asm_elementwise(
                asm="""{ .reg .b16 lo, hi; .reg .b32 a, b;
                mov.b32 {lo, hi}, $4;
                cvt.rn.f16x2.e4m3x2 a, lo;
                cvt.rn.f16x2.e4m3x2 b, hi;
                mov.b32 {$0, $1}, a;
                mov.b32 {$2, $3}, b; }""",
                constraints="=h,=h,=h,=h,r", args=[w], dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
                is_pure=True, pack=1)
        else:
            b0 = _e4m3_byte(w, 0)
            b1 = _e4m3_byte(w, 8)
            b2 = _e4m3_byte(w, 16)
            b3 = _e4m3_byte(w, 24)
        # byte i of word j is element 4 j + i: join's new axis is the last, so (b0, b2) and (b1, b3) pair up
        return tl.reshape(tl.join(tl.join(b0, b2), tl.join(b1, b3)), (BLOCK_N, BLOCK_D))


# FP8 KV cache (engine/kv_pool.py): float8_e4m3fn's largest finite value. A stored token's K (V) of
# one KV head is x / scale with scale = amax(|x|) / FP8_MAX over its D channels (1 for a zero vector).
FP8_MAX = 448.0


def quantize_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [..., D] -> (x / scale in float8_e4m3fn, scale [...] fp32), one scale per vector."""
    amax = x.float().abs().amax(-1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (x.float() / scale.unsqueeze(-1)).to(torch.float8_e4m3fn), scale


def word_aligned(cache: torch.Tensor) -> bool:
    """Whether a [slots, H_kv, D] cache reads as int32 words (e4m3_tile): strides and base a multiple of 4."""
    return cache.stride(0) % 4 == 0 and cache.stride(1) % 4 == 0 and cache.data_ptr() % 4 == 0


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

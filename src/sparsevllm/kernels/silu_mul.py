"""SiLU(gate) * up over a packed [gate | up] projection.

The Triton kernel reads each half once and writes the product, where the reference materialises
silu(gate) in between.
"""
import torch
import torch.nn.functional as F

from sparsevllm.kernels.common import jit, tl, use_triton

BLOCK = 1024


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2I] -> [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


@jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, I: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    gate = tl.load(x_ptr + t * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + t * stride_x + I + cols, mask=mask, other=0.0).to(tl.float32)
    # Round silu(gate) to the input dtype before the product, like F.silu(gate) * up.
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + t * stride_o + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """Same contract as silu_and_mul_ref."""
    I = x.shape[-1] // 2
    assert x.stride(-1) == 1
    x2 = x.reshape(-1, 2 * I)
    out = torch.empty(x2.shape[0], I, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        _silu_and_mul_kernel[(x2.shape[0], -(-I // BLOCK))](
            x2, out, x2.stride(0), out.stride(0), I=I, BLOCK=BLOCK, num_warps=4)
    return out.view(*x.shape[:-1], I)


def silu_and_mul(x):
    if use_triton(x):
        return silu_and_mul_triton(x)
    return silu_and_mul_ref(x)

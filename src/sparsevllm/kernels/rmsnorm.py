"""RMSNorm, optionally fused with the residual add that precedes it.

The Triton kernel does the add, the statistics and the scaling in one pass over each row (one
program per token), where the reference reads the row three times.
"""
import torch

from sparsevllm.kernels.common import gdc_launch_dependents, gdc_wait, jit, pdl, pow2, tl, use_triton


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None):
    """x: [T, H]. With residual: x += residual first and return (normed, x) like HF decoder layers."""
    if residual is not None:
        x = x + residual
        residual = x
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(x.dtype)
    return out if residual is None else (out, residual)


@jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, eps,
                     stride_x, stride_r, stride_o, stride_ro,
                     H: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, PDL: tl.constexpr):
    if PDL:   # see common.pdl: let the next kernel start, wait for the one before (on decode: GEMMs)
        gdc_launch_dependents()
        gdc_wait()
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(x_ptr + t * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # The sum is rounded to x's dtype before the statistics, as the reference does.
        x = (x.to(tl.float32) + tl.load(res_ptr + t * stride_r + cols, mask=mask, other=0.0)
             .to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + t * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / H + eps)
    normed = (xf * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_o + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    residual: torch.Tensor | None = None):
    """Same contract as rms_norm_ref."""
    H = x.shape[-1]
    assert x.stride(-1) == 1 and weight.is_contiguous()
    x2 = x.reshape(-1, H)
    out = torch.empty(x2.shape, dtype=torch.result_type(weight, x), device=x.device)
    if residual is not None:
        r2 = residual.reshape(-1, H)
        res_out = torch.empty(x2.shape, dtype=torch.result_type(x, residual), device=x.device)
        assert res_out.dtype == x.dtype, "residual must not promote x's dtype"
    else:
        r2 = res_out = x2   # unused
    on = pdl()
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, r2, weight, out, res_out, eps,
            x2.stride(0), r2.stride(0), out.stride(0), res_out.stride(0),
            H=H, BLOCK=pow2(H), HAS_RESIDUAL=residual is not None, PDL=on,
            num_warps=4 if H <= 2048 else 8, **({"launch_pdl": True} if on else {}))
    out = out.view(x.shape)
    return out if residual is None else (out, res_out.view(x.shape))


def rms_norm(x, weight, eps, residual=None):
    if use_triton(x):
        return rms_norm_triton(x, weight, eps, residual)
    return rms_norm_ref(x, weight, eps, residual)

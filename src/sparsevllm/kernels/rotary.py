"""Rotary position embedding (neox / HF rotate_half layout).

The Triton kernel rotates q and k of one token in one program (a single launch for both), reading
the token's cos/sin row once.
"""
import torch

from sparsevllm.kernels.common import jit, pow2, tl, use_triton


def apply_rope_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                   cos_sin_cache: torch.Tensor):
    """q: [T, H_q, D], k: [T, H_kv, D], positions: [T] int, cos_sin_cache: [max_pos, D] fp32
    (first D/2 columns cos, last D/2 sin). Returns new (q, k) in their dtypes."""
    cos, sin = cos_sin_cache[positions.long()].unsqueeze(1).chunk(2, dim=-1)

    def rotate(x):
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    return rotate(q), rotate(k)


@jit
def _rotate(x_ptr, o_ptr, t, stride_t, stride_h, stride_ot, stride_oh, cos, sin,
            H: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < H) & (cols < HALF)
    src = x_ptr + t * stride_t + heads * stride_h + cols
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dst = o_ptr + t * stride_ot + heads * stride_oh + cols
    tl.store(dst, (x1 * cos - x2 * sin).to(o_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(o_ptr.dtype.element_ty), mask=mask)


@jit
def _rope_kernel(q_ptr, k_ptr, qo_ptr, ko_ptr, pos_ptr, cache_ptr,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh,
                 stride_kot, stride_koh, stride_c,
                 HQ: tl.constexpr, HK: tl.constexpr, HALF: tl.constexpr,
                 BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    cmask = cols < HALF
    cos = tl.load(cache_ptr + pos * stride_c + cols, mask=cmask, other=0.0).to(tl.float32)
    sin = tl.load(cache_ptr + pos * stride_c + HALF + cols, mask=cmask, other=0.0).to(tl.float32)
    _rotate(q_ptr, qo_ptr, t, stride_qt, stride_qh, stride_qot, stride_qoh, cos, sin,
            HQ, HALF, BLOCK_HQ, BLOCK_HALF)
    _rotate(k_ptr, ko_ptr, t, stride_kt, stride_kh, stride_kot, stride_koh, cos, sin,
            HK, HALF, BLOCK_HK, BLOCK_HALF)


def apply_rope_triton(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                      cos_sin_cache: torch.Tensor):
    """Same contract as apply_rope_ref (out of place)."""
    T, HQ, D = q.shape
    HK = k.shape[1]
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos_sin_cache.stride(-1) == 1
    assert D % 2 == 0 and cos_sin_cache.shape[-1] == D
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    if T:
        _rope_kernel[(T,)](
            q, k, q_out, k_out, positions, cos_sin_cache,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
            cos_sin_cache.stride(0),
            HQ=HQ, HK=HK, HALF=D // 2, BLOCK_HQ=pow2(HQ), BLOCK_HK=pow2(HK),
            BLOCK_HALF=pow2(D // 2), num_warps=4)
    return q_out, k_out


def apply_rope(q, k, positions, cos_sin_cache):
    if use_triton(q):
        return apply_rope_triton(q, k, positions, cos_sin_cache)
    return apply_rope_ref(q, k, positions, cos_sin_cache)

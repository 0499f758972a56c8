"""RoPE and the KV-cache write in one kernel (neox / HF rotate_half layout).

Every token's q and k are rotated to its position and its k (after RoPE) and v are written to
the pool slot its slot_mapping names (-1: padding, written nowhere). One program per token reads
the token's cos/sin row once and does all of it: a separate RoPE launch and store launch per layer
cost more than their arithmetic on the decode path.

Optionally (kmin/kmax given) the write also keeps the per-page key bounds that page scoring reads
(kernels/page_bounds.py): the page of the slot gets the channel-wise min/max of its keys, reset by
the page's first slot. This is exact only when no two tokens of the step write the same page, which
holds in decode (one token per request, requests never share a page they write); prefill chunks
recompute their pages instead.

An FP8 cache (k_scale / v_scale given, [num_slots, H_kv] fp32) stores each token's K (after RoPE)
and V of each KV head as x / scale in float8_e4m3fn with scale = amax(|x|) / 448 over its D
channels, and the scale beside it (common.quantize_ref). The page bounds then fold the dequantized
key, the one attention reads.
"""
import torch

from sparsevllm.kernels.common import jit, pow2, quantize_ref, tl, use_triton


def rope_store_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                   cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, kmin: torch.Tensor | None = None,
                   kmax: torch.Tensor | None = None, page_size: int = 1,
                   k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None):
    """q: [T, H_q, D], k, v: [T, H_kv, D] (before RoPE); positions, slot_mapping: [T] int;
    cos_sin_cache: [max_pos, D] fp32 (first D/2 columns cos, last D/2 sin); k_cache, v_cache:
    [num_slots, H_kv, D]; kmin, kmax: [num_pages, H_kv, D] or None; k_scale, v_scale: [num_slots,
    H_kv] fp32 for an FP8 cache, else None. Returns (q, k) after RoPE."""
    cos, sin = cos_sin_cache[positions.long()].unsqueeze(1).chunk(2, dim=-1)

    def rotate(x):
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    q, k = rotate(q), rotate(k)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    if k_scale is not None:
        k_cache[slots], k_scale[slots] = quantize_ref(k[keep])
        v_cache[slots], v_scale[slots] = quantize_ref(v[keep])
        new_k = k_cache[slots].float() * k_scale[slots].unsqueeze(-1)
    else:
        new_k = k[keep].to(k_cache.dtype)
        k_cache[slots] = new_k
        v_cache[slots] = v[keep].to(v_cache.dtype)
    if kmin is not None:
        pages, first = slots // page_size, (slots % page_size == 0).view(-1, 1, 1)
        new_k = new_k.to(kmin.dtype)
        kmin[pages] = torch.where(first, new_k, torch.minimum(kmin[pages], new_k))
        kmax[pages] = torch.where(first, new_k, torch.maximum(kmax[pages], new_k))
    return q, k


@jit
def _rotate_halves(x_ptr, t, stride_t, stride_h, cos, sin,
                   H: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < H) & (cols < HALF)
    src = x_ptr + t * stride_t + heads * stride_h + cols
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    # Explicit fmas, the product with sin rounded and the one with cos fused: the page-scoring kernel's
    # fused store (kernels/page_bounds.py) rotates with the same two, so its stored q and k equal
    # these bit for bit.
    return tl.fma(x1, cos, -(x2 * sin)), tl.fma(x2, cos, x1 * sin), heads, cols, mask


@jit
def fold_bounds(mn, mx, k, first, mask):
    """Fold keys k into their page's channel-wise bounds at mn / mx (k itself at the page's first slot)."""
    if first:
        tl.store(mn, k, mask=mask)
        tl.store(mx, k, mask=mask)
    else:
        tl.store(mn, tl.minimum(tl.load(mn, mask=mask, other=0.0), k), mask=mask)
        tl.store(mx, tl.maximum(tl.load(mx, mask=mask, other=0.0), k), mask=mask)


@jit
def quantize_halves(lo, hi, mask):
    """A token's heads as two [heads, D/2] fp32 halves -> (lo / scale, hi / scale, scale [heads]):
    the FP8 cache's scale per head (common.quantize_ref)."""
    amax = tl.maximum(tl.max(tl.where(mask, tl.abs(lo), 0.0), 1), tl.max(tl.where(mask, tl.abs(hi), 0.0), 1))
    scale = tl.where(amax > 0, amax / 448.0, 1.0)   # common.FP8_MAX (a jit function reads no globals)
    return lo / scale[:, None], hi / scale[:, None], scale


@jit
def _rope_store_kernel(q_ptr, k_ptr, v_ptr, qo_ptr, ko_ptr, pos_ptr, cache_ptr, slot_ptr,
                       kc_ptr, vc_ptr, kmin_ptr, kmax_ptr, ks_ptr, vs_ptr, stride_ss,
                       stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                       stride_qot, stride_qoh, stride_kot, stride_koh, stride_c,
                       stride_kcs, stride_kch, stride_vcs, stride_vch, stride_mp, stride_mh,
                       HQ: tl.constexpr, HK: tl.constexpr, HALF: tl.constexpr, P: tl.constexpr,
                       BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
                       BOUNDS: tl.constexpr, SCALED: tl.constexpr = False):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    cmask = cols < HALF
    cos = tl.load(cache_ptr + pos * stride_c + cols, mask=cmask, other=0.0).to(tl.float32)
    sin = tl.load(cache_ptr + pos * stride_c + HALF + cols, mask=cmask, other=0.0).to(tl.float32)

    lo, hi, heads, cols, mask = _rotate_halves(q_ptr, t, stride_qt, stride_qh, cos, sin, HQ, HALF, BLOCK_HQ, BLOCK_HALF)
    dst = qo_ptr + t * stride_qot + heads * stride_qoh + cols
    tl.store(dst, lo.to(qo_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, hi.to(qo_ptr.dtype.element_ty), mask=mask)

    lo, hi, heads, cols, mask = _rotate_halves(k_ptr, t, stride_kt, stride_kh, cos, sin, HK, HALF, BLOCK_HK, BLOCK_HALF)
    dst = ko_ptr + t * stride_kot + heads * stride_koh + cols
    tl.store(dst, lo.to(ko_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, hi.to(ko_ptr.dtype.element_ty), mask=mask)

    slot = tl.load(slot_ptr + t).to(tl.int64)   # int64: slot * stride overflows int32 on big pools
    if slot >= 0:
        kdst = kc_ptr + slot * stride_kcs + heads * stride_kch + cols
        vsrc = v_ptr + t * stride_vt + heads * stride_vh + cols
        vdst = vc_ptr + slot * stride_vcs + heads * stride_vch + cols
        if SCALED:   # FP8: from k as returned (rounded to k's dtype), as the reference quantizes it
            hs = tl.arange(0, BLOCK_HK)
            lo_q, hi_q, ks = quantize_halves(lo.to(ko_ptr.dtype.element_ty).to(tl.float32),
                                             hi.to(ko_ptr.dtype.element_ty).to(tl.float32), mask)
            tl.store(ks_ptr + slot * stride_ss + hs, ks, mask=hs < HK)
            k_lo = lo_q.to(kc_ptr.dtype.element_ty)
            k_hi = hi_q.to(kc_ptr.dtype.element_ty)
            v_lo, v_hi, vs = quantize_halves(tl.load(vsrc, mask=mask, other=0.0).to(tl.float32),
                                             tl.load(vsrc + HALF, mask=mask, other=0.0).to(tl.float32), mask)
            tl.store(vs_ptr + slot * stride_ss + hs, vs, mask=hs < HK)
            tl.store(vdst, v_lo.to(vc_ptr.dtype.element_ty), mask=mask)
            tl.store(vdst + HALF, v_hi.to(vc_ptr.dtype.element_ty), mask=mask)
        else:
            k_lo = lo.to(kc_ptr.dtype.element_ty)
            k_hi = hi.to(kc_ptr.dtype.element_ty)
            tl.store(vdst, tl.load(vsrc, mask=mask, other=0.0).to(vc_ptr.dtype.element_ty), mask=mask)
            tl.store(vdst + HALF, tl.load(vsrc + HALF, mask=mask, other=0.0).to(vc_ptr.dtype.element_ty),
                     mask=mask)
        tl.store(kdst, k_lo, mask=mask)
        tl.store(kdst + HALF, k_hi, mask=mask)
        if BOUNDS:
            page = slot // P
            first = slot % P == 0
            mn = kmin_ptr + page * stride_mp + heads * stride_mh + cols
            mx = kmax_ptr + page * stride_mp + heads * stride_mh + cols
            if SCALED:   # the dequantized key: what attention reads
                k_lo = k_lo.to(tl.float32) * ks[:, None]
                k_hi = k_hi.to(tl.float32) * ks[:, None]
            fold_bounds(mn, mx, k_lo.to(kmin_ptr.dtype.element_ty), first, mask)
            fold_bounds(mn + HALF, mx + HALF, k_hi.to(kmin_ptr.dtype.element_ty), first, mask)


def rope_store_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                      cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, kmin: torch.Tensor | None = None,
                      kmax: torch.Tensor | None = None, page_size: int = 1,
                      k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None):
    """Same contract as rope_store_ref."""
    T, HQ, D = q.shape
    HK = k.shape[1]
    for x in (q, k, v, k_cache, v_cache, cos_sin_cache):
        assert x.stride(-1) == 1
    assert D % 2 == 0 and cos_sin_cache.shape[-1] == D and slot_mapping.shape == (T,)
    bounds = kmin is not None
    if bounds:
        assert kmax is not None and kmin.shape == kmax.shape and kmin.stride() == kmax.stride()
        assert kmin.shape[1:] == (HK, D) and (kmin.dtype == k_cache.dtype or k_scale is not None)
    scaled = k_scale is not None
    if scaled:
        assert v_scale is not None and k_scale.shape == v_scale.shape == (k_cache.shape[0], HK)
        assert k_scale.stride() == v_scale.stride() and k_scale.stride(1) == 1
    positions, slot_mapping = positions.contiguous(), slot_mapping.contiguous()   # read as ptr + t
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    if T:
        mn, mx = (kmin, kmax) if bounds else (k_cache, k_cache)   # unused without bounds
        _rope_store_kernel[(T,)](
            q, k, v, q_out, k_out, positions, cos_sin_cache, slot_mapping, k_cache, v_cache, mn, mx,
            k_scale if scaled else mn, v_scale if scaled else mn, k_scale.stride(0) if scaled else 0,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cos_sin_cache.stride(0),
            k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
            mn.stride(0), mn.stride(1),
            HQ=HQ, HK=HK, HALF=D // 2, P=int(page_size), BLOCK_HQ=pow2(HQ), BLOCK_HK=pow2(HK),
            BLOCK_HALF=pow2(D // 2), BOUNDS=bounds, SCALED=scaled, num_warps=4)
    return q_out, k_out


def rope_store(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, kmin=None, kmax=None,
               page_size=1, k_scale=None, v_scale=None):
    if use_triton(q):
        return rope_store_triton(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
                                 kmin, kmax, page_size, k_scale, v_scale)
    return rope_store_ref(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, kmin, kmax,
                          page_size, k_scale, v_scale)

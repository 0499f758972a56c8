"""DeltaKV's kernels: reading tokens back to the compressor's space, compressing a block, and
reconstructing the selected tokens into the scratch slots a sparse layer's decode attention reads.

The sparse layers' raw pool holds K after RoPE (prefill attention reads it as it is), while the
compressor works on x = [K before RoPE ; V]. So:
- gather_x(k_cache, v_cache, slots, positions, cos_sin_cache, dtype) -> x [n, 2 * H * D] (fp32 by
  default): rotates K back by its position (RoPE is a rotation: the inverse is exact up to rounding)
  and appends V.
- compress_block(x, refs, ref_pos, pos, neighbors, codec) -> (z, nbr): every token's `neighbors`
  nearest references at earlier positions by L2 (the causal rule of deltakv_compressor), their mean
  r, and z = down(x) - down(r), for a batch of requests at once. Torch (a batched GEMM for the
  distances + topk + the codec's GEMMs): it runs outside CUDA graphs, once per step in which some
  request's tokens age out, and cuBLAS does the heavy part.
- shortlist(x, refs, ref_sq, ref_pos, pos, size) -> each token's `size` best candidates by a bf16
  GEMM; compress_block then ranks just those exactly in fp32 (the GPU path: the fp32 GEMM against
  every reference was most of a decode step's compression).
- reconstruct(...): for every entry of a sparse layer's decode view, copies a raw token (sink,
  references, recent tokens) or rebuilds a compressed one as up(z) + mean of its references (each
  rotated back from the raw pool), then RoPE at its true position, into the scratch slots. up(z)
  itself is one GEMM before the kernel (up_of: a Triton GEMM that gathers the selected latents in
  its loads, then the rest of an mlp_gelu up in torch); the kernel does the reference gathers, the
  mean, the rotation and the writes, one program per view entry.
"""
import torch

from sparsevllm.kernels.common import dot_precision, jit, pow2, tl, upcast_loads, use_triton
from sparsevllm.kernels.decode_attention import dequant


def _cos_sin(cos_sin_cache: torch.Tensor, positions: torch.Tensor):
    return cos_sin_cache[positions.long()].float().unsqueeze(-2).chunk(2, dim=-1)


def _rotate(k: torch.Tensor, cos, sin, sign: float) -> torch.Tensor:
    """RoPE (sign 1) or its inverse (sign -1), neox / rotate_half layout, fp32."""
    k1, k2 = k.float().chunk(2, dim=-1)
    return torch.cat((k1 * cos - sign * k2 * sin, k2 * cos + sign * k1 * sin), dim=-1)


# ---------------------------------------------------------------- gather_x

def gather_x_ref(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                 cos_sin_cache: torch.Tensor, dtype: torch.dtype = torch.float32, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """k_cache, v_cache: [num_slots, H, D] (K after RoPE); slots, positions: [n] int ->
    x: [n, 2 * H * D] = [K before RoPE ; V], heads flattened, computed in fp32 and stored as dtype.
    k_scale, v_scale: [num_slots, H] fp32 of an FP8 raw pool (dequantized as read), else None."""
    cos, sin = _cos_sin(cos_sin_cache, positions)
    k = _rotate(dequant(k_cache, k_scale, (slots.long(),)), cos, sin, -1.0)
    v = dequant(v_cache, v_scale, (slots.long(),))
    return torch.cat([k.flatten(1), v.flatten(1)], dim=-1).to(dtype)


@jit
def _gather_x_kernel(kc_ptr, vc_ptr, slot_ptr, pos_ptr, cache_ptr, out_ptr, ks_ptr, vs_ptr, stride_ss,
                     stride_ks, stride_kh, stride_vs, stride_vh, stride_c, stride_o,
                     H: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, SCALED: tl.constexpr = False):
    i = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + i).to(tl.int64)     # int64 before the stride product: big pools
    pos = tl.load(pos_ptr + i).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < H) & (cols < HALF)
    cos = tl.load(cache_ptr + pos * stride_c + cols, mask=cols < HALF, other=0.0).to(tl.float32)
    sin = tl.load(cache_ptr + pos * stride_c + HALF + cols, mask=cols < HALF, other=0.0).to(tl.float32)
    src = kc_ptr + slot * stride_ks + heads * stride_kh + cols
    k1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    k2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    vsrc = vc_ptr + slot * stride_vs + heads * stride_vh + cols
    v1 = tl.load(vsrc, mask=mask, other=0.0).to(tl.float32)
    v2 = tl.load(vsrc + HALF, mask=mask, other=0.0).to(tl.float32)
    if SCALED:   # an FP8 raw pool: each head's scale
        ks = tl.load(ks_ptr + slot * stride_ss + heads, mask=heads < H, other=0.0)
        vs = tl.load(vs_ptr + slot * stride_ss + heads, mask=heads < H, other=0.0)
        k1, k2, v1, v2 = k1 * ks, k2 * ks, v1 * vs, v2 * vs
    dst = out_ptr + i * stride_o + heads * D + cols
    ty = out_ptr.dtype.element_ty
    tl.store(dst, (k1 * cos + k2 * sin).to(ty), mask=mask)
    tl.store(dst + HALF, (k2 * cos - k1 * sin).to(ty), mask=mask)
    vdst = dst + H * D
    tl.store(vdst, v1.to(ty), mask=mask)
    tl.store(vdst + HALF, v2.to(ty), mask=mask)


def gather_x_triton(k_cache, v_cache, slots, positions, cos_sin_cache, dtype=torch.float32, k_scale=None,
                    v_scale=None):
    """Same contract as gather_x_ref; one program per token."""
    n, (_, H, D) = slots.shape[0], k_cache.shape
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1 and cos_sin_cache.stride(-1) == 1
    assert positions.shape == (n,) and D % 2 == 0
    slots, positions = slots.contiguous(), positions.contiguous()   # read as ptr + i
    out = torch.empty(n, 2 * H * D, dtype=dtype, device=k_cache.device)
    scaled = k_scale is not None
    assert not scaled or (k_scale.stride() == v_scale.stride() and k_scale.stride(1) == 1)
    if n:
        _gather_x_kernel[(n,)](k_cache, v_cache, slots, positions, cos_sin_cache, out,
                               *((k_scale, v_scale, k_scale.stride(0)) if scaled else (out, out, 0)),
                               k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
                               cos_sin_cache.stride(0), out.stride(0), H=H, D=D, HALF=D // 2,
                               BLOCK_H=pow2(H), BLOCK_HALF=pow2(D // 2), SCALED=scaled, num_warps=4)
    return out


def gather_x(k_cache, v_cache, slots, positions, cos_sin_cache, dtype=torch.float32, k_scale=None, v_scale=None):
    if use_triton(k_cache):
        return gather_x_triton(k_cache, v_cache, slots, positions, cos_sin_cache, dtype, k_scale, v_scale)
    return gather_x_ref(k_cache, v_cache, slots, positions, cos_sin_cache, dtype, k_scale, v_scale)


# ---------------------------------------------------------------- compress

def shortlist(x: torch.Tensor, refs: torch.Tensor, ref_sq: torch.Tensor, ref_pos: torch.Tensor, pos: torch.Tensor,
              size: int) -> torch.Tensor:
    """x: [B, n, F] tokens at pos [B, n]; refs: [B, R, F] (bf16 on the GPU) at ref_pos [B, R] with
    ref_sq [B, R] fp32 their squared norms -> [B, n, min(size, R)] indices into refs: each token's
    `size` nearest by ||r||^2 - 2 x.r in refs' dtype (the GEMM at bf16 rate), references at or after
    the token last. compress_block ranks the shortlist exactly; a true neighbour misses it only if
    bf16 rounding moves `size` others past it, far more than the distances' usual gaps."""
    dots = torch.bmm(x.to(refs.dtype), refs.transpose(1, 2)).float()
    score = (ref_sq.unsqueeze(1) - 2.0 * dots).masked_fill(ref_pos.long().unsqueeze(1) >= pos.long().unsqueeze(2),
                                                            float("inf"))
    return score.topk(min(size, refs.shape[1]), dim=-1, largest=False).indices


def compress_block(x: torch.Tensor, refs: torch.Tensor, ref_pos: torch.Tensor, pos: torch.Tensor,
                   neighbors: int, codec, chunk: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [B, n, F] fp32 tokens at positions pos [B, n]; refs: [B, R, F] fp32 at ref_pos [B, R],
    shared by the request's tokens, or [B, n, L, F] at [B, n, L], each token's own candidates (a
    shortlist) -> (z [B, n, latent] fp32, nbr [B, n, neighbors] int32: the references' positions,
    -1 where fewer than `neighbors` lie before the token). B requests compressed together (one
    batched GEMM a layer, not one per request); a single request may drop the B axis. Only
    references strictly before a token count (causal), so padding is free: a padding reference at a
    position after every token is never chosen, a padding token at position -1 chooses none. Chunks
    of `chunk` tokens bound the [B, n, R] score matrix (128K x 12.8K would not fit)."""
    if x.dim() == 2:
        z, nbr = compress_block(x[None], refs[None], ref_pos[None], pos[None], neighbors, codec, chunk)
        return z[0], nbr[0]
    per_token = refs.dim() == 4
    B, F = x.shape[0], x.shape[-1]
    zs, nbrs = [], []
    k = min(neighbors, refs.shape[-2])
    if not per_token:
        # L2 order without torch.cdist: ||x - r||^2 = ||x||^2 + ||r||^2 - 2 x.r, and ||x||^2 is the
        # same for every reference of a token, so ||r||^2 - 2 x.r orders them alike. cdist pads the
        # GEMM's K to F + 2, which sent a 128K x 4 decode compression on the H200 to a slow fp32 kernel.
        ref_sq = torch.linalg.vector_norm(refs, dim=-1).square().unsqueeze(1)    # [B, 1, R], no [B, R, F] temporary
    for s in range(0, x.shape[1], chunk):
        xc, pc = x[:, s:s + chunk], pos[:, s:s + chunk].long()
        c = xc.shape[1]
        if per_token:   # a few candidates a token: the same order, one small GEMM per token
            rc, rp = refs[:, s:s + chunk], ref_pos[:, s:s + chunk].long()
            L = rc.shape[2]
            c_sq = torch.linalg.vector_norm(rc, dim=-1).square().view(B * c, 1, L)
            score = torch.baddbmm(c_sq, xc.reshape(B * c, 1, F), rc.reshape(B * c, L, F).transpose(1, 2),
                                  alpha=-2.0).view(B, c, L)
        else:
            rc, rp = refs.unsqueeze(1).expand(B, c, -1, F), ref_pos.long().unsqueeze(1).expand(B, c, -1)
            score = torch.baddbmm(ref_sq, xc, refs.transpose(1, 2), alpha=-2.0)     # [B, c, R]
        score = score.masked_fill(rp >= pc.unsqueeze(2), float("inf"))
        d, idx = score.topk(k, dim=-1, largest=False)                           # [B, c, k]
        ok = torch.isfinite(d)
        picked = torch.gather(rc, 2, idx.unsqueeze(-1).expand(-1, -1, -1, F))   # [B, c, k, F]
        r = (picked * ok.unsqueeze(-1)).sum(2) / ok.sum(2, keepdim=True).clamp(min=1)
        with torch.no_grad():
            dt = _param_dtype(codec)
            zs.append(codec.encode(xc.to(dt), r.to(dt)).float())
        nbr = torch.where(ok, torch.gather(rp, 2, idx), -1).to(torch.int32)
        if k < neighbors:
            nbr = torch.cat([nbr, nbr.new_full((*nbr.shape[:2], neighbors - k), -1)], dim=-1)
        nbrs.append(nbr)
    return torch.cat(zs, 1), torch.cat(nbrs, 1)


def _param_dtype(module) -> torch.dtype:
    return next(module.parameters()).dtype


# ---------------------------------------------------------------- up(z) of gathered latents

def gather_linear_ref(x: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor,
                      bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x[rows], weight, bias): x [n, K], rows int [...], weight [N, K] -> [..., N]."""
    return torch.nn.functional.linear(x[rows.long()], weight, bias)


@jit
def _gather_linear_kernel(x_ptr, row_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_x, stride_w, stride_o,
                          HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.load(row_ptr + m, mask=m < M, other=0).to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(x_ptr + rows[:, None] * stride_x + k[None, :], mask=(m[:, None] < M) & (k[None, :] < K),
                    other=0.0)
        w = tl.load(w_ptr + n[None, :].to(tl.int64) * stride_w + k[:, None], mask=(n[None, :] < N) & (k[:, None] < K),
                    other=0.0)
        if UPCAST:   # the interpreter's half math is wrong; fp32 stays fp32 (no tf32)
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=DOT_PREC)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
    dst = out_ptr + m[:, None].to(tl.int64) * stride_o + n[None, :]
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=(m[:, None] < M) & (n[None, :] < N))


GATHER_LINEAR_BLOCKS = (128, 128, 64, 4)   # BLOCK_M, BLOCK_N, BLOCK_K, warps


def gather_linear_triton(x, rows, weight, bias):
    """Same contract as gather_linear_ref; the gather happens in the GEMM's A loads (no gathered
    copy of x written and read back). up(z) is narrow in K (the latent dim) and wide in N, so its
    cost is writing the output: one pass, tiles of BLOCK_M x BLOCK_N."""
    K, N = x.shape[1], weight.shape[0]
    assert x.stride(-1) == 1 and weight.stride(-1) == 1 and weight.shape[1] == K
    flat = rows.reshape(-1).contiguous()
    out = torch.empty(flat.numel(), N, dtype=x.dtype, device=x.device)
    BM, BN, BK, warps = GATHER_LINEAR_BLOCKS
    if flat.numel():
        _gather_linear_kernel[(-(-N // BN), -(-flat.numel() // BM))](
            x, flat, weight, bias if bias is not None else weight, out, flat.numel(), N, K, x.stride(0),
            weight.stride(0), out.stride(0), HAS_BIAS=bias is not None,
            UPCAST=upcast_loads(x.dtype), DOT_PREC=dot_precision(x.dtype), BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, num_warps=warps)
    return out.view(*rows.shape, N)


def gather_linear(x, rows, weight, bias):
    impl = gather_linear_triton if use_triton(x) else gather_linear_ref
    return impl(x, rows, weight, bias)


def up_of(up: torch.nn.Module, latents: torch.Tensor, latent_slots: torch.Tensor) -> torch.Tensor:
    """up(latents[latent_slots]) with the gather inside the first linear's kernel: `up` is a Linear
    or a Sequential starting with one (the compressor's `linear` and `mlp_gelu`)."""
    if isinstance(up, torch.nn.Sequential):
        return up[1:](gather_linear(latents, latent_slots, up[0].weight, up[0].bias))
    return gather_linear(latents, latent_slots, up.weight, up.bias)


# ---------------------------------------------------------------- reconstruct

def reconstruct_ref(view_pos: torch.Tensor, lengths: torch.Tensor, rows: torch.Tensor, raw_map: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, up_z: torch.Tensor, neighbors: torch.Tensor,
                    latent_slots: torch.Tensor, head: int, cos_sin_cache: torch.Tensor, out_k: torch.Tensor,
                    out_v: torch.Tensor, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None) -> None:
    """Fill the scratch slots of a sparse layer's decode view.

    view_pos: [B, C] positions (entry j of request b is scratch slot b * C + j); lengths: [B];
    rows: [B] the requests' rows of raw_map ([rows, max_len] int32: raw slot of a position, -1 when
    compressed); k_cache, v_cache: the layer's raw pool [num_slots, H, D], K after RoPE; up_z:
    [B, S, 2 * H * D] = up(z) of the selected tokens, entry j >= head using up_z[b, j - head];
    neighbors: [slots, k] every token's references' positions (-1: none), latent_slots [B, S] the
    selected tokens' rows there (entry j >= head: latent_slots[b, j - head]); out_k, out_v:
    [B * C, H, D]. Raw positions are copied; compressed ones become up(z) + mean of their references
    (rotated back to before RoPE), K rotated to the true position. Entries past lengths[b] are left
    alone. k_scale, v_scale: [num_slots, H] fp32 of an FP8 raw pool, else None: raw tokens and
    references are dequantized as they are read; the scratch is in out_k's dtype."""
    B, C = view_pos.shape
    H, D = k_cache.shape[1:]
    S = up_z.shape[1]
    j = torch.arange(C, device=view_pos.device)
    live = j.view(1, C) < lengths.long().view(B, 1)
    pos = view_pos.long().clamp(0, min(raw_map.shape[1], cos_sin_cache.shape[0]) - 1)   # padding entries
    slot = raw_map[rows.long().view(B, 1), pos].long()                                # [B, C]
    dest = torch.arange(B, device=view_pos.device).view(B, 1) * C + j.view(1, C)
    raw = live & (slot >= 0)
    out_k[dest[raw]] = dequant(k_cache, k_scale, (slot[raw],)).to(out_k.dtype)
    out_v[dest[raw]] = dequant(v_cache, v_scale, (slot[raw],)).to(out_v.dtype)
    # compressed entries: x = up(z) + r, r the mean of the references (RoPE undone), K re-rotated
    bi, ji = torch.nonzero(live & (slot < 0), as_tuple=True)
    si = (ji - head).clamp(0, S - 1)
    refs = neighbors[latent_slots[bi, si].long()].long()                              # [n, k]
    ok = (refs >= 0).float().unsqueeze(-1)
    ref_slot = raw_map[rows.long()[bi].view(-1, 1), refs.clamp(min=0)].long().clamp(min=0)
    cos, sin = _cos_sin(cos_sin_cache, refs.clamp(min=0))
    ref_x = torch.cat([_rotate(dequant(k_cache, k_scale, (ref_slot,)), cos, sin, -1.0).flatten(-2),
                       dequant(v_cache, v_scale, (ref_slot,)).flatten(-2)], dim=-1)   # [n, k, F]
    x = up_z[bi, si].float() + (ref_x * ok).sum(1) / ok.sum(1).clamp(min=1)
    cos, sin = _cos_sin(cos_sin_cache, pos[bi, ji])
    out_k[dest[bi, ji]] = _rotate(x[:, :H * D].view(-1, H, D), cos, sin, 1.0).to(out_k.dtype)
    out_v[dest[bi, ji]] = x[:, H * D:].view(-1, H, D).to(out_v.dtype)


@jit
def _reconstruct_kernel(pos_ptr, len_ptr, row_ptr, map_ptr, kc_ptr, vc_ptr, upz_ptr, nbr_ptr, ls_ptr, cache_ptr,
                        ok_ptr, ov_ptr, head, ks_ptr, vs_ptr, stride_ss,
                        stride_pb, stride_mr, stride_ks, stride_kh, stride_vs, stride_vh,
                        stride_ub, stride_us, stride_nb, stride_lb, stride_c, stride_os, stride_oh,
                        C, S, MAXPOS,
                        H: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, NBR: tl.constexpr,
                        BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, SCALED: tl.constexpr = False):
    b = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1).to(tl.int64)
    if j >= tl.load(len_ptr + b):
        return
    pos = tl.minimum(tl.maximum(tl.load(pos_ptr + b * stride_pb + j).to(tl.int64), 0), MAXPOS - 1)
    row = tl.load(row_ptr + b).to(tl.int64)
    slot = tl.load(map_ptr + row * stride_mr + pos).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < H) & (cols < HALF)
    dst_k = ok_ptr + (b * C + j) * stride_os + heads * stride_oh + cols
    dst_v = ov_ptr + (b * C + j) * stride_os + heads * stride_oh + cols
    if slot >= 0:   # raw: sink, a reference, or a recent token
        src = kc_ptr + slot * stride_ks + heads * stride_kh + cols
        # (names of their own: the other branch's k1.. are fp32, a raw load is the cache's dtype)
        r1 = tl.load(src, mask=mask, other=0.0)
        r2 = tl.load(src + HALF, mask=mask, other=0.0)
        src = vc_ptr + slot * stride_vs + heads * stride_vh + cols
        w1 = tl.load(src, mask=mask, other=0.0)
        w2 = tl.load(src + HALF, mask=mask, other=0.0)
        if SCALED:   # an FP8 raw pool: dequantized into the scratch
            rks = tl.load(ks_ptr + slot * stride_ss + heads, mask=heads < H, other=0.0)
            rvs = tl.load(vs_ptr + slot * stride_ss + heads, mask=heads < H, other=0.0)
            r1, r2 = r1.to(tl.float32) * rks, r2.to(tl.float32) * rks
            w1, w2 = w1.to(tl.float32) * rvs, w2.to(tl.float32) * rvs
        tl.store(dst_k, r1.to(ok_ptr.dtype.element_ty), mask=mask)
        tl.store(dst_k + HALF, r2.to(ok_ptr.dtype.element_ty), mask=mask)
        tl.store(dst_v, w1.to(ov_ptr.dtype.element_ty), mask=mask)
        tl.store(dst_v + HALF, w2.to(ov_ptr.dtype.element_ty), mask=mask)
    else:
        s = tl.minimum(tl.maximum(j - head, 0), S - 1)
        ls = tl.load(ls_ptr + b * stride_lb + s).to(tl.int64)   # the token's row in the latent store
        k1 = tl.zeros([BLOCK_H, BLOCK_HALF], tl.float32)
        k2 = tl.zeros([BLOCK_H, BLOCK_HALF], tl.float32)
        v1 = tl.zeros([BLOCK_H, BLOCK_HALF], tl.float32)
        v2 = tl.zeros([BLOCK_H, BLOCK_HALF], tl.float32)
        count = 0.0
        for i in range(NBR):
            rp = tl.load(nbr_ptr + ls * stride_nb + i).to(tl.int64)
            if rp >= 0:
                rs = tl.load(map_ptr + row * stride_mr + rp).to(tl.int64)
                rs = tl.maximum(rs, 0)
                rc = tl.load(cache_ptr + rp * stride_c + cols, mask=cols < HALF, other=0.0).to(tl.float32)
                rn = tl.load(cache_ptr + rp * stride_c + HALF + cols, mask=cols < HALF, other=0.0).to(tl.float32)
                src = kc_ptr + rs * stride_ks + heads * stride_kh + cols
                a1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
                a2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
                src = vc_ptr + rs * stride_vs + heads * stride_vh + cols
                b1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
                b2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
                if SCALED:
                    ks = tl.load(ks_ptr + rs * stride_ss + heads, mask=heads < H, other=0.0)
                    vs = tl.load(vs_ptr + rs * stride_ss + heads, mask=heads < H, other=0.0)
                    a1, a2, b1, b2 = a1 * ks, a2 * ks, b1 * vs, b2 * vs
                k1 += a1 * rc + a2 * rn            # RoPE undone at the reference's own position
                k2 += a2 * rc - a1 * rn
                v1 += b1
                v2 += b2
                count += 1.0
        inv = 1.0 / tl.maximum(count, 1.0)
        up = upz_ptr + b * stride_ub + s * stride_us + heads * D + cols
        k1 = k1 * inv + tl.load(up, mask=mask, other=0.0).to(tl.float32)
        k2 = k2 * inv + tl.load(up + HALF, mask=mask, other=0.0).to(tl.float32)
        v1 = v1 * inv + tl.load(up + H * D, mask=mask, other=0.0).to(tl.float32)
        v2 = v2 * inv + tl.load(up + H * D + HALF, mask=mask, other=0.0).to(tl.float32)
        cos = tl.load(cache_ptr + pos * stride_c + cols, mask=cols < HALF, other=0.0).to(tl.float32)
        sin = tl.load(cache_ptr + pos * stride_c + HALF + cols, mask=cols < HALF, other=0.0).to(tl.float32)
        tl.store(dst_k, (k1 * cos - k2 * sin).to(ok_ptr.dtype.element_ty), mask=mask)
        tl.store(dst_k + HALF, (k2 * cos + k1 * sin).to(ok_ptr.dtype.element_ty), mask=mask)
        tl.store(dst_v, v1.to(ov_ptr.dtype.element_ty), mask=mask)
        tl.store(dst_v + HALF, v2.to(ov_ptr.dtype.element_ty), mask=mask)


def reconstruct_triton(view_pos, lengths, rows, raw_map, k_cache, v_cache, up_z, neighbors, latent_slots, head,
                       cos_sin_cache, out_k, out_v, k_scale=None, v_scale=None) -> None:
    """Same contract as reconstruct_ref; one program per (request, view entry), those past the
    request's length exit at once."""
    B, C = view_pos.shape
    H, D = k_cache.shape[1:]
    S, NBR = up_z.shape[1], neighbors.shape[-1]
    for t in (view_pos, raw_map, k_cache, v_cache, up_z, neighbors, latent_slots, cos_sin_cache, out_k, out_v):
        assert t.stride(-1) == 1
    assert out_k.stride() == out_v.stride() and up_z.shape[-1] == 2 * H * D and latent_slots.shape == (B, S)
    lengths, rows = lengths.contiguous(), rows.contiguous()   # read as ptr + b
    scaled = k_scale is not None
    assert not scaled or (k_scale.stride() == v_scale.stride() and k_scale.stride(1) == 1)
    if B and C:
        _reconstruct_kernel[(B, C)](
            view_pos, lengths, rows, raw_map, k_cache, v_cache, up_z, neighbors, latent_slots, cos_sin_cache,
            out_k, out_v, head, *((k_scale, v_scale, k_scale.stride(0)) if scaled else (out_k, out_v, 0)),
            view_pos.stride(0), raw_map.stride(0), k_cache.stride(0), k_cache.stride(1),
            v_cache.stride(0), v_cache.stride(1), up_z.stride(0), up_z.stride(1), neighbors.stride(0),
            latent_slots.stride(0), cos_sin_cache.stride(0), out_k.stride(0), out_k.stride(1), C, S,
            min(raw_map.shape[1], cos_sin_cache.shape[0]),
            H=H, D=D, HALF=D // 2, NBR=NBR, BLOCK_H=pow2(H), BLOCK_HALF=pow2(D // 2), SCALED=scaled, num_warps=4)


def reconstruct(view_pos, lengths, rows, raw_map, k_cache, v_cache, up_z, neighbors, latent_slots, head, cos_sin_cache,
                out_k, out_v, k_scale=None, v_scale=None):
    impl = reconstruct_triton if use_triton(k_cache) else reconstruct_ref
    return impl(view_pos, lengths, rows, raw_map, k_cache, v_cache, up_z, neighbors, latent_slots, head, cos_sin_cache,
                out_k, out_v, k_scale, v_scale)

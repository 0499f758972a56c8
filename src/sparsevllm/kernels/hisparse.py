"""HiSparse's three kernels: the write of new K/V into the host pool, the hit/eviction plan of the
hot buffer, and the host -> device copy of the misses.

host_store: rows of k, v ([T, H, D], any row stride) into the pinned host pool at host slots
(-1: skip). On the GPU the kernel writes pinned host memory through its pointer (unified virtual
addressing), so a decode step backs its token up without leaving the CUDA graph.

swap_plan: per request, the pages its decode view wants (host page ids, in view order, the current
page last) against the hot buffer's entries (which host page each entry holds, when it was last
used, its device page). A wanted page already held is a hit; each miss takes the least recently
used entry that no wanted page holds (empty entries first, ties by entry index), in view order.
It returns the view's device pages and, per entry of the view, the host page to copy in (-1: none),
and updates the buffer's keys and clocks in place. The current page lives in its own device page
(the one the step's slot mapping writes into), never in the LRU entries.

copy_pages: for every planned miss, one page of K and V from the host pool into the device pool;
the GPU reads pinned host memory directly (~48 GB/s for scattered rows on the H200, inside a graph).

FP8 (engine/kv_pool.py): host_store quantizes as rope_store does (a scale per token and KV head,
from the same k and v, so the host copy equals the device's), and copy_pages moves the scales as a
second, tiny cache ([slots, H, 1]).
"""
import torch

from sparsevllm.kernels.common import jit, pow2, quantize_ref, tl, use_triton

SWAP_CHUNK = 16   # wanted pages matched at once: a [16, E] tile (E ~ 256-512 entries) stays in registers

# ---------------------------------------------------------------- host store


def host_store_ref(k: torch.Tensor, v: torch.Tensor, host_k: torch.Tensor, host_v: torch.Tensor,
                   host_slots: torch.Tensor, host_ks: torch.Tensor | None = None,
                   host_vs: torch.Tensor | None = None) -> None:
    """k, v: [T, H, D]; host_k, host_v: [num_slots, H, D]; host_slots: [T] int, -1 = skip; host_ks,
    host_vs: [num_slots, H] fp32 scales of an FP8 host pool (k, v are then quantized), else None."""
    keep = host_slots >= 0
    idx = host_slots[keep].long().to(host_k.device)
    if host_ks is not None:
        for x, dst, dst_scale in ((k, host_k, host_ks), (v, host_v, host_vs)):
            xq, scale = quantize_ref(x[keep])
            dst[idx], dst_scale[idx] = xq.to(dst.device), scale.to(dst.device)
        return
    host_k[idx] = k[keep].to(host_k.device, host_k.dtype)
    host_v[idx] = v[keep].to(host_v.device, host_v.dtype)


@jit
def _host_store_kernel(k_ptr, v_ptr, hk_ptr, hv_ptr, slot_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
                       H: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)   # int64: slot * H * D overflows int32 on big pools
    if slot < 0:
        return
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < H * D
    h, d = offs // D, offs % D
    kv = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=ok)
    vv = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=ok)
    tl.store(hk_ptr + slot * (H * D) + offs, kv.to(hk_ptr.dtype.element_ty), mask=ok)
    tl.store(hv_ptr + slot * (H * D) + offs, vv.to(hv_ptr.dtype.element_ty), mask=ok)


@jit
def _quantize_token(x_ptrs, dst_ptrs, scale_ptrs, mask, head_ok):
    """One token's heads [H, D] -> x / scale in fp8 and the scale per head (common.quantize_ref)."""
    x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.where(mask, tl.abs(x), 0.0), 1)
    scale = tl.where(amax > 0, amax / 448.0, 1.0)   # common.FP8_MAX (a jit function reads no globals)
    tl.store(dst_ptrs, (x / scale[:, None]).to(dst_ptrs.dtype.element_ty), mask=mask)
    tl.store(scale_ptrs, scale, mask=head_ok)


@jit
def _host_store_fp8_kernel(k_ptr, v_ptr, hk_ptr, hv_ptr, hks_ptr, hvs_ptr, slot_ptr, stride_kt, stride_kh,
                           stride_vt, stride_vh, H: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr,
                           BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)   # int64: slot * H * D overflows int32 on big pools
    if slot < 0:
        return
    hs = tl.arange(0, BLOCK_H)
    ds = tl.arange(0, BLOCK_D)
    head_ok = hs < H
    mask = head_ok[:, None] & (ds < D)[None, :]
    dst = slot * (H * D) + hs[:, None] * D + ds[None, :]
    _quantize_token(k_ptr + t * stride_kt + hs[:, None] * stride_kh + ds[None, :], hk_ptr + dst,
                    hks_ptr + slot * H + hs, mask, head_ok)
    _quantize_token(v_ptr + t * stride_vt + hs[:, None] * stride_vh + ds[None, :], hv_ptr + dst,
                    hvs_ptr + slot * H + hs, mask, head_ok)


def host_store_triton(k, v, host_k, host_v, host_slots, host_ks=None, host_vs=None) -> None:
    T, H, D = k.shape
    assert v.shape == k.shape and k.stride(-1) == 1 and v.stride(-1) == 1
    assert host_k.is_contiguous() and host_v.is_contiguous() and host_k.shape[1:] == (H, D)
    if T == 0:
        return
    host_slots = host_slots.contiguous()   # read as ptr + t
    if host_ks is not None:
        assert host_ks.is_contiguous() and host_vs.is_contiguous() and host_ks.shape == host_k.shape[:2]
        _host_store_fp8_kernel[(T,)](k, v, host_k, host_v, host_ks, host_vs, host_slots, k.stride(0), k.stride(1),
                                     v.stride(0), v.stride(1), H=H, D=D, BLOCK_H=pow2(H), BLOCK_D=pow2(D))
        return
    block = min(1024, pow2(H * D))
    _host_store_kernel[(T, -(-H * D // block))](k, v, host_k, host_v, host_slots, k.stride(0), k.stride(1),
                                                 v.stride(0), v.stride(1), H=H, D=D, BLOCK=block)


def host_store(k, v, host_k, host_v, host_slots, host_ks=None, host_vs=None):
    if use_triton(k):
        host_store_triton(k, v, host_k, host_v, host_slots, host_ks, host_vs)
    else:
        host_store_ref(k, v, host_k, host_v, host_slots, host_ks, host_vs)


# ---------------------------------------------------------------- swap plan (hits + LRU eviction)

def swap_plan_ref(want: torch.Tensor, lengths: torch.Tensor, rows: torch.Tensor, active: torch.Tensor,
                  current: torch.Tensor, clock: torch.Tensor, buf_key: torch.Tensor, buf_last: torch.Tensor,
                  buf_phys: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """want: [B, n] host pages of the view (current page last of its ceil(len / P) valid entries);
    lengths: [B] view lengths; rows: [B] buffer row of each request; active: [B] bool (inactive rows
    touch nothing); current: [B] device page of the current page; clock: [B] int32 step counter;
    buf_key, buf_last, buf_phys: [R, E] int32 (key -1 = empty), keys and clocks updated in place.
    -> (table [B, n] int32 device pages, src [B, n] int32 host page to copy in or -1)."""
    B, n = want.shape
    E = buf_key.shape[1]
    dev = want.device
    rows = rows.long()
    keys, last, phys = buf_key[rows].long(), buf_last[rows].long(), buf_phys[rows].long()   # [B, E]
    nv = (lengths.long() + page_size - 1) // page_size
    j = torch.arange(n, device=dev)
    valid = (j.unsqueeze(0) < (nv - 1).unsqueeze(1)) & active.bool().unsqueeze(1)      # [B, n] non-current
    match = (keys.unsqueeze(2) == want.long().unsqueeze(1)) & valid.unsqueeze(1)           # [B, E, n]
    held = match.any(2)                                                                    # entry wanted
    hit = match.any(1)                                                                     # [B, n]
    hit_phys = (match.long() * phys.unsqueeze(2)).sum(1)
    miss = valid & ~hit
    # Victims: unwanted entries by (last use, index); the k-th miss takes the k-th of them.
    idx = torch.arange(E, device=dev)
    order = torch.where(held, torch.iinfo(torch.int64).max, (last + 1) * E + idx).argsort(1)   # [B, E]
    rank = (miss.long().cumsum(1) - 1).clamp(0, E - 1)
    victim = order.gather(1, rank)                                                         # [B, n]
    is_cur = (j.unsqueeze(0) == (nv - 1).unsqueeze(1))
    table = torch.where(hit, hit_phys, torch.where(miss, phys.gather(1, victim),
                                                   torch.where(is_cur, current.long().unsqueeze(1), 0)))
    src = torch.where(miss, want.long(), -1)
    # In-place updates: hits and filled victims get this step's clock, victims the new page.
    now = clock.long().unsqueeze(1)
    new_last = torch.where(held & active.bool().unsqueeze(1), now, last)
    new_keys = keys.clone()
    b_idx = torch.arange(B, device=dev).unsqueeze(1).expand(B, n)
    new_keys[b_idx[miss], victim[miss]] = want.long()[miss]
    new_last[b_idx[miss], victim[miss]] = now.expand(B, n)[miss]
    act = active.bool()
    buf_key[rows[act]] = new_keys[act].to(buf_key.dtype)
    buf_last[rows[act]] = new_last[act].to(buf_last.dtype)
    return table.to(torch.int32), src.to(torch.int32)


@jit
def _swap_plan_kernel(want_ptr, len_ptr, row_ptr, act_ptr, cur_ptr, clock_ptr, key_ptr, last_ptr, phys_ptr,
                      table_ptr, src_ptr, stride_w, stride_t, stride_s, stride_r, E,
                      N: tl.constexpr, P: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_J: tl.constexpr):
    # One program per request, the buffer's entries in registers. Pass 1 matches the view against
    # the buffer a chunk of BLOCK_J wanted pages at a time (hits, the current page, which entries
    # are held); pass 2 gives each miss, in view order, the least recently used free entry, one at
    # a time but only inside chunks that have misses (in steady state most chunks have none).
    b = tl.program_id(0)
    if tl.load(act_ptr + b) == 0:
        return
    row = tl.load(row_ptr + b).to(tl.int64)
    nv = (tl.load(len_ptr + b) + P - 1) // P
    now = tl.load(clock_ptr + b)
    cur = tl.load(cur_ptr + b)
    idx = tl.arange(0, BLOCK_E)
    in_buf = idx < E
    keys = tl.load(key_ptr + row * stride_r + idx, mask=in_buf, other=-1)
    last = tl.load(last_ptr + row * stride_r + idx, mask=in_buf, other=0)
    phys = tl.load(phys_ptr + row * stride_r + idx, mask=in_buf, other=0)
    lanes = tl.arange(0, BLOCK_J)
    held = idx < 0
    for j0 in range(0, N, BLOCK_J):
        js = j0 + lanes
        w = tl.load(want_ptr + b * stride_w + js, mask=js < N, other=-2)
        valid = js < nv - 1
        m = (keys[None, :] == w[:, None]) & valid[:, None]                      # [BLOCK_J, BLOCK_E]
        held = held | (tl.max(m.to(tl.int32), 0) > 0)
        hit = tl.max(m.to(tl.int32), 1) > 0
        out = tl.where(hit, tl.sum(tl.where(m, phys[None, :], 0), 1), tl.where(js == nv - 1, cur, 0))
        tl.store(table_ptr + b * stride_t + js, out, mask=js < N)
        tl.store(src_ptr + b * stride_s + js, tl.where(valid & (hit == 0), w, -1), mask=js < N)
    last = tl.where(held, now, last)
    taken = held | (idx >= E)
    keys0 = keys
    for j0 in range(0, N, BLOCK_J):
        js = j0 + lanes
        w = tl.load(want_ptr + b * stride_w + js, mask=js < N, other=-2)
        valid = js < nv - 1
        hit = tl.max(((keys0[None, :] == w[:, None]) & valid[:, None]).to(tl.int32), 1) > 0
        miss = valid & (hit == 0)
        if tl.sum(miss.to(tl.int32), 0) > 0:
            for jj in range(BLOCK_J):
                here = lanes == jj
                need = tl.sum((here & miss).to(tl.int32), 0) > 0
                wj = tl.sum(tl.where(here, w, 0), 0)
                # LRU first, then entry order; int64 so the clock never overflows the packed rank
                rank = tl.where(taken, tl.full([BLOCK_E], 1 << 62, tl.int64),
                                (last + 1).to(tl.int64) * BLOCK_E + idx)
                v = (tl.min(rank, 0) % BLOCK_E).to(tl.int32)
                pick = (idx == v) & need
                keys = tl.where(pick, wj, keys)
                last = tl.where(pick, now, last)
                taken = taken | pick
                tl.store(table_ptr + b * stride_t + j0 + jj, tl.sum(tl.where(idx == v, phys, 0), 0), mask=need)
    tl.store(key_ptr + row * stride_r + idx, keys, mask=in_buf)
    tl.store(last_ptr + row * stride_r + idx, last, mask=in_buf)


def swap_plan_triton(want, lengths, rows, active, current, clock, buf_key, buf_last, buf_phys, page_size):
    """Same contract as swap_plan_ref; one program per request."""
    B, n = want.shape
    E = buf_key.shape[1]
    assert want.stride(-1) == 1 and buf_key.stride() == buf_last.stride() == buf_phys.stride()
    assert buf_key.dtype == buf_last.dtype == buf_phys.dtype == torch.int32 and buf_key.stride(1) == 1
    table = torch.zeros(B, n, dtype=torch.int32, device=want.device)
    src = torch.full((B, n), -1, dtype=torch.int32, device=want.device)
    # the per-request vectors are read as ptr + b
    _swap_plan_kernel[(B,)](want, lengths.to(torch.int32).contiguous(), rows.contiguous(),
                            active.to(torch.int32).contiguous(), current.to(torch.int32).contiguous(),
                            clock.to(torch.int32).contiguous(), buf_key, buf_last, buf_phys, table, src,
                            want.stride(0), table.stride(0), src.stride(0), buf_key.stride(0), E,
                            N=n, P=int(page_size), BLOCK_E=pow2(E), BLOCK_J=SWAP_CHUNK)
    return table, src


def swap_plan(want, lengths, rows, active, current, clock, buf_key, buf_last, buf_phys, page_size):
    if use_triton(want):
        return swap_plan_triton(want, lengths, rows, active, current, clock, buf_key, buf_last, buf_phys, page_size)
    return swap_plan_ref(want, lengths, rows, active, current, clock, buf_key, buf_last, buf_phys, page_size)


# ---------------------------------------------------------------- host -> device copy of misses

def copy_pages_ref(host_k: torch.Tensor, host_v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   src: torch.Tensor, dst: torch.Tensor, page_size: int) -> None:
    """host_k, host_v: [host_slots, H, D]; k_cache, v_cache: [slots, H, D]; src, dst: [B, n] int
    (host page -> device page where src >= 0)."""
    P = page_size
    keep = src >= 0
    s, d = src[keep].long(), dst[keep].long()
    if s.numel() == 0:
        return
    offs = torch.arange(P, device=s.device)
    hs = (s.unsqueeze(1) * P + offs).flatten().to(host_k.device)
    ds = (d.unsqueeze(1) * P + offs).flatten()
    k_cache[ds] = host_k[hs].to(k_cache.device, k_cache.dtype)
    v_cache[ds] = host_v[hs].to(v_cache.device, v_cache.dtype)


@jit
def _copy_pages_kernel(hk_ptr, hv_ptr, k_ptr, v_ptr, src_ptr, dst_ptr, stride_s, stride_d,
                       PAGE_ELEMS: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    j = tl.program_id(1)
    s = tl.load(src_ptr + b * stride_s + j).to(tl.int64)
    if s < 0:
        return
    d = tl.load(dst_ptr + b * stride_d + j).to(tl.int64)
    offs = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < PAGE_ELEMS
    tl.store(k_ptr + d * PAGE_ELEMS + offs, tl.load(hk_ptr + s * PAGE_ELEMS + offs, mask=ok), mask=ok)
    tl.store(v_ptr + d * PAGE_ELEMS + offs, tl.load(hv_ptr + s * PAGE_ELEMS + offs, mask=ok), mask=ok)


def copy_pages_triton(host_k, host_v, k_cache, v_cache, src, dst, page_size) -> None:
    B, n = src.shape
    assert host_k.is_contiguous() and host_v.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert host_k.dtype == k_cache.dtype and dst.shape == src.shape
    elems = page_size * k_cache.shape[1] * k_cache.shape[2]
    block = min(4096, pow2(elems))
    _copy_pages_kernel[(B, n, -(-elems // block))](host_k, host_v, k_cache, v_cache, src, dst,
                                                   src.stride(0), dst.stride(0), PAGE_ELEMS=elems, BLOCK=block)


def copy_pages(host_k, host_v, k_cache, v_cache, src, dst, page_size):
    if use_triton(k_cache):
        copy_pages_triton(host_k, host_v, k_cache, v_cache, src, dst, page_size)
    else:
        copy_pages_ref(host_k, host_v, k_cache, v_cache, src, dst, page_size)

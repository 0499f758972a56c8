"""Key bounds of pages, for methods that pick a decode step's pages from its query (Quest, HiSparse):
per-page key min/max and the pages' upper-bound scores; kernels/page_select.py turns the scores into
the top pages as a decode view.

page_bounds: for every page a step wrote into, recompute the channel-wise min and max of the keys
stored in it so far, per KV head. A touched page is named by the slot of the last token the step
wrote into it: pages fill in order, so its valid tokens are offsets 0 .. slot % P. Decode passes
the slot mapping itself (one token per request, -1 for padding), so no host work is needed and
the update is graph-capturable. Recomputing from the pool rather than folding the new token into
the old min/max needs no "first token of the page" reset and costs at most P token reads.

bound_scores: the bound of Quest (Tang et al., "Quest: Query-Aware Sparsity for Efficient
Long-Context LLM Inference", ICML 2024): for every page of a request's block table, sum over the
channels of max(q_c * max_c, q_c * min_c) (an upper bound on q . k for any key of the page),
computed as relu(q) . max + min(q, 0) . min (the same number, as max_c >= min_c), per page-set row:
per query head ("query_head", Quest's official per-head bound), summed over the query heads of each
KV group ("kv_head"), or summed over all heads ("shared"). Pages at or after the current (last)
page of the request score -inf: the current page is always attended and is not a candidate, and
entries past the row's pages are padding. Programs whose pages all lie past the row's current page
write -inf and exit, so the work follows the real length, not the static table width that CUDA
graphs use.

The scoring launch can also do a decode step's rope_store (launch_bound_scores with `store`; Quest's
store_and_score in kernels/quest.py): the first block's program of each request and KV head writes
(RoPE, the cache write, the page bounds); every program rotates the query heads it scores with, one
launch a layer less. Nothing in the launch reads what it writes: a decode token lands in its
request's current page, never a candidate.
"""
import torch

from sparsevllm.kernels.common import gdc_launch_dependents, gdc_wait, jit, pdl, pow2, tl, use_triton
from sparsevllm.kernels.rope_store import fold_bounds

BLOCK_PAGES = 32   # pages per scoring program: a [32, 128] fp32 tile per min/max fits in registers
SCORE_WARPS = 4    # H200, 4 x 8K pages x 8 heads: 33-35 us for 16-64 pages and 2-8 warps alike


# ---------------------------------------------------------------- page bounds

def page_bounds_ref(k_cache: torch.Tensor, last_slots: torch.Tensor, kmin: torch.Tensor,
                    kmax: torch.Tensor, page_size: int, k_scale: torch.Tensor | None = None) -> None:
    """k_cache: [num_slots, H_kv, D]; last_slots: [M] int, -1 = nothing; kmin, kmax: [num_pages, H_kv, D]
    written in place for the page of every last slot. k_scale: [num_slots, H_kv] of an FP8 cache
    (the bounds are then those of the dequantized keys, the ones attention reads), else None."""
    P = page_size
    last = last_slots[last_slots >= 0].long()
    if last.numel() == 0:
        return
    pages = last // P
    count = last % P + 1
    offs = torch.arange(P, device=k_cache.device)
    slots = pages.unsqueeze(1) * P + offs
    keys = k_cache[slots] if k_scale is None else k_cache[slots].float() * k_scale[slots].unsqueeze(-1)   # [M, P, H, D]
    valid = (offs.unsqueeze(0) < count.unsqueeze(1)).view(-1, P, 1, 1)
    kmin[pages] = keys.masked_fill(~valid, float("inf")).amin(1).to(kmin.dtype)
    kmax[pages] = keys.masked_fill(~valid, float("-inf")).amax(1).to(kmax.dtype)


@jit
def _page_bounds_kernel(k_ptr, slot_ptr, kmin_ptr, kmax_ptr, ks_ptr, stride_ss,
                        stride_ks, stride_kh, stride_ms, stride_mh, stride_xs, stride_xh,
                        P: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SCALED: tl.constexpr = False):
    i = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    last = tl.load(slot_ptr + i).to(tl.int64)   # int64: slot * stride overflows int32 on big pools
    if last < 0:
        return
    page = last // P
    count = last % P + 1
    toks = tl.arange(0, P)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    mask = (toks < count)[:, None] & dim_ok[None, :]
    k = tl.load(k_ptr + (page * P + toks)[:, None] * stride_ks + h * stride_kh + dims[None, :],
                mask=mask, other=0.0)
    if SCALED:   # FP8: the dequantized keys
        k = k.to(tl.float32) * tl.load(ks_ptr + (page * P + toks) * stride_ss + h, mask=toks < count, other=0.0)[:, None]
    lo = tl.min(tl.where(mask, k, float("inf")), 0)
    hi = tl.max(tl.where(mask, k, float("-inf")), 0)
    tl.store(kmin_ptr + page * stride_ms + h * stride_mh + dims, lo.to(kmin_ptr.dtype.element_ty), mask=dim_ok)
    tl.store(kmax_ptr + page * stride_xs + h * stride_xh + dims, hi.to(kmax_ptr.dtype.element_ty), mask=dim_ok)


def page_bounds_triton(k_cache: torch.Tensor, last_slots: torch.Tensor, kmin: torch.Tensor,
                       kmax: torch.Tensor, page_size: int, k_scale: torch.Tensor | None = None) -> None:
    """Same contract as page_bounds_ref; one program per (touched page, KV head)."""
    M = last_slots.shape[0]
    H, D = k_cache.shape[1], k_cache.shape[2]
    last_slots = last_slots.contiguous()   # 1-D vectors are read as ptr + i (likewise below)
    assert last_slots.dim() == 1 and kmin.shape == kmax.shape and kmin.shape[1:] == (H, D)
    assert k_cache.stride(-1) == 1 and kmin.stride(-1) == 1 and kmax.stride(-1) == 1
    if M == 0:
        return
    scaled = k_scale is not None
    assert not scaled or (k_scale.shape == k_cache.shape[:2] and k_scale.stride(1) == 1)
    _page_bounds_kernel[(M, H)](
        k_cache, last_slots, kmin, kmax, k_scale if scaled else kmin, k_scale.stride(0) if scaled else 0,
        k_cache.stride(0), k_cache.stride(1),
        kmin.stride(0), kmin.stride(1), kmax.stride(0), kmax.stride(1),
        P=int(page_size), HEAD_DIM=D, BLOCK_D=pow2(D), SCALED=scaled, num_warps=4)


def page_bounds(k_cache, last_slots, kmin, kmax, page_size, k_scale=None):
    if use_triton(k_cache):
        page_bounds_triton(k_cache, last_slots, kmin, kmax, page_size, k_scale)
    else:
        page_bounds_ref(k_cache, last_slots, kmin, kmax, page_size, k_scale)


# ---------------------------------------------------------------- bound scores

SELECTIONS = ("kv_head", "query_head", "shared")   # page-set rows: H_kv, H_q or 1


def bound_scores_ref(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, block_tables: torch.Tensor,
                     cache_lens: torch.Tensor, page_size: int, selection: str,
                     row_budgets: torch.Tensor | None = None) -> torch.Tensor:
    """q: [B, H_q, D]; kmin, kmax: [num_pages, H_kv, D]; block_tables: [B, N]; cache_lens: [B]
    -> fp32 scores [B, G, N], G = H_kv / H_q / 1 for selection kv_head / query_head / shared;
    -inf at and after each row's current page. row_budgets: [B] page budgets (select_pages'), or
    None: a row within its budget attends densely and is not scored (-inf everywhere)."""
    B, Hq, D = q.shape
    Hkv = kmin.shape[1]
    N = block_tables.shape[1]
    pages = block_tables.long()
    hi = kmax[pages].float()                                       # [B, N, H_kv, D]
    lo = kmin[pages].float()
    qg = q.float().view(B, Hkv, Hq // Hkv, D)
    if selection == "query_head":
        pos, neg = qg.clamp(min=0), qg.clamp(max=0)                # [B, H_kv, group, D]
        bound = (torch.einsum("bnhd,bhgd->bnhg", hi, pos) + torch.einsum("bnhd,bhgd->bnhg", lo, neg))
        scores = bound.flatten(2).transpose(1, 2)                 # [B, H_q, N]
    else:   # summing over a group's heads commutes with the split: sum relu(q) and min(q, 0) first
        pos, neg = qg.clamp(min=0).sum(2), qg.clamp(max=0).sum(2)  # [B, H_kv, D]
        scores = (hi * pos.unsqueeze(1) + lo * neg.unsqueeze(1)).sum(-1).transpose(1, 2)   # [B, H_kv, N]
        if selection == "shared":
            scores = scores.sum(1, keepdim=True)
    current = (cache_lens.long() - 1) // page_size
    if row_budgets is not None:
        current = torch.where(current < row_budgets.long(), 0, current)
    candidate = torch.arange(N, device=q.device).view(1, 1, N) < current.view(B, 1, 1)
    return scores.masked_fill(~candidate, float("-inf")).contiguous()


@jit
def _rope_row(pos_ptr, cs_ptr, b, stride_c, dims, dim_ok, HALF: tl.constexpr):
    """Request b's token's cos and signed sin per channel (-sin on the first half), and each
    channel's rotation partner (the same channel of the other half)."""
    position = tl.load(pos_ptr + b).to(tl.int64)
    cos = tl.load(cs_ptr + position * stride_c + dims % HALF, mask=dim_ok, other=0.0).to(tl.float32)
    sin = tl.load(cs_ptr + position * stride_c + HALF + dims % HALF, mask=dim_ok, other=0.0).to(tl.float32)
    first_half = dims < HALF
    return tl.where(first_half, dims + HALF, dims - HALF), cos, tl.where(first_half, -sin, sin)


@jit
def _rotated(x_ptr, dims, dim_ok, partner, cos, signed_sin):
    """One head's vector rotated to its position (fp32) with rope_store's fmas: x cos + partner
    (-sin | sin), the product with sin rounded, the one with cos fused."""
    x = tl.load(x_ptr + dims, mask=dim_ok, other=0.0).to(tl.float32)
    xs = tl.load(x_ptr + partner, mask=dim_ok, other=0.0).to(tl.float32)
    return tl.fma(x, cos, xs * signed_sin)


@jit
def _store_token(rq_ptr, k_ptr, v_ptr, qo_ptr, ko_ptr, pos_ptr, cs_ptr, slot_ptr, kc_ptr, vc_ptr, kmin_ptr,
                 kmax_ptr, b, r, dims, dim_ok, stride_c,
                 stride_rqb, stride_rqh, stride_kb, stride_kh, stride_vb, stride_vh,
                 stride_qob, stride_qoh, stride_kob, stride_koh, stride_kcs, stride_kch,
                 stride_vcs, stride_vch, stride_ms, stride_mh, stride_xs, stride_xh,
                 GROUP: tl.constexpr, KV_PER_PROG: tl.constexpr, P: tl.constexpr, HALF: tl.constexpr):
    """rope_store's work for request b's token and KV heads r * KV_PER_PROG .. + KV_PER_PROG: the
    rotated query heads of their groups to qo, rotated k to ko, k and v to the token's slot (-1:
    nowhere) and k folded into its page's bounds (reset by the page's first slot)."""
    partner, cos, signed_sin = _rope_row(pos_ptr, cs_ptr, b, stride_c, dims, dim_ok, HALF)
    slot = tl.load(slot_ptr + b).to(tl.int64)   # int64: slot * stride overflows int32 on big pools
    page = slot // P
    first = slot % P == 0
    for kh in range(KV_PER_PROG):
        h = (r * KV_PER_PROG + kh).to(tl.int64)
        for j in range(GROUP):
            qh = h * GROUP + j
            qr = _rotated(rq_ptr + b * stride_rqb + qh * stride_rqh, dims, dim_ok, partner, cos, signed_sin)
            tl.store(qo_ptr + b * stride_qob + qh * stride_qoh + dims, qr.to(qo_ptr.dtype.element_ty), mask=dim_ok)
        kr = _rotated(k_ptr + b * stride_kb + h * stride_kh, dims, dim_ok, partner, cos, signed_sin)
        tl.store(ko_ptr + b * stride_kob + h * stride_koh + dims, kr.to(ko_ptr.dtype.element_ty), mask=dim_ok)
        if slot >= 0:
            kc = kr.to(kc_ptr.dtype.element_ty)
            tl.store(kc_ptr + slot * stride_kcs + h * stride_kch + dims, kc, mask=dim_ok)
            v = tl.load(v_ptr + b * stride_vb + h * stride_vh + dims, mask=dim_ok, other=0.0)
            tl.store(vc_ptr + slot * stride_vcs + h * stride_vch + dims, v.to(vc_ptr.dtype.element_ty), mask=dim_ok)
            fold_bounds(kmin_ptr + page * stride_ms + h * stride_mh + dims, kmax_ptr + page * stride_xs + h * stride_xh
                        + dims, kc.to(kmin_ptr.dtype.element_ty), first, dim_ok)


@jit
def _bound_scores_kernel(q_ptr, kmin_ptr, kmax_ptr, table_ptr, len_ptr, out_ptr,
                         stride_qb, stride_qh, stride_ms, stride_mh, stride_xs, stride_xh,
                         stride_tb, stride_ob, stride_og, N,
                         rq_ptr, k_ptr, v_ptr, ko_ptr, pos_ptr, cs_ptr, slot_ptr, kc_ptr, vc_ptr,
                         stride_rqb, stride_rqh, stride_kb, stride_kh, stride_vb, stride_vh,
                         stride_kob, stride_koh, stride_c, stride_kcs, stride_kch, stride_vcs, stride_vch,
                         budget_ptr,
                         GROUP: tl.constexpr, KV_PER_PROG: tl.constexpr, PER_QUERY: tl.constexpr,
                         P: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                         BLOCK_P: tl.constexpr, STORE: tl.constexpr, PER_ROW: tl.constexpr, PDL: tl.constexpr):
    # Program (b, r, blk) reads the metadata of KV heads r * KV_PER_PROG .. + KV_PER_PROG once
    # and scores them with their GROUP query heads: summed into row r (kv_head: one head a
    # program; shared: all heads, r = 0), or one row per query head (query_head).
    b = tl.program_id(0)
    r = tl.program_id(1)
    blk = tl.program_id(2)
    current = (tl.load(len_ptr + b) - 1) // P
    if PER_ROW:   # a row within its page budget attends densely: nothing to score, its programs exit
        current = tl.where(current < tl.load(budget_ptr + b), 0, current)
    offs = blk * BLOCK_P + tl.arange(0, BLOCK_P)
    out_row = out_ptr + b * stride_ob + offs
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    if PDL:   # see common.pdl: the next kernel may start; nothing is written before gdc_wait
        gdc_launch_dependents()
    if blk * BLOCK_P < current:
        ok = offs < current
        if STORE:
            partner, cos, signed_sin = _rope_row(pos_ptr, cs_ptr, b, stride_c, dims, dim_ok, HEAD_DIM // 2)
        page = tl.load(table_ptr + b * stride_tb + offs, mask=ok, other=0).to(tl.int64)
        tile_ok = ok[:, None] & dim_ok[None, :]
        acc = tl.zeros([BLOCK_P], tl.float32)
        for kh in range(KV_PER_PROG):
            h = (r * KV_PER_PROG + kh).to(tl.int64)
            hi = tl.load(kmax_ptr + page[:, None] * stride_xs + h * stride_xh + dims[None, :],
                         mask=tile_ok, other=0.0).to(tl.float32)
            lo = tl.load(kmin_ptr + page[:, None] * stride_ms + h * stride_mh + dims[None, :],
                         mask=tile_ok, other=0.0).to(tl.float32)
            if PDL:   # the bounds, the table and the positions do not come from the kernel before; q does
                gdc_wait()
            # max(q hi, q lo) = relu(q) hi + min(q, 0) lo as hi >= lo; a group's sum of these is one
            # pair of dot products with the group's summed relu(q) and min(q, 0).
            pos = tl.zeros([BLOCK_D], tl.float32)
            neg = tl.zeros([BLOCK_D], tl.float32)
            for j in range(GROUP):
                if STORE:   # rounded to q's dtype as the stored query is: the same scores as unfused
                    qv = _rotated(rq_ptr + b * stride_rqb + (h * GROUP + j) * stride_rqh, dims, dim_ok, partner,
                                  cos, signed_sin).to(q_ptr.dtype.element_ty).to(tl.float32)
                else:
                    qv = tl.load(q_ptr + b * stride_qb + (h * GROUP + j) * stride_qh + dims,
                                 mask=dim_ok, other=0.0).to(tl.float32)
                if PER_QUERY:
                    bound = tl.sum(tl.fma(hi, tl.maximum(qv, 0.0)[None, :], lo * tl.minimum(qv, 0.0)[None, :]), 1)
                    tl.store(out_row + (h * GROUP + j) * stride_og, tl.where(ok, bound, float("-inf")),
                             mask=offs < N)
                else:
                    pos += tl.maximum(qv, 0.0)
                    neg += tl.minimum(qv, 0.0)
            if not PER_QUERY:
                # explicit fma: the same bits from every build of this kernel (with or without the store)
                acc += tl.sum(tl.fma(hi, pos[None, :], lo * neg[None, :]), 1)
        if not PER_QUERY:
            tl.store(out_row + r * stride_og, tl.where(ok, acc, float("-inf")), mask=offs < N)
    else:   # every page of this block is the current page or padding
        if PDL:
            gdc_wait()
        for j in range(GROUP if PER_QUERY else 1):
            tl.store(out_row + (r * GROUP + j if PER_QUERY else r) * stride_og,
                     tl.full([BLOCK_P], float("-inf"), tl.float32), mask=offs < N)
    if STORE:
        # The layer's decode RoPE and cache write ride in this launch (rope_store's work, one launch
        # less a layer): the first block's program writes its query heads after RoPE to q (the
        # attention's query), its KV heads' k and v to the request's slot and folds k into its
        # page's bounds; every program rotates the query heads it scores with from the raw q (rq)
        # itself. Nothing here reads the bounds written: the current page is never a candidate.
        if blk == 0:
            _store_token(rq_ptr, k_ptr, v_ptr, q_ptr, ko_ptr, pos_ptr, cs_ptr, slot_ptr, kc_ptr, vc_ptr,
                         kmin_ptr, kmax_ptr, b, r, dims, dim_ok, stride_c,
                         stride_rqb, stride_rqh, stride_kb, stride_kh, stride_vb, stride_vh,
                         stride_qb, stride_qh, stride_kob, stride_koh, stride_kcs, stride_kch,
                         stride_vcs, stride_vch, stride_ms, stride_mh, stride_xs, stride_xh,
                         GROUP, KV_PER_PROG, P, HEAD_DIM // 2)


def bound_scores_triton(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, block_tables: torch.Tensor,
                        cache_lens: torch.Tensor, page_size: int, selection: str,
                        row_budgets: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as bound_scores_ref; one program per (request, KV head or all, block of pages)."""
    return launch_bound_scores(q, kmin, kmax, block_tables, cache_lens, page_size, selection, None, row_budgets)


def launch_bound_scores(q, kmin, kmax, block_tables, cache_lens, page_size, selection, store, row_budgets=None):
    """bound_scores_triton's launch. With `store` = (q before RoPE, k, v, positions, cos_sin_cache,
    k_cache, v_cache, slot_mapping, k_out) the same launch also does that decode step's rope_store
    (with the page bounds) and scores the rotated query, which it writes into `q`
    (store_and_score in kernels/quest.py)."""
    B, Hq, D = q.shape
    Hkv = kmin.shape[1]
    N = block_tables.shape[1]
    assert Hq % Hkv == 0 and kmin.shape == kmax.shape and kmin.shape[2] == D
    assert q.stride(-1) == 1 and kmin.stride(-1) == 1 and kmax.stride(-1) == 1
    assert block_tables.stride(-1) == 1 and cache_lens.shape == (B,) and cache_lens.stride(0) == 1
    G = {"kv_head": Hkv, "query_head": Hq, "shared": 1}[selection]
    shared = selection == "shared"
    out = torch.empty(B, G, N, dtype=torch.float32, device=q.device)
    grid = (B, 1 if shared else Hkv, -(-N // BLOCK_PAGES))
    if store is None:   # the store's pointers and strides are unused: any tensor will do
        rq, k, v, k_out, positions, cos_sin, slots, k_cache, v_cache = (q,) * 9
    else:
        rq, k, v, positions, cos_sin, k_cache, v_cache, slots, k_out = store
        positions, slots = positions.contiguous(), slots.contiguous()
        assert D % 2 == 0 and cos_sin.shape[-1] == D and rq.shape == q.shape and k.shape == k_out.shape == (B, Hkv, D)
        assert positions.shape == slots.shape == (B,)
        for x in (rq, k, v, k_out, cos_sin, k_cache, v_cache):
            assert x.stride(-1) == 1
    on = pdl()
    _bound_scores_kernel[grid](
        q, kmin, kmax, block_tables, cache_lens, out,
        q.stride(0), q.stride(1), kmin.stride(0), kmin.stride(1), kmax.stride(0), kmax.stride(1),
        block_tables.stride(0), out.stride(0), out.stride(1), N,
        rq, k, v, k_out, positions, cos_sin, slots, k_cache, v_cache,
        rq.stride(0), rq.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_out.stride(0), k_out.stride(1), cos_sin.stride(0), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), row_budgets.contiguous() if row_budgets is not None else cache_lens,
        GROUP=Hq // Hkv, KV_PER_PROG=Hkv if shared else 1, PER_QUERY=selection == "query_head",
        P=int(page_size), HEAD_DIM=D, BLOCK_D=pow2(D), BLOCK_P=BLOCK_PAGES, STORE=store is not None,
        PER_ROW=row_budgets is not None, PDL=on,
        num_warps=SCORE_WARPS, **({"launch_pdl": True} if on else {}))
    return out


def bound_scores(q, kmin, kmax, block_tables, cache_lens, page_size, selection, row_budgets=None):
    if use_triton(q):
        return bound_scores_triton(q, kmin, kmax, block_tables, cache_lens, page_size, selection, row_budgets)
    return bound_scores_ref(q, kmin, kmax, block_tables, cache_lens, page_size, selection, row_budgets)

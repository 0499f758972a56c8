"""Page selection by key bounds, for methods that pick a decode step's pages from its query (Quest,
HiSparse): per-page key min/max, the pages' upper-bound scores, and the top pages as a decode view.

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

select_pages: per row (request, page set), the n - 1 highest-scoring candidate pages in logical
order, then the current page. The Triton version is one program per row: it finds the (n - 1)-th
largest score over the scores' order-preserving int32 keys by narrowing a bracket, two cut points
a pass (the row held in registers; it stops once exactly n - 1 keys reach the lower end), then
writes the pages above it (and the first ties, in page order) through a prefix sum, already in
logical order. It replaces a top-k, a sort and several gathers and concatenations, a dozen launches per
layer, with one.
"""
import torch

from sparsevllm.kernels.common import gdc_launch_dependents, gdc_wait, jit, pdl, pow2, tl, use_triton
from sparsevllm.kernels.rope_store import fold_bounds

BLOCK_PAGES = 32   # pages per scoring program: a [32, 128] fp32 tile per min/max fits in registers
SCORE_WARPS = 4    # H200, 4 x 8K pages x 8 heads: 33-35 us for 16-64 pages and 2-8 warps alike
PACKED_MAX_PAGES = 1 << 15   # below this, select_pages packs two per-page counts in one int32 scan


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


# ---------------------------------------------------------------- page selection

DENSE_PAGES = 1 << 30   # a per-row budget no table reaches: the row attends densely


def select_pages_ref(scores: torch.Tensor, block_tables: torch.Tensor, cache_lens: torch.Tensor,
                     page_size: int, budget_pages: "int | torch.Tensor") -> tuple[torch.Tensor, torch.Tensor]:
    """The decode view from page scores. scores: [B, G, N] fp32 (-inf where not a candidate),
    block_tables: [B, N], cache_lens: [B]; budget_pages: one page budget n for every row (N > n;
    the view is [B, G, n] wide) or a [B] int tensor, one per request (>= 2; DENSE_PAGES: dense;
    the view is [B, G, N] wide, row b's first n_b entries used) -> (table int32, lengths [B, G] int32).

    Row (b, g) gets its top n - 1 scored pages in logical order, then the current page; a row of
    <= n pages gets the first entries of its table (the length masks the rest). Only static
    shapes and tensor ops, so it also runs inside CUDA graphs.
    """
    B, G, N = scores.shape
    P = page_size
    per_row = isinstance(budget_pages, torch.Tensor)
    n = budget_pages.long().view(B, 1) if per_row else torch.full((B, 1), budget_pages, device=scores.device)
    width = N if per_row else budget_pages
    ctx = cache_lens.long()
    current = (ctx - 1) // P
    # A row with more than n pages has at least n candidates, so the top n - 1 are all real pages.
    # Ties at the cut go to the earlier page, as in the Triton kernel: a stable sort (topk leaves
    # that choice to the device and picked later pages on CPU).
    order = scores.sort(dim=-1, descending=True, stable=True).indices
    rank = torch.arange(N, device=scores.device).view(1, 1, N)
    chosen = torch.zeros(B, G, N, dtype=torch.bool, device=scores.device).scatter_(
        2, order, (rank < (n - 1).view(B, 1, 1)).expand(B, G, N))
    top = torch.where(chosen, rank, N).sort(dim=-1).values[..., :width].clamp(max=N - 1)   # chosen pages, in order
    tables = block_tables.unsqueeze(1).expand(B, G, N)
    last = block_tables.gather(1, current.clamp(min=0).unsqueeze(1)).unsqueeze(1).expand(B, G, width)
    sparse = torch.where(rank[..., :width] == (n - 1).view(B, 1, 1), last, tables.gather(2, top))
    dense = current.view(B, 1) < n
    table = torch.where(dense.view(B, 1, 1), tables[:, :, :width], sparse).to(torch.int32).contiguous()
    # Sparse rows: n - 1 full pages plus the filled part of the current page.
    lengths = torch.where(dense.view(B), ctx, ctx - (current - (n.view(B) - 1)) * P)
    return table, lengths.to(torch.int32).view(B, 1).expand(B, G).contiguous()


@jit
def _select_pages_kernel(score_ptr, table_ptr, len_ptr, budget_ptr, out_ptr, out_len_ptr,
                         stride_sb, stride_sg, stride_tb, stride_ob, stride_og, N, G, width,
                         P: tl.constexpr, NUM_PAGES: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, PER_ROW: tl.constexpr, PACKED: tl.constexpr, PDL: tl.constexpr):
    # As a programmatic dependent launch (common.pdl) it starts while the scoring kernel drains:
    # the lengths and the block table are the step's inputs, loaded before gdc_wait; the scores
    # and every write come after it.
    if PDL:
        gdc_launch_dependents()
    b = tl.program_id(0)
    g = tl.program_id(1)
    ctx = tl.load(len_ptr + b)
    current = (ctx - 1) // P
    out_row = out_ptr + b * stride_ob + g * stride_og
    firsts = tl.arange(0, BLOCK_K)
    # The row's page budget: one for all rows (NUM_PAGES, the view's width), or its own (a
    # request's SparseParams; DENSE_PAGES: dense), the view then as wide as the table.
    if PER_ROW:
        n = tl.load(budget_ptr + b)
    else:
        n = NUM_PAGES
    if current < n:   # at most n pages: the first entries, the length masks the rest
        page = tl.load(table_ptr + b * stride_tb + firsts, mask=firsts < width, other=0)
        if PDL:
            gdc_wait()
        tl.store(out_row + firsts, page, mask=firsts < width)
        tl.store(out_len_ptr + b * G + g, ctx)
        return
    offs = tl.arange(0, BLOCK_N)
    in_row = offs < N
    # The pages are written at the end, under the chosen mask; loading them now hides the load's
    # latency behind the search.
    row_pages = tl.load(table_ptr + b * stride_tb + offs, mask=in_row, other=0)
    last_page = tl.load(table_ptr + b * stride_tb + current)
    if PDL:
        gdc_wait()
    x = tl.load(score_ptr + b * stride_sb + g * stride_sg + offs, mask=in_row, other=float("-inf"))
    # fp32 -> int32 with the same order: negative floats get their magnitude bits flipped.
    bits = x.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    # The k-th largest key t, by narrowing [lo, hi): at least k keys are >= lo, fewer than k are
    # >= hi. Each pass counts the keys at or above two cut points in one block-wide sum (the two
    # counts packed in one int32 where N < 2^15); it stops as soon as exactly k keys are >= lo
    # (they are the top k) or hi = lo + 1 (then t = lo, with ties across it). Cut points: first
    # 2^22 and 2^23 keys below the row's max, then 2^24 and 2^25, ... (a binade is 2^23 keys for
    # either sign, so this brackets t in a few binades of the max), once t is bracketed the thirds
    # of [lo, hi). On 8,000 Gaussian scores (k = 127) that is 7.6 passes on average against 18.7
    # for the bit-by-bit search this replaced, and 8.0 against 16.4 on the real page scores of
    # SmolLM2-135M (5,796 rows: prose, code and a passkey prompt of ~7K tokens, every decode step
    # and sparse layer). The data decide the count (a CPU count of the passes). Starting from the
    # previous step's threshold instead of the max saves about one pass: it moves 11% (median)
    # from step to step on those rows. Measured on the H200 after the scoring kernel at 128K x 4
    # (4 x 8 rows of 8,016 pages, 8 warps): launch 1.4 us, + loads and max 3.0, + search 8.75,
    # + scan and writes 11.4, so a pass costs ~0.8 us (~7 passes). Measured no faster and dropped:
    # a 64-bin tl.histogram a pass (~2 passes; 15.9 us alone against 12.4, 128 / 256 bins slower
    # still); interpolated cut points (~0.6 fewer passes; 11.6 us after the scores against 11.1);
    # 3 or 4 cut points a pass counted in one int64 sum (~1.1 / 1.6-2.8 fewer passes; 12.4 / 14.0
    # against 11.0); a multiply and a shift for the int64 divisions (11.2). The scalar work and the
    # wider reductions cost more than the passes they save.
    k = n - 1
    top = tl.max(key, 0).to(tl.int64) + 1
    lo = tl.full((), -2147483648, tl.int64)   # int64 scalars: the cut points' arithmetic must not wrap
    hi = top
    gap = tl.full((), 1 << 22, tl.int64)
    n_lo = tl.full((), BLOCK_N, tl.int32)     # every key, padding's too, is >= INT_MIN
    gallop = tl.full((), 1, tl.int1)
    while (n_lo != k) & (hi - lo > 1):
        span = hi - lo
        c1 = tl.where(gallop, top - 2 * gap, lo + span // 3)
        c2 = tl.where(gallop, top - gap, lo + (2 * span) // 3)
        c1 = tl.minimum(tl.maximum(c1, lo + 1), hi - 1)
        c2 = tl.minimum(tl.maximum(c2, lo + 1), hi - 1)
        ge1 = key >= c1.to(tl.int32)
        ge2 = key >= c2.to(tl.int32)   # implies ge1
        if PACKED:   # counts <= 2^15: the sum may wrap into the sign bit, the masks undo it
            both = tl.sum(tl.where(ge2, 65537, tl.where(ge1, 1, 0)), 0)
            n1 = both & 0xFFFF
            n2 = (both >> 16) & 0xFFFF
        else:
            n1 = tl.sum(ge1.to(tl.int32), 0)
            n2 = tl.sum(ge2.to(tl.int32), 0)
        up2 = n2 >= k
        up1 = n1 >= k
        new_lo = tl.where(up2, c2, tl.where(up1, c1, lo))
        n_lo = tl.where(up2, n2, tl.where(up1, n1, n_lo))
        hi = tl.where(up2, hi, tl.where(up1, c2, c1))
        lo = new_lo
        gallop = gallop & (n1 < k) & (gap < 536870912)   # the last gallop cuts 2^30, 2^31 below
        gap = gap * 4
    t = lo.to(tl.int32)
    above = key > t
    tie = (key == t) & in_row
    # Ties at the threshold fill the remaining slots in page order. One scan counts both the pages
    # above and the ties before each entry (packed in one int32 where N < 2^15): a chosen page's slot is
    # the aboves before it plus its tie rank capped at `free` (13.97 -> 12.69 us with two scans).
    free = k - tl.sum(above.to(tl.int32), 0)
    if PACKED:
        both = tl.cumsum(above.to(tl.int32) + (tie.to(tl.int32) << 16), 0)
        ties_before = both >> 16
        chosen = above | (tie & (ties_before <= free))
        slot = (both & 0xFFFF) + tl.minimum(ties_before, free) - 1
    else:
        chosen = above | (tie & (tl.cumsum(tie.to(tl.int32), 0) <= free))
        slot = tl.cumsum(chosen.to(tl.int32), 0) - 1
    tl.store(out_row + slot, row_pages, mask=chosen)
    tl.store(out_row + k, last_page)
    tl.store(out_len_ptr + b * G + g, ctx - (current - k) * P)


def select_pages_triton(scores: torch.Tensor, block_tables: torch.Tensor, cache_lens: torch.Tensor,
                        page_size: int, budget_pages: "int | torch.Tensor") -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as select_pages_ref; one program per (request, page set)."""
    B, G, N = scores.shape
    per_row = isinstance(budget_pages, torch.Tensor)
    assert scores.dtype == torch.float32 and scores.stride(-1) == 1 and block_tables.shape == (B, N)
    assert block_tables.stride(-1) == 1 and cache_lens.shape == (B,)
    if per_row:
        assert budget_pages.shape == (B,) and budget_pages.dtype == torch.int32
        budgets, width = budget_pages.contiguous(), N
    else:
        assert N > budget_pages >= 2
        budgets, width = cache_lens, int(budget_pages)   # (budgets unread)
    table = torch.empty(B, G, width, dtype=torch.int32, device=scores.device)
    lengths = torch.empty(B, G, dtype=torch.int32, device=scores.device)
    block_n = pow2(N)
    on = pdl()
    _select_pages_kernel[(B, G)](
        scores, block_tables, cache_lens.to(torch.int32).contiguous(), budgets, table, lengths,
        scores.stride(0), scores.stride(1), block_tables.stride(0), table.stride(0), table.stride(1), N, G, width,
        P=int(page_size), NUM_PAGES=0 if per_row else int(budget_pages), BLOCK_N=block_n, BLOCK_K=pow2(width),
        PER_ROW=per_row, PACKED=N < PACKED_MAX_PAGES, PDL=on,
        num_warps=max(4, min(8, block_n // 1024)),   # 8 measured best at N = 8K
        **({"launch_pdl": True} if on else {}))
    return table, lengths


def select_pages(scores, block_tables, cache_lens, page_size, budget_pages):
    if use_triton(scores):
        return select_pages_triton(scores, block_tables, cache_lens, page_size, budget_pages)
    return select_pages_ref(scores, block_tables, cache_lens, page_size, budget_pages)

"""The top pages of a decode step as its decode view, from page scores (kernels/page_bounds.py: Quest's
bound; Quest, HiSparse).

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

PACKED_MAX_PAGES = 1 << 15   # below this, select_pages packs two per-page counts in one int32 scan


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

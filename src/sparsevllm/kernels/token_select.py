"""Top-n token selection into a decode view, for methods that pick single tokens by per-token scores
(OmniKV's filter layers, DeltaKV's full layers).

select_tokens: per request, the top keep[b] of the candidate positions [0, prompt_lens[b]) by score
(ties to the earlier position) followed by every position [prompt_lens[b], cache_lens[b]), as pool
slots in logical order: a decode view with page size 1 and one token set for all heads (G = 1).
OmniKV's candidates are the prompt and the rest its generated tokens; DeltaKV passes its number of
compressed tokens as both lengths (and a table of positions, page size 1) and reads the chosen
positions. Every position is below the query's (the current token is the last stored one), so the
view respects the causal invariant by construction.

The Triton selection generalises select_pages' k-th largest over order-preserving integer keys
(kernels/page_select.py) to rows far longer than one program can hold: it finds the keep-th largest
score key of a row by radix select, 8 bits at a time from the top, over blocks of the row in
parallel (a histogram per block, then one small program per row picks the bin that holds the
keep-th key), then writes the chosen slots through per-block counts.
"""
import torch

from sparsevllm.kernels.common import jit, pow2, tl, use_triton

SELECT_BLOCK = 2048   # scores per selection program (one histogram of 256 bins each)


def key_slots(block_tables: torch.Tensor, page_size: int) -> torch.Tensor:
    """[B, N] page table -> [B, N * P] slot of every position."""
    P = page_size
    pos = torch.arange(block_tables.shape[1] * P, device=block_tables.device)
    return block_tables.long()[:, pos // P] * P + pos % P


def select_tokens_ref(scores: torch.Tensor, keep: torch.Tensor, block_tables: torch.Tensor,
                      cache_lens: torch.Tensor, prompt_lens: torch.Tensor,
                      page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """scores: [B, T] fp32 (T = N * P; entries past the prompt are ignored); keep, cache_lens,
    prompt_lens: [B] int -> (table [B, 1, T] int32 of slots, lengths [B, 1] int32); keep is
    clamped to the prompt length."""
    B, T = scores.shape
    pos = torch.arange(T, device=scores.device)
    plen = torch.minimum(prompt_lens, cache_lens).long().view(B, 1)
    # Rank the prompt positions by score, ties to the earlier position: a stable sort of the
    # descending scores (positions past the prompt may hold scores too; they never compete).
    order = torch.sort(scores.masked_fill(pos >= plen, float("-inf")), dim=-1, descending=True,
                       stable=True).indices
    rank = torch.empty_like(order).scatter_(1, order, pos.expand(B, T).contiguous())
    chosen = (rank < torch.minimum(keep.long().view(B, 1), plen)) & (pos < plen)
    generated = (pos >= plen) & (pos < cache_lens.long().view(B, 1))
    attended = chosen | generated
    # Attended positions first, in logical order (a stable sort of "not attended").
    first = torch.sort((~attended).to(torch.int8), dim=-1, stable=True).indices
    slots = key_slots(block_tables, page_size).gather(1, first)
    lengths = attended.sum(dim=-1, dtype=torch.int32).view(B, 1)
    table = torch.where(pos.view(1, T) < lengths, slots, torch.zeros_like(slots))
    return table.to(torch.int32).view(B, 1, T), lengths


@jit
def _ukey(x):
    """fp32 -> int64 in [0, 2^32) with the same order (negative floats get their magnitude bits flipped)."""
    bits = x.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return key.to(tl.int64) + 2147483648


@jit
def _candidates(score_ptr, stride_sb, plen_ptr, len_ptr, b, blk, BLOCK: tl.constexpr):
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    plen = tl.minimum(tl.load(plen_ptr + b), tl.load(len_ptr + b))
    cand = offs < plen
    ukey = _ukey(tl.load(score_ptr + b * stride_sb + offs, mask=cand, other=0.0))
    return offs, plen, cand, ukey


@jit
def _radix_hist_kernel(score_ptr, plen_ptr, len_ptr, state_ptr, hist_ptr, stride_sb, NBLK,
                       SHIFT: tl.constexpr, BLOCK: tl.constexpr):
    # Histogram of the next 8 bits of the keys whose higher bits equal the row's prefix so far.
    b = tl.program_id(0)
    blk = tl.program_id(1)
    offs, plen, cand, ukey = _candidates(score_ptr, stride_sb, plen_ptr, len_ptr, b, blk, BLOCK)
    prefix = tl.load(state_ptr + b * 2)
    if SHIFT < 24:
        cand = cand & ((ukey >> (SHIFT + 8)) == prefix)
    digit = tl.where(cand, (ukey >> SHIFT) & 255, 256 + (offs & 255)).to(tl.int32)   # others: bins 256..511
    bins = tl.arange(0, 512)
    tl.store(hist_ptr + (b * NBLK + blk) * 256 + bins, tl.histogram(digit, 512), mask=bins < 256)


@jit
def _radix_pick_kernel(keep_ptr, plen_ptr, len_ptr, state_ptr, hist_ptr, NBLK,
                       FIRST: tl.constexpr, BLOCK_B: tl.constexpr):
    # Sum the row's block histograms; the digit holding the remaining-th largest key extends the
    # prefix, and the keys above that digit's bin leave the count.
    b = tl.program_id(0)
    digits = tl.arange(0, 256)
    counts = tl.zeros([256], tl.int32)
    for blk0 in range(0, NBLK, BLOCK_B):
        blks = blk0 + tl.arange(0, BLOCK_B)
        h = tl.load(hist_ptr + (b * NBLK + blks)[:, None] * 256 + digits[None, :],
                    mask=(blks < NBLK)[:, None], other=0)
        counts += tl.sum(h, 0)
    if FIRST:
        plen = tl.minimum(tl.load(plen_ptr + b), tl.load(len_ptr + b))
        remaining = tl.minimum(tl.load(keep_ptr + b), plen).to(tl.int64)
        prefix = tl.zeros([], tl.int64)
    else:
        prefix = tl.load(state_ptr + b * 2)
        remaining = tl.load(state_ptr + b * 2 + 1)
    at_least = (tl.sum(counts, 0) - tl.cumsum(counts, 0) + counts).to(tl.int64)   # keys with digit >= d
    d = tl.max(tl.where(at_least >= remaining, digits, 0), 0)
    above = tl.sum(tl.where(digits > d, counts, 0), 0).to(tl.int64)
    tl.store(state_ptr + b * 2, prefix * 256 + d)
    tl.store(state_ptr + b * 2 + 1, remaining - above)


@jit
def _count_kernel(score_ptr, plen_ptr, len_ptr, state_ptr, cnt_ptr, stride_sb, NBLK, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    blk = tl.program_id(1)
    offs, plen, cand, ukey = _candidates(score_ptr, stride_sb, plen_ptr, len_ptr, b, blk, BLOCK)
    t = tl.load(state_ptr + b * 2)
    tl.store(cnt_ptr + (b * NBLK + blk) * 2, tl.sum((cand & (ukey > t)).to(tl.int32), 0))
    tl.store(cnt_ptr + (b * NBLK + blk) * 2 + 1, tl.sum((cand & (ukey == t)).to(tl.int32), 0))


@jit
def _write_kernel(score_ptr, keep_ptr, plen_ptr, len_ptr, state_ptr, cnt_ptr, table_ptr, out_ptr, out_len_ptr,
                  stride_sb, stride_tb, stride_ob, NBLK, P: tl.constexpr, BLOCK: tl.constexpr,
                  BLOCK_B: tl.constexpr):
    # The chosen prompt positions of this block (above the threshold, or tied with it within the
    # remaining count, earlier positions first) and the generated positions, as slots, in order.
    b = tl.program_id(0)
    blk = tl.program_id(1)
    offs, plen, cand, ukey = _candidates(score_ptr, stride_sb, plen_ptr, len_ptr, b, blk, BLOCK)
    length = tl.load(len_ptr + b)
    keep = tl.minimum(tl.load(keep_ptr + b), plen)
    t = tl.load(state_ptr + b * 2)
    ties_wanted = tl.load(state_ptr + b * 2 + 1).to(tl.int32)
    above_before = tl.zeros([], tl.int32)
    ties_before = tl.zeros([], tl.int32)
    for blk0 in range(0, NBLK, BLOCK_B):
        blks = blk0 + tl.arange(0, BLOCK_B)
        earlier = blks < blk
        above_before += tl.sum(tl.load(cnt_ptr + (b * NBLK + blks) * 2, mask=earlier, other=0), 0)
        ties_before += tl.sum(tl.load(cnt_ptr + (b * NBLK + blks) * 2 + 1, mask=earlier, other=0), 0)
    above = cand & (ukey > t)
    tie = cand & (ukey == t)
    chosen = above | (tie & (ties_before + tl.cumsum(tie.to(tl.int32), 0) <= ties_wanted))
    start = above_before + tl.minimum(ties_before, ties_wanted)
    generated = (offs >= plen) & (offs < length)
    index = tl.where(chosen, start + tl.cumsum(chosen.to(tl.int32), 0) - 1, keep + offs - plen)
    write = chosen | generated
    page = tl.load(table_ptr + b * stride_tb + offs // P, mask=write, other=0)
    tl.store(out_ptr + b * stride_ob + index, page * P + offs % P, mask=write)
    if blk == 0:
        tl.store(out_len_ptr + b, keep + length - plen)


def select_tokens_triton(scores: torch.Tensor, keep: torch.Tensor, block_tables: torch.Tensor,
                         cache_lens: torch.Tensor, prompt_lens: torch.Tensor,
                         page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as select_tokens_ref: a radix select of the keep-th largest score key, 8 bits
    a pass (histograms per block of SELECT_BLOCK scores, one pick program per row), then per-block
    counts and one write pass. 10 launches a filter layer, all sized by static shapes."""
    B, T = scores.shape
    P, N = int(page_size), block_tables.shape[1]
    assert T == N * P and scores.dtype == torch.float32 and scores.stride(-1) == 1
    assert block_tables.stride(-1) == 1 and keep.shape == cache_lens.shape == prompt_lens.shape == (B,)
    keep, cache_lens, prompt_lens = keep.contiguous(), cache_lens.contiguous(), prompt_lens.contiguous()   # ptr + b
    dev = scores.device
    nblk = -(-T // SELECT_BLOCK)
    state = torch.empty(B, 2, dtype=torch.int64, device=dev)
    hist = torch.empty(B, nblk, 256, dtype=torch.int32, device=dev)
    cnt = torch.empty(B, nblk, 2, dtype=torch.int32, device=dev)
    table = torch.empty(B, 1, T, dtype=torch.int32, device=dev)   # read only up to each row's length
    lengths = torch.empty(B, 1, dtype=torch.int32, device=dev)
    block_b = min(64, pow2(nblk))
    for shift in (24, 16, 8, 0):
        _radix_hist_kernel[(B, nblk)](scores, prompt_lens, cache_lens, state, hist, scores.stride(0), nblk,
                                      SHIFT=shift, BLOCK=SELECT_BLOCK, num_warps=8)
        _radix_pick_kernel[(B,)](keep, prompt_lens, cache_lens, state, hist, nblk, FIRST=shift == 24,
                                 BLOCK_B=block_b, num_warps=4)
    _count_kernel[(B, nblk)](scores, prompt_lens, cache_lens, state, cnt, scores.stride(0), nblk,
                             BLOCK=SELECT_BLOCK, num_warps=8)
    _write_kernel[(B, nblk)](scores, keep, prompt_lens, cache_lens, state, cnt, block_tables, table, lengths,
                             scores.stride(0), block_tables.stride(0), table.stride(0), nblk, P=P,
                             BLOCK=SELECT_BLOCK, BLOCK_B=block_b, num_warps=8)
    return table, lengths


def select_tokens(scores, keep, block_tables, cache_lens, prompt_lens, page_size):
    if use_triton(scores):
        return select_tokens_triton(scores, keep, block_tables, cache_lens, prompt_lens, page_size)
    return select_tokens_ref(scores, keep, block_tables, cache_lens, prompt_lens, page_size)

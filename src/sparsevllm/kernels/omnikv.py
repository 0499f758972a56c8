"""OmniKV's two kernels: a filter layer's token scores, and the top-n selection into a decode view.

omnikv_scores: for request b and every prompt position j (j < prompt_lens[b]), the filter layer's
score of token j from its current decode query: "last" (OmniKV's default) takes the raw logit
max over query heads h of q_h . k_j * scale; "softmax_max" takes the max over heads of the softmax
probability (normalised over every stored token of the request, as that head's attention does).
Positions at or past the prompt length score -inf: generated tokens are always attended, never
selected. Keys are read through the block table (P = page_size), so the scores are a [B, N * P]
row per request whatever the pages are.

select_tokens: per request, the top keep[b] prompt positions by score (ties to the earlier
position) followed by every generated position [prompt_lens[b], cache_lens[b]), as pool slots in
logical order: a decode view with page size 1 and one token set for all heads (G = 1). Every
position is below the query's (the current token is the last generated one), so the view respects
the causal invariant by construction.

The Triton selection generalises Quest's k-th-largest-by-bits to rows far longer than one program
can hold: it finds the keep-th largest score key of a row by radix select, 8 bits at a time from the
top, over blocks of the row in parallel (a histogram per block, then one small program per row
picks the bin that holds the keep-th key), then writes the chosen slots through per-block counts.
"""
import torch

from sparsevllm.kernels.common import dot_precision, jit, pow2, tl, upcast_loads, use_triton

SELECTORS = ("last", "softmax_max")
BLOCK_T = 64        # tokens per scoring program
SELECT_BLOCK = 2048   # scores per selection program (one histogram of 256 bins each)


def _key_slots(block_tables: torch.Tensor, page_size: int) -> torch.Tensor:
    """[B, N] page table -> [B, N * P] slot of every position."""
    P = page_size
    pos = torch.arange(block_tables.shape[1] * P, device=block_tables.device)
    return block_tables.long()[:, pos // P] * P + pos % P


# ---------------------------------------------------------------- scores

def omnikv_scores_ref(q: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor,
                      cache_lens: torch.Tensor, prompt_lens: torch.Tensor, page_size: int, scale: float,
                      selector: str) -> torch.Tensor:
    """q: [B, H_q, D] (after RoPE); k_cache: [num_slots, H_kv, D]; block_tables: [B, N] int32;
    cache_lens, prompt_lens: [B] int -> fp32 [B, N * P], -inf at positions >= prompt_lens[b]."""
    B, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    slots = _key_slots(block_tables, page_size)                                    # [B, T]
    T = slots.shape[1]
    pos = torch.arange(T, device=q.device)
    keys = k_cache[slots].float().repeat_interleave(Hq // Hkv, dim=2)              # [B, T, H_q, D]
    logits = torch.einsum("bhd,bthd->bht", q.float(), keys) * scale                # [B, H_q, T]
    if selector == "softmax_max":
        stored = pos.view(1, 1, T) < cache_lens.long().view(B, 1, 1)
        logits = logits.masked_fill(~stored, float("-inf")).softmax(dim=-1)
    scores = logits.amax(dim=1)
    candidate = pos.view(1, T) < torch.minimum(prompt_lens, cache_lens).long().view(B, 1)
    return scores.masked_fill(~candidate, float("-inf"))


@jit
def _scores_kernel(q_ptr, k_ptr, table_ptr, len_ptr, plen_ptr, lse_ptr, out_ptr, stat_ptr, qk_scale,
                   stride_qb, stride_qh, stride_ks, stride_kh, stride_tb, stride_ob,
                   stride_sb, stride_sh, stride_sblk,
                   HKV: tl.constexpr, QG: tl.constexpr, P: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr, MODE: tl.constexpr,
                   UPCAST: tl.constexpr, DOT_PREC: tl.constexpr):
    # MODE 0: raw logits, max over heads ("last"). MODE 1: per-head (max, sum of exp) of this block
    # over every stored token (softmax_max, first pass). MODE 2: max over heads of exp(logit - lse).
    # Logits are kept in the log2 domain (qk_scale includes log2 e); MODE 0 converts back.
    b = tl.program_id(0)
    blk = tl.program_id(1)
    length = tl.load(len_ptr + b)
    plen = tl.minimum(tl.load(plen_ptr + b), length)
    toks = blk * BLOCK_T + tl.arange(0, BLOCK_T)
    limit = length if MODE == 1 else plen
    rows = tl.arange(0, BLOCK_H)
    row_ok = rows < QG
    if blk * BLOCK_T >= limit:   # past the request: nothing to score
        if MODE == 1:
            for kvh in range(HKV):
                stat = stat_ptr + b * stride_sb + (kvh * QG + rows) * stride_sh + blk * stride_sblk
                tl.store(stat, tl.full([BLOCK_H], float("-inf"), tl.float32), mask=row_ok)
                tl.store(stat + 1, tl.zeros([BLOCK_H], tl.float32), mask=row_ok)
        else:
            tl.store(out_ptr + b * stride_ob + toks, tl.full([BLOCK_T], float("-inf"), tl.float32))
        return
    tok_ok = toks < limit
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    page = tl.load(table_ptr + b * stride_tb + toks // P, mask=tok_ok, other=0)
    slot = page.to(tl.int64) * P + toks % P
    best = tl.full([BLOCK_T], float("-inf"), tl.float32)
    for kvh in range(HKV):
        heads = kvh * QG + rows
        q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + dims[None, :],
                    mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
        k = tl.load(k_ptr + slot[:, None] * stride_ks + kvh * stride_kh + dims[None, :],
                    mask=tok_ok[:, None] & dim_ok[None, :], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale        # [BLOCK_H, BLOCK_T]
        s = tl.where(row_ok[:, None] & tok_ok[None, :], s, float("-inf"))
        if MODE == 1:
            m = tl.max(s, 1)
            m_safe = tl.where(m == float("-inf"), 0.0, m)
            l = tl.sum(tl.exp2(s - m_safe[:, None]), 1)
            stat = stat_ptr + b * stride_sb + heads * stride_sh + blk * stride_sblk
            tl.store(stat, m, mask=row_ok)
            tl.store(stat + 1, l, mask=row_ok)
        else:
            if MODE == 2:
                lse = tl.load(lse_ptr + b * (HKV * QG) + heads, mask=row_ok, other=0.0)
                s = tl.exp2(s - lse[:, None])
            best = tl.maximum(best, tl.max(s, 0))
    if MODE != 1:
        if MODE == 0:
            best = best * 0.6931471805599453   # log2 domain -> natural logits
        tl.store(out_ptr + b * stride_ob + toks, tl.where(tok_ok, best, float("-inf")))


def omnikv_scores_triton(q: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor,
                         cache_lens: torch.Tensor, prompt_lens: torch.Tensor, page_size: int, scale: float,
                         selector: str) -> torch.Tensor:
    """Same contract as omnikv_scores_ref; one program per (request, block of BLOCK_T positions).
    Programs past the prompt write -inf and exit, so the work follows the prompt, not the table."""
    B, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    P, N = int(page_size), block_tables.shape[1]
    T = N * P
    assert Hq % Hkv == 0 and q.stride(-1) == 1 and k_cache.stride(-1) == 1 and block_tables.stride(-1) == 1
    assert cache_lens.shape == (B,) and prompt_lens.shape == (B,) and selector in SELECTORS
    cache_lens, prompt_lens = cache_lens.contiguous(), prompt_lens.contiguous()   # read as ptr + b
    nblk = -(-T // BLOCK_T)
    out = torch.empty(B, nblk * BLOCK_T, dtype=torch.float32, device=q.device)
    QG = Hq // Hkv
    common = dict(HKV=Hkv, QG=QG, P=P, HEAD_DIM=D, BLOCK_D=pow2(D), BLOCK_H=max(16, pow2(QG)),
                  BLOCK_T=BLOCK_T, UPCAST=upcast_loads(q.dtype), DOT_PREC=dot_precision(q.dtype), num_warps=4)
    args = (q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), block_tables.stride(0), out.stride(0))
    qk_scale = scale * 1.4426950408889634
    lse = out   # unused unless softmax_max
    stats = out
    if selector == "softmax_max":
        stats = torch.empty(B, Hq, nblk, 2, dtype=torch.float32, device=q.device)
        _scores_kernel[(B, nblk)](q, k_cache, block_tables, cache_lens, prompt_lens, out, out, stats, qk_scale,
                                  *args, stats.stride(0), stats.stride(1), stats.stride(2), MODE=1, **common)
        # Blocks past a request's length wrote (-inf, 0); merge the rest into one log2-sum-exp per head.
        m, l = stats[..., 0], stats[..., 1]
        top = m.amax(dim=-1, keepdim=True)
        top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
        lse = (top.squeeze(-1) + torch.log2((l * torch.exp2(m - top)).nan_to_num(0.0).sum(-1))).contiguous()
    _scores_kernel[(B, nblk)](q, k_cache, block_tables, cache_lens, prompt_lens, lse, out, stats, qk_scale,
                              *args, 0, 0, 0, MODE=2 if selector == "softmax_max" else 0, **common)
    return out[:, :T]


def omnikv_scores(q, k_cache, block_tables, cache_lens, prompt_lens, page_size, scale, selector):
    if use_triton(q):
        return omnikv_scores_triton(q, k_cache, block_tables, cache_lens, prompt_lens, page_size, scale, selector)
    return omnikv_scores_ref(q, k_cache, block_tables, cache_lens, prompt_lens, page_size, scale, selector)


# ---------------------------------------------------------------- selection

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
    slots = _key_slots(block_tables, page_size).gather(1, first)
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

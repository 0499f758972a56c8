"""Decode attention over a DecodeView.

A decode view is (table[B, G, N] int32, lengths[B, G] int32, page_size): row (b, g) attends to the
tokens of pages table[b, g, :ceil(len / P)], the last page possibly partial. G is 1 (one token set
shared by every KV head), H_kv (a set per KV head) or H_q (a set per query head, as selection
methods written for multi-head attention pick them; the group's query heads then read their KV
head's pages separately). Token-wise selection is the case P = 1.

The Triton path is split-K flash-decoding: one program per (request, KV head, split) holds every
query head of the KV group as the rows of one tl.dot (padded to 16 rows so the tensor cores take
it; with G = H_q a program holds one query head), walks its share of the row's tokens with an
online softmax and writes a partial output and its log-sum-exp; a second small kernel merges the
splits (a single split writes the output itself). The split count depends only on static
shapes (B, H_kv, N, P), never on the lengths, so a CUDA graph captured per batch bucket replays
correctly for any lengths: each row divides its own length over the splits in-kernel, and splits
left empty write lse = -inf which the merge ignores.

An FP8 cache (kv_cache_dtype="fp8") passes k_scale / v_scale, [num_slots, H_kv] fp32: a stored
token's K (V) of KV head h is k_cache[slot, h] * k_scale[slot, h]. The kernel widens the fp8 tiles
in registers, scales the logits' columns by the keys' scales and the values' rows by theirs: no
dequantized copy of the cache is ever made (engine/kv_pool.py says why a scale per token and head).
"""

import os

import torch

from sparsevllm.kernels.common import dot_precision, gdc_launch_dependents, gdc_wait, jit, pdl, pow2, sm_count, tl
from sparsevllm.kernels.common import e4m3_tile, upcast_loads, use_triton, word_aligned

# Both kernels launch as programmatic dependent launches (common.pdl): each starts while the kernel
# before it drains and waits for its output in gdc_wait; SPARSEVLLM_PDL_ATTENTION=0 turns it off (A/B).
PDL_ATTENTION = os.environ.get("SPARSEVLLM_PDL_ATTENTION", "1") != "0"
# Launch settings: the best of a sweep on the H200 (scripts/benchmarks/bench_kernels.py --sweep).
BLOCK_N = 64        # tokens per inner step
NUM_WARPS = 4
NUM_STAGES = 3
# Below this a split's fixed cost outweighs the parallelism it buys. 64 (one block) against 256, graph-timed
# on the H200 at the benchmark's table widths: 4K x 1 9.81 -> 9.52 us, a Quest view of 2,048 tokens
# per KV head x 4 12.76 -> 11.56 us, 4K x 32 and 32K x 1 unchanged (PROGRAMS_PER_SM 8 or 16 and
# BLOCK_N 32 were slower everywhere).
MIN_SPLIT_TOKENS = 64
PROGRAMS_PER_SM = 4     # enough resident programs to keep HBM busy across all SMs
# Reporting token scores: a store per block inside the loop slowed a dense 128K x 4 view from 478 to
# 617 us at its best launch (8 warps; graph-timed on the H200, Llama-3.1-8B heads, `.probe`-style copy of
# this kernel). Staging them in registers and storing once after the loop, with enough splits that a
# split's blocks fit MAX_SCORE_ITERS, takes it to 488 us at 4 warps and 2 stages (S = 64; 8 warps: 568).
SCORES_NUM_WARPS = 4
SCORES_NUM_STAGES = 2
MAX_SCORE_ITERS = 32    # blocks of staged token scores a program holds (32 x 64 fp32: 16 registers a thread at 4 warps)

# An FP8 cache's tiles widen to fp16 (one native convert per pair of e4m3, exact), q goes in as fp16
# (exact from bf16 within fp16's normal range, 6e-5 to 65504), and the values' scales weigh p's
# [heads, block] columns instead of v's [block, D] rows. Widening to bf16 and scaling v in fp32 made FP8
# decode slower than bf16: one layer at 128K x 4 on an H100, 783 -> 493 us (bf16 cache 697 us;
# docs/performance.md, FP8 section).
# On by default since the GPU tests passed with it (H100, 2026-12-07: graph == eager, overlap == sync, the
# kernels against their references); SPARSEVLLM_FP8_F16=0 gives the bf16-tile path (A/B). An fp32 q keeps
# its precision either way.
FP8_F16 = os.environ.get("SPARSEVLLM_FP8_F16", "1") == "1"
# Its blocks are twice as long (half the bytes each; a view's token scores keep BLOCK_N's registers).
FP8_BLOCK_N = 128
FP8_NUM_STAGES = 2
# Its program needs 168 registers (Triton 3.6, sm_90), so 3 fit an SM, not 4: PROGRAMS_PER_SM's 4 made 1.3
# waves (512 programs on 396 slots at 128K x 4). 6 makes two full waves: one layer at 128K x 4 on an H200,
# 477.3 -> 387.7 us (bf16 cache 495.3 us); the engine's 128K x 4 decode 222.66 -> 242.27 tok/s (auto 206.33).
# 3 an SM times the same on both cards (H200 388.4, H100 402.0 against 403.2 us).
FP8_PROGRAMS_PER_SM = int(os.environ.get("SPARSEVLLM_FP8_PROGRAMS_PER_SM", "6"))
# 4 warps: 168 registers, 3 programs (12 warps) an SM, 1,380 loop instructions a 128-token block. Not yet
# timed on a GPU: 8 warps (154 registers, 1 program an SM) and, with V_WORDS, 8 warps at 118 registers,
# 2 programs (16 warps) an SM (ptxas of Triton 3.6 for sm_90, compiled on the CPU, 2026-12-08);
# SPARSEVLLM_FP8_NUM_WARPS and `bench_kernels.py --sweep-fp8` try them.
FP8_NUM_WARPS = int(os.environ.get("SPARSEVLLM_FP8_NUM_WARPS", "4"))
# (A register cap of 128, so that 4 fit, spilled and was slower at every split count: not kept.)
# V is p @ v's second operand, whose contraction runs over tokens: read from shared memory as e4m3, each
# thread gathers 4 tokens' bytes of one column one byte at a time (128 LDS.U8 a 128-token block in the
# SASS, Triton 3.6, sm_90). Read as int32 words and widened in registers (FP8_V_WORDS), the fp16 tile
# takes the path a bf16 V takes (ldmatrix.trans). It passes the GPU tests but measured slower (H100, one
# layer at 128K x 4: bytes 402.0 us at 3 programs an SM, V words 490.5 at its best, V and K words 426.9;
# docs/performance.md, 2026-12-07 22:55), so it stays off: SPARSEVLLM_FP8_V_WORDS=1 turns it on for
# another card (`bench_kernels.py --sweep-fp8` decides).
FP8_V_WORDS = os.environ.get("SPARSEVLLM_FP8_V_WORDS", "0") == "1"
# K's operand reads 8 bytes at a time as e4m3 already; words for K too need fewer registers (150 against
# 194 at BLOCK_N 128, so 3 programs fit an SM) but were no faster than bytes either (above).
FP8_K_WORDS = os.environ.get("SPARSEVLLM_FP8_K_WORDS", "0") == "1"

LN2 = 0.6931471805599453   # log-sum-exps leave the kernels in log2 units


def dequant(cache: torch.Tensor, scale: torch.Tensor | None, index: tuple) -> torch.Tensor:
    """cache[index] in fp32, times its scales where the cache is FP8 (only the gathered tokens)."""
    x = cache[index].float()
    return x if scale is None else x * scale[index].unsqueeze(-1)


def decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         table: torch.Tensor, lengths: torch.Tensor, page_size: int,
                         scale: float, token_scores: torch.Tensor | None = None,
                         k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                         lse_out: torch.Tensor | None = None) -> torch.Tensor:
    """q: [B, H_q, D]; k_cache, v_cache: [num_slots, H_kv, D] -> out [B, H_q, D] in q's dtype.
    k_scale, v_scale: [num_slots, H_kv] fp32 scales of an FP8 cache, or None (the cache is the values).

    token_scores (G = 1 or H_kv): an fp32 [B, H_kv, >= N * P] buffer; entry (b, g, t) is set to the
    max over KV group g's query heads of the raw logit q . k_t * scale, k_t the t-th token of row
    (b, g) (G = 1: of row b), for every t < its length (entries past it are left as they are). A
    view per KV head whose rows are one token set repeated (an engine mixing methods) reports the
    same scores as that set's G = 1 view. A filter layer's dense attention reports its token
    scores this way (OmniKV) instead of reading the keys a second time; the max over g is the
    caller's. One writer per entry: no atomics, no -inf fill. A row of length 0 outputs zeros.

    lse_out (optional): an fp32 [B, H_q] buffer set to each query head's natural log-sum-exp of its
    scaled logits over the view (-inf for a row of length 0): two views' difference of it is the
    share of one's softmax mass on the other's tokens (attention recall, engine/recall.py)."""
    B, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    G, N = table.shape[1], table.shape[2]
    assert G in (1, Hkv, Hq), f"decode view G={G} must be 1, num_kv_heads={Hkv} or num_heads={Hq}"
    P = page_size
    T = N * P
    offs = torch.arange(T, device=q.device)
    # Slots of every candidate token; padded table entries point at page 0 and are masked below.
    slots = (table.long().unsqueeze(-1) * P + torch.arange(P, device=q.device)).reshape(B, G, T)
    valid = offs.view(1, 1, T) < lengths.long().unsqueeze(-1)              # [B, G, T]
    if G == Hq and Hq != Hkv:   # a token set per query head: each row is a group of one
        assert token_scores is None, "token_scores needs a decode view of G = 1 or num_kv_heads"
        heads = (torch.arange(Hq, device=q.device) // (Hq // Hkv)).view(1, Hq, 1)
        k, v = dequant(k_cache, k_scale, (slots, heads)), dequant(v_cache, v_scale, (slots, heads))   # [B, H_q, T, D]
        scores = torch.einsum("bhd,bhtd->bht", q.float(), k) * scale
        scores = scores.masked_fill(~valid, float("-inf"))
        if lse_out is not None:
            lse_out.copy_(torch.logsumexp(scores, dim=-1))
        probs = torch.softmax(scores, dim=-1)
        probs = probs.masked_fill(~valid, 0.0)   # an empty row (length 0): zeros as the kernel, not NaN
        return torch.einsum("bht,bhtd->bhd", probs, v).to(q.dtype)
    if G == 1:
        k = dequant(k_cache, k_scale, (slots[:, 0],)).transpose(1, 2)     # [B, H_kv, T, D]
        v = dequant(v_cache, v_scale, (slots[:, 0],)).transpose(1, 2)
        valid = valid.expand(B, Hkv, T)
    else:
        heads = torch.arange(Hkv, device=q.device).view(1, Hkv, 1)
        k = dequant(k_cache, k_scale, (slots, heads))                     # [B, H_kv, T, D]
        v = dequant(v_cache, v_scale, (slots, heads))
    qg = q.float().view(B, Hkv, Hq // Hkv, D)
    scores = torch.einsum("bhgd,bhtd->bhgt", qg, k.float()) * scale
    scores = scores.masked_fill(~valid.unsqueeze(2), float("-inf"))
    if token_scores is not None:
        best = scores.amax(dim=2)                                          # [B, H_kv, T]
        token_scores[:, :, :T] = torch.where(valid, best, token_scores[:, :, :T])
    if lse_out is not None:
        lse_out.copy_(torch.logsumexp(scores, dim=-1).reshape(B, Hq))
    probs = torch.softmax(scores, dim=-1).masked_fill(~valid.unsqueeze(2), 0.0)   # length 0: zeros, not NaN
    out = torch.einsum("bhgt,bhtd->bhgd", probs, v.float())
    return out.reshape(B, Hq, D).to(q.dtype)


@jit
def _decode_split_kernel(
        q_ptr, k_ptr, v_ptr, table_ptr, len_ptr, mid_o_ptr, mid_lse_ptr, out_ptr, tok_ptr, qk_scale,
        ks_ptr, vs_ptr, stride_ss, stride_sh,
        stride_qb, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh,
        stride_tb, stride_tg, stride_lb, stride_lg,
        stride_ob, stride_oh, stride_os, stride_lseb, stride_lseh, stride_outb, stride_outh,
        stride_tokb, stride_tokh,
        NUM_SPLITS,
        QG: tl.constexpr, KV_DIV: tl.constexpr, P: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
        UPCAST: tl.constexpr, DOT_PREC: tl.constexpr, DIRECT: tl.constexpr, TOKEN_SCORES: tl.constexpr,
        SCORE_ITERS: tl.constexpr, SCALED: tl.constexpr = False, F16: tl.constexpr = False,
        V_WORDS: tl.constexpr = False, K_WORDS: tl.constexpr = False, V_ASM: tl.constexpr = False,
        PDL: tl.constexpr = False):
    if PDL:   # everything read here (q, the cache, the view) comes from the kernels before
        gdc_wait()
    b = tl.program_id(0)
    h = tl.program_id(1)        # the view row: a KV head (QG query heads), or a query head (QG = 1)
    split = tl.program_id(2)
    kvh = h // KV_DIV
    # stride_tg / stride_lg are 0 when G == 1: every KV head reads the same token set.
    length = tl.load(len_ptr + b * stride_lb + h * stride_lg)
    per_split = tl.cdiv(tl.cdiv(length, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, length)

    rows = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    row_ok = rows < QG
    dim_ok = dims < HEAD_DIM
    heads = h * QG + rows
    lse_ptrs = mid_lse_ptr + b * stride_lseb + heads * stride_lseh + split
    o_ptrs = (mid_o_ptr + b * stride_ob + heads[:, None] * stride_oh + split * stride_os
              + dims[None, :])
    # One split (DIRECT): the program owns the whole row and writes the final output, no merge.
    out_ptrs = out_ptr + b * stride_outb + heads[:, None] * stride_outh + dims[None, :]
    if start >= end:  # a split past this row's length: contributes nothing to the merge
        if DIRECT:
            tl.store(out_ptrs, tl.zeros([BLOCK_H, BLOCK_D], tl.float32).to(out_ptr.dtype.element_ty),
                     mask=row_ok[:, None] & dim_ok[None, :])
        else:
            tl.store(lse_ptrs, tl.full([BLOCK_H], float("-inf"), tl.float32), mask=row_ok)
            tl.store(o_ptrs, tl.zeros([BLOCK_H, BLOCK_D], tl.float32), mask=row_ok[:, None] & dim_ok[None, :])
        return

    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    if F16:   # unscaled, so exact (a version that rounded q * qk_scale to fp16 failed graph == eager on the GPU)
        q = q.to(tl.float16)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    table_row = table_ptr + b * stride_tb + h * stride_tg
    # Token scores are staged in registers, a row per block of the split, and stored once after the
    # loop: a store inside the loop cost a 128K x 4 filter layer 478 -> 676 us on the H200.
    staged = tl.full([SCORE_ITERS, BLOCK_N], float("-inf"), tl.float32)
    iters = tl.arange(0, SCORE_ITERS)
    for t0 in range(start, end, BLOCK_N):
        toks = t0 + tl.arange(0, BLOCK_N)
        tok_ok = toks < end
        page = tl.load(table_row + toks // P, mask=tok_ok, other=0)
        # int64 before the stride multiply: slot * stride overflows int32 on large pools.
        slot = page.to(tl.int64) * P + toks % P
        kv_mask = tok_ok[:, None] & dim_ok[None, :]
        if K_WORDS:   # the same for K (FP8_K_WORDS)
            k = e4m3_tile(k_ptr, slot, kvh, stride_ks, stride_kh, tok_ok, HEAD_DIM, BLOCK_N, BLOCK_D, V_ASM)
        else:
            k = tl.load(k_ptr + slot[:, None] * stride_ks + kvh * stride_kh + dims[None, :],
                        mask=kv_mask, other=0.0)
        if V_WORDS:   # an FP8 V read as 4-byte words and unpacked here (V_WORDS at the top of the file says why)
            v = e4m3_tile(v_ptr, slot, kvh, stride_vs, stride_vh, tok_ok, HEAD_DIM, BLOCK_N, BLOCK_D, V_ASM)
        else:
            v = tl.load(v_ptr + slot[:, None] * stride_vs + kvh * stride_vh + dims[None, :],
                        mask=kv_mask, other=0.0)
        k = k.to(q.dtype)   # widened in registers (UPCAST: fp32; an FP8 cache: q's dtype, fp16 under F16)
        if SCALED:   # FP8: a key's scale multiplies its logit column, a value's scale its row (or p's column)
            s_off = slot * stride_ss + kvh * stride_sh
            v_s = tl.load(vs_ptr + s_off, mask=tok_ok, other=0.0)
            if F16:
                v = v.to(q.dtype)
            else:
                v = (v.to(tl.float32) * v_s[:, None]).to(q.dtype)
        else:
            v = v.to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale   # log2 domain
        if SCALED:
            s = s * tl.load(ks_ptr + s_off, mask=tok_ok, other=0.0)[None, :]
        s = tl.where(tok_ok[None, :], s, float("-inf"))
        if TOKEN_SCORES:   # max over this KV group's heads, a row per group: plain stores (atomics
            # across the groups' programs cost 0.4 ms a filter layer at 128K x 4 on the H200)
            best = tl.max(tl.where(row_ok[:, None], s, float("-inf")), 0) * 0.6931471805599453
            staged = tl.where(iters[:, None] == (t0 - start) // BLOCK_N, best[None, :], staged)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if F16:   # the values' scales weigh p's columns, over the block's largest so p stays within [0, 1]
            v_max = tl.max(v_s, 0)
            v_max = tl.where(v_max > 0, v_max, 1.0)
            pv = tl.dot((p * (v_s / v_max)[None, :]).to(v.dtype), v, input_precision=DOT_PREC) * v_max
        else:
            pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    if PDL:   # past the loop: the next kernel may launch (it waits for this one's stores in gdc_wait)
        gdc_launch_dependents()
    if TOKEN_SCORES:
        toks = start + iters[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        tl.store(tok_ptr + b * stride_tokb + kvh * stride_tokh + toks, staged, mask=toks < end)
    if DIRECT:
        tl.store(out_ptrs, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])
    else:
        tl.store(lse_ptrs, m_i + tl.log2(l_i), mask=row_ok)
        tl.store(o_ptrs, acc / l_i[:, None], mask=row_ok[:, None] & dim_ok[None, :])


@jit
def _decode_merge_kernel(mid_o_ptr, mid_lse_ptr, out_ptr,
                         stride_ob, stride_oh, stride_os, stride_lseb, stride_lseh,
                         stride_outb, stride_outh, NUM_SPLITS,
                         BLOCK_S: tl.constexpr,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    if PDL:   # a small kernel: let the next one (o_proj's weight prefetch) start now
        gdc_launch_dependents()
        gdc_wait()
    b = tl.program_id(0)
    h = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    split_ok = splits < NUM_SPLITS
    lse = tl.load(mid_lse_ptr + b * stride_lseb + h * stride_lseh + splits, mask=split_ok,
                  other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)   # empty row (length 0): output zeros, not NaN
    w = tl.exp2(lse - m)
    o = tl.load(mid_o_ptr + b * stride_ob + h * stride_oh + splits[:, None] * stride_os + dims[None, :],
                mask=split_ok[:, None] & (dims[None, :] < HEAD_DIM), other=0.0)
    total = tl.sum(w, 0)
    out = tl.sum(o * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + b * stride_outb + h * stride_outh + dims,
             out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


def num_splits(batch: int, num_kv_heads: int, table_width: int, page_size: int,
               device: torch.device, programs_per_sm: int | None = None) -> int:
    """Splits per row: about programs_per_sm (default PROGRAMS_PER_SM) programs per SM, no split under
    MIN_SPLIT_TOKENS.

    A function of static shapes only, so a captured graph's split count is right for any lengths.
    """
    sms = sm_count(device) or 4
    want = (programs_per_sm or PROGRAMS_PER_SM) * sms // max(1, batch * num_kv_heads)
    cap = max(1, table_width * page_size // MIN_SPLIT_TOKENS)
    return int(max(1, min(want, cap, 128)))


def decode_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            table: torch.Tensor, lengths: torch.Tensor, page_size: int,
                            scale: float, token_scores: torch.Tensor | None = None,
                            k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                            lse_out: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as decode_attention_ref."""
    B, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    G, N = table.shape[1], table.shape[2]
    assert G in (1, Hkv, Hq), f"decode view G={G} must be 1, num_kv_heads={Hkv} or num_heads={Hq}"
    assert Hq % Hkv == 0 and lengths.shape == (B, G)
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert table.stride(-1) == 1
    P = int(page_size)
    per_query_head = G == Hq and Hq != Hkv
    rows = Hq if per_query_head else Hkv       # programs per request and split
    QG = 1 if per_query_head else Hq // Hkv    # query heads per program
    f16 = k_scale is not None and FP8_F16 and q.dtype != torch.float32
    fp8_launch = f16 and token_scores is None
    S = num_splits(B, rows, N, P, q.device, FP8_PROGRAMS_PER_SM if fp8_launch else None)
    block_n, stages, warps = ((FP8_BLOCK_N, FP8_NUM_STAGES, FP8_NUM_WARPS) if fp8_launch
                              else (BLOCK_N, NUM_STAGES, NUM_WARPS))
    score_iters = 1
    if token_scores is not None:   # enough splits that a split's blocks fit the staged scores
        S = max(S, -(-(N * P) // (MAX_SCORE_ITERS * BLOCK_N)))
        split_tokens = -(-(N * P) // S)                       # the kernel's per_split, before rounding
        score_iters = pow2(-(-split_tokens // BLOCK_N))
        stages = SCORES_NUM_STAGES
    out = torch.empty_like(q)
    direct = S == 1 and lse_out is None   # the log-sum-exp is the splits' (mid_lse), merged below
    mid_o = torch.empty(B, Hq, 1 if direct else S, D, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(B, Hq, 1 if direct else S, dtype=torch.float32, device=q.device)
    upcast = upcast_loads(q.dtype)
    if token_scores is not None:
        # a program per (request, KV head) writes its head's row: G = 1 or H_kv, never per query head
        assert not per_query_head and token_scores.dtype == torch.float32 and token_scores.stride(-1) == 1
        assert token_scores.shape[:2] == (B, Hkv) and token_scores.shape[2] >= N * page_size
    scaled = k_scale is not None
    if scaled:
        assert v_scale is not None and k_scale.dtype == v_scale.dtype == torch.float32
        assert k_scale.shape == v_scale.shape == k_cache.shape[:2] and k_scale.stride() == v_scale.stride()
    # K / V read as int32 words: whole words per token and head (D, the strides and the base a multiple of 4)
    v_words = f16 and FP8_V_WORDS and D % 4 == 0 and word_aligned(v_cache)
    k_words = v_words and FP8_K_WORDS and word_aligned(k_cache)
    asm = v_words and os.environ.get("TRITON_INTERPRET") != "1"   # the interpreter runs no inline PTX
    stride_tg = table.stride(1) if G > 1 else 0
    stride_lg = lengths.stride(1) if G > 1 else 0
    BLOCK_D = pow2(D)
    on = PDL_ATTENTION and pdl()
    launch = {"launch_pdl": True} if on else {}
    _decode_split_kernel[(B, rows, S)](
        q, k_cache, v_cache, table, lengths, mid_o, mid_lse, out,
        token_scores if token_scores is not None else out, scale * 1.4426950408889634,
        k_scale if scaled else mid_lse, v_scale if scaled else mid_lse, *(k_scale.stride() if scaled else (0, 0)),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1),
        table.stride(0), stride_tg, lengths.stride(0), stride_lg,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1), *(token_scores.stride()[:2] if token_scores is not None else (0, 0)),
        S, QG=QG, KV_DIV=Hq // Hkv if per_query_head else 1, P=P, HEAD_DIM=D, BLOCK_D=BLOCK_D,
        BLOCK_H=max(16, pow2(QG)), BLOCK_N=block_n,
        UPCAST=upcast, DOT_PREC=dot_precision(q.dtype), DIRECT=direct, TOKEN_SCORES=token_scores is not None,
        SCORE_ITERS=score_iters, SCALED=scaled, F16=f16, V_WORDS=v_words, K_WORDS=k_words, V_ASM=asm, PDL=on,
        num_warps=SCORES_NUM_WARPS if token_scores is not None else warps, num_stages=stages, **launch)
    if direct:
        return out
    _decode_merge_kernel[(B, Hq)](
        mid_o, mid_lse, out, mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1), out.stride(0), out.stride(1), S,
        BLOCK_S=pow2(S), HEAD_DIM=D, BLOCK_D=BLOCK_D, PDL=on, num_warps=4, **launch)
    if lse_out is not None:   # the splits' log2-domain sums, merged and taken to natural log
        lse_out.copy_(torch.logsumexp(mid_lse * LN2, dim=-1))
    return out


def decode_attention(q, k_cache, v_cache, table, lengths, page_size, scale, token_scores=None, k_scale=None,
                     v_scale=None, lse_out=None):
    if use_triton(q):
        return decode_attention_triton(q, k_cache, v_cache, table, lengths, page_size, scale, token_scores,
                                       k_scale, v_scale, lse_out)
    return decode_attention_ref(q, k_cache, v_cache, table, lengths, page_size, scale, token_scores, k_scale,
                                v_scale, lse_out)

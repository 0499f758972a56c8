"""OmniKV's kernel: a filter layer's token scores from its decode query.

omnikv_scores: for request b and every prompt position j (j < prompt_lens[b]), the filter layer's
score of token j from its current decode query: "last" (OmniKV's default) takes the raw logit
max over query heads h of q_h . k_j * scale; "softmax_max" takes the max over heads of the softmax
probability, each head's softmax normalised over the prompt's keys only (the official
softmax_before_last slices the key cache to the prefill length before its softmax), so generated
tokens do not dilute the prompt's probabilities. Positions at or past the prompt length score -inf:
generated tokens are always attended, never selected. Keys are read through the block table
(P = page_size), so the scores are a [B, N * P] row per request whatever the pages are. The top-n
selection of these scores is kernels/token_select.py's select_tokens.
"""
import torch

from sparsevllm.kernels.common import dot_precision, jit, pow2, tl, upcast_loads, use_triton
from sparsevllm.kernels.decode_attention import dequant
from sparsevllm.kernels.token_select import key_slots

SELECTORS = ("last", "softmax_max")
BLOCK_T = 64        # tokens per scoring program


def omnikv_scores_ref(q: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor,
                      cache_lens: torch.Tensor, prompt_lens: torch.Tensor, page_size: int, scale: float,
                      selector: str, k_scale: torch.Tensor | None = None) -> torch.Tensor:
    """q: [B, H_q, D] (after RoPE); k_cache: [num_slots, H_kv, D]; block_tables: [B, N] int32;
    cache_lens, prompt_lens: [B] int -> fp32 [B, N * P], -inf at positions >= prompt_lens[b].
    k_scale: [num_slots, H_kv] fp32 of an FP8 cache (the keys are k_cache * k_scale), else None."""
    B, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    slots = key_slots(block_tables, page_size)                                     # [B, T]
    T = slots.shape[1]
    pos = torch.arange(T, device=q.device)
    keys = dequant(k_cache, k_scale, (slots,)).repeat_interleave(Hq // Hkv, dim=2)  # [B, T, H_q, D]
    logits = torch.einsum("bhd,bthd->bht", q.float(), keys) * scale                # [B, H_q, T]
    candidate = pos.view(1, 1, T) < torch.minimum(prompt_lens, cache_lens).long().view(B, 1, 1)
    if selector == "softmax_max":   # each head's softmax over the prompt's keys only
        logits = logits.masked_fill(~candidate, float("-inf")).softmax(dim=-1)
    return logits.masked_fill(~candidate, float("-inf")).amax(dim=1)


@jit
def _scores_kernel(q_ptr, k_ptr, table_ptr, len_ptr, plen_ptr, lse_ptr, out_ptr, stat_ptr, qk_scale, ks_ptr, stride_ss,
                   stride_qb, stride_qh, stride_ks, stride_kh, stride_tb, stride_ob,
                   stride_sb, stride_sh, stride_sblk,
                   HKV: tl.constexpr, QG: tl.constexpr, P: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr, MODE: tl.constexpr,
                   UPCAST: tl.constexpr, DOT_PREC: tl.constexpr, SCALED: tl.constexpr = False):
    # MODE 0: raw logits, max over heads ("last"). MODE 1: per-head (max, sum of exp) of this block
    # of prompt keys (softmax_max, first pass). MODE 2: max over heads of exp(logit - lse).
    # Logits are kept in the log2 domain (qk_scale includes log2 e); MODE 0 converts back.
    # Every mode reads the prompt's keys only: softmax_max normalises over them (as the official
    # softmax_before_last does), and only they are scored.
    b = tl.program_id(0)
    blk = tl.program_id(1)
    plen = tl.minimum(tl.load(plen_ptr + b), tl.load(len_ptr + b))
    toks = blk * BLOCK_T + tl.arange(0, BLOCK_T)
    rows = tl.arange(0, BLOCK_H)
    row_ok = rows < QG
    if blk * BLOCK_T >= plen:   # past the prompt: nothing to score
        if MODE == 1:
            for kvh in range(HKV):
                stat = stat_ptr + b * stride_sb + (kvh * QG + rows) * stride_sh + blk * stride_sblk
                tl.store(stat, tl.full([BLOCK_H], float("-inf"), tl.float32), mask=row_ok)
                tl.store(stat + 1, tl.zeros([BLOCK_H], tl.float32), mask=row_ok)
        else:
            tl.store(out_ptr + b * stride_ob + toks, tl.full([BLOCK_T], float("-inf"), tl.float32))
        return
    tok_ok = toks < plen
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
        k = k.to(q.dtype)   # widened in registers (an FP8 cache: to q's dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale        # [BLOCK_H, BLOCK_T]
        if SCALED:   # FP8: a key's scale multiplies its logit column
            s = s * tl.load(ks_ptr + slot * stride_ss + kvh, mask=tok_ok, other=0.0)[None, :]
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
                         selector: str, k_scale: torch.Tensor | None = None) -> torch.Tensor:
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
                  BLOCK_T=BLOCK_T, UPCAST=upcast_loads(q.dtype), DOT_PREC=dot_precision(q.dtype),
                  SCALED=k_scale is not None, num_warps=4)
    assert k_scale is None or (k_scale.shape == k_cache.shape[:2] and k_scale.stride(1) == 1)
    scales = (k_scale, k_scale.stride(0)) if k_scale is not None else (q, 0)
    args = (q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), block_tables.stride(0), out.stride(0))
    qk_scale = scale * 1.4426950408889634
    lse = out   # unused unless softmax_max
    stats = out
    if selector == "softmax_max":
        stats = torch.empty(B, Hq, nblk, 2, dtype=torch.float32, device=q.device)
        _scores_kernel[(B, nblk)](q, k_cache, block_tables, cache_lens, prompt_lens, out, out, stats, qk_scale,
                                  *scales, *args, stats.stride(0), stats.stride(1), stats.stride(2), MODE=1, **common)
        # Blocks past a request's prompt wrote (-inf, 0); merge the rest into one log2-sum-exp per head.
        m, l = stats[..., 0], stats[..., 1]
        top = m.amax(dim=-1, keepdim=True)
        top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
        lse = (top.squeeze(-1) + torch.log2((l * torch.exp2(m - top)).nan_to_num(0.0).sum(-1))).contiguous()
    _scores_kernel[(B, nblk)](q, k_cache, block_tables, cache_lens, prompt_lens, lse, out, stats, qk_scale,
                              *scales, *args, 0, 0, 0, MODE=2 if selector == "softmax_max" else 0, **common)
    return out[:, :T]


def omnikv_scores(q, k_cache, block_tables, cache_lens, prompt_lens, page_size, scale, selector, k_scale=None):
    if use_triton(q):
        return omnikv_scores_triton(q, k_cache, block_tables, cache_lens, prompt_lens, page_size, scale, selector,
                                    k_scale)
    return omnikv_scores_ref(q, k_cache, block_tables, cache_lens, prompt_lens, page_size, scale, selector, k_scale)

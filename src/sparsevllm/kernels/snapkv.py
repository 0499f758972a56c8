"""SnapKV's observation-window scores and its kept-token selection.

`window_scores`: the last w prompt queries (the observation window) against all L prompt keys of
one request, read through its block table. Per query row: softmax in fp32 over the L keys, causal
only inside the window (window query i sits at position L - w + i and sees keys [0, L - w + i]);
the probabilities are summed over the w rows and averaged over the query heads of each KV group
-> [H_kv, L] fp32.

The Triton path never holds more than a [BLOCK_R, BLOCK_N] tile of logits. It runs two passes
over key blocks, one program per (KV head, key block): the first writes each row's block max and
block sum of exponentials (merged into a log-sum-exp per row on the host side of the launch, a
[H_kv, L / BLOCK_N, w * group] tensor), the second recomputes the logits, normalises them with that
log-sum-exp and writes the column sums of its block. Nothing of size L x L or w x L per head is
ever stored; the QK work is done twice, which at w = 32 is negligible next to the prefill itself.

`select_kept`: 1-D pooling of the prefix scores and the top (C - w) per KV head, plus the window.
"""
import torch
import torch.nn.functional as F

from sparsevllm.kernels.common import dot_precision, jit, pow2, tl, upcast_loads, use_triton
from sparsevllm.kernels.decode_attention import dequant

BLOCK_N = 64      # keys per program
MAX_BLOCK_R = 64  # query rows (window x group heads) per inner step


def window_scores_ref(q: torch.Tensor, k_cache: torch.Tensor, table: torch.Tensor, length: int,
                      page_size: int, scale: float, k_scale: torch.Tensor | None = None) -> torch.Tensor:
    """q: [w, H_q, D], the queries at positions length - w .. length - 1; k_cache: [num_slots,
    H_kv, D]; table: [N] int32, the request's block table -> [H_kv, length] fp32. k_scale:
    [num_slots, H_kv] fp32 of an FP8 cache (the keys are k_cache * k_scale), else None."""
    w, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    qg_size = Hq // Hkv
    pos = torch.arange(length, device=q.device)
    slots = table[pos // page_size].long() * page_size + pos % page_size
    keys = dequant(k_cache, k_scale, (slots,))                             # [L, H_kv, D]
    qpos = torch.arange(length - w, length, device=q.device)
    visible = pos.view(1, -1) <= qpos.view(-1, 1)                          # [w, L]
    out = torch.empty(Hkv, length, dtype=torch.float32, device=q.device)
    for h in range(Hkv):  # one KV head at a time: [group, w, L] is the most held at once
        qh = q[:, h * qg_size:(h + 1) * qg_size].float().transpose(0, 1)  # [group, w, D]
        logits = (qh @ keys[:, h].T) * scale
        probs = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)
        out[h] = probs.sum(dim=1).mean(dim=0)
    return out


@jit
def _window_pass_kernel(
        q_ptr, k_ptr, table_ptr, m_ptr, l_ptr, lse_ptr, out_ptr, qk_scale, length, window, ks_ptr, stride_ss,
        stride_qt, stride_qh, stride_ks, stride_kh, stride_mh, stride_mb, stride_lseh, stride_oh,
        QG: tl.constexpr, P: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, STATS: tl.constexpr,
        UPCAST: tl.constexpr, DOT_PREC: tl.constexpr, SCALED: tl.constexpr = False):
    h = tl.program_id(0)
    blk = tl.program_id(1)
    toks = blk * BLOCK_N + tl.arange(0, BLOCK_N)
    tok_ok = toks < length
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    page = tl.load(table_ptr + toks // P, mask=tok_ok, other=0)
    slot = page.to(tl.int64) * P + toks % P   # int64: slot * stride overflows int32 on large pools
    k = tl.load(k_ptr + slot[:, None] * stride_ks + h * stride_kh + dims[None, :],
                mask=tok_ok[:, None] & dim_ok[None, :], other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
    elif SCALED:   # an FP8 cache: widened in registers to q's dtype
        k = k.to(q_ptr.dtype.element_ty)
    if SCALED:   # a key's scale multiplies its logit column
        k_scale = tl.load(ks_ptr + slot * stride_ss + h, mask=tok_ok, other=0.0)
    num_rows = QG * window
    col = tl.zeros([BLOCK_N], tl.float32)
    # Row r is window query r % window of query head h * QG + r // window.
    for r0 in range(0, num_rows, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        row_ok = rows < num_rows
        i = rows % window
        head = h * QG + rows // window
        q = tl.load(q_ptr + i[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                    mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale      # log2 domain
        if SCALED:
            s = s * k_scale[None, :]
        qpos = length - window + i
        ok = row_ok[:, None] & tok_ok[None, :] & (toks[None, :] <= qpos[:, None])
        s = tl.where(ok, s, float("-inf"))
        if STATS:
            m = tl.max(s, 1)
            m_safe = tl.where(m == float("-inf"), 0.0, m)  # a block wholly after the row: sum 0
            l_blk = tl.sum(tl.exp2(s - m_safe[:, None]), 1)
            tl.store(m_ptr + h * stride_mh + blk * stride_mb + rows, m, mask=row_ok)
            tl.store(l_ptr + h * stride_mh + blk * stride_mb + rows, l_blk, mask=row_ok)
        else:
            lse = tl.load(lse_ptr + h * stride_lseh + rows, mask=row_ok, other=0.0)
            p = tl.where(ok, tl.exp2(s - lse[:, None]), 0.0)
            col += tl.sum(p, 0)
    if not STATS:
        tl.store(out_ptr + h * stride_oh + toks, col / QG, mask=tok_ok)


def window_scores_triton(q: torch.Tensor, k_cache: torch.Tensor, table: torch.Tensor, length: int,
                         page_size: int, scale: float, k_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as window_scores_ref."""
    w, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    assert Hq % Hkv == 0 and 1 <= w <= length
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and table.stride(-1) == 1
    QG = Hq // Hkv
    num_rows = QG * w
    NB = -(-length // BLOCK_N)
    dev = q.device
    m = torch.empty(Hkv, NB, num_rows, dtype=torch.float32, device=dev)
    l_blk = torch.empty_like(m)
    lse = torch.empty(Hkv, num_rows, dtype=torch.float32, device=dev)
    out = torch.empty(Hkv, length, dtype=torch.float32, device=dev)
    common = dict(QG=QG, P=int(page_size), HEAD_DIM=D, BLOCK_D=max(16, pow2(D)),
                  BLOCK_R=min(MAX_BLOCK_R, max(16, pow2(num_rows))), BLOCK_N=BLOCK_N,
                  UPCAST=upcast_loads(q.dtype), DOT_PREC=dot_precision(q.dtype), SCALED=k_scale is not None,
                  num_warps=4)
    assert k_scale is None or (k_scale.shape == k_cache.shape[:2] and k_scale.stride(1) == 1)
    args = (q, k_cache, table, m, l_blk, lse, out, scale * 1.4426950408889634, length, w,
            *((k_scale, k_scale.stride(0)) if k_scale is not None else (q, 0)),
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), m.stride(0), m.stride(1),
            lse.stride(0), out.stride(0))
    _window_pass_kernel[(Hkv, NB)](*args, STATS=True, **common)
    # Merge the per-block (max, sum) pairs into one log2-sum-exp per row: [H_kv, NB, R] is small.
    # In place on m (the second pass does not read it), so no [H_kv, NB, R] temporaries pile up.
    top = m.amax(dim=1, keepdim=True)   # finite: key 0 is visible to every row
    torch.log2(m.sub_(top).exp2_().mul_(l_blk).sum(dim=1), out=lse)
    lse += top.squeeze(1)
    _window_pass_kernel[(Hkv, NB)](*args, STATS=False, **common)
    return out


def window_scores(q, k_cache, table, length, page_size, scale, k_scale=None):
    if use_triton(q):
        return window_scores_triton(q, k_cache, table, length, page_size, scale, k_scale)
    return window_scores_ref(q, k_cache, table, length, page_size, scale, k_scale)


def select_kept(scores: torch.Tensor, window: int, capacity: int, kernel_size: int,
                pooling: str) -> torch.Tensor:
    """scores: [..., L] fp32 window scores -> [..., capacity] int64 kept positions, ascending: the
    top (capacity - window) prefix positions [0, L - window) by pooled score, then the window.

    Pooling is 1-D over positions, stride 1, same padding, as the official code does it with
    F.max_pool1d / F.avg_pool1d: max pads with -inf (padding never wins), avg with zeros that
    count in the mean (count_include_pad), so edge scores are diluted. Equal pooled scores at the
    cut go to the earlier position (the official topk leaves that choice to the device)."""
    L = scores.shape[-1]
    prefix = scores[..., :L - window]
    flat = prefix.reshape(-1, 1, L - window)
    pad = kernel_size // 2
    if pooling == "max":
        pooled = F.max_pool1d(flat, kernel_size, stride=1, padding=pad)
    else:
        pooled = F.avg_pool1d(flat, kernel_size, stride=1, padding=pad, count_include_pad=True)
    # Max pooling makes plateaus of equal scores, so ties at the cut are common. topk breaks them
    # differently on CPU and GPU; a stable sort keeps the earlier position on every device.
    order = pooled.view(prefix.shape).sort(dim=-1, descending=True, stable=True).indices
    top = order[..., :capacity - window].sort(dim=-1).values
    win = torch.arange(L - window, L, device=scores.device).expand(*prefix.shape[:-1], window)
    return torch.cat([top, win], dim=-1)

"""Prefill attention of a chunk over the request's paged prefix plus the chunk itself.

The chunk's K/V are stored before this runs, so every key is read through the block table:
request i owns queries cu_seqlens_q[i]:cu_seqlens_q[i+1], which sit at the last positions of its
cache_lens[i] keys (causal: query j of the chunk sees keys [0, cache_len - chunk_len + j]).

CUDA paths: a chunk with a cached prefix goes to the Triton kernel below (flash-attention style
online softmax, keys gathered through the block table, GQA by KV-head indexing). Chunks with no
prefix need no table: each sequence goes to torch's scaled_dot_product_attention (which takes
cuDNN's kernel on the H200: 634 TFLOP/s for one 32K causal sequence, where varlen_attn and SDPA's
flash kernel reach 347; scripts/benchmarks/profile_prefill.py), else to varlen_attn
(FlashAttention-2 inside PyTorch) or flash_attn.flash_attn_varlen_func, else the reference.

An FP8 cache passes k_scale / v_scale ([num_slots, H_kv] fp32, see decode_attention): the paged
kernel dequantizes each gathered tile in registers. A chunk with no prefix attends over its own
k, v as computed (not yet rounded to FP8), as vLLM's FP8 cache does.
"""
import functools
import inspect
import logging

import torch
import torch.nn.functional as F

from sparsevllm.kernels.common import dot_precision, jit, pow2, tl, upcast_loads, use_triton
from sparsevllm.kernels.decode_attention import dequant

logger = logging.getLogger(__name__)


@functools.cache
def varlen_backends() -> tuple:
    """(torch's varlen_attn, its parameter names, flash_attn's varlen function), None where absent.
    Imported on first use, not with the package: torch.nn.attention.varlen pulls in torch._dynamo,
    about a second of every `import sparsevllm` (and of every --help)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
        params = set(inspect.signature(varlen_attn).parameters)
    except ImportError:
        varlen_attn, params = None, set()
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        flash_attn_varlen_func = None
    return varlen_attn, params, flash_attn_varlen_func

# Launch settings: the best of a sweep on the H200 (scripts/benchmarks/bench_kernels.py --sweep).
BLOCK_M = 128
BLOCK_N = 32
NUM_WARPS = 4
NUM_STAGES = 2


def prefill_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                          cache_lens: torch.Tensor, page_size: int, scale: float,
                          k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, H_q, D]; block_tables: [B, N] int32; cu_seqlens_q: [B+1]; cache_lens: [B];
    k_scale, v_scale: [num_slots, H_kv] fp32 of an FP8 cache, or None."""
    out = torch.empty_like(q)
    Hq, Hkv = q.shape[1], k_cache.shape[1]
    starts, lens = cu_seqlens_q.tolist(), cache_lens.tolist()
    for i in range(len(lens)):
        s, e, L = starts[i], starts[i + 1], lens[i]
        n = e - s
        pos = torch.arange(L, device=q.device)
        slots = block_tables[i, pos // page_size].long() * page_size + pos % page_size
        k = dequant(k_cache, k_scale, (slots,)).transpose(0, 1)     # [H_kv, L, D]
        v = dequant(v_cache, v_scale, (slots,)).transpose(0, 1)
        if Hkv != Hq:
            k = k.repeat_interleave(Hq // Hkv, dim=0)
            v = v.repeat_interleave(Hq // Hkv, dim=0)
        qpos = torch.arange(L - n, L, device=q.device)
        mask = pos.view(1, L) <= qpos.view(n, 1)                    # [n, L]
        # 4-D inputs: with 3-D ones torch's CPU SDPA takes its math path (an L x L matrix per
        # head, 3-6x slower) instead of the flash kernel.
        o = F.scaled_dot_product_attention(q[s:e].transpose(0, 1)[None], k.to(q.dtype)[None], v.to(q.dtype)[None],
                                           attn_mask=mask, scale=scale)
        out[s:e] = o[0].transpose(0, 1)
    return out


def varlen_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         cu_seqlens: torch.Tensor, max_seqlen: int, scale: float) -> torch.Tensor:
    """Causal attention of packed sequences with no cached prefix. q: [T, H_q, D]; k, v: [T, H_kv, D]."""
    out = torch.empty_like(q)
    Hq, Hkv = q.shape[1], k.shape[1]
    bounds = cu_seqlens.tolist()
    for s, e in zip(bounds[:-1], bounds[1:]):
        kk, vv = k[s:e].transpose(0, 1), v[s:e].transpose(0, 1)
        if Hkv != Hq:
            kk = kk.repeat_interleave(Hq // Hkv, dim=0)
            vv = vv.repeat_interleave(Hq // Hkv, dim=0)
        o = F.scaled_dot_product_attention(q[s:e].transpose(0, 1)[None], kk[None], vv[None], is_causal=True,
                                           scale=scale)    # 4-D: see prefill_attention_ref
        out[s:e] = o[0].transpose(0, 1)
    return out


@jit
def _prefill_paged_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, bt_ptr, cu_ptr, ctx_ptr, qk_scale, ks_ptr, vs_ptr, stride_ss,
        stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_ot, stride_oh,
        stride_btb,
        QG: tl.constexpr, P: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr,
        SCALED: tl.constexpr = False):
    m_block = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    kvh = h // QG
    q_start = tl.load(cu_ptr + b)
    n = tl.load(cu_ptr + b + 1) - q_start
    if m_block * BLOCK_M >= n:
        return
    ctx = tl.load(ctx_ptr + b)
    offset = ctx - n          # position of the chunk's first query in the request
    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    row_ok = rows < n
    dim_ok = dims < HEAD_DIM
    qpos = offset + rows
    tok = (q_start + rows).to(tl.int64)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + h * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Causal: the block's last query sees keys up to its own position; key 0 is seen by every
    # row, so the first step makes every running max finite.
    end = tl.minimum(ctx, offset + tl.minimum((m_block + 1) * BLOCK_M, n))
    bt_row = bt_ptr + b * stride_btb
    for k0 in range(0, end, BLOCK_N):
        kpos = k0 + tl.arange(0, BLOCK_N)
        key_ok = kpos < end
        page = tl.load(bt_row + kpos // P, mask=key_ok, other=0)
        slot = page.to(tl.int64) * P + kpos % P
        kv_mask = key_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_ptr + slot[:, None] * stride_ks + kvh * stride_kh + dims[None, :],
                    mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + slot[:, None] * stride_vs + kvh * stride_vh + dims[None, :],
                    mask=kv_mask, other=0.0)
        k = k.to(q.dtype)   # widened in registers (UPCAST: fp32; an FP8 cache: q's dtype)
        if SCALED:   # FP8: a key's scale multiplies its logit column, a value's scale its row
            s_off = slot * stride_ss + kvh
            v = (v.to(tl.float32) * tl.load(vs_ptr + s_off, mask=key_ok, other=0.0)[:, None]).to(q.dtype)
        else:
            v = v.to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale   # log2 domain
        if SCALED:
            s = s * tl.load(ks_ptr + s_off, mask=key_ok, other=0.0)[None, :]
        s = tl.where(key_ok[None, :] & (kpos[None, :] <= qpos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new
    acc = acc / l_i[:, None]
    tl.store(out_ptr + tok[:, None] * stride_ot + h * stride_oh + dims[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def prefill_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                             cache_lens: torch.Tensor, page_size: int, scale: float,
                             max_seqlen_q: int | None = None, k_scale: torch.Tensor | None = None,
                             v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as prefill_attention_ref. max_seqlen_q (host int) sizes the grid; without it
    the grid covers the whole packed batch and idle programs exit at once."""
    T, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    B = cache_lens.shape[0]
    assert Hq % Hkv == 0 and q.stride(-1) == 1 and k_cache.stride(-1) == 1
    assert v_cache.stride(-1) == 1 and block_tables.stride(-1) == 1
    scaled = k_scale is not None
    if scaled:
        assert v_scale is not None and k_scale.shape == v_scale.shape == k_cache.shape[:2]
        assert k_scale.stride() == v_scale.stride() and k_scale.stride(1) == 1
    out = torch.empty_like(q)
    cu_seqlens_q, cache_lens = cu_seqlens_q.contiguous(), cache_lens.contiguous()   # read as ptr + b
    rows = T if max_seqlen_q is None else max_seqlen_q
    grid = (-(-rows // BLOCK_M), B, Hq)
    _prefill_paged_kernel[grid](
        q, k_cache, v_cache, out, block_tables, cu_seqlens_q, cache_lens,
        scale * 1.4426950408889634, k_scale if scaled else out, v_scale if scaled else out,
        k_scale.stride(0) if scaled else 0,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        QG=Hq // Hkv, P=int(page_size), HEAD_DIM=D, BLOCK_D=pow2(D), BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N, UPCAST=upcast_loads(q.dtype), DOT_PREC=dot_precision(q.dtype), SCALED=scaled,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return out


def _varlen_torch(q, k, v, cu_seqlens, max_seqlen, scale):
    """torch.nn.attention.varlen.varlen_attn across its API versions (is_causal in early
    releases, window_size/scale/enable_gqa later)."""
    varlen_attn, params, _ = varlen_backends()
    kwargs = {}
    Hq, Hkv = q.shape[1], k.shape[1]
    if Hkv != Hq:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            k = k.repeat_interleave(Hq // Hkv, dim=1)
            v = v.repeat_interleave(Hq // Hkv, dim=1)
    if "scale" in params:
        kwargs["scale"] = scale
    else:  # its default scale is 1/sqrt(D)
        q = q * (scale * q.shape[-1] ** 0.5)
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0)
    else:
        kwargs["is_causal"] = True
    cu = cu_seqlens.to(torch.int32)
    return varlen_attn(q, k, v, cu, cu, max_seqlen, max_seqlen, **kwargs)


def _varlen_flash(q, k, v, cu_seqlens, max_seqlen, scale):
    cu = cu_seqlens.to(torch.int32)
    return varlen_backends()[2](q, k, v, cu, cu, max_seqlen, max_seqlen, softmax_scale=scale, causal=True)


def _sdpa_per_sequence(q, k, v, cu_seqlens, max_seqlen, scale, seq_lens):
    """Causal SDPA one sequence at a time; seq_lens is the host list of the packed lengths."""
    out = torch.empty_like(q)
    start = 0
    for n in seq_lens:
        end = start + n
        o = F.scaled_dot_product_attention(q[start:end].transpose(0, 1)[None], k[start:end].transpose(0, 1)[None],
                                           v[start:end].transpose(0, 1)[None], is_causal=True, scale=scale,
                                           enable_gqa=q.shape[1] != k.shape[1])
        out[start:end] = o[0].transpose(0, 1)
        start = end
    return out


_varlen_broken: set[str] = set()


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                     max_seqlen: int, scale: float, seq_lens: list[int] | None = None) -> torch.Tensor:
    """Dispatcher for chunks with no prefix: the first backend present, else the reference. SDPA
    comes first where the host knows the sequence lengths (seq_lens): on the H200 its cuDNN kernel
    ran a 32K causal prefill at 1.8x varlen_attn's rate. A backend that fails (old GPU, unsupported
    head size) is logged once and skipped."""
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        torch_varlen, _, flash_varlen = varlen_backends()
        for name, fn in (("sdpa", seq_lens is not None and _sdpa_per_sequence),
                         ("torch varlen_attn", torch_varlen and _varlen_torch),
                         ("flash_attn", flash_varlen and _varlen_flash)):
            if not fn or name in _varlen_broken:
                continue
            try:
                if name == "sdpa":
                    return fn(q, k, v, cu_seqlens, max_seqlen, scale, seq_lens)
                return fn(q, k, v, cu_seqlens, max_seqlen, scale)
            except (RuntimeError, TypeError, ValueError) as e:
                _varlen_broken.add(name)
                logger.warning("%s failed (%s); falling back for the rest of the run", name, e)
    return varlen_attention_ref(q, k, v, cu_seqlens, max_seqlen, scale)


def prefill_attention(q, k, v, k_cache, v_cache, block_tables, cu_seqlens_q, cache_lens,
                      max_seqlen_q: int, has_prefix: bool, page_size: int, scale: float,
                      seq_lens: list[int] | None = None, k_scale=None, v_scale=None):
    """Dispatcher. has_prefix is a host bool (no device sync): False when every chunk starts at 0,
    so the chunk's own k, v are all the keys; seq_lens (host) are the chunk lengths."""
    if not has_prefix:
        return varlen_attention(q, k, v, cu_seqlens_q, max_seqlen_q, scale, seq_lens)
    if use_triton(q):
        return prefill_attention_triton(q, k_cache, v_cache, block_tables, cu_seqlens_q,
                                        cache_lens, page_size, scale, max_seqlen_q, k_scale, v_scale)
    return prefill_attention_ref(q, k_cache, v_cache, block_tables, cu_seqlens_q, cache_lens,
                                 page_size, scale, k_scale, v_scale)

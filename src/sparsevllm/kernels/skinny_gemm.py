"""y = x @ W.T (+ bias) for the few rows of a decode step: a weight-streaming GEMM.

A decode step multiplies every weight matrix by a handful of rows (the batch), so each linear layer
is a pass over its weight: the time is the weight's bytes over the memory bandwidth. cuBLAS picks
split-K kernels for some of these shapes (o_proj, down_proj) that run at 64-90% of the copy rate
and add a reduce kernel. Here one program owns a run of output columns and walks the whole K of
their weight rows (no split, no reduce), the rows of x padded to 16 for the tensor cores. An SM
streams about 34 GB/s at most (the LM head's 4.4 TB/s over 132 SMs; qkv's 96 programs reached
3.2 TB/s), so a weight needs every SM busy for its whole pass: the columns are
spread evenly over the SMs (launch_config), not cut into fixed tiles that leave SMs idle (qkv's
96 tiles of 64 on 132 SMs) or a last partial wave (gate_up's 448 tiles).

Measured on the H200 (graph-timed, weights cold in L2 as in scripts/benchmarks/bench_kernels.py,
Llama-3.1-8B shapes, M = 1 / 4, cuBLAS -> this kernel with fixed tiles, 2026-12-03): qkv
15.9 -> 14.8 / 15.4 -> 14.9 us, o_proj 12.4 -> 10.8 / 12.5 -> 11.0, gate_up 57.0 -> 56.7 / 61.0 ->
56.9, down 31.0 -> 29.7 / 31.3 -> 29.9, LM head 246 -> 236 / 248 -> 238. Spreading the columns
evenly (2026-12-04, M = 4, 24 cold weights a shape): qkv 15.7 -> 13.7 us, gate_up 61.0 -> 55.1;
o_proj and down already had 128 programs of 32 columns (no change); the LM head keeps its tiles.
At 32 rows cuBLAS is as fast or faster, so the kernel takes only steps of at most MAX_ROWS rows,
and only weights wide enough to give every SM a program (smaller models keep cuBLAS).

The MLP's gate_up goes through linear_silu_mul: the same kernel with SiLU(gate) * up in its
epilogue, so a decode step has no separate activation launch and no [M, 2I] intermediate.

The RMSNorm between two projections can ride in their epilogues (skinny_add_norm_triton, then
linear / linear_silu_mul with row_norm; RowParallelLinear.add_norm picks it on one rank): o_proj and
down_proj add the residual, write it and norm_weight * it, and each program's per-row sum of
squares; qkv and gate_up, whose x that is, sum those partial sums in a fixed order (the same bits
every run) and scale their rows by 1 / rms before the bias and the activation. Nothing changes in
either K loop (a norm computed in the next GEMM's K loop made the GEMMs ~1.7x slower on the H200):
63 of the 65 norm launches of a Llama-3.1-8B decode step go (the first layer's and the final one
stay). The rounding differs from the three launches (norm_weight * r is rounded before the GEMM,
1 / rms applied after it): bf16 noise, tested.

The qkv projection of a decode step can go through linear_rope_store: the epilogue rotates q and k
(RoPE, rope_store's arithmetic) and writes k and v to their cache slots, and optionally folds each
key into its page's min / max (the page bounds of kernels/page_bounds.py), so a layer has no
rope_store launch of its own; the cache manager says where (CacheManager.store_target). With the
attention's PDL launches it measured +0.7% (QuEST) and +1.3% (SnapKV) decode tok/s at 32K x 4 on an
H100 (docs/performance.md, 2026-12-05).

On the GPU every launch is a programmatic dependent launch (PDL, see common.pdl): the kernel lets
the next one start early (`gdc_launch_dependents`), asks L2 for its first weight tile and only then
waits for the kernel before (`gdc_wait`): a GEMM's weight stream starts while the kernel before it
drains. A CUDA graph of 32 layers' GEMMs (4 rows, Llama-3.1-8B shapes) replayed in 3.831 ms
against 3.941 ms without (H200, 2026-12-04).
"""
import torch
import torch.nn.functional as F

from sparsevllm.kernels.common import dot_precision, gdc_launch_dependents, gdc_wait, jit, pdl, prefetch_l2, tl
from sparsevllm.kernels.common import pow2, sm_count, upcast_loads, use_triton
from sparsevllm.kernels.rope_store import rope_store_ref
from sparsevllm.kernels.silu_mul import silu_and_mul, silu_and_mul_ref

MAX_ROWS = 16          # rows of x the kernel takes (one 16-row tensor-core tile)
MIN_N, MIN_K = 4096, 2048   # below these cuBLAS keeps the shape: too few programs / too little to stream


def rstd_of(row_norm: tuple[torch.Tensor, float], rows: int, k: int) -> torch.Tensor:
    """1 / rms of each row from an add_norm launch's partial sums of squares: [rows, 1] fp32."""
    parts, eps = row_norm
    return torch.rsqrt(parts.sum(0)[:rows] / k + eps).unsqueeze(-1)


def skinny_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                      row_norm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    """x: [..., K]; weight: [N, K]; bias: [N] or None -> [..., N] in x's dtype. row_norm (parts, eps):
    x is w_norm * r from skinny_add_norm; each row is scaled by its 1 / rms before the bias."""
    if row_norm is None:
        return F.linear(x, weight, bias)
    K = x.shape[-1]
    y = F.linear(x.reshape(-1, K).float(), weight.float()) * rstd_of(row_norm, x.numel() // K, K)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).view(*x.shape[:-1], -1)


def skinny_add_norm_ref(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor,
                        norm_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The add + RMSNorm after a row-parallel projection, but for the norm's 1 / rms: with y = x @ W.T,
    r = y + residual (rounded as two launches round) -> (norm_weight * r, r, parts), parts fp32
    [programs, MAX_ROWS] whose column sums are the rows' sums of r^2 (one row of them here). A
    linear with row_norm=(parts, eps) over norm_weight * r then equals it over RMSNorm(r)."""
    r = F.linear(x, weight) + residual
    rows = r.reshape(-1, r.shape[-1]).float()
    parts = torch.zeros(1, MAX_ROWS, dtype=torch.float32, device=x.device)
    parts[0, :rows.shape[0]] = rows.pow(2).sum(-1)
    return (norm_weight.float() * r.float()).to(r.dtype), r, parts


@jit
def _skinny_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, COLS, stride_xm, stride_wn, stride_ym,
                   res_ptr, res_out_ptr, nw_ptr, part_ptr, num_parts, eps, stride_rm, stride_rom,
                   HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr, PDL: tl.constexpr,
                   ADD_NORM: tl.constexpr, ROW_NORM: tl.constexpr, BLOCK_P: tl.constexpr,
                   pos_ptr=None, cs_ptr=None, slot_ptr=None, kc_ptr=None, vc_ptr=None, mn_ptr=None, mx_ptr=None,
                   stride_c=0, stride_kcs=0, stride_kch=0, stride_vcs=0, stride_vch=0, stride_mp=0, stride_mh=0,
                   Q_SIZE=0, KV_SIZE=0, HEAD_DIM: tl.constexpr = 2, PAGE: tl.constexpr = 1,
                   ROPE: tl.constexpr = False, BOUNDS: tl.constexpr = False):
    # ADD_NORM (o_proj, down): the epilogue adds the residual (r = x @ W.T + residual, written to
    # res_out), writes w_norm * r as y and this program's per-row sum of r^2 to part[program, row]:
    # the RMSNorm that follows, but for its 1 / rms, which needs every program's columns.
    # ROW_NORM (qkv, gate_up): x is such a w_norm * r; the epilogue sums the num_parts partial sums
    # of squares in a fixed order (no atomics: the same bits every run) and scales the rows by
    # rsqrt(mean + eps) before the bias and the activation. Together they replace a norm launch.
    # SILU_MUL: the weight is [gate; up] with N rows each, y = silu(x @ gate.T) * (x @ up.T) [M, N];
    # a program streams gate rows `cols` and up rows N + `cols` together.
    # ROPE (the qkv projection of a decode step, see linear_rope_store): the epilogue rotates q and k
    # to their positions (RoPE) and writes k and v to their cache slots (and folds k into its page's
    # bounds with BOUNDS). A rotation pairs columns c and c + D/2 of a head, so the program's lanes
    # walk "virtual" columns in which the pairs of the q and k heads sit side by side (lane 2i: c,
    # lane 2i + 1: c + D/2; v columns as they are): COLS is even, so no pair straddles two programs.
    # a program owns COLS <= BLOCK_N columns: the tile's lanes past COLS are masked (no loads)
    lane = tl.arange(0, BLOCK_N)
    cols = tl.program_id(0) * COLS + lane
    vcols = cols
    if ROPE:
        pair = cols // 2
        half = HEAD_DIM // 2
        cols = tl.where(cols < Q_SIZE + KV_SIZE, (pair // half) * HEAD_DIM + pair % half + (cols % 2) * half, cols)
    rows = tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    col_ok = (lane < COLS) & (vcols < N)
    row_ok = rows < M
    w_rows = w_ptr + cols[:, None].to(tl.int64) * stride_wn   # int64: N * K passes 2^31 for an LM head
    u_rows = w_rows + N.to(tl.int64) * stride_wn
    if PDL:   # the weights do not depend on the kernel before: ask for the first tile, then wait for x
        gdc_launch_dependents()
        lines = (w_ptr + tl.minimum(cols, N - 1)[:, None].to(tl.int64) * stride_wn
                 + tl.arange(0, BLOCK_K // 64)[None, :] * 64)   # a pointer a 128-byte line (half types)
        prefetch_l2(lines)
        if SILU_MUL:
            prefetch_l2(lines + N.to(tl.int64) * stride_wn)
        gdc_wait()
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        k_ok = k < K
        w_ok = col_ok[:, None] & k_ok[None, :]
        w = tl.load(w_rows + k[None, :], mask=w_ok, other=0.0)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if SILU_MUL:
            u = tl.load(u_rows + k[None, :], mask=w_ok, other=0.0)
            if UPCAST:
                u = u.to(tl.float32)
        if UPCAST:
            w = w.to(tl.float32)
            x = x.to(tl.float32)
        acc += tl.dot(x, tl.trans(w), input_precision=DOT_PREC)
        if SILU_MUL:
            acc_up += tl.dot(x, tl.trans(u), input_precision=DOT_PREC)
    if ROW_NORM:
        parts = tl.arange(0, BLOCK_P)
        sq = tl.load(part_ptr + parts[:, None] * BLOCK_M + rows[None, :], mask=(parts < num_parts)[:, None], other=0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(sq, 0) / K + eps)
        acc = acc * rstd[:, None]
        if SILU_MUL:
            acc_up = acc_up * rstd[:, None]
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    ty = y_ptr.dtype.element_ty
    if SILU_MUL:   # rounded where the GEMM and then silu_and_mul round: the same bits as two launches
        gate = acc.to(ty).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(ty).to(tl.float32)
        acc = act * acc_up.to(ty).to(tl.float32)
    out_ok = row_ok[:, None] & col_ok[None, :]
    if ADD_NORM:   # rounded where the GEMM and then the add + norm kernel round
        res = tl.load(res_ptr + rows[:, None] * stride_rm + cols[None, :], mask=out_ok, other=0.0)
        r = (acc.to(ty).to(tl.float32) + res.to(tl.float32)).to(ty)
        tl.store(res_out_ptr + rows[:, None] * stride_rom + cols[None, :], r, mask=out_ok)
        rf = tl.where(out_ok, r.to(tl.float32), 0.0)
        tl.store(part_ptr + tl.program_id(0) * BLOCK_M + rows, tl.sum(rf * rf, 1))
        acc = tl.load(nw_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :] * rf
    if ROPE:
        _rope_store_epilogue(acc.to(ty), rows, row_ok, cols, vcols, out_ok, y_ptr, stride_ym, pos_ptr, cs_ptr,
                             stride_c, slot_ptr, kc_ptr, vc_ptr, mn_ptr, mx_ptr, stride_kcs, stride_kch,
                             stride_vcs, stride_vch, stride_mp, stride_mh, Q_SIZE, KV_SIZE, BLOCK_M, BLOCK_N,
                             HEAD_DIM, PAGE, BOUNDS)
    else:
        tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], acc.to(ty), mask=out_ok)


@jit
def _rope_store_epilogue(y, rows, row_ok, cols, vcols, out_ok, y_ptr, stride_ym, pos_ptr, cs_ptr, stride_c,
                         slot_ptr, kc_ptr, vc_ptr, mn_ptr, mx_ptr, stride_kcs, stride_kch, stride_vcs, stride_vch,
                         stride_mp, stride_mh, Q_SIZE, KV_SIZE, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BOUNDS: tl.constexpr):
    """y: [BLOCK_M, BLOCK_N] in the output dtype (rounded where the GEMM alone rounds), lanes in
    virtual-column order. Rotates the q / k pairs with rope_store's arithmetic (the same bits as the
    GEMM followed by rope_store), stores y (q, k after RoPE, v) at the real columns and writes k and
    v to their slots (-1: nowhere)."""
    HALF = HEAD_DIM // 2
    R = Q_SIZE + KV_SIZE
    x1, x2 = tl.split(tl.reshape(y.to(tl.float32), [BLOCK_M, BLOCK_N // 2, 2]))
    pair_v = tl.reshape(vcols, [BLOCK_N // 2, 2])   # the pair's two virtual columns
    first_v, _ = tl.split(pair_v)
    j = (first_v // 2) % HALF                         # the pair's channel in the head's first half
    pair_rot = first_v < R
    pos = tl.load(pos_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    cs_mask = row_ok[:, None] & pair_rot[None, :]
    cos = tl.load(cs_ptr + pos[:, None] * stride_c + j[None, :], mask=cs_mask, other=1.0).to(tl.float32)
    sin = tl.load(cs_ptr + pos[:, None] * stride_c + HALF + j[None, :], mask=cs_mask, other=0.0).to(tl.float32)
    r1 = tl.fma(x1, cos, -(x2 * sin))
    r2 = tl.fma(x2, cos, x1 * sin)
    rotated = tl.reshape(tl.join(r1, r2), [BLOCK_M, BLOCK_N])
    ty = y_ptr.dtype.element_ty
    out = tl.where((vcols < R)[None, :], rotated, y.to(tl.float32)).to(ty)
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], out, mask=out_ok)
    slot = tl.load(slot_ptr + rows, mask=row_ok, other=-1).to(tl.int64)   # int64: slot * stride passes 2^31
    write = out_ok & (slot >= 0)[:, None]
    is_k = (cols >= Q_SIZE) & (cols < R)
    kcol = cols - Q_SIZE
    k_dst = slot[:, None] * stride_kcs + (kcol // HEAD_DIM)[None, :] * stride_kch + (kcol % HEAD_DIM)[None, :]
    k_new = out.to(kc_ptr.dtype.element_ty)
    tl.store(kc_ptr + k_dst, k_new, mask=write & is_k[None, :])
    vcol = cols - R
    v_dst = slot[:, None] * stride_vcs + (vcol // HEAD_DIM)[None, :] * stride_vch + (vcol % HEAD_DIM)[None, :]
    tl.store(vc_ptr + v_dst, out.to(vc_ptr.dtype.element_ty), mask=write & (cols >= R)[None, :])
    if BOUNDS:   # decode: no two rows write one page, so a plain read-modify-write is exact
        page = slot // PAGE
        first = (slot % PAGE == 0)[:, None]
        b_dst = page[:, None] * stride_mp + (kcol // HEAD_DIM)[None, :] * stride_mh + (kcol % HEAD_DIM)[None, :]
        b_ok = write & is_k[None, :]
        k_b = k_new.to(mn_ptr.dtype.element_ty)
        old_min = tl.load(mn_ptr + b_dst, mask=b_ok, other=0.0)
        old_max = tl.load(mx_ptr + b_dst, mask=b_ok, other=0.0)
        tl.store(mn_ptr + b_dst, tl.where(first, k_b, tl.minimum(old_min, k_b)), mask=b_ok)
        tl.store(mx_ptr + b_dst, tl.where(first, k_b, tl.maximum(old_max, k_b)), mask=b_ok)


def num_sms(device: torch.device) -> int:
    """SMs to spread a weight over: the device's; 132 (an H200's) off CUDA, for the interpreter."""
    return sm_count(device) or 132


def launch_config(n: int, silu_mul: bool, sms: int) -> tuple[int, int, int, int, int]:
    """(columns a program, BLOCK_N, BLOCK_K, num_warps, num_stages) for n output columns (a [gate;
    up] weight: n of each), from sweeps on the H200 at Llama-3.1-8B shapes.

    A weight is a single wave: its columns are spread evenly over the SMs, ceil(n / sms) rounded up
    to an even count a program, in the smallest tile that holds them (qkv: 48 columns on 128 SMs;
    gate_up: 110 + 110 on 131; the sweep behind it timed 109 and 110 columns; times in the module
    docstring). Wider weights (the LM head) keep 64-column tiles in many waves. These configs take
    120-147 KB of shared memory (one CTA an SM). Half the BLOCK_K with one more stage (two CTAs an SM,
    so the next PDL launch could sit beside the one draining) plus the first weight tile loaded before
    gdc_wait measured slower on an H100 (a layer's four GEMMs 166.5 us against 149.5; docs/performance.md, 2026-12-06)."""
    cols = -(-n // sms)
    cols += cols % 2      # qkv: 47 -> 48 columns measured 14.1 -> 13.7 us
    if silu_mul:
        if cols <= 32:
            return cols, 32, 256, 4, 4
        return (cols, 128, 128, 4, 3) if cols <= 128 else (32, 32, 256, 4, 4)
    if cols <= 32:
        return cols, 32, 512, 4, 4
    return (cols, 64, 256, 4, 4) if cols <= 64 else (64, 64, 256, 4, 4)


def _skinny(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu_mul: bool,
            add_norm: tuple[torch.Tensor, torch.Tensor] | None = None,
            row_norm: tuple[torch.Tensor, float] | None = None, epilogue: dict | None = None):
    """epilogue: the RoPE + store epilogue's kernel arguments (linear_rope_store_triton)."""
    N2, K = weight.shape
    N = N2 // 2 if silu_mul else N2
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    assert M <= MAX_ROWS and weight.stride(-1) == 1 and x.shape[-1] == K and not (silu_mul and N2 % 2)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    cols, block_n, block_k, warps, stages = launch_config(N, silu_mul, num_sms(x.device))
    grid = -(-N // cols)
    res = res_out = parts = y
    if add_norm is not None:   # (residual [.., N], norm weight [N])
        residual, norm_weight = add_norm
        assert bias is None and not silu_mul and residual.shape[-1] == N and norm_weight.shape == (N,)
        res = residual.reshape(-1, N)
        assert res.shape[0] == M and res.stride(-1) == 1 and res.dtype == x.dtype
        res_out = torch.empty_like(y)
        parts = torch.empty(grid, MAX_ROWS, dtype=torch.float32, device=x.device)
        norm_weight = norm_weight.contiguous()
    num_parts, eps = 1, 0.0
    if row_norm is not None:   # (partial sums of squares [programs, MAX_ROWS] of an add_norm launch, eps)
        parts, eps = row_norm
        num_parts = parts.shape[0]
        assert parts.shape[1] == MAX_ROWS and parts.dtype == torch.float32 and parts.is_contiguous()
    assert epilogue is None or cols % 2 == 0, "a program must hold whole rotation pairs"
    on = pdl()
    _skinny_kernel[(grid,)](
        x2, weight, bias if bias is not None else weight, y, M, N, K, cols, x2.stride(0), weight.stride(0), y.stride(0),
        res, res_out, norm_weight if add_norm is not None else y, parts, num_parts, float(eps),
        res.stride(0), res_out.stride(0),
        HAS_BIAS=bias is not None, SILU_MUL=silu_mul, BLOCK_M=MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k,
        UPCAST=upcast_loads(x.dtype), DOT_PREC=dot_precision(x.dtype), PDL=on,
        ADD_NORM=add_norm is not None, ROW_NORM=row_norm is not None, BLOCK_P=pow2(num_parts),
        num_warps=warps, num_stages=stages, **(epilogue or {}), **({"launch_pdl": True} if on else {}))
    y = y.view(*x.shape[:-1], N)
    if add_norm is not None:
        return y, res_out.view(y.shape), parts
    return y


def skinny_linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                         row_norm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    """Same contract as skinny_linear_ref, for at most MAX_ROWS rows."""
    return _skinny(x, weight, bias, False, row_norm=row_norm)


def skinny_add_norm_triton(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor,
                           norm_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as skinny_add_norm_ref (parts: a row per program), for at most MAX_ROWS rows."""
    return _skinny(x, weight, None, False, add_norm=(residual, norm_weight))


def linear_rope_store_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          row_norm: tuple[torch.Tensor, float] | None, q_size: int, kv_size: int, head_dim: int,
                          positions: torch.Tensor, cos_sin_cache: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, slot_mapping: torch.Tensor, kmin: torch.Tensor | None = None,
                          kmax: torch.Tensor | None = None, page_size: int = 1) -> torch.Tensor:
    """The qkv projection of a decode step with RoPE and the KV write: x [T, K], weight [q_size +
    2 kv_size, K] -> qkv [T, N] with q and k rotated to `positions`; k (after RoPE) and v are
    written to their slots (and folded into kmin / kmax) as rope_store does. The GEMM, then
    rope_store."""
    y = skinny_linear_ref(x, weight, bias, row_norm)
    T = y.shape[0]
    q, k, v = y.split([q_size, kv_size, kv_size], dim=-1)
    q, k = rope_store_ref(q.reshape(T, -1, head_dim), k.reshape(T, -1, head_dim), v.reshape(T, -1, head_dim),
                          positions, cos_sin_cache, k_cache, v_cache, slot_mapping, kmin, kmax, page_size)
    return torch.cat([q.reshape(T, q_size), k.reshape(T, kv_size), v], dim=-1)


def linear_rope_store_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                             row_norm: tuple[torch.Tensor, float] | None, q_size: int, kv_size: int, head_dim: int,
                             positions: torch.Tensor, cos_sin_cache: torch.Tensor, k_cache: torch.Tensor,
                             v_cache: torch.Tensor, slot_mapping: torch.Tensor, kmin: torch.Tensor | None = None,
                             kmax: torch.Tensor | None = None, page_size: int = 1) -> torch.Tensor:
    """Same contract as linear_rope_store_ref, in one launch (at most MAX_ROWS rows): the skinny GEMM
    whose epilogue rotates q / k and writes the cache (see _rope_store_epilogue)."""
    D, T = head_dim, x.numel() // x.shape[-1]
    assert weight.shape[0] == q_size + 2 * kv_size and D % 2 == 0 and q_size % D == 0 and kv_size % D == 0
    assert positions.shape == (T,) and slot_mapping.shape == (T,) and cos_sin_cache.shape[-1] == D
    assert k_cache.shape[1:] == (kv_size // D, D) and v_cache.shape[1:] == (kv_size // D, D)
    for t in (k_cache, v_cache, cos_sin_cache):
        assert t.stride(-1) == 1
    bounds = kmin is not None
    if bounds:
        assert kmax is not None and kmin.shape == kmax.shape and kmin.stride() == kmax.stride()
        assert kmin.shape[1:] == k_cache.shape[1:]
    mn, mx = (kmin, kmax) if bounds else (k_cache, k_cache)   # unused without bounds
    positions, slot_mapping = positions.contiguous(), slot_mapping.contiguous()   # read as ptr + t
    epilogue = dict(pos_ptr=positions, cs_ptr=cos_sin_cache, slot_ptr=slot_mapping, kc_ptr=k_cache, vc_ptr=v_cache,
                    mn_ptr=mn, mx_ptr=mx, stride_c=cos_sin_cache.stride(0), stride_kcs=k_cache.stride(0),
                    stride_kch=k_cache.stride(1), stride_vcs=v_cache.stride(0), stride_vch=v_cache.stride(1),
                    stride_mp=mn.stride(0), stride_mh=mn.stride(1), Q_SIZE=q_size, KV_SIZE=kv_size, HEAD_DIM=D,
                    PAGE=int(page_size), ROPE=True, BOUNDS=bounds)
    return _skinny(x, weight, bias, False, row_norm=row_norm, epilogue=epilogue)


def linear_rope_store(x, weight, bias, row_norm, q_size, kv_size, head_dim, positions, cos_sin_cache, k_cache,
                      v_cache, slot_mapping, kmin=None, kmax=None, page_size=1) -> torch.Tensor | None:
    """linear_rope_store_triton where the skinny kernel takes the shape (a decode step on the GPU),
    else None: the caller projects and stores separately."""
    if not takes(x, weight):
        return None
    return linear_rope_store_triton(x, weight, bias, row_norm, q_size, kv_size, head_dim, positions, cos_sin_cache,
                                    k_cache, v_cache, slot_mapping, kmin, kmax, page_size)


def skinny_silu_mul_ref(x: torch.Tensor, weight: torch.Tensor,
                        row_norm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    """x: [..., K]; weight: [2I, K] = [gate; up] -> silu(x @ gate.T) * (x @ up.T): [..., I];
    row_norm as in skinny_linear_ref (applied to gate and up before the activation)."""
    return silu_and_mul_ref(skinny_linear_ref(x, weight, None, row_norm))


def skinny_silu_mul_triton(x: torch.Tensor, weight: torch.Tensor,
                           row_norm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    """Same contract as skinny_silu_mul_ref, for at most MAX_ROWS rows: the MLP's gate_up GEMM with
    the activation in its epilogue (one launch, no [M, 2I] intermediate)."""
    return _skinny(x, weight, None, True, row_norm=row_norm)


def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel beats cuBLAS here: a decode-sized step over a wide half-precision weight."""
    N, K = weight.shape
    return (use_triton(x) and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
            and weight.stride(-1) == 1 and x.numel() <= MAX_ROWS * K and N >= MIN_N and K >= MIN_K)


def linear_silu_mul(x: torch.Tensor, weight: torch.Tensor,
                    row_norm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    """silu_and_mul(F.linear(x, weight)) for a [gate; up] weight, fused for decode-sized steps."""
    if takes(x, weight):
        return skinny_silu_mul_triton(x, weight, row_norm)
    return silu_and_mul(skinny_linear_ref(x, weight, None, row_norm))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           row_norm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    """F.linear, with decode-sized steps over wide weights routed to the weight-streaming kernel.
    row_norm: x came from skinny_add_norm (see skinny_linear_ref)."""
    if takes(x, weight):
        return skinny_linear_triton(x, weight, bias, row_norm)
    return skinny_linear_ref(x, weight, bias, row_norm)


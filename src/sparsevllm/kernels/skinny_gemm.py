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

On the GPU every launch is a programmatic dependent launch (PDL, see common.pdl): the kernel lets
the next one start early (`gdc_launch_dependents`), asks L2 for its first weight tile and only then
waits for the kernel before (`gdc_wait`): a GEMM's weight stream starts while the kernel before it
drains. A CUDA graph of 32 layers' GEMMs (4 rows, Llama-3.1-8B shapes) replayed in 3.831 ms
against 3.941 ms without (H200, 2026-12-04).
"""
import torch
import torch.nn.functional as F

from sparsevllm.kernels.common import dot_precision, gdc_launch_dependents, gdc_wait, jit, pdl, prefetch_l2, tl
from sparsevllm.kernels.common import sm_count, upcast_loads, use_triton
from sparsevllm.kernels.silu_mul import silu_and_mul, silu_and_mul_ref

MAX_ROWS = 16          # rows of x the kernel takes (one 16-row tensor-core tile)
MIN_N, MIN_K = 4096, 2048   # below these cuBLAS keeps the shape: too few programs / too little to stream


def skinny_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [..., K]; weight: [N, K]; bias: [N] or None -> [..., N] in x's dtype."""
    return F.linear(x, weight, bias)


@jit
def _skinny_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, COLS, stride_xm, stride_wn, stride_ym,
                   HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr, PDL: tl.constexpr):
    # SILU_MUL: the weight is [gate; up] with N rows each, y = silu(x @ gate.T) * (x @ up.T) [M, N];
    # a program streams gate rows `cols` and up rows N + `cols` together.
    # a program owns COLS <= BLOCK_N columns: the tile's lanes past COLS are masked (no loads)
    lane = tl.arange(0, BLOCK_N)
    cols = tl.program_id(0) * COLS + lane
    rows = tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    col_ok = (lane < COLS) & (cols < N)
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
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    ty = y_ptr.dtype.element_ty
    if SILU_MUL:   # rounded where the GEMM and then silu_and_mul round: the same bits as two launches
        gate = acc.to(ty).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(ty).to(tl.float32)
        acc = act * acc_up.to(ty).to(tl.float32)
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], acc.to(ty), mask=row_ok[:, None] & col_ok[None, :])


def num_sms(device: torch.device) -> int:
    """SMs to spread a weight over: the device's; 132 (an H200's) off CUDA, for the interpreter."""
    return sm_count(device) or 132


def launch_config(n: int, silu_mul: bool, sms: int) -> tuple[int, int, int, int, int]:
    """(columns a program, BLOCK_N, BLOCK_K, num_warps, num_stages) for n output columns (a [gate;
    up] weight: n of each), from sweeps on the H200 at Llama-3.1-8B shapes.

    A weight is a single wave: its columns are spread evenly over the SMs, ceil(n / sms) rounded up
    to an even count a program, in the smallest tile that holds them (qkv: 48 columns on 128 SMs;
    gate_up: 110 + 110 on 131; the sweep behind it timed 109 and 110 columns; times in the module
    docstring). Wider weights (the LM head) keep 64-column tiles in many waves."""
    cols = -(-n // sms)
    cols += cols % 2      # qkv: 47 -> 48 columns measured 14.1 -> 13.7 us
    if silu_mul:
        if cols <= 32:
            return cols, 32, 256, 4, 4
        return (cols, 128, 128, 4, 3) if cols <= 128 else (32, 32, 256, 4, 4)
    if cols <= 32:
        return cols, 32, 512, 4, 4
    return (cols, 64, 256, 4, 4) if cols <= 64 else (64, 64, 256, 4, 4)


def _skinny(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu_mul: bool) -> torch.Tensor:
    N2, K = weight.shape
    N = N2 // 2 if silu_mul else N2
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    assert M <= MAX_ROWS and weight.stride(-1) == 1 and x.shape[-1] == K and not (silu_mul and N2 % 2)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    cols, block_n, block_k, warps, stages = launch_config(N, silu_mul, num_sms(x.device))
    on = pdl()
    _skinny_kernel[(-(-N // cols),)](
        x2, weight, bias if bias is not None else weight, y, M, N, K, cols, x2.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, SILU_MUL=silu_mul, BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k,
        UPCAST=upcast_loads(x.dtype), DOT_PREC=dot_precision(x.dtype), PDL=on, num_warps=warps, num_stages=stages,
        **({"launch_pdl": True} if on else {}))
    return y.view(*x.shape[:-1], N)


def skinny_linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as skinny_linear_ref, for at most MAX_ROWS rows."""
    return _skinny(x, weight, bias, False)


def skinny_silu_mul_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x: [..., K]; weight: [2I, K] = [gate; up] -> silu(x @ gate.T) * (x @ up.T): [..., I]."""
    return silu_and_mul_ref(F.linear(x, weight))


def skinny_silu_mul_triton(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Same contract as skinny_silu_mul_ref, for at most MAX_ROWS rows: the MLP's gate_up GEMM with
    the activation in its epilogue (one launch, no [M, 2I] intermediate)."""
    return _skinny(x, weight, None, True)


def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel beats cuBLAS here: a decode-sized step over a wide half-precision weight."""
    N, K = weight.shape
    return (use_triton(x) and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
            and weight.stride(-1) == 1 and x.numel() <= MAX_ROWS * K and N >= MIN_N and K >= MIN_K)


def linear_silu_mul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """silu_and_mul(F.linear(x, weight)) for a [gate; up] weight, fused for decode-sized steps."""
    if takes(x, weight):
        return skinny_silu_mul_triton(x, weight)
    return silu_and_mul(F.linear(x, weight))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, with decode-sized steps over wide weights routed to the weight-streaming kernel."""
    if takes(x, weight):
        return skinny_linear_triton(x, weight, bias)
    return F.linear(x, weight, bias)

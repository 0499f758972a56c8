"""Every Triton kernel against its torch reference.

Without CUDA the kernels run under Triton's interpreter on CPU (fp32 and fp16: the interpreter
computes bf16 wrongly) on small randomized shapes; with CUDA the `gpu` tests run them in bf16,
including a 32K-context decode and a decode captured in a CUDA graph.
"""
import os
import subprocess
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from helpers import CUDA, gpu  # noqa: E402
from sparsevllm.kernels import decode_attention as da  # noqa: E402
from sparsevllm.kernels import prefill_attention as pa, rmsnorm, rope_store as rs, silu_mul  # noqa: E402
from sparsevllm.kernels import skinny_gemm  # noqa: E402

interp = pytest.mark.skipif(CUDA, reason="interpreter tests run on CPU-only machines")


TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}


@pytest.fixture
def poison(monkeypatch):
    """Fresh float buffers from torch.empty/empty_like come NaN-filled, so any element a kernel
    forgets to write shows up."""
    empty, empty_like = torch.empty, torch.empty_like

    def fill(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: fill(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: fill(empty_like(*a, **k)))


def diagonal_quick(firsts, seconds):
    """Every pair of the two lists of values (a value may be a tuple of several parameters): the quick
    suite runs the diagonal, firsts[i] with seconds[i], so each value once; `-m long` the rest. Under
    the interpreter the programs of a launch run one after the other: many SMs, many programs."""
    def flat(value):
        return value if isinstance(value, tuple) else (value,)
    return [pytest.param(*flat(a), *flat(b), marks=() if i == j else pytest.mark.long)
            for i, a in enumerate(firsts) for j, b in enumerate(seconds)]


def close(a, b, dtype):
    atol, rtol = TOL[dtype]
    assert not a.isnan().any()
    torch.testing.assert_close(a.float(), b.float(), atol=atol, rtol=rtol)


def decode_case(g, B, Hq, Hkv, D, P, G, N, dtype, device):
    """A random decode view over a shuffled pool: lengths 1..N*P (one full row, the rest mostly
    with a partial last page), table entries past a row's pages padded with 0."""
    num_pages = B * G * N + 3
    k_cache = torch.randn(num_pages * P, Hkv, D, generator=g).to(device, dtype)
    v_cache = torch.randn(num_pages * P, Hkv, D, generator=g).to(device, dtype)
    table = torch.randperm(num_pages, generator=g)[:B * G * N].view(B, G, N).int()
    lengths = torch.randint(1, N * P + 1, (B, G), generator=g).int()
    lengths[0, 0] = N * P
    used = (lengths.long() + P - 1) // P
    table[torch.arange(N).view(1, 1, N) >= used.unsqueeze(-1)] = 0
    q = torch.randn(B, Hq, D, generator=g).to(device, dtype)
    return q, k_cache, v_cache, table.to(device), lengths.to(device)


def prefill_case(g, chunks, contexts, Hq, Hkv, D, P, dtype, device):
    """Chunks of cu_seqlens_q at the end of their contexts, keys through shuffled block tables."""
    B = len(chunks)
    N = max(-(-c // P) for c in contexts) + 1       # one padded entry at least
    num_pages = B * N + 2
    k_cache = torch.randn(num_pages * P, Hkv, D, generator=g).to(device, dtype)
    v_cache = torch.randn(num_pages * P, Hkv, D, generator=g).to(device, dtype)
    bt = torch.randperm(num_pages, generator=g)[:B * N].view(B, N).int()
    cu = torch.tensor([0] + torch.tensor(chunks).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(sum(chunks), Hq, D, generator=g).to(device, dtype)
    return (q, k_cache, v_cache, bt.to(device), cu.to(device),
            torch.tensor(contexts, dtype=torch.int32, device=device))


# ---------------------------------------------------------------- interpreter (CPU)

@interp
@pytest.mark.parametrize("P,G_is_heads,dtype", [
    (1, False, torch.float32), (1, True, torch.float16), (16, False, torch.float16),
    (16, True, torch.float32), (4, True, torch.float32), (64, False, torch.float32)])
def test_decode_attention_triton_matches_reference(P, G_is_heads, dtype, poison, monkeypatch):
    monkeypatch.setattr(da, "MIN_SPLIT_TOKENS", 16)   # several splits, some empty, on tiny rows
    g = torch.Generator().manual_seed(P * 10 + G_is_heads)
    B, Hq, Hkv, D = 3, 4, 2, 32
    N = {1: 70, 4: 20, 16: 5, 64: 2}[P]
    args = decode_case(g, B, Hq, Hkv, D, P, Hkv if G_is_heads else 1, N, dtype, "cpu")
    out = da.decode_attention_triton(*args, P, D ** -0.5)
    close(out, da.decode_attention_ref(*args, P, D ** -0.5), dtype)


@interp
@pytest.mark.parametrize("P", [1, 16])
def test_decode_attention_triton_per_query_head_rows(P, poison, monkeypatch):
    monkeypatch.setattr(da, "MIN_SPLIT_TOKENS", 16)
    g = torch.Generator().manual_seed(P + 3)
    args = decode_case(g, 3, 6, 2, 32, P, 6, {1: 70, 16: 5}[P], torch.float32, "cpu")   # G = H_q
    close(da.decode_attention_triton(*args, P, 0.2), da.decode_attention_ref(*args, P, 0.2), torch.float32)


@interp
@pytest.mark.parametrize("G_is_heads", [False, True])
def test_decode_attention_triton_single_split_writes_the_output_itself(G_is_heads, poison, monkeypatch):
    monkeypatch.setattr(da, "MIN_SPLIT_TOKENS", 1 << 30)   # one split per row: no merge kernel
    g = torch.Generator().manual_seed(21)
    args = decode_case(g, 3, 4, 2, 32, 16, 2 if G_is_heads else 1, 5, torch.float32, "cpu")
    assert da.num_splits(3, 2, 5, 16, torch.device("cpu")) == 1
    close(da.decode_attention_triton(*args, 16, 0.2), da.decode_attention_ref(*args, 16, 0.2), torch.float32)


@interp
@pytest.mark.parametrize("P,staged_blocks", [(1, 32), (16, 32), (1, 2)])
def test_decode_attention_reports_token_scores(P, staged_blocks, monkeypatch):
    """With a token_scores buffer the attention also leaves, per token of a G = 1 row and KV group,
    the max over the group's query heads of its raw logit (an OmniKV filter layer selects from the
    max over groups), across several splits; entries past a row's length are left alone. The last
    case stages several 16-token blocks a program and forces more splits to fit them."""
    monkeypatch.setattr(da, "MIN_SPLIT_TOKENS", 16)
    monkeypatch.setattr(da, "MAX_SCORE_ITERS", staged_blocks)
    if staged_blocks == 2:
        monkeypatch.setattr(da, "BLOCK_N", 16)
    g = torch.Generator().manual_seed(P + 31)
    q, k_cache, v_cache, table, lengths = decode_case(g, 3, 4, 2, 32, P, 1, {1: 70, 16: 5}[P], torch.float32, "cpu")
    T = table.shape[2] * P
    got = torch.full((3, 2, T), float("-inf"))
    want = got.clone()
    out = da.decode_attention_triton(q, k_cache, v_cache, table, lengths, P, 0.2, got)
    close(out, da.decode_attention_ref(q, k_cache, v_cache, table, lengths, P, 0.2, want), torch.float32)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    torch.testing.assert_close(got[torch.isfinite(want)], want[torch.isfinite(want)], atol=1e-5, rtol=1e-5)
    pos = torch.arange(T)
    slots = (table[:, 0].long()[:, pos // P] * P + pos % P)                      # [B, T]
    keys = k_cache[slots].repeat_interleave(2, dim=2)                             # [B, T, H_q, D]
    logits = torch.einsum("bhd,bthd->bht", q, keys).view(3, 2, 2, T).amax(2) * 0.2   # [B, H_kv, T]
    valid = (pos.view(1, T) < lengths.view(3, 1)).unsqueeze(1).expand(3, 2, T)
    torch.testing.assert_close(want[valid], logits[valid], atol=1e-5, rtol=1e-5)
    assert torch.isinf(want[~valid]).all()


@interp
def test_decode_attention_handles_non_power_of_two_group_and_head_dim(poison):
    g = torch.Generator().manual_seed(7)
    args = decode_case(g, 2, 6, 2, 24, 16, 1, 3, torch.float32, "cpu")
    close(da.decode_attention_triton(*args, 16, 0.2), da.decode_attention_ref(*args, 16, 0.2),
          torch.float32)


@interp
@pytest.mark.parametrize("P,dtype", [(1, torch.float32), (16, torch.float16), (4, torch.float32)])
def test_prefill_attention_triton_matches_reference(P, dtype, poison):
    g = torch.Generator().manual_seed(P)
    args = prefill_case(g, [5, 70, 1, 16], [5, 100, 33, 16], 4, 2, 32, P, dtype, "cpu")
    out = pa.prefill_attention_triton(*args, P, 0.25, 70)
    close(out, pa.prefill_attention_ref(*args, P, 0.25), dtype)


def rope_store_case(g, T, Hq, Hk, D, S, dtype, device="cpu"):
    q, k, v = (torch.randn(T, h, D, generator=g).to(dtype).to(device) for h in (Hq, Hk, Hk))
    cache = torch.randn(50, D, generator=g).to(device)
    pos = torch.randint(0, 50, (T,), generator=g).to(device)
    kc, vc = (torch.randn(S, Hk, D, generator=g).to(dtype).to(device) for _ in range(2))
    return q, k, v, pos, cache, kc, vc


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rope_store_triton_rotates_writes_mapped_slots_and_skips_padding(dtype, poison):
    g = torch.Generator().manual_seed(3)
    q, k, v, pos, cache, kc, vc = rope_store_case(g, 9, 6, 3, 32, 40, dtype)
    slots = torch.randperm(40, generator=g)[:9]
    slots[[2, 5]] = -1
    kc_ref, vc_ref = kc.clone(), vc.clone()
    got = rs.rope_store_triton(q, k, v, pos, cache, kc, vc, slots)
    want = rs.rope_store_ref(q, k, v, pos, cache, kc_ref, vc_ref, slots)
    for a, b in zip(got, want):
        close(a, b, dtype)
    close(kc, kc_ref, dtype)
    assert torch.equal(vc, vc_ref)
    assert torch.equal(kc[slots[slots >= 0]], got[1][slots >= 0])   # the cache holds k after RoPE


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rope_store_page_bounds_equal_the_min_max_of_each_page(dtype):
    """Decode-like writes (one token per page per step, pages filled in order) keep each page's
    channel-wise min/max of its stored keys exactly, the first slot resetting stale bounds."""
    g = torch.Generator().manual_seed(8)
    P, pages, Hk, D = 4, 3, 2, 16
    S = P * pages
    kc, vc = torch.zeros(S, Hk, D, dtype=dtype), torch.zeros(S, Hk, D, dtype=dtype)
    kmin = torch.randn(pages, Hk, D, generator=g).to(dtype)   # stale values from an earlier owner
    kmax = kmin.clone()
    kc_r, vc_r, kmin_r, kmax_r = kc.clone(), vc.clone(), kmin.clone(), kmax.clone()
    cache = torch.randn(50, D, generator=g)
    for off in range(P):              # step `off` writes slot off of every page (padding row: -1)
        slots = torch.tensor([p * P + off for p in range(pages)] + [-1])
        q, k, v = (torch.randn(pages + 1, h, D, generator=g).to(dtype) for h in (2 * Hk, Hk, Hk))
        pos = torch.randint(0, 50, (pages + 1,), generator=g)
        rs.rope_store_triton(q, k, v, pos, cache, kc, vc, slots, kmin, kmax, P)
        rs.rope_store_ref(q, k, v, pos, cache, kc_r, vc_r, slots, kmin_r, kmax_r, P)
        stored = kc_r.view(pages, P, Hk, D)[:, :off + 1]
        assert torch.equal(kmin_r, stored.amin(1)) and torch.equal(kmax_r, stored.amax(1))
        close(kmin, kmin_r, dtype)
        close(kmax, kmax_r, dtype)


@interp
@pytest.mark.parametrize("dtype,with_residual", [(torch.float32, True), (torch.float16, True),
                                                 (torch.float16, False)])
def test_rms_norm_triton_matches_reference(dtype, with_residual, poison):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(5, 96, generator=g).to(dtype)
    w = torch.randn(96, generator=g).to(dtype)
    res = torch.randn(5, 96, generator=g).to(dtype) if with_residual else None
    got, want = rmsnorm.rms_norm_triton(x, w, 1e-6, res), rmsnorm.rms_norm_ref(x, w, 1e-6, res)
    for a, b in zip(got if with_residual else [got], want if with_residual else [want]):
        close(a, b, dtype)


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_silu_and_mul_triton_matches_reference(dtype, poison):
    g = torch.Generator().manual_seed(6)
    x = torch.randn(3, 2 * 1500, generator=g).to(dtype)    # I spans two blocks, the last partial
    close(silu_mul.silu_and_mul_triton(x), silu_mul.silu_and_mul_ref(x), dtype)


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows,with_bias,sms", diagonal_quick([(1, False), (5, True), (16, False)], [1, 2, 132]))
def test_skinny_linear_triton_matches_reference(dtype, rows, with_bias, sms, poison, monkeypatch):
    # SM counts that give each launch shape of launch_config: 2 columns a program in 32-column
    # tiles, 50 in 64-column tiles (evenly spread), 64-column tiles in several waves.
    monkeypatch.setattr(skinny_gemm, "num_sms", lambda device: sms)
    g = torch.Generator().manual_seed(rows)
    # N spans a partial column block, K a partial K block; x arrives as a 3-d view like a model's.
    x = torch.randn(1, rows, 700, generator=g).to(dtype)
    w = (torch.randn(100, 700, generator=g) * 0.05).to(dtype)
    b = torch.randn(100, generator=g).to(dtype) if with_bias else None
    got = skinny_gemm.skinny_linear_triton(x, w, b)
    assert got.shape == (1, rows, 100)
    close(got, skinny_gemm.skinny_linear_ref(x.float(), w.float(), None if b is None else b.float()), dtype)


def qkv_store_case(g, rows, Hq, Hk, D, K, P, dtype, device="cpu"):
    """A decode step's qkv projection over a random pool: one row a page (page size P), the rows'
    slots anywhere in their pages, one padding row (-1); stale page bounds to fold into."""
    N = (Hq + 2 * Hk) * D
    x = torch.randn(rows, K, generator=g).to(dtype)
    w = (torch.randn(N, K, generator=g) * 0.1).to(dtype)
    b = torch.randn(N, generator=g).to(dtype)
    pages = 2 * rows + 1
    slots = torch.randperm(pages, generator=g)[:rows] * P + torch.randint(0, P, (rows,), generator=g)
    slots[rows // 2] = -1
    pos = torch.randint(0, 50, (rows,), generator=g)
    cache = torch.randn(50, D, generator=g)
    kc, vc = (torch.randn(pages * P, Hk, D, generator=g).to(dtype) for _ in range(2))
    kmin = torch.randn(pages, Hk, D, generator=g).to(dtype)
    kmax = kmin + torch.rand(pages, Hk, D, generator=g).to(dtype)
    out = (x, w, b, pos, cache, kc, vc, slots, kmin, kmax)
    return tuple(t.to(device) for t in out)


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows,sms", diagonal_quick([1, 5, 16], [1, 3, 132]))
@pytest.mark.parametrize("bounds", [False, True])
def test_linear_rope_store_triton_equals_the_gemm_then_rope_store(dtype, rows, sms, bounds, poison, monkeypatch):
    # 2 virtual columns a program (32-column tiles), 44 (64-column tiles, a program holding parts of
    # two heads and of q and k), 64-column tiles in waves; the q / k / v boundaries fall inside programs.
    monkeypatch.setattr(skinny_gemm, "num_sms", lambda device: sms)
    g = torch.Generator().manual_seed(40 + rows)
    Hq, Hk, D, P = 4, 2, 16, 4
    x, w, b, pos, cache, kc, vc, slots, kmin, kmax = qkv_store_case(g, rows, Hq, Hk, D, 200, P, dtype)
    ref = [t.clone() for t in (kc, vc, kmin, kmax)]
    mm = (kmin, kmax) if bounds else (None, None)
    got = skinny_gemm.linear_rope_store_triton(x, w, b, None, Hq * D, Hk * D, D, pos, cache, kc, vc, slots, *mm, P)
    want = skinny_gemm.linear_rope_store_ref(x, w, b, None, Hq * D, Hk * D, D, pos, cache, *ref[:2], slots,
                                             *(ref[2:] if bounds else (None, None)), P)
    assert got.shape == (rows, (Hq + 2 * Hk) * D)
    close(got, want, dtype)
    for a, r in zip((kc, vc, kmin, kmax), ref):
        close(a, r, dtype)
    keep = slots >= 0
    kv = got[:, Hq * D:].view(rows, 2, Hk, D)
    assert torch.equal(kc[slots[keep]], kv[keep, 0]) and torch.equal(vc[slots[keep]], kv[keep, 1])
    if not bounds:
        assert torch.equal(kmin, ref[2])
    # against the plain pieces: the GEMM (rounded to the dtype, as the kernel rounds it), then RoPE
    y = skinny_gemm.skinny_linear_ref(x.float(), w.float(), b.float()).to(dtype).float()
    q_rot, k_rot = rs.rope_store_ref(y[:, :Hq * D].reshape(rows, Hq, D), y[:, Hq * D:(Hq + Hk) * D].reshape(rows, Hk, D),
                                     y[:, (Hq + Hk) * D:].reshape(rows, Hk, D), pos, cache, kc.float().clone(),
                                     vc.float().clone(), torch.full_like(slots, -1))
    close(got[:, :Hq * D], q_rot.reshape(rows, -1), dtype)
    close(got[:, Hq * D:(Hq + Hk) * D], k_rot.reshape(rows, -1), dtype)


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows,sms", diagonal_quick([1, 7, 16], [1, 3, 132]))
def test_skinny_silu_mul_triton_matches_reference(dtype, rows, sms, poison, monkeypatch):
    # 2 or 30 columns of gate and of up a program in 32-column tiles, 90 in 128-column tiles
    monkeypatch.setattr(skinny_gemm, "num_sms", lambda device: sms)
    g = torch.Generator().manual_seed(20 + rows)
    # I = 90 spans a partial column block (gate rows 0..89, up rows 90..179), K a partial K block.
    x = torch.randn(1, rows, 700, generator=g).to(dtype)
    w = (torch.randn(180, 700, generator=g) * 0.05).to(dtype)
    got = skinny_gemm.skinny_silu_mul_triton(x, w)
    assert got.shape == (1, rows, 90)
    close(got, skinny_gemm.skinny_silu_mul_ref(x.float(), w.float()), dtype)
    close(skinny_gemm.linear_silu_mul(x, w), got, dtype)     # CPU tensors: the unfused path, same values


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows,sms", diagonal_quick([1, 5, 16], [1, 3, 132]))
def test_skinny_add_norm_then_row_norm_equals_add_rmsnorm_linear(dtype, rows, sms, poison, monkeypatch):
    """o_proj with the residual add and the RMSNorm (all but 1 / rms) in its epilogue, then qkv /
    gate_up scaling their rows by 1 / rms from o_proj's per-program sums of squares: the same as
    o_proj, add + RMSNorm, qkv / gate_up as three launches. sms gives 1, 3 and many programs' sums."""
    monkeypatch.setattr(skinny_gemm, "num_sms", lambda device: sms)
    g = torch.Generator().manual_seed(30 + rows)
    H = 300                                                   # the normed width: o_proj's N, qkv's K
    x = torch.randn(1, rows, 200, generator=g).to(dtype)      # attention output
    w_o = (torch.randn(H, 200, generator=g) * 0.05).to(dtype)
    res = torch.randn(1, rows, H, generator=g).to(dtype)
    w_norm = (torch.rand(H, generator=g) + 0.5).to(dtype)
    w_qkv = (torch.randn(100, H, generator=g) * 0.05).to(dtype)
    bias = torch.randn(100, generator=g).to(dtype)
    w_gu = (torch.randn(180, H, generator=g) * 0.05).to(dtype)
    eps = 1e-5

    xw, r, parts = skinny_gemm.skinny_add_norm_triton(x, w_o, res, w_norm)
    xw_ref, r_ref, parts_ref = skinny_gemm.skinny_add_norm_ref(x, w_o, res, w_norm)
    assert xw.shape == r.shape == (1, rows, H) and parts.shape[1] == skinny_gemm.MAX_ROWS
    close(r, r_ref, dtype)
    close(xw, xw_ref, dtype)
    close(parts.sum(0), parts_ref.sum(0), dtype)
    assert not parts.sum(0)[rows:].any()                      # rows past M add nothing

    normed, r_plain = rmsnorm.rms_norm_ref(skinny_gemm.skinny_linear_triton(x, w_o), w_norm, eps, res)
    assert torch.equal(r, r_plain)                            # the residual stream: two launches' bits
    row_norm = (parts, eps)
    close(skinny_gemm.skinny_linear_triton(xw, w_qkv, bias, row_norm),
          skinny_gemm.skinny_linear_ref(normed.float(), w_qkv.float(), bias.float()), dtype)
    close(skinny_gemm.skinny_silu_mul_triton(xw, w_gu, row_norm),
          skinny_gemm.skinny_silu_mul_ref(normed.float(), w_gu.float()), dtype)
    # the references of the fused pair agree with the triton pair (CPU dispatch: linear -> reference)
    close(skinny_gemm.linear(xw_ref, w_qkv, bias, (parts_ref, eps)),
          skinny_gemm.skinny_linear_triton(xw, w_qkv, bias, row_norm), dtype)
    close(skinny_gemm.linear_silu_mul(xw_ref, w_gu, (parts_ref, eps)),
          skinny_gemm.skinny_silu_mul_triton(xw, w_gu, row_norm), dtype)


def test_linear_routes_only_decode_sized_steps_over_wide_weights():
    w = torch.empty(4096, 4096, dtype=torch.bfloat16)
    x = torch.empty(4, 4096, dtype=torch.bfloat16)
    assert not skinny_gemm.takes(x, w)                      # CPU tensors: F.linear
    if CUDA:
        wc, xc = w.cuda(), x.cuda()
        assert skinny_gemm.takes(xc, wc)
        assert not skinny_gemm.takes(torch.empty(17, 4096, dtype=torch.bfloat16, device="cuda"), wc)  # prefill
        assert not skinny_gemm.takes(xc[:, :1024], wc[:1024, :1024].contiguous())                   # small model
        assert not skinny_gemm.takes(xc.float(), wc.float())                                        # fp32
    x = torch.randn(3, 64)
    w = torch.randn(32, 64)
    assert torch.equal(skinny_gemm.linear(x, w), torch.nn.functional.linear(x, w))


def test_kernel_modules_import_and_dispatch_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from sparsevllm.kernels import decode_attention, page_select, prefill_attention, rmsnorm, rope_store, silu_mul\n"
        "from sparsevllm.kernels import page_bounds, skinny_gemm, token_select\n"
        "x = torch.randn(2, 8)\n"
        "assert torch.equal(skinny_gemm.linear(x, torch.ones(4, 8)), x @ torch.ones(4, 8).T)\n"
        "assert torch.equal(silu_mul.silu_and_mul(x), silu_mul.silu_and_mul_ref(x))\n"
        "assert torch.equal(rmsnorm.rms_norm(x, torch.ones(8), 1e-6), rmsnorm.rms_norm_ref(x, torch.ones(8), 1e-6))\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    env.pop("TRITON_INTERPRET", None)
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


# ---------------------------------------------------------------- GPU (bf16)

@gpu
@pytest.mark.parametrize("P", [1, 16, 64])
@pytest.mark.parametrize("G", [1, 8, 32])
def test_gpu_decode_attention_matches_reference_bf16(P, G):
    g = torch.Generator().manual_seed(P + 100 * G)
    for B, N in [(1, 4096 // P), (5, 1000 // P + 1), (17, 300 // P + 1)]:
        args = decode_case(g, B, 32, 8, 128, P, G, N, torch.bfloat16, "cuda")
        close(da.decode_attention(*args, P, 128 ** -0.5),
              da.decode_attention_ref(*args, P, 128 ** -0.5), torch.bfloat16)


@gpu
def test_gpu_decode_attention_32k_context():
    g = torch.Generator().manual_seed(32)
    args = decode_case(g, 2, 32, 8, 128, 16, 1, 32768 // 16, torch.bfloat16, "cuda")
    # A peaked softmax (large scale) so a wrong split merge moves the output well past tolerance.
    close(da.decode_attention(*args, 16, 0.3), da.decode_attention_ref(*args, 16, 0.3), torch.bfloat16)


@gpu
def test_gpu_decode_attention_cuda_graph_replay_equals_eager():
    g = torch.Generator().manual_seed(9)
    B, P, N = 4, 16, 256
    q, kc, vc, table, lengths = decode_case(g, B, 32, 8, 128, P, 1, N, torch.bfloat16, "cuda")
    out = da.decode_attention(q, kc, vc, table, lengths, P, 0.1)          # warm-up / compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = da.decode_attention(q, kc, vc, table, lengths, P, 0.1)
    for trial in range(3):
        new = decode_case(g, B, 32, 8, 128, P, 1, N, torch.bfloat16, "cuda")
        new[4][:] = torch.randint(1, 40 * (trial + 1), (B, 1), generator=g).int().cuda()
        for dst, src in zip((q, kc, vc, table, lengths), new):
            dst.copy_(src)
        graph.replay()
        eager = da.decode_attention(q, kc, vc, table, lengths, P, 0.1)
        torch.testing.assert_close(out, eager, atol=0, rtol=0)
        close(out, da.decode_attention_ref(q, kc, vc, table, lengths, P, 0.1), torch.bfloat16)


@gpu
@pytest.mark.parametrize("P", [1, 16])
def test_gpu_prefill_attention_with_prefix_matches_reference_bf16(P):
    g = torch.Generator().manual_seed(P)
    args = prefill_case(g, [100, 513, 1, 64], [300, 2000, 700, 64], 32, 8, 128, P, torch.bfloat16, "cuda")
    k = v = torch.empty(0)   # unused with a prefix
    out = pa.prefill_attention(args[0], k, v, *args[1:], max_seqlen_q=513, has_prefix=True,
                               page_size=P, scale=0.1)
    close(out, pa.prefill_attention_ref(*args, P, 0.1), torch.bfloat16)


@gpu
def test_gpu_varlen_attention_without_prefix_matches_reference_bf16():
    g = torch.Generator().manual_seed(11)
    lens = [37, 300, 1, 128]
    T = sum(lens)
    q = torch.randn(T, 32, 128, generator=g).cuda().bfloat16()
    k = torch.randn(T, 8, 128, generator=g).cuda().bfloat16()
    v = torch.randn(T, 8, 128, generator=g).cuda().bfloat16()
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    want = pa.varlen_attention_ref(q, k, v, cu, max(lens), 0.1)
    for seq_lens in (lens, None):   # SDPA per sequence, and varlen_attn without host lengths
        out = pa.prefill_attention(q, k, v, None, None, None, cu, None, max(lens), False, 16, 0.1, seq_lens)
        assert not pa._varlen_broken, f"a FlashAttention backend failed: {pa._varlen_broken}"
        close(out, want, torch.bfloat16)


@gpu
def test_gpu_fused_ops_match_reference_bf16():
    g = torch.Generator().manual_seed(12)
    bf = torch.bfloat16
    for T in (1, 7, 300):
        x, res = torch.randn(T, 4096, generator=g).cuda().to(bf), torch.randn(T, 4096, generator=g).cuda().to(bf)
        w = torch.randn(4096, generator=g).cuda().to(bf)
        for a, b in zip(rmsnorm.rms_norm(x, w, 1e-5, res), rmsnorm.rms_norm_ref(x, w, 1e-5, res)):
            close(a, b, bf)
        close(rmsnorm.rms_norm(x, w, 1e-5), rmsnorm.rms_norm_ref(x, w, 1e-5), bf)
        xm = torch.randn(T, 2 * 14336, generator=g).cuda().to(bf)
        close(silu_mul.silu_and_mul(xm), silu_mul.silu_and_mul_ref(xm), bf)
        q, k, v, pos, cache, kc, vc = rope_store_case(g, T, 32, 8, 128, 4 * T, bf, "cuda")
        slots = torch.randperm(4 * T, generator=g)[:T].cuda()
        slots[::3] = -1
        kc2, vc2 = kc.clone(), vc.clone()
        kmin, kmax = (torch.randn(4 * T, 8, 128, generator=g).cuda().to(bf) for _ in range(2))
        kmin2, kmax2 = kmin.clone(), kmax.clone()
        # page size 1: every slot is its own page, so the bounds are exact for any slot mapping
        got = rs.rope_store(q, k, v, pos, cache, kc, vc, slots, kmin, kmax, 1)
        want = rs.rope_store_ref(q, k, v, pos, cache, kc2, vc2, slots, kmin2, kmax2, 1)
        for a, b in zip(got, want):
            close(a, b, bf)
        for a, b in ((kc, kc2), (kmin, kmin2), (kmax, kmax2)):
            close(a, b, bf)
        assert torch.equal(vc, vc2)


@gpu
def test_gpu_skinny_linear_matches_cublas_on_llama_shapes_bf16():
    g = torch.Generator().manual_seed(14)
    bf = torch.bfloat16
    for n, k, bias in ((6144, 4096, True), (4096, 4096, False), (28672, 4096, False), (4096, 14336, False),
                       (128256, 4096, False)):
        w = (torch.randn(n, k, generator=g) * 0.02).cuda().to(bf)
        b = torch.randn(n, generator=g).cuda().to(bf) if bias else None
        for rows in (1, 4, 16):
            x = torch.randn(rows, k, generator=g).cuda().to(bf)
            assert skinny_gemm.takes(x, w)
            want = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
            close(skinny_gemm.linear(x, w, b), want, bf)


@gpu
def test_gpu_qkv_rope_store_equals_the_gemm_then_rope_store_on_llama_shapes_bf16():
    """The qkv GEMM with RoPE and the cache write (and Quest's page bounds) in its epilogue == the
    skinny GEMM, then rope_store: rounded at the same points with the same fmas, so equal bits up to
    the order of the K sum (the same tiles walk K in the same order; only the columns are permuted)."""
    g = torch.Generator().manual_seed(16)
    bf = torch.bfloat16
    Hq, Hk, D, P = 32, 8, 128, 16
    for rows in (1, 4, 16):
        x, w, b, pos, cache, kc, vc, slots, kmin, kmax = qkv_store_case(g, rows, Hq, Hk, D, 4096, P, bf, "cuda")
        assert skinny_gemm.takes(x, w)
        for bounds in (False, True):
            ref = [t.clone() for t in (kc, vc, kmin, kmax)]
            mm = (kmin, kmax) if bounds else (None, None)
            got = skinny_gemm.linear_rope_store(x, w, b, None, Hq * D, Hk * D, D, pos, cache, kc, vc, slots, *mm, P)
            y = skinny_gemm.linear(x, w, b)
            q, k, v = y.split([Hq * D, Hk * D, Hk * D], dim=-1)
            q, k = rs.rope_store(q.reshape(rows, Hq, D), k.reshape(rows, Hk, D), v.reshape(rows, Hk, D), pos, cache,
                                 ref[0], ref[1], slots, *(ref[2:] if bounds else (None, None)), P)
            want = torch.cat([q.reshape(rows, -1), k.reshape(rows, -1), v], dim=-1)
            for name, a, r in zip(("qkv", "k_cache", "v_cache", "kmin", "kmax"), (got, kc, vc, kmin, kmax), [want] + ref):
                close(a, r, bf)
                assert (a != r).float().mean() < 1e-3, (rows, bounds, name, (a != r).sum().item())


@gpu
def test_gpu_skinny_silu_mul_equals_the_two_launches_on_llamas_gate_up_bf16():
    """Fused epilogue == skinny GEMM then silu_and_mul: rounded at the same points, so equal bits up
    to the order of the K sum (the same tiles walk K in the same order in both)."""
    g = torch.Generator().manual_seed(15)
    bf = torch.bfloat16
    w = (torch.randn(28672, 4096, generator=g) * 0.02).cuda().to(bf)
    for rows in (1, 4, 16):
        x = torch.randn(rows, 4096, generator=g).cuda().to(bf)
        assert skinny_gemm.takes(x, w)
        want = silu_mul.silu_and_mul(skinny_gemm.linear(x, w))
        got = skinny_gemm.linear_silu_mul(x, w)
        close(got, want, bf)
        close(got, skinny_gemm.skinny_silu_mul_ref(x.float(), w.float()), bf)


@gpu
def test_gpu_decoder_gemms_launched_back_to_back_under_a_graph_match_eager_and_the_reference_bf16():
    """Three Llama-3.1-8B layers' decode GEMMs and norms as programmatic dependent launches (on an
    sm_90+ GPU): each starts while the one before drains and must wait for its output (gdc_wait).
    Replayed from a CUDA graph they give eager's bits; one layer matches the fp32 reference."""
    g = torch.Generator().manual_seed(16)
    bf = torch.bfloat16
    w = {name: (torch.randn(n, k, generator=g) * 0.02).cuda().to(bf)
         for name, n, k in (("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336))}
    g1, g2 = ((torch.rand(4096, generator=g) + 0.5).cuda().to(bf) for _ in range(2))

    def block(h, norm, lin, silu, layers=3):
        res = None
        for _ in range(layers):   # each kernel reads the one before's output
            x, res = (norm(h, g1, 1e-5), h) if res is None else norm(h, g1, 1e-5, res)
            h = lin(lin(x, w["qkv"])[:, :4096], w["o"])
            x, res = norm(h, g2, 1e-5, res)
            h = lin(silu(x, w["gate_up"]), w["down"])
        return h + res

    fused = (rmsnorm.rms_norm, skinny_gemm.linear, skinny_gemm.linear_silu_mul)
    for rows in (1, 4):
        h = torch.randn(rows, 4096, generator=g).cuda().to(bf)
        assert skinny_gemm.takes(h, w["qkv"])
        eager = block(h, *fused)
        static = h.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = block(static, *fused)
        for _ in range(3):
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, eager)
        want = block(h.float(), rmsnorm.rms_norm_ref, lambda x, wt: skinny_gemm.skinny_linear_ref(x, wt.float()),
                     lambda x, wt: skinny_gemm.skinny_silu_mul_ref(x, wt.float()), layers=1)
        got = block(h, *fused, layers=1).float()
        assert (got - want).norm() / want.norm() < 1e-2


@gpu
def test_gpu_decoder_gemms_with_the_norms_in_their_epilogues_under_a_graph_bf16():
    """Llama-3.1-8B layers as RowParallelLinear.add_norm runs them on decode steps: o_proj / down
    add the residual and apply the next norm but its 1 / rms, qkv / gate_up scale their rows by it
    (from the producer's per-program sums of squares, read after gdc_wait). A graph replays eager's
    bits; it matches the three-launch block (norm, GEMM, GEMM) and the fp32 reference."""
    g = torch.Generator().manual_seed(17)
    bf = torch.bfloat16
    w = {name: (torch.randn(n, k, generator=g) * 0.02).cuda().to(bf)
         for name, n, k in (("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336))}
    g1, g2 = ((torch.rand(4096, generator=g) + 0.5).cuda().to(bf) for _ in range(2))
    eps = 1e-5

    def fused(h, layers=3):
        res, row = h, None
        x = rmsnorm.rms_norm(h, g1, eps)
        for _ in range(layers):
            a = skinny_gemm.linear(x, w["qkv"], None, row)[:, :4096]
            x, res, parts = skinny_gemm.skinny_add_norm_triton(a, w["o"], res, g2)
            m = skinny_gemm.linear_silu_mul(x, w["gate_up"], (parts, eps))
            x, res, parts = skinny_gemm.skinny_add_norm_triton(m, w["down"], res, g1)
            row = (parts, eps)
        return x, res, row

    def plain(h, layers=3):
        res = h
        x = rmsnorm.rms_norm(h, g1, eps)
        for _ in range(layers):
            a = skinny_gemm.linear(x, w["qkv"])[:, :4096]
            x, res = rmsnorm.rms_norm(skinny_gemm.linear(a, w["o"]), g2, eps, res)
            x, res = rmsnorm.rms_norm(skinny_gemm.linear(skinny_gemm.linear_silu_mul(x, w["gate_up"]), w["down"]), g1, eps, res)
        return x, res

    for rows in (1, 4, 16):
        h = torch.randn(rows, 4096, generator=g).cuda().to(bf)
        assert skinny_gemm.takes(h, w["o"]) and skinny_gemm.takes(h, w["qkv"])
        x, res, row = fused(h)
        static = h.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fused(static)
        for _ in range(3):
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out[0], x) and torch.equal(out[1], res) and torch.equal(out[2][0], row[0])
        # the next layer's normed input: w_norm * r scaled by 1 / rms, against the plain launches
        got = (x.float() * skinny_gemm.rstd_of(row, rows, 4096)).to(bf)
        want, want_res = plain(h)
        assert (res.float() - want_res.float()).norm() / want_res.float().norm() < 1e-2
        assert (got.float() - want.float()).norm() / want.float().norm() < 1e-2
        one, _, row1 = fused(h, layers=1)
        a = skinny_gemm.skinny_linear_ref(rmsnorm.rms_norm_ref(h.float(), g1.float(), eps), w["qkv"].float())[:, :4096]
        ref, ref_res = rmsnorm.rms_norm_ref(skinny_gemm.skinny_linear_ref(a, w["o"].float()), g2.float(), eps, h.float())
        m = skinny_gemm.skinny_silu_mul_ref(ref, w["gate_up"].float())
        ref, _ = rmsnorm.rms_norm_ref(skinny_gemm.skinny_linear_ref(m, w["down"].float()), g1.float(), eps, ref_res)
        got1 = one.float() * skinny_gemm.rstd_of(row1, rows, 4096)
        assert (got1 - ref).norm() / ref.norm() < 1e-2


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_gpu_attention_kernels_match_reference_in_fp16_and_fp32(dtype):
    g = torch.Generator().manual_seed(13)
    args = decode_case(g, 3, 32, 8, 128, 16, 8, 40, dtype, "cuda")
    close(da.decode_attention(*args, 16, 0.1), da.decode_attention_ref(*args, 16, 0.1), dtype)
    args = prefill_case(g, [100, 3], [300, 50], 32, 8, 128, 16, dtype, "cuda")
    close(pa.prefill_attention_triton(*args, 16, 0.1, 100), pa.prefill_attention_ref(*args, 16, 0.1), dtype)

"""Kernel/reference agreement at edge shapes the main kernel tests do not reach: ties in Quest's
page selection (the CPU reference must break them in page order as the Triton kernel does), empty
decode rows (length 0), and 1-D index vectors passed as strided views."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from sparsevllm.kernels import decode_attention as da, omnikv as ok, page_select as psel  # noqa: E402
from sparsevllm.kernels import token_select as tsel  # noqa: E402

# On a GPU the compiled kernels, on CPU the interpreter (fp32 throughout: both compute it exactly enough).
DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = dict(atol=1e-5, rtol=1e-5) if DEV == "cpu" else dict(atol=2e-3, rtol=2e-3)   # tl.dot's fp32 is TF32 on GPUs


def _select_case(seed, B, G, N, P, values):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, values, (B, G, N), generator=g).float()
    bt = torch.randperm(B * N + 5, generator=g)[:B * N].view(B, N).int()
    ctx = torch.tensor([N * P - 1 - 3 * b for b in range(B)], dtype=torch.int32)
    current = (ctx.long() - 1) // P
    scores = scores.masked_fill(torch.arange(N).view(1, 1, N) >= current.view(B, 1, 1), float("-inf"))
    return scores, bt, ctx, current


@pytest.mark.parametrize("N,n,values", [(20, 5, 1), (40, 9, 3), (200, 17, 2)])
def test_select_pages_reference_breaks_ties_in_page_order(N, n, values):
    """Equal page scores at the cut: the reference (the CPU path) picks the earliest pages, the
    same pages as the Triton kernel, and keeps the current page last."""
    B, G, P = 2, 3, 4
    scores, bt, ctx, current = _select_case(N, B, G, N, P, values)
    table, lengths = psel.select_pages_ref(scores, bt, ctx, P, n)
    for b in range(B):
        for g in range(G):
            cands = sorted(range(int(current[b])), key=lambda i: (-float(scores[b, g, i]), i))[:n - 1]
            want = [int(bt[b, i]) for i in sorted(cands)] + [int(bt[b, current[b]])]
            assert table[b, g].tolist() == want
    got = psel.select_pages_triton(scores.to(DEV), bt.to(DEV), ctx.to(DEV), P, n)
    assert torch.equal(got[0].cpu(), table) and torch.equal(got[1].cpu(), lengths)


@pytest.mark.parametrize("G_is_heads,direct", [(False, False), (True, True), (False, True)])
def test_decode_attention_empty_row_gives_zeros_in_kernel_and_reference(G_is_heads, direct, monkeypatch):
    """A row of length 0 attends to nothing: zeros from both (the merge kernel's rule), not NaN."""
    monkeypatch.setattr(da, "MIN_SPLIT_TOKENS", 1 << 30 if direct else 16)
    g = torch.Generator().manual_seed(5)
    B, Hq, Hkv, D, P, N = 3, 4, 2, 32, 4, 5
    G = Hkv if G_is_heads else 1
    k = torch.randn(B * G * N * P + 8, Hkv, D, generator=g)
    v = torch.randn_like(k)
    table = torch.randperm(B * G * N + 2, generator=g)[:B * G * N].view(B, G, N).int()
    lengths = torch.tensor([0, 20, 1] * G, dtype=torch.int32).view(G, B).t().contiguous()
    q = torch.randn(B, Hq, D, generator=g)
    ref = da.decode_attention_ref(q, k, v, table, lengths, P, 0.2)
    out = da.decode_attention_triton(*(x.to(DEV) for x in (q, k, v, table, lengths)), P, 0.2).cpu()
    assert not ref.isnan().any()
    assert torch.equal(ref[0], torch.zeros_like(ref[0]))
    torch.testing.assert_close(out, ref, **TOL)


def test_select_pages_triton_reads_strided_cache_lens():
    """cache_lens as a strided view (a column of a [B, 2] tensor): the kernel reads the row's own length."""
    B, G, N, P, n = 3, 2, 40, 4, 5
    scores, bt, ctx, _ = _select_case(1, B, G, N, P, 1000)
    pair = torch.stack([ctx, torch.full_like(ctx, 7)], dim=1)        # [B, 2]: column 0 is ctx
    got = psel.select_pages_triton(scores.to(DEV), bt.to(DEV), pair.to(DEV)[:, 0], P, n)
    want = psel.select_pages_ref(scores, bt, ctx, P, n)
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])


def test_omnikv_kernels_read_strided_length_vectors():
    g = torch.Generator().manual_seed(3)
    B, Hq, Hkv, D, P, N = 3, 4, 2, 32, 4, 10
    k = torch.randn((B * N + 2) * P, Hkv, D, generator=g)
    q = torch.randn(B, Hq, D, generator=g)
    bt = torch.randperm(B * N + 2, generator=g)[:B * N].view(B, N).int()
    cl, pl, keep = torch.tensor([40, 17, 9]).int(), torch.tensor([33, 40, 2]).int(), torch.tensor([5, 3, 1]).int()

    def strided(x):
        return torch.stack([x, x * 0 + 1], dim=1).to(DEV)[:, 0]

    def dev(x):
        return x.to(DEV)

    want = ok.omnikv_scores_ref(q, k, bt, cl, pl, P, 0.3, "last")
    got = ok.omnikv_scores_triton(dev(q), dev(k), dev(bt), strided(cl), strided(pl), P, 0.3, "last").cpu()
    fin = torch.isfinite(want)
    assert torch.equal(fin, torch.isfinite(got))
    torch.testing.assert_close(got[fin], want[fin], **TOL)
    tw, lw = tsel.select_tokens_ref(want, keep, bt, cl, pl, P)
    tg, lg = tsel.select_tokens_triton(dev(want), strided(keep), dev(bt), strided(cl), strided(pl), P)
    tg, lg = tg.cpu(), lg.cpu()
    assert torch.equal(lg, lw)
    for b in range(B):
        assert torch.equal(tg[b, 0, :lw[b, 0]], tw[b, 0, :lw[b, 0]])

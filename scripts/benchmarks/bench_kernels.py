"""Kernel micro-benchmarks: decode attention bandwidth, fused ops, the skinny GEMM and prefill vs their refs.

    PYTHONPATH=src python scripts/benchmarks/bench_kernels.py --out kernels.json

Decode attention is timed over a dense decode view (every row the full context) for batch 1/4/32 x
4K/32K/128K, page sizes 1/16/64 and G = 1 / G = H_kv, Llama-3.1-8B heads (32 q, 8 kv, d = 128),
bf16, and reported as TB/s of KV read, timed both eagerly (triton.testing.do_bench, median; small
cases are launch-bound there) and replayed from a CUDA graph (do_bench_cudagraph, as the engine runs
decode). The fused ops (RMSNorm, RoPE + KV-cache write, SiLU-mul) are timed against their torch
references; the decode-step GEMM (skinny_gemm, at most 16 rows) against F.linear (cuBLAS) on the
Llama-3.1-8B weight shapes, graph-timed with the weight cold in L2 and reported as GB/s of weight read.
Decoder layers' GEMMs with the RMSNorms as launches against the norms in the GEMM epilogues.
DeltaKV's up(z) of the selected latents: gather + F.linear against the gathering Triton GEMM.
--sweep first tries launch settings of the decode and prefill kernels and uses the best;
--sweep-splits times several split-count heuristics.
--sweep-fp8 times only the FP8 decode paths (V and K read as bytes or as int32 words, 4 or 8 warps)
and split counts at 4 x 64K / 128K tokens against the bf16 cache, then stops.
`--smoke` runs tiny shapes on whatever device there is (under TRITON_INTERPRET on CPU) to check the
script itself.
"""
import argparse
import itertools
import json
import os
import platform
import sys
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402

from sparsevllm.kernels import decode_attention as da  # noqa: E402
from sparsevllm.kernels import prefill_attention as pa, rmsnorm, rope_store as rs, silu_mul  # noqa: E402
from sparsevllm.kernels import deltakv as kd  # noqa: E402
from sparsevllm.kernels import page_bounds as pb, page_select as psel, quest as qk  # noqa: E402
from sparsevllm.kernels import skinny_gemm as sk  # noqa: E402
from sparsevllm.kernels.common import quantize_ref  # noqa: E402

HQ, HKV, D = 32, 8, 128
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def bench_ms(fn) -> float:
    if DEV == "cuda":
        return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")
    # On the CPU (a --smoke run, the kernels under the interpreter) the time only shows the path ran:
    # one call, which keeps the smoke run short.
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def bench_graph_ms(fn) -> float:
    """Median time of fn replayed from a CUDA graph: the kernels alone, without launch overhead
    (decode runs this way in the engine)."""
    if DEV != "cuda":
        return bench_ms(fn)
    # do_bench_cudagraph runs fn on a side stream: without this sync it can read inputs (a block
    # table still being written by randperm) before the default stream has produced them.
    torch.cuda.synchronize()
    try:
        return triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median")
    except TypeError:  # older Triton without return_mode
        return triton.testing.do_bench_cudagraph(fn, rep=20)


def dense_view(B, ctx, P, G, gen):
    """Every row covers the full context through shuffled pages of one pool of B * ctx slots."""
    num_pages = B * ctx // P
    N = ctx // P
    if G == 1:
        table = torch.randperm(num_pages, device=DEV, generator=gen).view(B, 1, N)
    else:  # each KV head reads its own permutation of the request's pages
        table = torch.stack([torch.randperm(num_pages, device=DEV, generator=gen)[:B * N].view(B, N)
                             for _ in range(G)], dim=1)
    lengths = torch.full((B, G), ctx, dtype=torch.int32, device=DEV)
    return table.int().contiguous(), lengths


def kv_bytes(B, ctx, dtype=torch.bfloat16):
    return 2 * B * ctx * HKV * D * torch.finfo(dtype).bits // 8


def copy_bandwidth():
    x = torch.empty(1 << 30, dtype=torch.uint8, device=DEV)
    y = torch.empty_like(x)
    ms = bench_ms(lambda: y.copy_(x))
    return 2 * x.numel() / ms / 1e9


def sweep_decode(results, gen, ctx):
    """Launch settings of the split kernel on B = 4 x ctx; leaves the best in the module."""
    B = 4
    k_cache = torch.randn(B * ctx, HKV, D, device=DEV, dtype=torch.bfloat16, generator=gen)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(B, HQ, D, device=DEV, dtype=torch.bfloat16, generator=gen)
    views = {P: dense_view(B, ctx, P, 1, gen) for P in (1, 16)}
    best = None
    for block_n in (32, 64, 128):
        for warps in (4, 8):
            for stages in (2, 3):
                for pps in (4, 8):
                    da.BLOCK_N, da.NUM_WARPS, da.NUM_STAGES, da.PROGRAMS_PER_SM = block_n, warps, stages, pps
                    row = {"BLOCK_N": block_n, "num_warps": warps, "num_stages": stages,
                           "programs_per_sm": pps}
                    try:
                        for P, (table, lengths) in views.items():
                            ms = bench_ms(lambda: da.decode_attention_triton(
                                q, k_cache, v_cache, table, lengths, P, D ** -0.5))
                            row[f"P{P}_tbps"] = round(kv_bytes(B, ctx) / ms / 1e9, 3)
                    except Exception as e:  # e.g. out of shared memory for a large block
                        row["error"] = str(e)[:200]
                        results.append(row)
                        continue
                    results.append(row)
                    print("sweep", row, flush=True)
                    score = min(row["P1_tbps"], row["P16_tbps"])
                    if best is None or score > best[0]:
                        best = (score, row)
    r = best[1]
    da.BLOCK_N, da.NUM_WARPS, da.NUM_STAGES, da.PROGRAMS_PER_SM = (
        r["BLOCK_N"], r["num_warps"], r["num_stages"], r["programs_per_sm"])
    print("best decode settings", r, flush=True)
    return r


def bench_decode(results, gen, batches, contexts, deadline):
    free = torch.cuda.mem_get_info()[0] if DEV == "cuda" else 1 << 34
    for B in batches:
        for ctx in contexts:
            if 2.3 * kv_bytes(B, ctx) > free:
                results.append({"batch": B, "context": ctx, "skipped": "does not fit"})
                continue
            k_cache = torch.randn(B * ctx, HKV, D, device=DEV, dtype=torch.bfloat16, generator=gen)
            v_cache = torch.randn_like(k_cache)
            q = torch.randn(B, HQ, D, device=DEV, dtype=torch.bfloat16, generator=gen)
            for P in (1, 16, 64):
                for G in (1, HKV):
                    if time.time() > deadline:
                        results.append({"batch": B, "context": ctx, "page_size": P, "G": G,
                                        "skipped": "time budget"})
                        continue
                    table, lengths = dense_view(B, ctx, P, G, gen)
                    fn = lambda: da.decode_attention(q, k_cache, v_cache, table, lengths,  # noqa: E731
                                                     P, D ** -0.5)
                    ms, graph_ms = bench_ms(fn), bench_graph_ms(fn)
                    row = {"batch": B, "context": ctx, "page_size": P, "G": G,
                           "eager_ms": round(ms, 4), "graph_ms": round(graph_ms, 4),
                           "kv_tbps": round(kv_bytes(B, ctx) / graph_ms / 1e9, 3),
                           "eager_kv_tbps": round(kv_bytes(B, ctx) / ms / 1e9, 3),
                           "splits": da.num_splits(B, HKV, ctx // P, P, q.device)}
                    results.append(row)
                    print("decode", row, flush=True)
                    del table, lengths
            del k_cache, v_cache
            if DEV == "cuda":
                torch.cuda.empty_cache()


def sweep_splits(results, gen, cases):
    """Graph-timed decode for several PROGRAMS_PER_SM values (the split-count heuristic)."""
    keep = da.PROGRAMS_PER_SM
    for B, ctx in cases:
        k_cache = torch.randn(B * ctx, HKV, D, device=DEV, dtype=torch.bfloat16, generator=gen)
        v_cache = torch.randn_like(k_cache)
        q = torch.randn(B, HQ, D, device=DEV, dtype=torch.bfloat16, generator=gen)
        table, lengths = dense_view(B, ctx, 16, 1, gen)
        row = {"batch": B, "context": ctx}
        for pps in (1, 2, 3, 4, 6, 8, 12, 16):
            da.PROGRAMS_PER_SM = pps
            ms = bench_graph_ms(lambda: da.decode_attention(q, k_cache, v_cache, table, lengths,
                                                            16, D ** -0.5))
            row[f"pps{pps}_splits"] = da.num_splits(B, HKV, ctx // 16, 16, q.device)
            row[f"pps{pps}_tbps"] = round(kv_bytes(B, ctx) / ms / 1e9, 3)
        results.append(row)
        print("splits sweep", row, flush=True)
        del k_cache, v_cache, table
    da.PROGRAMS_PER_SM = keep


def bench_fused(results, gen, token_counts):
    bf = torch.bfloat16

    def add(op, T, ref, fused, ref_capturable=True):
        ref_ms, fused_ms = bench_ms(ref), bench_ms(fused)
        row = {"op": op, "tokens": T, "ref_ms": round(ref_ms, 5), "triton_ms": round(fused_ms, 5),
               "speedup": round(ref_ms / fused_ms, 2)}
        if DEV == "cuda":   # in a graph, without launch overhead
            row["triton_graph_ms"] = round(bench_graph_ms(fused), 5)
            if ref_capturable:
                row["ref_graph_ms"] = round(bench_graph_ms(ref), 5)
                row["graph_speedup"] = round(row["ref_graph_ms"] / row["triton_graph_ms"], 2)
        results.append(row)
        print("fused", row, flush=True)

    for T in token_counts:
        x = torch.randn(T, 4096, device=DEV, dtype=bf, generator=gen)
        res, w = torch.randn_like(x), torch.randn(4096, device=DEV, dtype=bf, generator=gen)
        add("rms_norm+residual", T, lambda: rmsnorm.rms_norm_ref(x, w, 1e-5, res),
            lambda: rmsnorm.rms_norm_triton(x, w, 1e-5, res))
        add("rms_norm", T, lambda: rmsnorm.rms_norm_ref(x, w, 1e-5),
            lambda: rmsnorm.rms_norm_triton(x, w, 1e-5))
        xm = torch.randn(T, 2 * 14336, device=DEV, dtype=bf, generator=gen)
        add("silu_and_mul", T, lambda: silu_mul.silu_and_mul_ref(xm),
            lambda: silu_mul.silu_and_mul_triton(xm))
        args = rope_store_inputs(T, gen)
        add("rope_store", T, lambda: rs.rope_store_ref(*args), lambda: rs.rope_store_triton(*args),
            ref_capturable=False)   # its boolean-mask indexing (padding slots) syncs with the host


def rope_store_inputs(T, gen):
    """One layer's RoPE + KV write as the engine calls it: T tokens at random positions of a 128K
    cos/sin cache, written to distinct random slots of a pool a few times larger."""
    bf = torch.bfloat16
    q = torch.randn(T, HQ, D, device=DEV, dtype=bf, generator=gen)
    k, v = (torch.randn(T, HKV, D, device=DEV, dtype=bf, generator=gen) for _ in range(2))
    cache = torch.randn(131072, D, device=DEV, generator=gen)
    pos = torch.randint(0, 131072, (T,), device=DEV, generator=gen)
    k_cache = torch.zeros(4 * T + 64, HKV, D, device=DEV, dtype=bf)
    slots = torch.randperm(k_cache.shape[0], device=DEV, generator=gen)[:T]
    return q, k, v, pos, cache, k_cache, torch.zeros_like(k_cache), slots


# Llama-3.1-8B's decode weights (N, K); qkv and gate_up are the merged projections the engine runs.
LLAMA_LINEARS = [("qkv", 6144, 4096), ("o_proj", 4096, 4096), ("gate_up", 28672, 4096),
                 ("down", 4096, 14336), ("lm_head", 128256, 4096)]


def bench_skinny(results, gen, shapes, row_counts, dtype, cold_bytes):
    """The weight-streaming GEMM vs F.linear per (N, K) and rows, graph-timed. Each call runs over
    its own copy of the weight, the copies together about cold_bytes, well past the L2 (50 MB on the
    H200): a decode step reads every weight from HBM, and a weight left in L2 by the previous replay
    would time the cache instead."""
    for name, N, K in shapes:
        wbytes = N * K * torch.finfo(dtype).bits // 8
        copies = max(2, int(cold_bytes // wbytes))
        ws = [torch.randn(N, K, device=DEV, dtype=dtype, generator=gen) for _ in range(copies)]
        for M in row_counts:
            x = torch.randn(M, K, device=DEV, dtype=dtype, generator=gen)
            row = {"op": name, "N": N, "K": K, "rows": M, "weight_copies": copies,
                   "engine_uses_skinny": sk.takes(x, ws[0])}
            for label, lin in (("f_linear", torch.nn.functional.linear), ("triton", sk.skinny_linear_triton)):
                us = bench_graph_ms(lambda: [lin(x, w) for w in ws]) / copies * 1e3
                row[f"{label}_us"] = round(us, 2)
                row[f"{label}_gbps"] = round(wbytes / us / 1e3, 1)
            row["speedup"] = round(row["f_linear_us"] / row["triton_us"], 3)
            results.append(row)
            print("skinny", row, flush=True)
        del ws
        if DEV == "cuda":
            torch.cuda.empty_cache()


def bench_layer_norms(results, gen, dims, row_counts, layers, dtype):
    """Decoder layers' decode GEMMs and RMSNorms, graph-timed: the norms as their own launches (add +
    norm after o_proj and down) against the norms in the GEMM epilogues (skinny_gemm.skinny_add_norm_triton,
    the rows' 1 / rms applied by qkv / gate_up). dims: (hidden, qkv width, intermediate); attention
    is left out (qkv's first `hidden` columns feed o_proj). Every layer has its own weights, so
    they stream from HBM as in a decode step."""
    H, QKV, I = dims
    eps = 1e-5
    ws = [{n: torch.randn(a, b, device=DEV, dtype=dtype, generator=gen) * 0.02 for n, a, b in
           (("qkv", QKV, H), ("o", H, H), ("gate_up", 2 * I, H), ("down", H, I))} for _ in range(layers)]
    norms = [torch.rand(2, H, device=DEV, generator=gen).to(dtype) + 0.5 for _ in range(layers)]

    def plain(h):
        x, res = rmsnorm.rms_norm(h, norms[0][0], eps), h
        for i, w in enumerate(ws):
            a = sk.linear(x, w["qkv"])[:, :H]
            x, res = rmsnorm.rms_norm(sk.linear(a, w["o"]), norms[i][1], eps, res)
            y = sk.linear(sk.linear_silu_mul(x, w["gate_up"]), w["down"])
            x, res = rmsnorm.rms_norm(y, norms[(i + 1) % layers][0], eps, res)
        return x

    def fused(h):
        x, res, row = rmsnorm.rms_norm(h, norms[0][0], eps), h, None
        for i, w in enumerate(ws):
            a = sk.linear(x, w["qkv"], None, row)[:, :H]
            x, res, parts = sk.skinny_add_norm_triton(a, w["o"], res, norms[i][1])
            m = sk.linear_silu_mul(x, w["gate_up"], (parts, eps))
            x, res, parts = sk.skinny_add_norm_triton(m, w["down"], res, norms[(i + 1) % layers][0])
            row = (parts, eps)
        return x

    for M in row_counts:
        h = torch.randn(M, H, device=DEV, dtype=dtype, generator=gen)
        row = {"layers": layers, "hidden": H, "rows": M, "engine_fuses": sk.takes(h, ws[0]["o"])}
        for label, fn in (("norm_launches", plain), ("norms_in_epilogues", fused)):
            row[f"{label}_ms"] = round(bench_graph_ms(lambda: fn(h)), 4)
        results.append(row)
        print("layer_norms", row, flush=True)
    del ws
    if DEV == "cuda":
        torch.cuda.empty_cache()


def bench_deltakv_up(results, gen, cases, dtype):
    """DeltaKV's up(z) of a decode step's selected latents (a linear up): the gather then F.linear
    (cuBLAS) against the Triton GEMM that gathers in its loads, graph-timed, per (requests, kept
    tokens, latent dim, 2 * H * D, latent rows in the store)."""
    for B, S, lat, N, pool in cases:
        latents = torch.randn(pool, lat, device=DEV, dtype=dtype, generator=gen)
        slots = torch.randint(0, pool, (B, S), device=DEV, dtype=torch.int32, generator=gen)
        w = torch.randn(N, lat, device=DEV, dtype=dtype, generator=gen) / lat ** 0.5
        b = torch.randn(N, device=DEV, dtype=dtype, generator=gen)
        row = {"requests": B, "kept": S, "latent_dim": lat, "out": N}
        for label, fn in (("gather_f_linear", kd.gather_linear_ref), ("triton", kd.gather_linear_triton)):
            row[f"{label}_us"] = round(bench_graph_ms(lambda: fn(latents, slots, w, b)) * 1e3, 2)
        row["speedup"] = round(row["gather_f_linear_us"] / row["triton_us"], 3)
        results.append(row)
        print("deltakv_up", row, flush=True)


def bench_quest_store(results, gen, B, N, layers, shapes, dtype):
    """A Quest decode layer's front, `layers` layers in one graph (so launch gaps and early starts
    count): the qkv GEMM (4,096 -> 6,144, a weight a layer), then rope_store (with the page
    bounds) and bound_scores, or the store inside the scoring launch (store_and_score), then
    select_pages; per scoring launch shape (pages a program, warps). Tables of N 16-token pages,
    nearly full; each layer has its own bounds (134 MB at 128K x 4: none left in L2)."""
    P, n = 16, min(128, N // 2)   # the default budget: 2,048 tokens
    pages = B * N + 3
    ctx = torch.full((B,), N * P - 5, device=DEV, dtype=torch.int32)
    bt = torch.randperm(pages, device=DEV, generator=gen)[:B * N].view(B, N).int()
    slots = bt[torch.arange(B, device=DEV), (ctx.long() - 1) // P].long() * P + (ctx.long() - 1) % P
    x = torch.randn(B, HQ * D, device=DEV, dtype=dtype, generator=gen)
    w = [torch.randn((HQ + 2 * HKV) * D, HQ * D, device=DEV, dtype=dtype, generator=gen) / 64 for _ in range(layers)]
    cos_sin = torch.randn(N * P, D, device=DEV, generator=gen)
    k_cache, v_cache = (torch.zeros(pages * P, HKV, D, device=DEV, dtype=dtype) for _ in range(2))
    kmin = [torch.randn(pages, HKV, D, device=DEV, dtype=dtype, generator=gen) for _ in range(layers)]
    kmax = [t + 1 for t in kmin]
    pos = ctx.long() - 1

    def qkv(i):
        # (the interpreter's GEMM would make a CPU smoke run slow; there F.linear stands in)
        out = (sk.skinny_linear_triton if DEV == "cuda" else torch.nn.functional.linear)(x, w[i])
        return (out[:, :HQ * D].view(B, HQ, D), out[:, HQ * D:(HQ + HKV) * D].view(B, HKV, D),
                out[:, (HQ + HKV) * D:].view(B, HKV, D))

    def two():
        for i in range(layers):
            q, k, v = qkv(i)
            q_rot, _ = rs.rope_store_triton(q, k, v, pos, cos_sin, k_cache, v_cache, slots, kmin[i], kmax[i], P)
            scores = pb.bound_scores_triton(q_rot, kmin[i], kmax[i], bt, ctx, P, "kv_head")
            psel.select_pages_triton(scores, bt, ctx, P, n)

    def one():
        for i in range(layers):
            q, k, v = qkv(i)
            scores = qk.store_and_score_triton(q, k, v, pos, cos_sin, k_cache, v_cache, slots, kmin[i], kmax[i], bt,
                                               ctx, P, "kv_head", torch.empty_like(q), torch.empty_like(k))
            psel.select_pages_triton(scores, bt, ctx, P, n)

    keep = pb.BLOCK_PAGES, pb.SCORE_WARPS
    try:
        for pb.BLOCK_PAGES, pb.SCORE_WARPS in shapes:
            row = {"requests": B, "pages": N, "layers": layers, "block_pages": pb.BLOCK_PAGES,
                   "warps": pb.SCORE_WARPS,
                   "two_launches_us": round(bench_graph_ms(two) / layers * 1e3, 2),
                   "one_launch_us": round(bench_graph_ms(one) / layers * 1e3, 2)}
            results.append(row)
            print("quest_store", row, flush=True)
    finally:
        pb.BLOCK_PAGES, pb.SCORE_WARPS = keep


def gather_sdpa(q, k_cache, v_cache, block_tables, context_len, page_size, scale):
    """The naive paged-prefix path: gather the context's K/V, then masked SDPA."""
    n = q.shape[0]
    pos = torch.arange(context_len, device=q.device)
    slots = block_tables[0, pos // page_size].long() * page_size + pos % page_size
    k = k_cache[slots].transpose(0, 1).repeat_interleave(HQ // HKV, dim=0)
    v = v_cache[slots].transpose(0, 1).repeat_interleave(HQ // HKV, dim=0)
    mask = pos.view(1, -1) <= torch.arange(context_len - n, context_len, device=q.device).view(n, 1)
    return torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask,
                                                            scale=scale)


def sweep_prefill(results, gen, chunk, ctx):
    """Launch settings of the paged-prefix kernel on one chunk over ctx; leaves the best in the module."""
    bf, P = torch.bfloat16, 16
    k_cache = torch.randn(ctx, HKV, D, device=DEV, dtype=bf, generator=gen)
    v_cache = torch.randn_like(k_cache)
    bt = torch.randperm(ctx // P, device=DEV, generator=gen).int().view(1, -1)
    q = torch.randn(chunk, HQ, D, device=DEV, dtype=bf, generator=gen)
    cu = torch.tensor([0, chunk], dtype=torch.int32, device=DEV)
    lens = torch.tensor([ctx], dtype=torch.int32, device=DEV)
    best = None
    for bm, bn, warps, stages in [(64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 2), (128, 64, 8, 3),
                                  (128, 32, 4, 2), (64, 32, 4, 3), (128, 128, 8, 2)]:
        pa.BLOCK_M, pa.BLOCK_N, pa.NUM_WARPS, pa.NUM_STAGES = bm, bn, warps, stages
        row = {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages}
        try:
            row["ms"] = round(bench_ms(lambda: pa.prefill_attention_triton(
                q, k_cache, v_cache, bt, cu, lens, P, 0.1, chunk)), 4)
        except Exception as e:
            row["error"] = str(e)[:200]
        results.append(row)
        print("prefill sweep", row, flush=True)
        if "ms" in row and (best is None or row["ms"] < best["ms"]):
            best = row
    pa.BLOCK_M, pa.BLOCK_N, pa.NUM_WARPS, pa.NUM_STAGES = (
        best["BLOCK_M"], best["BLOCK_N"], best["num_warps"], best["num_stages"])
    return best


def bench_prefill(results, gen, chunk, contexts):
    bf, P = torch.bfloat16, 16
    for ctx in contexts:
        N = ctx // P
        k_cache = torch.randn(ctx, HKV, D, device=DEV, dtype=bf, generator=gen)
        v_cache = torch.randn_like(k_cache)
        bt = torch.randperm(N, device=DEV, generator=gen).int().view(1, N)
        q = torch.randn(chunk, HQ, D, device=DEV, dtype=bf, generator=gen)
        cu = torch.tensor([0, chunk], dtype=torch.int32, device=DEV)
        lens = torch.tensor([ctx], dtype=torch.int32, device=DEV)
        tri = bench_ms(lambda: pa.prefill_attention_triton(q, k_cache, v_cache, bt, cu, lens, P, 0.1, chunk))
        ref = bench_ms(lambda: gather_sdpa(q, k_cache, v_cache, bt, ctx, P, 0.1))
        flops = 4 * chunk * (ctx - chunk / 2) * D * HQ
        row = {"case": "paged prefix", "chunk": chunk, "context": ctx, "triton_ms": round(tri, 4),
               "gather_sdpa_ms": round(ref, 4), "speedup": round(ref / tri, 2),
               "triton_tflops": round(flops / tri / 1e9, 1)}
        results.append(row)
        print("prefill", row, flush=True)
    # No prefix: the FlashAttention backend the dispatcher picks vs the paged Triton kernel.
    B = 4
    k = torch.randn(B * chunk, HKV, D, device=DEV, dtype=bf, generator=gen)
    v = torch.randn_like(k)
    q = torch.randn(B * chunk, HQ, D, device=DEV, dtype=bf, generator=gen)
    cu = torch.arange(0, B * chunk + 1, chunk, dtype=torch.int32, device=DEV)
    bt = torch.arange(B * chunk // P, device=DEV, dtype=torch.int32).view(B, chunk // P)
    lens = torch.full((B,), chunk, dtype=torch.int32, device=DEV)
    var = bench_ms(lambda: pa.varlen_attention(q, k, v, cu, chunk, 0.1, [chunk] * B))
    tri = bench_ms(lambda: pa.prefill_attention_triton(q, k, v, bt, cu, lens, P, 0.1, chunk))
    flops = B * 2 * chunk * chunk * D * HQ
    row = {"case": "no prefix", "chunks": B, "chunk": chunk, "varlen_ms": round(var, 4),
           "triton_ms": round(tri, 4), "varlen_tflops": round(flops / var / 1e9, 1),
           "triton_tflops": round(flops / tri / 1e9, 1),
           "varlen_backend": varlen_backend(q),
           "varlen_failed": sorted(pa._varlen_broken), "varlen_params": sorted(pa.varlen_backends()[1])}
    results.append(row)
    print("prefill", row, flush=True)


def varlen_backend(q):
    """The backend varlen_attention ran for q with the host's sequence lengths (as the engine calls
    it): the first present one that has not failed."""
    if not (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)):
        return "reference"
    for name, present in (("sdpa", True), ("torch varlen_attn", pa.varlen_backends()[0] is not None),
                          ("flash_attn", pa.varlen_backends()[2] is not None)):
        if present and name not in pa._varlen_broken:
            return name
    return "reference"


def sweep_fp8(results, gen, contexts):
    """Graph-timed decode over an FP8 cache (4 requests, distinct pages, P = 16, G = 1) for each path:
    V's and K's e4m3 tiles read as bytes or as int32 words (FP8_V_WORDS, FP8_K_WORDS), at 4 or 8 warps
    (FP8_NUM_WARPS) and several FP8_PROGRAMS_PER_SM; the bf16 cache at its defaults beside them. GB/s
    counts the FP8 bytes and scales."""
    keep = da.FP8_V_WORDS, da.FP8_K_WORDS, da.FP8_PROGRAMS_PER_SM, da.FP8_NUM_WARPS
    for ctx in contexts:
        k_cache = torch.randn(4 * ctx, HKV, D, device=DEV, dtype=torch.bfloat16, generator=gen)
        v_cache = torch.randn_like(k_cache)
        q = torch.randn(4, HQ, D, device=DEV, dtype=torch.bfloat16, generator=gen)
        table, lengths = dense_view(4, ctx, 16, 1, gen)
        ms = bench_graph_ms(lambda: da.decode_attention(q, k_cache, v_cache, table, lengths, 16, D ** -0.5))
        results.append({"context": ctx, "cache": "bf16", "us": round(ms * 1e3, 1),
                        "gbps": round(kv_bytes(4, ctx) / ms / 1e6)})
        print("fp8 sweep", results[-1], flush=True)
        (k8, ks), (v8, vs) = quantize_ref(k_cache), quantize_ref(v_cache)   # as the engine stores them
        del k_cache, v_cache
        nbytes = 2 * (k8.numel() + ks.numel() * 4)
        # 8 warps fit 1 program an SM (2 with V words: 118 registers), so fewer programs an SM there
        for (v_words, k_words), warps in itertools.product(((False, False), (True, False), (True, True)), (4, 8)):
            for pps in ((2, 3, 4, 6) if warps == 4 else (1, 2, 3, 4)):
                da.FP8_V_WORDS, da.FP8_K_WORDS, da.FP8_PROGRAMS_PER_SM, da.FP8_NUM_WARPS = (
                    v_words, k_words, pps, warps)
                ms = bench_graph_ms(lambda: da.decode_attention(q, k8, v8, table, lengths, 16, D ** -0.5,
                                                                k_scale=ks, v_scale=vs))
                results.append({"context": ctx, "cache": "fp8", "v_words": v_words, "k_words": k_words,
                                "num_warps": warps, "programs_per_sm": pps, "us": round(ms * 1e3, 1),
                                "gbps": round(nbytes / ms / 1e6)})
                print("fp8 sweep", results[-1], flush=True)
        del k8, v8, ks, vs, table
        if DEV == "cuda":
            torch.cuda.empty_cache()
    da.FP8_V_WORDS, da.FP8_K_WORDS, da.FP8_PROGRAMS_PER_SM, da.FP8_NUM_WARPS = keep


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--budget-s", type=float, default=240.0,
                    help="stop starting new decode cases after this many seconds")
    ap.add_argument("--sweep", action="store_true",
                    help="sweep the decode and prefill launch settings first and use the best")
    ap.add_argument("--sweep-splits", action="store_true",
                    help="also time decode for several split-count heuristics (PROGRAMS_PER_SM)")
    ap.add_argument("--sweep-fp8", action="store_true",
                    help="time only the FP8 decode paths and split counts (4 x 64K / 128K), then stop")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, to check the script")
    args = ap.parse_args()
    start = time.time()
    args.deadline = start + args.budget_s
    gen = torch.Generator(device=DEV).manual_seed(0)
    report = {"device": torch.cuda.get_device_name() if DEV == "cuda" else platform.processor(),
              "torch": torch.__version__, "triton": triton.__version__,
              "python": sys.version.split()[0]}

    def save():
        report["elapsed_s"] = round(time.time() - start, 1)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)

    try:
        run(args, report, gen, save)
    finally:
        save()
    print("wrote", args.out, flush=True)


def run(args, report, gen, save):
    report["copy_tbps"] = round(copy_bandwidth(), 3) if DEV == "cuda" else None
    print("device copy TB/s", report["copy_tbps"], flush=True)
    if args.smoke:
        batches, contexts, tokens, chunk, pctx = (2,), (256,), (3,), 64, (128,)
        linears, rows, cold_bytes = [("tiny", 64, 96)], (1, 3), 0   # tiny weights: 2 copies
    else:
        batches, contexts, tokens = (1, 4, 32), (4096, 32768, 131072), (1, 64, 4096)
        chunk, pctx = 2048, (8192, 32768)
        linears, rows, cold_bytes = LLAMA_LINEARS, (1, 4, 16), 400e6
    # The interpreter computes bf16 wrongly (common.upcast_loads), so a CPU smoke run uses fp32.
    gemm_dtype = torch.bfloat16 if DEV == "cuda" else torch.float32
    if args.sweep_fp8:
        report["fp8_sweep"] = []
        sweep_fp8(report["fp8_sweep"], gen, (256,) if args.smoke else (65536, 131072))
        return
    report["decode_sweep"] = []
    if args.sweep and not args.smoke:
        report["decode_settings"] = sweep_decode(report["decode_sweep"], gen, 32768)
    report["splits_sweep"] = []
    if args.sweep_splits:
        cases = [(1, 256), (2, 256)] if args.smoke else [
            (1, 32768), (1, 131072), (4, 32768), (4, 131072), (32, 4096), (32, 32768)]
        sweep_splits(report["splits_sweep"], gen, cases)
        save()
    report["decode_settings_used"] = {"BLOCK_N": da.BLOCK_N, "num_warps": da.NUM_WARPS,
                                      "num_stages": da.NUM_STAGES,
                                      "programs_per_sm": da.PROGRAMS_PER_SM}
    save()
    report["decode"] = []
    bench_decode(report["decode"], gen, batches, contexts, args.deadline)
    save()
    report["fused"] = []
    bench_fused(report["fused"], gen, tokens)
    save()
    report["skinny_gemm"] = []
    bench_skinny(report["skinny_gemm"], gen, linears, rows, gemm_dtype, cold_bytes)
    save()
    report["layer_norms"] = []   # 32 Llama-3.1-8B layers (~14 GB of weights); smoke: 2 tiny ones
    bench_layer_norms(report["layer_norms"], gen, (64, 96, 80) if args.smoke else (4096, 6144, 14336),
                      (1, 3) if args.smoke else (1, 4, 16), 2 if args.smoke else 32, gemm_dtype)
    save()
    report["deltakv_up"] = []   # Llama-3.1-8B at 128K x 4: 2,048 kept a request, latent 128, 8 x 128 heads
    bench_deltakv_up(report["deltakv_up"], gen, [(2, 20, 8, 48, 100)] if args.smoke else
                     [(1, 2048, 128, 2048, 128000), (4, 2048, 128, 2048, 4 * 128000)], gemm_dtype)
    save()
    report["quest_store"] = []   # Llama-3.1-8B at 128K x 4: 8,016 pages of 16 tokens a request
    bench_quest_store(report["quest_store"], gen, *((3, 40, 2, [(32, 4)]) if args.smoke else
                                                    (4, 8016, 8, [(32, 4), (32, 8), (64, 4), (64, 8)])), gemm_dtype)
    save()
    report["prefill_sweep"] = []
    if args.sweep and not args.smoke:
        report["prefill_settings"] = sweep_prefill(report["prefill_sweep"], gen, chunk, 32768)
    report["prefill"] = []
    bench_prefill(report["prefill"], gen, chunk, pctx)


if __name__ == "__main__":
    main()

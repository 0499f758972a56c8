"""Attention recall measured while serving (recall_sample_every; docs/design.md, section 10): what
the engine reports equals a plain-PyTorch dense computation of the same quantities, made here from
the queries and the keys each layer saw (softmax over every token the request holds, the mass on
the tokens the method's view attends, found by their keys; the outputs' relative error), for every
sparse method at a small budget; vanilla and a budget covering the context report 1.0; N = 0
changes nothing; the knob is validated; decode attention's log-sum-exp against its reference."""
import os

import numpy as np
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from helpers import CUDA, gpu, prompts  # noqa: E402
from method_knobs import METHOD_KNOBS  # noqa: E402
from sparsevllm import LLM, SamplingParams  # noqa: E402
from sparsevllm.kernels import decode_attention as da  # noqa: E402
from sparsevllm.method_registry import make_config  # noqa: E402
from test_deltakv import compressor  # noqa: E402

SP = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
interp = pytest.mark.skipif(CUDA, reason="interpreter tests run on CPU-only machines")
KNOBS = {**METHOD_KNOBS, "hisparse": dict(METHOD_KNOBS["hisparse"], page_size=4, chunk_prefill_size=64),
         "deltakv": dict(METHOD_KNOBS["deltakv"], deltakv_decode_keep=8)}


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("llama", num_hidden_layers=4)


def make(model, method, tmp_path, **knobs):
    knobs = {**KNOBS[method], **knobs}
    if method == "deltakv":
        knobs["deltakv_compressor_path"] = compressor(model, tmp_path / "c", "random", latent=6)
    return LLM(model, vllm_sparse_method=method, device="cpu", **knobs)


# ---------------------------------------------------------------- the oracle

def row_tokens(view, b, num_heads):
    """Per query head, the keys and values row b of a decode view reads: [n, D] each (fp32)."""
    G, P, Hkv = view.table.shape[1], view.page_size, view.k_cache.shape[1]
    out = []
    for h in range(num_heads):
        kvh = h // (num_heads // Hkv)
        g = 0 if G == 1 else (kvh if G == Hkv else h)
        pos = torch.arange(int(view.lengths[b, g]))
        slots = view.table[b, g].long()[pos // P] * P + pos % P
        out.append((view.k_cache[slots, kvh].float(), view.v_cache[slots, kvh].float()))
    return out


def oracle(q, sparse, dense, scale):
    """q [H, D]; sparse, dense: per head (K, V). -> (mean over heads of the dense softmax mass on
    the sparse tokens, ||o_sparse - o_dense|| / ||o_dense||). Every sparse token must be a dense one."""
    shares, o_s, o_d = [], [], []
    for h, ((ks, vs), (kd, vd)) in enumerate(zip(sparse, dense)):
        dist = (ks[:, None] - kd[None]).abs().amax(dim=-1)   # [n_sparse, n_dense]
        assert (dist.min(dim=1).values < 1e-4).all(), "the view attends a token the dense set lacks"
        member = (dist < 1e-4).any(dim=0)
        pd = torch.softmax(kd @ q[h].float() * scale, dim=0)
        shares.append(pd[member].sum())
        o_s.append(torch.softmax(ks @ q[h].float() * scale, dim=0) @ vs)
        o_d.append(pd @ vd)
    o_s, o_d = torch.stack(o_s), torch.stack(o_d)
    return float(torch.stack(shares).mean()), float((o_s - o_d).norm() / o_d.norm())


def spy(llm):
    """Records (request id, layer, oracle recall, oracle error) for every row the engine measures."""
    cm, records = llm.engine.cache_manager, []
    build, dense_of = cm.build_decode_view, cm.recall_view
    heads, scale = llm.engine.model_config.num_attention_heads, llm.engine.model_config.head_dim ** -0.5

    def built(layer_id, q, step):
        view = build(layer_id, q, step)
        if step.recall is not None:
            step.scratch[f"test.{layer_id}"] = (q.clone(), [row_tokens(view, b, heads) for b in range(len(q))])
        return view

    def dense_view(layer_id, step):
        dense = dense_of(layer_id, step)
        q, sparse = step.scratch.pop(f"test.{layer_id}")
        for b in (step.recall.rows if dense is not None else []):
            if int(dense.lengths[b, 0]) > 0:
                assert int(dense.lengths[b, 0]) == int(step.cache_lens[b])   # every token the request holds
                records.append((str(step.seqs[b].seq_id), layer_id,
                                *oracle(q[b], sparse[b], row_tokens(dense, b, heads), scale)))
        return dense
    cm.build_decode_view, cm.recall_view = built, dense_view
    return records


def expected(records, request_id, num_layers):
    per_layer, errors = [None] * num_layers, []
    for layer in range(num_layers):
        rows = [(r, e) for rid, lay, r, e in records if rid == request_id and lay == layer]
        if rows:
            per_layer[layer] = float(np.mean([r for r, _ in rows]))
            errors.append(float(np.mean([e for _, e in rows])))
    return per_layer, errors


@pytest.mark.parametrize("method", ["quest", "omnikv", "hisparse", "deltakv"])
def test_recall_equals_a_dense_pytorch_oracle(model, method, tmp_path):
    llm = make(model, method, tmp_path, recall_sample_every=3)
    records = spy(llm)
    outs = llm.generate(prompts([150, 100], seed=1), SP, use_tqdm=False)
    assert records, "no layer was measured"
    for out in outs:
        got = out.metrics["attention_recall"]
        per_layer, errors = expected(records, out.request_id, 4)
        assert got["sampled_steps"] == 3   # decode steps 0..6 of 8 tokens: 0, 3, 6
        assert [x is None for x in got["per_layer"]] == [x is None for x in per_layer]
        measured = [(g, w) for g, w in zip(got["per_layer"], per_layer) if w is not None]
        assert measured and all(abs(g - w) < 1e-4 for g, w in measured), (got, per_layer)
        assert got["mean"] == pytest.approx(np.mean([w for _, w in measured]), abs=1e-4)
        assert got["output_rel_error"] == pytest.approx(np.mean(errors), rel=1e-3, abs=1e-5)
        assert 0.0 < got["mean"] < 1.0 and got["output_rel_error"] > 0   # a small budget: really sparse
        assert got["definition"] == llm.config.method.recall_definition


def test_snapkv_reports_its_window_mass_share_at_compaction(model, tmp_path):
    llm = make(model, "snapkv", tmp_path, recall_sample_every=4)
    cm, records = llm.engine.cache_manager, {}
    observe, scale = cm.observe_prefill_queries, cm.scale

    def observed(layer_id, q, step):
        observe(layer_id, q, step)
        k_cache, v_cache = cm.pool.layer(layer_id)
        for c in step.scratch["snapkv.compactions"]:
            L, w, kept = c.seq.num_prompt_tokens, c.window, c.kept[-1]
            pos = torch.arange(L)
            slots = step.block_tables[c.index].long()[pos // cm.page_size] * cm.page_size + pos % cm.page_size
            keys, values = k_cache[slots].float(), v_cache[slots].float()
            qw = q[c.row_end - w:c.row_end].float()
            Hq, Hkv = qw.shape[1], keys.shape[1]
            shares, errors = [], []
            for i in range(w):
                end = L - w + i + 1   # causal
                o_s, o_d = [], []
                for h in range(Hq):
                    kvh = h // (Hq // Hkv)
                    pd = torch.softmax(keys[:end, kvh] @ qw[i, h] * scale, dim=0)
                    mine = kept[kvh][kept[kvh] < end]
                    shares.append(pd[mine].sum())
                    o_s.append(torch.softmax(keys[mine, kvh] @ qw[i, h] * scale, dim=0) @ values[mine, kvh])
                    o_d.append(pd @ values[:end, kvh])
                o_s, o_d = torch.stack(o_s), torch.stack(o_d)
                errors.append((o_s - o_d).norm() / o_d.norm())
            records[(str(c.seq.seq_id), layer_id)] = (float(torch.stack(shares).mean()),
                                                      float(torch.stack(errors).mean()))
    cm.observe_prefill_queries = observed
    outs = llm.generate(prompts([150, 30, 100], seed=2), SP, use_tqdm=False)
    long, short, other = (o.metrics["attention_recall"] for o in outs)
    for out, got in ((outs[0], long), (outs[2], other)):
        want = [records[(out.request_id, layer)] for layer in range(4)]
        assert got["per_layer"] == pytest.approx([r for r, _ in want], abs=1e-5)
        assert got["output_rel_error"] == pytest.approx(np.mean([e for _, e in want]), abs=1e-5)
        assert 0.0 < got["mean"] < 1.0
        assert got["sampled_steps"] == 1 + 2   # the compaction, decode steps 0 and 4 (not measured)
    # a prompt within the capacity is never compacted: dense, nothing measured
    assert short == {**short, "mean": 1.0, "per_layer": [None] * 4, "output_rel_error": 0.0, "sampled_steps": 2}


def test_vanilla_reports_exactly_one(model, tmp_path):
    out = make(model, "vanilla", tmp_path, recall_sample_every=2).generate(prompts([40]), SP, use_tqdm=False)[0]
    got = out.metrics["attention_recall"]
    assert got["mean"] == 1.0 and got["output_rel_error"] == 0.0 and got["per_layer"] == [None] * 4
    assert got["sampled_steps"] == 4 and "dense" in got["definition"]


@pytest.mark.parametrize("method, knobs", [("quest", dict(quest_token_budget=256)),
                                           ("hisparse", dict(hisparse_device_pages=64)),
                                           ("omnikv", dict(omnikv_num_selected=1.0))])
def test_a_budget_covering_the_context_reports_one(model, method, knobs, tmp_path):
    out = make(model, method, tmp_path, recall_sample_every=2, **knobs).generate(prompts([150]), SP,
                                                                                 use_tqdm=False)[0]
    got = out.metrics["attention_recall"]
    if method == "omnikv":   # sparse layers measured, over every prompt token: 1.0 up to rounding
        assert got["mean"] == pytest.approx(1.0, abs=1e-6) and got["output_rel_error"] < 1e-5
        assert sum(x is not None for x in got["per_layer"]) == 3
    else:                    # dense: exactly 1.0, nothing measured
        assert got["mean"] == 1.0 and got["output_rel_error"] == 0.0 and got["per_layer"] == [None] * 4


@pytest.mark.parametrize("method", ["quest", "snapkv"])
def test_recall_off_and_on_give_the_same_tokens_and_off_reports_nothing(model, method, tmp_path):
    ps = prompts([150, 60], seed=3)
    off = make(model, method, tmp_path).generate(ps, SP, use_tqdm=False)
    on = make(model, method, tmp_path, recall_sample_every=1).generate(ps, SP, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in off] == [o.outputs[0].token_ids for o in on]
    assert all("attention_recall" not in o.metrics for o in off)
    assert all(o.metrics["attention_recall"]["sampled_steps"] >= 7 for o in on)


def test_the_samples_of_a_request_are_pooled(model, tmp_path):
    sp = SamplingParams(temperature=1.0, max_tokens=5, n=2, seed=0, ignore_eos=True)
    out = make(model, "quest", tmp_path, recall_sample_every=2).generate(prompts([150]), sp, use_tqdm=False)[0]
    assert out.metrics["attention_recall"]["sampled_steps"] == 2 * 2   # decode steps 0 and 2 of each sample


def test_a_request_without_a_decode_step_reports_none(model, tmp_path):
    sp = SamplingParams(temperature=0.0, max_tokens=1)
    got = make(model, "quest", tmp_path, recall_sample_every=1).generate(prompts([150]), sp,
                                                                         use_tqdm=False)[0].metrics["attention_recall"]
    assert got["mean"] is None and got["sampled_steps"] == 0 and got["per_layer"] == [None] * 4


@pytest.mark.parametrize("value", [-1, 1.5, True, "64", None])
def test_a_bad_recall_sample_every_is_a_clear_error(value):
    with pytest.raises(ValueError, match="recall_sample_every"):
        make_config(recall_sample_every=value)


# ---------------------------------------------------------------- the decode kernel's log-sum-exp

def lse_case(B, Hq, Hkv, D, P, N, G, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    slots = 4 * N * P
    q = torch.randn(B, Hq, D, generator=g).to(device, dtype)
    k = torch.randn(slots, Hkv, D, generator=g).to(device, dtype)
    v = torch.randn(slots, Hkv, D, generator=g).to(device, dtype)
    table = torch.randint(0, 4 * N, (B, G, N), generator=g, dtype=torch.int32).to(device)
    lengths = torch.randint(1, N * P + 1, (B, G), generator=g, dtype=torch.int32)
    lengths[0] = 0   # an empty row: -inf
    return q, k, v, table, lengths.to(device)


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("G, N", [(1, 2), (1, 40), (2, 8), (4, 8)])
def test_decode_attention_lse_triton_matches_reference(dtype, G, N):
    q, k, v, table, lengths = lse_case(3, 4, 2, 16, 4, N, G, dtype, "cpu")
    want_lse, got_lse = torch.empty(3, 4), torch.empty(3, 4)
    want = da.decode_attention_ref(q, k, v, table, lengths, 4, 0.25, lse_out=want_lse)
    got = da.decode_attention_triton(q, k, v, table, lengths, 4, 0.25, lse_out=got_lse)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got_lse, want_lse, atol=tol, rtol=tol)
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    assert torch.isneginf(got_lse[0]).all()
    # the output with lse_out is the one without it
    torch.testing.assert_close(da.decode_attention_triton(q, k, v, table, lengths, 4, 0.25).float(), got.float(),
                               atol=tol, rtol=tol)


def test_decode_attention_reference_lse_is_the_log_of_the_softmax_denominator():
    q, k, v, table, lengths = lse_case(2, 4, 2, 8, 4, 3, 1, torch.float32, "cpu", seed=1)
    lse = torch.empty(2, 4)
    da.decode_attention_ref(q, k, v, table, lengths, 4, 0.5, lse_out=lse)
    n = int(lengths[1, 0])
    pos = torch.arange(n)
    slots = table[1, 0].long()[pos // 4] * 4 + pos % 4
    for h in range(4):
        logits = k[slots, h // 2] @ q[1, h] * 0.5
        assert float(lse[1, h]) == pytest.approx(float(torch.log(torch.exp(logits).sum())), rel=1e-5)


# ---------------------------------------------------------------- GPU

@gpu
@pytest.mark.parametrize("G", [1, 2, 4])
def test_gpu_decode_attention_lse_matches_reference_bf16(G):
    q, k, v, table, lengths = lse_case(4, 4, 2, 64, 16, 64, G, torch.bfloat16, "cuda")
    want_lse, got_lse = (torch.empty(4, 4, device="cuda") for _ in range(2))
    da.decode_attention_ref(q, k, v, table, lengths, 16, 0.125, lse_out=want_lse)
    da.decode_attention_triton(q, k, v, table, lengths, 16, 0.125, lse_out=got_lse)
    torch.testing.assert_close(got_lse, want_lse, atol=2e-2, rtol=2e-2)


@gpu
@pytest.mark.parametrize("method", ["quest", "omnikv", "hisparse"])
def test_gpu_recall_under_cuda_graphs_equals_the_cpu_oracle_path(model, method, tmp_path):
    """Sampled steps run eagerly beside graph-replayed ones: the tokens equal recall off, and the
    recall (HiSparse's dense pass reading pinned host memory from Triton) the fp32 CPU engine's."""
    ps = prompts([150, 100], seed=1)
    cuda = dict(device="cuda", dtype="float32", max_num_seqs=8)
    off = LLM(model, vllm_sparse_method=method, **{**KNOBS[method], **cuda}).generate(ps, SP, use_tqdm=False)
    on = LLM(model, vllm_sparse_method=method, recall_sample_every=3,
             **{**KNOBS[method], **cuda}).generate(ps, SP, use_tqdm=False)
    cpu = make(model, method, tmp_path, recall_sample_every=3).generate(ps, SP, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in off] == [o.outputs[0].token_ids for o in on]
    for g, c in zip(on, cpu):
        g, c = g.metrics["attention_recall"], c.metrics["attention_recall"]
        assert g["sampled_steps"] == c["sampled_steps"] == 3
        # (the CPU oracle test checks exactness; here kernels' rounding may flip a near-tied page)
        assert g["mean"] == pytest.approx(c["mean"], abs=1e-2)
        assert g["output_rel_error"] == pytest.approx(c["output_rel_error"], abs=1e-2, rel=5e-2)

"""Several sparse methods in one engine (mixed_methods): every request of a batch mixing vanilla,
QuEST, OmniKV and SnapKV rows at different budgets gives the tokens the same request gets alone in
an engine launched with its method and knobs, with overlapped scheduling off and on, over
prefix-cache hits across methods and under preemption; allocators end idle; a request naming a
method the engine does not host fails alone, naming it and the hosted ones; launch errors name
mixed_methods; the decode kernel's token scores over a view per KV head (a mixed layer's form)
against its reference and against the G = 1 view it repeats.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from helpers import CUDA, gpu, prompts, token_ids  # noqa: E402
from method_knobs import METHOD_KNOBS  # noqa: E402
from per_request_helpers import BASE, GREEDY, OTHER, alone, run_noting_preemptions  # noqa: E402
from sparsevllm import LLM, SamplingParams, SparseParams  # noqa: E402
from sparsevllm.engine.sequence import Sequence  # noqa: E402
from sparsevllm.kernels import decode_attention as da  # noqa: E402
from sparsevllm.kernels import omnikv as okv  # noqa: E402
from sparsevllm.kernels import page_bounds as pb, page_select as psel  # noqa: E402
from sparsevllm.kernels import token_select as tsel  # noqa: E402
from sparsevllm.method_registry import make_config, request_sparsity  # noqa: E402

MIXED = ["omnikv", "snapkv"]   # hosted beside the engine's own quest
# OmniKV's filter layer 0 (dense for QuEST too: a paged layer with token scores, then two merged
# layers), or 1 (QuEST's sparse layer 1 is then merged while it reports token scores per KV head).
LAYOUTS = {"filter0": METHOD_KNOBS["omnikv"], "filter1": dict(METHOD_KNOBS["omnikv"], omnikv_filter_layers=[1])}


def launch_knobs(layout="filter0"):
    return {**METHOD_KNOBS["quest"], **LAYOUTS[layout], **METHOD_KNOBS["snapkv"]}


def own_knobs(method, layout="filter0"):
    return {"vanilla": {}, "quest": METHOD_KNOBS["quest"], "omnikv": LAYOUTS[layout],
            "snapkv": METHOD_KNOBS["snapkv"]}[method]


def mixed_case(layout="filter0"):
    """Prompts, their SparseParams and what each runs alone: every hosted method at the engine's
    budget and at another, vanilla rows, and a request with none (the engine's quest)."""
    ps = prompts([150, 96, 200, 120, 170, 88, 140, 110, 160])
    rows = [("vanilla", {}), ("quest", {}), ("quest", OTHER["quest"]), ("omnikv", {}), ("omnikv", OTHER["omnikv"]),
            ("snapkv", {}), ("snapkv", OTHER["snapkv"]), (None, {}), ("vanilla", {})]
    sparse = [None if m is None else SparseParams(method=m, **k) for m, k in rows]
    wanted = [(m or "quest", {**own_knobs(m or "quest", layout), **k}) for m, k in rows]
    return ps, sparse, wanted


@pytest.mark.parametrize("layout,overlap", [("filter0", False), ("filter0", True), ("filter1", False)])
def test_a_batch_of_every_method_equals_each_request_alone(tiny_model, layout, overlap):
    model = tiny_model(num_hidden_layers=3)
    ps, sparse, wanted = mixed_case(layout)
    llm = LLM(model, "quest", mixed_methods=MIXED, **BASE, **launch_knobs(layout), async_scheduling=overlap)
    assert type(llm.engine.cache_manager).__name__ == "MixedCacheManager"
    outs = llm.generate(ps, GREEDY, use_tqdm=False, sparse_params=sparse)
    assert llm.engine.cache_manager.allocator.is_idle()
    assert all(o.error is None for o in outs)
    assert [o.metrics["sparse"]["method"] for o in outs] == [m for m, _ in wanted]
    assert outs[4].metrics["sparse"]["knobs"] == {"omnikv_num_selected": 8}
    want = [alone(model, m, k, p) for p, (m, k) in zip(ps, wanted)]
    assert token_ids(outs) == want
    # the rows differ from one another's methods: each ran its own
    assert want[3] != alone(model, "quest", own_knobs("quest"), ps[3]) or \
        want[5] != alone(model, "vanilla", {}, ps[5])


def test_a_vanilla_engine_hosting_methods_serves_them_and_defaults_to_dense(tiny_model):
    model = tiny_model(num_hidden_layers=3)
    ps = prompts([130, 150, 90])
    llm = LLM(model, mixed_methods=["quest", "snapkv"], **BASE, **METHOD_KNOBS["quest"], **METHOD_KNOBS["snapkv"])
    outs = llm.generate(ps, GREEDY, use_tqdm=False,
                        sparse_params=[None, SparseParams(method="quest"), SparseParams(method="snapkv")])
    assert llm.engine.cache_manager.allocator.is_idle()
    assert [o.metrics["sparse"]["method"] for o in outs] == ["vanilla", "quest", "snapkv"]
    assert token_ids(outs) == [alone(model, "vanilla", {}, ps[0]), alone(model, "quest", METHOD_KNOBS["quest"], ps[1]),
                         alone(model, "snapkv", METHOD_KNOBS["snapkv"], ps[2])]


def test_prefix_hits_across_methods_equal_misses(tiny_model):
    """Pages prefilled by one method's row are hit by another's: QuEST's page bounds are kept for
    every page, whoever wrote it; SnapKV's hits stop before its window as alone."""
    model = tiny_model(num_hidden_layers=3)
    first = prompts([160, 140, 150], seed=3)
    llm = LLM(model, "quest", mixed_methods=MIXED, **BASE, **launch_knobs())
    llm.generate(first, GREEDY, use_tqdm=False, sparse_params=[
        SparseParams(method="omnikv"), SparseParams(method="vanilla"), SparseParams(method="snapkv")])
    second = [first[0][:120] + prompts([40], seed=4)[0], first[1][:100] + prompts([30], seed=5)[0],
              first[2][:120] + prompts([50], seed=6)[0]]
    rows = [("quest", {}), ("snapkv", OTHER["snapkv"]), ("omnikv", {})]
    cm = llm.engine.cache_manager
    for p, (m, k) in zip(second, rows):
        probe = Sequence(p, GREEDY)
        probe.sparse = request_sparsity(llm.config, SparseParams(method=m, **k), len(p))
        assert len(cm.cached_prefix(probe)) > 0
    outs = llm.generate(second, GREEDY, use_tqdm=False, sparse_params=[SparseParams(method=m, **k) for m, k in rows])
    assert cm.allocator.is_idle()
    assert token_ids(outs) == [alone(model, m, {**own_knobs(m), **k}, p) for p, (m, k) in zip(second, rows)]


def test_a_mixed_batch_under_preemption(tiny_model):
    """A pool too small for the batch preempts and recomputes. Vanilla and SnapKV rows recompute
    exactly; QuEST's and OmniKV's recompute prefills a preempted request's generated tokens densely
    (their modules say so), so their rows are compared only where they were not preempted. The
    SnapKV compactions' pages stay free from the other methods' reserves (else _compact asserts)."""
    model = tiny_model(num_hidden_layers=3)
    ps, sparse, wanted = mixed_case()
    gen = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    llm = LLM(model, "quest", mixed_methods=MIXED, **BASE, **launch_knobs(), num_kv_pages=100)
    seqs, preempted = run_noting_preemptions(llm, ps, gen, sparse)
    assert preempted
    compared = 0
    for seq, p, (m, k) in zip(seqs, ps, wanted):
        assert seq.error is None
        if m in ("vanilla", "snapkv") or seq.seq_id not in preempted:
            assert seq.completion_token_ids == alone(model, m, k, p, gen), (m, seq.seq_id in preempted)
            compared += 1
    assert compared >= 5


def test_a_method_the_engine_does_not_host_fails_alone_naming_it(tiny_model):
    model = tiny_model(num_hidden_layers=3)
    llm = LLM(model, "quest", mixed_methods=["omnikv"], **BASE, **METHOD_KNOBS["quest"], **METHOD_KNOBS["omnikv"])
    ps = prompts([100] * 6)
    bad = [SparseParams(method="omnikv", omnikv_num_selected=4), SparseParams(method="snapkv"),
           SparseParams(method="hisparse"), SparseParams(method="omnikv", quest_token_budget=32),
           SparseParams(method="omnikv", omnikv_filter_layers=[1]), SparseParams(method="vanilla")]
    outs = llm.generate(ps, GREEDY, use_tqdm=False, sparse_params=bad)
    assert llm.engine.cache_manager.allocator.is_idle()
    assert outs[0].error is None and outs[5].error is None and len(outs[0].outputs[0].token_ids) == 10
    errors = [o.error for o in outs[1:5]]
    assert all(o.outputs[0].finish_reason == "error" for o in outs[1:5])
    assert "sparse_params.method='snapkv'" in errors[0] and "vanilla | quest | omnikv" in errors[0] \
        and "mixed_methods=['snapkv']" in errors[0]
    assert "sparse_params.method='hisparse'" in errors[1] and "owns its KV pool's layout" in errors[1]
    assert "knob 'quest_token_budget' belongs to method 'quest', but this request runs 'omnikv'" in errors[2]
    assert "'omnikv_filter_layers' cannot be set per request" in errors[3]


def test_mixed_methods_launch_errors_name_the_knob():
    with pytest.raises(ValueError, match=r"mixed_methods=\['hisparse'\] is invalid: 'hisparse' cannot be mixed"):
        make_config(None, "quest", mixed_methods=["hisparse"])
    with pytest.raises(ValueError, match=r"mixed_methods=\['nope'\] is invalid.*no registered method"):
        make_config(None, "quest", mixed_methods=["nope"])
    with pytest.raises(ValueError, match="mixed_methods='quest' is invalid"):
        make_config(None, "vanilla", mixed_methods="quest")
    with pytest.raises(ValueError, match="vllm_sparse_method='deltakv' cannot host mixed_methods"):
        make_config(None, "deltakv", mixed_methods=["quest"])
    with pytest.raises(ValueError, match="quest_selection='query_head' cannot be mixed with omnikv"):
        make_config(None, "quest", mixed_methods=["omnikv"], quest_selection="query_head")
    with pytest.raises(ValueError, match="knob 'snapkv_capacity' belongs to method 'snapkv', but .*mixed_methods"):
        make_config(None, "quest", mixed_methods=["omnikv"], snapkv_capacity=64)
    with pytest.raises(ValueError, match="snapkv_capacity=4 is invalid"):
        make_config(None, "quest", mixed_methods=["snapkv"], snapkv_capacity=4)
    cfg = make_config(None, "auto", mixed_methods=["omnikv", "vanilla", "quest"], page_size=4)
    assert list(cfg.hosted) == ["quest", "omnikv"] and cfg.method.method_name == "mixed"


def test_auto_with_mixed_methods_picks_between_dense_and_its_method(tiny_model):
    model = tiny_model(num_hidden_layers=3)
    llm = LLM(model, "auto", mixed_methods=["omnikv"], auto_dense_below=120, **BASE, **METHOD_KNOBS["quest"],
              **METHOD_KNOBS["omnikv"])
    ps = prompts([150, 80, 130])
    outs = llm.generate(ps, GREEDY, use_tqdm=False, sparse_params=[None, None, SparseParams(method="omnikv")])
    assert [o.metrics["sparse"]["method"] for o in outs] == ["quest", "vanilla", "omnikv"]
    assert token_ids(outs) == [alone(model, "quest", METHOD_KNOBS["quest"], ps[0]), alone(model, "vanilla", {}, ps[1]),
                         alone(model, "omnikv", METHOD_KNOBS["omnikv"], ps[2])]
    assert llm.engine.cache_manager.allocator.is_idle()


# ---------------------------------------------------------------- the decode kernel's token scores

@pytest.mark.skipif(CUDA, reason="interpreter test runs on CPU-only machines")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_token_scores_of_a_view_per_kv_head_equal_the_shared_view_they_repeat(dtype, monkeypatch):
    """A mixed layer's view is per KV head (G = H_kv) with OmniKV rows one token set repeated: the
    token scores and output equal the G = 1 view's, Triton (interpreted) against the reference,
    over several splits; rows with their own set per head report their own tokens' scores."""
    monkeypatch.setattr(da, "MIN_SPLIT_TOKENS", 16)
    g = torch.Generator().manual_seed(5)
    B, Hq, Hkv, D, T = 3, 4, 2, 32, 70
    q = torch.randn(B, Hq, D, generator=g).to(dtype)
    k_cache, v_cache = (torch.randn(300, Hkv, D, generator=g).to(dtype) for _ in range(2))
    table = torch.randperm(300, generator=g)[:B * T].view(B, 1, T).int()
    lengths = torch.tensor([[70], [33], [1]], dtype=torch.int32)
    per_head = table.expand(B, Hkv, T).clone()
    per_head[2, 1] = torch.randperm(300, generator=g)[:T].int()   # row 2: a set per KV head of its own
    heads_len = lengths.expand(B, Hkv).clone()
    heads_len[2, 1] = 40
    shared = torch.full((B, Hkv, T), float("-inf"))
    da.decode_attention_ref(q, k_cache, v_cache, table, lengths, 1, 0.2, shared)
    want = torch.full((B, Hkv, T), float("-inf"))
    out_ref = da.decode_attention_ref(q, k_cache, v_cache, per_head, heads_len, 1, 0.2, want)
    got = torch.full((B, Hkv, T), float("-inf"))
    out = da.decode_attention_triton(q, k_cache, v_cache, per_head, heads_len, 1, 0.2, got)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.float(), out_ref.float(), **tol)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = torch.isfinite(want)
    torch.testing.assert_close(got[finite], want[finite], **tol)
    torch.testing.assert_close(want[:2], shared[:2])                 # repeated rows: the shared view's scores
    keys = k_cache[per_head[2, 1, :40].long(), 1].float()            # row 2, KV head 1: its own tokens
    logits = (q[2, 2:].float() @ keys.T * 0.2).amax(0)
    torch.testing.assert_close(want[2, 1, :40], logits, atol=1e-3, rtol=1e-3)


@pytest.mark.skipif(CUDA, reason="interpreter test runs on CPU-only machines")
def test_selection_kernels_give_rows_of_other_methods_length_0():
    """A hosted method sees the other methods' rows with cache length 0: its selection kernels
    (QuEST's bound scores and page selection, OmniKV's scores and token selection) must give
    them an empty view, Triton (interpreted) as the reference, and the other rows as unmasked."""
    g = torch.Generator().manual_seed(11)
    B, Hq, Hkv, D, N, P = 4, 4, 2, 16, 12, 4
    q = torch.randn(B, Hq, D, generator=g)
    k_cache = torch.randn(64 * P, Hkv, D, generator=g)
    kmin = torch.randn(64, Hkv, D, generator=g)
    kmax = kmin + torch.rand(64, Hkv, D, generator=g)
    bt = torch.randperm(64, generator=g)[:B * N].view(B, N).int()
    full = torch.tensor([45, 30, 47, 20], dtype=torch.int32)
    masked = torch.tensor([45, 0, 47, 0], dtype=torch.int32)   # rows 1 and 3 are another method's
    budgets = torch.tensor([3, psel.DENSE_PAGES, 4, psel.DENSE_PAGES], dtype=torch.int32)
    for fn in (pb.bound_scores_ref, pb.bound_scores_triton):
        scores = fn(q, kmin, kmax, bt, masked, P, "kv_head", budgets)
        for select in (psel.select_pages_ref, psel.select_pages_triton):
            table, lengths = select(scores, bt, masked, P, budgets)
            assert lengths[[1, 3]].eq(0).all()
            want_t, want_l = psel.select_pages_ref(pb.bound_scores_ref(q, kmin, kmax, bt, full, P, "kv_head", budgets),
                                                   bt, full, P, budgets)
            assert torch.equal(lengths[[0, 2]], want_l[[0, 2]])
            for b in (0, 2):
                for h in range(Hkv):
                    used = -(-int(want_l[b, h]) // P)
                    assert torch.equal(table[b, h, :used], want_t[b, h, :used])
    prompt = torch.tensor([40, 25, 44, 16], dtype=torch.int32)
    keep = torch.tensor([8, 25, 5, 16], dtype=torch.int32)
    scores = okv.omnikv_scores_ref(q, k_cache, bt, masked, prompt, P, 0.25, "last")
    torch.testing.assert_close(okv.omnikv_scores_triton(q, k_cache, bt, masked, prompt, P, 0.25, "last"), scores)
    assert torch.isinf(scores[[1, 3]]).all()
    for select in (tsel.select_tokens_ref, tsel.select_tokens_triton):
        table, lengths = select(scores, keep, bt, masked, prompt, P)
        want_t, want_l = tsel.select_tokens_ref(okv.omnikv_scores_ref(q, k_cache, bt, full, prompt, P, 0.25, "last"),
                                                keep, bt, full, prompt, P)
        assert lengths.view(-1).tolist() == [int(want_l[0]), 0, int(want_l[2]), 0]
        for b in (0, 2):
            assert torch.equal(table[b, 0, :int(want_l[b])], want_t[b, 0, :int(want_l[b])])


def test_recall_in_a_mixed_engine_measures_each_row_by_its_method(tiny_model):
    """recall_sample_every: merged recall views; tokens unchanged, sparse rows measured, vanilla rows 1.0."""
    model = tiny_model(num_hidden_layers=3)
    ps, sparse, _ = mixed_case()
    plain = LLM(model, "quest", mixed_methods=MIXED, **BASE, **launch_knobs())
    want = token_ids(plain.generate(ps, GREEDY, use_tqdm=False, sparse_params=sparse))
    llm = LLM(model, "quest", mixed_methods=MIXED, **BASE, **launch_knobs(), recall_sample_every=2)
    outs = llm.generate(ps, GREEDY, use_tqdm=False, sparse_params=sparse)
    assert token_ids(outs) == want and llm.engine.cache_manager.allocator.is_idle()
    recall = [o.metrics["attention_recall"] for o in outs]
    assert recall[0]["mean"] == 1.0 and recall[0]["output_rel_error"] == 0.0          # vanilla
    for i in (1, 2, 3, 4):                                                              # QuEST, OmniKV rows
        assert 0.0 < recall[i]["mean"] < 1.0 and recall[i]["sampled_steps"] > 0, (i, recall[i])


# ---------------------------------------------------------------- GPU: under CUDA graphs

@gpu
@pytest.mark.parametrize("layout", ["filter0", "filter1"])
def test_gpu_a_batch_of_every_method_under_graphs_equals_each_request_alone(tiny_model, layout):
    """fp32 on the GPU (token equality), decode in CUDA graphs, overlap on: one captured graph per
    bucket serves the mix (mixed_rows is a decode extra); each request alone also in graphs."""
    model = tiny_model(num_hidden_layers=3)
    ps, sparse, wanted = mixed_case(layout)
    llm = LLM(model, "quest", mixed_methods=MIXED, **BASE, **launch_knobs(layout), device="cuda", dtype="float32")
    assert llm.execution_mode == "cuda_graph"
    outs = llm.generate(ps, GREEDY, use_tqdm=False, sparse_params=sparse)
    assert llm.engine.cache_manager.allocator.is_idle()
    want = [alone(model, m, k, p, device="cuda", dtype="float32") for p, (m, k) in zip(ps, wanted)]
    assert token_ids(outs) == want

"""Sparsity per request (SparseParams): every request of a mixed batch (vanilla rows, the engine's
method at its own budget and at another) gives the tokens the same request gets alone in an engine
launched with its method and knobs, with overlapped scheduling off and on, over prefix-cache hits
and under preemption; allocators end idle; a bad per-request knob fails its request alone;
methods that own their pool layout refuse per-request sparsity; vllm_sparse_method="auto" decodes
short prompts densely and long ones with its method; the per-row page selection's kernel against
its reference, and the reference against the one-budget selection it generalises.
"""
import os
import subprocess
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from helpers import CUDA, gpu, prompts, token_ids  # noqa: E402
from method_knobs import METHOD_KNOBS  # noqa: E402
from per_request_helpers import BASE, GREEDY, OTHER, alone, run_noting_preemptions  # noqa: E402
from sparsevllm import LLM, SamplingParams, SparseParams  # noqa: E402
from sparsevllm.engine.sequence import Sequence  # noqa: E402
from sparsevllm.kernels import page_bounds as pb, page_select as psel  # noqa: E402
from sparsevllm.method_registry import make_config, methods, request_sparsity  # noqa: E402

# Per method: the engine's knobs (OTHER: a second budget a request asks for).
ENGINE = {"quest": METHOD_KNOBS["quest"],
          "omnikv": METHOD_KNOBS["omnikv"],
          "snapkv": METHOD_KNOBS["snapkv"]}


def mixed_case(method):
    """Prompts and their SparseParams: vanilla rows, the engine's budget (None and an explicit
    method name), the other budget; lengths past every budget, so each sparse row is sparse."""
    ps = prompts([150, 96, 200, 120, 170, 88])
    sparse = [SparseParams(method="vanilla"), None, SparseParams(**OTHER[method]),
              SparseParams(method=method), SparseParams(method="vanilla"), SparseParams(method=method, **OTHER[method])]
    wanted = [("vanilla", {}), (method, ENGINE[method]), (method, {**ENGINE[method], **OTHER[method]}),
              (method, ENGINE[method]), ("vanilla", {}), (method, {**ENGINE[method], **OTHER[method]})]
    return ps, sparse, wanted


@pytest.mark.parametrize("method", ["quest", "omnikv", "snapkv"])
@pytest.mark.parametrize("overlap", [False, True])
def test_a_mixed_batch_equals_each_request_alone(tiny_model, method, overlap):
    model = tiny_model(num_hidden_layers=3)
    ps, sparse, wanted = mixed_case(method)
    llm = LLM(model, method, **BASE, **ENGINE[method], async_scheduling=overlap)
    outs = llm.generate(ps, GREEDY, use_tqdm=False, sparse_params=sparse)
    assert llm.engine.cache_manager.allocator.is_idle()
    assert all(o.error is None for o in outs)
    want = [alone(model, m, k, p) for p, (m, k) in zip(ps, wanted)]
    assert token_ids(outs) == want
    # the rows differ: a vanilla row is not the method's, nor the other budget the engine's
    assert want[0] != alone(model, method, ENGINE[method], ps[0]) or want[2] != alone(model, method, ENGINE[method], ps[2])
    assert [o.metrics["sparse"]["method"] for o in outs] == [m for m, _ in wanted]
    knob = next(iter(OTHER[method]))
    assert outs[2].metrics["sparse"]["knobs"] == {knob: OTHER[method][knob]}
    assert outs[1].metrics["sparse"]["knobs"] == {knob: getattr(llm.config.method_config, knob)}


@pytest.mark.parametrize("method", ["quest", "snapkv"])
def test_prefix_hits_across_per_request_settings_equal_misses(tiny_model, method):
    """A prompt prefilled by a vanilla row is hit by a sparse one and the other way round."""
    model = tiny_model(num_hidden_layers=3)
    first = prompts([160, 140], seed=3)
    llm = LLM(model, method, **BASE, **ENGINE[method])
    llm.generate(first, GREEDY, use_tqdm=False, sparse_params=[SparseParams(method="vanilla"), None])
    cm = llm.engine.cache_manager
    second = [first[0][:120] + prompts([40], seed=4)[0], first[1][:100] + prompts([30], seed=5)[0]]
    sparse = [SparseParams(**OTHER[method]), SparseParams(method="vanilla")]
    probes = [Sequence(p, GREEDY) for p in second]
    for probe, s in zip(probes, sparse):
        probe.sparse = request_sparsity(llm.config, s, len(probe))
    assert all(len(cm.cached_prefix(probe)) > 0 for probe in probes)
    outs = llm.generate(second, GREEDY, use_tqdm=False, sparse_params=sparse)
    assert cm.allocator.is_idle()
    assert token_ids(outs) == [alone(model, method, {**ENGINE[method], **OTHER[method]}, second[0]),
                         alone(model, "vanilla", {}, second[1])]


@pytest.mark.parametrize("method", ["quest", "snapkv"])
def test_a_mixed_batch_under_preemption(tiny_model, method):
    """A pool too small for the batch preempts and recomputes. Vanilla rows and SnapKV recompute
    exactly; QuEST's recompute prefills a preempted request's generated tokens densely (quest.py),
    so its rows are compared only where they were not preempted."""
    model = tiny_model(num_hidden_layers=3)
    ps, sparse, wanted = mixed_case(method)
    gen = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    llm = LLM(model, method, **BASE, **ENGINE[method], num_kv_pages=150)
    seqs, preempted = run_noting_preemptions(llm, ps, gen, sparse)
    assert preempted
    for seq, p, (m, k) in zip(seqs, ps, wanted):
        assert seq.error is None
        if m == "vanilla" or method == "snapkv" or seq.seq_id not in preempted:
            ref = LLM(model, m, **BASE, **k).generate([p], gen, use_tqdm=False)[0].outputs[0].token_ids
            assert seq.completion_token_ids == ref, (m, seq.seq_id in preempted)


def test_a_bad_per_request_knob_fails_alone_naming_it(tiny_model):
    model = tiny_model(num_hidden_layers=3)
    llm = LLM(model, "quest", **BASE, **ENGINE["quest"])
    ps = prompts([100] * 7)
    bad = [None, SparseParams(quest_token_budget=2), SparseParams(method="snapkv"), SparseParams(quest_skip_layers=0),
           SparseParams(method="vanilla", quest_token_budget=64), SparseParams(quest_token_bugdet=64),
           SparseParams(method="vanilla")]
    outs = llm.generate(ps, GREEDY, use_tqdm=False, sparse_params=bad)
    assert llm.engine.cache_manager.allocator.is_idle()
    assert outs[0].error is None and len(outs[0].outputs[0].token_ids) == 10
    assert outs[6].error is None and len(outs[6].outputs[0].token_ids) == 10
    errors = [o.error for o in outs[1:6]]
    assert all(o.outputs[0].finish_reason == "error" for o in outs[1:6])
    # the launch's own message for the knob's value
    with pytest.raises(ValueError) as launch:
        make_config(model, "quest", page_size=4, quest_token_budget=2)
    assert errors[0] == f"sparse_params: {launch.value}" and "quest_token_budget=2 is invalid" in errors[0]
    assert "sparse_params.method='snapkv'" in errors[1] and "runs vllm_sparse_method='quest'" in errors[1] \
        and "mixed_methods=['snapkv']" in errors[1]
    assert "'quest_skip_layers' cannot be set per request" in errors[2] and "quest_token_budget" in errors[2]
    assert "vanilla' takes no knobs" in errors[3]
    assert "unknown knob 'quest_token_bugdet'" in errors[4] and "did you mean 'quest_token_budget'" in errors[4]
    with pytest.raises(ValueError, match="got 2 sparse_params for 3 prompts"):
        llm.generate(ps[:3], GREEDY, use_tqdm=False, sparse_params=[None, None])
    with pytest.raises(TypeError, match="sparse_params must be SparseParams"):
        llm.generate(ps[:1], GREEDY, use_tqdm=False, sparse_params={"method": "vanilla"})
    with pytest.raises(ValueError, match="SparseParams.method must be"):
        SparseParams(method=3)


def test_methods_owning_their_pool_layout_refuse_per_request_sparsity(tiny_model):
    assert methods()["deltakv"].request_knobs is None and methods()["hisparse"].request_knobs is None
    model = tiny_model(num_hidden_layers=3)
    llm = LLM(model, "hisparse", **BASE, **METHOD_KNOBS["hisparse"])
    ps = prompts([100, 100])
    outs = llm.generate(ps, GREEDY, use_tqdm=False, sparse_params=[SparseParams(method="vanilla"), None])
    assert "vllm_sparse_method='hisparse' takes no per-request sparsity" in outs[0].error
    assert "owns its KV pool's layout" in outs[0].error
    assert outs[1].error is None and len(outs[1].outputs[0].token_ids) == 10   # the engine-wide setting works
    assert llm.engine.cache_manager.allocator.is_idle()


def test_a_vanilla_engine_takes_vanilla_requests_only(tiny_model):
    cfg = make_config(tiny_model(num_hidden_layers=3), None, **BASE)
    assert request_sparsity(cfg, SparseParams(method="vanilla"), 10).dense
    with pytest.raises(ValueError, match="sparse_params.method='quest'.*runs vllm_sparse_method='vanilla'"):
        request_sparsity(cfg, SparseParams(method="quest"), 10)


def test_auto_decodes_short_prompts_densely_and_long_ones_with_its_method(tiny_model):
    model = tiny_model(num_hidden_layers=3)
    knobs = dict(quest_token_budget=16, quest_skip_layers=1)
    llm = LLM(model, "auto", **BASE, auto_dense_below=120, **knobs)
    assert llm.config.vllm_sparse_method == "auto" and llm.config.method.method_name == "quest"
    ps = prompts([150, 80, 200, 60, 130])
    sparse = [None, None, SparseParams(method="vanilla"), SparseParams(method="quest", quest_token_budget=8),
              SparseParams(method="auto", quest_token_budget=32)]
    outs = llm.generate(ps, GREEDY, use_tqdm=False, sparse_params=sparse)
    assert llm.engine.cache_manager.allocator.is_idle()
    report = [o.metrics["sparse"] for o in outs]
    assert [r["method"] for r in report] == ["quest", "vanilla", "vanilla", "quest", "quest"]
    assert report[0]["policy"] == "auto: prompt of 150 tokens >= auto_dense_below=120"
    assert report[1]["policy"] == "auto: prompt of 80 tokens < auto_dense_below=120"
    assert "policy" not in report[2] and report[3]["knobs"] == {"quest_token_budget": 8}
    want = [alone(model, "quest", knobs, ps[0]), alone(model, "vanilla", {}, ps[1]), alone(model, "vanilla", {}, ps[2]),
            alone(model, "quest", {**knobs, "quest_token_budget": 8}, ps[3]),
            alone(model, "quest", {**knobs, "quest_token_budget": 32}, ps[4])]
    assert token_ids(outs) == want


def test_auto_knobs_are_validated_at_launch(tiny_model):
    with pytest.raises(ValueError, match="auto_method='hisparse' is invalid; valid: "):
        make_config(None, "auto", auto_method="hisparse")
    with pytest.raises(ValueError, match="auto_method='vanilla' is invalid"):
        make_config(None, "auto", auto_method="vanilla")
    with pytest.raises(ValueError, match="knob 'auto_dense_below' belongs to vllm_sparse_method='auto'"):
        make_config(None, "quest", auto_dense_below=10)
    with pytest.raises(ValueError, match="auto_dense_below=-1 is invalid"):
        make_config(None, "auto", auto_dense_below=-1)
    with pytest.raises(ValueError, match="knob 'snapkv_capacity' belongs to method 'snapkv'"):
        make_config(None, "auto", snapkv_capacity=64)
    cfg = make_config(None, "auto", auto_method="snapkv", snapkv_capacity=64)
    assert cfg.method.method_name == "snapkv" and cfg.method_config.snapkv_capacity == 64
    with pytest.raises(ValueError, match="sparse_params.method='auto'.*a request may choose vanilla | quest"):
        request_sparsity(make_config(None, "quest"), SparseParams(method="auto"), 10)


def test_sparse_params_import_no_torch():
    code = "import sys, sparsevllm; sparsevllm.SparseParams(method='vanilla'); assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": "src"})


# ---------------------------------------------------------------- the per-row selection

def _rows(B, G, N, P, seed):
    g = torch.Generator().manual_seed(seed)
    ctx = torch.randint(1, N * P + 1, (B,), generator=g, dtype=torch.int32)
    scores = torch.randn(B, G, N, generator=g)
    current = ((ctx.long() - 1) // P).view(B, 1, 1)
    scores = scores.masked_fill(torch.arange(N).view(1, 1, N) >= current, float("-inf"))
    bt = torch.randperm(2 * B * N, generator=g)[:B * N].view(B, N).int()
    budgets = torch.randint(2, N + 2, (B,), generator=g, dtype=torch.int32)
    budgets[0] = psel.DENSE_PAGES
    return scores, bt, ctx, budgets


@pytest.mark.parametrize("B,G,N,P", [(5, 2, 37, 4), (4, 4, 130, 16), (3, 1, 9, 1)])
def test_per_row_selection_equals_the_one_budget_selection_of_each_row(B, G, N, P):
    """Row b of the per-row view = the one-budget selection with n = budgets[b] (the path every
    row took before budgets per request), in its first n entries; dense rows get their table."""
    scores, bt, ctx, budgets = _rows(B, G, N, P, seed=N)
    table, lengths = psel.select_pages_ref(scores, bt, ctx, P, budgets)
    assert table.shape == (B, G, N)
    for b in range(B):
        n = int(budgets[b])
        pages = -(-int(ctx[b]) // P)
        if pages <= n:
            assert (lengths[b] == ctx[b]).all() and torch.equal(table[b, :, :pages], bt[b, :pages].expand(G, -1))
            continue
        t1, l1 = psel.select_pages_ref(scores[b:b + 1], bt[b:b + 1], ctx[b:b + 1], P, n)
        assert torch.equal(table[b, :, :n], t1[0]) and torch.equal(lengths[b], l1[0])


@pytest.mark.parametrize("B,G,N,P", [(5, 2, 37, 4), (4, 4, 130, 16), (2, 8, 300, 1)])
def test_per_row_selection_triton_matches_reference(B, G, N, P):
    scores, bt, ctx, budgets = _rows(B, G, N, P, seed=7 * N)
    dev = "cuda" if CUDA else "cpu"
    want_t, want_l = psel.select_pages_ref(scores, bt, ctx, P, budgets)
    got_t, got_l = psel.select_pages_triton(scores.to(dev), bt.to(dev), ctx.to(dev), P, budgets.to(dev))
    assert torch.equal(got_l.cpu(), want_l)
    for b in range(B):   # entries past a row's pages are not read
        for g in range(G):
            used = -(-int(want_l[b, g]) // P)
            assert torch.equal(got_t[b, g, :used].cpu(), want_t[b, g, :used])


@pytest.mark.parametrize("selection", ["kv_head", "query_head", "shared"])
def test_rows_within_their_budget_are_not_scored(selection):
    """bound_scores with per-row budgets: a row within its budget (a dense row) scores -inf everywhere
    and its programs exit; the others score as without budgets. Triton against the reference."""
    g = torch.Generator().manual_seed(3)
    B, Hq, Hkv, D, N, P = 4, 4, 2, 16, 12, 4
    q = torch.randn(B, Hq, D, generator=g)
    kmin = torch.randn(64, Hkv, D, generator=g)
    kmax = kmin + torch.rand(64, Hkv, D, generator=g)
    bt = torch.randperm(64, generator=g)[:B * N].view(B, N).int()
    ctx = torch.tensor([45, 45, 13, 30], dtype=torch.int32)
    budgets = torch.tensor([3, psel.DENSE_PAGES, 3, 8], dtype=torch.int32)   # rows 1 and 3 are within theirs
    want = pb.bound_scores_ref(q, kmin, kmax, bt, ctx, P, selection, budgets)
    plain = pb.bound_scores_ref(q, kmin, kmax, bt, ctx, P, selection)
    assert torch.isinf(want[[1, 3]]).all() and torch.equal(want[[0, 2]], plain[[0, 2]])
    dev = "cuda" if CUDA else "cpu"
    got = pb.bound_scores_triton(*(x.to(dev) for x in (q, kmin, kmax, bt, ctx)), P, selection, budgets.to(dev))
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- GPU: under CUDA graphs

@gpu
@pytest.mark.parametrize("method", ["quest", "omnikv", "snapkv"])
def test_gpu_a_mixed_batch_under_graphs_equals_each_request_alone(tiny_model, method):
    """fp32 on the GPU (token equality), decode in CUDA graphs, overlap on: the mixed batch against each request alone
    (also in graphs)."""
    model = tiny_model(num_hidden_layers=3)
    ps, sparse, wanted = mixed_case(method)
    llm = LLM(model, method, **BASE, **ENGINE[method], device="cuda", dtype="float32")
    assert llm.execution_mode == "cuda_graph"
    outs = llm.generate(ps, GREEDY, use_tqdm=False, sparse_params=sparse)
    assert llm.engine.cache_manager.allocator.is_idle()
    want = [alone(model, m, k, p, device="cuda", dtype="float32") for p, (m, k) in zip(ps, wanted)]
    assert token_ids(outs) == want


# ---------------------------------------------------------------- the server

@pytest.fixture(scope="module")
def quest_server(tmp_path_factory):
    """A QuEST engine on a tiny tokenized Llama, served over HTTP, and the knobs it was launched with."""
    pytest.importorskip("uvicorn")
    from regression_fixtures import build_tiny_llama
    from test_server import serving
    model = build_tiny_llama(str(tmp_path_factory.mktemp("tinytok")), max_position_embeddings=512)
    knobs = dict(device="cpu", **BASE, **ENGINE["quest"])
    llm = LLM(model, "quest", **knobs)
    with serving(llm, "tiny") as url:
        yield url, llm, model, knobs


def test_the_server_takes_sparse_per_request_and_lists_the_choices(quest_server):
    import asyncio
    import json
    openai = pytest.importorskip("openai")
    from test_server import http, idle
    url, llm, model, knobs = quest_server
    prompt = " ".join(f"w{i % 37} x{i % 11}" for i in range(80))   # far past the 16-token budget
    bodies = [{"method": "vanilla"}, {"method": "quest", "quest_token_budget": 16}]
    launched = [("vanilla", {k: v for k, v in knobs.items() if not k.startswith("quest")}),
                ("quest", {**knobs, "quest_token_budget": 16})]
    want = [LLM(model, m, **k).generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].text for m, k in launched]
    assert want[0] != want[1]
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)

    async def both():   # two concurrent requests, different `sparse` bodies
        return await asyncio.gather(*[client.completions.create(
            model="tiny", prompt=prompt, max_tokens=10, temperature=0, extra_body={"sparse": b, "ignore_eos": True})
            for b in bodies])
    got = asyncio.run(both())
    assert [c.choices[0].text for c in got] == want
    chat = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=6, temperature=0,
        extra_body={"sparse": {"method": "vanilla"}})
    messages = [{"role": "user", "content": prompt}]
    ref = LLM(model, "vanilla", **launched[0][1]).chat(messages, SamplingParams(temperature=0.0, max_tokens=6),
                                                       use_tqdm=False)[0].outputs[0].text
    assert chat.choices[0].message.content == ref
    for body, needle in [({"method": "snapkv"}, "sparse.method='snapkv'"), ({"quest_token_budget": 1}, "quest_token_budget=1"),
                         ({"method": 3}, "SparseParams.method must be"), ({"quest_page_size": 8}, "cannot be set per request"),
                         ("quest", "sparse")]:
        for endpoint, extra in [("/v1/completions", {"prompt": "hi"}),
                                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})]:
            code, text = http("POST", url + endpoint, json.dumps({**extra, "max_tokens": 2, "sparse": body}), key=None)
            error = json.loads(text)["error"]
            assert code == 400 and error["param"] == "sparse" and needle in error["message"], (body, text)
    models = json.loads(http("GET", url + "/v1/models", key=None)[1])["data"][0]
    assert models["sparse"] == {"default": "quest", "methods": ["quest", "vanilla"], "knobs": ["quest_token_budget"]}
    assert idle(llm.engine)

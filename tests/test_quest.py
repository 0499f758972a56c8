"""quest: equal to vanilla when the budget covers the context; the selected pages equal a naive
oracle of the bound computed from the raw keys in the pool; the causal invariant; page min/max
equal a recomputation from the pool after chunked prefill, prefix-cache hits and many decode
steps; knob validation; the Triton kernels against their references (interpreter on CPU, bf16 and
graph replay on the GPU).

Decode steps on CPU see a block table as wide as the live batch needs; CUDA graphs see one
max_model_len / P wide whose tail holds stale entries. `graph_shaped` gives CPU decode steps that
shape (garbage past each row), so the selection path the graphs run is tested here too.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from helpers import CUDA, gpu, prompts, token_ids  # noqa: E402
from sparsevllm import LLM, SamplingParams  # noqa: E402
from sparsevllm.method_registry import make_config  # noqa: E402
from sparsevllm.kernels import page_bounds as pb, page_select as psel, quest as qk  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def graph_shaped(llm):
    """Decode steps get a block table max_model_len / P wide with random page ids past each row's
    pages, as the CUDA-graph static buffer holds stale entries there."""
    cm, runner = llm.engine.cache_manager, llm.engine.model_runner
    prepare, width = runner.prepare_step, cm.pages_for(llm.config.max_model_len)
    gen = torch.Generator().manual_seed(1)

    def wide(seqs, num_tokens, is_prefill, *feed):
        step = prepare(seqs, num_tokens, is_prefill, *feed)
        if not is_prefill:
            bt = torch.randint(0, cm.num_pages, (len(seqs), width), generator=gen, dtype=torch.int32)
            bt[:, :step.block_tables.shape[1]] = step.block_tables
            for i, ctx in enumerate(step.cache_lens.tolist()):
                bt[i, cm.pages_for(ctx):] = torch.randint(0, cm.num_pages, (width - cm.pages_for(ctx),),
                                                          generator=gen, dtype=torch.int32)
            step.block_tables = bt.to(step.block_tables.device)
        return step
    runner.prepare_step = wide
    return llm


# ---------------------------------------------------------------- the naive oracle

def oracle_view(q, k_cache, table_row, ctx, P, n, selection):
    """Quest's selection for one request, from the raw keys, in float64 Python loops.
    Returns per page set (one, one per KV head or one per query head) the physical pages and the length."""
    Hq, Hkv = q.shape[0], k_cache.shape[1]
    qg = Hq // Hkv
    num_pages = -(-ctx // P)
    # Each page set: the query heads whose bounds it sums.
    sets = {"shared": [list(range(Hq))], "kv_head": [list(range(h * qg, (h + 1) * qg)) for h in range(Hkv)],
            "query_head": [[h] for h in range(Hq)]}[selection]
    if num_pages <= n:
        return [(table_row[:num_pages], ctx)] * len(sets)
    out = []
    for q_heads in sets:
        scores = []
        for j in range(num_pages - 1):     # full pages only: the current page is forced
            keys = k_cache[table_row[j] * P:(table_row[j] + 1) * P].double()
            s = 0.0
            for qh in q_heads:
                hi, lo = keys[:, qh // qg].max(0).values, keys[:, qh // qg].min(0).values
                qd = q[qh].double()
                s += float(torch.maximum(qd * hi, qd * lo).sum())
            scores.append(s)
        top = sorted(range(num_pages - 1), key=lambda j: -scores[j])[:n - 1]
        chosen = sorted(top) + [num_pages - 1]
        out.append(([table_row[j] for j in chosen], (n - 1) * P + ctx - (num_pages - 1) * P))
    return out


def check_decode_views(llm, log):
    """Wrap build_decode_view: every sparse-layer view must equal the oracle and respect causality."""
    cm = llm.engine.cache_manager
    build = cm.build_decode_view

    def checked(layer_id, q, step):
        view = build(layer_id, q, step)
        k_cache = cm.pool.layer(layer_id)[0]
        P, n = cm.page_size, cm.budget_pages
        B, G, _ = view.table.shape
        for b in range(B):
            ctx = int(step.cache_lens[b])
            row = step.block_tables[b, :cm.pages_for(ctx)].tolist()
            logical = {page: j for j, page in enumerate(row)}
            for g in range(G):
                length = int(view.lengths[b, g])
                pages = view.table[b, g, :cm.pages_for(length)].tolist()
                # The causal invariant: every token the view names is a distinct stored position
                # <= the query's, and the query's own token is among them.
                positions = [logical[p] * P + t for i, p in enumerate(pages) for t in range(P)
                             if i * P + t < length]
                assert len(set(positions)) == len(positions) and max(positions) == ctx - 1
                if layer_id >= cm.skip_layers:
                    want = oracle_view(q[b], k_cache, row, ctx, P, n, cm.selection)[g]
                    assert (pages, length) == want, f"layer {layer_id} row {b} head set {g}"
                    log["sparse" if length < ctx else "dense"] += g == 0
        return view
    cm.build_decode_view = checked
    return llm


def check_metadata(llm, log):
    """After every step, each live request's page min/max equal a recomputation from the pool."""
    cm = llm.engine.cache_manager
    end = cm.on_step_end

    def checked(step):
        P = cm.page_size
        for b, seq in enumerate(step.seqs):
            ctx = int(step.cache_lens[b])
            for j, page in enumerate(cm.tables[seq.seq_id][:cm.pages_for(ctx)]):
                count = min(P, ctx - j * P)
                for layer in range(cm.skip_layers, cm.num_layers):
                    keys = cm.pool.layer(layer)[0][page * P:page * P + count]
                    i = layer - cm.skip_layers
                    assert torch.equal(cm.kmin[i, page], keys.amin(0)), (layer, page)
                    assert torch.equal(cm.kmax[i, page], keys.amax(0)), (layer, page)
                    log["pages"] += 1
        end(step)
    cm.on_step_end = checked
    return llm


def quest(path, **knobs):
    return LLM(path, vllm_sparse_method="quest", device="cpu", **knobs)


# ---------------------------------------------------------------- engine (CPU)

@pytest.mark.parametrize("graph_like", [False, True])
def test_quest_equals_vanilla_when_budget_covers_context(tiny_model, graph_like):
    path = tiny_model("llama")
    ps = prompts([70, 13, 150])
    want = token_ids(LLM(path, device="cpu").generate(ps, GREEDY, use_tqdm=False))
    llm = quest(path, quest_token_budget=256, quest_skip_layers=0, chunk_prefill_size=32)
    if graph_like:
        graph_shaped(llm)
    assert token_ids(llm.generate(ps[:1], GREEDY, use_tqdm=False)) == want[:1]      # bs 1
    assert token_ids(llm.generate(ps, GREEDY, use_tqdm=False)) == want              # bs 3
    assert llm.engine.cache_manager.allocator.is_idle()


def test_decode_steps_within_every_budget_take_the_dense_graph_variant(tiny_model, monkeypatch):
    """A decode step whose rows are all within their budgets (a short request, a vanilla row) runs
    graph_variant "dense" (no scoring: the captured graph without it); once a row passes its budget,
    the general one. Graph-shaped tables, so the general path would score: the tokens equal those
    of the general path run for every step."""
    from sparsevllm import SparseParams
    from sparsevllm.engine.cache_manager import quest as quest_cm
    path = tiny_model("llama")
    ps = prompts([9, 14, 30], seed=3)
    sparse = [None, None, SparseParams(method="vanilla")]
    knobs = dict(page_size=4, quest_token_budget=24, quest_skip_layers=1)
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    variants, general = [], quest_cm.QuestCacheManager.graph_variant

    def record(self, step):
        variants.append(general(self, step))
        return variants[-1]
    monkeypatch.setattr(quest_cm.QuestCacheManager, "graph_variant", record)
    scored = []
    for name in ("bound_scores", "store_and_score"):
        fn = getattr(quest_cm, name)
        monkeypatch.setattr(quest_cm, name, lambda *a, fn=fn, **k: scored.append(1) or fn(*a, **k))
    llm = graph_shaped(quest(path, **knobs))
    got = token_ids(llm.generate(ps, sp, sparse_params=sparse, use_tqdm=False))
    # 6 pages of budget: rows of 10 and 15 tokens start within it, the 14-token prompt passes it at 25
    assert variants[0] == "dense" and variants[-1] == "" and set(variants) == {"", "dense"}
    cm = llm.engine.cache_manager
    assert len(scored) == variants.count("") * (cm.num_layers - cm.skip_layers)   # the dense steps score nothing
    assert llm.engine.cache_manager.allocator.is_idle()
    monkeypatch.setattr(quest_cm.QuestCacheManager, "graph_variant", lambda self, step: "")
    want = token_ids(graph_shaped(quest(path, **knobs)).generate(ps, sp, sparse_params=sparse, use_tqdm=False))
    assert got == want


@pytest.mark.parametrize("arch,selection", [("llama", "kv_head"), ("qwen3", "shared"), ("qwen2", "query_head")])
def test_quest_selection_equals_oracle_and_is_causal(tiny_model, arch, selection):
    path = tiny_model(arch)
    ps = prompts([90, 21, 57], seed=1)      # 23, 6 and 15 pages of 4: sparse and dense rows together
    llm = quest(path, page_size=4, quest_token_budget=24, quest_skip_layers=1, quest_selection=selection,
                chunk_prefill_size=40)
    log = {"sparse": 0, "dense": 0}
    check_decode_views(graph_shaped(llm), log)
    outs = llm.generate(ps, GREEDY, use_tqdm=False)
    assert log["sparse"] > 20 and log["dense"] >= 3     # rows: 12 + 9 + 12 sparse, 3 dense
    assert all(o.outputs[0].finish_reason == "length" and len(o.outputs[0].token_ids) == GREEDY.max_tokens for o in outs)
    # A budget below the context changes the long request's output (valid tokens, different ones).
    want = token_ids(LLM(path, device="cpu").generate(ps, GREEDY, use_tqdm=False))
    assert token_ids(outs)[0] != want[0]


@pytest.mark.skipif(CUDA, reason="interpreter test: runs on CPU-only machines")
def test_quest_on_kv_stored_sees_the_keys_the_cache_holds(tiny_model, monkeypatch):
    """The hook contract: when on_kv_stored runs, k is written at the step's slots, also for the
    scoring layers whose decode store runs inside the page-scoring launch."""
    from sparsevllm.engine.cache_manager import quest as quest_cm
    monkeypatch.setattr(quest_cm, "FUSED_STORE", True)
    seen = []
    original = quest_cm.QuestCacheManager.on_kv_stored

    def spy(self, layer_id, k, v, step):
        k_cache, v_cache = self.pool.layer(layer_id)
        rows = step.slot_mapping >= 0
        slots = step.slot_mapping[rows]
        seen.append((step.is_prefill, self._scores(layer_id, step)))
        assert torch.equal(k_cache[slots], k[rows]) and torch.equal(v_cache[slots], v[rows]), layer_id
        return original(self, layer_id, k, v, step)
    monkeypatch.setattr(quest_cm.QuestCacheManager, "on_kv_stored", spy)
    llm = quest(tiny_model("llama"), page_size=4, quest_token_budget=12, quest_skip_layers=1)
    llm.generate(prompts([60, 33]), GREEDY, use_tqdm=False)
    assert (False, True) in seen and (True, False) in seen   # fused decode layers and prefill both checked


@pytest.mark.parametrize("arch,selection", [("llama", "kv_head"), ("qwen2", "shared")])
def test_quest_store_inside_the_scoring_launch_gives_the_separate_stores_tokens(tiny_model, arch, selection,
                                                                               monkeypatch):
    """With the scoring layers' decode store run by the Triton scoring kernel (interpreter), the
    engine produces the tokens of the separate rope_store launch, graph-shaped tables included."""
    from sparsevllm.engine.cache_manager import quest as quest_cm
    path = tiny_model(arch)
    ps = prompts([90, 21, 57], seed=5)
    knobs = dict(page_size=4, quest_token_budget=24, quest_skip_layers=1, quest_selection=selection,
                 chunk_prefill_size=40)
    monkeypatch.setattr(quest_cm, "FUSED_STORE", False)
    want = token_ids(graph_shaped(quest(path, **knobs)).generate(ps, GREEDY, use_tqdm=False))
    monkeypatch.setattr(quest_cm, "FUSED_STORE", True)
    calls = []

    def fused(*args):
        calls.append(args[0].shape[0])
        return qk.store_and_score_triton(*args)
    monkeypatch.setattr(quest_cm, "store_and_score", fused)
    llm = graph_shaped(quest(path, **knobs))
    assert token_ids(llm.generate(ps, GREEDY, use_tqdm=False)) == want
    assert len(calls) >= GREEDY.max_tokens - 1 and max(calls) == 3   # a call a decode step and sparse layer
    assert llm.engine.cache_manager.allocator.is_idle()


def test_quest_metadata_matches_pool_after_chunked_prefill_prefix_hits_and_decode(tiny_model):
    path = tiny_model("llama")
    llm = quest(path, page_size=8, quest_token_budget=32, quest_skip_layers=1, chunk_prefill_size=24,
                max_num_batched_tokens=48)
    log = {"pages": 0, "sparse": 0, "dense": 0}
    check_decode_views(check_metadata(llm, log), log)
    shared_prefix = prompts([64], seed=2)[0]
    first = [shared_prefix + p for p in prompts([30, 9], seed=3)]
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    llm.generate(first, sp, use_tqdm=False)
    hits = []
    allocate = llm.engine.cache_manager.allocate

    def record(seq):
        allocate(seq)
        hits.append(seq.num_computed_tokens)
    llm.engine.cache_manager.allocate = record
    second = [shared_prefix + p for p in prompts([5, 41], seed=4)]
    llm.generate(second, sp, use_tqdm=False)
    assert min(hits) >= 64                  # the shared prefix came from the cache
    assert log["pages"] > 1000 and log["sparse"] > 50
    assert llm.engine.cache_manager.allocator.is_idle()


def test_quest_memory_accounting_counts_metadata(tiny_model):
    path = tiny_model("llama")
    llm = quest(path, num_kv_pages=100, quest_skip_layers=1)
    cm = llm.engine.cache_manager
    mc = llm.hf_config
    # One sparse layer, min and max, H_kv x D fp32 values per page.
    meta = 2 * 1 * mc.num_key_value_heads * mc.head_dim * 4
    assert llm.memory_accounting()["metadata_bytes"] == 100 * meta
    kv = cm.pool.nbytes // 100
    assert type(cm).bytes_per_page(llm.config, mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim,
                                   torch.float32) == kv + meta


def test_quest_knobs_are_validated():
    cfg = make_config(None, "quest")
    assert (cfg.method_config.quest_token_budget, cfg.page_size, cfg.method_config.quest_skip_layers) == (2048, 16, 2)
    assert make_config(None, "quest", quest_page_size=32).page_size == 32
    assert make_config(None, "quest", quest_page_size=8, page_size=8).page_size == 8
    with pytest.raises(ValueError, match="quest_page_size=8 contradicts page_size=32"):
        make_config(None, "quest", quest_page_size=8, page_size=32)
    bad = [dict(quest_page_size=12), dict(quest_page_size=0), dict(quest_token_budget=8),
           dict(quest_token_budget=1.5e3), dict(quest_skip_layers=-1), dict(quest_selection="per_head")]
    for knobs in bad:
        with pytest.raises(ValueError, match=next(iter(knobs))):
            make_config(None, "quest", **knobs)
    with pytest.raises(ValueError, match="belongs to method 'quest'"):
        make_config(None, "vanilla", quest_token_budget=512)


def test_skip_layers_past_the_model_fail_before_weights_load(tiny_model, monkeypatch):
    from sparsevllm.engine import model_runner

    def no_load(*a, **k):
        raise AssertionError("weights started loading")
    monkeypatch.setattr(model_runner, "load_weights", no_load)
    path = tiny_model("llama")
    with pytest.raises(ValueError, match=r"quest_skip_layers=3 is out of range .* 2 layers; valid: .*\[0, 2\]"):
        LLM(path, vllm_sparse_method="quest", quest_skip_layers=3, device="cpu")


def test_select_pages_dense_rows_and_lengths():
    # Row 0: 6 pages > n = 3 -> top 2 of pages 0..4 by score, then the current page 5.
    # Row 1: 3 pages <= n -> dense. Scores past a row's candidates are -inf as the kernels write them.
    inf = float("-inf")
    scores = torch.tensor([[[0.5, 3.0, 1.0, 2.0, 0.0, inf, inf, inf]],
                           [[9.0, 8.0, inf, inf, inf, inf, inf, inf]]])
    bt = torch.tensor([[10, 11, 12, 13, 14, 15, 7, 7], [20, 21, 22, 5, 5, 5, 5, 5]], dtype=torch.int32)
    ctx = torch.tensor([5 * 4 + 3, 2 * 4 + 1], dtype=torch.int32)
    dev = "cuda" if CUDA else "cpu"   # the Triton version runs in the interpreter on CPU
    for select in (psel.select_pages_ref, psel.select_pages_triton):
        table, lengths = select(scores.to(dev), bt.to(dev), ctx.to(dev), 4, 3)
        assert table.tolist() == [[[11, 13, 15]], [[20, 21, 22]]]
        assert lengths.tolist() == [[2 * 4 + 3], [9]]


def test_select_pages_breaks_ties_in_page_order():
    # Page 3 scores highest, pages 0..9 tie at 0: the three other slots go to pages 0, 1, 2.
    dev = "cuda" if CUDA else "cpu"
    scores = torch.zeros(1, 1, 20, device=dev)
    scores[0, 0, 10:] = float("-inf")
    scores[0, 0, 3] = 1.0
    table, lengths = psel.select_pages_triton(scores, torch.arange(20, device=dev).int().view(1, 20),
                                            torch.tensor([10 * 4 + 2], device=dev).int(), 4, 5)
    assert table.tolist() == [[[0, 1, 2, 3, 10]]] and lengths.tolist() == [[42 - 6 * 4]]


# ---------------------------------------------------------------- kernels (interpreter on CPU)

interp = pytest.mark.skipif(CUDA, reason="interpreter tests run on CPU-only machines")


def bounds_case(g, num_pages, P, H, D, dtype, device):
    k_cache = torch.randn(num_pages * P, H, D, generator=g).to(device, dtype)
    pages = torch.randperm(num_pages, generator=g)[:6]
    offs = torch.randint(0, P, (6,), generator=g)
    offs[0], offs[1] = 0, P - 1                       # first token of a page; a full page
    last = pages * P + offs
    last[3] = -1                                      # padding writes nothing
    kmin = torch.randn(num_pages, H, D, generator=g).to(device, dtype)
    kmax = torch.randn(num_pages, H, D, generator=g).to(device, dtype)
    return k_cache, last.to(device), kmin, kmax


def scores_case(g, B, Hq, Hkv, D, P, N, dtype, device, head_major=False):
    num_pages = B * N + 3
    kmin = torch.randn(num_pages, Hkv, D, generator=g)
    kmax = kmin + torch.rand(num_pages, Hkv, D, generator=g)
    if head_major:   # strided metadata: [H_kv, pages, D] storage seen as [pages, H_kv, D]
        kmin, kmax = (x.transpose(0, 1).contiguous().transpose(0, 1) for x in (kmin, kmax))
    q = torch.randn(B, Hq, D, generator=g)
    bt = torch.randperm(num_pages, generator=g)[:B * N].view(B, N).int()
    ctx = torch.randint(1, N * P + 1, (B,), generator=g).int()
    ctx[0], ctx[-1] = N * P, 1                         # a full table; a single token
    return [x.to(device) for x in (q.to(dtype), kmin.to(dtype), kmax.to(dtype), bt, ctx)]


@interp
@pytest.mark.parametrize("P,dtype", [(1, torch.float32), (4, torch.float16), (16, torch.float32)])
def test_page_bounds_triton_matches_reference(P, dtype):
    g = torch.Generator().manual_seed(P)
    args = bounds_case(g, 12, P, 3, 24, dtype, "cpu")
    ref = [a.clone() for a in args]
    pb.page_bounds_triton(*args, P)
    pb.page_bounds_ref(*ref, P)
    assert torch.equal(args[2], ref[2]) and torch.equal(args[3], ref[3])


@interp
@pytest.mark.parametrize("P,selection,dtype,head_major", [
    (16, "kv_head", torch.float32, True), (4, "shared", torch.float16, False),
    (1, "query_head", torch.float16, True), (16, "query_head", torch.float32, False)])
def test_bound_scores_triton_matches_reference(P, selection, dtype, head_major):
    g = torch.Generator().manual_seed(P + len(selection))
    args = scores_case(g, 3, 6, 2, 24, P, {1: 70, 4: 40, 16: 9}[P], dtype, "cpu", head_major)   # 70 pages: 3 blocks
    got, want = pb.bound_scores_triton(*args, P, selection), pb.bound_scores_ref(*args, P, selection)
    assert torch.equal(got.isinf(), want.isinf())
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-4)


def store_case(g, B, Hq, Hkv, D, P, N, dtype, device):
    """A decode step's inputs: q, k, v before RoPE, each request's new token in its current page
    (request 1 at the page's first slot, request 2 within its first page, the last one padding),
    a pool and stale page bounds, and empty q / k outputs."""
    num_pages = B * N + 3
    ctx = torch.randint(P + 2, N * P + 1, (B,), generator=g)
    ctx[1], ctx[2] = 5 * P + 1, min(3, P)
    bt = torch.randperm(num_pages, generator=g)[:B * N].view(B, N).int()
    current = (ctx - 1) // P
    slots = bt[torch.arange(B), current].long() * P + (ctx - 1) % P
    slots[-1] = -1
    q, k, v = (torch.randn(B, h, D, generator=g).to(dtype) for h in (Hq, Hkv, Hkv))
    cos_sin = torch.randn(N * P, D, generator=g)
    k_cache, v_cache = (torch.randn(num_pages * P, Hkv, D, generator=g).to(dtype) for _ in range(2))
    kmin = torch.randn(num_pages, Hkv, D, generator=g)
    kmax = kmin + torch.rand(num_pages, Hkv, D, generator=g)
    args = [q, k, v, ctx - 1, cos_sin, k_cache, v_cache, slots, kmin.to(dtype), kmax.to(dtype), bt, ctx.int()]
    return [x.to(device) for x in args]


def run_store(fn, args, P, selection):
    """fn's scores and every tensor it writes (q / k after RoPE, the pool, the bounds), on copies."""
    args = [a.clone() for a in args]
    q_out, k_out = torch.empty_like(args[0]), torch.empty_like(args[1])
    scores = fn(*args, P, selection, q_out, k_out)
    return [scores, q_out, k_out] + args[5:7] + args[8:10]


def unfused(q, k, v, pos, cos_sin, kc, vc, slots, kmin, kmax, bt, ctx, P, selection, q_out, k_out):
    from sparsevllm.kernels.rope_store import rope_store_triton
    q_rot, k_rot = rope_store_triton(q, k, v, pos, cos_sin, kc, vc, slots, kmin, kmax, P)
    q_out.copy_(q_rot)
    k_out.copy_(k_rot)
    return pb.bound_scores_triton(q_out, kmin, kmax, bt, ctx, P, selection)


@interp
@pytest.mark.parametrize("selection", pb.SELECTIONS)
@pytest.mark.parametrize("P,dtype", [(16, torch.float32), (4, torch.float16), (1, torch.float32)])
def test_store_and_score_triton_equals_rope_store_then_scores(selection, P, dtype):
    """The decode store inside the scoring launch writes what rope_store writes (q and k after RoPE,
    the pool slots, padding nowhere, the page bounds, a page's first slot resetting them) and gives
    the scores bound_scores gives on the rotated query: bit for bit against the two launches, and
    against the reference."""
    g = torch.Generator().manual_seed(P + len(selection))
    args = store_case(g, 4, 6, 2, 24, P, {1: 70, 4: 40, 16: 9}[P], dtype, "cpu")   # 70 pages: 3 blocks
    fused = run_store(qk.store_and_score_triton, args, P, selection)
    two = run_store(unfused, args, P, selection)
    ref = run_store(qk.store_and_score_ref, args, P, selection)
    for name, a, b, c in zip(["scores", "q", "k", "k_cache", "v_cache", "kmin", "kmax"], fused, two, ref):
        assert torch.equal(a, b), name
        assert torch.equal(a.isinf(), c.isinf()), name
        torch.testing.assert_close(a, c, atol=1e-3 if dtype == torch.float32 else 2e-2, rtol=1e-3), name
    k_cache, slots = fused[3], args[7]
    assert not torch.equal(k_cache, args[5]) and torch.equal(k_cache[slots[slots >= 0]], fused[2][slots >= 0])
    assert torch.equal(fused[4][slots[slots >= 0]], args[2][slots >= 0])


def select_case(g, B, G, N, P, device):
    """Random scores (some negative) with -inf at and past each row's current page."""
    scores = torch.randn(B, G, N, generator=g) * 4
    bt = torch.randperm(B * N + 7, generator=g)[:B * N].view(B, N).int()
    ctx = torch.randint(1, N * P + 1, (B,), generator=g).int()
    ctx[0], ctx[-1] = N * P, 1
    current = (ctx.long() - 1) // P
    scores = scores.masked_fill(torch.arange(N).view(1, 1, N) >= current.view(B, 1, 1), float("-inf"))
    return [x.to(device) for x in (scores, bt, ctx)]


@interp
@pytest.mark.parametrize("B,G,N,P,n", [(3, 2, 40, 4, 5), (4, 8, 300, 16, 128), (2, 1, 17, 1, 3), (2, 3, 8016, 16, 128)])
def test_select_pages_triton_matches_reference(B, G, N, P, n):
    args = select_case(torch.Generator().manual_seed(N), B, G, N, P, "cpu")
    got, want = psel.select_pages_triton(*args, P, n), psel.select_pages_ref(*args, P, n)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@interp
@pytest.mark.parametrize("kind", ["distinct", "ties_at_threshold", "few_values", "negative", "tiny_gaps",
                                  "wide_range", "constant"])
@pytest.mark.parametrize("packed", [True, False])
def test_select_pages_triton_stops_early_only_when_exact(kind, packed, monkeypatch):
    """The threshold search stops once exactly k keys reach it; every kind of score row gives the
    top k by (score, then page order), whether it stops early (distinct scores) or narrows down to
    one key (a tie across the k-th place), whether the threshold lies within a binade of the row's
    max or many below it (wide_range: magnitudes 1e-30 .. 1e30 of both signs); with the counts and
    slots packed or not (tables of PACKED_MAX_PAGES pages or more)."""
    if not packed:
        monkeypatch.setattr(psel, "PACKED_MAX_PAGES", 0)
    g = torch.Generator().manual_seed(len(kind))
    B, G, N, P, n = 3, 4, 200, 4, 17
    scores, bt, ctx = select_case(g, B, G, N, P, "cpu")
    ctx[:] = N * P - 1 - torch.arange(B, dtype=torch.int32) * 7     # sparse rows
    current = (ctx.long() - 1) // P
    base = {"distinct": torch.randn(B, G, N, generator=g),
            "ties_at_threshold": torch.randint(0, 4, (B, G, N), generator=g).float(),
            "few_values": torch.randint(0, 2, (B, G, N), generator=g).float() * 2.5,
            "negative": -torch.rand(B, G, N, generator=g) - 1e-3,
            "tiny_gaps": 1.0 + torch.randint(0, 64, (B, G, N), generator=g).float() * 2 ** -23,
            "wide_range": torch.randn(B, G, N, generator=g).sign() * 10 ** (torch.rand(B, G, N, generator=g) * 60 - 30),
            "constant": torch.full((B, G, N), -3.5)}[kind]
    scores = base.masked_fill(torch.arange(N).view(1, 1, N) >= current.view(B, 1, 1), float("-inf"))
    table, lengths = psel.select_pages_triton(scores, bt, ctx, P, n)
    for b in range(B):
        for h in range(G):
            cands = sorted(range(int(current[b])), key=lambda i: (-float(scores[b, h, i]), i))[:n - 1]
            want = [int(bt[b, i]) for i in sorted(cands)] + [int(bt[b, current[b]])]
            assert table[b, h].tolist() == want, (kind, b, h)
            assert int(lengths[b, h]) == int(ctx[b]) - (int(current[b]) - (n - 1)) * P


# ---------------------------------------------------------------- GPU

@gpu
@pytest.mark.parametrize("selection", pb.SELECTIONS)
def test_gpu_quest_kernels_match_references_bf16(selection):
    g = torch.Generator().manual_seed(21 + len(selection))
    bf = torch.bfloat16
    for B, N in [(1, 4096), (5, 300), (33, 64)]:
        args = scores_case(g, B, 32, 8, 128, 16, N, bf, "cuda", head_major=B != 5)
        got, want = pb.bound_scores(*args, 16, selection), pb.bound_scores_ref(*args, 16, selection)
        assert torch.equal(got.isinf(), want.isinf())
        torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-3)
    for P in (1, 16, 64):
        args = bounds_case(g, 50, P, 8, 128, bf, "cuda")
        ref = [a.clone() for a in args]
        pb.page_bounds(*args, P)
        pb.page_bounds_ref(*ref, P)
        assert torch.equal(args[2], ref[2]) and torch.equal(args[3], ref[3])
    # 128K tokens of 16-token pages, budget 2048: the benchmark's shape.
    for B, G, N, n in [(4, 8, 8016, 128), (3, 1, 8016, 128), (7, 8, 300, 3)]:
        args = select_case(g, B, G, N, 16, "cuda")
        got, want = psel.select_pages(*args, 16, n), psel.select_pages_ref(*args, 16, n)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@gpu
@pytest.mark.parametrize("selection", pb.SELECTIONS)
def test_gpu_store_inside_the_scoring_launch_equals_rope_store_then_scores_bf16(selection):
    """At Llama-3.1-8B head shapes (the benchmark's 8,016-page tables among them) the store inside
    the scoring launch writes rope_store's bits (same two fmas) and gives bound_scores' scores."""
    g = torch.Generator().manual_seed(5 + len(selection))
    for B, N in [(4, 8016), (5, 300), (33, 64)]:
        args = store_case(g, B, 32, 8, 128, 16, N, torch.bfloat16, "cuda")
        fused = run_store(qk.store_and_score_triton, args, 16, selection)
        two = run_store(unfused, args, 16, selection)
        for name, a, b in zip(["scores", "q", "k", "k_cache", "v_cache", "kmin", "kmax"], fused, two):
            assert torch.equal(a, b), (B, N, name)


@gpu
def test_gpu_quest_fused_store_gives_the_separate_stores_tokens_under_graphs(tiny_model, monkeypatch):
    from sparsevllm.engine.cache_manager import quest as quest_cm
    path = tiny_model("llama")
    knobs = dict(vllm_sparse_method="quest", device="cuda", dtype="float32", max_num_seqs=8, page_size=4,
                 quest_token_budget=24, quest_skip_layers=1)
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ps = prompts([40 + 23 * i for i in range(5)], seed=9)
    outs = {}
    for fused in (False, True):
        monkeypatch.setattr(quest_cm, "FUSED_STORE", fused)
        llm = LLM(path, **knobs)
        assert llm.execution_mode == "cuda_graph"
        outs[fused] = token_ids(llm.generate(ps, sp, use_tqdm=False))
        assert llm.engine.cache_manager.allocator.is_idle()
    assert outs[True] == outs[False]


@gpu
@pytest.mark.parametrize("selection", pb.SELECTIONS)
def test_gpu_quest_graph_replay_equals_eager(tiny_model, selection):
    path = tiny_model("llama")
    knobs = dict(vllm_sparse_method="quest", device="cuda", dtype="float32", max_num_seqs=8, page_size=4,
                 quest_token_budget=24, quest_skip_layers=1, quest_selection=selection)
    eager = LLM(path, enforce_eager=True, **knobs)
    graph = LLM(path, **knobs)
    assert graph.execution_mode == "cuda_graph"
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    cases = [prompts([40 + 23 * i for i in range(n)], seed=n) for n in (1, 3, 8)]
    cases.append(prompts([6, 11, 3], seed=9))   # within the budget at first: the "dense" graph, then the general one
    for ps in cases:
        assert token_ids(eager.generate(ps, sp, use_tqdm=False)) == token_ids(graph.generate(ps, sp, use_tqdm=False))
    assert set(graph.engine.model_runner.graphs.graphs) >= {(4, "dense"), (4, "")}
    assert graph.engine.cache_manager.allocator.is_idle()


@pytest.mark.parametrize("fused_store", [False, True])
def test_quest_store_in_the_qkv_epilogue_gives_the_separate_stores_tokens(tiny_model, monkeypatch, fused_store):
    """Decode steps whose qkv GEMM rotates and writes K/V itself (CacheManager.store_target): the
    dense layer writes the pool, the sparse layers also fold each key into its page's bounds (or,
    with the store inside the scoring launch, leave the layer to it). Forced through the
    interpreter for decode-sized steps: the tokens of rope_store's separate launch."""
    from sparsevllm.engine.cache_manager import quest as quest_cm
    from sparsevllm.kernels import skinny_gemm
    from sparsevllm.layers import attention, parallel_linear
    decode_sized = lambda x, w: x.numel() <= skinny_gemm.MAX_ROWS * w.shape[1]   # noqa: E731
    monkeypatch.setattr(skinny_gemm, "takes", decode_sized)
    monkeypatch.setattr(parallel_linear, "takes", decode_sized)
    monkeypatch.setattr(skinny_gemm, "num_sms", lambda device: 3)
    monkeypatch.setattr(quest_cm, "FUSED_STORE", fused_store)
    targets = []
    store_target = quest_cm.QuestCacheManager.store_target
    monkeypatch.setattr(quest_cm.QuestCacheManager, "store_target",
                        lambda self, i, step: targets.append(store_target(self, i, step)) or targets[-1])
    path = tiny_model("llama")
    ps = prompts([40 + 23 * i for i in range(4)], seed=5)
    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outs = {}
    for epilogue in (False, True):
        monkeypatch.setattr(attention, "FUSED_ROPE_STORE", epilogue)
        llm = LLM(path, vllm_sparse_method="quest", page_size=4, quest_token_budget=12, quest_skip_layers=1)
        outs[epilogue] = token_ids(llm.generate(ps, sp, use_tqdm=False))
        assert llm.engine.cache_manager.allocator.is_idle()
    assert outs[True] == outs[False]
    bounds = [t for t in targets if t is not None and t.page_min is not None]
    assert any(t is not None and t.page_min is None for t in targets)      # the dense layer 0
    assert bool(bounds) != fused_store                                 # sparse layers: bounds, or the scoring launch


def test_quest_last_prompt_token_alone_in_its_chunk_is_prefilled_densely(tiny_model):
    """Prefill is dense: a prompt whose last chunk holds one token (97 = 3 x 32 + 1) must give the
    tokens of one-shot prefill, and the samples of n = 3 (the others prefill that token after
    prefix-cache hits) the same tokens. The last prompt token used to run as a decode step (sparse
    view) when it was alone in its chunk, so the first output token depended on the chunking."""
    path = tiny_model("llama", num_hidden_layers=4)
    ps = prompts([97], seed=1)
    knobs = dict(page_size=4, quest_token_budget=16, quest_skip_layers=1)
    want = token_ids(quest(path, chunk_prefill_size=128, **knobs).generate(ps, GREEDY, use_tqdm=False))
    llm = quest(path, chunk_prefill_size=32, **knobs)
    assert token_ids(llm.generate(ps, GREEDY, use_tqdm=False)) == want
    n3 = SamplingParams(temperature=0.0, max_tokens=GREEDY.max_tokens, ignore_eos=True, n=3)
    llm = quest(path, chunk_prefill_size=32, **knobs)
    assert [c.token_ids for c in llm.generate(ps, n3, use_tqdm=False)[0].outputs] == want * 3

"""SnapKV: scores and selection against a naive oracle of the official formula, physical eviction
(pages, positions, prefix cache, preemption), chunked prefill and batching, and the memory it frees.

The position test is the one that proves logical length and cache length stay apart: after
eviction, decode logits must equal Hugging Face attention over exactly the kept K/V with the new
token at its logical RoPE position, and differ from the same with the cache length as position.
"""
import math
import os
import warnings

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from helpers import CUDA, gpu  # noqa: E402
from method_knobs import METHOD_KNOBS  # noqa: E402
from sparsevllm import LLM, SamplingParams  # noqa: E402
from sparsevllm.method_registry import make_config  # noqa: E402
from sparsevllm.kernels import snapkv as sk  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
# Pages of 16 and a capacity of 4 of them: prompts of 150 tokens are 10 pages raw, 4 after compaction.
P, C = 16, 64
KNOBS = dict(METHOD_KNOBS["snapkv"], page_size=P, snapkv_capacity=C)
W = KNOBS["snapkv_window_size"]


def prompts(n=3, base=150, step=23):
    return [[(7 * i + 13 * j) % 250 + 3 for j in range(base + step * i)] for i in range(n)]


def run(llm, ps, sp=GREEDY):
    outs = llm.generate(ps, sp, use_tqdm=False)
    assert llm.engine.cache_manager.allocator.is_idle()
    return [o.outputs[0].token_ids for o in outs]


def spy_chunks(cm):
    """Record (seq, start, n) for every chunk_size answer of the cache manager."""
    calls, chunk_size = [], cm.chunk_size

    def spy(seq, max_tokens):
        n = chunk_size(seq, max_tokens)
        calls.append((seq, seq.num_computed_tokens, n))
        return n
    cm.chunk_size = spy
    return calls


def spy_kept(cm):
    """Record the [layers, H_kv, C] kept positions of every compaction."""
    kept, compact = [], cm._compact

    def spy(seq, positions):
        kept.append(positions.cpu().clone())
        compact(seq, positions)
    cm._compact = spy
    return kept


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def reference(model):
    """SnapKV outputs with one-shot prefill, one request at a time, a roomy pool, no prefix cache."""
    llm = LLM(model, "snapkv", enable_prefix_caching=False, **KNOBS)
    return [run(llm, [p])[0] for p in prompts()]


# ---- knobs ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("knobs, name", [
    (dict(snapkv_capacity=32, snapkv_window_size=32), "snapkv_capacity"),
    (dict(snapkv_window_size=0), "snapkv_window_size"),
    (dict(snapkv_kernel_size=4), "snapkv_kernel_size"),
    (dict(snapkv_kernel_size=0), "snapkv_kernel_size"),
    (dict(snapkv_pooling="maxpool"), "snapkv_pooling"),
    (dict(chunk_prefill_size=16), "chunk_prefill_size"),          # smaller than the default window 32
    (dict(max_num_batched_tokens=31), "max_num_batched_tokens"),
])
def test_bad_knobs_raise_naming_the_knob(knobs, name):
    with pytest.raises(ValueError, match=name):
        make_config(None, "snapkv", **knobs)


def test_defaults_and_knob_ownership():
    mc = make_config(None, "snapkv").method_config
    assert (mc.snapkv_capacity, mc.snapkv_window_size, mc.snapkv_kernel_size, mc.snapkv_pooling) == (2048, 32, 7, "max")
    with pytest.raises(ValueError, match="belongs to method 'snapkv'"):
        make_config(None, "vanilla", snapkv_capacity=128)


# ---- scores and selection ---------------------------------------------------------------------------
def paged_case(g, w, Hq, Hkv, D, page_size, L, dtype=torch.float32, device="cpu"):
    """Random keys of one request scattered over a shuffled pool, and its window queries."""
    n = -(-L // page_size)
    num_pages = n + 4
    k_cache = torch.randn(num_pages * page_size, Hkv, D, generator=g).to(device, dtype)
    table = torch.randperm(num_pages, generator=g)[:n].int().to(device)
    q = torch.randn(w, Hq, D, generator=g).to(device, dtype)
    pos = torch.arange(L)
    keys = k_cache.cpu()[table.cpu()[pos // page_size].long() * page_size + pos % page_size]  # [L, H_kv, D]
    return q, k_cache, table, keys


def oracle_kept(q, keys, capacity, kernel, pooling):
    """The official formula written out plainly in float64, per query head, then averaged per group:
    softmax of the window rows over all keys (causal in the window), summed over the window, pooled
    position by position (max: padding never wins; avg: zero padding counted), top C - w, + window."""
    w, Hq, D = q.shape
    L, Hkv = keys.shape[0], keys.shape[1]
    group = Hq // Hkv
    summed = torch.zeros(Hq, L, dtype=torch.float64)
    for h in range(Hq):
        kh = keys[:, h // group].double()
        for i in range(w):
            qpos = L - w + i
            logits = kh[:qpos + 1] @ q[i, h].double() / math.sqrt(D)
            summed[h, :qpos + 1] += torch.softmax(logits, dim=0)
    scores = summed.view(Hkv, group, L).mean(1)[:, :L - w]
    pad = kernel // 2
    pooled = torch.empty_like(scores)
    for j in range(L - w):
        lo, hi = max(0, j - pad), min(L - w, j + pad + 1)
        pooled[:, j] = scores[:, lo:hi].amax(1) if pooling == "max" else scores[:, lo:hi].sum(1) / kernel
    # Ties (max-pooling plateaus) go to the earlier position.
    return pooled, pooled.sort(dim=1, descending=True, stable=True).indices[:, :capacity - w]


@pytest.mark.parametrize("pooling", ["max", "avg"])
@pytest.mark.parametrize("shape", [(8, 4, 2, 16, 16, 120, 40), (5, 6, 3, 8, 1, 61, 20), (4, 2, 2, 16, 4, 33, 12)])
def test_kept_set_equals_naive_oracle(shape, pooling):
    w, Hq, Hkv, D, page_size, L, capacity = shape
    g = torch.Generator().manual_seed(sum(shape))
    q, k_cache, table, keys = paged_case(g, w, Hq, Hkv, D, page_size, L)
    scores = sk.window_scores(q, k_cache, table, L, page_size, D ** -0.5)
    kept = sk.select_kept(scores, w, capacity, 7, pooling)
    pooled, top = oracle_kept(q, keys, capacity, 7, pooling)
    assert kept.shape == (Hkv, capacity)
    assert torch.equal(kept[:, -w:], torch.arange(L - w, L).expand(Hkv, w)), "the window is always kept"
    assert (kept.diff(dim=1) > 0).all(), "kept positions ascend without repeats"
    for h in range(Hkv):
        assert set(kept[h, :-w].tolist()) == set(top[h].tolist())


def test_ties_at_the_cut_go_to_earlier_positions():
    # Max pooling (k = 3) turns the two peaks into plateaus 0..2 and 5..7 of equal score; keeping
    # 4 prefix positions cuts into the second plateau, which keeps its earliest position.
    scores = torch.tensor([[0.0, 5.0, 0.0, 0.0, 0.0, 0.0, 5.0, 0.0, 0.0, 0.0, 1.0, 1.0]])
    kept = sk.select_kept(scores, 2, 6, 3, "max")
    assert kept.tolist() == [[0, 1, 2, 5, 10, 11]]


@pytest.mark.skipif(CUDA, reason="interpreter tests run on CPU-only machines")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(8, 4, 2, 16, 16, 150), (5, 6, 3, 24, 1, 37), (32, 8, 2, 64, 16, 200),
                                   (3, 2, 2, 16, 4, 3)])
def test_window_scores_triton_matches_reference(shape, dtype):
    w, Hq, Hkv, D, page_size, L = shape
    g = torch.Generator().manual_seed(L)
    q, k_cache, table, _ = paged_case(g, w, Hq, Hkv, D, page_size, L, dtype)
    ref = sk.window_scores_ref(q, k_cache, table, L, page_size, D ** -0.5)
    out = sk.window_scores_triton(q, k_cache, table, L, page_size, D ** -0.5)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out.sum(1), torch.full((Hkv,), float(w)))  # every row's softmax sums to 1


# ---- the engine ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("bs", [1, 3])
def test_prompts_within_capacity_equal_vanilla(model, bs):
    ps = prompts(bs, base=40, step=9)                 # 40..58 tokens <= C = 64
    vanilla = run(LLM(model, page_size=P), ps)
    llm = LLM(model, "snapkv", **KNOBS)
    assert run(llm, ps) == vanilla
    assert llm.memory_accounting()["compactions"] == 0


def test_decode_after_eviction_uses_logical_positions(model):
    """Oracle: HF transformers with its cache cut to exactly the kept tokens of each layer and KV head."""
    import transformers
    prompt, cont = prompts(1, base=131)[0], [5, 77, 200]
    llm = LLM(model, "snapkv", **KNOBS)
    cm = llm.engine.cache_manager
    captured = spy_kept(cm)
    ours = llm.teacher_forced_logprobs([prompt], [cont], use_tqdm=False)[0]
    kept = captured[0]                                              # [layers, H_kv, C]
    assert kept.shape[-1] == C and cm.allocator.is_idle()

    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    L = len(prompt)

    def hf_logprobs(position_of):
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = hf(torch.tensor([prompt]), use_cache=True)
            rows = [out.logits[0, -1]]
            cache = out.past_key_values
            for layer, idx in zip(cache.layers, kept):
                gather = idx[None, :, :, None].expand(1, -1, -1, layer.keys.shape[-1])
                layer.keys, layer.values = layer.keys.gather(2, gather), layer.values.gather(2, gather)
            for t, token in enumerate(cont[:-1]):
                out = hf(torch.tensor([[token]]), past_key_values=cache,
                         position_ids=torch.tensor([[position_of(t)]]), cache_position=torch.tensor([C + t]),
                         attention_mask=torch.ones(1, C + t + 1, dtype=torch.long))
                rows.append(out.logits[0, -1])
        return torch.log_softmax(torch.stack(rows).float(), dim=-1)

    logical = hf_logprobs(lambda t: L + t)
    torch.testing.assert_close(ours, logical, atol=1e-4, rtol=1e-4)
    by_cache_len = hf_logprobs(lambda t: C + t)
    assert (ours[1:] - by_cache_len[1:]).abs().max() > 1e-2, "the model must be position-sensitive"


def test_pages_and_counters_after_compaction(model):
    prompt = prompts(1, base=150)[0]
    llm = LLM(model, "snapkv", enable_prefix_caching=False, **KNOBS)
    eng, cm = llm.engine, llm.engine.cache_manager
    seq = eng.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    eng.step()                                                       # the whole prompt in one chunk
    assert (seq.num_computed_tokens, seq.cache_len) == (150, C)      # logical length vs cache length
    acc = cm.memory_accounting()
    assert acc["used_pages"] == -(-C // P) and len(cm.tables[seq.seq_id]) == -(-C // P)
    assert acc["kv_used_bytes"] == acc["used_pages"] * acc["kv_page_bytes"]
    assert acc["evicted_tokens"] == 150 - C and acc["evicted_bytes"] == (150 - C) * acc["kv_page_bytes"] // P
    for t in range(1, 20):
        eng.step()
        assert (seq.num_computed_tokens, seq.cache_len) == (150 + t, C + t)
        assert cm.memory_accounting()["used_pages"] == -(-(C + t) // P)
    eng.run([seq], use_tqdm=False)
    assert cm.allocator.is_idle() and cm.memory_accounting()["evicted_tokens"] == 0


@pytest.mark.parametrize("chunk", [16, 40, 56, 64, 4096])
def test_chunked_prefill_equals_one_shot_and_keeps_the_window_whole(model, reference, chunk):
    llm = LLM(model, "snapkv", chunk_prefill_size=chunk, max_num_batched_tokens=max(chunk, 64),
              enable_prefix_caching=False, **KNOBS)
    cm = llm.engine.cache_manager
    chunks = spy_chunks(cm)
    assert run(llm, prompts()) == reference
    for seq, start, n in chunks:
        end = seq.num_prompt_tokens
        assert not (end - W < start + n < end), f"chunk [{start}, {start + n}) splits the window ({end} tokens)"
    assert cm.num_compactions == 3


def test_batch_equals_one_at_a_time(model, reference):
    llm = LLM(model, "snapkv", max_num_seqs=3, **KNOBS)
    assert run(llm, prompts()) == reference
    assert run(llm, list(reversed(prompts()))) == list(reversed(reference))


def test_prefix_cache_reuses_raw_prompt_pages_but_never_names_compacted_ones(model, reference):
    llm = LLM(model, "snapkv", **KNOBS)
    eng, cm = llm.engine, llm.engine.cache_manager
    p = prompts(1)[0]                                                  # 150 tokens, window [142, 150)
    assert run(llm, [p]) == reference[:1]
    seq = eng.add_request(p, GREEDY)
    batch = eng.scheduler._schedule_prefill()
    assert seq.num_computed_tokens == (150 - W) // P * P == 128, "hits stop before the window"
    assert batch.num_tokens == [150 - 128]
    step = eng.model_runner.prepare_step(batch.seqs, batch.num_tokens, True)
    eng.model_runner.forward(step)
    cm.on_step_end(step)
    for s, n in zip(batch.seqs, batch.num_tokens):
        cm.commit(s, n)
    assert (seq.num_computed_tokens, seq.cache_len) == (150, C)
    assert all(cm.allocator.hash_of[page] == -1 for page in cm.tables[seq.seq_id])
    eng.scheduler.preempt(seq)                                          # undo the manual step
    eng.run([seq], use_tqdm=False)
    assert seq.completion_token_ids == reference[0]


@pytest.fixture(scope="module")
def equal_prompts(model):
    """Three 150-token prompts (10 pages raw, 4 after compaction to C = 64) and their SnapKV
    outputs for 60 tokens in a roomy pool."""
    ps = prompts(3, base=150, step=0)
    llm = LLM(model, "snapkv", enable_prefix_caching=False, **KNOBS)
    return ps, run(llm, ps, SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))


def test_batch_that_does_not_fit_vanilla_runs_at_once_under_snapkv(model, equal_prompts):
    # 19 pages of 16 tokens: two raw prompts (2 x 10 pages) never fit together; under SnapKV each
    # shrinks to 4 pages after its prefill step, so the next one is admitted and all three decode at once.
    ps, expected = equal_prompts

    def peak_decoding(llm):
        eng = llm.engine
        seqs = [eng.add_request(p, GREEDY) for p in ps]
        peak = 0
        while eng.scheduler.has_work():
            eng.step()
            peak = max(peak, sum(not s.in_prefill for s in eng.scheduler.running))
        assert eng.cache_manager.allocator.is_idle()
        return peak, [s.completion_token_ids for s in seqs]

    vanilla_peak, _ = peak_decoding(LLM(model, num_kv_pages=19, enable_prefix_caching=False, page_size=P))
    snap = LLM(model, "snapkv", num_kv_pages=19, enable_prefix_caching=False, **KNOBS)
    snap_peak, outs = peak_decoding(snap)
    assert (vanilla_peak, snap_peak) == (1, 3)
    assert outs == [o[:GREEDY.max_tokens] for o in expected]
    assert snap.engine.scheduler.num_preemptions == 0


def test_preemption_recomputes_a_compacted_request_to_the_same_output(model, equal_prompts):
    # 14 pages: two compacted requests decoding 60 tokens grow to 8 pages each, so one is preempted.
    # It is recomputed from prompt + generated tokens: the chunk ending at the prompt's end compacts
    # again, then the generated tokens are prefilled over the compacted cache.
    ps, expected = equal_prompts
    sp = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    for prefix_caching in (False, True):
        llm = LLM(model, "snapkv", num_kv_pages=14, enable_prefix_caching=prefix_caching, **KNOBS)
        assert run(llm, ps, sp) == expected
        assert llm.engine.scheduler.num_preemptions > 0


def test_recompute_whose_prompt_hits_a_live_requests_pages_waits_for_room_to_compact(model):
    # A 100-token prompt (compacted to C = 64) beside a live request whose prompt is its first 64
    # tokens (not compacted): when it is preempted and recomputed, its first 4 pages are prefix hits
    # that request holds. Admission counted them as held, but compaction copies the kept tokens
    # into pages of its own: with 10 pages there was then no page for its generated tokens, so it
    # was preempted and admitted again in every step, and the other request never decoded again.
    x = prompts(1, base=100)[0]
    ps = [x[:C], x]
    sp = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (60, 40)]
    expected = run(LLM(model, "snapkv", enable_prefix_caching=False, **KNOBS), ps, sp)
    llm = LLM(model, "snapkv", num_kv_pages=10, **KNOBS)
    eng = llm.engine
    seqs = [eng.add_request(p, s) for p, s in zip(ps, sp)]
    for _ in range(200):   # 100 tokens to decode, the recompute's prefill steps and the waits
        if not eng.has_work():
            break
        eng.step()
    assert not eng.has_work(), "a request was preempted and admitted again without end"
    assert [s.completion_token_ids for s in seqs] == expected
    assert eng.scheduler.num_preemptions > 0 and eng.cache_manager.allocator.is_idle()


def test_a_prompt_admitted_after_a_compacting_chunk_leaves_the_compaction_its_pages(model):
    # A 100-token prompt whose first 4 pages are hits held by a live request (prompt: its first 64
    # tokens) owns 3 pages, and its compaction needs 4 fresh ones. In the step of its last chunk a
    # 47-token prompt was admitted after it and took the 3 pages left of 10: there was then no page
    # to compact into, and the request silently kept its whole prompt (its tokens not SnapKV's).
    x = prompts(1, base=100)[0]
    ps = [x[:C], x, prompts(2, base=47, step=0)[1]]
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    expected = run(LLM(model, "snapkv", enable_prefix_caching=False, **KNOBS), ps, sp)
    llm = LLM(model, "snapkv", num_kv_pages=10, **KNOBS)
    eng = llm.engine
    seqs = [eng.add_request(ps[0], sp)]
    eng.step()                                    # its pages are named: the long prompt hits them
    seqs += [eng.add_request(p, sp) for p in ps[1:]]
    eng.run(seqs, use_tqdm=False)
    assert [s.completion_token_ids for s in seqs] == expected
    assert llm.memory_accounting()["compactions"] == 1 and eng.cache_manager.allocator.is_idle()


def test_window_that_does_not_fit_the_token_budget_waits_without_deadlock(model):
    # Found by simulating the scheduler: with 15-token chunks and a 20-token step budget, a request
    # reaches its window when only 5 tokens of budget are left; chunk_size gives it 0 that step.
    ps = [[(7 * i + 13 * j) % 250 + 3 for j in range(L)] for i, L in enumerate([366, 93, 286, 375])]
    expected = run(LLM(model, "snapkv", enable_prefix_caching=False, **KNOBS), ps)
    llm = LLM(model, "snapkv", chunk_prefill_size=15, max_num_batched_tokens=20, enable_prefix_caching=False,
              **KNOBS)
    cm = llm.engine.cache_manager
    chunks = spy_chunks(cm)
    assert run(llm, ps) == expected
    assert any(n == 0 for _, _, n in chunks) and cm.num_compactions >= 3


# ---- GPU ------------------------------------------------------------------------------------------------
@gpu
@pytest.mark.parametrize("L", [1000, 33000])
def test_window_scores_bf16_on_gpu_matches_reference_without_quadratic_memory(L):
    g = torch.Generator().manual_seed(0)
    w, Hq, Hkv, D, page_size = 32, 32, 8, 128, 16
    q, k_cache, table, _ = paged_case(g, w, Hq, Hkv, D, page_size, L, torch.bfloat16, "cuda")
    ref = sk.window_scores_ref(q, k_cache, table, L, page_size, D ** -0.5)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = sk.window_scores(q, k_cache, table, L, page_size, D ** -0.5)
    torch.cuda.synchronize()
    # Per-block row stats and the output take ~24 bytes per (KV head, key); fp32 logits of the
    # window alone ([H_q, w, L]) would take 512.
    assert torch.cuda.max_memory_allocated() - before < 64 * L * Hkv + (1 << 22)
    torch.testing.assert_close(out, ref, atol=2e-3, rtol=3e-2)
    kept, kept_ref = (sk.select_kept(s, w, 512, 7, "max") for s in (out, ref))
    overlap = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(kept, kept_ref)) / kept.numel()
    assert overlap > 0.95


@gpu
def test_snapkv_graph_equals_eager_on_gpu(model):
    ps = prompts(5, base=120, step=31)
    eager = LLM(model, "snapkv", device="cuda", dtype="float32", enforce_eager=True, max_num_seqs=8, **KNOBS)
    graph = LLM(model, "snapkv", device="cuda", dtype="float32", max_num_seqs=8, **KNOBS)
    assert graph.execution_mode == "cuda_graph"
    assert run(graph, ps) == run(eager, ps)
    cont = [5, 9, 200, 17, 3, 88]
    a = eager.teacher_forced_logprobs(ps, [cont] * 5, use_tqdm=False)
    b = graph.teacher_forced_logprobs(ps, [cont] * 5, use_tqdm=False)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4)
    cpu = LLM(model, "snapkv", device="cpu", **KNOBS)
    assert run(cpu, ps) == run(graph, ps)
    bf16 = LLM(model, "snapkv", device="cuda", max_num_seqs=8, **KNOBS)
    run(bf16, ps)  # bf16 with graphs runs and leaves the allocator idle


def test_window_of_one_query_compacts_after_chunked_prefill(model):
    """w = 1: the chunk before the window leaves exactly one prompt token, which must still run as
    prefill (the compacting chunk); it used to run as a decode step, so nothing was ever evicted."""
    knobs = dict(page_size=P, snapkv_capacity=C, snapkv_window_size=1)
    ps = prompts(1, base=129)                         # 2 x 64 + 1
    want = run(LLM(model, "snapkv", enable_prefix_caching=False, **knobs), ps)
    llm = LLM(model, "snapkv", chunk_prefill_size=64, enable_prefix_caching=False, **knobs)
    assert run(llm, ps) == want
    assert llm.memory_accounting()["compactions"] == 1

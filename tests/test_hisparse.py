"""hisparse: the same tokens as quest with the same page-set policy at contexts several times the
hot buffer (only placement differs); the hot buffer's hits, misses and LRU evictions against a naive
Python oracle; every buffered page equals its host copy (so nothing is evicted before it is backed
up); the causal invariant on every view; allocators back to their initial state; short requests
never touch the host; preemption; bad knobs and requests that can never fit; the Triton kernels
against their references (interpreter on CPU, bf16 and graph replay on the GPU).
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from helpers import CUDA, gpu, prompts, token_ids  # noqa: E402
from method_knobs import METHOD_KNOBS  # noqa: E402
from sparsevllm import LLM, SamplingParams  # noqa: E402
from sparsevllm.engine.cache_manager import hisparse as hs  # noqa: E402
from sparsevllm.kernels import hisparse as hk  # noqa: E402
from sparsevllm.method_registry import make_config  # noqa: E402

P = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
# The table's 16-token budget in pages of 4: 4 top-k pages + 2 recent + current = a 7-page view; a
# 10-page hot buffer; prompts of 40-90 pages.
KNOBS = dict(METHOD_KNOBS["hisparse"], page_size=P, chunk_prefill_size=64)


interp = pytest.mark.skipif(CUDA, reason="interpreter tests run on CPU-only machines")


def hisparse(path, **knobs):
    return LLM(path, vllm_sparse_method="hisparse", device="cpu", **{**KNOBS, **knobs})


def assert_idle(cm):
    assert cm.allocator.is_idle() and cm.host.is_idle()
    assert sorted(cm.free_rows) == list(range(cm.dummy_row)) and not cm.row_of and not cm.decoding
    assert not cm.prefilling
    assert (cm.buf_key == -1).all() and not cm.offloaded.any()


# ---------------------------------------------------------------- oracles

def lru_oracle(want, nv, keys, last, phys, clock, current):
    """One request's buffer step, written the obvious way: hits keep their entry, each miss takes
    the least recently used entry no wanted page holds (ties: lowest entry)."""
    keys, last = list(keys), list(last)
    wanted = list(want[:nv - 1])
    held = {e for e, key in enumerate(keys) if key in wanted}
    table, src = [], []
    for w in wanted:
        if w in keys:
            e = keys.index(w)
            table.append(phys[e])
            src.append(-1)
        else:
            e = min((e for e in range(len(keys)) if e not in held), key=lambda e: (last[e], e))
            held.add(e)
            keys[e] = w
            table.append(phys[e])
            src.append(w)
        last[e] = clock
    table.append(current)
    src.append(-1)
    return table, src, keys, last


def checked(llm, log):
    """Wrap the swap plan: compare every active row with the LRU oracle and check the causal
    invariant of the view it serves; after every step, check buffered pages equal their host copies."""
    cm = llm.engine.cache_manager
    plan = hs.swap_plan

    def spy(want, lengths, rows, active, current, clock, buf_key, buf_last, buf_phys, page_size):
        before = buf_key.clone(), buf_last.clone()
        table, src = plan(want, lengths, rows, active, current, clock, buf_key, buf_last, buf_phys, page_size)
        for b in torch.nonzero(active).flatten().tolist():
            r = int(rows[b])
            nv = -(-int(lengths[b]) // P)
            t, s, keys, last = lru_oracle(want[b].tolist(), nv, before[0][r].tolist(), before[1][r].tolist(),
                                          buf_phys[r].tolist(), int(clock[b]), int(current[b]))
            assert table[b, :nv].tolist() == t and src[b, :nv].tolist() == s
            assert buf_key[r].tolist() == keys and buf_last[r].tolist() == last
            log["hits"] += sum(x < 0 for x in s[:-1])
            log["misses"] += sum(x >= 0 for x in s)
            # Causal: full pages strictly before the current one, each once; the current page last,
            # read up to the query position only.
            sid = next(k for k, v in cm.row_of.items() if v == r)
            host_pages = cm.host_pages_of[sid].tolist()
            logical = [host_pages.index(w) for w in want[b, :nv].tolist()]
            cur_len = int(log["lens"][b])
            assert logical[-1] == (cur_len - 1) // P
            assert sorted(set(logical[:-1])) == logical[:-1] and all(x < logical[-1] for x in logical[:-1])
            assert int(lengths[b]) == (nv - 1) * P + cur_len - logical[-1] * P
            log["views"] += 1
        return table, src

    build = cm.build_decode_view

    def view(layer_id, q, step):
        log["lens"] = step.cache_lens.tolist()
        return build(layer_id, q, step)

    end = cm.on_step_end

    def backed_up(step):
        end(step)
        for sid, row in cm.row_of.items():
            if sid not in cm.decoding:
                continue
            hp = cm.host_pages_of[sid]
            for layer in range(cm.num_layers):
                dev_k, dev_v = cm.pool.layer(layer)
                host_k, host_v = cm.host.layer(layer)
                for key, phys in zip(cm.buf_key[layer, row].tolist(), cm.buf_phys[row].tolist()):
                    if key >= 0:
                        assert torch.equal(dev_k[phys * P:(phys + 1) * P], host_k[key * P:(key + 1) * P])
                        assert torch.equal(dev_v[phys * P:(phys + 1) * P], host_v[key * P:(key + 1) * P])
                        log["checked_pages"] += 1
                assert len(hp) > 0
    hs.swap_plan = spy
    cm.build_decode_view = view
    cm.on_step_end = backed_up
    return plan


# ---------------------------------------------------------------- engine (CPU)

def test_hisparse_equals_quest_with_the_same_page_policy(tiny_model):
    path = tiny_model("llama", max_position_embeddings=2048)
    ps = prompts([300, 170, 230], seed=3)
    # Quest with one page set for all heads, no recent pages, every layer sparse: its budget counts
    # the current page, HiSparse's top-k does not.
    quest = LLM(path, vllm_sparse_method="quest", device="cpu", page_size=P, quest_token_budget=5 * P,
                quest_skip_layers=0, quest_selection="shared", chunk_prefill_size=64, enable_prefix_caching=False)
    want = token_ids(quest.generate(ps, GREEDY, use_tqdm=False))
    llm = hisparse(path, hisparse_recent_pages=0, hisparse_device_pages=6)
    assert token_ids(llm.generate(ps[:1], GREEDY, use_tqdm=False)) == want[:1]       # bs 1
    assert token_ids(llm.generate(ps, GREEDY, use_tqdm=False)) == want               # bs 3
    acc = llm.engine.cache_manager.memory_accounting()
    assert acc["swapped_in_pages"] > 0 and 0 < acc["hit_rate"] < 1 and acc["pcie_bytes_per_decode_step"] > 0
    assert acc["host_pool_bytes"] > 0 and acc["host_used_bytes"] == 0
    assert_idle(llm.engine.cache_manager)


def test_hisparse_buffer_matches_lru_oracle_and_host_copies(tiny_model):
    path = tiny_model("llama", max_position_embeddings=2048)
    llm = hisparse(path)
    log = dict(hits=0, misses=0, views=0, checked_pages=0, lens=[])
    plan = checked(llm, log)
    try:
        ps = prompts([260, 150, 90, 333], seed=5)
        outs = token_ids(llm.generate(ps, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
                                      use_tqdm=False))
    finally:
        hs.swap_plan = plan
    assert all(len(o) == 30 for o in outs)
    assert log["views"] > 0 and log["hits"] > 0 and log["misses"] > 0 and log["checked_pages"] > 0
    assert_idle(llm.engine.cache_manager)


def test_hisparse_short_requests_stay_dense_and_never_touch_the_host(tiny_model):
    path = tiny_model("llama", max_position_embeddings=2048)
    ps = prompts([30, 12, 200], seed=7)   # 30 + 12 tokens fit the buffer; 200 is under min_prompt_len
    want = token_ids(LLM(path, device="cpu").generate(ps, GREEDY, use_tqdm=False))
    llm = hisparse(path, hisparse_min_prompt_len=256)
    assert token_ids(llm.generate(ps, GREEDY, use_tqdm=False)) == want
    cm = llm.engine.cache_manager
    assert not cm.host.k.any() and not cm.host.v.any()        # nothing was ever written to host
    assert cm.swap_stats.tolist() == [0, 0] and cm.memory_accounting()["hit_rate"] is None
    assert_idle(cm)


def test_hisparse_mixed_batch_of_dense_and_offloaded_requests(tiny_model):
    path = tiny_model("llama", max_position_embeddings=2048)
    ps = prompts([300, 20, 120], seed=9)
    llm = hisparse(path)
    alone = [token_ids(llm.generate([p], GREEDY, use_tqdm=False))[0] for p in ps]
    assert token_ids(llm.generate(ps, GREEDY, use_tqdm=False)) == alone
    assert_idle(llm.engine.cache_manager)


def test_hisparse_preemption_recomputes_and_frees(tiny_model):
    path = tiny_model("llama", max_position_embeddings=2048)
    ps = prompts([200, 40, 40], seed=11)
    sp = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (20, 200, 200)]
    roomy = token_ids(hisparse(path, hisparse_min_prompt_len=100).generate(ps, sp, use_tqdm=False))
    # 75 device pages: the 200-token prompt (51 pages + 10 hot) prefills next to two dense requests
    # that then grow to 60 pages each: someone is preempted.
    tight = hisparse(path, hisparse_min_prompt_len=100, num_kv_pages=75)
    assert token_ids(tight.generate(ps, sp, use_tqdm=False)) == roomy
    assert tight.engine.scheduler.num_preemptions > 0
    assert_idle(tight.engine.cache_manager)


def decode_batches(llm):
    runner, sizes = llm.engine.model_runner, []
    prepare = runner.prepare_step

    def spy(seqs, num_tokens, is_prefill, *feed):
        if not is_prefill:
            sizes.append(len(seqs))
        return prepare(seqs, num_tokens, is_prefill, *feed)
    runner.prepare_step = spy
    return sizes


def test_hisparse_decodes_more_long_requests_together_than_the_pool_holds(tiny_model):
    path = tiny_model("llama", max_position_embeddings=2048)
    ps = prompts([200] * 4, seed=19)
    # 90 pages of 4 tokens: one 224-token request (56 pages) at a time for vanilla; HiSparse holds
    # 10 hot pages per decoding request and the whole prompt only while it prefills.
    vanilla = LLM(path, device="cpu", page_size=P, num_kv_pages=90, chunk_prefill_size=64)
    v_sizes = decode_batches(vanilla)
    vanilla.generate(ps, GREEDY, use_tqdm=False)
    want = token_ids(hisparse(path).generate(ps, GREEDY, use_tqdm=False))
    llm = hisparse(path, num_kv_pages=90)
    h_sizes = decode_batches(llm)
    assert token_ids(llm.generate(ps, GREEDY, use_tqdm=False)) == want
    assert max(v_sizes) == 1 and max(h_sizes) >= 3
    assert_idle(llm.engine.cache_manager)


def test_hisparse_request_that_never_fits_the_host_fails_alone(tiny_model):
    path = tiny_model("llama", max_position_embeddings=4096)
    llm = hisparse(path, hisparse_host_memory_gb=0.0005)    # a few dozen host pages
    cm = llm.engine.cache_manager
    ok, big = prompts([100, 100], seed=2)
    outs = llm.generate([ok, big], [GREEDY, SamplingParams(temperature=0.0, max_tokens=3000, ignore_eos=True)],
                        use_tqdm=False)
    assert len(outs[0].outputs[0].token_ids) == 24
    assert outs[1].outputs[0].finish_reason == "error" and "hisparse_host_memory_gb" in outs[1].error
    assert cm.host.num_pages < cm.pages_for(3100)
    assert_idle(cm)


def test_hisparse_prompt_that_exactly_fills_the_pool_with_its_hot_pages_is_served_with_max_tokens_1(tiny_model):
    """Prefill holds a 200-token prompt (50 pages) next to the 10 hot pages: 60 pages exactly. With
    max_tokens=1 no decode token's KV is ever stored, so it must run, with vanilla's token."""
    path = tiny_model("llama", max_position_embeddings=2048)
    ps = prompts([200], seed=23)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    want = token_ids(LLM(path, device="cpu").generate(ps, one, use_tqdm=False))
    llm = hisparse(path, num_kv_pages=60)
    outs = llm.generate(ps, one, use_tqdm=False)
    assert outs[0].error is None and token_ids(outs) == want
    assert_idle(llm.engine.cache_manager)


def test_hisparse_overlapped_scheduling_equals_synchronous(tiny_model):
    """Overlap learns sampled tokens a step late: the buffer hand-over after prefill and the current
    page's moves must not depend on them. Requests end at different steps (a stop token, lengths)."""
    path = tiny_model("llama", max_position_embeddings=2048)
    ps = prompts([260, 150, 40, 300], seed=13)
    free = token_ids(hisparse(path).generate(ps, GREEDY, use_tqdm=False))
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop_token_ids=[free[0][6]]),
              SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True), GREEDY,
              SamplingParams(temperature=0.0, max_tokens=17, ignore_eos=True)]
    want = token_ids(hisparse(path, async_scheduling=False).generate(ps, params, use_tqdm=False))
    llm = hisparse(path, async_scheduling=True)
    assert token_ids(llm.generate(ps, params, use_tqdm=False)) == want
    assert len(want[0]) == 7 and len(want[1]) == 9
    assert_idle(llm.engine.cache_manager)


@pytest.mark.parametrize("knob,value", [("hisparse_token_budget", 2), ("hisparse_token_budget", "big"),
                                        ("hisparse_recent_pages", -1), ("hisparse_device_pages", 3),
                                        ("hisparse_min_prompt_len", 0), ("hisparse_host_memory_gb", 0),
                                        ("hisparse_host_memory_gb", 1e9)])
def test_hisparse_knobs_are_validated(knob, value):
    with pytest.raises(ValueError, match=knob):
        make_config(vllm_sparse_method="hisparse", page_size=P, **{knob: value})


def test_hisparse_roofline_counts_view_and_bounds(preset_model):
    cfg, model = make_config(vllm_sparse_method="hisparse"), preset_model("llama-3.1-8b")
    cls = hs.HiSparseCacheManager
    assert cls.decode_kv_tokens_read(cfg, model, 1000, 1000) == 1000              # short prompt: dense
    assert cls.decode_kv_tokens_read(cfg, model, 64000, 64000) == (128 + 4 + 1) * 16 + 64000 / 16
    assert cls.kv_tokens_held(cfg, model, 64000, 256) == (2 * 128 + 4 + 1) * 16


@pytest.mark.long   # each kernel's reference is compared in the quick suite; this is their wiring
@interp
def test_engine_with_the_triton_kernels_equals_the_references(tiny_model, monkeypatch):
    """Prefill and decode with every Triton kernel HiSparse calls (interpreted on the CPU; host
    memory is CPU memory there) give the tokens the torch references give: the GPU wiring, short
    of graphs and pinned memory."""
    from sparsevllm.kernels import page_bounds as pb, page_select as psel
    path = tiny_model("llama", max_position_embeddings=2048)
    ps = prompts([200, 90], seed=17)
    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    want = token_ids(hisparse(path).generate(ps, sp, use_tqdm=False))
    for name, fn in [("swap_plan", hk.swap_plan_triton), ("copy_pages", hk.copy_pages_triton),
                     ("host_store", hk.host_store_triton), ("page_bounds", pb.page_bounds_triton),
                     ("bound_scores", pb.bound_scores_triton), ("select_pages", psel.select_pages_triton)]:
        monkeypatch.setattr(hs, name, fn)
    llm = hisparse(path)
    assert token_ids(llm.generate(ps, sp, use_tqdm=False)) == want
    assert llm.engine.cache_manager.swap_stats[1] > 0
    assert_idle(llm.engine.cache_manager)


# ---------------------------------------------------------------- kernels vs references

def swap_case(g, B, E, n, device):
    R, pages = B + 2, max(40, 2 * E)
    key = torch.full((R, E), -1, dtype=torch.int32)
    last = torch.full((R, E), -1, dtype=torch.int32)
    for r in range(R):
        filled = int(torch.randint(0, E + 1, (1,), generator=g))
        key[r, :filled] = torch.randperm(pages, generator=g)[:filled].int()
        last[r, :filled] = torch.randint(0, 5, (filled,), generator=g).int()   # ties on purpose
    phys = torch.randperm(R * E, generator=g).int().view(R, E)
    want = torch.stack([torch.randperm(pages, generator=g)[:n] for _ in range(B)]).int()
    lengths = torch.randint(1, n * P + 1, (B,), generator=g).int()
    rows = torch.randperm(R, generator=g)[:B].long()
    active = torch.rand(B, generator=g) < 0.8
    if active.any():   # graph padding: inactive rows keep stale extras, e.g. a live request's row
        rows[~active] = rows[active][0]
    current = torch.randint(0, 100, (B,), generator=g).int()
    clock = torch.full((B,), 9, dtype=torch.int32)
    to = lambda t: t.to(device)  # noqa: E731
    return [to(t) for t in (want, lengths, rows, active, current, clock)], [to(t) for t in (key, last, phys)]


@interp
@pytest.mark.parametrize("B,E,n", [(1, 6, 5), (4, 12, 7), (3, 33, 20), (2, 260, 133)])
def test_swap_plan_triton_and_reference_match_the_oracle(B, E, n):
    g = torch.Generator().manual_seed(B * 100 + E)
    args, buf = swap_case(g, B, E, n, "cpu")
    ref_buf = [t.clone() for t in buf]
    tri_buf = [t.clone() for t in buf]
    ref = hk.swap_plan_ref(*args, *ref_buf, P)
    tri = hk.swap_plan_triton(*args, *tri_buf, P)
    want, lengths, rows, active, current, clock = args
    for b in range(B):
        nv = -(-int(lengths[b]) // P)
        if not active[b]:
            continue
        t, s, keys, last = lru_oracle(want[b].tolist(), nv, buf[0][rows[b]].tolist(), buf[1][rows[b]].tolist(),
                                      buf[2][rows[b]].tolist(), int(clock[b]), int(current[b]))
        for table, src in (ref, tri):
            assert table[b, :nv].tolist() == t and src[b, :nv].tolist() == s
    for a, r in zip(tri_buf[:2], ref_buf[:2]):
        assert torch.equal(a, r)
    idle = torch.tensor([r not in rows[active].tolist() for r in range(buf[0].shape[0])])
    assert torch.equal(ref_buf[0][idle], buf[0][idle]) and torch.equal(tri_buf[1][idle], buf[1][idle])


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_host_store_and_copy_pages_triton_match_references(dtype):
    g = torch.Generator().manual_seed(0)
    H, D, T = 2, 24, 9
    k = torch.randn(T, H, 2 * D, generator=g).to(dtype)[:, :, :D]       # a strided view, as qkv splits give
    v = torch.randn(T, H, D, generator=g).to(dtype)
    slots = torch.randperm(40, generator=g)[:T]
    slots[2] = -1
    host = [torch.zeros(40, H, D, dtype=dtype) for _ in range(4)]
    hk.host_store_ref(k, v, host[0], host[1], slots)
    hk.host_store_triton(k, v, host[2], host[3], slots)
    assert torch.equal(host[0], host[2]) and torch.equal(host[1], host[3]) and host[0].any()
    src = torch.tensor([[3, -1, 7], [0, 5, -1]], dtype=torch.int32)
    dst = torch.tensor([[1, 2, 4], [6, 0, 3]], dtype=torch.int32)
    dev = [torch.zeros(8 * P, H, D, dtype=dtype) for _ in range(4)]
    hk.copy_pages_ref(host[0], host[1], dev[0], dev[1], src, dst, P)
    hk.copy_pages_triton(host[0], host[1], dev[2], dev[3], src, dst, P)
    assert torch.equal(dev[0], dev[2]) and torch.equal(dev[1], dev[3])
    assert torch.equal(dev[0][P:2 * P], host[0][3 * P:4 * P]) and not dev[0][2 * P:3 * P].any()


# ---------------------------------------------------------------- GPU

@gpu
def test_gpu_hisparse_kernels_read_and_write_pinned_host_memory_bf16():
    g = torch.Generator().manual_seed(1)
    H, D, T = 8, 128, 33
    k = torch.randn(T, H, D, generator=g).bfloat16().cuda()
    v = torch.randn(T, H, D, generator=g).bfloat16().cuda()
    slots = torch.randperm(64 * P, generator=g)[:T].cuda()
    host = [torch.zeros(64 * P, H, D, dtype=torch.bfloat16, pin_memory=True) for _ in range(2)]
    hk.host_store(k, v, host[0], host[1], slots)       # the GPU writes pinned host memory directly
    torch.cuda.synchronize()
    assert torch.equal(host[0][slots.cpu()], k.cpu()) and torch.equal(host[1][slots.cpu()], v.cpu())
    src = torch.randint(-1, 64, (4, 16), generator=g).int().cuda()
    dst = torch.randperm(64, generator=g)[:64].view(4, 16).int().cuda()
    dev = [torch.zeros(64 * P, H, D, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    want = [t.clone() for t in dev]
    hk.copy_pages(host[0], host[1], dev[0], dev[1], src, dst, P)
    hk.copy_pages_ref(host[0], host[1], want[0], want[1], src.cpu(), dst.cpu(), P)
    assert torch.equal(dev[0], want[0]) and torch.equal(dev[1], want[1])
    args, buf = swap_case(g, 8, 40, 20, "cuda")
    ref_buf = [t.cpu().clone() for t in buf]
    tri = hk.swap_plan(*args, *buf, P)
    ref = hk.swap_plan_ref(*[a.cpu() for a in args], *ref_buf, P)
    active = args[3].cpu()
    assert torch.equal(tri[0].cpu()[active], ref[0][active]) and torch.equal(tri[1].cpu()[active], ref[1][active])
    assert torch.equal(buf[0].cpu(), ref_buf[0]) and torch.equal(buf[1].cpu(), ref_buf[1])


@gpu
def test_gpu_hisparse_graph_replay_equals_eager_and_quest(tiny_model):
    path = tiny_model("llama", max_position_embeddings=2048)
    knobs = dict(vllm_sparse_method="hisparse", device="cuda", dtype="float32", max_num_seqs=8,
                 **{**KNOBS, "hisparse_recent_pages": 0, "hisparse_device_pages": 6})
    eager = LLM(path, enforce_eager=True, **knobs)
    graph = LLM(path, **knobs)
    sync = LLM(path, async_scheduling=False, **knobs)
    quest = LLM(path, vllm_sparse_method="quest", device="cuda", dtype="float32", max_num_seqs=8, page_size=P,
                quest_token_budget=5 * P, quest_skip_layers=0, quest_selection="shared", enforce_eager=True,
                enable_prefix_caching=False, chunk_prefill_size=KNOBS["chunk_prefill_size"])
    assert graph.execution_mode == "cuda_graph"
    for n in (1, 3, 8):
        ps = prompts([100 + 37 * i for i in range(n)], seed=n)
        want = token_ids(eager.generate(ps, GREEDY, use_tqdm=False))
        assert token_ids(sync.generate(ps, GREEDY, use_tqdm=False)) == want
        assert token_ids(graph.generate(ps, GREEDY, use_tqdm=False)) == want
        assert token_ids(quest.generate(ps, GREEDY, use_tqdm=False)) == want
    acc = graph.engine.cache_manager.memory_accounting()
    assert acc["swapped_in_pages"] > 0 and acc["hit_rate"] is not None
    assert_idle(graph.engine.cache_manager)


@pytest.mark.long   # the default model's weights through a script
def test_hit_rate_script_reports_real_weights_hit_rate():
    """scripts/benchmarks/hisparse_hit_rate.py on the embedded model: prompts offload, the decode
    steps report a hit rate in (0, 1], and successive queries of a real model mostly hit."""
    import json
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.path.join(root, "src")}
    out = subprocess.run([sys.executable, os.path.join(root, "scripts", "benchmarks", "hisparse_hit_rate.py"),
                          "--prompt_len", "1024", "--num_prompts", "2", "--output_len", "8", "--token_budget", "64"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    row = json.loads(out.stdout.strip().splitlines()[-1])
    assert row["decode_steps"] >= 6 and row["swapped_in_pages"] > 0 and 0.5 < row["hit_rate"] <= 1.0


def test_hisparse_equals_quest_when_the_last_prompt_chunk_is_one_token(tiny_model):
    """257 = 4 x 64 + 1: the last prompt token alone in its chunk. It used to run as a decode step
    while the request was not yet offloaded, so its K/V never reached the host copy of its page
    (nor its page bounds), and once decode left that page HiSparse read it without the token."""
    path = tiny_model("llama", max_position_embeddings=2048)
    ps = prompts([257], seed=3)
    quest = LLM(path, vllm_sparse_method="quest", device="cpu", page_size=P, quest_token_budget=5 * P,
                quest_skip_layers=0, quest_selection="shared", chunk_prefill_size=64, enable_prefix_caching=False)
    want = token_ids(quest.generate(ps, GREEDY, use_tqdm=False))
    llm = hisparse(path, hisparse_recent_pages=0, hisparse_device_pages=6)
    assert token_ids(llm.generate(ps, GREEDY, use_tqdm=False)) == want
    assert_idle(llm.engine.cache_manager)


def test_hisparse_recompute_after_preemption_backs_up_every_token(tiny_model):
    """A preempted offloaded request is recomputed by prefill up to its last known token, which then
    runs as a decode step before the request is offloaded again. When it moves to its hot buffer the
    host must hold every token it stored, and each page's bounds the min/max of its keys; that last
    token used to stay on the device only (decode wrote through to host for offloaded rows only)."""
    path = tiny_model("llama", max_position_embeddings=2048)
    llm = hisparse(path)
    eng, cm = llm.engine, llm.engine.cache_manager
    to_hot, checked_requests = cm._to_hot_buffer, []

    def check(seq):
        pages, hp = cm.tables[seq.seq_id], cm.host_pages_of[seq.seq_id]
        for layer in range(cm.num_layers):
            dev_k, dev_v = cm.pool.layer(layer)
            host_k, host_v = cm.host.layer(layer)
            for j, page in enumerate(pages[:cm.pages_for(seq.cache_len)]):
                count = min(P, seq.cache_len - j * P)
                d, h = slice(page * P, page * P + count), slice(int(hp[j]) * P, int(hp[j]) * P + count)
                assert torch.equal(host_k[h], dev_k[d]) and torch.equal(host_v[h], dev_v[d]), (layer, j)
                assert torch.equal(cm.kmin[layer, hp[j]], dev_k[d].amin(0)), (layer, j)
                assert torch.equal(cm.kmax[layer, hp[j]], dev_k[d].amax(0)), (layer, j)
        checked_requests.append(seq.cache_len)
        to_hot(seq)
    cm._to_hot_buffer = check
    seq = eng.add_request(prompts([120], seed=13)[0], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    while seq.num_completion_tokens < 9:
        eng.step()
    # 129 known tokens: the recompute prefills 2 x 64 of them, the last one runs as a decode step.
    eng.scheduler.preempt(seq)
    eng.run([seq], use_tqdm=False)
    assert checked_requests == [120, 129] and len(seq.completion_token_ids) == 20
    assert_idle(cm)

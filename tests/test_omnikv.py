"""OmniKV: layer roles, the filter layers' selection against a naive float64 oracle (ties included),
generated tokens always attended, the causal invariant, equality with vanilla when the selection
covers the prompt (batch 1 and > 1, chunked prefill, prefix-cache hits), bad knobs rejected before
any weight loads, and the kernels against their references."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from helpers import CUDA, gpu, prompts  # noqa: E402
from method_knobs import METHOD_KNOBS  # noqa: E402
from sparsevllm import LLM, SamplingParams  # noqa: E402
from sparsevllm.engine.cache_manager.cross_layer import layer_roles  # noqa: E402
from sparsevllm.engine.cache_manager.omnikv import default_filter_layers  # noqa: E402
from sparsevllm.kernels import omnikv as ok, token_select as tsel  # noqa: E402
from sparsevllm.method_registry import make_config  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
# 4 layers: dense, filter, wait, sparse, so that a wait layer and a dense layer before the filter run too
KNOBS = dict(METHOD_KNOBS["omnikv"], omnikv_filter_layers=[1], omnikv_wait_layers=1)
interp = pytest.mark.skipif(CUDA, reason="interpreter tests run on CPU-only machines")


def model(tiny_model, arch="llama"):
    return tiny_model(arch, num_hidden_layers=4)


def run(llm, ps, sp=GREEDY):
    outs = llm.generate(ps, sp, use_tqdm=False)
    assert llm.engine.cache_manager.allocator.is_idle()
    return [o.outputs[0].token_ids for o in outs]


# ---------------------------------------------------------------- the naive oracle

def oracle(q, k_cache, table_row, length, prompt_len, P, keep, scale, selector):
    """OmniKV's attended positions for one request from the raw keys, in float64 Python loops."""
    Hq, Hkv = q.shape[0], k_cache.shape[1]
    keys = [k_cache[table_row[j // P] * P + j % P].double() for j in range(length)]
    per_head = [[float(q[h].double() @ keys[j][h // (Hq // Hkv)]) * scale for j in range(length)]
                for h in range(Hq)]
    if selector == "softmax_max":   # each head's softmax over the prompt's keys (softmax_before_last)
        per_head = [list(torch.tensor(row[:prompt_len]).softmax(0)) for row in per_head]
    score = [max(float(per_head[h][j]) for h in range(Hq)) for j in range(prompt_len)]
    chosen = sorted(range(prompt_len), key=lambda j: (-score[j], j))[:keep]
    return sorted(chosen) + list(range(prompt_len, length))


def check_views(llm, log):
    """Every sparse layer's view equals the oracle, names distinct positions below or at the
    query's, and contains every generated token."""
    cm = llm.engine.cache_manager
    build = cm.build_decode_view
    captured = {}

    def checked(layer_id, q, step):
        view = build(layer_id, q, step)
        role, source = cm.roles[layer_id]
        if role == "filter":
            captured[layer_id] = q.clone()
        if role != "sparse":
            return view
        P = cm.page_size
        qf = captured[source]
        k_cache = cm.pool.layer(source)[0]
        for b, seq in enumerate(step.seqs):
            length, plen = int(step.cache_lens[b]), seq.num_prompt_tokens
            row = step.block_tables[b].tolist()
            slot_pos = {row[j // P] * P + j % P: j for j in range(length)}
            n = int(view.lengths[b, 0])
            positions = [slot_pos[s] for s in view.table[b, 0, :n].tolist()]
            assert positions == sorted(set(positions)) and positions[-1] == length - 1   # causal, in order
            assert set(range(plen, length)) <= set(positions)                            # generated: all
            keep = cm.method_config.num_kept(plen)
            want = oracle(qf[b], k_cache, row, length, plen, P, keep, cm.scale, cm.selector)
            assert positions == want, f"layer {layer_id} request {b}"
            log["sparse"] += keep < plen
            log["views"] += 1
        return view
    cm.build_decode_view = checked
    return llm


# ---------------------------------------------------------------- layer roles and knobs

def test_layer_roles_follow_filter_and_wait_layers():
    roles = layer_roles(8, [2, 5], 1)
    assert [r for r, _ in roles] == ["dense", "dense", "filter", "dense", "sparse", "filter", "dense", "sparse"]
    assert [s for _, s in roles] == [None] * 4 + [2, None, None, 5]
    assert [r for r, _ in layer_roles(6, [1], 0)] == ["dense", "filter", "sparse", "sparse", "sparse", "sparse"]
    assert default_filter_layers(32) == [2, 8, 18]
    assert default_filter_layers(30) == [2, 8, 17]      # SmolLM2-135M
    assert default_filter_layers(64) == [4, 16, 36]


@pytest.mark.parametrize("knobs,msg", [
    ({"omnikv_filter_layers": [8, 2]}, "omnikv_filter_layers=.*strictly increasing"),
    ({"omnikv_filter_layers": [2, 2]}, "omnikv_filter_layers=.*strictly increasing"),
    ({"omnikv_filter_layers": []}, "omnikv_filter_layers=.*non-empty"),
    ({"omnikv_filter_layers": [-1]}, "omnikv_filter_layers"),
    ({"omnikv_wait_layers": -1}, "omnikv_wait_layers=-1 is invalid; valid: an integer >= 0"),
    ({"omnikv_num_selected": 0}, r"omnikv_num_selected=0 is invalid; valid: an integer >= 1 .* fraction in \(0, 1\]"),
    ({"omnikv_num_selected": 1.5}, "omnikv_num_selected=1.5 is invalid"),
    ({"omnikv_num_selected": -0.1}, "omnikv_num_selected"),
    ({"omnikv_selector": "mean"}, "omnikv_selector='mean' is invalid; valid: last | softmax_max"),
])
def test_bad_knobs_are_rejected_before_any_model_loads(knobs, msg):
    with pytest.raises(ValueError, match=msg):
        make_config("/no/such/model", "omnikv", **knobs)


def test_filter_layers_out_of_range_fail_before_weights_load(tiny_model, monkeypatch):
    from sparsevllm.engine import model_runner

    def no_load(*a, **k):
        raise AssertionError("weights started loading")
    monkeypatch.setattr(model_runner, "load_weights", no_load)
    with pytest.raises(ValueError, match=r"omnikv_filter_layers=\[1, 4\] is out of range .* 4 layers; valid: .*\[0, 3\]"):
        LLM(model(tiny_model), vllm_sparse_method="omnikv", omnikv_filter_layers=[1, 4], device="cpu")


def test_num_selected_is_a_count_or_a_fraction_of_the_prompt():
    cfg = make_config(None, "omnikv").method_config
    assert cfg.omnikv_num_selected == 0.067 and cfg.num_kept(1000) == 67 and cfg.num_kept(5) == 1
    assert make_config(None, "omnikv", omnikv_num_selected=40).method_config.num_kept(30) == 30


# ---------------------------------------------------------------- engine (CPU)

@pytest.mark.parametrize("chunk", [4096, 32])
def test_omnikv_equals_vanilla_when_the_selection_covers_the_prompt(tiny_model, chunk):
    path = model(tiny_model)
    ps = prompts([70, 13, 150])
    want = run(LLM(path, device="cpu", chunk_prefill_size=chunk), ps)
    llm = LLM(path, vllm_sparse_method="omnikv", device="cpu", chunk_prefill_size=chunk,
              **dict(KNOBS, omnikv_num_selected=1.0))
    assert run(llm, ps[:1]) == want[:1]     # batch 1
    assert run(llm, ps) == want             # batch > 1, different prompt lengths


@pytest.mark.parametrize("selector", ["last", "softmax_max"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_omnikv_selection_equals_oracle_and_is_causal(tiny_model, arch, selector):
    log = {"sparse": 0, "views": 0}
    llm = check_views(LLM(model(tiny_model, arch), vllm_sparse_method="omnikv", device="cpu", omnikv_selector=selector,
                          chunk_prefill_size=48, page_size=8, **dict(KNOBS, omnikv_num_selected=9)), log)
    outs = run(llm, prompts([70, 13, 150], seed=1))
    assert log["views"] >= 2 * 9 and log["sparse"] > 0
    assert all(len(o) == GREEDY.max_tokens for o in outs)


def test_omnikv_with_prefix_cache_hits_and_filter_layer_zero(tiny_model):
    path = model(tiny_model)
    shared = prompts([64], seed=3)[0]
    ps = [shared + p for p in prompts([20, 37], seed=4)]
    knobs = dict(vllm_sparse_method="omnikv", device="cpu", omnikv_filter_layers=[0, 2], omnikv_wait_layers=0,
                 omnikv_num_selected=0.25, page_size=8, chunk_prefill_size=40)
    want = run(LLM(path, enable_prefix_caching=False, **knobs), ps)
    llm = LLM(path, **knobs)
    assert run(llm, ps[:1]) == want[:1]
    assert run(llm, ps) == want           # the second request hits the first one's prefix pages
    assert llm.engine.cache_manager.roles == [("filter", None), ("sparse", 0), ("filter", None), ("sparse", 2)]


def test_omnikv_differs_from_vanilla_when_it_selects(tiny_model):
    """A sanity check that the selection is used: a 2-token budget changes some output."""
    path = model(tiny_model)
    ps = prompts([150, 120], seed=5)
    want = run(LLM(path, device="cpu"), ps, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    got = run(LLM(path, vllm_sparse_method="omnikv", device="cpu", omnikv_num_selected=2,
                  omnikv_filter_layers=[0], omnikv_wait_layers=0), ps,
              SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    assert got != want


# ---------------------------------------------------------------- kernels

def kernel_case(g, B, Hq, Hkv, D, P, N, dtype, device):
    num_pages = B * N + 3
    k_cache = torch.randn(num_pages * P, Hkv, D, generator=g).to(device, dtype)
    table = torch.randperm(num_pages, generator=g)[:B * N].view(B, N).int().to(device)
    q = torch.randn(B, Hq, D, generator=g).to(device, dtype)
    lengths = torch.randint(N * P // 2, N * P + 1, (B,), generator=g).int()
    prompt = (lengths.float() * torch.rand(B, generator=g) * 0.9).int() + 1
    return q, k_cache, table, lengths.to(device), prompt.to(device)


@interp
@pytest.mark.parametrize("selector", ["last", "softmax_max"])
@pytest.mark.parametrize("P,dtype", [(1, torch.float32), (4, torch.float16), (16, torch.float32)])
def test_omnikv_scores_triton_matches_reference(selector, P, dtype):
    g = torch.Generator().manual_seed(P)
    q, k_cache, table, lengths, prompt = kernel_case(g, 3, 6, 2, 32, P, 160 // P, dtype, "cpu")
    got = ok.omnikv_scores_triton(q, k_cache, table, lengths, prompt, P, 0.2, selector)
    want = ok.omnikv_scores_ref(q, k_cache, table, lengths, prompt, P, 0.2, selector)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    fin = torch.isfinite(want)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got[fin], want[fin], atol=tol, rtol=tol)


@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_softmax_max_normalises_over_the_prompt_keys_only(impl):
    """softmax_max follows the official softmax_before_last: each head's softmax runs over the
    prompt's keys only (the official code slices the key cache to the prefill length), then the max
    over heads. Generated tokens are stored (and weigh heavily here) yet leave the prompt's scores
    unchanged; the oracle is a plain loop in float64."""
    if impl == "triton" and CUDA:
        pytest.skip("interpreter case")
    g = torch.Generator().manual_seed(7)
    B, Hq, Hkv, D, P, N = 3, 6, 2, 16, 4, 12
    q, k_cache, table, _, _ = kernel_case(g, B, Hq, Hkv, D, P, N, torch.float32, "cpu")
    prompt = torch.tensor([17, 30, 1], dtype=torch.int32)
    lengths = torch.tensor([25, 48, 9], dtype=torch.int32)       # decode after the prompt: generated tokens
    slots = table.long().repeat_interleave(P, 1) * P + torch.arange(N * P) % P
    group = Hq // Hkv
    for b in range(B):   # generated keys aligned with the query: large logits, if they counted
        for t in range(int(prompt[b]), int(lengths[b])):
            k_cache[slots[b, t]] = q[b].view(Hkv, group, D)[:, 0] * 3
    fn = ok.omnikv_scores_ref if impl == "ref" else ok.omnikv_scores_triton
    got = fn(q, k_cache, table, lengths, prompt, P, 0.3, "softmax_max")
    want = torch.full((B, N * P), float("-inf"), dtype=torch.float64)
    for b in range(B):
        n = int(prompt[b])
        keys = k_cache[slots[b, :n]].double()                    # [n, H_kv, D]
        for h in range(Hq):
            probs = torch.softmax(keys[:, h // group] @ q[b, h].double() * 0.3, dim=0)
            want[b, :n] = probs if h == 0 else torch.maximum(want[b, :n], probs)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    fin = torch.isfinite(want)
    torch.testing.assert_close(got[fin].double(), want[fin], atol=1e-6, rtol=1e-5)


@interp
@pytest.mark.parametrize("block", [32, 2048])
def test_select_tokens_triton_matches_reference_with_ties(block, monkeypatch):
    monkeypatch.setattr(tsel, "SELECT_BLOCK", block)   # 32: many blocks per row
    g = torch.Generator().manual_seed(block)
    B, P, N = 4, 4, 40
    _, _, table, lengths, prompt = kernel_case(g, B, 2, 1, 8, P, N, torch.float32, "cpu")
    for trial in range(4):
        scores = torch.randn(B, N * P, generator=g)
        scores[:, ::5] = 0.25                       # plateaus of equal scores straddle the cut
        if trial == 3:
            scores[:] = -1.0                        # everything tied
        pos = torch.arange(N * P)
        scores = scores.masked_fill(pos >= torch.minimum(prompt, lengths).long().view(B, 1), float("-inf"))
        keep = torch.minimum(torch.randint(1, 40, (B,), generator=g).int(), prompt)
        got_t, got_l = tsel.select_tokens_triton(scores, keep, table, lengths, prompt, P)
        want_t, want_l = tsel.select_tokens_ref(scores, keep, table, lengths, prompt, P)
        assert torch.equal(got_l, want_l)
        for b in range(B):
            assert torch.equal(got_t[b, 0, :int(want_l[b])], want_t[b, 0, :int(want_l[b])]), (trial, b)


@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_select_tokens_keeps_the_top_n_prompt_tokens_then_every_generated_token(impl):
    """Generated positions carry scores too (a filter layer's attention reports every token) but
    never take a prompt token's place."""
    if impl == "triton" and CUDA:
        pytest.skip("interpreter case")
    table = torch.arange(4, dtype=torch.int32).view(1, 4)            # page size 4: slot = position
    scores = torch.tensor([[0.5, 2.0, 2.0, -1.0, 3.0, 0.1, 9.0, 9.0, 9.0] + [float("-inf")] * 7])
    fn = tsel.select_tokens_ref if impl == "ref" else tsel.select_tokens_triton
    t, n = fn(scores, torch.tensor([3], dtype=torch.int32), table, torch.tensor([9], dtype=torch.int32),
              torch.tensor([6], dtype=torch.int32), 4)
    assert int(n) == 3 + 3 and t[0, 0, :6].tolist() == [1, 2, 4, 6, 7, 8]


# ---------------------------------------------------------------- GPU

@gpu
@pytest.mark.parametrize("selector", ["last", "softmax_max"])
def test_gpu_omnikv_kernels_match_references_bf16(selector):
    g = torch.Generator().manual_seed(2)
    q, k_cache, table, lengths, prompt = kernel_case(g, 4, 32, 8, 128, 16, 300, torch.bfloat16, "cuda")
    got = ok.omnikv_scores(q, k_cache, table, lengths, prompt, 16, 128 ** -0.5, selector)
    want = ok.omnikv_scores_ref(q, k_cache, table, lengths, prompt, 16, 128 ** -0.5, selector)
    fin = torch.isfinite(want)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    torch.testing.assert_close(got[fin], want[fin], atol=2e-2, rtol=2e-2)
    keep = (prompt.float() * 0.067).ceil().int()
    got_t, got_l = tsel.select_tokens(want, keep, table, lengths, prompt, 16)
    want_t, want_l = tsel.select_tokens_ref(want, keep, table, lengths, prompt, 16)
    assert torch.equal(got_l, want_l)
    for b in range(4):
        assert torch.equal(got_t[b, 0, :int(want_l[b])], want_t[b, 0, :int(want_l[b])])


@gpu
def test_gpu_omnikv_graph_replay_equals_eager(tiny_model):
    path = model(tiny_model)
    ps = prompts([300, 90, 500, 41], seed=6)
    knobs = dict(KNOBS, vllm_sparse_method="omnikv", device="cuda", dtype="float32", omnikv_num_selected=0.1)
    eager = LLM(path, enforce_eager=True, **knobs)
    graph = LLM(path, **knobs)
    assert graph.execution_mode == "cuda_graph"
    assert run(graph, ps) == run(eager, ps)
    cont = prompts([12] * 4, seed=7)
    for a, b in zip(graph.teacher_forced_logprobs(ps, cont, use_tqdm=False),
                    eager.teacher_forced_logprobs(ps, cont, use_tqdm=False)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------- calibration helper

def test_calibration_picks_filter_layers_deterministically(tiny_model, tmp_path, capsys):
    import json

    from sparsevllm.tools import omnikv_calibrate as cal, omnikv_calibration as calibration
    path = tiny_model("llama", num_hidden_layers=6)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt_token_ids": p}) for p in prompts_of(3)))
    out = tmp_path / "cal"
    args = ["--model", path, "--prompts", str(prompts), "--decode_steps", "3", "--num_filter_layers", "2",
            "--first_layer", "0", "--wait_layers", "1", "--num_selected", "0.2", "--out", str(out),
            "--hyper_params", '{"device": "cpu"}']
    assert cal.main(args) == 0
    report = json.loads((tmp_path / "cal.json").read_text())
    assert (tmp_path / "cal.png").stat().st_size > 0
    filters = report["filter_layers"]
    assert filters[0] == 0 and len(filters) == 2 and filters == sorted(set(filters))
    assert f"omnikv_filter_layers={filters}" in capsys.readouterr().out
    cov = report["coverage"]
    assert len(cov) == 6 and all(0.0 <= cov[f][l] <= 1.0 + 1e-9 for f in range(6) for l in range(f, 6))
    # the greedy pick is the best pair with layer 0 first, under its own objective
    import torch
    c = torch.tensor(cov)
    best = max(range(2, 6), key=lambda x: calibration.mean_sparse_coverage(c, [0, x], 1))
    assert filters == [0, best] or (calibration.mean_sparse_coverage(c, filters, 1)
                                    >= calibration.mean_sparse_coverage(c, [0, best], 1))
    assert cal.main(args) == 0 and json.loads((tmp_path / "cal.json").read_text())["coverage"] == cov   # deterministic


@pytest.mark.parametrize("hyper_params", ['{"vllm_sparse_method": "quest"}', '[1]'])
def test_calibration_refuses_a_sparse_method_in_hyper_params(hyper_params, capsys):
    """It measures dense attention from the vanilla pool's keys: another method (which used to give
    made-up coverages, or an IndexError for deltakv's pool) is a usage error before a model loads."""
    from sparsevllm.tools import omnikv_calibrate as cal
    with pytest.raises(SystemExit) as e:
        cal.main(["--model", "/no/such/model", "--hyper_params", hyper_params])
    assert e.value.code == 2 and "--hyper_params" in capsys.readouterr().err


def prompts_of(n):
    return prompts([120 + 17 * i for i in range(n)], seed=11)


def test_omnikv_last_prompt_token_alone_in_its_chunk_is_prefilled_densely(tiny_model):
    """Prefill is dense everywhere: a prompt whose last chunk holds one token (97 = 3 x 32 + 1) gives
    the tokens of one-shot prefill. That token used to run as a decode step, where the filter layer
    ranks it as a prompt token: the sparse layers' view could leave out the query's own token."""
    path = model(tiny_model)
    ps = prompts([97], seed=4)
    knobs = dict(KNOBS, page_size=4, omnikv_num_selected=4)
    want = run(LLM(path, vllm_sparse_method="omnikv", device="cpu", chunk_prefill_size=128, **knobs), ps)
    assert run(LLM(path, vllm_sparse_method="omnikv", device="cpu", chunk_prefill_size=32, **knobs), ps) == want

"""Overlapped scheduling (async_scheduling): the host builds step t + 1 while step t runs, the sampled
tokens of step t reach step t + 1's inputs on the device and the host one step later. Outputs must
equal the synchronous engine's token for token, for every method, whatever finishes when:
stop tokens (which cost one discarded extra step), length limits, preemption, prefix-cache hits, a
request that fails alone. Allocators must be idle after every run."""
import pytest
import torch

from helpers import CUDA, prompts
from method_knobs import METHOD_KNOBS
from sparsevllm import LLM, SamplingParams
from sparsevllm.method_registry import get_method

# DeltaKV's overlap is tested in tests/test_deltakv.py, with the compressor and 4-layer model it needs.
METHODS = {method: knobs for method, knobs in METHOD_KNOBS.items() if method != "deltakv"}


def build(path, method, async_scheduling, **knobs):
    return LLM(path, vllm_sparse_method=method, device="cpu", page_size=8, chunk_prefill_size=64,
               async_scheduling=async_scheduling, **METHODS[method], **knobs)


def generate(llm, ps, params):
    outs = llm.generate(ps, params, use_tqdm=False)
    assert llm.engine.cache_manager.allocator.is_idle(), "KV pages leaked"
    assert llm.engine._in_flight is None and not llm.engine.has_work()
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.error) for o in outs]


def watch_feeds(llm):
    """Count decode steps whose inputs were fed from the previous step's device tokens."""
    runner, fed = llm.engine.model_runner, {"steps": 0, "rows": 0, "decode_rows": 0}
    forward = runner.forward

    def counting(step, prev_tokens=None):
        if step.feed_rows is not None:
            fed["steps"] += 1
            fed["rows"] += int((step.feed_rows >= 0).sum())
        fed["decode_rows"] += 0 if step.is_prefill else step.batch_size
        return forward(step, prev_tokens)
    runner.forward = counting
    return fed


def mixed_params(reference):
    """Requests that end at different steps: by a stop token taken from the reference output (the
    engine only learns it one step late), by max_tokens, by EOS ignored."""
    return [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop_token_ids=[reference[0][4]]),
            SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
            SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop_token_ids=[reference[2][11]]),
            SamplingParams(temperature=0.0, max_tokens=13, ignore_eos=True),
            SamplingParams(temperature=0.8, top_k=20, max_tokens=15, ignore_eos=True, seed=7)]


def test_async_scheduling_defaults_off_on_cpu_and_is_validated(tiny_model):
    assert LLM(tiny_model("llama"), device="cpu").engine.async_scheduling is False
    with pytest.raises(ValueError, match="async_scheduling"):
        LLM(tiny_model("llama"), device="cpu", async_scheduling="yes")


@pytest.mark.parametrize("method", list(METHODS))
def test_overlap_equals_no_overlap_with_requests_finishing_at_different_steps(tiny_model, method):
    path = tiny_model("llama")
    ps = prompts([70, 13, 150, 40, 90])
    free_run = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)] * 5
    reference = [o[0] for o in generate(build(path, method, False), ps, free_run)]
    params = mixed_params(reference)
    want = generate(build(path, method, False), ps, params)
    llm = build(path, method, True)
    fed = watch_feeds(llm)
    got = generate(llm, ps, params)
    assert got == want
    assert [len(t) for t, _, _ in got][:4] == [5, 7, 12, 13]   # the stop tokens did end requests 0 and 2
    # the two stop-token requests each ran one extra, discarded step; every other decode row made a
    # token (the first token of each request comes from its prefill); most inputs came from the device
    assert fed["decode_rows"] == sum(len(t) for t, _, _ in got) - 5 + 2
    assert fed["steps"] > 10 and fed["rows"] >= fed["decode_rows"] - 5
    assert got == generate(llm, ps, params)                      # the same engine again, warm


@pytest.mark.parametrize("method", list(METHODS))
def test_overlap_equals_no_overlap_under_preemption_prefix_hits_and_a_failing_request(tiny_model, method):
    path = tiny_model("llama")
    shared = prompts([64], seed=3)[0]
    ps = [shared + p for p in prompts([30, 5, 41], seed=4)] + [prompts([2000], seed=5)[0]] + prompts([20], seed=6)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (24, 30, 16, 8, 28)]
    # 40 pages of 8 tokens: the three shared-prefix requests do not all fit at full length
    want = generate(build(path, method, False, num_kv_pages=40), ps, params)
    llm = build(path, method, True, num_kv_pages=40)
    got = generate(llm, ps, params)
    assert got == want
    assert got[3][1] == "error" and all(reason == "length" for _, reason, _ in got[:3] + got[4:])
    # SnapKV's prompts here fit its capacity only partly, and HiSparse keeps only its hot buffer on the
    # device: preemption is a matter of the methods that keep every page there
    if method not in ("snapkv", "hisparse"):
        assert llm.engine.scheduler.num_preemptions > 0
    if not get_method(method).capabilities.prefix_cache:   # HiSparse: a request's pages are its own
        return
    hits_before = llm.engine.cache_manager.allocator.page_of.copy()
    assert hits_before, "the shared prefix was named"
    assert generate(llm, ps[:2], params[:2]) == want[:2]         # now served from the prefix cache


@pytest.mark.parametrize("method", list(METHODS))
def test_overlap_keeps_teacher_forced_logprobs(tiny_model, method):
    path = tiny_model("llama")
    ps = prompts([60, 17], seed=8)
    conts = prompts([9, 14], seed=9)
    want = build(path, method, False).teacher_forced_logprobs(ps, conts, use_tqdm=False)
    got = build(path, method, True).teacher_forced_logprobs(ps, conts, use_tqdm=False)
    for a, b in zip(got, want):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("method", list(METHODS))
def test_gpu_overlap_equals_no_overlap_with_graphs(tiny_model, method):
    """On the GPU, where overlap really runs ahead of the device: fp32 (graphs, mixed finishing
    steps, preemption) token for token; bf16 with graphs on a batch whose composition is the same
    in both modes (every request runs to its length together)."""
    path = tiny_model("llama")
    ps = prompts([70, 13, 150, 40, 90])
    knobs = dict(device="cuda", page_size=8, chunk_prefill_size=64, max_num_seqs=8, **METHODS[method])
    free_run = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)] * 5
    sync = LLM(path, vllm_sparse_method=method, dtype="float32", async_scheduling=False, **knobs)
    over = LLM(path, vllm_sparse_method=method, dtype="float32", **knobs)
    assert over.engine.async_scheduling and over.execution_mode == "cuda_graph"
    reference = [o[0] for o in generate(sync, ps, free_run)]
    params = mixed_params(reference)
    assert generate(over, ps, params) == generate(sync, ps, params)
    tight = dict(knobs, num_kv_pages=40)
    ps2 = ps[:3] + prompts([33], seed=2)
    assert generate(LLM(path, vllm_sparse_method=method, dtype="float32", **tight), ps2, free_run[:4]) == \
        generate(LLM(path, vllm_sparse_method=method, dtype="float32", async_scheduling=False, **tight), ps2,
                 free_run[:4])
    bf_sync = LLM(path, vllm_sparse_method=method, async_scheduling=False, **knobs)
    bf_over = LLM(path, vllm_sparse_method=method, **knobs)
    assert generate(bf_over, ps, free_run) == generate(bf_sync, ps, free_run)

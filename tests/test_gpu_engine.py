"""The engine on a GPU: fp32 output equals the CPU engine's; CUDA-graph replay equals eager for
every batch-size bucket; bf16 with graphs runs and leaves the allocator idle."""
import gc

import pytest
import torch

from method_knobs import METHOD_KNOBS
from sparsevllm import LLM, SamplingParams
from sparsevllm.engine.model_runner import DecodeGraphs

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def prompts(n, base=40):
    return [[(11 * i + 7 * j) % 250 + 3 for j in range(base + 13 * i)] for i in range(n)]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_gpu_fp32_equals_cpu(tiny_model, arch):
    path = tiny_model(arch)
    ps = prompts(5)
    cpu = LLM(path, device="cpu").generate(ps, GREEDY, use_tqdm=False)
    gpu_llm = LLM(path, device="cuda", dtype="float32", max_num_seqs=8)
    assert gpu_llm.execution_mode == "cuda_graph"
    gpu = gpu_llm.generate(ps, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in gpu] == [o.outputs[0].token_ids for o in cpu]
    assert gpu_llm.engine.cache_manager.allocator.is_idle()


@pytest.mark.parametrize("page_size", [1, 16])
def test_graph_replay_equals_eager_for_every_bucket(tiny_model, page_size):
    path = tiny_model("llama")
    eager = LLM(path, device="cuda", dtype="float32", enforce_eager=True, max_num_seqs=16, page_size=page_size)
    graph = LLM(path, device="cuda", dtype="float32", max_num_seqs=16, page_size=page_size)
    assert eager.execution_mode == "eager" and graph.execution_mode == "cuda_graph"
    assert graph.engine.model_runner.graphs.buckets == [1, 2, 4, 8, 16]
    for n in (1, 2, 3, 4, 7, 8, 13, 16):  # every bucket, full and padded
        ps = prompts(n, base=20)
        a = [o.outputs[0].token_ids for o in eager.generate(ps, GREEDY, use_tqdm=False)]
        b = [o.outputs[0].token_ids for o in graph.generate(ps, GREEDY, use_tqdm=False)]
        assert a == b, f"batch {n}"


def test_graph_logits_equal_eager_logits(tiny_model):
    path = tiny_model("qwen3")
    cont = [5, 9, 200, 17, 3, 88]
    ps = prompts(3)
    eager = LLM(path, device="cuda", dtype="float32", enforce_eager=True)
    graph = LLM(path, device="cuda", dtype="float32")
    a = eager.teacher_forced_logprobs(ps, [cont] * 3, use_tqdm=False)
    b = graph.teacher_forced_logprobs(ps, [cont] * 3, use_tqdm=False)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4)


def test_the_collector_is_off_while_graphs_capture(tiny_model, monkeypatch):
    """An engine's parts form cycles, so a dropped LLM's graphs wait for the collector; a collection
    inside the next engine's capture destroyed them mid-capture and invalidated it (H100, the
    mixed-methods test). So every capture runs with the collector off, and it is back on after."""
    seen, real = [], DecodeGraphs._capture

    def capture(self, b, variant):
        seen.append(gc.isenabled())
        real(self, b, variant)
    monkeypatch.setattr(DecodeGraphs, "_capture", capture)
    path = tiny_model("llama")
    ps = prompts(2)
    first = LLM(path, device="cuda", dtype="float32", max_num_seqs=4)
    want = [o.outputs[0].token_ids for o in first.generate(ps, GREEDY, use_tqdm=False)]
    del first   # its graphs now wait for the collector
    second = LLM(path, device="cuda", dtype="float32", max_num_seqs=4)
    assert second.execution_mode == "cuda_graph" and gc.isenabled()
    assert seen and not any(seen)
    assert [o.outputs[0].token_ids for o in second.generate(ps, GREEDY, use_tqdm=False)] == want


def test_bf16_graphs_with_chunked_prefill_and_prefix_cache(tiny_model):
    path = tiny_model("llama")
    llm = LLM(path, device="cuda", chunk_prefill_size=32, max_num_batched_tokens=64)
    assert llm.engine.model_runner.dtype == torch.bfloat16
    ps = prompts(6, base=100)
    first = [o.outputs[0].token_ids for o in llm.generate(ps, GREEDY, use_tqdm=False)]
    again = [o.outputs[0].token_ids for o in llm.generate(ps, GREEDY, use_tqdm=False)]  # prefix-cache hits
    assert first == again
    assert llm.engine.cache_manager.allocator.is_idle()


# Quest's budget lowered to 24 tokens (6 pages of 4): a selection far below the 60-125 token prompts
@pytest.mark.parametrize("method,knobs", [("vanilla", METHOD_KNOBS["vanilla"]), ("snapkv", METHOD_KNOBS["snapkv"]),
                                          ("quest", dict(METHOD_KNOBS["quest"], quest_token_budget=24))])
@pytest.mark.parametrize("quest_fused_store", [False, True])
def test_bf16_store_in_the_qkv_epilogue_equals_the_separate_launch(tiny_model, monkeypatch, method, knobs,
                                                                 quest_fused_store):
    """Decode steps whose qkv GEMM rotates q / k and writes the cache (store_target) give the tokens of
    the GEMM followed by rope_store, under CUDA graphs in bf16 (the skinny kernel forced for the tiny
    model's decode-sized steps; its launches are PDL on the H200, so this also checks their order)."""
    if method != "quest" and quest_fused_store:
        pytest.skip("Quest's knob")
    from sparsevllm.engine.cache_manager import quest as quest_cm
    from sparsevllm.kernels import skinny_gemm
    from sparsevllm.layers import attention, parallel_linear
    decode_sized = lambda x, w: x.numel() <= skinny_gemm.MAX_ROWS * w.shape[1] and x.dtype == torch.bfloat16  # noqa: E731
    monkeypatch.setattr(skinny_gemm, "takes", decode_sized)
    monkeypatch.setattr(parallel_linear, "takes", decode_sized)
    monkeypatch.setattr(quest_cm, "FUSED_STORE", quest_fused_store)
    stores = []
    rope_store = parallel_linear.linear_rope_store
    monkeypatch.setattr(parallel_linear, "linear_rope_store", lambda *a: stores.append(1) or rope_store(*a))
    path = tiny_model("llama")
    ps = prompts(6, base=60)
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = {}
    for epilogue in (False, True):
        monkeypatch.setattr(attention, "FUSED_ROPE_STORE", epilogue)
        llm = LLM(path, device="cuda", vllm_sparse_method=method, max_num_seqs=8, page_size=4, **knobs)
        assert llm.execution_mode == "cuda_graph"
        outs[epilogue] = [o.outputs[0].token_ids for o in llm.generate(ps, sp, use_tqdm=False)]
        assert llm.engine.cache_manager.allocator.is_idle()
        assert bool(stores) == epilogue
    assert outs[True] == outs[False]

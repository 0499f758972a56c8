"""Chunked prefill, prefix caching, batching and preemption never change greedy outputs, and every
generate leaves the page allocator as it found it."""
import pytest

from method_knobs import METHOD_KNOBS
from sparsevllm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def prompts(n=5, base=60):
    return [[(7 * i + 13 * j) % 250 + 3 for j in range(base + 9 * i)] for i in range(n)]


def run(llm, ps, sp=GREEDY):
    outs = llm.generate(ps, sp, use_tqdm=False)
    assert llm.engine.cache_manager.allocator.is_idle()
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def reference(model):
    llm = LLM(model, page_size=16, enable_prefix_caching=False)
    return [run(llm, [p])[0] for p in prompts()]


@pytest.mark.parametrize("chunk", [16, 32, 48, 4096])
def test_chunked_prefill_equals_one_shot(model, reference, chunk):
    llm = LLM(model, page_size=16, chunk_prefill_size=chunk, max_num_batched_tokens=max(chunk, 64),
              enable_prefix_caching=False)
    assert run(llm, prompts()) == reference


def test_chunk_of_one_page_with_page_size_one(model, reference):
    llm = LLM(model, page_size=1, chunk_prefill_size=1, max_num_batched_tokens=3)
    assert run(llm, prompts(2)) == reference[:2]


def test_batch_invariance(model, reference):
    llm = LLM(model, page_size=16, max_num_seqs=3)
    assert run(llm, prompts()) == reference
    assert run(llm, list(reversed(prompts()))) == list(reversed(reference))


def test_prefix_cache_hit_equals_miss(model):
    shared = [(5 * j) % 240 + 4 for j in range(70)]
    ps = [shared + [9, 8, 7], shared + [100, 101], shared]
    cold = LLM(model, page_size=16, enable_prefix_caching=False)
    expected = run(cold, ps)
    warm = LLM(model, page_size=16)
    assert run(warm, ps[:1]) == expected[:1]
    free_before = warm.engine.cache_manager.allocator.num_free
    seqs = [warm.engine.add_request(p, GREEDY) for p in ps[1:]]
    first = warm.engine.scheduler._schedule_prefill()
    hits = [s.num_computed_tokens for s in seqs]
    assert hits == [64, 64], "the 4 full shared pages should be reused"
    assert sum(first.num_tokens) == len(ps[1]) - 64 + len(ps[2]) - 64
    for s in first.seqs:  # undo the manual scheduling and run normally
        warm.engine.scheduler.preempt(s)
    warm.engine.run(seqs, use_tqdm=False)
    assert [s.completion_token_ids for s in seqs] == expected[1:]
    assert warm.engine.cache_manager.allocator.num_free == free_before


def test_preemption_under_tiny_kv_budget_keeps_outputs(model, reference):
    # 14 pages of 16 tokens: two of these requests fit at once, so decode growth forces preemption.
    llm = LLM(model, page_size=16, num_kv_pages=14, enable_prefix_caching=False)
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    ref_llm = LLM(model, page_size=16, enable_prefix_caching=False)
    expected = run(ref_llm, prompts(), sp)
    assert run(llm, prompts(), sp) == expected
    assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("case", [
    (9, 16, 32, [101, 66, 95, 71, 69], 15),
    (12, 48, 96, [90, 101, 131], 12),
])
def test_prompts_preempted_while_prefilling_never_fail_a_request_that_fits(model, case):
    """Prompts admitted together outgrow a small pool while still prefilling; the one preempted
    first must not end the step with nothing to run (the engine then failed a request that fits
    alone: "no longer fits the KV pool"). Every request finishes, as it does with room to spare."""
    pages, chunk, batched, lens, max_tokens = case
    ps = [[(11 * i + 5 * j) % 240 + 3 for j in range(n)] for i, n in enumerate(lens)]
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    want = run(LLM(model, page_size=16, enable_prefix_caching=False), ps, sp)
    llm = LLM(model, page_size=16, num_kv_pages=pages, chunk_prefill_size=chunk, max_num_batched_tokens=batched,
              max_num_seqs=4, enable_prefix_caching=False)
    outs = llm.generate(ps, sp, use_tqdm=False)
    assert [o.error for o in outs] == [None] * len(ps)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert llm.engine.cache_manager.allocator.is_idle() and llm.engine.scheduler.num_preemptions > 0


def test_max_tokens_eos_and_stop_tokens(model, reference):
    llm = LLM(model)
    p = prompts(1)[0]
    full = reference[0]
    out = llm.generate(p, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == full[:3] and out.outputs[0].finish_reason == "length"
    stop = full[4]
    out = llm.generate(p, SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[stop]), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == full[:full.index(stop) + 1] and out.outputs[0].finish_reason == "stop"
    llm.engine.eos_token_ids = {full[2]}
    out = llm.generate(p, SamplingParams(temperature=0.0, max_tokens=10), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == full[:full.index(full[2]) + 1] and out.outputs[0].finish_reason == "stop"


def test_max_model_len_stops_generation(model, reference):
    p = prompts(1)[0]
    llm = LLM(model, max_model_len=len(p) + 4)
    out = llm.generate(p, GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == reference[0][:4] and out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize("method, knobs", [("quest", METHOD_KNOBS["quest"]), ("omnikv", METHOD_KNOBS["omnikv"])])
def test_a_prefix_hit_on_generated_tokens_equals_a_miss_with_a_sparse_decode(tiny_model, method, knobs):
    """A sparse decode view gives the generated tokens' later layers other inputs than prefill
    would, so their KV is not the KV a miss computes; a follow-up prompt (a chat's next turn: prompt,
    answer, new message) must get the same output whether the first turn ran on this engine or not."""
    path = tiny_model("llama", num_hidden_layers=4)
    first = prompts(1, base=100)[0]
    kw = dict(vllm_sparse_method=method, page_size=8, **knobs)
    warm = LLM(path, **kw)
    answer = run(warm, [first], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))[0]
    follow_up = first + answer[:32] + [5, 6, 7]
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=0)

    def first_logprob(llm):
        out = llm.generate(follow_up, sp, use_tqdm=False)[0].outputs[0]
        return out.logprobs[0][out.token_ids[0]].logprob

    assert first_logprob(warm) == pytest.approx(first_logprob(LLM(path, **kw)), abs=1e-5)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_prompt_that_exactly_fills_the_pool_is_served_when_it_needs_no_decode(model, async_scheduling):
    """max_tokens=1 finishes at prefill: the first decode token's KV, which admission reserves for
    every other request, is never written, so a prompt of exactly the pool's size must run."""
    p = [(3 * j) % 240 + 5 for j in range(64)]
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    expected = run(LLM(model, page_size=16, enable_prefix_caching=False), [p], one)
    llm = LLM(model, page_size=16, num_kv_pages=4, async_scheduling=async_scheduling)
    outs = llm.generate([p], one, use_tqdm=False)
    assert outs[0].error is None and outs[0].outputs[0].finish_reason == "length"
    assert [o.outputs[0].token_ids for o in outs] == expected
    allocator = llm.engine.cache_manager.allocator
    assert allocator.is_idle() and allocator.num_free == allocator.num_pages == 4
    # A request that can still decode keeps its reservation: it never fits this pool.
    two = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    out = llm.generate([p], two, use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "error" and "num_kv_pages" in out.error
    assert allocator.is_idle()


def test_a_preempted_request_reserves_decode_room_only_if_it_has_tokens_left(model):
    """Recomputing a preempted request counts what it generated: with its last token sampled by
    the prefill, it needs no room for a decode token's KV."""
    from sparsevllm.engine.sequence import Sequence
    cm = LLM(model, page_size=16, num_kv_pages=4).engine.cache_manager
    p = [(3 * j) % 240 + 5 for j in range(63)]
    for max_tokens, fits in [(2, True), (3, False)]:
        seq = Sequence(p, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        seq.append_token(7)   # generated before the preemption: 64 tokens to recompute
        assert cm.can_admit(seq) == fits

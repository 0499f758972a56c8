"""The offline API as vLLM users expect it: RequestOutput objects (dict keys still readable, with a
warning), stop strings split across tokens, n samples sharing the prompt's pages, logprobs and
prompt_logprobs equal to teacher forcing, penalties against a naive Hugging Face loop, min_tokens,
type checks on every SamplingParams field, and the max_model_len warning."""
import logging
import re
import warnings

import pytest
import torch

from helpers import prompts
from sparsevllm import LLM, SamplingParams
from sparsevllm.outputs import CompletionOutput, RequestOutput

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def smol():
    return LLM(max_num_seqs=4, cpu_kv_cache_gb=0.5)


# ---------------------------------------------------------------- outputs and type checks

def test_generate_returns_request_outputs_and_old_keys_still_read(tiny):
    llm = LLM(tiny, device="cpu")
    out = llm.generate([prompts([20])[0]], GREEDY, use_tqdm=False)[0]
    assert isinstance(out, RequestOutput) and isinstance(out.outputs[0], CompletionOutput)
    assert out.prompt_token_ids == prompts([20])[0] and out.finished and out.error is None
    first = out.outputs[0]
    assert len(first.token_ids) == 12 and first.finish_reason == "length" and first.logprobs is None
    assert set(out.metrics) >= {"arrival_time", "first_token_time", "finish_time", "token_times"}
    with pytest.warns(DeprecationWarning, match="out.outputs\\[0\\].text"):
        assert out["token_ids"] == first.token_ids
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        assert out["finish_reason"] == "length" and out.get("error") is None and out["metrics"] is out.metrics


@pytest.mark.parametrize("field,value", [
    ("temperature", "0"), ("top_p", 0.0), ("top_k", 0), ("top_k", 2.5), ("max_tokens", 0), ("n", 0),
    ("min_tokens", 20), ("stop", ""), ("stop", ["ok", 3]), ("stop_token_ids", [-1]), ("logprobs", -1),
    ("prompt_logprobs", "5"), ("repetition_penalty", 0.0), ("presence_penalty", 3.0), ("frequency_penalty", "1"),
    ("seed", 1.5), ("seed", 2**64), ("seed", -2**63 - 1), ("ignore_eos", "yes"), ("include_stop_str_in_output", 1),
    ("skip_special_tokens", None)])
def test_every_sampling_params_field_is_type_checked(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field} must be .*got {re.escape(repr(value))}"):
        SamplingParams(**{field: value})


def test_max_tokens_cut_by_max_model_len_warns(tiny, caplog):
    llm = LLM(tiny, device="cpu", max_model_len=40)
    with caplog.at_level(logging.WARNING):
        out = llm.generate([prompts([30])[0]], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True),
                           use_tqdm=False)[0]
    assert "max_tokens=50 is cut to 10 by max_model_len=40" in caplog.text
    assert len(out.outputs[0].token_ids) == 10 and out.outputs[0].finish_reason == "length"


# ---------------------------------------------------------------- stop strings

def test_stop_string_split_across_tokens_ends_the_output(smol):
    prompt = [{"role": "user", "content": "Write a short story about a cat."}]
    free = smol.chat(prompt, SamplingParams(temperature=0.0, max_tokens=40), use_tqdm=False)[0].outputs[0]
    tok = smol.tokenizer
    pieces = [tok.decode(free.token_ids[:i]) for i in range(len(free.token_ids) + 1)]
    # a stop string that starts inside one token and ends inside a later one
    k = next(i for i in range(3, len(free.token_ids) - 2)
             if len(pieces[i]) - len(pieces[i - 1]) >= 2 and len(pieces[i + 1]) - len(pieces[i]) >= 2)
    stop = pieces[k + 1][len(pieces[k]) - 1:len(pieces[k]) + 1]
    at = free.text.index(stop)
    for include in (False, True):
        out = smol.chat(prompt, SamplingParams(temperature=0.0, max_tokens=40, stop=[stop, "zzzz-never"],
                                               include_stop_str_in_output=include), use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert out.text == free.text[:at + (len(stop) if include else 0)]
        assert out.token_ids == free.token_ids[:len(out.token_ids)] and len(out.token_ids) < len(free.token_ids)
    assert smol.engine.cache_manager.allocator.is_idle()


def test_stop_strings_without_a_tokenizer_fail_alone(tiny):
    llm = LLM(tiny, device="cpu")
    outs = llm.generate(prompts([10, 10]), [SamplingParams(stop=["x"]), GREEDY], use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error" and "stop strings need a tokenizer" in outs[0].error
    assert outs[1].outputs[0].finish_reason == "length"


# ---------------------------------------------------------------- n samples

def test_n_samples_share_the_prompt_pages_and_free_them_once(tiny):
    llm = LLM(tiny, device="cpu", page_size=8)
    cm = llm.engine.cache_manager
    allocate, calls = cm.allocator.allocate, []
    cm.allocator.allocate = lambda: calls.append(1) or allocate()
    prompt = prompts([83], seed=2)[0]                       # 10 full pages + 3 tokens
    sp = SamplingParams(n=3, temperature=1.0, max_tokens=6, ignore_eos=True, seed=11)
    out = llm.generate([prompt], sp, use_tqdm=False)[0]
    assert len(out.outputs) == 3 and [o.index for o in out.outputs] == [0, 1, 2]
    assert all(len(o.token_ids) == 6 and o.finish_reason == "length" for o in out.outputs)
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1          # different samples
    # the first sample allocates the prompt's 11 pages; the others only their own last page
    assert len(calls) == 11 + 2 * 1
    assert cm.allocator.is_idle()                                       # released once each
    again = llm.generate([prompt], sp, use_tqdm=False)[0]
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in out.outputs]   # seeded
    solo = llm.generate([prompt], sp.clone(n=1), use_tqdm=False)[0]
    assert solo.outputs[0].token_ids == out.outputs[0].token_ids


# ---------------------------------------------------------------- logprobs

def test_logprobs_equal_teacher_forced_logprobs(tiny):
    llm = LLM(tiny, device="cpu")
    ps = prompts([30, 17], seed=3)
    outs = llm.generate(ps, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3),
                        use_tqdm=False)
    forced = llm.teacher_forced_logprobs(ps, [o.outputs[0].token_ids for o in outs], use_tqdm=False)
    for out, rows in zip(outs, forced):
        first = out.outputs[0]
        assert len(first.logprobs) == len(first.token_ids)
        for token, entry, row in zip(first.token_ids, first.logprobs, rows):
            assert entry[token].rank == 1                                 # greedy picks the argmax
            assert entry[token].logprob == pytest.approx(float(row[token]), abs=1e-5)
            top = row.topk(3)
            assert {t: round(v.logprob, 4) for t, v in entry.items()} == \
                {int(t): round(float(v), 4) for t, v in zip(top.indices, top.values)}
        assert first.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(first.token_ids,
                                                                                             first.logprobs)))


def test_prompt_logprobs_equal_teacher_forcing_over_the_prompt(tiny):
    llm = LLM(tiny, device="cpu", chunk_prefill_size=16)            # the prompt spans several chunks
    prompt = prompts([40], seed=4)[0]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2), use_tqdm=False)[0]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    forced = llm.teacher_forced_logprobs([prompt[:1]], [prompt[1:]], use_tqdm=False)[0]
    for j, entry in enumerate(out.prompt_logprobs[1:], start=1):
        assert entry[prompt[j]].logprob == pytest.approx(float(forced[j - 1][prompt[j]]), abs=1e-4)
        assert len(entry) <= 3 and entry[prompt[j]].rank == int((forced[j - 1] > forced[j - 1][prompt[j]]).sum()) + 1
    assert llm.engine.cache_manager.allocator.is_idle()


# ---------------------------------------------------------------- penalties and min_tokens

def naive_penalized_greedy(hf, prompt, n, rep, pres, freq):
    """Greedy decoding with the penalties written out, on the Hugging Face model (full recompute)."""
    ids = list(prompt)
    for _ in range(n):
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1].double()
        out = ids[len(prompt):]
        for t in set(ids):
            logits[t] = logits[t] / rep if logits[t] > 0 else logits[t] * rep
        for t in set(out):
            logits[t] -= freq * out.count(t) + pres
        ids.append(int(logits.argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_penalties_equal_a_naive_implementation(tiny, async_scheduling):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    llm = LLM(tiny, device="cpu", async_scheduling=async_scheduling)
    ps = prompts([12, 25], seed=5)
    cases = [(1.3, 0.0, 0.0), (1.0, 0.5, 0.3), (0.8, -0.2, 0.7)]
    params = [SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True, repetition_penalty=r,
                             presence_penalty=p, frequency_penalty=f) for r, p, f in cases]
    for sp, (r, p, f) in zip(params, cases):
        outs = llm.generate(ps, [sp, GREEDY.clone(max_tokens=14)], use_tqdm=False)
        assert outs[0].outputs[0].token_ids == naive_penalized_greedy(hf, ps[0], 14, r, p, f), (r, p, f)
        assert outs[1].outputs[0].token_ids == naive_penalized_greedy(hf, ps[1], 14, 1.0, 0.0, 0.0)


def test_min_tokens_holds_back_eos_and_stop_tokens(tiny):
    llm = LLM(tiny, device="cpu")
    p = prompts([15], seed=6)[0]
    free = llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    llm.engine.eos_token_ids = {free[1]}                          # EOS would come second
    short = llm.generate([p], SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)[0].outputs[0]
    assert short.token_ids == free[:2] and short.finish_reason == "stop"
    held = llm.generate([p], SamplingParams(temperature=0.0, max_tokens=12, min_tokens=6,
                                            stop_token_ids=[free[3]]), use_tqdm=False)[0].outputs[0]
    assert len(held.token_ids) >= 6 and free[1] not in held.token_ids[:6] and free[3] not in held.token_ids[:6]


def test_a_stop_string_before_min_tokens_does_not_cut_the_output_later():
    """vLLM checks stop strings from min_tokens on, in the text each new token adds. The first
    search at min_tokens once covered the whole output and cut it at an earlier occurrence."""
    from sparsevllm.engine.output_processor import OutputProcessor
    from sparsevllm.engine.sequence import Sequence

    class Letters:   # token id i decodes to the letter chr(ord("a") + i)
        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(ord("a") + i) for i in ids)

    def run(params, tokens):
        proc, seq = OutputProcessor(Letters(), set(), 100), Sequence([0], params)
        for t in tokens:
            seq.append_token(t)
            if reason := proc.finish_reason(seq, t):
                return reason, proc.text(seq)
        return None, proc.text(seq)
    # "b" is the 2nd token: before min_tokens=3 it cannot stop, and no later token adds a "b"
    assert run(SamplingParams(stop=["b"], min_tokens=3, max_tokens=10), [0, 1, 2, 3]) == (None, "abcd")
    assert run(SamplingParams(stop=["b"], min_tokens=3, max_tokens=10), [0, 1, 2, 1, 3]) == ("stop", "abc")
    # a stop string that the min_tokens-th token completes still counts
    assert run(SamplingParams(stop=["bc"], min_tokens=3, max_tokens=10), [0, 1, 2, 3]) == ("stop", "a")
    assert run(SamplingParams(stop=["b"], max_tokens=10), [0, 1, 2]) == ("stop", "a")


def test_closing_a_stream_aborts_samples_still_running_after_the_first_finished(tiny):
    """AsyncLLM: a client that goes away aborts every sample of its request, not only while the
    first one runs."""
    import asyncio
    import time

    from sparsevllm.engine.async_engine import AsyncLLM
    llm = LLM(tiny, device="cpu")
    p = prompts([12], seed=2)[0]
    sp = SamplingParams(n=2, temperature=0.9, seed=5, max_tokens=300, ignore_eos=True)
    free = [o.token_ids for o in llm.generate([p], sp, use_tqdm=False)[0].outputs]
    stop = next(t for t in free[0][1:] if t not in free[1])   # ends the first sample only
    added = []
    add_request = llm.engine.add_request
    llm.engine.add_request = lambda *a, **k: added.append(add_request(*a, **k)) or added[-1]
    async_llm = AsyncLLM(llm.engine)

    async def client():
        stream = async_llm.generate(p, sp.clone(stop_token_ids=[stop]))
        async for out in stream:
            if out.outputs[0].finish_reason is not None:
                assert out.outputs[1].finish_reason is None
                await stream.aclose()
                return

    try:
        asyncio.run(client())
        for _ in range(1000):
            if not llm.engine.has_work():
                break
            time.sleep(0.01)
        time.sleep(0.6)   # a loop turn after the abort: nothing is sent to the client's closed event loop
        assert async_llm._thread.is_alive()
    finally:
        async_llm.shutdown()
    assert [s.finish_reason for s in added[0].group] == ["stop", "abort"]
    assert llm.engine.cache_manager.allocator.is_idle()


def _wait_idle(engine, seconds=10.0):
    import time
    end = time.time() + seconds
    while engine.has_work() and time.time() < end:
        time.sleep(0.01)


def test_a_stream_closed_before_the_engine_thread_takes_it_is_aborted(tiny):
    """AsyncLLM: a client gone before its request reached the engine (the engine thread was busy)
    does not leave it running to max_tokens for nobody."""
    import asyncio
    import time

    from sparsevllm.engine.async_engine import AsyncLLM
    llm = LLM(tiny, device="cpu")
    added = []
    add_request = llm.engine.add_request

    def slow_add(*a, **k):   # the engine thread takes the request only after the client left
        time.sleep(0.3)
        added.append(add_request(*a, **k))
        return added[-1]
    llm.engine.add_request = slow_add
    async_llm = AsyncLLM(llm.engine)

    async def client():
        stream = async_llm.generate(prompts([12], seed=4)[0], SamplingParams(max_tokens=300, ignore_eos=True))
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(stream.__anext__(), timeout=0.05)
        await stream.aclose()

    try:
        asyncio.run(client())
        time.sleep(0.5)
        _wait_idle(llm.engine)
        assert async_llm._thread.is_alive()
    finally:
        async_llm.shutdown()
    assert [s.finish_reason for s in added[0].group] == ["abort"] and added[0].num_completion_tokens < 300
    assert llm.engine.cache_manager.allocator.is_idle()


def test_a_closed_client_loop_does_not_stop_the_engine_thread(tiny):
    """Publishing to a client's event loop that is closed (asyncio.run returned while the engine
    thread still held its request) aborts that request; the thread serves the next client."""
    import asyncio
    import time

    from sparsevllm.engine.async_engine import AsyncLLM, _Stream
    llm = LLM(tiny, device="cpu")
    async_llm = AsyncLLM(llm.engine)
    try:
        dead = asyncio.new_event_loop()
        dead.close()
        async_llm._inbox.put(("add", prompts([12], seed=5)[0], SamplingParams(max_tokens=300, ignore_eos=True),
                              None, _Stream(dead), time.perf_counter()))
        async_llm._wake.set()
        _wait_idle(llm.engine)
        assert async_llm._thread.is_alive() and not async_llm._streams

        async def client():
            outs = [o async for o in async_llm.generate(prompts([10], seed=6)[0], GREEDY)]
            return outs[-1].outputs[0]
        last = asyncio.run(client())
        assert last.finish_reason == "length" and len(last.token_ids) == 12
    finally:
        async_llm.shutdown()
    assert llm.engine.cache_manager.allocator.is_idle()

"""The OpenAI-compatible server, started on loopback inside the test, driven by the official
`openai` client: completions and chat (streaming and not) equal LLM.generate; a cancelled stream
frees its pages; 32 concurrent clients; bad requests get the right 4xx and the server stays up."""
import asyncio
import contextlib
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from sparsevllm import LLM, SamplingParams  # noqa: E402
from sparsevllm.engine.async_engine import AsyncLLM  # noqa: E402
from sparsevllm.serve import build_app  # noqa: E402

KNOBS = dict(max_num_seqs=32, cpu_kv_cache_gb=0.5)
KEY = "test-key"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def http(method: str, url: str, body: str | None = None, key: str | None = KEY) -> tuple[int, str]:
    """A raw request (stdlib), for what the openai client would not send."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url, data=body.encode() if body is not None else None, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(llm, name: str, key: str | None = None):
    """llm's engine served over HTTP on a free loopback port, in a thread: yields the base URL; stops
    the server and the engine thread after."""
    async_llm = AsyncLLM(llm.engine)
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(build_app(async_llm, name, key), host="127.0.0.1", port=port,
                                        log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    try:
        while not srv.started:
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(timeout=30)
        async_llm.shutdown()


@pytest.fixture(scope="module")
def server():
    llm = LLM(**KNOBS)
    with serving(llm, "smollm2", KEY) as url:
        yield url, llm.engine


@pytest.fixture(scope="module")
def reference():
    return LLM(**KNOBS)


def client(url, key=KEY):
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


def idle(engine, timeout=30.0) -> bool:
    end = time.time() + timeout
    while time.time() < end:
        if engine.cache_manager.allocator.is_idle() and not engine.has_work():
            return True
        time.sleep(0.05)
    return False


def test_completions_and_chat_equal_llm_generate(server, reference):
    url, engine = server
    c = client(url)
    want = reference.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=12),
                              use_tqdm=False)[0].outputs[0]
    got = c.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=12, temperature=0)
    assert got.choices[0].text == want.text and got.choices[0].finish_reason == want.finish_reason
    assert got.usage.completion_tokens == len(want.token_ids)
    streamed = c.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=12,
                                    temperature=0, stream=True)
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == want.text
    chat_want = reference.chat(QUESTION, SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)[0].outputs[0]
    chat = c.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=24, temperature=0)
    assert chat.choices[0].message.content == chat_want.text and "Paris" in chat_want.text
    assert chat.choices[0].finish_reason == chat_want.finish_reason
    parts = c.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=24, temperature=0, stream=True,
                                      stream_options={"include_usage": True})
    chunks = list(parts)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == chat_want.text
    assert chunks[-1].usage.completion_tokens == len(chat_want.token_ids)
    assert idle(engine)


def test_logprobs_stop_and_models(server, reference):
    url, _ = server
    c = client(url)
    models = c.models.list().data
    assert models[0].id == "smollm2" and models[0].sparse_method == "vanilla"
    got = c.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=6, temperature=0,
                               logprobs=2)
    lp = got.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 6 and all(len(t) <= 2 for t in lp.top_logprobs)
    full = reference.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=12),
                              use_tqdm=False)[0].outputs[0].text
    stop = full[4:7]
    cut = c.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=12, temperature=0,
                               stop=[stop])
    assert cut.choices[0].text == full[:full.index(stop)] and cut.choices[0].finish_reason == "stop"
    # streamed, the text before a stop string is held back until it cannot be part of it
    parts = c.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=12, temperature=0,
                                 stop=[stop], stream=True)
    assert "".join(ch.choices[0].text for ch in parts if ch.choices) == cut.choices[0].text
    metrics = http("GET", url + "/metrics")[1]
    assert "sparsevllm_time_to_first_token_seconds_count" in metrics and "sparsevllm_kv_pages_used" in metrics


def test_cancelling_a_stream_frees_its_pages(server):
    url, engine = server
    c = client(url)
    stream = c.completions.create(model="smollm2", prompt="Tell me a long story.", max_tokens=2000, temperature=0.8,
                                  stream=True, extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    assert idle(engine), "pages of the cancelled request were not freed"


@pytest.mark.long
def test_32_concurrent_clients_with_mixed_lengths(server, reference):
    url, engine = server
    prompts = [f"Count to {i % 7 + 2}:" for i in range(32)]
    lengths = [4 + (i * 5) % 23 for i in range(32)]

    async def run():
        c = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        return await asyncio.gather(*(c.completions.create(model="smollm2", prompt=p, max_tokens=n, temperature=0,
                                                           extra_body={"ignore_eos": True})
                                      for p, n in zip(prompts, lengths)))
    outs = asyncio.run(run())
    assert [o.usage.completion_tokens for o in outs] == lengths
    assert all(o.choices[0].finish_reason == "length" for o in outs)
    want = reference.generate(prompts[:4], [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                                            for n in lengths[:4]], use_tqdm=False)
    assert [o.choices[0].text for o in outs[:4]] == [w.outputs[0].text for w in want]
    assert idle(engine)


@pytest.mark.parametrize("body,status,message", [
    ('{"model": "smollm2", "prompt": "hi"', 400, "not valid JSON"),
    ('{"model": "smollm2", "prompt": "hi", "bogus_field": 1}', 400, "unknown field 'bogus_field'"),
    ('{"model": "smollm2", "prompt": "hi", "max_tokens": -3}', 400, "max_tokens"),
    ('{"model": "smollm2", "prompt": "hi", "temperature": "hot"}', 400, "temperature"),
    ('{"model": "other", "prompt": "hi"}', 404, "not served here"),
    ('{"model": "smollm2", "prompt": "' + "word " * 9000 + '"}', 400, "max_model_len"),
], ids=["malformed_json", "unknown_field", "negative_max_tokens", "wrong_type", "unknown_model", "prompt_too_long"])
def test_bad_requests_get_a_4xx_and_the_server_stays_up(server, body, status, message):
    url, engine = server
    code, text = http("POST", url + "/v1/completions", body)
    assert code == status and message in json.loads(text)["error"]["message"], text
    assert http("GET", url + "/health")[0] == 200
    assert idle(engine)


def test_a_wrong_api_key_is_a_401_and_health_and_metrics_need_none(server):
    url, _ = server
    with pytest.raises(openai.AuthenticationError):
        client(url, key="wrong").completions.create(model="smollm2", prompt="hi", max_tokens=2)
    assert http("GET", url + "/v1/models", key=None)[0] == 401
    assert http("GET", url + "/health", key=None)[0] == 200 and http("GET", url + "/metrics", key=None)[0] == 200


@pytest.mark.long   # a benchmark script's server and client processes
def test_online_benchmark_reports_latencies_and_throughput(tmp_path):
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.path.join(root, "src"))
    out = tmp_path / "online"
    proc = subprocess.run([sys.executable, os.path.join(root, "scripts", "benchmarks", "bench_online.py"),
                           "--model_path", "tiny", "--input_len", "48", "--output_len", "8", "--num_requests", "6",
                           "--request_rates", "50,inf", "--hyper_params", '{"device": "cpu"}', "--out_dir", str(out)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["request_rate"] for r in rows] == [50.0, float("inf")]
    for r in rows:
        assert r["num_requests"] == 6 and r["output_tokens"] == 48 and r["output_tok_s"] > 0
        assert 0 < r["ttft_p50_ms"] <= r["ttft_p99_ms"] and 0 < r["e2e_p50_ms"] <= r["e2e_p99_ms"]
        assert r["itl_p50_ms"] is not None
        # the engine's side of TTFT (receipt -> first token) is part of what the client waits
        assert 0 < r["server_ttft_mean_ms"] <= r["ttft_mean_ms"]
    assert (out / "summary.md").read_text().count("|") > 20 and (out / "plot.png").stat().st_size > 0


def test_latency_histogram_counts_like_a_naive_count():
    """/metrics' histograms keep bucket counts, not every observation (constant memory)."""
    from sparsevllm.engine.async_engine import Histogram
    values = [0.0, 0.005, 0.0051, 0.3, 2.5, 100.0] + [i / 997 for i in range(500)]
    h = Histogram()
    for v in values:
        h.observe(v)
    assert h.counts == [sum(v <= le for v in values) for le in h.bounds]
    assert h.count == len(values) and abs(h.sum - sum(values)) < 1e-9


# ---------------------------------------------------------------- a tiny model with a tokenizer (fast)

@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    """A 2-layer random Llama with a small BPE tokenizer and a ChatML template, served without a key."""
    import os
    import sys
    sys.path.insert(0, os.path.dirname(__file__))
    from regression_fixtures import build_tiny_llama
    llm = LLM(build_tiny_llama(str(tmp_path_factory.mktemp("tinytok")), max_position_embeddings=256), device="cpu")
    with serving(llm, "tiny") as url:
        yield url, llm


def post(url: str, body: dict) -> tuple[int, dict | str]:
    code, text = http("POST", url, json.dumps(body), key=None)
    return code, (json.loads(text) if text.startswith("{") else text)


def test_a_seed_beyond_the_generators_range_is_a_400(tiny_server):
    url, llm = tiny_server
    code, body = post(url + "/v1/completions", {"prompt": "hi", "max_tokens": 2, "seed": 2**70})
    assert code == 400 and "seed" in body["error"]["message"], body
    assert idle(llm.engine)


def test_chat_without_max_tokens_runs_to_the_end_of_the_context(tiny_server):
    """OpenAI's and vLLM's chat default is no limit but the context (completions keep 16)."""
    url, llm = tiny_server
    code, body = post(url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}],
                                                     "temperature": 0, "ignore_eos": True})
    assert code == 200, body
    assert body["usage"]["total_tokens"] == llm.config.max_model_len == 256
    assert body["choices"][0]["finish_reason"] == "length"
    code, body = post(url + "/v1/completions", {"prompt": "hello", "temperature": 0, "ignore_eos": True})
    assert code == 200 and body["usage"]["completion_tokens"] == 16, body


def sse_events(text: str) -> list:
    events = [line[len("data: "):] for line in text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_streamed_logprobs_report_each_token_once(tiny_server):
    """Each chunk carries the log-probabilities of its new tokens (completions repeated every earlier
    token in every chunk; chat streamed none), so the chunks add up to the non-streamed answer."""
    url, llm = tiny_server
    ask = {"prompt": "hello there", "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 2}
    whole = post(url + "/v1/completions", ask)[1]["choices"][0]["logprobs"]
    code, text = http("POST", url + "/v1/completions", json.dumps({**ask, "stream": True}), key=None)
    chunks = [c["choices"][0]["logprobs"] for c in sse_events(text)]
    assert code == 200 and {k: sum((c[k] for c in chunks), []) for k in whole} == whole
    chat = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "logprobs": True, "top_logprobs": 2}
    whole = post(url + "/v1/chat/completions", chat)[1]["choices"][0]["logprobs"]["content"]
    code, text = http("POST", url + "/v1/chat/completions", json.dumps({**chat, "stream": True}), key=None)
    assert code == 200 and len(whole) == 6
    assert sum((c["choices"][0]["logprobs"]["content"] for c in sse_events(text)), []) == whole


def test_echo_of_a_token_id_prompt_and_of_a_stream(tiny_server):
    """echo returns the prompt's text before the completion: also for a prompt sent as token ids,
    and in a stream (its first chunk), as vLLM does."""
    url, llm = tiny_server
    ask = {"prompt": "hello there", "max_tokens": 4, "temperature": 0, "ignore_eos": True, "echo": True}
    want = post(url + "/v1/completions", ask)[1]["choices"][0]["text"]
    assert want.startswith("hello there") and len(want) > len("hello there")
    ids = llm.tokenizer.encode("hello there")
    assert post(url + "/v1/completions", {**ask, "prompt": ids})[1]["choices"][0]["text"] == want
    code, text = http("POST", url + "/v1/completions", json.dumps({**ask, "stream": True}), key=None)
    assert code == 200 and "".join(c["choices"][0]["text"] for c in sse_events(text)) == want


# (field, value) pairs of the fields the server hands to SamplingParams: a string is not a number,
# a float not an integer, a bool neither, a JSON integer is a number; values out of range too
SAMPLING_VALUES = [
    ("temperature", "0.5"), ("temperature", True), ("temperature", 0), ("temperature", 0.5), ("temperature", -1),
    ("top_p", "1"), ("top_p", 1), ("top_p", 0),
    ("top_k", "2"), ("top_k", 2.0), ("top_k", True), ("top_k", 2),
    ("max_tokens", "2"), ("max_tokens", 2.0), ("max_tokens", True), ("max_tokens", 0),
    ("min_tokens", "1"), ("min_tokens", 1.0), ("min_tokens", 1),
    ("ignore_eos", "true"), ("ignore_eos", 1), ("ignore_eos", True),
    ("seed", "3"), ("seed", 3.0), ("seed", True), ("seed", 3), ("seed", 2**70),
    ("stop", 5), ("stop", ["a", 5]), ("stop", ""), ("stop", ["x"]),
    ("stop_token_ids", ["2"]), ("stop_token_ids", [2.0]), ("stop_token_ids", [True]), ("stop_token_ids", [2]),
    ("logprobs", "1"), ("logprobs", 1.0), ("logprobs", True), ("logprobs", 1),
    ("presence_penalty", "0"), ("presence_penalty", False), ("presence_penalty", 1), ("presence_penalty", 3),
    ("frequency_penalty", "0.1"), ("frequency_penalty", -0.5),
    ("repetition_penalty", "1.0"), ("repetition_penalty", True), ("repetition_penalty", 2),
    ("n", "1"), ("n", 1.0), ("n", True), ("n", 1),
]


@pytest.mark.parametrize("field,value", SAMPLING_VALUES, ids=[f"{f}={v!r}" for f, v in SAMPLING_VALUES])
def test_the_server_refuses_a_sampling_field_exactly_when_sampling_params_does(tiny_server, field, value):
    url, _ = tiny_server
    ask = {"max_tokens": 1, field: value}
    try:
        SamplingParams(**ask)
        refused = False
    except (TypeError, ValueError):
        refused = True
    code, body = post(url + "/v1/completions", {"prompt": "hi", **ask})
    if refused:
        assert code == 400 and body["error"]["param"] == field, body
    else:
        assert code == 200, body


@pytest.mark.parametrize("endpoint,field,value,param", [
    ("completions", "prompt", 5, "prompt"),
    ("completions", "echo", 1, "echo"),
    ("completions", "stream", "false", "stream"),
    ("completions", "model", 3, "model"),
    ("completions", "user", 7, "user"),
    ("completions", "stream_options", {"include_usage": "yes"}, "stream_options"),
    ("completions", "n", 2, "n"),
    ("chat/completions", "messages", "hello", "messages"),
    ("chat/completions", "logprobs", "true", "logprobs"),
    ("chat/completions", "top_logprobs", 1.5, "top_logprobs"),
    ("chat/completions", "max_completion_tokens", "8", "max_completion_tokens"),
    # values SamplingParams refuses, named by the request field they came from
    ("chat/completions", "max_completion_tokens", 0, "max_completion_tokens"),
    ("chat/completions", "top_logprobs", -1, "top_logprobs"),
], ids=lambda x: x if isinstance(x, str) else None)
def test_a_wrong_server_field_is_a_400_naming_it(tiny_server, endpoint, field, value, param):
    url, _ = tiny_server
    ask = {"prompt": "hi"} if endpoint == "completions" else {"messages": [{"role": "user", "content": "hi"}],
                                                              "logprobs": True}
    code, body = post(f"{url}/v1/{endpoint}", {**ask, "max_tokens": 1, field: value})
    assert code == 400 and body["error"]["param"] == param, body


@pytest.mark.parametrize("body,message", [
    ('{"prompt": "hi", "max_tokens": 1', "request body is not valid JSON"),
    ("[1, 2]", "request body: Input should be a valid dictionary"),
], ids=["malformed_json", "not_an_object"])
def test_a_body_that_is_not_a_json_object_is_a_400_naming_no_field(tiny_server, body, message):
    url, _ = tiny_server
    code, text = http("POST", url + "/v1/completions", body, key=None)
    error = json.loads(text)["error"]
    assert code == 400 and error["message"].startswith(message) and error["param"] is None, text


def test_recall_sample_every_reports_recall_histograms_in_metrics(tmp_path, capsys):
    """--recall-sample-every: each finished request's attention recall and output error in /metrics."""
    import os
    import sys
    sys.path.insert(0, os.path.dirname(__file__))
    from regression_fixtures import build_tiny_llama
    from sparsevllm.serve.cli import main
    assert main(["--recall-sample-every", "-1"]) == 2 and "recall_sample_every" in capsys.readouterr().err
    llm = LLM(build_tiny_llama(str(tmp_path), max_position_embeddings=256), device="cpu",
              vllm_sparse_method="quest", quest_token_budget=16, quest_skip_layers=0, page_size=4,
              recall_sample_every=2)
    with serving(llm, "tiny") as url:
        for _ in range(2):
            code, body = post(url + "/v1/completions", {"prompt": "hello world " * 20, "max_tokens": 6,
                                                        "temperature": 0, "ignore_eos": True})
            assert code == 200, body
        text = http("GET", url + "/metrics", key=None)[1]
        rows = dict(line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
        assert rows['sparsevllm_attention_recall_count{model="tiny"}'] == "2"
        assert rows['sparsevllm_attention_recall_output_rel_error_count{model="tiny"}'] == "2"
        assert 0.0 < float(rows['sparsevllm_attention_recall_sum{model="tiny"}']) < 2.0

"""LLM(tensor_parallel_size=2) on a CPU (gloo, 2 ranks): the same tokens as one rank, greedy in fp32,
for vanilla and every method that declares tensor parallelism, on Llama, Qwen2 and Qwen3; every
rank's allocator back to its initial state; bad input and a failing rank raise clear errors."""
import pytest
import torch

from method_knobs import METHOD_KNOBS
from sparsevllm import LLM, SamplingParams, SparseParams
from sparsevllm.method_registry import methods

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
SHARED = list(range(3, 43))   # a prefix two prompts share: a prefix-cache hit on every rank
PROMPTS = [SHARED + list(range(100, 150)), list(range(60, 131)), SHARED + [9] * 30, [5, 6, 7, 8] * 6]

# The table's knobs with smaller budgets, so that every method really selects (or evicts) on prompts
# of ~70 tokens.
QUEST = dict(METHOD_KNOBS["quest"], vllm_sparse_method="quest", page_size=4, quest_token_budget=16)
CASES = {
    "vanilla": dict(METHOD_KNOBS["vanilla"], vllm_sparse_method="vanilla"),
    "quest": QUEST,
    "quest_shared": dict(QUEST, quest_selection="shared"),
    "omnikv": dict(METHOD_KNOBS["omnikv"], vllm_sparse_method="omnikv", omnikv_num_selected=12),
    "snapkv": dict(METHOD_KNOBS["snapkv"], vllm_sparse_method="snapkv", page_size=4, snapkv_capacity=24),
}


def _run(path, prompts=PROMPTS, sparse_params=None, gen=GREEDY, **knobs):
    llm = LLM(path, num_kv_pages=knobs.pop("num_kv_pages", 256), max_num_batched_tokens=96,
              chunk_prefill_size=64, **knobs)
    try:
        outs = llm.generate(prompts, gen, use_tqdm=False, sparse_params=sparse_params)
        followers = llm.engine.workers.query("allocator") if llm.engine.workers else []
        if llm.engine.workers:   # eviction (SnapKV) happened alike on every rank
            for acc in llm.engine.workers.query("accounting"):
                for key in ("compactions", "evicted_tokens_total", "kv_peak_used_bytes"):
                    assert acc.get(key) == llm.memory_accounting().get(key), key
        return outs, followers, llm.engine.scheduler.num_preemptions
    finally:
        llm.shutdown()


def _tokens(outs):
    return [o.outputs[0].token_ids if not o.error else o.error for o in outs]


def test_every_method_declares_tensor_parallel():
    assert {name for name, cls in methods().items() if cls.capabilities.tensor_parallel} == \
        {c["vllm_sparse_method"] for c in CASES.values()}


@pytest.mark.parametrize("arch", ["llama", pytest.param("qwen2", marks=pytest.mark.long),
                                  pytest.param("qwen3", marks=pytest.mark.long)])
@pytest.mark.parametrize("case", list(CASES))
def test_tp2_equals_tp1_token_for_token(tiny_model, arch, case):
    path = tiny_model(arch)
    ref, _, _ = _run(path, **CASES[case])
    outs, followers, _ = _run(path, tensor_parallel_size=2, **CASES[case])
    assert _tokens(outs) == _tokens(ref)
    assert all(len(o.outputs[0].token_ids) == GREEDY.max_tokens for o in outs)
    assert followers == [{"idle": True, "num_free": 256, "num_pages": 256, "tables": 0, "mirrors": 0}]


# Per-request sparsity (issue #51) under TP: each follower's mirror of a request carries its resolved
# choice, so every rank decodes each row with its own method and budget and takes the same host
# decisions (SnapKV's per-request compaction, OmniKV's selection, "auto"'s dense rows).
MIXED = dict(QUEST, **METHOD_KNOBS["omnikv"], **dict(METHOD_KNOBS["snapkv"], snapkv_capacity=24),
             mixed_methods=["omnikv", "snapkv"])
PER_REQUEST = {
    # vanilla rows beside QuEST at two budgets, in a QuEST engine
    "quest": (QUEST, [None, SparseParams("vanilla"), SparseParams(quest_token_budget=32),
                      SparseParams("quest", quest_token_budget=16)]),
    # every mixable method in one batch, SnapKV at its own capacity per request
    "mixed": (MIXED, [SparseParams("omnikv"), SparseParams("snapkv", snapkv_capacity=32),
                      SparseParams("vanilla"), SparseParams("snapkv")]),
    # "auto": the short prompts decode densely, the long ones with QuEST
    "auto": (dict(QUEST, vllm_sparse_method="auto", auto_dense_below=50), None),
}


@pytest.mark.parametrize("case", list(PER_REQUEST))
def test_tp2_equals_tp1_with_sparsity_per_request(tiny_model, case):
    path = tiny_model("llama")
    knobs, sparse = PER_REQUEST[case]
    want, _, _ = _run(path, sparse_params=sparse, **knobs)
    outs, followers, _ = _run(path, sparse_params=sparse, tensor_parallel_size=2, **knobs)
    assert _tokens(outs) == _tokens(want)
    assert [o.metrics["sparse"] for o in outs] == [o.metrics["sparse"] for o in want]
    assert all(f["idle"] and f["mirrors"] == 0 for f in followers)
    if case == "auto":
        assert {o.metrics["sparse"]["method"] for o in outs} == {"vanilla", "quest"}


def test_tp2_auto_compacts_under_pressure_like_tp1(tiny_model):
    """"auto" short of pages compacts a running request (a host decision the followers replay, each
    rank scoring its own KV heads) instead of preempting: the same tokens and compactions as one rank."""
    path = tiny_model("llama")
    ps = [list(range(3, 203)), list(range(5, 205)), list(range(7, 207)), list(range(9, 209))]
    gen = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    knobs = dict(QUEST, vllm_sparse_method="auto", auto_dense_below=120, auto_compact_capacity=48,
                 num_kv_pages=110, max_model_len=512)
    want, _, pre1 = _run(path, prompts=ps, gen=gen, **knobs)
    outs, followers, pre2 = _run(path, prompts=ps, gen=gen, tensor_parallel_size=2, **knobs)
    assert pre1 == pre2 == 0
    assert any("compacted" in o.metrics["sparse"] for o in want)
    assert _tokens(outs) == _tokens(want)
    assert [o.metrics["sparse"] for o in outs] == [o.metrics["sparse"] for o in want]
    assert all(f["idle"] and f["mirrors"] == 0 for f in followers)


def test_tp2_under_preemption_and_overlapped_scheduling(tiny_model):
    """A pool too small for every request at once: requests are preempted and recomputed, and the
    followers' allocators follow rank 0's decisions through it; with overlapped scheduling the
    decode inputs reach the followers from rank 0's device."""
    path = tiny_model("llama")
    ref, _, _ = _run(path, num_kv_pages=14)
    outs, followers, preemptions = _run(path, tensor_parallel_size=2, num_kv_pages=14, async_scheduling=True)
    assert preemptions > 0
    assert _tokens(outs) == _tokens(ref)
    assert followers[0]["idle"] and followers[0]["num_free"] == 14


def test_tp2_tied_embeddings_prompt_logprobs_and_samples(tiny_model):
    """A tied LM head (the embedding's vocab slice), prompt log-probabilities (the same logits rows
    on every rank) and n = 2 samples sharing the prompt's pages through the prefix cache."""
    path = tiny_model("llama_tied")
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, n=2, prompt_logprobs=1, logprobs=1)
    outs = []
    for tp in (1, 2):
        llm = LLM(path, num_kv_pages=128, tensor_parallel_size=tp)
        try:
            outs.append(llm.generate(PROMPTS[:2], params, use_tqdm=False))
            if tp == 2:
                assert llm.engine.workers.query("allocator")[0]["idle"]
        finally:
            llm.shutdown()
    ref, got = outs
    for r, g in zip(ref, got):
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in r.outputs]
        assert len(g.outputs) == 2 and g.outputs[0].token_ids == g.outputs[1].token_ids
        lp_r = [next(iter(d.values())).logprob for d in r.prompt_logprobs[1:]]
        lp_g = [next(iter(d.values())).logprob for d in g.prompt_logprobs[1:]]
        assert lp_g == pytest.approx(lp_r, abs=1e-4)


def test_bad_request_fails_alone_under_tp(tiny_model):
    path = tiny_model("llama")
    prompts = [PROMPTS[0], [1, 2, 10_000], PROMPTS[1]]
    ref, _, _ = _run(path, prompts=prompts)
    outs, followers, _ = _run(path, prompts=prompts, tensor_parallel_size=2)
    assert not outs[0].error and not outs[2].error
    assert "token ids must be in [0, 256)" in outs[1].error
    assert _tokens(outs) == _tokens(ref)
    assert followers[0]["idle"]


def test_kv_heads_not_divisible_is_a_clear_error(tiny_model):
    path = tiny_model("llama", num_attention_heads=3, num_key_value_heads=3, hidden_size=48)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 must divide the model's KV heads"):
        LLM(path, tensor_parallel_size=2)


def test_method_without_tensor_parallel_is_a_clear_error(tiny_model):
    with pytest.raises(ValueError, match="'deltakv' does not support tensor_parallel_size=2"):
        LLM(tiny_model("llama"), vllm_sparse_method="deltakv", load_format="dummy", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size=0 is invalid"):
        LLM(tiny_model("llama"), tensor_parallel_size=0)


def test_failing_rank_raises_on_rank_0_instead_of_hanging(tiny_model):
    llm = LLM(tiny_model("llama"), tensor_parallel_size=2, num_kv_pages=64)
    llm.engine.workers.send(("no_such_command",))   # rank 1 fails on it and exits
    with pytest.raises(RuntimeError, match="tensor-parallel rank 1 failed"):
        llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)
    llm.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("case", list(CASES))
def test_tp2_equals_tp1_on_two_gpus(tiny_model, case):
    """NCCL, CUDA graphs with the all-reduces captured; fp32 so greedy tokens are comparable."""
    path = tiny_model("llama")
    ref, _, _ = _run(path, dtype="float32", **CASES[case])
    outs, followers, _ = _run(path, dtype="float32", tensor_parallel_size=2, **CASES[case])
    assert _tokens(outs) == _tokens(ref)
    assert followers[0]["idle"]


@pytest.mark.long   # one more rank failure; the quick suite keeps test_failing_rank_raises_on_rank_0_*
def test_follower_dies_with_rank_0(tmp_path):
    """Rank 0 killed (a benchmark case on its timeout) while a follower sits in NCCL, which does not
    notice: the follower must not live on holding its GPU. (On gloo a follower would also notice
    through its next collective, so the follower here just sleeps.)"""
    import os
    import signal
    import subprocess
    import sys
    import time
    script = tmp_path / "rank0.py"
    script.write_text(
        "import multiprocessing as mp, time\n"
        "from sparsevllm.engine.tensor_parallel import _die_with_parent\n"
        "def follower(ready):\n"
        "    _die_with_parent()\n"
        "    ready.set()\n"
        "    time.sleep(600)\n"
        "if __name__ == '__main__':\n"
        "    ctx = mp.get_context('spawn')\n"
        "    ready = ctx.Event()\n"
        "    p = ctx.Process(target=follower, args=(ready,), daemon=True)\n"
        "    p.start()\n"
        "    assert ready.wait(120)\n"
        "    print(p.pid, flush=True)\n"
        "    time.sleep(600)\n")
    rank0 = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    follower = int(rank0.stdout.readline())
    rank0.send_signal(signal.SIGKILL)
    rank0.wait()
    deadline = time.time() + 20
    while time.time() < deadline:
        try:
            with open(f"/proc/{follower}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in "ZX":   # dead, not yet reaped by init
                    return
        except FileNotFoundError:
            return
        time.sleep(0.2)
    os.kill(follower, signal.SIGKILL)
    pytest.fail("the follower outlived its rank 0 by 20 s")


def test_shutdown_drops_graphs_before_the_teardown(tiny_model, monkeypatch):
    """NCCL's teardown hangs while graphs that captured its all-reduces live (pytorch#115388; it hung on
    the H200s): every rank drops its graphs first, also when the process exits without shutdown()."""
    import atexit
    from sparsevllm import distributed as tp
    from sparsevllm.engine.model_runner import ModelRunner
    calls = []
    release = ModelRunner.release_graphs
    monkeypatch.setattr(ModelRunner, "release_graphs", lambda self: (calls.append("graphs"), release(self)))
    destroy = tp.destroy_tensor_parallel
    monkeypatch.setattr(tp, "destroy_tensor_parallel", lambda **kw: (calls.append(("teardown", kw)), destroy(**kw)))
    llm = LLM(tiny_model("llama"), tensor_parallel_size=2, num_kv_pages=32)
    registered = []
    monkeypatch.setattr(atexit, "unregister", lambda f: registered.append(f))
    llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)
    engine = llm.engine
    llm.shutdown()
    assert calls == ["graphs", ("teardown", {"abort": False})]
    assert engine.shutdown in registered   # the exit hook that shutdown() replaces is the engine's


@pytest.mark.long   # one more rank failure; the quick suite keeps test_failing_rank_raises_on_rank_0_*
def test_rank_dead_before_joining_is_a_clear_error_not_a_hang(tiny_model, tmp_path):
    """A script without the `if __name__ == "__main__":` guard: the spawned rank re-runs it, fails
    while bootstrapping and never joins the group. Rank 0 must say so, not wait in the group's
    rendezvous (30 minutes)."""
    import os
    import subprocess
    import sys
    script = tmp_path / "unguarded.py"
    script.write_text(f"from sparsevllm import LLM\nLLM({tiny_model('llama')!r}, tensor_parallel_size=2, num_kv_pages=16)\n")
    try:
        run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=90,
                             env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    except subprocess.TimeoutExpired:
        pytest.fail("rank 0 waited for a rank that had died before joining")
    assert run.returncode != 0
    assert "exited before joining" in run.stderr and "__main__" in run.stderr


def test_existing_process_group_is_refused_before_ranks_are_spawned(tiny_model):
    """torch.distributed already initialised in this process: a clear error, and no follower left
    behind waiting for a rank 0 that never comes."""
    import multiprocessing
    import torch.distributed as dist
    from sparsevllm.engine.tensor_parallel import _free_port
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="without a torch.distributed group already initialised"):
            LLM(tiny_model("llama"), tensor_parallel_size=2, num_kv_pages=16)
        assert not [p for p in multiprocessing.active_children() if p.name.startswith("sparsevllm-tp")]
    finally:
        dist.destroy_process_group()


def _within(seconds, fn):
    """fn's exception (None if it returned), failing the test if fn is still blocked after seconds."""
    import threading
    box = []

    def target():
        try:
            fn()
            box.append(None)
        except BaseException as e:   # noqa: B036 - KeyboardInterrupt is what some cases raise
            box.append(e)
    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        pytest.fail(f"blocked for more than {seconds} s")
    return box[0]


def _fail_rank_0_mid_forward(llm, monkeypatch, error):
    """Rank 0 (this process) raises inside its forward, after the followers were sent the step: they
    wait in the step's next all-reduce (rank 0 only: the followers are other processes)."""
    layer = llm.engine.model_runner.model.layers[1]
    forward = type(layer).forward

    def failing(self, *args, **kwargs):
        if self is layer:
            monkeypatch.setattr(type(layer), "forward", forward)
            raise error
        return forward(self, *args, **kwargs)
    monkeypatch.setattr(type(layer), "forward", failing)


@pytest.mark.long   # one more rank failure; the quick suite keeps test_failing_rank_raises_on_rank_0_*
def test_rank_0_failing_mid_forward_raises_instead_of_hanging(tiny_model, monkeypatch):
    """A rank-0-only error inside the forward (a GPU out of memory on rank 0's card): the error is raised,
    not lost in a shutdown whose exit command the followers, inside the step's all-reduce, never read."""
    path = tiny_model("llama")
    llm = LLM(path, tensor_parallel_size=2, num_kv_pages=32)
    _fail_rank_0_mid_forward(llm, monkeypatch, RuntimeError("rank 0 out of memory"))
    error = _within(60, lambda: llm.generate([PROMPTS[3]], GREEDY, use_tqdm=False))
    assert isinstance(error, RuntimeError) and "rank 0 out of memory" in str(error)
    llm.shutdown()
    with LLM(path, tensor_parallel_size=2, num_kv_pages=32) as again:   # the ranks' resources were released
        assert len(again.generate([PROMPTS[3]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 10


def test_rank_0_failing_while_building_raises_instead_of_hanging(tiny_model, monkeypatch):
    """Rank 0 fails building its runner while the followers wait in the KV-page agreement."""
    from sparsevllm.engine.model_runner import ModelRunner
    monkeypatch.setattr(ModelRunner, "num_kv_pages", lambda self, cls: (_ for _ in ()).throw(MemoryError("rank 0")))
    error = _within(60, lambda: LLM(tiny_model("llama"), tensor_parallel_size=2, num_kv_pages=32))
    assert isinstance(error, MemoryError)


def test_interrupt_mid_forward_leaves_a_clear_error_not_a_hang(tiny_model, monkeypatch):
    """Ctrl-C inside a step's forward leaves the followers inside that step's collectives: the ranks
    are stopped, and the LLM says so on its next call instead of waiting for them forever."""
    llm = LLM(tiny_model("llama"), tensor_parallel_size=2, num_kv_pages=32)
    _fail_rank_0_mid_forward(llm, monkeypatch, KeyboardInterrupt())
    assert isinstance(_within(60, lambda: llm.generate([PROMPTS[3]], GREEDY, use_tqdm=False)), KeyboardInterrupt)
    error = _within(60, lambda: llm.generate([PROMPTS[3]], GREEDY, use_tqdm=False))
    assert isinstance(error, RuntimeError) and "were stopped" in str(error) and "new LLM" in str(error)
    llm.shutdown()


def test_generate_after_shutdown_is_a_clear_error(tiny_model):
    llm = LLM(tiny_model("llama"), tensor_parallel_size=2, num_kv_pages=32)
    llm.shutdown()
    with pytest.raises(RuntimeError, match="was shut down.*create a new LLM"):
        llm.generate([PROMPTS[3]], GREEDY, use_tqdm=False)

"""A seeded randomized stress of the engine's request lifecycle, for every method, driven step by
step as a server drives it: requests of random lengths (some sharing prefixes, some a chat's next
turn over the previous answer) arrive while others run, with random max_tokens (1 included), n > 1,
stop tokens, EOS with min_tokens, penalties, logprobs and seeded sampling; some are aborted while
waiting, prefilling or decoding; some can never run; the KV pool is small enough to preempt.

Checked, with overlapped scheduling off and on:
- every step: each page's refcount equals the block tables (and method-held pages) referencing it,
  the free lists hold exactly the unreferenced pages, the prefix-cache maps agree, a method's own
  pools (HiSparse's host pages and rows, DeltaKV's raw slots and rows) are partitioned between its
  live requests and its free list, and no finished request holds anything;
- every request that was not aborted ends once, with the finish reason and token count its
  parameters imply (stop / EOS token last and nowhere before, or max_tokens / max_model_len);
- at the end every allocator, method pool and per-request engine state is back at its initial state;
- every request's tokens equal the same request run alone on a large pool (an aborted one's: a
  prefix of them), and the two modes agree; for QuEST, OmniKV, HiSparse and DeltaKV only where the
  request was not preempted: their recompute changes a preempted request's later tokens, and a tight
  pool may preempt differently under overlap (the README's one exception). Vanilla and SnapKV
  recompute exactly: every request.
"""
import os
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from method_knobs import METHOD_KNOBS  # noqa: E402
from sparsevllm import LLM, SamplingParams  # noqa: E402
from sparsevllm.engine.cache_manager.deltakv import compressor as dc  # noqa: E402
from sparsevllm.models.config import ModelConfig, read_config_json  # noqa: E402

P = 4              # page size
MAX_LEN = 192      # max_model_len: some requests are cut by it
EOS = 2            # the tiny models' eos_token_id
SEEDS = (0, 1, 2)
NUM_REQUESTS = 24
NUM_FOLLOW_UPS = 4
COMMON = dict(device="cpu", page_size=P, max_model_len=MAX_LEN, chunk_prefill_size=32, max_num_batched_tokens=64,
              max_num_seqs=6)
# The table's knobs with budgets far below these prompts, so every sparse path runs, and pools a few
# requests deep, so they preempt. Every method of the table must have its pool here.
STRESS = {
    "vanilla": dict(num_kv_pages=50),
    # (prompts of one 24-token prefix plus up to 12 tokens stay whole and share their pages with
    # longer ones, which compact: the recompute and same-step admissions around that are the risk)
    "snapkv": dict(num_kv_pages=40, snapkv_capacity=36),
    "quest": dict(num_kv_pages=50, quest_token_budget=3 * P),
    "omnikv": dict(num_kv_pages=50, omnikv_filter_layers=[1], omnikv_num_selected=6),
    "hisparse": dict(num_kv_pages=48, hisparse_token_budget=3 * P, hisparse_recent_pages=1, hisparse_device_pages=8,
                     hisparse_min_prompt_len=40, hisparse_host_memory_gb=0.01),
    # A step's token budget never cuts a chunk short (6 requests x 32), so each prompt's chunks end
    # at the same places whatever runs beside it: DeltaKV's prefill reads the compressed part of a
    # prompt rebuilt, so where its chunks end changes its tokens (its module docstring says so).
    # With a 48-token budget overlap on and off differed without any preemption (seeds 2 and 3:
    # overlap admits a prompt a step later, beside other prompts), as docs/methods/deltakv.md says.
    "deltakv": dict(num_kv_pages=60, max_num_batched_tokens=192, deltakv_recent=8, deltakv_decode_keep=6,
                    deltakv_compress_steps=2),
}
METHODS = {method: dict(knobs, **STRESS[method]) for method, knobs in METHOD_KNOBS.items()}
EXACT_RECOMPUTE = ("vanilla", "snapkv")   # a preempted request's continuation is unchanged


@dataclass
class Request:
    prompt: list[int]
    params: SamplingParams
    arrive: int               # added before this engine step
    abort: int | None = None  # aborted before this engine step
    # A chat's next turn: once request `follows` has ended, its prompt and its first sample's first
    # `take` tokens, then `prompt` (a hit on generated tokens' pages must equal a miss).
    follows: int | None = None
    take: int = 0


def workload(seed: int, vanilla) -> list[Request]:
    """NUM_REQUESTS requests; a "stop" request stops on a token vanilla's greedy decode of its prompt
    produces early (random stop tokens would hardly ever be met), among random others."""
    rng = np.random.default_rng(seed)
    tokens = lambda n: rng.integers(3, 250, n).tolist()   # noqa: E731  (no EOS in prompts)
    prefixes = [tokens(n) for n in (6 * P, 11 * P + 1, 37)]
    reqs, stops = [], {}
    for i in range(NUM_REQUESTS):
        if rng.random() < 0.5:   # a shared prefix (some whole prompts repeat), else a fresh prompt
            prompt = prefixes[rng.integers(len(prefixes))] + tokens(int(rng.choice([0, 1, P, rng.integers(1, 60)])))
        else:
            prompt = tokens(int(rng.choice([1, 2, P, rng.integers(3, 150)])))
        max_tokens = int(rng.choice([1, 2, rng.integers(3, 50), rng.integers(3, 50)]))
        kind = rng.choice(["greedy", "greedy", "stop", "stop", "eos", "n", "sampled", "penalty"])
        if kind == "stop":
            stops[i] = int(rng.integers(0, min(max_tokens, 6)))
        params = SamplingParams(
            temperature=0.8 if kind == "sampled" else 0.0, top_k=20 if kind == "sampled" else -1,
            seed=int(rng.integers(1 << 30)) if kind == "sampled" else None,
            n=int(rng.integers(2, 4)) if kind in ("n", "sampled") else 1, max_tokens=max_tokens,
            ignore_eos=kind != "eos", stop_token_ids=tokens(3) if kind == "stop" else None,
            min_tokens=int(rng.integers(0, max_tokens + 1)) if kind == "eos" else 0,
            repetition_penalty=1.3 if kind == "penalty" else 1.0, logprobs=2 if rng.random() < 0.15 else None,
            prompt_logprobs=1 if rng.random() < 0.1 else None)
        arrive = 0 if i < 6 else int(rng.integers(0, 40))
        reqs.append(Request(prompt, params, arrive))
    # Chats: a turn arrives after the rush (its answer's pages then stay cached until the next turn
    # arrives) and its next turn when it ends; at most 80 + 40 + 11 tokens, which every pool holds.
    turns = [i for i, r in enumerate(reqs) if len(r.prompt) <= 80 and r.params.max_tokens >= 8]
    for i in rng.choice(turns, NUM_FOLLOW_UPS, replace=False):
        reqs[i].arrive = int(rng.integers(55, 70))
        reqs.append(Request(tokens(int(rng.integers(1, 12))), SamplingParams(temperature=0.0, max_tokens=int(
            rng.integers(1, 30)), ignore_eos=True), reqs[i].arrive, follows=int(i), take=int(rng.integers(4, 41))))
    for i in rng.choice(NUM_REQUESTS, 5, replace=False):   # aborted while waiting, prefilling, decoding or done
        reqs[i].abort = reqs[i].arrive + int(rng.integers(0, 20))
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for i, out in zip(stops, vanilla.generate([reqs[i].prompt for i in stops], greedy, use_tqdm=False)):
        reqs[i].params.stop_token_ids.append(out.outputs[0].token_ids[stops[i]])
    # Requests that can never run fail alone, at once: a prompt that leaves no room for a token, an empty one.
    reqs.append(Request(tokens(MAX_LEN), SamplingParams(max_tokens=4), int(rng.integers(0, 30))))
    reqs.append(Request([], SamplingParams(temperature=0.8, seed=5, max_tokens=4, n=2), int(rng.integers(0, 30))))
    reqs.append(Request(tokens(9), SamplingParams(max_tokens=4, stop="no tokenizer"), int(rng.integers(0, 30))))
    return reqs


def compressor(path, out) -> str:
    """A random DeltaKV compressor (lossy latents of 4 dims) for the tiny model."""
    mc = ModelConfig.from_dict(read_config_json(path))
    cfg = dc.make_config(mc, latent_dim=4, full_layers=[0, 2], cluster_ratio=0.25, neighbors=2, sink=4)
    torch.manual_seed(0)
    dc.DeltaKVCompressor(cfg).save(str(out))
    return str(out)


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("llama", num_hidden_layers=4)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Steps of a model this small are a few microseconds of math each: intra-op threads only add
    synchronisation, which costs 15x on a loaded 2-core machine (measured: 150 steps 8.3 s with 2
    threads against 0.54 s with 1)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def workloads(model):
    vanilla = LLM(model, **COMMON, num_kv_pages=512)
    return {seed: workload(seed, vanilla) for seed in SEEDS}


@pytest.fixture(scope="module")
def knobs(model, tmp_path_factory):
    comp = compressor(model, tmp_path_factory.mktemp("deltakv") / "c")

    def build(method):
        extra = dict(deltakv_compressor_path=comp) if method == "deltakv" else {}
        return dict(COMMON, vllm_sparse_method=method, **METHODS[method], **extra)
    return build


# ---------------------------------------------------------------- invariants of the pools

def method_pages(cm) -> list[int]:
    """Pages a method holds outside the block tables (HiSparse's hot pages)."""
    return [p for pages in getattr(cm, "hot_of", {}).values() for p in pages]


def check_pools(cm, live_ids: set[int]) -> None:
    """Refcounts equal the references; free lists hold exactly the unreferenced pages; the prefix
    cache's two maps agree; a method's own pools are partitioned between live requests and free."""
    a, n = cm.allocator, cm.allocator.num_pages
    assert set(cm.tables.tables) <= live_ids, "a finished request still holds a block table"
    held = Counter(p for table in cm.tables.tables.values() for p in table)
    held.update(method_pages(cm))
    assert a.refcount == [held[p] for p in range(n)]
    free = list(a.free_clean) + list(a.free_cached)
    assert sorted(free) == [p for p in range(n) if a.refcount[p] == 0]
    assert all(a.hash_of[p] < 0 for p in a.free_clean) and all(a.hash_of[p] >= 0 for p in a.free_cached)
    assert {h: p for p, h in enumerate(a.hash_of) if h >= 0} == a.page_of
    if hasattr(cm, "host"):   # HiSparse: host pages and buffer rows
        assert set(cm.row_of) <= live_ids and set(cm.hot_of) == set(cm.row_of) == set(cm.host_pages_of)
        host = list(cm.host.free_pages) + [p for pages in cm.host_pages_of.values() for p in pages.tolist()]
        assert sorted(host) == list(range(cm.host.num_pages))
        assert sorted(cm.free_rows + list(cm.row_of.values())) == list(range(cm.dummy_row))
        assert cm.decoding | set(cm.prefilling) <= set(cm.row_of) and not cm.decoding & set(cm.prefilling)
    if hasattr(cm, "raw_slots"):   # DeltaKV: raw slots and rows
        assert set(cm.requests) <= live_ids
        slots = [cm.raw_slots.free[:cm.raw_slots.top]]
        slots += [r.slots[:r.upto][r.slots[:r.upto] >= 0] for r in cm.requests.values()]
        assert sorted(np.concatenate(slots).tolist()) == list(range(cm.raw_slots.num_slots))
        rows = cm.free_rows + [r.row for r in cm.requests.values()]
        assert sorted(rows) == list(range(cm.config.max_num_seqs + 1))
    if hasattr(cm, "_evicted"):   # SnapKV
        assert set(cm._evicted) <= live_ids


def check_idle(llm) -> None:
    eng, cm = llm.engine, llm.engine.cache_manager
    assert not eng.has_work() and eng._in_flight is None
    assert not eng._seq_generators and not eng.outputs._checked_chars
    check_pools(cm, set())
    assert cm.allocator.is_idle()
    assert not cm.tables.tables and not cm.tables.arrays and not cm.tables.named and not cm.tables._hashes
    if hasattr(cm, "host"):
        assert cm.host.is_idle() and not cm.row_of and not cm.decoding and not cm.prefilling
        assert (cm.buf_key == -1).all() and not cm.offloaded.any()
    if hasattr(cm, "raw_slots"):
        assert cm.raw_slots.num_free == cm.raw_slots.num_slots and not cm.requests and not cm.events
    if hasattr(cm, "_evicted"):
        assert not cm._evicted and not cm._compacted_now


# ---------------------------------------------------------------- the driver

@dataclass
class Outcome:
    prompts: list[list[int]]                     # per request, as added (a follow-up's, built then)
    outputs: list[list[tuple[list[int], str]]]   # per request, per sample: (tokens, finish reason)
    preempted: set[int]                          # requests one of whose samples was preempted
    aborted: set[int]                            # requests the abort API finished
    stats: Counter


def drive(llm, reqs: list[Request]) -> Outcome:
    """Add, abort and step as an online server does, checking the pools after every step."""
    eng, cm = llm.engine, llm.engine.cache_manager
    stats, preempted, owner = Counter(), set(), {}
    preempt, allocate, build_view = eng.scheduler.preempt, cm.allocate, cm.build_decode_view

    def preempt_spy(seq):
        preempted.add(owner[seq.seq_id])
        preempt(seq)

    def allocate_spy(seq):
        allocate(seq)
        stats["prefix_hit_tokens"] += seq.num_computed_tokens
        i = owner[seq.seq_id]
        if reqs[i].follows is not None and seq.seq_id not in admitted:   # hits on the turn before's answer
            stats["answer_hit_tokens"] += max(0, seq.num_computed_tokens - len(prompts[reqs[i].follows]))
        admitted.add(seq.seq_id)

    def view_spy(layer_id, q, step):
        view = build_view(layer_id, q, step)
        stats["sparse_views"] += bool((view.lengths < step.cache_lens.unsqueeze(1)).any())
        return view
    eng.scheduler.preempt, cm.allocate, cm.build_decode_view = preempt_spy, allocate_spy, view_spy

    seqs, prompts, reported, aborted, admitted = {}, {}, Counter(), set(), set()
    last = max(max(r.arrive, r.abort or 0) for r in reqs)
    t = 0
    while t <= last or eng.has_work() or len(seqs) < len(reqs):
        for i, r in enumerate(reqs):
            if i not in seqs and t >= r.arrive:
                parent = seqs.get(r.follows) if r.follows is not None else None
                if r.follows is None:
                    prompts[i] = r.prompt
                elif parent is not None and all(s.is_finished for s in parent.group):
                    prompts[i] = prompts[r.follows] + parent.completion_token_ids[:r.take] + r.prompt
                else:
                    continue
                seqs[i] = eng.add_request(prompts[i], r.params)
                owner.update({s.seq_id: i for s in seqs[i].group})
            if r.abort == t:
                if not all(s.is_finished for s in seqs[i].group):
                    aborted.add(i)
                eng.abort(seqs[i])
        finished, _ = eng.step()
        reported.update(s.seq_id for s in finished)
        live = {s.seq_id for group in seqs.values() for s in group.group if not s.is_finished}
        check_pools(cm, live)
        stats["steps"] += 1
        t += 1
        assert t < 2000, "the engine stopped making progress"
    check_idle(llm)
    stats["preemptions"] = eng.scheduler.num_preemptions
    for i, seq in seqs.items():
        for s in seq.group:   # a request ended by its stop conditions is reported once, by the step that ended it
            assert reported[s.seq_id] == (s.finish_reason in ("stop", "length")), (i, s.finish_reason)
    outputs = [[(s.completion_token_ids, s.finish_reason) for s in seqs[i].group] for i in range(len(reqs))]
    return Outcome([prompts[i] for i in range(len(reqs))], outputs, preempted, aborted, stats)


def fails(prompt: list[int], params: SamplingParams) -> bool:
    """A request the engine refuses when it arrives."""
    return not prompt or len(prompt) >= MAX_LEN or bool(params.stop)


def check_finish_reasons(reqs: list[Request], out: Outcome) -> None:
    for i, (r, prompt, samples) in enumerate(zip(reqs, out.prompts, out.outputs)):
        p = r.params
        assert len(samples) == p.n
        if fails(prompt, p):
            assert all(reason == "error" for _, reason in samples), i
            continue
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else {EOS})
        limit = min(p.max_tokens, MAX_LEN - len(prompt))
        for tokens, reason in samples:
            assert reason in ("stop", "length", "abort"), (i, reason)
            assert reason != "abort" or i in out.aborted, i
            assert not stops & set(tokens[:-1]), f"request {i} went on past a stop token"
            if reason == "length":
                assert len(tokens) == limit and tokens[-1] not in stops, i
            elif reason == "stop":
                assert 1 <= len(tokens) <= limit and tokens[-1] in stops, i
            else:
                assert len(tokens) <= limit and (not tokens or tokens[-1] not in stops), i


def check_alone(reqs: list[Request], out: Outcome, alone, exact: bool) -> None:
    """Each request's tokens equal the same request run by itself (its samples together) on a roomy
    pool; an aborted one's are a prefix of them. Without an exact recompute, preempted requests are
    left out: their later tokens may differ."""
    for i, (r, prompt, samples) in enumerate(zip(reqs, out.prompts, out.outputs)):
        if fails(prompt, r.params) or (not exact and i in out.preempted):
            continue
        for (tokens, _), want in zip(samples, alone(i, prompt)):
            if i in out.aborted:
                assert tokens == want[:len(tokens)], f"request {i} (aborted)"
            else:
                assert tokens == want, f"request {i}"


def check_same(reqs: list[Request], a: Outcome, b: Outcome, skip: set[int]) -> None:
    """Equal outputs, except for the requests in skip and follow-ups of turns that differed; an
    aborted request's tokens are a prefix of the other run's (the abort lands at the same engine
    step, a step earlier in the request's life with overlap, which learns its tokens a step late)."""
    for i in range(len(reqs)):
        if i in skip or a.prompts[i] != b.prompts[i]:
            continue
        if i in a.aborted or i in b.aborted:
            for (x, _), (y, _) in zip(a.outputs[i], b.outputs[i]):
                short, long_ = sorted((x, y), key=len)
                assert long_[:len(short)] == short, f"request {i}"
        else:
            assert a.outputs[i] == b.outputs[i], f"request {i}"


@pytest.mark.long   # 18 runs of ~100 steps: minutes on 2 cores
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("method", list(METHODS))
def test_random_online_workload_keeps_outputs_and_pools(model, knobs, workloads, method, seed):
    reqs = workloads[seed]
    runs = {}
    for overlap in (False, True):
        llm = LLM(model, async_scheduling=overlap, **knobs(method))
        assert llm.engine.async_scheduling is overlap
        runs[overlap] = out = drive(llm, reqs)
        check_finish_reasons(reqs, out)
    sync, over = runs[False], runs[True]
    # The workload really exercised what it is meant to: preemption, aborts part-way, prefix hits
    # (where the method shares pages), stop tokens, and the method's sparse path.
    assert sync.stats["preemptions"] + over.stats["preemptions"] > 0
    assert sync.aborted and over.aborted
    assert any(reason == "stop" for samples in sync.outputs for _, reason in samples)
    if method in ("vanilla", "snapkv", "quest", "omnikv"):
        assert sync.stats["prefix_hit_tokens"] > 0 and over.stats["prefix_hit_tokens"] > 0
    if method == "vanilla":   # the others name prompt pages only, or raw ones (SnapKV: uncompacted requests')
        assert sync.stats["answer_hit_tokens"] + over.stats["answer_hit_tokens"] > 0
    if method in ("quest", "omnikv", "hisparse", "deltakv"):
        assert sync.stats["sparse_views"] > 0 and over.stats["sparse_views"] > 0
    else:   # vanilla's and SnapKV's decode views are dense: all a request stores
        assert sync.stats["sparse_views"] == over.stats["sparse_views"] == 0

    roomy = LLM(model, **{**knobs(method), "num_kv_pages": 512, "enable_prefix_caching": False})
    cache = {}

    def alone(i, prompt):
        key = (i, tuple(prompt))
        if key not in cache:
            cache[key] = [o.token_ids for o in roomy.generate(prompt, reqs[i].params, use_tqdm=False)[0].outputs]
        return cache[key]
    exact = method in EXACT_RECOMPUTE
    for out in (sync, over):
        check_alone(reqs, out, alone, exact)
    # A preempted request of a sparse-decode method is recomputed by dense prefill, which changes its
    # later tokens, and overlap can preempt other requests than the synchronous engine does (README).
    check_same(reqs, sync, over, skip=set() if exact else sync.preempted | over.preempted)

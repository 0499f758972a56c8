"""Decode speed of per-request sparsity (issue #51) on one card, against the homogeneous runs it mixes.

    python scripts/benchmarks/per_request_bench.py mixed [LENGTH]   # QuEST x 2 + vanilla x 2 in one batch
    python scripts/benchmarks/per_request_bench.py auto [LENGTH] [BATCH]   # "auto" against vanilla, short prompts
    python scripts/benchmarks/per_request_bench.py pressure [LENGTH]   # 4 x LENGTH in a pool that admits 2
    python scripts/benchmarks/per_request_bench.py workload [LENGTH]   # 24 x 2K chats + 4 x LENGTH documents

Llama-3.1-8B shape (PRESET=<name> for another preset), random bf16 weights, CUDA graphs, overlapped
scheduling, output 256, default QuEST knobs; the measurement of ab_decode.py (bench_case.timing_metrics'
stable window; the requests of a run share one prompt, prefilled once by a warm-up request, so a case
costs one long prefill an engine). One ROW json line per run.

mixed: a vanilla engine runs 2 requests (vanilla x 2); a QuEST engine runs 2 (quest x 2), then 2 + 2
with SparseParams(method="vanilla") on two of them (mixed), then 2 vanilla rows alone (vanilla rows in
the QuEST engine, for the record). The mixed step does what the two homogeneous steps do apart, so the
tok/s predicted from them is 4 / (2 / quest + 2 / vanilla); the ROW "mixed_over_predicted" is the
issue's target (>= 0.95).
auto: the same BATCH x LENGTH prompts (LENGTH below auto_dense_below: every request a dense row) in
a vanilla engine and an "auto" engine of the same knobs; the target is auto within 2% of vanilla.
pressure: 4 distinct prompts of LENGTH (128000) in a pool of 2 x (LENGTH + OUTPUT / 2) tokens: two
are admitted, and their outputs outgrow the pool. Vanilla preempts and recomputes (prefills again);
"auto" (every request long: QuEST) compacts a running request to auto_compact_capacity instead. ROW:
wall time of the whole generate (prefill included), prompt tokens prefilled, preemptions,
compactions; the target is no recompute (prefilled == 4 x LENGTH, no preemption) and the wall time
against vanilla's.
workload: 24 distinct chats of 2,048 tokens and 4 documents of LENGTH (128000; one prompt, prefilled
once by the warm-up) in one generate, output 256, in a vanilla, a QuEST and an "auto" engine (chats
below auto_dense_below decode dense, documents with QuEST). ROW per engine and group (all, chats,
documents): decode tok/s and ITL over the stable window. The targets: auto's chats' ITL within 5% of
vanilla's, its documents' decode within 5% of QuEST's, and its total against both. The documents share
one prompt, so its KV is held once: it runs on an H100 (86 s for the three engines at 128K).
"""
import argparse
import gc
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402
from bench_case import make_prompts, timing_metrics  # noqa: E402
from sparsevllm import LLM, SamplingParams, SparseParams  # noqa: E402

OUTPUT = 256
ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("case", choices=["mixed", "auto", "pressure", "workload"])
ap.add_argument("length", type=int, nargs="?", default=None)
ap.add_argument("batch", type=int, nargs="?", default=32)
args = ap.parse_args()
cfg = json.load(open(os.path.join("src/sparsevllm/presets", os.environ.get("PRESET", "llama-3.1-8b") + ".json")))
mdir = tempfile.mkdtemp()
json.dump(cfg, open(os.path.join(mdir, "config.json"), "w"))
length = args.length or (128000 if args.case in ("mixed", "pressure", "workload") else 4096)
CHATS, CHAT_LEN = 24, 2048
batch = {"mixed": 4, "pressure": 4, "workload": CHATS + 4}.get(args.case, args.batch)
DECODE = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=OUTPUT)


def engine(method: str, **knobs):
    gc.collect()   # an earlier engine's last parts (a closure kept its scheduler) go before this one loads
    llm = LLM(mdir, vllm_sparse_method=method, load_format="dummy", max_num_seqs=batch,
              max_model_len=length + OUTPUT + 64, chunk_prefill_size=8192, max_num_batched_tokens=16384, **knobs)
    warm = make_prompts(cfg, batch, 256, seed=10_000)   # compiles and captures outside the timing
    llm.generate(warm, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=48), use_tqdm=False)
    prompt = make_prompts(cfg, 1, length, seed=0)[0]
    llm.generate([prompt], SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=1), use_tqdm=False)
    return llm, prompt


def run(llm, prompt, name: str, sparse: list) -> dict:
    start = time.perf_counter()
    outs = llm.generate([prompt] * len(sparse), DECODE, use_tqdm=False, sparse_params=sparse)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    ms = [o.metrics for o in outs]
    m = timing_metrics(start, [x["first_token_time"] for x in ms], [x["finish_time"] for x in ms],
                       [x["token_times"] for x in ms], len(sparse), length)
    row = dict(case=name, engine=llm.config.vllm_sparse_method, length=length, batch=len(sparse),
               mode=llm.execution_mode, decode_tok_s=m["decode_tok_s"], itl_p50_ms=m["itl_p50_ms"],
               itl_p99_ms=m["itl_p99_ms"], sparse=[x["sparse"]["method"] for x in ms],
               device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
    print("ROW", json.dumps(row), flush=True)
    return row


if args.case == "mixed":
    llm, prompt = engine("vanilla")
    vanilla = run(llm, prompt, "vanilla x 2 (vanilla engine)", [None, None])
    llm.shutdown()
    llm, prompt = engine("quest")
    quest = run(llm, prompt, "quest x 2", [None, None])
    dense = SparseParams(method="vanilla")
    mixed = run(llm, prompt, "quest x 2 + vanilla x 2", [None, dense, None, dense])
    run(llm, prompt, "vanilla rows x 2 (quest engine)", [dense, dense])
    llm.shutdown()
    predicted = 4 / (2 / quest["decode_tok_s"] + 2 / vanilla["decode_tok_s"])
    print("ROW", json.dumps(dict(case="mixed vs predicted", predicted_tok_s=predicted,
                                 mixed_tok_s=mixed["decode_tok_s"],
                                 mixed_over_predicted=mixed["decode_tok_s"] / predicted)), flush=True)
elif args.case == "pressure":
    PAGE = 16
    pool = 2 * -(-(length + OUTPUT // 2) // PAGE)   # admits two prompts, not their outputs
    prompts = make_prompts(cfg, 4, length, seed=1)  # distinct: no prefix-cache hits between them

    def pressure(method: str) -> dict:
        """One engine's run; a function so that nothing of the engine (its scheduler) outlives it."""
        llm, _ = engine(method, page_size=PAGE, num_kv_pages=pool)
        sched, prefilled = llm.engine.scheduler, []
        real = sched._schedule_prefill

        def counted():
            b = real()
            prefilled.extend(b.num_tokens)
            return b
        sched._schedule_prefill = counted
        preempted, compacted = sched.num_preemptions, sched.num_pressure_compactions
        start = time.perf_counter()
        outs = llm.generate(prompts, DECODE, use_tqdm=False)
        wall = time.perf_counter() - start
        assert all(o.error is None for o in outs), [o.error for o in outs]
        row = dict(case=f"pressure {method} 4 x {length}", pool_pages=pool, wall_s=wall,
                   prefilled_tokens=sum(prefilled), prompt_tokens=4 * length,
                   preemptions=sched.num_preemptions - preempted,
                   compactions=sched.num_pressure_compactions - compacted,
                   compacted=[o.metrics["sparse"].get("compacted") for o in outs],
                   device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
        print("ROW", json.dumps(row), flush=True)
        llm.shutdown()
        return row
    rows = {method: pressure(method) for method in ("vanilla", "auto")}
    print("ROW", json.dumps(dict(case="pressure auto vs vanilla",
                                 wall_auto_over_vanilla=rows["auto"]["wall_s"] / rows["vanilla"]["wall_s"],
                                 no_recompute=rows["auto"]["prefilled_tokens"] == 4 * length
                                 and rows["auto"]["preemptions"] == 0)), flush=True)
elif args.case == "workload":
    chats = make_prompts(cfg, CHATS, CHAT_LEN, seed=2)
    groups = {"all": range(CHATS + 4), "chats": range(CHATS), "documents": range(CHATS, CHATS + 4)}
    for method in ("vanilla", "quest", "auto"):
        llm, doc = engine(method)
        start = time.perf_counter()
        outs = llm.generate(chats + [doc] * 4, DECODE, use_tqdm=False)
        assert all(o.error is None for o in outs), [o.error for o in outs]
        ms = [o.metrics for o in outs]
        for name, rows in groups.items():
            m = timing_metrics(start, [ms[i]["first_token_time"] for i in rows], [ms[i]["finish_time"] for i in rows],
                               [ms[i]["token_times"] for i in rows], len(rows), length)
            print("ROW", json.dumps(dict(case=f"workload {method} {name}", engine=method, group=name, requests=len(rows),
                                         decode_tok_s=m["decode_tok_s"], itl_p50_ms=m["itl_p50_ms"],
                                         itl_p99_ms=m["itl_p99_ms"], ttft_max_s=m["ttft_max_s"],
                                         sparse=sorted({ms[i]["sparse"]["method"] for i in rows}),
                                         device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")),
                  flush=True)
        llm.shutdown()
else:
    rows = {}
    for method in ("vanilla", "auto"):
        llm, prompt = engine(method)
        rows[method] = run(llm, prompt, f"{method} {batch} x {length}", [None] * batch)
        llm.shutdown()
    print("ROW", json.dumps(dict(case="auto vs vanilla",
                                 auto_over_vanilla=rows["auto"]["decode_tok_s"] / rows["vanilla"]["decode_tok_s"])),
          flush=True)

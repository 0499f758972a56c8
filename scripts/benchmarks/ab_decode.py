"""A/B decode timing of source trees: decode tok/s of one tree's engine for several cases in one process,
with that tree's own prompt maker and stable-window timing (its scripts/benchmarks/bench_case.py).

    python scripts/benchmarks/ab_decode.py TREE METHOD:LENGTH:BATCH[:KV_CACHE_DTYPE][:RECALL] [...]

TREE is a checkout (e.g. a `git worktree add` of the commit to compare against); run it for each tree
on the same card, one after the other, and compare ratios. Llama-3.1-8B shape (PRESET=<name> for
another preset), random weights, default knobs, chunk_prefill_size 8192, max_num_batched_tokens
16384, CUDA graphs, overlapped scheduling, output 256. Optional fields after BATCH, told apart by their
form: a dtype sets kv_cache_dtype (auto, fp8: the same tree's bf16 and FP8 caches compared in one
process); a number sets recall_sample_every (the cost of measuring attention recall; the row then
carries the mean recall). AB_KNOBS='{"knob": value}' adds knobs
to every case that takes them (e.g. hisparse_host_memory_gb).

Cheaper than bench_sparse_vllm.py at long contexts, so that several methods fit one device lease:
the B requests of a case share one prompt, which a warm-up request (max_tokens=1) prefills once, so
they prefill only its last page (SnapKV: its window) and are admitted together. Methods without prefix
caching (DeltaKV) prefill all B. Decode reads shared pages, so absolute tok/s may run above the
benchmark's (L2 hits across requests); only the ratio between trees measured alike means anything.
AB_DISTINCT=1 gives each request a prompt of its own (B full prefills; decode reads every request's KV
from HBM): for comparing what reads fewer bytes, such as an FP8 cache against bf16."""
import argparse
import gc
import json
import os
import sys
import tempfile
import time

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("tree", help="a checkout: its src/ and scripts/benchmarks/ are what runs")
ap.add_argument("cases", nargs="+", metavar="METHOD:LENGTH:BATCH[:KV_CACHE_DTYPE][:RECALL]")
args = ap.parse_args()
tree = os.path.abspath(args.tree)
sys.path.insert(0, os.path.join(tree, "src"))
sys.path.insert(0, os.path.join(tree, "scripts", "benchmarks"))
import torch  # noqa: E402
from bench_case import make_prompts, timing_metrics  # noqa: E402
from sparsevllm import LLM, SamplingParams  # noqa: E402
from sparsevllm.method_registry import method_knob_owners  # noqa: E402

OUTPUT = 256
DISTINCT = os.environ.get("AB_DISTINCT") == "1"
cfg = json.load(open(os.path.join(tree, "src/sparsevllm/presets", os.environ.get("PRESET", "llama-3.1-8b") + ".json")))
mdir = tempfile.mkdtemp()
json.dump(cfg, open(os.path.join(mdir, "config.json"), "w"))
for spec in args.cases:
    method, length, batch, *more = spec.split(":")
    length, batch = int(length), int(batch)
    kv = [f for f in more if not f.isdigit()]
    recall = int(next((f for f in more if f.isdigit()), 0))
    owners = method_knob_owners()   # engine knobs go to every case, a method's only to its own
    extra = {k: v for k, v in json.loads(os.environ.get("AB_KNOBS", "{}")).items() if owners.get(k, method) == method}
    if kv:
        extra["kv_cache_dtype"] = kv[0]
    if recall:   # only then: older trees lack the knob
        extra["recall_sample_every"] = recall
    llm = LLM(mdir, vllm_sparse_method=method, load_format="dummy", max_num_seqs=batch,
              max_model_len=length + OUTPUT + 64, chunk_prefill_size=8192, max_num_batched_tokens=16384, **extra)
    warm = make_prompts(cfg, batch, 256, seed=10_000)
    llm.generate(warm, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=48), use_tqdm=False)
    prompt = make_prompts(cfg, 1, length, seed=0)[0]
    batch_prompts, fill = [prompt] * batch, 0.0
    if DISTINCT:   # B prompts of their own: decode reads B times the KV from HBM, as served traffic does
        batch_prompts = make_prompts(cfg, batch, length, seed=0)
    else:
        t = time.perf_counter()
        llm.generate([prompt], SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=1), use_tqdm=False)
        fill = time.perf_counter() - t
    start = time.perf_counter()
    outs = llm.generate(batch_prompts, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=OUTPUT),
                        use_tqdm=False)
    ms = [o.metrics for o in outs]
    m = timing_metrics(start, [x["first_token_time"] for x in ms], [x["finish_time"] for x in ms],
                       [x["token_times"] for x in ms], batch, length)
    row = dict(tree=os.path.basename(tree), method=method, length=length, batch=batch, mode=llm.execution_mode,
               decode_tok_s=m["decode_tok_s"], itl_p50_ms=m["itl_p50_ms"], ttft_max_s=m["ttft_max_s"],
               warm_prefill_s=fill, tokens=sum(len(o.outputs[0].token_ids) for o in outs),
               kv_cache_dtype=kv[0] if kv else "auto",
               **{k: v for k, v in llm.memory_accounting().items()
                  if k in ("kv_page_bytes", "hit_rate", "pcie_bytes_per_decode_step")})
    if recall:
        row.update(recall_sample_every=recall, attention_recall=[x["attention_recall"]["mean"] for x in ms],
                   output_rel_error=[x["attention_recall"]["output_rel_error"] for x in ms],
                   sampled_steps=[x["attention_recall"]["sampled_steps"] for x in ms])
    print("ROW", json.dumps(row), flush=True)
    llm.shutdown()
    del llm, outs   # a tree older than b85729a frees its engine only when the LLM is collected
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()

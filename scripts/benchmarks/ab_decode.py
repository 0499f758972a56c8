"""A/B decode timing of source trees: decode tok/s of one tree's engine for several cases in one process,
with that tree's own prompt maker and stable-window timing (its scripts/benchmarks/bench_case.py).

    python scripts/benchmarks/ab_decode.py TREE METHOD:LENGTH:BATCH[:RECALL] [...]

TREE is a checkout (e.g. a `git worktree add` of the commit to compare against); run it for each tree
on the same card, one after the other, and compare ratios. Llama-3.1-8B shape (PRESET=<name> for
another preset), random weights, default knobs, chunk_prefill_size 8192, max_num_batched_tokens
16384, CUDA graphs, overlapped scheduling, output 256. RECALL: recall_sample_every (the cost of
measuring attention recall; the row then carries the mean recall).

Cheaper than bench_sparse_vllm.py at long contexts, so that several methods fit one device lease:
the B requests of a case share one prompt, which a warm-up request (max_tokens=1) prefills once, so
they prefill only its last page (SnapKV: its window) and are admitted together. Methods without prefix
caching (DeltaKV) prefill all B. Decode reads shared pages, so absolute tok/s may run above the
benchmark's (L2 hits across requests); only the ratio between trees measured alike means anything."""
import argparse
import gc
import json
import os
import sys
import tempfile
import time

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("tree", help="a checkout: its src/ and scripts/benchmarks/ are what runs")
ap.add_argument("cases", nargs="+", metavar="METHOD:LENGTH:BATCH[:RECALL]")
args = ap.parse_args()
tree = os.path.abspath(args.tree)
sys.path.insert(0, os.path.join(tree, "src"))
sys.path.insert(0, os.path.join(tree, "scripts", "benchmarks"))
import torch  # noqa: E402
from bench_case import make_prompts, timing_metrics  # noqa: E402
from sparsevllm import LLM, SamplingParams  # noqa: E402

OUTPUT = 256
cfg = json.load(open(os.path.join(tree, "src/sparsevllm/presets", os.environ.get("PRESET", "llama-3.1-8b") + ".json")))
mdir = tempfile.mkdtemp()
json.dump(cfg, open(os.path.join(mdir, "config.json"), "w"))
for spec in args.cases:
    method, length, batch, *recall = spec.split(":")
    length, batch, recall = int(length), int(batch), int(recall[0]) if recall else 0
    llm = LLM(mdir, vllm_sparse_method=method, load_format="dummy", max_num_seqs=batch,
              max_model_len=length + OUTPUT + 64, chunk_prefill_size=8192, max_num_batched_tokens=16384,
              **({"recall_sample_every": recall} if recall else {}))   # older trees lack the knob
    warm = make_prompts(cfg, batch, 256, seed=10_000)
    llm.generate(warm, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=48), use_tqdm=False)
    prompt = make_prompts(cfg, 1, length, seed=0)[0]
    t = time.perf_counter()
    llm.generate([prompt], SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=1), use_tqdm=False)
    fill = time.perf_counter() - t
    start = time.perf_counter()
    outs = llm.generate([prompt] * batch, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=OUTPUT),
                        use_tqdm=False)
    ms = [o.metrics for o in outs]
    m = timing_metrics(start, [x["first_token_time"] for x in ms], [x["finish_time"] for x in ms],
                       [x["token_times"] for x in ms], batch, length)
    row = dict(tree=os.path.basename(tree), method=method, length=length, batch=batch, mode=llm.execution_mode,
               decode_tok_s=m["decode_tok_s"], itl_p50_ms=m["itl_p50_ms"], ttft_max_s=m["ttft_max_s"],
               warm_prefill_s=fill, tokens=sum(len(o.outputs[0].token_ids) for o in outs))
    if recall:
        row.update(recall_sample_every=recall, attention_recall=[x["attention_recall"]["mean"] for x in ms],
                   output_rel_error=[x["attention_recall"]["output_rel_error"] for x in ms],
                   sampled_steps=[x["attention_recall"]["sampled_steps"] for x in ms])
    print("ROW", json.dumps(row), flush=True)
    llm.shutdown()
    del llm, outs
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()

"""How many long requests a method decodes together in a fixed amount of GPU memory.

Runs N requests of one prompt length through one engine (a preset's shape, random weights) whose
memory is capped by gpu_memory_utilization, and reports the most requests that were decoding at
once, the KV pool's size and the wall time. Run it once per method with the same cap: a method
that holds fewer bytes per request (deltakv) decodes more of them at once than vanilla.

    python scripts/benchmarks/capacity.py --method vanilla --length 32768 --num_requests 16 \
        --gpu_memory_utilization 0.25 --hyper_params '{"chunk_prefill_size": 8192}'
"""
import argparse
import json
import os
import tempfile
import time
from importlib import resources

import torch

from sparsevllm import LLM, SamplingParams


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--method", default="vanilla")
    ap.add_argument("--preset", default="llama-3.1-8b")
    ap.add_argument("--length", type=int, default=32768, help="prompt tokens of every request")
    ap.add_argument("--output_len", type=int, default=64)
    ap.add_argument("--num_requests", type=int, default=16)
    ap.add_argument("--gpu_memory_utilization", type=float, default=0.25)
    ap.add_argument("--hyper_params", default="{}")
    ap.add_argument("--out", default=None, help="append the result as a JSON line here")
    args = ap.parse_args()
    folder = tempfile.mkdtemp()
    cfg = json.loads(resources.files("sparsevllm.presets").joinpath(f"{args.preset}.json").read_text())
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    llm = LLM(folder, vllm_sparse_method=args.method, load_format="dummy", max_num_seqs=args.num_requests,
              max_model_len=args.length + args.output_len + 16,
              gpu_memory_utilization=args.gpu_memory_utilization, **json.loads(args.hyper_params))
    gen = torch.Generator().manual_seed(0)
    eng = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    seqs = [eng.add_request(torch.randint(0, min(30000, cfg["vocab_size"]), (args.length,), generator=gen).tolist(), sp)
            for _ in range(args.num_requests)]
    running, peak, steps = eng.scheduler.running, 0, 0
    t0 = time.perf_counter()
    while eng.has_work():
        eng.step()
        steps += 1
        peak = max(peak, sum(not s.in_prefill for s in running))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    acc = eng.cache_manager.memory_accounting()
    out = {"method": args.method, "length": args.length, "num_requests": args.num_requests,
           "gpu_memory_utilization": args.gpu_memory_utilization,
           "peak_decoding_requests": peak, "kv_pool_gib": round(acc["kv_pool_bytes"] / 2**30, 2),
           "wall_s": round(time.perf_counter() - t0, 1), "steps": steps,
           "all_finished": all(s.is_finished for s in seqs)}
    print(json.dumps(out))
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(out) + "\n")


if __name__ == "__main__":
    main()

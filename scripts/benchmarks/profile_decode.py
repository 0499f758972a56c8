"""Where a decode step's time goes: GPU kernel time by kind vs wall time per step (the gap is host
work between graph replays). Llama-3.1-8B shape, random weights.

    python scripts/benchmarks/profile_decode.py --batch 1 --length 4096 [--method vanilla] [--steps 32]
"""
import argparse
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from importlib import resources

import torch
from torch.profiler import ProfilerActivity, profile

from sparsevllm import LLM, SamplingParams


def kind(name: str) -> str:
    n = name.lower()
    for key, label in (("decode_split", "decode attention"), ("decode_merge", "decode attention (merge)"),
                       ("gemm", "GEMM"), ("gemv", "GEMM"), ("nvjet", "GEMM"), ("cutlass", "GEMM"),
                       ("rms_norm", "rmsnorm"), ("rope", "rope"), ("silu", "silu_mul"), ("store", "kv store"),
                       ("argmax", "sampling"), ("copy", "copies"), ("quest_scores", "method: scores"),
                       ("select_pages", "method: select"), ("page_minmax", "method: page min/max")):
        if key in n:
            return label
    return "other"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--method", default="vanilla")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--preset", default="llama-3.1-8b")
    ap.add_argument("--hyper_params", default="{}")
    ap.add_argument("--out", default=None, help="write the breakdown as JSON here")
    args = ap.parse_args()
    folder = tempfile.mkdtemp()
    cfg = json.loads(resources.files("sparsevllm.presets").joinpath(f"{args.preset}.json").read_text())
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    llm = LLM(folder, vllm_sparse_method=args.method, load_format="dummy", max_num_seqs=args.batch,
              max_model_len=args.length + 4 * args.steps + 64, **json.loads(args.hyper_params))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1000, 30000, (args.length,), generator=gen).tolist() for _ in range(args.batch)]
    eng = llm.engine
    seqs = [eng.add_request(p, SamplingParams(temperature=0, max_tokens=4 * args.steps, ignore_eos=True))
            for p in prompts]
    while any(s.num_completion_tokens < 4 for s in seqs):  # prefill + a few warm decode steps
        eng.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        eng.step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / args.steps
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            eng.step()
        torch.cuda.synchronize()
    busy = defaultdict(float)  # ms per step by kernel kind (only device activity was recorded)
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", 0.0)
        if t:
            busy["memcpy" if "memcpy" in ev.key.lower() else kind(ev.key)] += t / 1e3 / args.steps
    total = sum(busy.values())
    out = {"method": args.method, "batch": args.batch, "length": args.length, "wall_ms_per_step": wall * 1e3,
           "gpu_busy_ms_per_step": total, "idle_ms_per_step": wall * 1e3 - total,
           "by_kind_ms": dict(sorted(busy.items(), key=lambda kv: -kv[1])), "mode": llm.execution_mode}
    print(json.dumps(out, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

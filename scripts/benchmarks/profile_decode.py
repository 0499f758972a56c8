"""Where a decode step's time goes: GPU kernel time by kind vs wall time per step (the gap is host
work between graph replays), and the longest stretches the GPU waits for the host. Llama-3.1-8B
shape, random weights.

    python scripts/benchmarks/profile_decode.py --batch 1 --length 4096 [--method vanilla] [--steps 32]
    python scripts/benchmarks/profile_decode.py --batch 64 --length 4096 --output_len 512 --vary_output --gaps
    python scripts/benchmarks/profile_decode.py --batch 32 --length 4096 --tp 2   # all-reduce share under TP

--gaps profiles every step after the last prefill until the last request finishes (requests ending at
different steps with --vary_output) and reports the idle gaps between consecutive GPU operations:
a gap longer than a kernel launch is the device waiting for the host.
"""
import argparse
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from importlib import resources

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from sparsevllm import LLM, SamplingParams


def kind(name: str) -> str:
    n = name.lower()
    for key, label in (("nccl", "all-reduce (NCCL)"), ("decode_split", "decode attention"), ("decode_merge", "decode attention (merge)"),
                       ("gemm", "GEMM"), ("gemv", "GEMM"), ("nvjet", "GEMM"), ("cutlass", "GEMM"), ("skinny", "GEMM"),
                       ("reconstruct", "method: rebuild"), ("rebuild", "method: rebuild"), ("radix", "method: select"),
                       ("rms_norm", "rmsnorm"), ("rope_store", "rope + kv store"), ("silu", "silu_mul"),
                       ("argmax", "sampling"), ("copy", "copies"), ("bound_scores", "method: scores"),
                       ("select_pages", "method: select"), ("page_bounds", "method: page min/max")):
        if key in n:
            return label
    return "other"


def gap_stats(prof, threshold_us: float = 50.0) -> dict:
    """Idle time between consecutive device operations (kernels and copies) on the timeline."""
    spans = sorted((ev.time_range.start, ev.time_range.end) for ev in prof.events()
                   if ev.device_type == torch.autograd.DeviceType.CUDA and ev.time_range.end > ev.time_range.start)
    if len(spans) < 2:
        return {}
    gaps, at, end = [], [], spans[0][1]
    for start, stop in spans[1:]:
        gaps.append(max(0.0, start - end))
        at.append((end - spans[0][0]) / 1e3)
        end = max(end, stop)
    g = np.asarray(gaps)
    largest = np.argsort(-g)[:10]
    return {"device_ops": len(spans), "timeline_ms": (end - spans[0][0]) / 1e3, "idle_ms": float(g.sum()) / 1e3,
            "max_gap_us": float(g.max()), "p99_gap_us": float(np.percentile(g, 99)),
            f"gaps_over_{threshold_us:.0f}us": int((g > threshold_us).sum()),
            "largest_gaps_us": [round(float(g[i]), 1) for i in largest],
            "largest_gaps_at_ms": [round(at[i], 3) for i in largest]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--method", default="vanilla")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--output_len", type=int, default=None, help="tokens per request (default 4 x --steps)")
    ap.add_argument("--vary_output", action="store_true",
                    help="output lengths spread uniformly over [output_len / 2, output_len] (seeded)")
    ap.add_argument("--gaps", action="store_true", help="profile from the last prefill to the end; report idle gaps")
    ap.add_argument("--preset", default="llama-3.1-8b")
    ap.add_argument("--hyper_params", default="{}")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks; rank 0's kernels are profiled "
                    "(its NCCL kernels' share is the all-reduce share of the step, waiting for peers included)")
    ap.add_argument("--out", default=None, help="write the breakdown as JSON here")
    args = ap.parse_args()
    output_len = args.output_len or 4 * args.steps
    folder = tempfile.mkdtemp()
    cfg = json.loads(resources.files("sparsevllm.presets").joinpath(f"{args.preset}.json").read_text())
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    # the model's own max_model_len, as the benchmark runs it: the CUDA graphs' table width (and so
    # the decode kernel's split count) is the same as there
    llm = LLM(folder, vllm_sparse_method=args.method, load_format="dummy", max_num_seqs=args.batch,
              tensor_parallel_size=args.tp, **json.loads(args.hyper_params))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1000, 30000, (args.length,), generator=gen).tolist() for _ in range(args.batch)]
    rng = np.random.default_rng(0)
    lens = (rng.integers(output_len // 2, output_len + 1, args.batch) if args.vary_output
            else [output_len] * args.batch)
    eng = llm.engine
    seqs = [eng.add_request(p, SamplingParams(temperature=0, max_tokens=int(n), ignore_eos=True))
            for p, n in zip(prompts, lens)]
    while any(s.num_completion_tokens < 4 for s in seqs):  # prefill + a few warm decode steps
        eng.step()
    torch.cuda.synchronize()
    out = {"method": args.method, "batch": args.batch, "length": args.length, "mode": llm.execution_mode,
           "async_scheduling": eng.async_scheduling}
    if args.gaps:
        steps, t0 = 0, time.perf_counter()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            while eng.has_work():
                eng.step()
                steps += 1
            torch.cuda.synchronize()
        out.update(output_lens=[int(x) for x in lens], steps=steps,
                   wall_ms_per_step=(time.perf_counter() - t0) * 1e3 / steps, gaps=gap_stats(prof))
    else:
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
        other = defaultdict(float)
        for ev in prof.key_averages():
            t = getattr(ev, "device_time_total", 0.0)
            if t:
                label = "memcpy" if "memcpy" in ev.key.lower() else kind(ev.key)
                busy[label] += t / 1e3 / args.steps
                if label == "other":
                    other[ev.key[:80]] += t / 1e3 / args.steps
        total = sum(busy.values())
        out.update(wall_ms_per_step=wall * 1e3, gpu_busy_ms_per_step=total, idle_ms_per_step=wall * 1e3 - total,
                   by_kind_ms=dict(sorted(busy.items(), key=lambda kv: -kv[1])),
                   other_ms=dict(sorted(other.items(), key=lambda kv: -kv[1])[:10]), gaps=gap_stats(prof))
    print(json.dumps(out, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

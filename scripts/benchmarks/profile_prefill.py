"""Where one long prefill's time goes, and how fast each attention backend runs its shape.

    python scripts/benchmarks/profile_prefill.py --length 32768 [--chunk 32768] [--preset llama-3.1-8b]

Part 1 prefills one prompt of --length tokens through the engine (random weights, chunks of --chunk
tokens) and reports wall time, model TFLOP/s (every linear layer plus causal attention, the count
BENCHMARKS.md uses) and GPU time by kernel kind from the torch profiler. Part 2 times causal
attention of one sequence of that length alone through every backend torch offers (varlen_attn,
SDPA flash / cuDNN / memory-efficient, GQA native or with K/V repeated), so the engine's choice can
be read against them.
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
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from profile_decode import kind  # noqa: E402

from sparsevllm import LLM, SamplingParams  # noqa: E402


def model_flops(cfg: dict, length: int) -> float:
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    linear = 2 * length * layers * (h * q + 2 * h * kv + q * h + 3 * h * inter)
    attention = 4 * layers * cfg["num_attention_heads"] * d * length * length / 2   # causal half
    return linear + attention + 2 * h * cfg["vocab_size"]   # logits of the last token only


def attention_flops(cfg: dict, length: int) -> float:
    d = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 4 * cfg["num_attention_heads"] * d * length * length / 2


def time_ms(fn, reps: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def engine_prefill(cfg: dict, folder: str, length: int, chunk: int, hyper: dict) -> dict:
    llm = LLM(folder, load_format="dummy", max_num_seqs=1, max_model_len=length + 64,
              chunk_prefill_size=chunk, max_num_batched_tokens=chunk, **hyper)
    gen = torch.Generator().manual_seed(0)

    def one_prefill():
        prompt = torch.randint(1000, 30000, (length,), generator=gen).tolist()
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False)

    one_prefill()   # compile kernels, warm the allocator
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    one_prefill()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        one_prefill()
        torch.cuda.synchronize()
    busy = defaultdict(float)
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", 0.0)
        if t:
            name = ev.key.lower()
            label = "attention" if any(s in name for s in ("flash", "fmha", "attn", "prefill_paged")) else kind(ev.key)
            busy[label] += t / 1e3
    flops = model_flops(cfg, length)
    return {"wall_s": wall, "model_flops": flops, "tflops": flops / wall / 1e12,
            "gpu_ms_by_kind": dict(sorted(busy.items(), key=lambda kv: -kv[1]))}


def attention_backends(cfg: dict, length: int) -> dict:
    from sparsevllm.kernels.prefill_attention import _varlen_torch, varlen_backends
    hq, hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or cfg["hidden_size"] // hq
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(length, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(length, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(length, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    q4, k4, v4 = (x.transpose(0, 1)[None] for x in (q, k, v))
    k4r, v4r = (x.repeat_interleave(hq // hkv, dim=1) for x in (k4, v4))
    flops, out = attention_flops(cfg, length), {}
    cu = torch.tensor([0, length], dtype=torch.int32, device="cuda")
    cases = {}
    if varlen_backends()[0] is not None:
        cases["varlen_attn"] = lambda: _varlen_torch(q, k, v, cu, length, d ** -0.5)
    for name, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("sdpa_efficient", SDPBackend.EFFICIENT_ATTENTION)):
        for gqa in ("gqa", "repeat"):
            def run(backend=backend, gqa=gqa):
                with sdpa_kernel([backend]):
                    if gqa == "gqa":
                        return F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, enable_gqa=True)
                    return F.scaled_dot_product_attention(q4, k4r, v4r, is_causal=True)
            cases[f"{name}_{gqa}"] = run
    for name, fn in cases.items():
        try:
            ms = time_ms(fn)
            out[name] = {"ms": ms, "tflops": flops / ms / 1e9}
        except Exception as e:  # noqa: BLE001 - a backend that does not take this shape is reported
            out[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--length", type=int, default=32768)
    ap.add_argument("--chunk", type=int, default=None, help="prefill chunk (default: the whole prompt)")
    ap.add_argument("--preset", default="llama-3.1-8b")
    ap.add_argument("--hyper_params", default="{}")
    ap.add_argument("--skip_engine", action="store_true", help="only time the attention backends")
    ap.add_argument("--out", default=None, help="write the report as JSON here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_prefill.py needs a CUDA device")
    cfg = json.loads(resources.files("sparsevllm.presets").joinpath(f"{args.preset}.json").read_text())
    folder = tempfile.mkdtemp()
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    report = {"length": args.length, "chunk": args.chunk or args.length, "preset": args.preset,
              "attention_flops_per_layer": attention_flops(cfg, args.length)}
    if not args.skip_engine:
        report["engine"] = engine_prefill(cfg, folder, args.length, args.chunk or args.length,
                                          json.loads(args.hyper_params))
        torch.cuda.empty_cache()   # the engine is gone: its memory goes to the backend timings
    report["attention_backends"] = attention_backends(cfg, args.length)
    print(json.dumps(report, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

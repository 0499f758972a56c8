"""Which FP8 scale granularity to build: teacher-forced log-prob drift against the model dtype.

Each candidate is simulated in the running engine: every K (after RoPE) and V the cache stores is
rounded through float8_e4m3fn with that candidate's scales and written back in the model dtype, so
decode and chunked prefill read exactly what an FP8 cache would hand them after dequantization.
The reference is the same engine storing the model dtype. Drift is mean |delta log p(target)| over
the teacher-forced continuation, plus mean KL(auto || fp8) and top-1 agreement.

    PYTHONPATH=src python scripts/benchmarks/fp8_granularity.py --lengths 1024,2048 --samples 4

Candidates: tensor (one scale 1.0, vLLM's default without calibrated scales), layer_head (one
static scale per layer and KV head: amax over every store of a calibration pass on the same samples
/ 448), token_head (a scale per stored token and KV head: amax over its D channels / 448);
bf16 (K and V rounded to bfloat16, no FP8) is the yardstick: the rounding a bf16 cache already has.
Which half drifts: k_only / v_only quantize one of K and V per token and head and round the other to
bf16; k_channel gives K a static scale per layer, KV head and channel (calibrated like layer_head; keys'
outliers sit in fixed channels) and V its scale per token and head; k_smooth divides each K channel by
the square root of its calibrated amax before the scale per token and head and multiplies it back after
(a factor q could absorb), so outlier channels no longer set every token's scale.

With --methods, the engine's real kv_cache_dtype="fp8" against "auto" instead, per method (each at
the knobs given as JSON in --hyper_params), on the same samples:

    PYTHONPATH=src python scripts/benchmarks/fp8_granularity.py --methods vanilla,quest,snapkv,omnikv,hisparse \
        --hyper_params '{"quest_token_budget": 256, "snapkv_capacity": 512, "hisparse_token_budget": 256}'
"""
import argparse
import json

import torch

import sparsevllm.engine.cache_manager.base as base
from sparsevllm import LLM
from sparsevllm.regression.fidelity import fidelity_sample

FP8_MAX = 448.0
# (K's mode, V's mode) of the candidates that treat them differently
HALVES = {"k_only": ("token_head", "bf16"), "v_only": ("bf16", "token_head"),
          "k_channel": ("channel", "token_head"), "k_smooth": ("smooth", "token_head")}


def fake_quant(x: torch.Tensor, mode: str, layer_amax: torch.Tensor | None) -> torch.Tensor:
    """x: [T, H, D] -> x rounded through float8_e4m3fn with the mode's scales, in x's dtype.
    layer_amax: [H] (layer_head) or [H, D] (channel)."""
    if mode == "bf16":
        return x.to(torch.bfloat16).to(x.dtype)
    if mode == "tensor":
        scale = torch.ones((), dtype=torch.float32)
    elif mode == "smooth":   # divide out sqrt of each channel's amax, scale per token, multiply back
        smooth = layer_amax.clamp_min(1e-6).sqrt().view(1, *layer_amax.shape)
        y = x.float() / smooth
        scale = (y.abs().amax(-1, keepdim=True) / FP8_MAX).clamp_min(1e-12)
        return ((y / scale).to(torch.float8_e4m3fn).float() * scale * smooth).to(x.dtype)
    elif mode in ("layer_head", "channel"):
        shape = layer_amax.shape if mode == "channel" else (*layer_amax.shape, 1)   # [H, D] or [H, 1]
        scale = (layer_amax / FP8_MAX).clamp_min(1e-12).view(1, *shape)
    else:
        scale = (x.float().abs().amax(-1, keepdim=True) / FP8_MAX).clamp_min(1e-12)
    return ((x.float() / scale).to(torch.float8_e4m3fn).float() * scale).to(x.dtype)


def score(ref, got, conts) -> dict:
    drift, kl, agree = [], [], []
    for r, g, c in zip(ref, got, conts):
        idx = torch.tensor(c).view(-1, 1)
        drift.append((r.gather(1, idx) - g.gather(1, idx)).abs().mean().item())
        kl.append(torch.nn.functional.kl_div(g, r, log_target=True, reduction="none").sum(-1).mean().item())
        agree.append((r.argmax(-1) == g.argmax(-1)).float().mean().item())
    n = len(drift)
    return {"mean_abs_dlogp": sum(drift) / n, "max_sample_dlogp": max(drift), "kl": sum(kl) / n,
            "top1_agreement": sum(agree) / n}


def compare_methods(a):
    from sparsevllm.method_registry import method_knob_owners
    owners, knobs = method_knob_owners(), json.loads(a.hyper_params)
    results = {}
    for method in a.methods.split(","):
        own = {k: v for k, v in knobs.items() if owners.get(k) == method}
        runs = {}
        for kv in ("auto", "fp8"):
            llm = LLM(None, vllm_sparse_method=method, kv_cache_dtype=kv, chunk_prefill_size=a.chunk,
                      max_num_batched_tokens=a.chunk, enable_prefix_caching=False, **own)
            samples = [fidelity_sample(llm.tokenizer, int(n), i, 0, num_tokens=a.tokens)
                       for n in a.lengths.split(",") for i in range(a.samples)]
            conts = [s.continuation_ids for s in samples]
            runs[kv] = llm.teacher_forced_logprobs([s.prompt_token_ids for s in samples], conts, use_tqdm=False)
            llm.shutdown()
        results[method] = dict(score(runs["auto"], runs["fp8"], conts), knobs=own)
        print(method, json.dumps(results[method]), flush=True)
    print(json.dumps({"lengths": a.lengths, "samples": a.samples, "tokens": a.tokens, "chunk": a.chunk,
                      "methods": results}))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--lengths", default="1024,2048")
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--modes", default="tensor,layer_head,token_head")
    p.add_argument("--chunk", type=int, default=512, help="chunk_prefill_size: later chunks read the stored prefix")
    p.add_argument("--methods", default=None, help="compare the engine's fp8 with auto per method instead")
    p.add_argument("--hyper_params", default="{}", help="method knobs for --methods (JSON)")
    a = p.parse_args()
    if a.methods:
        return compare_methods(a)
    llm = LLM(None, chunk_prefill_size=a.chunk, max_num_batched_tokens=a.chunk, enable_prefix_caching=False)
    tok = llm.tokenizer
    samples = [fidelity_sample(tok, int(n), i, 0, num_tokens=a.tokens)
               for n in a.lengths.split(",") for i in range(a.samples)]
    prompts = [s.prompt_token_ids for s in samples]
    conts = [s.continuation_ids for s in samples]
    ref = llm.teacher_forced_logprobs(prompts, conts, use_tqdm=False)

    # amax per (layer, KV head) over everything each sample stores, for the static candidate
    amax = {}
    real = base.rope_store

    def record(q, k, v, positions, cs, kc, vc, slots, *rest):
        q2, k2 = real(q, k, v, positions, cs, kc, vc, slots, *rest)
        lid = record.layer
        for name, x in (("k", k2), ("v", v)):
            m = x.float().abs().amax(dim=(0, 2))
            amax[(lid, name)] = torch.maximum(amax.get((lid, name), m), m)
        m = k2.float().abs().amax(dim=0)   # [H, D]: per channel, for k_channel and k_smooth
        amax[(lid, "kc")] = torch.maximum(amax.get((lid, "kc"), m), m)
        return q2, k2

    results, calibrating = {}, False
    for mode in a.modes.split(","):
        def store(self, layer_id, q, k, v, cos_sin_cache, step, mode=mode):
            k_cache, v_cache = self.pool.layer(layer_id)
            if calibrating:   # every store of the calibration pass is recorded and kept exact
                record.layer = layer_id
                return record(q, k, v, step.positions, cos_sin_cache, k_cache, v_cache, step.slot_mapping)
            q2, k2 = real(q, k, v, step.positions, cos_sin_cache, k_cache, v_cache, step.slot_mapping)
            keep = step.slot_mapping >= 0
            slots = step.slot_mapping[keep].long()
            k_mode, v_mode = HALVES.get(mode, (mode, mode))
            k_amax = amax.get((layer_id, "kc" if k_mode in ("channel", "smooth") else "k"))
            k_cache[slots] = fake_quant(k2[keep], k_mode, k_amax)
            v_cache[slots] = fake_quant(v[keep], v_mode, amax.get((layer_id, "v")))
            return q2, k2
        if mode in ("layer_head", "k_channel", "k_smooth"):   # a calibration pass over the samples fills amax
            amax.clear()
            calibrating = True
            base.CacheManager.store_kv = store
            llm.teacher_forced_logprobs(prompts, conts, use_tqdm=False)
        calibrating = False
        base.CacheManager.store_kv = store
        got = llm.teacher_forced_logprobs(prompts, conts, use_tqdm=False)
        results[mode] = score(ref, got, conts)
        print(mode, json.dumps(results[mode]), flush=True)
    print(json.dumps({"lengths": a.lengths, "samples": a.samples, "tokens": a.tokens, "chunk": a.chunk,
                      "results": results}))


if __name__ == "__main__":
    main()

"""One benchmark case, run inside its own process: build the engine (or the HF baseline), warm up,
time `repeat` generations of `batch` synthetic prompts, and turn per-token timestamps into metrics."""
import json
import platform
import resource
import statistics
import time
from dataclasses import asdict, is_dataclass

import numpy as np

# Decode steps skipped after the last request is admitted before the stable window opens: the first
# steps after a prefill still pay for allocator growth and cold caches.
DECODE_WARMUP_STEPS = 4


class KVCapacityError(RuntimeError):
    """The case cannot hold all its requests at once, so no stable decode window exists."""


# every row carries these keys; a failed case has them as None
METRIC_KEYS = ("ttft_mean_s", "ttft_max_s", "prefill_tok_s", "decode_tok_s", "itl_p50_ms", "itl_p99_ms",
               "decode_window_tokens", "decode_window_s", "concurrent", "decoded_tokens", "execution_mode",
               "dtype", "memory_accounting", "memory_accounting_peak", "peak_device_bytes", "max_rss_bytes",
               "resolved_config", "attention_recall", "attention_recall_output_rel_error")


def make_prompts(cfg: dict, batch: int, length: int, seed: int) -> list[list[int]]:
    """Random token ids of exact length. Real vocabularies keep their special tokens at the top
    (Llama-3 from 128000, Qwen3 from 151643), so ids come from the bottom 90%, minus any id the
    config names as special."""
    vocab = cfg["vocab_size"]
    special = set()
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        ids = cfg.get(key)
        special.update(ids if isinstance(ids, list) else [] if ids is None else [ids])
    low, high = min(100, vocab // 4), max(int(vocab * 0.9), min(100, vocab // 4) + 2)
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(batch):
        ids = rng.integers(low, high, size=length)
        while special.intersection(ids.tolist()):
            bad = np.isin(ids, list(special))
            ids[bad] = rng.integers(low, high, size=int(bad.sum()))
        out.append(ids.tolist())
    return out


def output_lens(case: dict) -> list[int]:
    """Per-request output lengths: all output_len, or with vary_output spread uniformly over
    [output_len / 2, output_len] (seeded), so requests finish at different steps."""
    if not case.get("vary_output"):
        return [case["output_len"]] * case["batch"]
    rng = np.random.default_rng(case["seed"] + 20_000)
    return [int(n) for n in rng.integers(max(1, case["output_len"] // 2), case["output_len"] + 1, case["batch"])]


def timing_metrics(start: float, first_token_times: list[float], finish_times: list[float],
                   token_times: list[list[float]], batch: int, length: int) -> dict:
    """Prefill and TTFT from the first tokens; decode from the stable window, which opens
    DECODE_WARMUP_STEPS steps after every request has its first token and closes when the first
    request finishes (after that the batch shrinks)."""
    ttft = [t - start for t in first_token_times]
    last_first = max(first_token_times)
    m = {"ttft_mean_s": statistics.fmean(ttft), "ttft_max_s": max(ttft),
         "prefill_tok_s": batch * length / (last_first - start) if last_first > start else None,
         "decode_tok_s": None, "itl_p50_ms": None, "itl_p99_ms": None, "decode_window_tokens": 0,
         "decode_window_s": None, "concurrent": last_first <= min(finish_times)}
    # the request admitted last sets the clock: its k-th token time is k decode steps after admission
    late = max(range(len(token_times)), key=lambda i: first_token_times[i])
    times = token_times[late]
    if not m["concurrent"] or len(times) < 2:
        return m
    t0 = times[min(DECODE_WARMUP_STEPS, len(times) - 2)]
    t1 = min(tt[-1] for tt in token_times)
    if t1 <= t0:
        return m
    count = sum(1 for tt in token_times for t in tt if t0 < t <= t1)
    itl = [b - a for tt in token_times for a, b in zip(tt, tt[1:]) if a >= t0 and b <= t1]
    m.update(decode_tok_s=count / (t1 - t0), decode_window_tokens=count, decode_window_s=t1 - t0)
    if itl:
        m.update(itl_p50_ms=float(np.percentile(itl, 50)) * 1e3, itl_p99_ms=float(np.percentile(itl, 99)) * 1e3)
    return m


def median_metrics(runs: list[dict]) -> dict:
    """Median of every numeric field over the repeats; per-run decode/prefill figures kept too."""
    out = dict(runs[0])
    for key, value in runs[0].items():
        vals = [r[key] for r in runs if isinstance(r.get(key), (int, float)) and not isinstance(r[key], bool)]
        if isinstance(value, (int, float)) and not isinstance(value, bool) and len(vals) == len(runs):
            out[key] = statistics.median(vals)
    out["concurrent"] = all(r["concurrent"] for r in runs)
    out["runs_decode_tok_s"] = [r["decode_tok_s"] for r in runs]
    out["runs_prefill_tok_s"] = [r["prefill_tok_s"] for r in runs]
    return out


def _jsonable(obj):
    if is_dataclass(obj):
        obj = asdict(obj)
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    return str(obj)


def environment() -> dict:
    import torch
    env = {"python": platform.python_version(), "torch": torch.__version__, "gpu": None}
    for mod in ("triton", "transformers", "sparsevllm"):
        try:
            env[mod] = getattr(__import__(mod), "__version__", "unknown")
        except Exception:  # noqa: BLE001 - a missing optional package is recorded, not fatal
            env[mod] = None
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
    return env


def _memory(torch) -> dict:
    mem = {"max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
           "peak_device_bytes": None, "peak_device_reserved_bytes": None}
    if torch.cuda.is_available():
        mem["peak_device_bytes"] = torch.cuda.max_memory_allocated()
        mem["peak_device_reserved_bytes"] = torch.cuda.max_memory_reserved()
    return mem


def _track_peak_accounting(llm) -> dict:
    """Sample memory_accounting() after every engine step and keep each field's maximum, since after
    generate() returns every request's pages are free again. Costs a small dict per step."""
    peak: dict = {}
    engine = getattr(llm, "engine", None)
    if engine is None or not hasattr(engine, "step"):
        return peak
    step = engine.step

    def step_and_sample(*args, **kwargs):
        out = step(*args, **kwargs)
        for key, value in llm.memory_accounting().items():
            if isinstance(value, (int, float)):
                peak[key] = max(peak.get(key, value), value)
        return out

    engine.step = step_and_sample
    return peak


def _resolved_dtype(llm) -> str:
    """The dtype the weights and KV really use (the config may still say "auto")."""
    if llm.config.dtype != "auto":
        return llm.config.dtype
    runner = getattr(getattr(llm, "engine", None), "model_runner", None)
    return str(getattr(runner, "dtype", "unknown")).replace("torch.", "")


# Warm-up decodes this many tokens: enough that work a method does every few windows of decode runs
# once before the clock starts (DeltaKV compresses when a 256-token prompt's raw tail passes two
# windows of 128, 8 tokens in, over the next 16 steps); on the H200 the first such event of a
# process cost 138 ms of one step (one-time set-up), inside the decode window that 4 tokens left it.
WARMUP_DECODE_TOKENS = 48


def _warmup_prompts(cfg: dict, case: dict) -> list[list[int]]:
    # short, so warm-up compiles kernels and touches every path without costing a long prefill; the
    # run's batch, so batched paths see the run's request count
    return make_prompts(cfg, case["batch"], min(case["length"], 256), seed=case["seed"] + 10_000)


def run_engine_case(case: dict) -> dict:
    import torch
    from sparsevllm import LLM, SamplingParams

    cfg = case["model_config"]
    llm = LLM(case["model_dir"], vllm_sparse_method=case["method"], **case["engine_kwargs"])
    result = {"resolved_config": _jsonable(llm.config), "execution_mode": llm.execution_mode,
              "dtype": _resolved_dtype(llm)}
    accounting = llm.memory_accounting()
    stored = case.get("kv_tokens_stored")
    if stored is not None and "num_pages" in accounting:
        page = llm.config.page_size
        need = case["batch"] * -(-stored // page)
        if need > accounting["num_pages"]:
            raise KVCapacityError(
                f"KV pool too small for this case: {case['batch']} requests x {stored} tokens need {need} pages "
                f"of {page} tokens, the pool has {accounting['num_pages']} (raise gpu_memory_utilization / "
                f"num_kv_pages, or lower the batch or length)")
    out_lens = output_lens(case)
    llm.generate(_warmup_prompts(cfg, case), SamplingParams(temperature=0.0, ignore_eos=True,
                                                            max_tokens=WARMUP_DECODE_TOKENS), use_tqdm=False)
    peak = _track_peak_accounting(llm)
    runs, decoded, recalls = [], [], []
    for r in range(case["repeat"]):
        # fresh prompts each repeat, so the prefix cache cannot turn a repeat's prefill into a lookup
        prompts = make_prompts(cfg, case["batch"], case["length"], seed=case["seed"] + r)
        params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n) for n in out_lens]
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        errors = [o.error for o in outs if o.outputs[0].finish_reason == "error"]
        if errors:
            raise RuntimeError(f"{len(errors)} of {len(outs)} requests failed: {errors[0]}")
        ms = [o.metrics for o in outs]
        runs.append(timing_metrics(start, [m["first_token_time"] for m in ms], [m["finish_time"] for m in ms],
                                   [m["token_times"] for m in ms], case["batch"], case["length"]))
        decoded.append(sum(len(o.outputs[0].token_ids) for o in outs))
        recalls += [m["attention_recall"] for m in ms if (m.get("attention_recall") or {}).get("mean") is not None]
    result.update(median_metrics(runs))
    if recalls:   # recall_sample_every: the mean over every request of every repeat
        result.update(attention_recall=statistics.mean(r["mean"] for r in recalls),
                      attention_recall_output_rel_error=statistics.mean(r["output_rel_error"] for r in recalls))
    result.update(decoded_tokens=decoded[-1], expected_decoded_tokens=sum(out_lens),
                  memory_accounting=_jsonable(accounting), memory_accounting_peak=peak or None, **_memory(torch))
    return result


def run_hf_case(case: dict) -> dict:
    """transformers `generate` with random weights from the same config: greedy, SDPA, forced to
    output_len tokens. A stopping criterion that never stops timestamps every generated token."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, StoppingCriteria, StoppingCriteriaList

    knobs = case["engine_kwargs"]
    device = knobs.get("device", "auto")
    device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    # the engine's defaults: bf16 on a GPU, fp32 on a CPU
    dtype = knobs.get("dtype", "auto")
    dtype = getattr(torch, dtype) if dtype != "auto" else torch.bfloat16 if device == "cuda" else torch.float32
    hf_cfg = AutoConfig.from_pretrained(case["model_dir"])
    torch.manual_seed(knobs.get("seed", 0))
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype, attn_implementation="sdpa").eval()

    class TokenClock(StoppingCriteria):
        def __init__(self):
            self.times = []

        def __call__(self, input_ids, scores, **kwargs):
            if device == "cuda":
                torch.cuda.synchronize()
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def generate(prompts, new_tokens):
        ids = torch.tensor(prompts, device=device)
        clock = TokenClock()
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                           max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0,
                           stopping_criteria=StoppingCriteriaList([clock]))
        return start, clock.times

    generate(_warmup_prompts(case["model_config"], case), 4)
    runs, decoded = [], 0
    for r in range(case["repeat"]):
        prompts = make_prompts(case["model_config"], case["batch"], case["length"], seed=case["seed"] + r)
        start, times = generate(prompts, case["output_len"])
        # every sequence of the batch gets each token at the same step
        runs.append(timing_metrics(start, [times[0]] * case["batch"], [times[-1]] * case["batch"],
                                   [times] * case["batch"], case["batch"], case["length"]))
        decoded = case["batch"] * len(times)
    result = {"resolved_config": {"model": case["model_dir"], "dtype": str(dtype), "attn_implementation": "sdpa",
                                  "device": device, "transformers_generate": True},
              "execution_mode": "eager", "dtype": str(dtype).replace("torch.", ""), "memory_accounting": None}
    result.update(median_metrics(runs))
    result.update(decoded_tokens=decoded, expected_decoded_tokens=case["batch"] * case["output_len"],
                  **_memory(torch))
    return result


def run_case_file(path: str) -> int:
    """Child-process entry: read the case, run it, write {"status", ...} next to it. A Python-level
    failure is caught and classified here; a hard crash leaves no result and the parent records it."""
    with open(path) as f:
        case = json.load(f)
    result = {"environment": environment()}
    try:
        runner = run_hf_case if case["method"] == "hf" else run_engine_case
        result.update(runner(case), status="ok", error=None)
    except Exception as e:  # noqa: BLE001 - every failure becomes this case's status
        import traceback
        traceback.print_exc()
        oom = isinstance(e, (MemoryError, KVCapacityError)) or "out of memory" in str(e).lower()
        result.update(status="oom" if oom else "failed", error=f"{type(e).__name__}: {e}")
    with open(case["result_path"], "w") as f:
        json.dump(_jsonable(result), f)
    return 0

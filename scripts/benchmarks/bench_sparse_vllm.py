"""Sparse-vLLM throughput benchmark: decode/prefill speed of sparse methods against vanilla.

    python scripts/benchmarks/bench_sparse_vllm.py --model_path llama-3.1-8b --methods vanilla \
        --lengths 4096,32768 --batch_sizes 1,4 --output_len 256 --out_dir bench_out

Each (method, length, batch) case runs in its own process, so an out-of-memory error or a crash
becomes that case's status and the sweep goes on. Results: <out_dir>/results.jsonl (appended, one
row per case), summary.md and plot.png (this run's cases). See BENCHMARKS.md for the protocol.
"""
import argparse
import dataclasses
import importlib.util
import json
import os
import shlex
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(os.path.dirname(HERE)), "src")
if importlib.util.find_spec("sparsevllm") is None and os.path.isdir(os.path.join(SRC, "sparsevllm")):
    sys.path.insert(0, SRC)  # running from a checkout without `pip install`
sys.path.insert(0, HERE)

import bench_case  # noqa: E402
import bench_roofline  # noqa: E402

# knobs the benchmark sets itself, per case
RESERVED_KNOBS = {"model": "--model_path", "vllm_sparse_method": "--methods", "sparse_method": "--methods",
                  "tensor_parallel_size": "--tp"}
BASELINES = ("hf",)
CHILD_FLAG = "--_run_case"  # not in --help: only this script starts case processes


def presets_dir() -> str:
    # found without importing sparsevllm, so --help and bad input stay fast
    spec = importlib.util.find_spec("sparsevllm")
    if spec is None:
        raise ValueError("the sparsevllm package is not importable; pip install it or set PYTHONPATH=src")
    return os.path.join(list(spec.submodule_search_locations)[0], "presets")


def available_presets() -> list[str]:
    d = presets_dir()
    return sorted(f[:-5] for f in os.listdir(d) if f.endswith(".json")) if os.path.isdir(d) else []


def parse_int_list(flag: str, text: str) -> list[int]:
    """'4096,32k' -> [4096, 32768]; every entry must be a positive integer."""
    out = []
    for item in text.split(","):
        item = item.strip()
        try:
            value = int(item[:-1]) * 1024 if item.lower().endswith("k") else int(item)
        except ValueError:
            raise ValueError(f"{flag}: {item!r} is not an integer (use e.g. 4096 or 4k)") from None
        if value < 1:
            raise ValueError(f"{flag}: {value} is invalid; every value must be an integer >= 1")
        out.append(value)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Sparse-vLLM throughput benchmark: TTFT, prefill and decode tok/s, ITL, memory and the "
                    "memory-bandwidth roofline per (method, length, batch), each case in its own process.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    try:
        presets = ", ".join(available_presets())
    except ValueError:
        presets = "(sparsevllm not importable)"
    p.add_argument("--model_path", required=True,
                   help="a Hugging Face model folder (config.json + safetensors), or a shipped preset run with "
                        f"random weights at its real shape: {presets} (tiny is a small Llama for CPU smoke runs)")
    p.add_argument("--methods", default="vanilla",
                   help="comma-separated registered sparse methods; vanilla is the speed-up reference")
    p.add_argument("--lengths", default="4096", help="comma-separated prompt lengths in tokens (4k = 4096)")
    p.add_argument("--batch_sizes", default="1", help="comma-separated batch sizes (requests run at once)")
    p.add_argument("--output_len", type=int, default=256,
                   help="tokens generated per request (>= 256 for a reported figure, 128 for a quick look)")
    p.add_argument("--vary_output", action="store_true",
                   help="spread the requests' output lengths uniformly over [output_len / 2, output_len] (seeded), "
                        "so they finish at different steps; decode tok/s covers the steps before the first finishes")
    p.add_argument("--hyper_params", default="{}",
                   help="JSON object of engine knobs (e.g. gpu_memory_utilization, chunk_prefill_size, page_size) "
                        "and method knobs (prefixed by the method name, e.g. quest_token_budget); a method knob "
                        "only goes to its own method's cases")
    p.add_argument("--out_dir", default="bench_out", help="where results.jsonl, summary.md and plot.png go")
    p.add_argument("--repeat", type=int, default=1,
                   help="measured generations per case, each with fresh prompts; the median is reported")
    p.add_argument("--enforce_eager", action="store_true", help="decode without CUDA graphs")
    p.add_argument("--kv_cache_dtype", default=None,
                   help="KV cache storage for every method: auto (the model dtype) | fp8 | fp8_e4m3 "
                        "(same as the kv_cache_dtype knob in --hyper_params)")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel ranks (GPUs of this host) per case; 1 runs on one device")
    p.add_argument("--baseline", choices=BASELINES, default=None,
                   help="also run Hugging Face transformers generate (SDPA, random weights, same prompts) as "
                        "method 'hf'")
    p.add_argument("--hbm_bw", type=float, default=None,
                   help="memory bandwidth in bytes/s for the roofline; by default the H200's measured copy rate "
                        f"({bench_roofline.DEFAULT_HBM_BW:.3g}) on a GPU; on a CPU this machine's copy rate, "
                        "measured at the start")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic prompts")
    p.add_argument("--recall_sample_every", "--recall-sample-every", type=int, default=0,
                   help="measure attention recall every N-th decode step of each request; rows get "
                        "attention_recall (mean over requests) and its output error (default: 0, off)")
    p.add_argument("--case_timeout", type=float, default=3600.0,
                   help="seconds after which a case's process is killed and recorded as failed")
    return p


def load_model_config(model_path: str) -> tuple[dict, bool]:
    """(config.json dict, is_preset). An existing folder wins over a preset of the same name."""
    if os.path.isdir(model_path):
        cfg_path = os.path.join(model_path, "config.json")
        if not os.path.isfile(cfg_path):
            raise ValueError(f"--model_path {model_path!r} is a folder without config.json")
        with open(cfg_path) as f:
            return json.load(f), False
    presets = available_presets()
    if model_path in presets:
        with open(os.path.join(presets_dir(), model_path + ".json")) as f:
            return json.load(f), True
    raise ValueError(f"--model_path {model_path!r} is neither a model folder nor a preset; "
                     f"presets: {', '.join(presets)}")


def validate(args) -> dict:
    """Every check that can fail before a model loads; returns the sweep plan. Knob validation goes
    through sparsevllm.method_registry.make_config, which builds the config without loading anything."""
    lengths = parse_int_list("--lengths", args.lengths)
    batches = parse_int_list("--batch_sizes", args.batch_sizes)
    if args.output_len < 1:
        raise ValueError(f"--output_len {args.output_len} is invalid; it must be >= 1")
    if args.repeat < 1:
        raise ValueError(f"--repeat {args.repeat} is invalid; it must be >= 1")
    if args.hbm_bw is not None and args.hbm_bw <= 0:
        raise ValueError(f"--hbm_bw {args.hbm_bw} is invalid; it must be a positive bytes/s figure")
    from sparsevllm.config import json_knobs
    knobs = json_knobs(args.hyper_params, "--hyper_params")
    for key, flag in RESERVED_KNOBS.items():
        if key in knobs:
            raise ValueError(f"--hyper_params must not set {key!r}; use {flag}")
    if args.enforce_eager:
        knobs["enforce_eager"] = True
    if args.kv_cache_dtype is not None:
        if knobs.get("kv_cache_dtype", args.kv_cache_dtype) != args.kv_cache_dtype:
            raise ValueError(f"--kv_cache_dtype {args.kv_cache_dtype} contradicts --hyper_params' kv_cache_dtype "
                             f"{knobs['kv_cache_dtype']!r}; give one of them")
        knobs["kv_cache_dtype"] = args.kv_cache_dtype
    if args.tp < 1:
        raise ValueError(f"--tp {args.tp} is invalid; it must be an integer >= 1")
    if args.tp > 1:
        knobs["tensor_parallel_size"] = args.tp
    if args.recall_sample_every:   # an engine knob like any other: make_config validates it
        knobs["recall_sample_every"] = args.recall_sample_every
    model_cfg, is_preset = load_model_config(args.model_path)
    if is_preset:
        if knobs.get("load_format", "dummy") != "dummy":
            raise ValueError(f"preset {args.model_path!r} has no weights; load_format must be 'dummy'")
        knobs["load_format"] = "dummy"

    from sparsevllm.method_registry import make_config
    from sparsevllm.method_registry import available_methods, method_knob_owners

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    registered = available_methods()
    for m in methods:
        if m not in registered:
            raise ValueError(f"--methods: unknown method {m!r}; registered methods: {', '.join(registered)}")
    if not methods and not args.baseline:
        raise ValueError("--methods is empty and no --baseline is given: nothing to run")
    owners = method_knob_owners()
    for key in knobs:
        if key in owners and owners[key] not in methods:
            raise ValueError(f"--hyper_params: knob {key!r} belongs to method {owners[key]!r}, "
                             f"which is not in --methods ({', '.join(methods)})")
    per_method, resolved, configs = {}, {}, {}
    for m in methods:
        # engine knobs (and unknown ones, which make_config rejects) go to every method
        per_method[m] = {k: v for k, v in knobs.items() if owners.get(k, m) == m}
        cfg = make_config(model=None if is_preset else args.model_path, vllm_sparse_method=m, **per_method[m])
        configs[m] = cfg
        resolved[m] = {**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
                          if f.name not in ("method_config", "method", "hosted")},
                       **dataclasses.asdict(cfg.method_config)}

    max_len = knobs.get("max_model_len") or model_cfg.get("max_position_embeddings")
    if max_len and max(lengths) + args.output_len > max_len:
        raise ValueError(f"--lengths: {max(lengths)} + --output_len {args.output_len} tokens exceed the model's "
                         f"max length {max_len} (max_model_len / max_position_embeddings)")
    ordered = sorted(methods, key=lambda m: m != "vanilla") + ([args.baseline] if args.baseline else [])
    if args.baseline:  # the baseline honours the engine's dtype / device / seed knobs
        per_method[args.baseline] = {k: v for k, v in knobs.items() if k in ("dtype", "device", "seed")}
    return {"lengths": lengths, "batches": batches, "methods": ordered, "knobs": per_method, "resolved": resolved,
            "configs": configs, "model_config": model_cfg, "is_preset": is_preset}


def _method_roofline_args(plan: dict, method: str):
    """(cache manager class, resolved engine config, ModelConfig) for the roofline classmethods."""
    from sparsevllm.models.config import ModelConfig
    cfg = plan["configs"][method]
    return cfg.method, cfg, ModelConfig.from_dict(plan["model_config"])


def kv_read_model(plan: dict, method: str):
    """What one request's decode step reads, as the method's cache manager says (None: dense, the
    HF baseline)."""
    if method not in plan["configs"]:
        return None
    cls, cfg, model = _method_roofline_args(plan, method)
    return lambda prompt_len, cache_len: cls.decode_kv_tokens_read(cfg, model, prompt_len, cache_len)


def kv_tokens_held(plan: dict, method: str, length: int, output_len: int) -> int | None:
    if method not in plan["configs"]:
        return None
    cls, cfg, model = _method_roofline_args(plan, method)
    return cls.kv_tokens_held(cfg, model, length, output_len)


def model_dir(args, plan: dict) -> str:
    """A preset becomes a folder holding only its config.json (the engine loads it with dummy weights)."""
    if not plan["is_preset"]:
        return os.path.abspath(args.model_path)
    d = os.path.abspath(os.path.join(args.out_dir, "models", args.model_path))
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(plan["model_config"], f, indent=2)
    return d


def run_case_process(case: dict, out_dir: str, timeout: float) -> dict:
    """Run one case in a fresh interpreter; a crash, kill or timeout becomes a status, never an exception."""
    name = f"{case['method']}_L{case['length']}_B{case['batch']}_{case['run_id']}"
    os.makedirs(os.path.join(out_dir, "cases"), exist_ok=True)
    os.makedirs(os.path.join(out_dir, "logs"), exist_ok=True)
    case_path = os.path.join(out_dir, "cases", name + ".json")
    case["result_path"] = os.path.join(out_dir, "cases", name + ".result.json")
    log_path = os.path.join(out_dir, "logs", name + ".log")
    with open(case_path, "w") as f:
        json.dump(case, f)
    env = dict(os.environ)
    if SRC in sys.path:  # the child must import the same sparsevllm as this process
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [SRC, env.get("PYTHONPATH")]))
    with open(log_path, "w") as log:
        try:
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), CHILD_FLAG, case_path],
                                  stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = None
    result = {"log": log_path}
    if os.path.isfile(case["result_path"]):
        with open(case["result_path"]) as f:
            result.update(json.load(f))
        return result
    with open(log_path, errors="replace") as f:
        tail = " | ".join(f.read().strip().splitlines()[-5:])
    if rc is None:
        result.update(status="failed", error=f"timed out after {timeout:.0f} s (--case_timeout)")
    elif rc == -9:
        result.update(status="oom", error=f"killed by SIGKILL (likely the host out-of-memory killer): {tail}")
    else:
        result.update(status="failed", error=f"process exited with code {rc}: {tail}")
    return result


def _dtype_bytes(result: dict, resolved: dict) -> int:
    """The case's real dtype; for a case that failed before reporting it, the engine's default
    (bf16 on a GPU, fp32 on a CPU) unless a dtype knob was set."""
    name = result.get("dtype") or resolved.get("dtype", "auto")
    if name == "auto":
        name = "bfloat16" if (result.get("environment") or {}).get("gpu") else "float32"
    return 4 if name == "float32" else 2


def make_row(case: dict, result: dict, args, plan: dict) -> dict:
    row = {k: case[k] for k in ("run_id", "method", "length", "batch", "output_len", "vary_output", "repeat",
                                 "seed")}
    row.update(status=result.get("status"), error=result.get("error"))
    row.update({k: v for k, v in result.items() if k not in row})
    for key in bench_case.METRIC_KEYS:
        row.setdefault(key, None)
    resolved = case["resolved_knobs"]
    on_gpu = bool((result.get("environment") or {}).get("gpu"))
    cpu_bw = plan.get("cpu_copy_bw")
    bw = args.hbm_bw or (bench_roofline.DEFAULT_HBM_BW if on_gpu else cpu_bw or bench_roofline.DEFAULT_HBM_BW)
    if on_gpu:
        bw *= args.tp   # each of the tp GPUs streams its own slice of the weights and KV
    elif cpu_bw is not None:
        row["measured_copy_bw"] = cpu_bw
    roof = bench_roofline.roofline(case["model_config"], _dtype_bytes(result, resolved),
                                   kv_read_model(plan, case["method"]), case["batch"], case["length"],
                                   case["output_len"], bw, resolved.get("kv_cache_dtype", "auto"))
    row.update(roof)
    dec = row.get("decode_tok_s")
    row["roofline_fraction"] = dec / roof["roofline_tok_s"] if dec else None
    row.update(tp=args.tp, model_path=args.model_path, engine_kwargs=case["engine_kwargs"], model_config=case["model_config"],
               command=args.command)
    return row


def _case_line(row: dict) -> str:
    head = f"{row['method']:>10} L={row['length']:<7} B={row['batch']:<4}"
    if row["status"] != "ok":
        return f"{head} {row['status'].upper()}: {row.get('error')}"
    dec, frac = row.get("decode_tok_s"), row.get("roofline_fraction")
    dec_s = f"{dec:,.1f}" if dec else "-"
    frac_s = f"{frac:.1%}" if frac is not None else "-"
    return (f"{head} decode {dec_s} tok/s, roofline {row['roofline_tok_s']:,.1f} tok/s ({frac_s}), "
            f"prefill {row.get('prefill_tok_s') or 0:,.0f} tok/s, TTFT {row.get('ttft_mean_s', 0) * 1e3:,.1f} ms, "
            f"{row.get('execution_mode')}")


def cpu_roofline_header(cpu_bw: float | None, rows: list[dict]) -> dict:
    """Summary lines that say where a CPU run's roofline bandwidth comes from and what its
    "% of roofline" means; none for a GPU run or a given --hbm_bw."""
    if cpu_bw is None:
        return {}
    ok = [r for r in rows if r["status"] == "ok" and r.get("decode_tok_s")]
    header = {"hbm_bw (B/s)": f"{cpu_bw:.3g}, measured on this CPU ({bench_roofline.CPU_COPY_HOW})"}
    if not ok:
        return header

    def span(values):
        return f"{min(values):.3g}-{max(values):.3g}" if min(values) != max(values) else f"{values[0]:.3g}"

    roof = [r["roofline_step_ms"] for r in ok]
    measured = [1e3 * r["batch"] / r["decode_tok_s"] for r in ok]
    header["% of roofline"] = (
        f"decode tok/s over the roofline's, a step that only moves the weights and the KV it reads at the "
        f"bandwidth above: {span(roof)} ms a step here, against {span(measured)} ms measured. A CPU step also "
        f"pays its compute and a fixed cost per operator (eager PyTorch dispatches each from Python), which "
        f"dominates when the weights are small: a low percentage there is that overhead, not memory "
        f"inefficiency.")
    return header


def run_sweep(args, plan: dict) -> list[dict]:
    import torch
    from tqdm import tqdm

    import bench_report

    os.makedirs(args.out_dir, exist_ok=True)
    if args.hbm_bw is None and not torch.cuda.is_available():
        # One figure for the whole run, printed before the cases, so every row's roofline uses the
        # same bandwidth (measured in each case's process, two cases of one CPU run differed by 9%).
        plan["cpu_copy_bw"] = bench_roofline.measure_cpu_copy_bw()
        print(f"roofline bandwidth: {plan['cpu_copy_bw'] / 1e9:.1f} GB/s, measured on this CPU "
              f"({bench_roofline.CPU_COPY_HOW}); --hbm_bw overrides it")
    mdir = model_dir(args, plan)
    run_id = time.strftime("%Y%m%d-%H%M%S")
    cases = []
    for length in plan["lengths"]:
        for batch in plan["batches"]:
            for method in plan["methods"]:
                kwargs = dict(plan["knobs"].get(method, {}))
                if method != "hf":
                    kwargs.setdefault("max_num_seqs", batch)  # every request admitted at once, graphs sized to it
                resolved = plan["resolved"].get(method, {})
                cases.append({"run_id": run_id, "method": method, "length": length, "batch": batch,
                              "output_len": args.output_len, "vary_output": args.vary_output,
                              "repeat": args.repeat, "seed": args.seed,
                              "model_dir": mdir, "model_config": plan["model_config"], "engine_kwargs": kwargs,
                              "resolved_knobs": resolved,
                              "kv_tokens_stored": kv_tokens_held(plan, method, length, args.output_len)})
    rows = []
    jsonl = os.path.join(args.out_dir, "results.jsonl")
    bar = tqdm(cases, desc="cases", unit="case")
    for case in bar:
        bar.set_postfix_str(f"{case['method']} L={case['length']} B={case['batch']}")
        row = make_row(case, run_case_process(case, args.out_dir, args.case_timeout), args, plan)
        rows.append(row)
        bench_report.add_speedups(rows)  # vanilla runs first in each (length, batch) group
        with open(jsonl, "a") as f:
            f.write(json.dumps(row) + "\n")
        bar.write(_case_line(row))
    env = next((r["environment"] for r in rows if r.get("environment")), {})
    header = {"run": run_id, "model": args.model_path, "gpu": env.get("gpu") or "none (CPU)",
              "dtype": next((r.get("dtype") for r in rows if r.get("dtype")), "-"),
              "output_len": args.output_len, "repeat": args.repeat, "enforce_eager": args.enforce_eager,
              "tp": args.tp,
              "hyper_params": args.hyper_params,
              "hbm_bw (B/s)": ", ".join(sorted({f"{r['hbm_bw']:.3g}" for r in rows})) or "-",
              **cpu_roofline_header(plan.get("cpu_copy_bw"), rows),
              "versions": ", ".join(f"{k} {env.get(k)}" for k in ("torch", "triton", "transformers", "sparsevllm")),
              "command": f"`{rows[0]['command']}`" if rows else "-"}
    with open(os.path.join(args.out_dir, "summary.md"), "w") as f:
        f.write(bench_report.summary_markdown(rows, header))
    if "% of roofline" in header:
        print(f"% of roofline: {header['% of roofline']}")
    bench_report.plot(rows, os.path.join(args.out_dir, "plot.png"),
                      f"{args.model_path}, output_len {args.output_len}, {header['gpu']}")
    print(f"wrote {jsonl}, {os.path.join(args.out_dir, 'summary.md')}, {os.path.join(args.out_dir, 'plot.png')}")
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == [CHILD_FLAG]:  # a case's own process, started by run_case_process
        return bench_case.run_case_file(argv[1])
    parser = build_parser()
    args = parser.parse_args(argv)
    args.command = shlex.join(["python", os.path.relpath(os.path.abspath(__file__))] + list(argv))
    try:
        plan = validate(args)
    except (ValueError, TypeError) as e:
        parser.error(str(e))  # exits with status 2 before anything loads
    run_sweep(args, plan)
    return 0


if __name__ == "__main__":
    sys.exit(main())

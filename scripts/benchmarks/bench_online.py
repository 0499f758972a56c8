"""Online benchmark: clients send requests to a running Sparse-vLLM server at a request rate
(Poisson arrivals) and stream the answers; it reports request throughput, output tok/s and TTFT,
ITL and end-to-end latency p50/p99.

    python scripts/benchmarks/bench_online.py --model_path llama-3.1-8b --sparse_method vanilla \
        --input_len 4096 --output_len 256 --num_requests 64 --request_rates 2,inf --out_dir online_out

With --model_path (a folder or a preset run with random weights) it starts the server itself, one
per request rate list (vanilla or --sparse_method), and stops it after; with --url it uses a
server already running. Prompts are random token ids of exact length (the completions endpoint
takes token ids), greedy, ignore_eos, so every request generates output_len tokens. Writes
results.jsonl (one row per request rate), summary.md and plot.png to --out_dir.
"""
import argparse
import asyncio
import json
import math
import os
import socket
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(os.path.dirname(HERE)), "src")
sys.path.insert(0, HERE)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args) -> tuple[subprocess.Popen, str]:
    from bench_sparse_vllm import available_presets, presets_dir
    model = args.model_path
    knobs = json.loads(args.hyper_params)
    if not os.path.isdir(model):
        if model not in available_presets():
            raise SystemExit(f"--model_path {model!r} is neither a folder nor a preset")
        folder = os.path.join(args.out_dir, "models", model)
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(presets_dir(), model + ".json")) as f, \
                open(os.path.join(folder, "config.json"), "w") as g:
            g.write(f.read())
        model = folder
        knobs.setdefault("load_format", "dummy")
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [SRC, os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "sparsevllm.serve", "--model", model, "--sparse-method", args.sparse_method,
           "--port", str(port), "--hyper-params", json.dumps(knobs)]
    log = open(os.path.join(args.out_dir, "server.log"), "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + args.server_timeout
    import urllib.request
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited (code {proc.returncode}); see {log.name}")
        try:
            urllib.request.urlopen(url + "/health", timeout=2)
            return proc, url
        except OSError:
            time.sleep(1)
    proc.kill()
    raise SystemExit(f"the server did not come up within {args.server_timeout} s; see {log.name}")


async def one_request(client, url: str, model: str, prompt: list[int], output_len: int) -> dict:
    start = time.perf_counter()
    times, tokens = [], 0
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    async with client.stream("POST", url + "/v1/completions", content=json.dumps(body),
                             headers={"Content-Type": "application/json"}) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and not chunk["choices"][0].get("finish_reason"):
                times.append(time.perf_counter())   # a chunk per arrival of tokens
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    end = time.perf_counter()
    return {"start": start, "ttft": (times[0] - start) if times else None, "e2e": end - start,
            "itl": [b - a for a, b in zip(times, times[1:])], "output_tokens": tokens, "end": end}


async def run_rate(url: str, model: str, prompts: list[list[int]], output_len: int, rate: float,
                   concurrency: int, seed: int) -> list[dict]:
    # Plain HTTP through httpx2 (the openai client's own transport), not the openai client: its
    # request transform took ~45 ms for a 4K-token prompt on a busy 2-core machine, in the client's
    # event loop, so 32 clients at once measured the client's own queue as TTFT.
    try:
        import httpx2
    except ImportError:
        raise SystemExit("bench_online.py needs httpx2 (it comes with `pip install openai`, or the dev extra)") from None
    key = os.environ.get("SPARSEVLLM_API_KEY")
    client = httpx2.AsyncClient(timeout=httpx2.Timeout(3600.0), headers={"Authorization": f"Bearer {key}"} if key else {},
                                limits=httpx2.Limits(max_connections=None, max_keepalive_connections=None))
    rng = np.random.default_rng(seed)
    gate = asyncio.Semaphore(concurrency)

    async def limited(p):
        async with gate:
            return await one_request(client, url, model, p, output_len)
    tasks = []
    try:
        for p in prompts:
            tasks.append(asyncio.create_task(limited(p)))
            if math.isfinite(rate):
                await asyncio.sleep(rng.exponential(1.0 / rate))
        return await asyncio.gather(*tasks)
    finally:
        await client.aclose()


def server_ttft(url: str) -> tuple[float, int]:
    """(sum of seconds, count) of the server's TTFT histogram: the engine's side of TTFT, from the
    request's receipt to its first token (client TTFT minus this is HTTP and client time)."""
    import urllib.request
    req = urllib.request.Request(url + "/metrics")
    if os.environ.get("SPARSEVLLM_API_KEY"):
        req.add_header("Authorization", "Bearer " + os.environ["SPARSEVLLM_API_KEY"])
    total, count = 0.0, 0
    for line in urllib.request.urlopen(req, timeout=30).read().decode().splitlines():
        if line.startswith("sparsevllm_time_to_first_token_seconds_sum"):
            total = float(line.split()[-1])
        elif line.startswith("sparsevllm_time_to_first_token_seconds_count"):
            count = int(float(line.split()[-1]))
    return total, count


def summarise(rate: float, results: list[dict]) -> dict:
    begin, end = min(r["start"] for r in results), max(r["end"] for r in results)
    ttft = [r["ttft"] for r in results if r["ttft"] is not None]
    itl = [x for r in results for x in r["itl"]]
    e2e = [r["e2e"] for r in results]
    tokens = sum(r["output_tokens"] for r in results)

    def pct(values, q):
        return float(np.percentile(values, q)) * 1e3 if values else None
    return {"request_rate": rate, "num_requests": len(results), "duration_s": end - begin,
            "request_throughput": len(results) / (end - begin), "output_tok_s": tokens / (end - begin),
            "output_tokens": tokens, "ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99),
            "ttft_mean_ms": float(np.mean(ttft)) * 1e3 if ttft else None,
            "itl_p50_ms": pct(itl, 50), "itl_p99_ms": pct(itl, 99), "e2e_p50_ms": pct(e2e, 50),
            "e2e_p99_ms": pct(e2e, 99)}


def write_report(rows: list[dict], args) -> None:
    with open(os.path.join(args.out_dir, "results.jsonl"), "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    cols = ("request_rate", "num_requests", "request_throughput", "output_tok_s", "ttft_p50_ms", "ttft_p99_ms",
            "ttft_mean_ms", "server_ttft_mean_ms", "itl_p50_ms", "itl_p99_ms", "e2e_p50_ms", "e2e_p99_ms")

    def fmt(v):
        return "-" if v is None else (f"{v:,.2f}" if isinstance(v, float) else str(v))
    lines = ["# Sparse-vLLM online benchmark", "", f"- **command**: `{args.command}`",
             f"- **method**: {args.sparse_method}, input {args.input_len}, output {args.output_len}", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r[c]) for c in cols) + " |" for r in rows]
    with open(os.path.join(args.out_dir, "summary.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    x = [str(r["request_rate"]) for r in rows]
    axes[0].bar(x, [r["output_tok_s"] for r in rows])
    axes[0].set_xlabel("request rate (req/s)")
    axes[0].set_ylabel("output tok/s")
    for key, label in (("ttft_p50_ms", "TTFT p50"), ("itl_p50_ms", "ITL p50"), ("e2e_p50_ms", "E2E p50")):
        axes[1].plot(x, [r[key] or 0 for r in rows], marker="o", label=label)
    axes[1].set_xlabel("request rate (req/s)")
    axes[1].set_ylabel("ms")
    axes[1].set_yscale("log")
    axes[1].legend()
    fig.suptitle(f"{args.sparse_method}, {args.input_len} in / {args.output_len} out")
    fig.tight_layout()
    fig.savefig(os.path.join(args.out_dir, "plot.png"), dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8000")
    where.add_argument("--model_path", help="start a server on this model folder or preset (random weights)")
    ap.add_argument("--sparse_method", default="vanilla", help="with --model_path: the server's method")
    ap.add_argument("--hyper_params", default="{}", help="with --model_path: the server's knobs, JSON")
    ap.add_argument("--model", default=None, help="the model id to send (default: the server's first)")
    ap.add_argument("--input_len", type=int, default=1024)
    ap.add_argument("--output_len", type=int, default=128)
    ap.add_argument("--num_requests", type=int, default=64)
    ap.add_argument("--request_rates", default="inf", help="comma list of requests/s (Poisson); inf = all at once")
    ap.add_argument("--concurrency", type=int, default=1024, help="most requests in flight")
    ap.add_argument("--vocab_size", type=int, default=None, help="token ids are drawn below this (default: 90%% "
                                                                "of the model's vocabulary, from /v1/models or preset)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--server_timeout", type=float, default=600.0)
    ap.add_argument("--out_dir", default="online_out")
    args = ap.parse_args(argv)
    args.command = " ".join(["python", os.path.relpath(os.path.abspath(__file__))] + (argv or sys.argv[1:]))
    try:
        rates = [float(r) for r in args.request_rates.split(",")]
        json.loads(args.hyper_params)
    except ValueError as e:
        ap.error(f"bad --request_rates or --hyper_params: {e}")
    if min(args.input_len, args.output_len, args.num_requests, args.concurrency) < 1 or min(rates) <= 0:
        ap.error("lengths, counts and rates must be positive")
    os.makedirs(args.out_dir, exist_ok=True)
    proc = None
    try:
        if args.model_path:
            proc, url = start_server(args)
        else:
            url = args.url.rstrip("/")
        import urllib.request
        info = json.loads(urllib.request.urlopen(url + "/v1/models", timeout=30).read())["data"][0]
        model = args.model or info["id"]
        vocab = args.vocab_size or 1000
        if args.vocab_size is None and args.model_path and not os.path.isdir(args.model_path):
            from bench_sparse_vllm import presets_dir
            with open(os.path.join(presets_dir(), args.model_path + ".json")) as f:
                vocab = int(json.load(f)["vocab_size"] * 0.9)
        rng = np.random.default_rng(args.seed)
        rows = []
        for rate in rates:
            prompts = [rng.integers(100, vocab, args.input_len).tolist() for _ in range(args.num_requests)]
            before = server_ttft(url)
            results = asyncio.run(run_rate(url, model, prompts, args.output_len, rate, args.concurrency, args.seed))
            row = summarise(rate, results)
            after = server_ttft(url)
            n = after[1] - before[1]
            row["server_ttft_mean_ms"] = (after[0] - before[0]) / n * 1e3 if n > 0 else None
            row.update(method=info.get("sparse_method", args.sparse_method), input_len=args.input_len,
                       output_len=args.output_len, model=model)
            rows.append(row)
            print(json.dumps(row), flush=True)
        write_report(rows, args)
        print(f"wrote {args.out_dir}/results.jsonl, summary.md, plot.png")
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)
    return 0


if __name__ == "__main__":
    sys.exit(main())

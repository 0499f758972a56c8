"""python -m sparsevllm.serve: an OpenAI-compatible server (FastAPI + uvicorn, the `server` extra).

    python -m sparsevllm.serve [--model DIR] [--sparse-method NAME] [--host H] [--port P]
        [--api-key KEY] [--recall-sample-every N] [--hyper-params JSON] [--<knob> VALUE ...]

One server, one model and one sparse method (`/v1/models` names both). Endpoints:
/v1/completions and /v1/chat/completions (streaming over SSE or not), /v1/models, /health and
/metrics (Prometheus text; with --recall-sample-every N, histograms of each finished request's
attention recall and output error: docs/design.md, section 10). Requests join the running batch as
they arrive; a client that disconnects frees its KV at once; a bad request gets a 4xx error in
OpenAI's shape and the server goes on. --api-key guards the /v1/ routes only: /health and /metrics answer without it.
"""
import argparse
import json
import os
import sys

from sparsevllm.config import json_knobs


def parse_knobs(extra: list[str], hyper_params: str) -> dict:
    """`--name value` pairs (name with - or _, value as JSON where it parses) and --hyper-params JSON."""
    knobs = json_knobs(hyper_params, "--hyper-params")
    i = 0
    while i < len(extra):
        name = extra[i]
        if not name.startswith("--") or i + 1 >= len(extra):
            raise ValueError(f"knobs are given as --name value pairs; got {' '.join(extra[i:i + 2])!r}")
        value = extra[i + 1]
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            pass
        knobs[name[2:].replace("-", "_")] = value
        i += 2
    return knobs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sparsevllm.serve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF model folder (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--served-model-name", default=None, help="the model id clients send (default: the folder name)")
    ap.add_argument("--sparse-method", default="vanilla", help="the sparse method every request runs")
    ap.add_argument("--host", default="127.0.0.1", help="(default: 127.0.0.1)")
    ap.add_argument("--port", type=int, default=8000, help="(default: 8000)")
    ap.add_argument("--api-key", default=os.environ.get("SPARSEVLLM_API_KEY"),
                    help="require 'Authorization: Bearer KEY' (default: $SPARSEVLLM_API_KEY, else none)")
    ap.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="tensor-parallel ranks, one process and one GPU each (default: 1)")
    ap.add_argument("--recall-sample-every", type=int, default=0,
                    help="measure attention recall every N-th decode step of each request, reported in "
                         "/metrics (default: 0, off)")
    ap.add_argument("--kv-cache-dtype", default=None,
                    help="KV cache storage: auto (the model dtype) | fp8 | fp8_e4m3 (default: auto)")
    ap.add_argument("--hyper-params", default="{}", help="JSON of engine and method knobs")
    args, extra = ap.parse_known_args(argv)
    try:   # the server's and the engine's imports (torch, fastapi) wait until --help has answered
        import uvicorn

        from sparsevllm import LLM
        from sparsevllm.engine.async_engine import AsyncLLM
        from sparsevllm.serve.app import build_app
        knobs = parse_knobs(extra, args.hyper_params)
        if args.tensor_parallel_size != 1:
            knobs["tensor_parallel_size"] = args.tensor_parallel_size
        if args.recall_sample_every:
            knobs["recall_sample_every"] = args.recall_sample_every
        if args.kv_cache_dtype is not None:
            knobs["kv_cache_dtype"] = args.kv_cache_dtype
        llm = LLM(args.model, vllm_sparse_method=args.sparse_method, **knobs)
        name = args.served_model_name or (os.path.basename(os.path.normpath(args.model)) if args.model
                                          else "smollm2-135m")
        async_llm = AsyncLLM(llm.engine)
        app = build_app(async_llm, name, args.api_key)
    except ImportError as e:
        print(f"error: {e}; install the server extra: pip install -e \".[server]\"", file=sys.stderr)
        return 2
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"serving {name} ({args.sparse_method}) on http://{args.host}:{args.port}/v1", file=sys.stderr)
    # The engine thread and the HTTP event loop share the GIL; at the default 5 ms switch interval
    # the engine can wait most of a decode step for the loop to let go.
    sys.setswitchinterval(float(os.environ.get("SPARSEVLLM_SWITCH_INTERVAL", 0.0005)))
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        async_llm.shutdown()
        llm.shutdown()
    return 0


"""python -m sparsevllm [PROMPT ...]: generate with any model and method from the command line."""
import argparse
import logging
import sys
import time

from sparsevllm import SamplingParams, available_methods
from sparsevllm.config import json_knobs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sparsevllm", description=__doc__,
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("prompts", nargs="*", default=["The capital of France is"], help="prompts")
    ap.add_argument("--model", default=None,
                    help="HF model folder (None: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--method", default="vanilla", help=f"sparse method: {', '.join(available_methods())}")
    ap.add_argument("--chat", action="store_true", help="wrap each prompt as a user turn of the chat template")
    ap.add_argument("--max_tokens", type=int, default=32, help="tokens to generate per prompt")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (one process and one GPU each)")
    ap.add_argument("--hyper_params", default="{}", help="JSON of engine and method knobs, e.g. '{\"page_size\": 16}'")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        knobs = json_knobs(args.hyper_params, "--hyper_params")
    except ValueError as e:
        ap.error(str(e))
    from sparsevllm import LLM   # torch and the engine: not needed for --help or a usage error
    try:
        if args.tp != 1:
            knobs["tensor_parallel_size"] = args.tp
        llm = LLM(args.model, vllm_sparse_method=args.method, **knobs)
        sp = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
        t0 = time.perf_counter()
        # inside the try: --chat without a chat template, or text for a model without a tokenizer
        if args.chat:
            outs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], sp, use_tqdm=False)
        else:
            outs = llm.generate(args.prompts, sp, use_tqdm=False)
    except (ValueError, TypeError) as e:   # a user's mistake: the message, not a traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    elapsed = time.perf_counter() - t0
    for prompt, out in zip(args.prompts, outs):
        print(f"--- {prompt!r}\n{out.outputs[0].text if not out.error else 'ERROR: ' + out.error}")
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    runner = llm.engine.model_runner
    where = f"cpu, {runner.threads} thread{'s' * (runner.threads > 1)}" if runner.device.type == "cpu" else runner.device
    print(f"[{args.method}, {llm.execution_mode}, {where}] {n} tokens in {elapsed:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

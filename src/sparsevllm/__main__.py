"""python -m sparsevllm [PROMPT ...]: generate with any model and method from the command line."""
import argparse
import json
import logging
import time

from sparsevllm import LLM, SamplingParams, available_methods


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m sparsevllm", description=__doc__)
    ap.add_argument("prompts", nargs="*", default=["The capital of France is"],
                    help="prompts (default: 'The capital of France is')")
    ap.add_argument("--model", default=None, help="HF model folder (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--method", default="vanilla", help=f"sparse method: {', '.join(available_methods())}")
    ap.add_argument("--chat", action="store_true", help="wrap each prompt as a user turn of the chat template")
    ap.add_argument("--max_tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--hyper_params", default="{}", help="JSON of engine and method knobs, e.g. '{\"page_size\": 16}'")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    llm = LLM(args.model, vllm_sparse_method=args.method, **json.loads(args.hyper_params))
    sp = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    t0 = time.perf_counter()
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], sp, use_tqdm=False)
    else:
        outs = llm.generate(args.prompts, sp, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    for prompt, out in zip(args.prompts, outs):
        print(f"--- {prompt!r}\n{out['text'] if not out['error'] else 'ERROR: ' + out['error']}")
    n = sum(len(o["token_ids"]) for o in outs)
    print(f"[{args.method}, {llm.execution_mode}, {llm.engine.model_runner.device}] "
          f"{n} tokens in {elapsed:.2f} s")


if __name__ == "__main__":
    main()

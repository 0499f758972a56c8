"""Command line: python -m sparsevllm.regression --methods quest --lengths 1k,2k,4k ..."""

import argparse
import logging
import sys

from sparsevllm.config import json_knobs
from sparsevllm.regression.runner import DEFAULT_TASKS, RunConfig, Runner


def parse_length(text: str) -> int:
    text = text.strip().lower()
    scale = 1024 if text.endswith("k") else 1
    try:
        value = int(float(text.rstrip("k")) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a length: {text!r} (use e.g. 4096 or 4k)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"length must be positive, got {text!r}")
    return value


def comma_list(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def json_object(text: str) -> dict:
    try:
        return json_knobs(text)
    except ValueError as e:
        # argparse prefixes "argument --hyper_params: "; its default "invalid json_object value" hides why.
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_args(argv=None) -> RunConfig:
    p = argparse.ArgumentParser(
        prog="python -m sparsevllm.regression",
        description="Accuracy of sparse KV methods against vanilla on long-context tasks.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    # List and JSON defaults are written as the text a user would type: argparse runs a string
    # default through `type`, and --help then shows "1k,2k,4k" rather than "[1024, 2048, 4096]".
    p.add_argument("--model", default=None,
                   help="HF model folder (None: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--methods", type=comma_list, default="vanilla",
                   help="comma-separated methods; vanilla is always run as the reference")
    p.add_argument("--tasks", type=comma_list, default=",".join(DEFAULT_TASKS),
                   help="comma-separated task names, or LongBench JSONL files 'path.jsonl[:metric]' "
                        "(metric: contains, contains_all, exact, f1, rouge_l; default f1)")
    p.add_argument("--lengths", type=lambda s: [parse_length(x) for x in comma_list(s)],
                   default="1k,2k,4k", help="target prompt lengths in tokens (4k = 4096)")
    p.add_argument("--samples", type=int, default=20, help="samples per task and length")
    p.add_argument("--hyper_params", type=json_object, default="{}",
                   help="JSON engine/method knobs; a method-name key holds that method's overrides, "
                        "a list value is swept, e.g. "
                        "'{\"max_num_seqs\": 8, \"quest\": {\"quest_token_budget\": [256, 512]}}'")
    p.add_argument("--kv_cache_dtype", default="auto",
                   help="KV cache storage of every run: auto | fp8 | fp8_e4m3 (the kv_cache_dtype knob; "
                        "--hyper_params '{\"kv_cache_dtype\": [\"auto\", \"fp8\"]}' sweeps both)")
    p.add_argument("--out_dir", default="regression_out",
                   help="output folder; rerunning with the same folder resumes")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the generated samples (synthetic tasks and fidelity windows)")
    p.add_argument("--no_chat_template", action="store_true",
                   help="plain-text prompts even when the tokenizer has a chat template")
    p.add_argument("--tolerance", type=float, default=5.0,
                   help="allowed accuracy drop against vanilla, in points")
    p.add_argument("--batch_size", type=int, default=0,
                   help="samples per generate() call (0: a whole task x length cell)")
    p.add_argument("--fidelity_tokens", type=int, default=32,
                   help="teacher-forced tokens per fidelity sample")
    a = p.parse_args(argv)
    if a.kv_cache_dtype != "auto":
        if "kv_cache_dtype" in a.hyper_params:
            p.error("give kv_cache_dtype once: --kv_cache_dtype or in --hyper_params")
        a.hyper_params["kv_cache_dtype"] = a.kv_cache_dtype
    return RunConfig(model=a.model, methods=a.methods, tasks=a.tasks, lengths=a.lengths,
                     samples=a.samples, hyper_params=a.hyper_params, out_dir=a.out_dir,
                     seed=a.seed, chat_template=not a.no_chat_template, tolerance=a.tolerance,
                     batch_size=a.batch_size, fidelity_tokens=a.fidelity_tokens)


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    config = parse_args(argv)
    try:
        runner = Runner(config)   # checks every argument and knob before anything runs
    except (ValueError, TypeError) as e:   # a user's mistake: the message, not a traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    summary = runner.run()
    with open(f"{config.out_dir}/summary.md") as f:
        print(f.read())
    return 0 if summary["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())

"""python -m sparsevllm.tools.omnikv_calibrate: pick OmniKV's filter layers for a model.

Runs sample prompts densely (vanilla) for a few decode steps and records, at every step and layer,
the decode query and the prompt's keys. For every pair of layers f < l it measures how much of
layer l's attention mass over the prompt falls on the top-n prompt tokens that layer f would select
(OmniKV's own score: max over heads of the raw logits): coverage C[f][l], averaged over heads,
steps and prompts. It then picks filter layers greedily: the first at --first_layer (default: the
paper's 2 of 32 scaled to the depth), each next one the layer that most raises the mean coverage
of the sparse layers (a sparse layer uses the nearest filter layer before it; layers before the
first filter layer, filter layers and the --wait_layers after them are dense). Deterministic for a
model, prompts and settings. Prints the knob value and writes a JSON report and a heat-map plot.

    python -m sparsevllm.tools.omnikv_calibrate [--model DIR] [--prompts FILE] [--out omnikv_calibration]

--prompts: a text file, one prompt per line, or JSONL with a "prompt" (text) or "prompt_token_ids" field. Without it, RULER-style
retrieval and variable-tracking prompts of --length tokens from the regression harness are used.
"""
import argparse
import json
import logging
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sparsevllm.tools.omnikv_calibrate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF model folder (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--prompts", default=None,
                    help="text file (a prompt a line) or JSONL with a 'prompt' or 'prompt_token_ids' field")
    ap.add_argument("--num_prompts", type=int, default=4, help="default prompts generated (without --prompts)")
    ap.add_argument("--length", type=int, default=2048, help="tokens of each default prompt")
    ap.add_argument("--decode_steps", type=int, default=8, help="decode steps measured per prompt")
    ap.add_argument("--num_filter_layers", type=int, default=3)
    ap.add_argument("--first_layer", type=int, default=None,
                    help="the first filter layer (default: the paper's 2 of 32, scaled to the depth)")
    ap.add_argument("--wait_layers", type=int, default=1, help="dense layers after each filter layer")
    ap.add_argument("--num_selected", type=float, default=0.067, help="n: a fraction of the prompt, or a count >= 1")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hyper_params", default="{}", help="JSON of engine knobs (e.g. dtype, device)")
    ap.add_argument("--out", default="omnikv_calibration", help="writes OUT.json and OUT.png")
    args = ap.parse_args(argv)
    try:
        knobs = json.loads(args.hyper_params)
    except json.JSONDecodeError as e:
        ap.error(f"--hyper_params is not valid JSON: {e}")
    if not isinstance(knobs, dict):
        ap.error("--hyper_params must be a JSON object of engine knobs")
    # The measurement is of dense attention and reads the vanilla pool's keys: another method's decode
    # changes the generated tokens, and its pool layout makes the keys wrong or out of range.
    if knobs.get("vllm_sparse_method", "vanilla") != "vanilla":
        ap.error(f"--hyper_params: vllm_sparse_method={knobs['vllm_sparse_method']!r}; the calibration runs "
                 "vanilla (dense) attention, leave it out")
    for name in ("num_prompts", "length", "decode_steps", "num_filter_layers"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1")
    if args.wait_layers < 0:
        ap.error("--wait_layers must be >= 0")
    if not (0.0 < args.num_selected <= 1.0 or (args.num_selected >= 1 and args.num_selected == int(args.num_selected))):
        ap.error("--num_selected must be a fraction in (0, 1] or an integer count >= 1")
    num_selected = int(args.num_selected) if args.num_selected > 1 else args.num_selected
    logging.basicConfig(level=logging.WARNING)
    from sparsevllm.tools.omnikv_calibration import calibrate   # torch and the engine: after --help and usage errors
    return calibrate(args, ap, knobs, num_selected)


if __name__ == "__main__":
    sys.exit(main())

"""HiSparse's buffer hit rate with real weights: the benchmark's presets have random weights, whose
successive decode queries are nearly independent, so their hit rates (and PCIe bytes) are a worst
case. This runs the embedded SmolLM2 (or --model) on --num_prompts windows of CPython's pydoc text and
reports the hit rate of the decode steps.

    python scripts/benchmarks/hisparse_hit_rate.py --device_pages default,30
"""
import argparse
import json

from transformers import AutoTokenizer

from sparsevllm import LLM, SamplingParams
from sparsevllm.default_model import resolve_model
from sparsevllm.regression.text import pydoc_text


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--prompt_len", type=int, default=4096)
    ap.add_argument("--num_prompts", type=int, default=4)
    ap.add_argument("--output_len", type=int, default=128)
    ap.add_argument("--token_budget", type=int, default=256, help="hisparse_token_budget")
    ap.add_argument("--device_pages", default="default", help="comma list of hisparse_device_pages ('default')")
    ap.add_argument("--host_memory_gb", type=float, default=1.0)
    args = ap.parse_args()
    path = resolve_model(args.model)
    ids = AutoTokenizer.from_pretrained(path)(pydoc_text(), add_special_tokens=False)["input_ids"]
    step = (len(ids) - args.prompt_len) // max(args.num_prompts, 1)
    if step <= 0:
        ap.error(f"the text holds {len(ids)} tokens, too few for --prompt_len {args.prompt_len}")
    prompts = [ids[i * step:i * step + args.prompt_len] for i in range(args.num_prompts)]
    for pages in args.device_pages.split(","):
        knobs = dict(hisparse_token_budget=args.token_budget, hisparse_min_prompt_len=min(1024, args.prompt_len),
                     hisparse_host_memory_gb=args.host_memory_gb)
        if pages != "default":
            knobs["hisparse_device_pages"] = int(pages)
        eng = LLM(path, vllm_sparse_method="hisparse", **knobs).engine
        sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        for p in prompts:
            eng.add_request(p, sp)
        last = None
        while eng.has_work():
            eng.step()
            acc = eng.cache_manager.memory_accounting()
            if acc["hit_rate"] is not None:     # the counters clear once no request is offloaded
                last = acc
        if last is None:
            raise SystemExit(f"no request was offloaded at device_pages={pages}: lengthen --prompt_len "
                             "or shrink --token_budget")
        print(json.dumps({"device_pages": pages, "token_budget": args.token_budget, "prompt_len": args.prompt_len,
                          "num_prompts": args.num_prompts, "hot_pages_per_request": last["hot_pages_per_request"],
                          "hit_rate": round(last["hit_rate"], 4), "swapped_in_pages": last["swapped_in_pages"],
                          "decode_steps": last["decode_steps_offloaded"]}), flush=True)


if __name__ == "__main__":
    main()

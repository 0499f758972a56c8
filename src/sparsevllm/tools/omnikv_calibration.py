"""The work of `python -m sparsevllm.tools.omnikv_calibrate` (its docstring says what it measures):
record dense decode queries and prompt keys, the coverage matrix, the greedy pick, the report."""
import json
import logging
import math
import time

import torch

from sparsevllm import LLM, SamplingParams
from sparsevllm.engine.cache_manager.cross_layer import layer_roles
from sparsevllm.engine.cache_manager.omnikv import default_filter_layers

logger = logging.getLogger(__name__)

DEFAULT_TASKS = ("niah_multikey", "niah_single_word_essay", "variable_tracking", "niah_multivalue")


def read_prompts(path: str) -> list:
    prompts = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            if line.startswith("{"):
                try:
                    row = json.loads(line)
                    prompts.append(row["prompt_token_ids"] if "prompt_token_ids" in row else row["prompt"])
                    continue
                except (json.JSONDecodeError, KeyError):
                    raise ValueError(f"--prompts {path!r}: a JSON line needs a \"prompt\" or "
                                     "\"prompt_token_ids\" field") from None
            prompts.append(line)
    if not prompts:
        raise ValueError(f"--prompts {path!r} holds no prompt")
    return prompts


def default_prompts(tokenizer, length: int, count: int, seed: int) -> list[list[int]]:
    from sparsevllm.regression.prompts import PromptFormatter
    from sparsevllm.regression.tasks import SYNTHETIC_TASKS
    formatter = PromptFormatter(tokenizer)
    return [SYNTHETIC_TASKS[DEFAULT_TASKS[i % len(DEFAULT_TASKS)]](formatter, length, i, seed).prompt_token_ids
            for i in range(count)]


def record(llm: LLM, prompts, decode_steps: int) -> list[dict]:
    """Run the prompts densely; per request: prompt keys per layer and the decode queries per layer."""
    cm = llm.engine.cache_manager
    build = cm.build_decode_view
    seen: dict[int, dict] = {}

    def capture(layer_id, q, step):
        P = cm.page_size
        for b, seq in enumerate(step.seqs):
            rec = seen.setdefault(seq.seq_id, {"keys": {}, "queries": {}, "prompt_len": seq.num_prompt_tokens})
            if layer_id not in rec["keys"]:
                pos = torch.arange(seq.num_prompt_tokens, device=q.device)
                slots = step.block_tables[b, pos // P].long() * P + pos % P
                rec["keys"][layer_id] = cm.pool.layer(layer_id)[0][slots].float().cpu()
            rec["queries"].setdefault(layer_id, []).append(q[b].float().cpu())
        return build(layer_id, q, step)
    cm.build_decode_view = capture
    try:
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=decode_steps + 1, ignore_eos=True),
                     use_tqdm=False)
    finally:
        cm.build_decode_view = build
    return list(seen.values())


def coverage(records: list[dict], num_layers: int, num_selected, scale: float) -> torch.Tensor:
    """C[f, l]: mean share of layer l's attention mass over the prompt that lies on layer f's
    top-n tokens (f <= l; C[l, l] is a layer's own top-n share)."""
    total, count = torch.zeros(num_layers, num_layers, dtype=torch.float64), 0
    for rec in records:
        L = rec["prompt_len"]
        n = max(1, min(L, num_selected if isinstance(num_selected, int) else math.ceil(num_selected * L)))
        steps = len(rec["queries"][0])
        for s in range(steps):
            probs, chosen = [], []
            for layer in range(num_layers):
                q, k = rec["queries"][layer][s], rec["keys"][layer]          # [H_q, D], [L, H_kv, D]
                group = q.shape[0] // k.shape[1]
                logits = torch.einsum("hd,lhd->hl", q, k.repeat_interleave(group, dim=1)) * scale
                probs.append(logits.double().softmax(dim=-1))                # [H_q, L]
                top = torch.sort(logits.amax(dim=0), descending=True, stable=True).indices[:n]
                mask = torch.zeros(L, dtype=torch.bool)
                mask[top] = True
                chosen.append(mask)
            for f in range(num_layers):
                for layer in range(f, num_layers):
                    total[f, layer] += probs[layer][:, chosen[f]].sum(dim=-1).mean()
            count += 1
    return total / max(count, 1)


def mean_sparse_coverage(cov: torch.Tensor, filters: list[int], wait: int) -> float:
    roles = layer_roles(cov.shape[0], filters, wait)
    vals = [float(cov[src, layer]) for layer, (role, src) in enumerate(roles) if role == "sparse"]
    return sum(vals) / len(vals) if vals else 1.0


def pick_filter_layers(cov: torch.Tensor, first: int, count: int, wait: int) -> tuple[list[int], list[dict]]:
    """Greedy: start from [first]; add the layer that most raises the sparse layers' mean coverage."""
    chosen, trace = [first], [{"filters": [first], "mean_sparse_coverage": mean_sparse_coverage(cov, [first], wait)}]
    while len(chosen) < count:
        best = None
        for layer in range(first + 1, cov.shape[0]):
            if layer in chosen:
                continue
            cand = sorted(chosen + [layer])
            score = mean_sparse_coverage(cov, cand, wait)
            if best is None or score > best[0] + 1e-12:
                best = (score, cand)
        if best is None:
            break
        chosen = best[1]
        trace.append({"filters": chosen, "mean_sparse_coverage": best[0]})
    return chosen, trace


def plot(cov: torch.Tensor, filters: list[int], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.5, 5.5))
    data = cov.clone()
    data[torch.tril(torch.ones_like(data, dtype=torch.bool), diagonal=-1)] = float("nan")
    im = ax.imshow(data.numpy(), vmin=0.0, vmax=1.0, cmap="viridis")
    for f in filters:
        ax.axhline(f, color="red", linewidth=0.8)
    ax.set_xlabel("layer l (attends)")
    ax.set_ylabel("layer f (selects top-n)")
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, label="share of l's prompt attention on f's top-n")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def calibrate(args, ap, knobs: dict, num_selected) -> int:
    """Measure, pick and report as the parsed arguments say; usage errors go through ap.error."""
    t0 = time.perf_counter()
    torch.manual_seed(args.seed)
    llm = LLM(args.model, **knobs)
    cfg = llm.hf_config
    layers = cfg.num_hidden_layers
    first = default_filter_layers(layers)[0] if args.first_layer is None else args.first_layer
    if not 0 <= first < layers:
        ap.error(f"--first_layer {first} is out of range for {layers} layers")
    if args.prompts:
        prompts = read_prompts(args.prompts)
    elif llm.tokenizer is None:
        ap.error("the model has no tokenizer: pass --prompts as JSONL with 'prompt_token_ids'")
    else:
        prompts = default_prompts(llm.tokenizer, args.length, args.num_prompts, args.seed)
    records = record(llm, prompts, args.decode_steps)
    cov = coverage(records, layers, num_selected, cfg.head_dim ** -0.5)
    filters, trace = pick_filter_layers(cov, first, min(args.num_filter_layers, layers - first), args.wait_layers)
    paper = default_filter_layers(layers)
    elapsed = time.perf_counter() - t0
    report = {"model": llm.engine.model_path, "num_layers": layers, "prompts": len(prompts),
              "prompt_tokens": [r["prompt_len"] for r in records], "decode_steps": args.decode_steps,
              "num_selected": num_selected, "wait_layers": args.wait_layers, "filter_layers": filters,
              "greedy_trace": trace, "paper_default_filter_layers": paper,
              "paper_default_mean_sparse_coverage": mean_sparse_coverage(cov, paper, args.wait_layers),
              "coverage": [[round(float(x), 5) for x in row] for row in cov], "seconds": round(elapsed, 1),
              "settings": {k: getattr(args, k) for k in ("length", "num_prompts", "seed", "first_layer")}}
    with open(args.out + ".json", "w") as f:
        json.dump(report, f, indent=1)
    plot(cov, filters, args.out + ".png",
         f"OmniKV coverage, n = {num_selected}, {len(prompts)} prompts; chosen {filters}")
    print(f"mean sparse-layer coverage: chosen {trace[-1]['mean_sparse_coverage']:.3f}, "
          f"paper default {paper}: {report['paper_default_mean_sparse_coverage']:.3f}")
    print(f"omnikv_filter_layers={filters}")
    print(f"wrote {args.out}.json and {args.out}.png ({elapsed:.1f} s)")
    return 0


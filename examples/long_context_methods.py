"""The same long prompt (a passkey hidden in ~800 tokens of filler) through vanilla, QuEST, SnapKV, OmniKV and
HiSparse (its hot buffer forced small, so pages really move between host and device), and DeltaKV when a compressor is given (it needs one trained for the model, ~30 min on a CPU):

    python -m sparsevllm.tools.train_deltakv --out deltakv_smollm2     # optional, once
    DELTAKV_COMPRESSOR=deltakv_smollm2 python examples/long_context_methods.py
"""
import os

from sparsevllm import LLM, SamplingParams

filler = "The grass is green. The sky is blue. The sun is yellow. Here we go. " * 20
prompt = f"{filler}The pass key is 71432. Remember it. {filler}\nWhat is the pass key?"
sp = SamplingParams(temperature=0.0, max_tokens=12)

for method, knobs in [("vanilla", {}),
                      ("quest", {"quest_token_budget": 256}),
                      ("snapkv", {"snapkv_capacity": 256}),
                      ("omnikv", {"omnikv_num_selected": 64}),
                      ("hisparse", {"hisparse_token_budget": 128, "hisparse_min_prompt_len": 256,
                                    "hisparse_host_memory_gb": 0.5})] + (
        [("deltakv", {"deltakv_compressor_path": os.environ["DELTAKV_COMPRESSOR"], "deltakv_decode_keep": 64})]
        if os.environ.get("DELTAKV_COMPRESSOR") else []):
    llm = LLM(vllm_sparse_method=method, **knobs)
    out = llm.chat([{"role": "user", "content": prompt}], sp, use_tqdm=False)[0]
    print(f"{method:8s} {len(out.prompt_token_ids)} prompt tokens -> {out.outputs[0].text!r}")

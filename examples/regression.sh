#!/usr/bin/env bash
# Accuracy of QuEST and SnapKV against vanilla on the embedded SmolLM2-135M (CPU), with budget sweeps.
set -euo pipefail
python -m sparsevllm.regression --methods quest,snapkv --lengths 2k --samples 20 \
  --tasks niah_single_number_noise,niah_multikey,fidelity \
  --hyper_params '{"max_num_seqs": 8, "quest": {"quest_token_budget": [256, 512, 1024]},
                   "snapkv": {"snapkv_capacity": [256, 512, 1024]}}' --out_dir runs/methods_2k

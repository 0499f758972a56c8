#!/usr/bin/env bash
# Decode throughput of vanilla, QuEST and SnapKV on the Llama-3.1-8B shape (random weights), on a GPU.
set -euo pipefail
python scripts/benchmarks/bench_sparse_vllm.py --model_path llama-3.1-8b --methods vanilla,quest,snapkv \
  --lengths 32768,128000 --batch_sizes 1,4 --output_len 256 \
  --hyper_params '{"chunk_prefill_size": 8192, "max_num_batched_tokens": 16384}' --out_dir bench_out
# A quick CPU smoke run of the same script:
#   python scripts/benchmarks/bench_sparse_vllm.py --model_path tiny --lengths 256 --batch_sizes 1,2 --output_len 32

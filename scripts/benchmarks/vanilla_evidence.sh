#!/usr/bin/env bash
# The GPU evidence for vanilla (engine + benchmark issues), in two parts that each fit a 10-minute run:
#   bash scripts/benchmarks/vanilla_evidence.sh short OUT_DIR   # 4K x 1/4/32, 8K x 32, HF baseline at 4K
#   bash scripts/benchmarks/vanilla_evidence.sh long  OUT_DIR   # 32K x 1/4 (+ one-shot 32K prefill), 128K x 1/4
set -uo pipefail
part=$1; out=$2
export PYTHONPATH=${PYTHONPATH:-src}
bench="python scripts/benchmarks/bench_sparse_vllm.py --model_path llama-3.1-8b --methods vanilla --output_len 256"
hp='{"chunk_prefill_size": 8192, "max_num_batched_tokens": 16384}'
if [ "$part" = short ]; then
  $bench --lengths 4096 --batch_sizes 1,4,32 --hyper_params "$hp" --out_dir "$out/bench"
  $bench --lengths 8192 --batch_sizes 32 --hyper_params "$hp" --out_dir "$out/bench"
  $bench --lengths 4096 --batch_sizes 1,16 --baseline hf --hyper_params "$hp" --out_dir "$out/bench_hf"
else
  $bench --lengths 32768 --batch_sizes 1,4 --hyper_params "$hp" --out_dir "$out/bench"
  $bench --lengths 32768 --batch_sizes 1 --output_len 16 \
    --hyper_params '{"chunk_prefill_size": 32768, "max_num_batched_tokens": 32768}' --out_dir "$out/prefill32k"
  $bench --lengths 131072 --batch_sizes 1,4 --hyper_params "$hp" --out_dir "$out/bench"
fi

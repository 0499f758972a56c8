#!/usr/bin/env bash
# GPU evidence for the FP8 KV cache (issue #50) on one H100 / H200, in two parts that each fit an
# 8-minute run (a 128K prefill and an engine start cost ~30-40 s a case):
#   bash scripts/benchmarks/fp8_evidence.sh first  $OUT   # GPU fp8 tests; vanilla auto vs fp8 at 128K x 4 (64K on an H100); capacity
#   bash scripts/benchmarks/fp8_evidence.sh sparse $OUT   # quest, omnikv, snapkv auto vs fp8 at the same size; hisparse 64K x 4;
#                                                           deltakv 32K x 4 (random compressor)
#   bash scripts/benchmarks/fp8_evidence.sh hisparse $OUT # capacity under a cap: vanilla bf16 64K x 2 against hisparse fp8 64K x 10
# Every A/B pair runs in one process on one card (ab_decode.py: Llama-3.1-8B shape, random bf16 weights,
# CUDA graphs, output 256); compare the fp8 / auto ratio of decode_tok_s. Logs and ROW lines go to $OUT.
set -uo pipefail
part=${1:-first}; out=${2:-${OUT:-fp8_evidence_out}}
mkdir -p "$out"
export PYTHONPATH=${PYTHONPATH:-src}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu_$part.txt"
ab() { python scripts/benchmarks/ab_decode.py . "$@" 2>&1 | tee -a "$out/ab_$part.log" | grep '^ROW'; }
# Distinct prompts (each request reads its own pages, as served traffic does; shared prompts are read
# from L2 four times and hide what FP8 saves): 4 x 128K of bf16 KV is 67 GB beside the 16 GB of
# weights, so 128K on an H200 and 64K on an H100.
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
L=65536; [ "$mem" -gt 120000 ] && L=128000
if [ "$part" = first ]; then
  timeout 180 python -m pytest -q -m gpu -k fp8 tests/test_fp8.py 2>&1 | tail -25 | tee "$out/gpu_tests.log"
  AB_DISTINCT=1 ab vanilla:$L:4:auto vanilla:$L:4:fp8
  # Capacity: one cap that holds ~2.6 bf16 requests of 128K tokens beside the weights (16.1 GB) and the
  # activation reserve; fp8 holds 2 x 128 / (128 + 4) per token and head as many (vanilla).
  util=$(python -c "import torch; t = torch.cuda.mem_get_info()[1]; print(round((16.1e9 + 2.5e9 + 2.6 * 128100 * 131072) / t, 3))")
  echo "capacity cap gpu_memory_utilization=$util" | tee "$out/capacity.log"
  for kv in auto fp8; do
    timeout 200 python scripts/benchmarks/capacity.py --method vanilla --length 128000 --output_len 8 --num_requests 5 \
      --gpu_memory_utilization "$util" --hyper_params "{\"chunk_prefill_size\": 16384, \"max_num_batched_tokens\": 16384, \"kv_cache_dtype\": \"$kv\"}" \
      --out "$out/capacity.jsonl" 2>&1 | tail -1 | tee -a "$out/capacity.log"
  done
elif [ "$part" = hisparse ]; then
  # The cap where vanilla bf16 fits 2 x 64K: 8,300 pages of 2 MiB (bf16, 16 tokens, 32 layers x 8 KV heads
  # x 128). HiSparse's fp8 page is 1,085,440 bytes (K and V in e4m3, a fp32 scale per token and head,
  # and its bf16 scratch row), so the same bytes hold 16,036 of them; its host pool holds the 10 prompts
  # (44 GB in fp8 against 82 GB in bf16: half the PCIe bytes a missed page costs).
  AB_DISTINCT=1 AB_KNOBS='{"num_kv_pages": 8300}' ab vanilla:65536:2:auto
  AB_DISTINCT=1 AB_KNOBS='{"num_kv_pages": 16036, "hisparse_host_memory_gb": 44}' ab hisparse:65536:10:fp8
else
  AB_DISTINCT=1 ab quest:$L:4:auto quest:$L:4:fp8 omnikv:$L:4:auto omnikv:$L:4:fp8 \
     snapkv:$L:4:auto snapkv:$L:4:fp8
  AB_KNOBS='{"hisparse_host_memory_gb": 36}' ab hisparse:65536:4:auto hisparse:65536:4:fp8
  ab deltakv:32000:4:auto deltakv:32000:4:fp8   # no prefix cache: each request prefills its own prompt
fi

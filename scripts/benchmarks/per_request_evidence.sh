#!/usr/bin/env bash
# GPU evidence for sparsity per request (issue #51) on one H100 / H200, in one run of ~15 minutes (two calls if a call is limited to 10):
#   bash scripts/benchmarks/per_request_evidence.sh $OUT
# 1. the GPU tests of the feature: a mixed batch (vanilla rows, QuEST / OmniKV / SnapKV at two budgets)
#    under CUDA graphs equals each request alone; the per-row page selection's Triton kernel against its
#    reference; QuEST's GPU tests (its selection now takes a budget per row).
# 2. 128K x 2 QuEST + 128K x 2 vanilla in one batch against the two homogeneous runs (target: mixed
#    >= 95% of the tok/s predicted from them; per_request_bench.py says how).
# 3. 4K x 32 with vllm_sparse_method="auto" (every request dense) against vanilla (target: within 2%).
# 4. memory pressure: 4 x 128K in a pool that admits 2 (not their outputs), "auto" against vanilla: wall
#    time, and no recompute under "auto" (prompt tokens prefilled once, no preemption; it compacts).
# Llama-3.1-8B shape, random bf16 weights, CUDA graphs, output 256. Logs and ROW lines go to $OUT.
set -uo pipefail
out=${1:-${OUT:-per_request_evidence_out}}
mkdir -p "$out"
export PYTHONPATH=${PYTHONPATH:-src}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
git log -1 --format='%H %s' | tee "$out/commit.txt"
timeout 200 python -m pytest -q -m gpu tests/test_per_request.py tests/test_quest.py 2>&1 | tail -25 | tee "$out/gpu_tests.log"
timeout 200 python scripts/benchmarks/per_request_bench.py mixed 128000 2>&1 | tee "$out/mixed.log" | grep '^ROW'
timeout 100 python scripts/benchmarks/per_request_bench.py auto 4096 32 2>&1 | tee "$out/auto.log" | grep '^ROW'
timeout 400 python scripts/benchmarks/per_request_bench.py pressure 128000 2>&1 | tee "$out/pressure.log" | grep '^ROW'
# 5. the mixed workload (24 x 2K chats + 4 x 128K documents sharing one prompt; vanilla / QuEST / auto engines)
timeout 300 python scripts/benchmarks/per_request_bench.py workload 128000 2>&1 | tee "$out/workload.log" | grep '^ROW'

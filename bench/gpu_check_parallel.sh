#!/usr/bin/env bash
# Tensor parallelism on a machine with more than one GPU (issue 9), run from the repo root; appended to
# gpu_check.sh (PARALLEL=0 skips it there) and runnable alone: `bash bench/gpu_check_parallel.sh`. Does nothing
# (exit 0) with fewer than 2 GPUs. Own budget: PARALLEL_BUDGET_S (default 300 s).
#
# Files in $OUT: parallel_check.json (greedy tokens TP=1 vs TP=N on a random Llama with Pallas attention under
# shard_map, bf16, and each one's decode step time), parallel_e2e.json / parallel_e2e.log (the Llama-3-8B-shaped
# offline throughput of gpu_check.sh's e2e phase, tensor-parallel over N GPUs: compare with e2e.json), and
# PARALLEL.txt (one line per row).
set -u -o pipefail

BUDGET=${PARALLEL_BUDGET_S:-300}
source bench/gpu_lib.sh

GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
echo; echo "=== tensor parallelism ($GPUS GPUs)"
if ((GPUS < 2)); then
  echo "one GPU or none: no tensor-parallel row" | tee "$OUT/PARALLEL.txt"
  exit 0
fi
TP=1
while ((TP * 2 <= GPUS && TP < 8)); do TP=$((TP * 2)); done  # the largest power of two <= GPUs, up to 8

cap 120 $PY bench/tp_check.py --tensor-parallel-size "$TP" --preset small --attention pallas \
  2>&1 | grep -v Warning | tee "$OUT/parallel_check.log" | grep '^{' > "$OUT/parallel_check.json"
CHECK_RC=$?
cap 200 $PY bench/offline_throughput.py --preset llama3-8b --batch-sizes 1 16 64 --repeats 1 --tensor-parallel-size "$TP" \
  --out "$OUT/parallel_e2e.json" 2>&1 | tee "$OUT/parallel_e2e.log" | tail -5
E2E_RC=$?
{
  echo "tensor-parallel $TP of $GPUS GPUs: check rc=$CHECK_RC e2e rc=$E2E_RC (124 = hit its time cap)"
  cat "$OUT/parallel_check.json" 2>/dev/null
  cat "$OUT/parallel_e2e.json" 2>/dev/null
} | tee "$OUT/PARALLEL.txt"
echo "tensor parallelism: $((SECONDS - START)) s"

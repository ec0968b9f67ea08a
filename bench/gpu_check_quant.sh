#!/usr/bin/env bash
# The prepared GPU check for issue 6 (quantization), run from the repo root on a machine with a CUDA GPU (bare
# image with jax 0.11.2 CUDA, flax, numpy; this repo copied in). Standalone, or as the last section of
# bench/gpu_check.sh. About 8-9 minutes; every phase has its own time cap inside QUANT_BUDGET_S.
#
#   bash bench/gpu_check_quant.sh          # results in $OUT (or bench/out when OUT is unset)
#
# Phases, most important first:
#   1. tests/test_quant_kernels.py compiled for the GPU (JAXSERVE_KERNEL_INTERPRET=0): W8A16/W4A16 and the
#      attention kernels over int8/fp8 caches against their references on real Triton
#   2. matmul rows: W8A16 / W4A16 vs the bf16 XLA dot, M = 1, 16, 64, 256, Llama-3-8B MLP shapes; then the
#      imported formats' kernel variants (int4/int8 zero points, act-order's x gather, fp8 per channel and
#      g128) and the native FP8 (W8A8) dot, M = 1, 16, 256
#   3. end to end: batch-1 decode tokens/s of a random Llama-3-8B-shaped model, bf16 / int8 / int4 / int8+kv-int8
#      / int4-g128-zp (the GPTQ/AWQ asymmetric format) / fp8
#   4. launch-config sweep at M = 16 (what choose_config should pick), if time is left
# $OUT gets: quant_tests.log, quant_matmul.{json,log}, quant_import_matmul.{json,log}, quant_e2e.{json,log},
# quant_sweep.{json,log},
# QUANT_RESULTS.md, quant_summary.txt. Copy QUANT_RESULTS.md into bench/RESULTS.md with the run's date.
set -u -o pipefail

BUDGET=${QUANT_BUDGET_S:-570}
PHASE_PREFIX="quant: "
source bench/gpu_lib.sh
export JAXSERVE_KERNEL_INTERPRET=0

phase "kernel tests on the GPU"
cap 120 $PY -m pytest -q -p no:cacheprovider --durations=5 tests/test_quant_kernels.py \
  -k "not lowers_for_h200 and not compiles_for_sm90" 2>&1 | tee "$OUT/quant_tests.log" | tail -15
TESTS_RC=$?

phase "matmul: W8A16 / W4A16 vs bf16 dot"
cap 140 $PY bench/quant_speed.py --only matmul --out "$OUT/quant_matmul.json" 2>&1 | grep -v Warning \
  | tee "$OUT/quant_matmul.log" | tail -20
MATMUL_RC=$?

phase "matmul: imported formats (zero points, act-order, fp8) vs bf16 dot and the native FP8 dot"
cap 150 $PY bench/quant_speed.py --only matmul --rows w4a16_zp w4a16_zp_act w8a16_zp wfp8a16 wfp8a16_g128 \
  --ms 1 16 256 --out "$OUT/quant_import_matmul.json" 2>&1 | grep -v Warning | tee "$OUT/quant_import_matmul.log" \
  | tail -40
IMPORT_RC=$?

phase "end to end: batch-1 decode per scheme"
cap 260 $PY bench/quant_speed.py --only e2e --e2e-schemes bf16 int8 int4 int8+kv-int8 int4-g128-zp fp8 \
  --out "$OUT/quant_e2e.json" 2>&1 | grep -v Warning | tee "$OUT/quant_e2e.log" | tail -12
E2E_RC=$?

phase "launch-config sweep at M = 16"
cap 120 $PY bench/quant_speed.py --only sweep --out "$OUT/quant_sweep.json" 2>&1 | grep -v Warning \
  | tee "$OUT/quant_sweep.log" | tail -8
SWEEP_RC=$?

phase "summary"
echo "exit codes: tests=$TESTS_RC matmul=$MATMUL_RC import=$IMPORT_RC e2e=$E2E_RC sweep=$SWEEP_RC (124 = hit its" \
  "time cap)" \
  | tee "$OUT/quant_summary.txt"
$PY bench/quant_speed.py --summarize "$OUT/quant_matmul.json" "$OUT/quant_import_matmul.json" "$OUT/quant_e2e.json" \
  "$OUT/quant_sweep.json" \
  --markdown "$OUT/QUANT_RESULTS.md" 2>&1 | tee -a "$OUT/quant_summary.txt"
grep -E "passed|failed|error" "$OUT/quant_tests.log" | tail -1 | tee -a "$OUT/quant_summary.txt"
echo "quant total $((SECONDS - START)) s"

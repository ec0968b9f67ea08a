#!/usr/bin/env bash
# The prepared GPU check for issue 17 (model families), run from the repo root on a machine with a CUDA GPU (bare
# image with jax 0.11.2 CUDA, flax, numpy; this repo copied in). Standalone, or as a section of bench/gpu_check.sh.
# About 5 minutes; every phase has its own time cap inside MOE_BUDGET_S.
#
#   bash bench/gpu_check_moe.sh          # results in $OUT (or bench/out when OUT is unset)
#
# Phases:
#   1. the Gemma attention variants (soft-capping, per-layer windows as operands) and the MoE grouped matmul,
#      compiled for the GPU: tests/test_kernels_attention.py -k softcap, tests/test_families.py -k grouped
#   2. one Mixtral-shaped MoE layer's expert matmuls (bench/moe_grouped.py): jax.lax.ragged_dot as XLA lowers it,
#      JAX's Pallas Triton grouped kernel (the same ragged_dot under jax_ragged_dot_use_gpu_pallas_triton_lowering),
#      every expert on every token, and the floor (the matmuls of the experts hit), T = 1, 16, 64, 256
#   3. a Mixtral-8x7B-shaped model cut to 4 layers (8 experts of 4096 x 14336, top-2; jax.lax.ragged_dot grouped
#      matmuls), bf16, batch 1 / 16 / 64: decode step vs its floor (the matmuls of the experts the batch hits)
# $OUT gets: moe_tests.log, moe_grouped.{json,log}, moe_e2e.{json,log}, moe_summary.txt. Copy the rows into bench/RESULTS.md with the date.
set -u -o pipefail

BUDGET=${MOE_BUDGET_S:-320}
PHASE_PREFIX="families: "
source bench/gpu_lib.sh
export JAXSERVE_KERNEL_INTERPRET=0

phase "Gemma attention variants and the MoE grouped matmul on the GPU"
cap 90 $PY -m pytest -q -p no:cacheprovider tests/test_kernels_attention.py tests/test_families.py \
  -k "softcap or grouped" 2>&1 | tee "$OUT/moe_tests.log" | tail -8
TESTS_RC=$?

phase "one Mixtral-shaped layer: grouped matmul paths vs the floor"
cap 80 $PY bench/moe_grouped.py --preset mixtral --tokens 1 16 64 256 --out "$OUT/moe_grouped.json" 2>&1 \
  | tee "$OUT/moe_grouped.log" | tail -16
GROUPED_RC=$?

phase "Mixtral-shaped layers: decode step vs the matmuls of the experts hit"
cap 150 $PY bench/offline_throughput.py --preset mixtral-layers --repeats 1 --batch-sizes 1 16 64 --input-len 128 \
  --output-len 64 --out "$OUT/moe_e2e.json" 2>&1 | tee "$OUT/moe_e2e.log" | tail -6
E2E_RC=$?

phase "summary"
echo "exit codes: tests=$TESTS_RC grouped=$GROUPED_RC e2e=$E2E_RC (124 = hit its time cap)" | tee "$OUT/moe_summary.txt"
grep -E "passed|failed|error" "$OUT/moe_tests.log" | tail -1 | tee -a "$OUT/moe_summary.txt"
echo "total $((SECONDS - START)) s"

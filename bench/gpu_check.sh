#!/usr/bin/env bash
# One prepared GPU check for issue 5, run from the repo root on a machine with a CUDA GPU (bare image with
# jax 0.11.2 CUDA, flax, numpy; this repo copied in). Finishes within ~8 minutes; every phase has its own time
# cap, so one hang cannot eat the others' budget.
#
#   bash bench/gpu_check.sh            # results in $OUT (or bench/out when OUT is unset)
#
# Phases: kernel tests compiled for the GPU (JAXSERVE_KERNEL_INTERPRET=0), bench/kernels.py (with the decode
# sweep), bench/offline_throughput.py (Llama-3-8B-shaped random model, bf16, batch 1/16/64/256), then one short
# table. $OUT gets at most 7 files: tests.log, kernels.log, kernels.json, e2e.log, e2e.json, RESULTS.md,
# summary.txt. Copy RESULTS.md into bench/RESULTS.md with the run's date.
set -u -o pipefail

BUDGET=${BUDGET_S:-470}  # whole script, seconds
source bench/gpu_lib.sh
export JAXSERVE_KERNEL_INTERPRET=0

phase "machine"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader || true
$PY -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())" 2>&1 | tail -1

phase "kernel tests on the GPU"
cap 150 $PY -m pytest -q -p no:cacheprovider -m "not slow" --durations=10 \
  tests/test_kernels_attention.py tests/test_kernels_model.py tests/test_kernels_lowering.py \
  2>&1 | tee "$OUT/tests.log" | tail -25
TESTS_RC=$?

phase "kernel benchmark"
cap 220 $PY bench/kernels.py --sweep --out "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.log" | grep -v Warning
BENCH_RC=$?

phase "end-to-end offline throughput"
if [[ -f bench/offline_throughput.py ]]; then
  cap 200 $PY bench/offline_throughput.py --preset llama3-8b --batch-sizes 1 16 64 256 --repeats 1 --out "$OUT/e2e.json" \
    2>&1 | tee "$OUT/e2e.log" | tail -30
  E2E_RC=$?
else
  echo "bench/offline_throughput.py is not in this checkout: no end-to-end numbers" | tee "$OUT/e2e.log"
  E2E_RC=127
fi

phase "summary"
echo "exit codes: tests=$TESTS_RC bench=$BENCH_RC e2e=$E2E_RC (124 = hit its time cap)" | tee "$OUT/summary.txt"
if [[ -f "$OUT/kernels.json" ]]; then
  $PY bench/kernels.py --summarize "$OUT/kernels.json" --e2e "$OUT/e2e.json" --markdown "$OUT/RESULTS.md" \
    2>&1 | tee -a "$OUT/summary.txt"
else
  echo "no kernels.json: see kernels.log" | tee -a "$OUT/summary.txt"
fi
grep -E "passed|failed|error" "$OUT/tests.log" | tail -1 | tee -a "$OUT/summary.txt"
echo "total $((SECONDS - START)) s"

# ------------------------------------------------------------------------------------------------------------------
# Quantization (issue 6): a separate script with its own time budget (QUANT_BUDGET_S, default 420 s), so it can
# also run alone: `bash bench/gpu_check_quant.sh`. QUANT=0 skips it here. Its files in $OUT start with quant_ /
# QUANT_ (see that script's header).
if [[ "${QUANT:-1}" != "0" && -f bench/gpu_check_quant.sh ]]; then
  OUT="$OUT" PYTHON="$PY" bash bench/gpu_check_quant.sh
fi

# ------------------------------------------------------------------------------------------------------------------
# Model families (issue 17): Gemma's attention variants and the MoE grouped matmul compiled for the GPU, and a
# Mixtral-shaped MoE row, in a separate script with its own budget (MOE_BUDGET_S, default 320 s), also runnable
# alone: `bash bench/gpu_check_moe.sh`. MOE=0 skips it. Its files in $OUT start with moe_.
if [[ "${MOE:-1}" != "0" && -f bench/gpu_check_moe.sh ]]; then
  OUT="$OUT" PYTHON="$PY" bash bench/gpu_check_moe.sh
fi

# ------------------------------------------------------------------------------------------------------------------
# Tensor parallelism (issue 9): only with more than one GPU, in a separate script with its own budget
# (PARALLEL_BUDGET_S, default 300 s), also runnable alone: `bash bench/gpu_check_parallel.sh`. PARALLEL=0 skips it.
# Its files in $OUT start with parallel_ / PARALLEL (see that script's header).
if [[ "${PARALLEL:-1}" != "0" && -f bench/gpu_check_parallel.sh ]]; then
  OUT="$OUT" PYTHON="$PY" bash bench/gpu_check_parallel.sh
fi
# ------------------------------------------------------------------------------------------------------------------
# LoRA (issue 16): base model vs 4 random rank-16 adapters mixed in every batch vs one merged adapter, Llama-3-8B
# shaped, bf16, 64 requests of 128 + 128 tokens, rounds interleaved (bench/lora.py). LORA=0 skips it. Files:
# $OUT/lora.log, $OUT/lora.json (one JSON line: out tok/s per engine and per round, lora_vs_base, merged_vs_base).
if [[ "${LORA:-1}" != "0" && -f bench/lora.py ]]; then
  phase "LoRA serving cost"
  cap 300 $PY bench/lora.py --preset llama3-8b --dtype bfloat16 --rounds 2 --out "$OUT/lora.json" \
    --engine-args '{"kv_cache_memory": 4e9, "decode_buckets": [16, 64], "prefill_token_buckets": [256, 2048]}' \
    2>&1 | tee "$OUT/lora.log" | tail -5
  echo "lora exit code: $? (124 = hit its time cap)" | tee -a "$OUT/summary.txt"
fi

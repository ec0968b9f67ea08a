# Sourced by bench/gpu_check*.sh: the shared environment and the time-capped runner. Before sourcing, set BUDGET
# (seconds for the whole script) and optionally PHASE_PREFIX. Defines OUT, PY, START, cap and phase.
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
START=$SECONDS

# cap SECONDS CMD...: run CMD with at most SECONDS, and never past the script's BUDGET.
cap() {
  local want=$1; shift
  local left=$((BUDGET - (SECONDS - START)))
  local limit=$((want < left ? want : left))
  if ((limit < 20)); then echo "skipped (budget spent): $*"; return 124; fi
  timeout --kill-after=10 "$limit" "$@"
}

phase() { echo; echo "=== ${PHASE_PREFIX:-}$1 ($((SECONDS - START)) s elapsed)"; }

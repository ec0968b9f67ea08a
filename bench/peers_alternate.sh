#!/bin/bash
# jaxserve against llama.cpp (llama-batched-bench) on the peers' `small` model, alternating: llama.cpp, then
# jaxserve, ROUNDS times, each a fresh process measuring N requests of 128 + 128 tokens. On a VM whose memory
# bandwidth drifts from minute to minute (the 2-vCPU Zen 4 VM: by a third within one harness run), one run of each
# engine minutes apart says more about the minute than about the engines at N = 1; pairs taken back to back do not.
#
#   bench/peers_alternate.sh f32  [ROUNDS] [N]   # llama.cpp f32 GGUF against the float32 checkpoint
#   bench/peers_alternate.sh q8_0 [ROUNDS] [N]   # llama.cpp q8_0 GGUF against int8 weights (converted once)
#
# Needs ../shared/peers set up (its setup.sh: models, GGUFs, llama.cpp built). Prints each round's pair (out tok/s,
# llama.cpp first), how many rounds jaxserve led, and both medians; the JSON lines stay under OUT.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PEERS="${PEERS:-$ROOT/../shared/peers}"
PY="${PY:-$ROOT/.venv/bin/python}"
GGUF_DIR="${GGUF_DIR:-/tmp/peers-models/gguf}"
LLAMA_BIN="${LLAMA_BIN:-/tmp/peers-build/llama.cpp/bin}"
TYPE="${1:?f32 or q8_0}"
ROUNDS="${2:-5}"
N="${3:-1}"
OUT="${OUT:-/tmp/peers-alternate-$TYPE-$(date -u +%Y%m%dT%H%M%S)}"
MODEL="$PEERS/models/small"
case "$TYPE" in
  f32) DTYPE=float32 ;;
  q8_0) DTYPE=int8 ;;
  *) echo "unknown weight type '$TYPE': f32 or q8_0" >&2; exit 2 ;;
esac
export PATH="$(dirname "$PY"):$PATH"
if [ "$DTYPE" = int8 ] && [ ! -f "$MODEL/.jaxserve-int8/jaxserve.json" ]; then
  # bench_jaxserve.py would pass --dtype int8 to convert; int8 is a quantization of float32 weights
  jaxserve convert "$MODEL" "$MODEL/.jaxserve-int8" --dtype float32 --quantize int8 --quantize-lm-head int8 --force
fi
mkdir -p "$OUT"
cd "$PEERS"
for i in $(seq "$ROUNDS"); do
  echo "round $i $(date -u +%H:%M:%S)"
  python3 bench_llamacpp_batched.py --bin "$LLAMA_BIN/llama-batched-bench" --gguf "$GGUF_DIR/small-$TYPE.gguf" \
    --model-name small --npl "$N" --threads 2 --repeats 1 --tag llama.cpp --out "$OUT/llamacpp.jsonl" >/dev/null
  "$PY" bench_jaxserve.py --model "$MODEL" --dtype "$DTYPE" --num-prompts "$N" --repeats 1 \
    --out "$OUT/jaxserve.jsonl" >"$OUT/jaxserve-$i.log" 2>&1
done
python3 - "$OUT" <<'EOF'
import json, statistics, sys
runs = {name: [json.loads(line)["out_tok_s"] for line in open(f"{sys.argv[1]}/{name}.jsonl")]
        for name in ("llamacpp", "jaxserve")}
pairs = list(zip(runs["llamacpp"], runs["jaxserve"]))
print("pairs (llama.cpp, jaxserve) out tok/s:", ", ".join(f"({a:.1f}, {b:.1f})" for a, b in pairs))
print(f"jaxserve ahead in {sum(b > a for a, b in pairs)} of {len(pairs)}; medians: llama.cpp "
      f"{statistics.median(runs['llamacpp']):.1f}, jaxserve {statistics.median(runs['jaxserve']):.1f}")
EOF

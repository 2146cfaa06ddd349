#!/usr/bin/env bash
# Tokens/s of gpt-small-cpu at np 2 (global batch 16, overlap_comm) in fp32, bf16 and fp16,
# and each 16-bit run's ratio to fp32 (issue 5's speed target: bf16 >= fp32).
# Usage: benchmarks/mixed_precision_speed.sh [WORKDIR]
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-output/mixed_precision_speed}
mkdir -p "$DIR"
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
for dtype in fp32 bf16 fp16; do
  set_dtype=()
  [ "$dtype" != fp32 ] && set_dtype=(--set "$dtype.enabled=true")
  mpirun -np 2 build/zero3d train input/gpt-small-cpu.json --set train_batch_size=16 \
    --set zero_optimization.overlap_comm=true "${set_dtype[@]}" --output "$DIR/$dtype" > "$DIR/$dtype.log"
  grep -E "^precision|^done" "$DIR/$dtype.log"
done
python3 - "$DIR" <<'PY'
import json, sys
d = sys.argv[1]
def tps(dtype):
    rows = [json.loads(l) for l in open(f"{d}/{dtype}/metrics.jsonl")][1:]  # the first step warms caches
    return sum(r["tokens_per_s"] for r in rows) / len(rows)
base = tps("fp32")
for dtype in ("fp32", "bf16", "fp16"):
    print(f"{dtype}: {tps(dtype):8.0f} tokens/s  ({tps(dtype) / base:.2f}x fp32)")
PY

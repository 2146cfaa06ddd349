#!/usr/bin/env bash
# ZeRO stage 3 against stage 0 at np 2 (issue 17's target: within 3%), fp32 and bf16, on
# gpt-small-cpu (global batch 16, overlap_comm), REPS alternating runs of each so that a drift
# in the machine's load reaches both alike; then the variable-count all-gather that stage 3
# runs (Communicator::all_gather_v_async) against raw MPI_Allgatherv (benchmarks/bench_comm.cpp).
# Usage: benchmarks/zero3_speed.sh [BUILD_DIR] [WORKDIR]   (REPS=3 by default)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
DIR=${2:-output/zero3_speed}
REPS=${REPS:-3}
mkdir -p "$DIR"
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
for dtype in fp32 bf16; do
  set_dtype=()
  [ "$dtype" != fp32 ] && set_dtype=(--set "$dtype.enabled=true")
  for rep in $(seq "$REPS"); do
    for stage in 0 3; do
      mpirun -np 2 "$BUILD/zero3d" train input/gpt-small-cpu.json --set train_batch_size=16 \
        --set zero_optimization.overlap_comm=true --set zero_optimization.stage=$stage --set training.steps=10 \
        "${set_dtype[@]}" --output "$DIR/$dtype-s$stage-r$rep" > "$DIR/$dtype-s$stage-r$rep.log" 2>&1
    done
  done
done
python3 - "$DIR" "$REPS" <<'PY'
import json, sys
d, reps = sys.argv[1], int(sys.argv[2])
def tps(name):
    rows = [json.loads(l) for l in open(f"{d}/{name}/metrics.jsonl")][1:]  # the first step warms caches
    return sum(r["tokens_per_s"] for r in rows) / len(rows)
for dtype in ("fp32", "bf16"):
    s0 = [tps(f"{dtype}-s0-r{r}") for r in range(1, reps + 1)]
    s3 = [tps(f"{dtype}-s3-r{r}") for r in range(1, reps + 1)]
    ratios = " ".join(f"{b / a:.3f}" for a, b in zip(s0, s3))
    print(f"{dtype} np2: stage 0 {sum(s0) / reps:.0f} tokens/s, stage 3 {sum(s3) / reps:.0f} tokens/s, "
          f"stage 3 / stage 0 = {sum(s3) / sum(s0):.3f} (per pair: {ratios})")
PY
echo "all_gather_v (communicator) against MPI_Allgatherv (raw), np 2, median of 5:"
mpirun -np 2 "$BUILD/benchmarks/zero3d_comm_bench" --benchmark_filter='all_gather_v' 2>&1 | grep -E 'median' |
  awk '{split($1, n, "/"); printf "  %-13s %10s bytes %9s us  %s\n", n[2], n[3], $2, $NF}'

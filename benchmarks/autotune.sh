#!/usr/bin/env bash
# Autotuning (issue 16) on gpt-small-cpu at np 2: the tuner's wall time, then the speed of its
# pick against the shipped config (tokens/s, median of REPEAT interleaved runs of STEPS steps,
# the first step not timed). Search: ZeRO 0-3 x micro-batch 8..MAX_MBS (fast mode), steps
# START..END profiled (DeepSpeed's defaults 3..5). On a loaded machine single runs move by several percent: read the figures as noisy.
# Usage: [ZERO3D=build/zero3d] [MAX_MBS=16] [START=3] [END=5] [STEPS=6] [REPEAT=3] benchmarks/autotune.sh [WORKDIR]
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-output/autotune_bench}
MAX_MBS=${MAX_MBS:-16}
START=${START:-3}
END=${END:-5}
STEPS=${STEPS:-6}
REPEAT=${REPEAT:-3}
ZERO3D=${ZERO3D:-build/zero3d}
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
rm -rf "$DIR"
mkdir -p "$DIR"
common=(--set training.peak_gflops=100 --set steps_per_print=1000 --set wall_clock_breakdown=false)
start=$(date +%s.%N)
mpirun -np 2 "$ZERO3D" autotune input/gpt-small-cpu.json "${common[@]}" --set zero_optimization.stage=all \
  --set autotuning.results_dir="$DIR/results" --set autotuning.exps_dir="$DIR/exps" \
  --set autotuning.start_profile_step="$START" --set autotuning.end_profile_step="$END" \
  --set autotuning.min_train_micro_batch_size_per_gpu=8 \
  --set autotuning.max_train_micro_batch_size_per_gpu="$MAX_MBS" \
  --set autotuning.num_tuning_micro_batch_sizes=2 > "$DIR/autotune.log"
end=$(date +%s.%N)
measured=$(grep -c '| measured |' "$DIR/results/summary.txt" || true)
echo "autotune: $(awk -v a="$start" -v b="$end" 'BEGIN{printf "%.1f", b-a}') s wall for $measured measured experiments"
grep '^best ' "$DIR/results/summary.txt"
# The shipped config against the pick, interleaved.
for rep in $(seq 1 "$REPEAT"); do
  for mode in shipped tuned; do
    cfg=input/gpt-small-cpu.json
    [ "$mode" = tuned ] && cfg="$DIR/results/ds_config_optimal.json"
    mpirun -np 2 "$ZERO3D" train "$cfg" "${common[@]}" --set training.steps="$STEPS" \
      --output "$DIR/$mode.$rep" > "$DIR/$mode.$rep.log"
  done
done
for mode in shipped tuned; do
  # tokens/s of steps 2..STEPS of each run, then the median over runs
  for rep in $(seq 1 "$REPEAT"); do
    python3 -c "
import json,sys
rows=[json.loads(l) for l in open('$DIR/$mode.$rep/metrics.jsonl')][1:]
print(sum(r['tokens_per_s'] for r in rows)/len(rows))"
  done | sort -g | awk -v m="$mode" '{v[NR]=$1} END{printf "%-8s %.0f tokens/s (median of %d runs)\n", m, v[int((NR+1)/2)], NR}'
done

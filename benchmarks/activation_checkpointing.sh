#!/usr/bin/env bash
# Activation checkpointing on gpt-small-cpu (V=256, L=6, H=6, C=384, micro-batch 8) at np 2 and a
# long sequence: peak resident memory, tokens/s and the planner's prediction without
# checkpointing, with selective recompute and with full recompute (interval 1); the measured
# recompute overhead of full against the formula (one more forward: 6N + 12LTC -> 8N + 16LTC
# per token, +33% of model FLOPs); then the largest micro-batch the planner fits in MEM per rank
# with and without checkpointing, each confirmed by a run at that micro-batch.
# Usage: [ZERO3D=build/zero3d] [STEPS=4] benchmarks/activation_checkpointing.sh [T] [MEM] [WORKDIR]
#        (defaults T=1024, MEM=8GiB)
set -euo pipefail
cd "$(dirname "$0")/.."
T=${1:-1024}
MEM=${2:-8GiB}
DIR=${3:-output/activation_checkpointing}
STEPS=${STEPS:-4}
ZERO3D=${ZERO3D:-build/zero3d}  # the executable (another build tree: ZERO3D=build-x/zero3d)
mkdir -p "$DIR"
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
common=(--set model.n_positions="$T" --set training.steps="$STEPS" --set training.peak_gflops=100
        --set steps_per_print=1000 --set wall_clock_breakdown=false)
echo "gpt-small-cpu, T=$T, micro-batch 8, np 2 (data parallel), fp32, $STEPS steps (the first is not timed)"
printf "%-22s %12s %12s %8s %10s %10s\n" checkpointing "predicted MB" "measured MB" ratio "tokens/s" "activ. MB"
declare -A tps
for mode in none selective full; do
  args=()
  case $mode in
    selective) args=(--set pipeline.activation_checkpoint_interval=1
                     --set activation_checkpointing.recompute_granularity=selective) ;;
    full) args=(--set pipeline.activation_checkpoint_interval=1 --set activation_checkpointing.profile=true) ;;
  esac
  run="$DIR/$mode"
  rm -rf "$run"
  mpirun -np 2 "$ZERO3D" train input/gpt-small-cpu.json "${common[@]}" "${args[@]}" --output "$run" > "$run.log"
  line=$(python3 - "$run" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1] + "/metrics.jsonl")]
plan = rows[-1]["memory_plan"]
timed = rows[1:] or rows
tps = sum(r["tokens_per_s"] for r in timed) / len(timed)
print(f'{plan["predicted_peak_bytes"]/1e6:.1f} {plan["measured_peak_bytes"]/1e6:.1f} {plan["ratio"]:.3f} {tps:.0f} '
      f'{rows[-1]["memory"]["activations"]/1e6:.1f}')
PY
)
  set -- $line
  tps[$mode]=$4
  printf "%-22s %12s %12s %8s %10s %10s\n" "$mode" "$1" "$2" "$3" "$4" "$5"
done
python3 - "${tps[none]}" "${tps[full]}" "$T" "$DIR/full" <<'PY'
import json, sys
none, full, T = float(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
rows = [json.loads(l) for l in open(sys.argv[4] + "/metrics.jsonl")][1:]
# measured within the full run itself (robust to load from other processes): the recompute
# time of rank 0's checkpoints against the rest of its step
recompute = sum(sum(p["recompute_ms"] for p in r["activation_checkpointing"]["profile"]) for r in rows)
rest = sum(r["elapsed_ms"] for r in rows) - recompute
L, C, V = 6, 384, 256
N = V * C + T * C + L * (12 * C * C + 13 * C) + 2 * C        # parameters (wte tied)
train = 6 * N + 12 * L * T * C                               # forward + backward per token
block_fwd = 2 * L * (12 * C * C) + 4 * L * T * C             # the blocks' forward, recomputed by full
print(f"full recompute: recompute time +{100 * recompute / rest:.1f}% of the rest of the step (profile); "
      f"tokens/s {100 * (none / full - 1):.1f}% lower than without; formula: one more forward of the blocks = "
      f"+{100 * block_fwd / train:.1f}% of model FLOPs (+33% when the blocks are the whole model)")
PY
echo
echo "largest micro-batch in $MEM per rank at np 2, ZeRO stage 0 (planner; then confirmed by running it):"
"$ZERO3D" estimate --config input/gpt-small-cpu.json --set model.n_positions="$T" --world-size 2 \
  --memory-per-rank "$MEM" --json > "$DIR/fit.json"
read -r none full < <(python3 -c "
import json; f = json.load(open('$DIR/fit.json'))['fits'][0]
print(f['without_checkpointing'], f['with_full_recompute'])")
for pair in "none $none" "full $full"; do
  set -- $pair
  if [ "$2" -eq 0 ]; then echo "  $1: not even micro-batch 1 fits in $MEM"; continue; fi
  args=()
  [ "$1" = full ] && args=(--set pipeline.activation_checkpoint_interval=1)
  run="$DIR/fit_$1"
  rm -rf "$run"
  mpirun -np 2 "$ZERO3D" train input/gpt-small-cpu.json --set model.n_positions="$T" --set training.steps=2 \
    --set training.peak_gflops=100 --set train_micro_batch_size_per_gpu="$2" "${args[@]}" --output "$run" > "$run.log"
  python3 - "$run" "$1" "$2" "$MEM" <<'PY'
import json, re, sys
run, mode, mb, mem = sys.argv[1:5]
units = {"GiB": 2**30, "MiB": 2**20, "GB": 1e9, "MB": 1e6}
m = re.match(r"([\d.]+)(\w+)", mem)
limit = float(m.group(1)) * units[m.group(2)]
plan = [json.loads(l) for l in open(run + "/metrics.jsonl")][-1]["memory_plan"]
print(f"  {mode:<5} micro-batch {mb:>4}: predicted {plan['predicted_peak_bytes']/2**30:.2f} GiB, measured "
      f"{plan['measured_peak_bytes']/2**30:.2f} GiB per rank ({'fits' if plan['measured_peak_bytes'] <= limit else 'OVER'} {mem})")
PY
done

#!/usr/bin/env bash
# Overhead of each observability feature (issue 16) on gpt-small-cpu at np 2: tokens/s with the
# feature on against the same run with everything off, runs interleaved REPEAT times and the
# median of each mode reported (other work on the machine moves single runs by a few percent).
# Modes: off | wall_clock_breakdown | flops_profiler (profile_step 3) | csv_monitor+tensorboard |
# comms_logger | all (everything but the trace) | trace (records step 3 only; the per-step
# cost shows in that step, the mean over STEPS dilutes it: its own column reports the step).
# Usage: [ZERO3D=build/zero3d] [STEPS=8] [REPEAT=3] benchmarks/observability_overhead.sh [WORKDIR]
set -euo pipefail -f  # -f: the trace.steps=[3] argument is not a glob
cd "$(dirname "$0")/.."
DIR=${1:-output/observability_overhead}
STEPS=${STEPS:-8}
REPEAT=${REPEAT:-3}
ZERO3D=${ZERO3D:-build/zero3d}  # the executable (another build tree: ZERO3D=build-x/zero3d)
mkdir -p "$DIR"
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
common=(--set training.steps="$STEPS" --set training.peak_gflops=100 --set steps_per_print=1000
        --set wall_clock_breakdown=false)
args_for() {
  case $1 in
    off) ;;
    breakdown) echo --set wall_clock_breakdown=true ;;
    flops) echo --set flops_profiler.enabled=true --set flops_profiler.profile_step=3
           echo --set flops_profiler.output_file="$DIR/flops_report.txt" ;;
    monitors) echo --set csv_monitor.enabled=true --set tensorboard.enabled=true ;;
    comms) echo --set comms_logger.enabled=true ;;
    all) args_for breakdown; args_for flops; args_for monitors; args_for comms ;;
    trace) echo --set trace.enabled=true --set 'trace.steps=[3]' ;;
  esac
}
modes=(off breakdown flops monitors comms all trace)
echo "gpt-small-cpu (V=256, T=256, L=6, H=6, C=384, micro-batch 8), np 2, fp32, $STEPS steps (the first not timed), $REPEAT interleaved runs per mode"
for rep in $(seq 1 "$REPEAT"); do
  for mode in "${modes[@]}"; do
    run="$DIR/$mode.$rep"
    rm -rf "$run"
    # shellcheck disable=SC2046
    mpirun -np 2 "$ZERO3D" train input/gpt-small-cpu.json "${common[@]}" $(args_for "$mode") --output "$run" > "$run.log"
  done
done
python3 - "$DIR" "$REPEAT" "${modes[@]}" <<'PY'
import json, statistics, sys
d, rep, modes = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
def rows(m, r): return [json.loads(l) for l in open(f"{d}/{m}.{r}/metrics.jsonl")]
def tps(m, r):
    t = rows(m, r)[1:]
    return sum(x["tokens_per_s"] for x in t) / len(t)
def step3_ms(m, r): return rows(m, r)[2]["elapsed_ms"]
base = statistics.median(tps("off", r) for r in range(1, rep + 1))
base3 = statistics.median(step3_ms("off", r) for r in range(1, rep + 1))
print(f'{"mode":<12}{"tokens/s (median)":>20}{"overhead":>10}{"step 3 ms":>12}{"step 3 vs off":>15}')
for m in modes:
    t = statistics.median(tps(m, r) for r in range(1, rep + 1))
    s3 = statistics.median(step3_ms(m, r) for r in range(1, rep + 1))
    print(f'{m:<12}{t:>20.0f}{100 * (base / t - 1):>9.1f}%{s3:>12.1f}{100 * (s3 / base3 - 1):>14.1f}%')
PY

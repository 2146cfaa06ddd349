#!/usr/bin/env bash
# Predicted against measured peak resident memory per rank: the memory plan (`estimate --config`,
# the start-up `plan` line, the "auto" micro-batch and autotune's pruning all use it) against the
# largest rank's peak RSS (metrics.jsonl memory_plan.measured_peak_bytes) of real runs of a
# 42M-parameter GPT (C 768, L 6, H 12, V 256, micro-batch 2, np 2, 2 steps saving after each: the second step's peak holds the first save's staging)
# in fp32, bf16 and fp16, at T 256 and 512, ZeRO 0 and 3, with and without full activation
# checkpointing, and at ZeRO 3 with the optimizer and parameters on NVMe.
# Usage: benchmarks/estimate_vs_measured.sh [WORKDIR] [SWAPDIR]   (ZERO3D=path/to/zero3d, NP=2,
#   CASES=regex: only the runs whose name matches, e.g. CASES='bf16_T512_z3' or CASES='nvmeyes')
#   SWAPDIR must take O_DIRECT (not tmpfs); default WORKDIR/swap.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-output/estimate_vs_measured}
SWAP=${2:-$DIR/swap}
EXE=${ZERO3D:-build/zero3d}
NP=${NP:-2}
mkdir -p "$DIR" "$SWAP"
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
cat > "$DIR/est.json" <<'JSON'
{"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
 "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
 "model": {"vocab_size": 256, "n_positions": 256, "n_layer": 6, "n_head": 12, "n_embd": 768},
 "zero_optimization": {"reduce_bucket_size": 5000000, "allgather_bucket_size": 5000000,
                       "prefetch_bucket_size": 5000000, "max_live_parameters": 20000000, "max_reuse_distance": 0},
 "training": {"steps": 2, "save_interval": 1, "peak_gflops": 100}}
JSON
NVME=(--set zero_optimization.offload_optimizer.device=nvme --set "zero_optimization.offload_optimizer.nvme_path=$SWAP"
      --set zero_optimization.offload_param.device=nvme --set "zero_optimization.offload_param.nvme_path=$SWAP"
      --set zero_optimization.sub_group_size=5000000 --set zero_optimization.offload_param.max_in_cpu=5000000)
printf "%-5s %-4s %-5s %-4s %-5s %12s %12s %7s\n" dtype T stage AC nvme "predicted MB" "measured MB" ratio
fails=0
for dtype in fp32 bf16 fp16; do
  for T in 256 512; do
    for case in "0 no no" "0 yes no" "3 no no" "3 yes no" "3 no yes" "3 yes yes"; do
      set -- $case
      stage=$1 ac=$2 nvme=$3
      args=(--set zero_optimization.stage="$stage" --set model.n_positions="$T")
      [ "$dtype" != fp32 ] && args+=(--set "$dtype.enabled=true")
      [ "$ac" = yes ] && args+=(--set pipeline.activation_checkpoint_interval=1)
      [ "$nvme" = yes ] && args+=("${NVME[@]}")
      run="$DIR/${dtype}_T${T}_z${stage}_ac${ac}_nvme${nvme}"
      [[ "$(basename "$run")" =~ ${CASES:-.} ]] || continue
      rm -rf "$run"
      mpirun -np "$NP" "$EXE" train "$DIR/est.json" "${args[@]}" --output "$run" > "$run.log" 2>&1 ||
        { echo "run failed: $run.log"; tail -3 "$run.log"; fails=$((fails + 1)); continue; }
      "$EXE" estimate --config "$DIR/est.json" --world-size "$NP" "${args[@]}" --json > "$run/estimate.json"
      python3 - "$run" "$dtype" "$T" "$stage" "$ac" "$nvme" <<'PY' || fails=$((fails + 1))
import json, sys
d, dtype, T, stage, ac, nvme = sys.argv[1:]
plan = [json.loads(l) for l in open(d + "/metrics.jsonl")][-1]["memory_plan"]
estimate = json.load(open(d + "/estimate.json"))["budgets"][int(stage)]["total"]
assert estimate == plan["predicted_peak_bytes"], (estimate, plan)  # estimate --config is the start-up plan
ratio = estimate / plan["measured_peak_bytes"]
print(f"{dtype:<5} {T:<4} {stage:<5} {ac:<4} {nvme:<5} {estimate/1e6:12.1f} {plan['measured_peak_bytes']/1e6:12.1f} {ratio:7.3f}"
      + ("" if 0.93 <= ratio <= 1.07 else "  outside 0.93-1.07"))
sys.exit(0 if 0.93 <= ratio <= 1.07 else 1)
PY
      # keep the figures, not the checkpoints (two saves of each run)
      find "$run" -mindepth 1 -maxdepth 1 ! -name metrics.jsonl ! -name estimate.json -exec rm -rf {} +
    done
  done
done
rm -rf "$SWAP"
echo "$fails outside 0.93-1.07 or failed"
[ "$fails" = 0 ]

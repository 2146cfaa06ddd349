#!/usr/bin/env bash
# zero3d estimate --config against the measured peak resident memory (metrics.jsonl
# peak_rss_bytes) of real runs: a 57M-parameter GPT at several stages and world sizes.
# Usage: benchmarks/estimate_vs_measured.sh [WORKDIR]
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-output/estimate_vs_measured}
mkdir -p "$DIR"
export OPENBLAS_NUM_THREADS=1
cat > "$DIR/est.json" <<'JSON'
{"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
 "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
 "model": {"vocab_size": 256, "n_positions": 16, "n_layer": 8, "n_head": 4, "n_embd": 768},
 "zero_optimization": {"reduce_bucket_size": 2000000, "allgather_bucket_size": 2000000,
                       "max_live_parameters": 8000000, "max_reuse_distance": 0, "overlap_comm": false},
 "training": {"steps": 2, "peak_gflops": 100}}
JSON
export OMP_NUM_THREADS=1
printf "%-4s %-6s %-6s %14s %14s %8s\n" np stage dtype "estimate MB" "measured MB" ratio
for cfg in "1 0 fp32" "2 0 fp32" "2 1 fp32" "2 2 fp32" "2 3 fp32" "4 2 fp32" "4 3 fp32" "1 3 fp32" \
           "1 0 bf16" "2 1 bf16" "2 2 bf16" "2 3 bf16" "1 3 bf16" "2 2 fp16"; do
  set -- $cfg
  run="$DIR/np$1_s$2_$3"
  dtype=()
  [ "$3" != fp32 ] && dtype=(--set "$3.enabled=true")
  mpirun -np "$1" build/zero3d train "$DIR/est.json" --set zero_optimization.stage="$2" "${dtype[@]}" --output "$run" > /dev/null
  build/zero3d estimate --config "$DIR/est.json" --world-size "$1" "${dtype[@]}" --json > "$run/estimate.json"
  python3 - "$run" "$1" "$2" "$3" <<'PY'
import json, sys
d, np, stage, dtype = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
measured = [json.loads(l) for l in open(d + "/metrics.jsonl")][-1]["peak_rss_bytes"]
estimate = json.load(open(d + "/estimate.json"))["budgets"][stage]["total"]
print(f"{np:<4} {stage:<6} {dtype:<6} {estimate/1e6:14.1f} {measured/1e6:14.1f} {estimate/measured:8.3f}")
PY
done

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
printf "%-4s %-6s %14s %14s %8s\n" np stage "estimate MB" "measured MB" ratio
for cfg in "1 0" "2 0" "2 1" "2 2" "2 3" "4 2" "4 3" "1 3"; do
  set -- $cfg
  mpirun -np "$1" build/zero3d train "$DIR/est.json" --set zero_optimization.stage="$2" --output "$DIR/np$1_s$2" > /dev/null
  build/zero3d estimate --config "$DIR/est.json" --world-size "$1" --json > "$DIR/np$1_s$2/estimate.json"
  python3 - "$DIR/np$1_s$2" "$1" "$2" <<'PY'
import json, sys
d, np, stage = sys.argv[1], sys.argv[2], int(sys.argv[3])
measured = [json.loads(l) for l in open(d + "/metrics.jsonl")][-1]["peak_rss_bytes"]
estimate = json.load(open(d + "/estimate.json"))["budgets"][stage]["total"]
print(f"{np:<4} {stage:<6} {estimate/1e6:14.1f} {measured/1e6:14.1f} {estimate/measured:8.3f}")
PY
done

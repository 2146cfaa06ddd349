#!/usr/bin/env bash
# Pipeline schedules against data parallelism on gpt-small-cpu deepened to 12 layers (so that
# stages balance), global batch 16: tokens/s, step time and each stage's measured idle share
# next to the schedule's bubble formula. Steps after the first (cache warm-up) are averaged.
# Usage: benchmarks/pipeline_speed.sh [NP] [STEPS] [WORKDIR]   (NP 2 on this 2-core machine)
set -euo pipefail
cd "$(dirname "$0")/.."
NP=${1:-2}
STEPS=${2:-12}
DIR=${3:-output/pipeline_speed}
mkdir -p "$DIR"
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
common=(--set model.n_layer=12 --set train_batch_size=16 --set training.steps="$STEPS" --set steps_per_print=1000
        --set zero_optimization.overlap_comm=true)
run() {  # name, then extra arguments
  local name=$1; shift
  rm -rf "${DIR:?}/$name"
  mpirun -np "$NP" build/zero3d train input/gpt-small-cpu.json "${common[@]}" "$@" --output "$DIR/$name" \
    > "$DIR/$name.log"
}
mb=$((16 / 8))  # 8 micro-batches per step in every pipeline run
run data_parallel --set train_micro_batch_size_per_gpu=$((16 / NP)) --set gradient_accumulation_steps=1
run 1f1b --set pipeline.stages="$NP" --set train_micro_batch_size_per_gpu=$mb --set gradient_accumulation_steps=8
run zb-h1 --set pipeline.stages="$NP" --set pipeline.schedule=zb-h1 --set train_micro_batch_size_per_gpu=$mb \
  --set gradient_accumulation_steps=8
run interleaved --set pipeline.stages="$NP" --set pipeline.schedule=interleaved --set pipeline.virtual_stages=2 \
  --set train_micro_batch_size_per_gpu=$mb --set gradient_accumulation_steps=8
python3 - "$DIR" <<'PY'
import json, sys
d = sys.argv[1]
def rows(name):
    return [json.loads(l) for l in open(f"{d}/{name}/metrics.jsonl")][1:]
base = None
for name in ("data_parallel", "1f1b", "zb-h1", "interleaved"):
    r = rows(name)
    tps = sum(x["tokens_per_s"] for x in r) / len(r)
    ms = sum(x["elapsed_ms"] for x in r) / len(r)
    base = base or tps
    line = f"{name:14s} {tps:8.0f} tokens/s  {ms:7.1f} ms/step  ({tps / base:.2f}x data parallel)"
    if "pipeline" in r[-1]:
        b = r[-1]["pipeline"]["bubble_fraction"]
        idle = [sum(x["pipeline"]["bubble_fraction"]["measured"][s] for x in r) / len(r) for s in range(len(b["measured"]))]
        line += "  bubble formula %.3f, measured per stage %s" % (b["formula"], ", ".join("%.3f" % i for i in idle))
    print(line)
PY

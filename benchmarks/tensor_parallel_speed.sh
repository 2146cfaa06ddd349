#!/usr/bin/env bash
# Tensor parallelism on gpt-small-cpu (V=256, T=256, L=6, H=6, C=384), global batch 16 in
# micro-batches of 8: tokens/s at t = NP against NP data-parallel ranks, the bytes the tensor
# axis moved per step against Megatron's count (4 all-reduces of B·T·C per layer, plus the
# embedding, the head's input gradient and the cross-entropy's three row reductions), the
# step-time share spent in tensor communication, and activation bytes with and without
# sequence parallelism. Steps after the first (cache warm-up) are averaged.
# Usage: benchmarks/tensor_parallel_speed.sh [NP] [STEPS] [WORKDIR]   (NP 2 on this 2-core machine)
set -euo pipefail
cd "$(dirname "$0")/.."
NP=${1:-2}
STEPS=${2:-8}
DIR=${3:-output/tensor_parallel_speed}
mkdir -p "$DIR"
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
common=(--set train_batch_size=16 --set training.steps="$STEPS" --set steps_per_print=1000 --set wall_clock_breakdown=true)
run() {  # name, then extra arguments
  local name=$1; shift
  rm -rf "${DIR:?}/$name"
  mpirun -np "$NP" build/zero3d train input/gpt-small-cpu.json "${common[@]}" "$@" --output "$DIR/$name" > "$DIR/$name.log"
}
run data_parallel --set train_micro_batch_size_per_gpu=$((16 / NP)) --set gradient_accumulation_steps=1
run tensor --set tensor_parallel.autotp_size="$NP" --set train_micro_batch_size_per_gpu=8 --set gradient_accumulation_steps=2
run tensor_overlap --set tensor_parallel.autotp_size="$NP" --set tensor_parallel.tp_overlap_comm=true \
  --set train_micro_batch_size_per_gpu=8 --set gradient_accumulation_steps=2
run tensor_sp --set tensor_parallel.autotp_size="$NP" --set tensor_parallel.sequence_parallel=true \
  --set train_micro_batch_size_per_gpu=8 --set gradient_accumulation_steps=2
python3 - "$DIR" "$NP" <<'PY'
import json, sys
d, t = sys.argv[1], int(sys.argv[2])
B, T, C, L, V, micro = 8, 256, 384, 6, 256, 2
BT = B * T
megatron = micro * ((4 * L + 2) * BT * C + 3 * BT) * 4 * 2 * (t - 1) / t
def rows(name):
    return [json.loads(l) for l in open(f"{d}/{name}/metrics.jsonl")][1:]
base = None
for name in ("data_parallel", "tensor", "tensor_overlap", "tensor_sp"):
    r = rows(name)
    tps = sum(x["tokens_per_s"] for x in r) / len(r)
    base = base or tps
    tensor = r[-1]["comm_bytes_by_axis"]["tensor"]
    share = sum(x["time_ms"]["tensor_comm"] for x in r) / sum(x["elapsed_ms"] for x in r)
    line = f"{name:15s} {tps:8.0f} tokens/s ({tps / base:.2f}x data parallel)  activations {r[-1]['memory']['activations'] / 1e6:7.1f} MB"
    if tensor:
        line += f"  tensor comm {100 * share:4.1f}% of the step, {tensor / 1e6:8.2f} MB/step"
        if name != "tensor_sp":
            line += f" (Megatron's count {megatron / 1e6:.2f} MB)"
    print(line)
PY

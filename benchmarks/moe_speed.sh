#!/usr/bin/env bash
# Mixture of Experts (issue 15) on gpt-small-cpu's width (C=384, T=256, micro-batch 8, V=256):
# an 8-expert top-2 GPT with an MoE MLP in every other block (GShard), L=6, at np 2 with the
# experts split over both ranks (ep 2), against the dense GPT of the same active parameters
# per token (MoE blocks 4C²+2·8C², dense blocks 12C²: L=8 dense blocks carry what the 6 do).
# Reports tokens/s, MFU (active-parameter FLOPs), and the all-to-all bytes per step next to
# the formula: 4 exchanges (dispatch and return, forward and backward) of every kept choice
# routed to the other expert rank, C·4 bytes each, (ep-1)/ep of them under uniform routing.
# Steps after the first (cache warm-up) are averaged.
# Usage: benchmarks/moe_speed.sh [STEPS] [WORKDIR]   (ZERO3D: the executable, default build/zero3d)
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${1:-6}
DIR=${2:-output/moe_speed}
ZERO3D=${ZERO3D:-build/zero3d}
mkdir -p "$DIR"
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
common=(--set train_batch_size=16 --set train_micro_batch_size_per_gpu=8 --set training.steps="$STEPS"
        --set steps_per_print=1000)
run() {  # name, then extra arguments
  local name=$1; shift
  rm -rf "${DIR:?}/$name"
  mpirun -np 2 "$ZERO3D" train input/gpt-small-cpu.json "${common[@]}" "$@" --output "$DIR/$name" > "$DIR/$name.log"
}
run moe_8x_top2_ep2 --set model.moe.num_experts=8 --set model.moe.k=2 --set model.moe.every=2 --set model.moe.ep_size=2
run dense_same_active --set model.n_layer=8
python3 - "$DIR" <<'PY'
import json, sys
d = sys.argv[1]
C, ep = 384, 2
def rows(name):
    return [json.loads(l) for l in open(f"{d}/{name}/metrics.jsonl")][1:]
moe, dense = rows("moe_8x_top2_ep2"), rows("dense_same_active")
avg = lambda r, k: sum(x[k] for x in r) / len(r)
for name, r in (("moe 8x top-2 ep 2", moe), ("dense, same active", dense)):
    print(f"{name:20s} {avg(r, 'tokens_per_s'):8.0f} tokens/s  MFU {100 * avg(r, 'mfu'):5.1f}%  "
          f"{avg(r, 'elapsed_ms'):7.1f} ms/step")
print(f"moe / dense tokens/s: {avg(moe, 'tokens_per_s') / avg(dense, 'tokens_per_s'):.2f}")
# All-to-all bytes of rank 0 per step against the formula from its kept choices (the whole data
# group's choices are counted in the metrics; rank 0 sends half of them).
for x in moe[:3]:
    kept = sum(sum(l["tokens_per_expert"]) * (1 - l["dropped_fraction"]) for l in x["moe"])
    formula = 4 * (kept / ep) * (ep - 1) / ep * C * 4
    measured = x["comm_bytes_by_axis"]["expert"]
    drop = sum(l["dropped_fraction"] for l in x["moe"]) / len(x["moe"])
    print(f"step {x['step']}: all-to-all {measured / 1e6:.2f} MB, formula {formula / 1e6:.2f} MB "
          f"(ratio {measured / formula:.3f}), dropped {100 * drop:.1f}%")
PY

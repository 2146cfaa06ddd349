#!/usr/bin/env bash
# Communication-efficient training (issue 34): the bytes each mode moves per step on 4 ranks in
# 2 emulated nodes (ZERO3D_RANKS_PER_NODE=2), gpt-small-cpu, against `zero3d estimate --config`'s
# prediction of the same step (comm_volume.hpp); then an α–β time model built from the measured
# intra-node link (benchmarks/bench_comm.cpp) and INTER_GBPS inter-node (25 GB/s by default)
# predicts each mode's step time on 2–64 nodes of RANKS_PER_NODE ranks (8 by default), with
# the compute time of a step measured on one rank (the per-rank work of data parallelism).
# Model: t = compute + Σ_groups calls·(W−1)·α + bytes/β_link (no overlap: an upper bound).
# The uncompressed peers (AdamW at ZeRO-0, ZeRO-3) come from the same run. 0/1 Adam's bytes change
# with its phase: it runs 8 steps with short intervals, every phase of §5.4 among them, and each
# step is printed against the estimate of that step (`estimate --step S`); a mode's time model
# averages its steady phases over the steps measured (`estimate --step-range`; a 1-bit
# optimizer's initialisation step and warm-up left out).
# Usage: benchmarks/comm_efficiency.sh [BUILD_DIR] [WORKDIR]  (MODES_ONLY="adamw_zero0 zero_one_adam": a subset;
# REPORT_ONLY=1: print again from WORKDIR's runs, e.g. with another INTRA_GBPS, running nothing)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
DIR=${2:-output/comm_efficiency}
INTER_GBPS=${INTER_GBPS:-25}
RANKS_PER_NODE=${RANKS_PER_NODE:-8}
INTRA_GBPS=${INTRA_GBPS:-measured}  # a number (e.g. an NVLink node's bus bandwidth) replaces the measured link
mkdir -p "$DIR"
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
BASE=(--set train_micro_batch_size_per_gpu=1 --set train_batch_size=4)
S3=(--set zero_optimization.stage=3)
declare -A MODES=(
  [adamw_zero0]=""
  [onebit_adam]="--set optimizer.type=OneBitAdam --set optimizer.params.freeze_step=2"
  [onebit_lamb]="--set optimizer.type=OneBitLamb --set optimizer.params.freeze_step=2"
  [zero_one_adam]="--set optimizer.type=ZeroOneAdam --set optimizer.params.var_freeze_step=3 --set optimizer.params.var_update_scaler=1 --set optimizer.params.local_step_scaler=1 --set optimizer.params.local_step_clipper=4"
  [zero3]="${S3[*]}"
  [mics2]="${S3[*]} --set zero_optimization.mics_shard_size=2"
  [mics4_hierarchical]="${S3[*]} --set zero_optimization.mics_shard_size=4 --set zero_optimization.mics_hierarchical_params_gather=true"
  [hpz2]="${S3[*]} --set zero_optimization.zero_hpz_partition_size=2"
  [zeropp_qwz]="${S3[*]} --set zero_optimization.zero_quantized_weights=true"
  [zeropp_qwz_hpz2]="${S3[*]} --set zero_optimization.zero_quantized_weights=true --set zero_optimization.zero_hpz_partition_size=2"
  [zeropp_qgz]="${S3[*]} --set zero_optimization.zero_quantized_gradients=true"
  [zeropp_qwz_hpz2_qgz]="${S3[*]} --set zero_optimization.zero_quantized_weights=true --set zero_optimization.zero_hpz_partition_size=2 --set zero_optimization.zero_quantized_gradients=true"
  [zeropp_qgz_loco]="${S3[*]} --set zero_optimization.zero_quantized_gradients=true --set zero_optimization.zeropp_loco_param.err_beta=0.8"
)
declare -A STEPS=([zero_one_adam]=8)
ORDER=(adamw_zero0 onebit_adam onebit_lamb zero_one_adam zero3 mics2 mics4_hierarchical hpz2 zeropp_qwz zeropp_qwz_hpz2
       zeropp_qgz zeropp_qwz_hpz2_qgz zeropp_qgz_loco)
if [[ -n "${MODES_ONLY:-}" ]]; then read -r -a ORDER <<< "$MODES_ONLY"; fi
for mode in "${ORDER[@]}"; do
  [[ -n "${REPORT_ONLY:-}" ]] && break
  # shellcheck disable=SC2086
  args=("${BASE[@]}" ${MODES[$mode]})
  steps=${STEPS[$mode]:-4}
  ZERO3D_RANKS_PER_NODE=2 mpirun -np 4 "$BUILD/zero3d" train input/gpt-small-cpu.json "${args[@]}" \
    --set training.steps=$steps --output "$DIR/$mode" > "$DIR/$mode.log" 2>&1
  for s in $(seq 1 "$steps"); do  # each measured step's own estimate (the last is the table's)
    "$BUILD/zero3d" estimate --config input/gpt-small-cpu.json "${args[@]}" --world-size 4 --ranks-per-node 2 \
      --step "$s" --step-range "1-$steps" --json > "$DIR/$mode.estimate.step$s.json"
  done
  cp "$DIR/$mode.estimate.step$steps.json" "$DIR/$mode.estimate.json"
  for nodes in 2 4 8 16 32 64; do
    world=$((nodes * RANKS_PER_NODE))  # one micro-batch of 1 per rank, as measured
    "$BUILD/zero3d" estimate --config input/gpt-small-cpu.json "${args[@]}" --set train_batch_size=$world \
      --world-size $world --ranks-per-node "$RANKS_PER_NODE" --step-range "1-$steps" --json \
      > "$DIR/$mode.estimate.n$nodes.json"
  done
done
if [[ -z "${REPORT_ONLY:-}" ]]; then
  "$BUILD/zero3d" train input/gpt-small-cpu.json "${BASE[@]}" --set train_batch_size=1 --set training.steps=6 \
    --output "$DIR/compute" > "$DIR/compute.log" 2>&1
  mpirun -np 2 "$BUILD/benchmarks/zero3d_comm_bench" --benchmark_filter='^all_reduce/communicator/(1024|67108864)/' \
    --benchmark_format=json > "$DIR/link.json" 2> "$DIR/link.err"
fi
python3 - "$DIR" "$INTER_GBPS" "$RANKS_PER_NODE" "$INTRA_GBPS" "${ORDER[@]}" <<'PY'
import json, statistics, sys
d, inter_gbps, per_node, intra_given, modes = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5:]
rows = lambda m: [json.loads(l) for l in open(f"{d}/{m}/metrics.jsonl")]
link = {b["run_name"].split("/")[2]: b for b in json.load(open(f"{d}/link.json"))["benchmarks"]
        if b.get("aggregate_name") == "median"}
alpha = link["1024"]["real_time"] * 1e-6 / 2  # seconds; a 1 KiB all-reduce on 2 ranks is 2 ring steps
beta_intra = link["67108864"]["busbw_GB/s"] * 1e9
measured_intra = beta_intra
if intra_given != "measured":
    beta_intra = float(intra_given) * 1e9
beta_inter = inter_gbps * 1e9
compute = statistics.median(r["elapsed_ms"] for r in rows("compute")[1:]) / 1e3
print(f"links: intra-node {beta_intra / 1e9:.2f} GB/s bus bandwidth ("
      + ("measured: all_reduce 64 MiB, np 2, this machine" if intra_given == "measured"
         else f"INTRA_GBPS; measured here {measured_intra / 1e9:.2f}")
      + f"), α {alpha * 1e6:.1f} us per ring step (all_reduce 1 KiB, np 2); inter-node {inter_gbps:g} GB/s, same α")
print(f"compute per step on one rank (gpt-small-cpu, micro-batch 1): {compute * 1e3:.1f} ms")
print("\nbytes per step, rank 0, 4 ranks in 2 emulated nodes (measured = last step; estimate = zero3d estimate --config)")
print(f"{'mode':<20} {'inter measured':>15} {'inter estimate':>15} {'intra measured':>15} {'intra estimate':>15}  vs AdamW inter")
adamw = None
for m in modes:
    last = rows(m)[-1]["comm_bytes_by_link"]
    est = json.load(open(f"{d}/{m}.estimate.json"))
    e = est["optimizer_communication"]["communication"]["comm_bytes_by_link"]  # the last step's
    adamw = adamw or last["inter_node"]
    ok = "" if (e["inter_node"], e["intra_node"]) == (last["inter_node"], last["intra_node"]) else "  MISMATCH"
    print(f"{m:<20} {last['inter_node']:>15,} {e['inter_node']:>15,} {last['intra_node']:>15,} {e['intra_node']:>15,}"
          f"  {adamw / max(1, last['inter_node']):6.1f}x fewer{ok}")
for m in modes:  # a mode whose bytes change by step: each step measured against its own estimate
    per_step = [json.load(open(f"{d}/{m}.estimate.step{s}.json"))["optimizer_communication"]
                for s in range(1, len(rows(m)) + 1)]
    if len({p["phase"] for p in per_step}) < 2:
        continue
    print(f"\n{m} step by step (measured = that step's metrics.jsonl row; AdamW inter-node {adamw:,} per step)")
    print(f"{'step':>4} {'phase':<26} {'inter measured':>15} {'inter estimate':>15} {'intra measured':>15} {'intra estimate':>15}")
    for s, (row, p) in enumerate(zip(rows(m), per_step), 1):
        got, e = row["comm_bytes_by_link"], p["communication"]["comm_bytes_by_link"]
        ok = "" if got == e else "  MISMATCH"
        print(f"{s:>4} {p['phase']:<26} {got['inter_node']:>15,} {e['inter_node']:>15,} {got['intra_node']:>15,}"
              f" {e['intra_node']:>15,}{ok}")
    r = per_step[0]["range"]
    print(f"average over steps {r['first']}-{r['last']}: inter-node {r['average_bytes_by_link']['inter_node']:,.0f} "
          f"per step, {adamw / max(1, r['average_bytes_by_link']['inter_node']):.1f}x fewer than AdamW")
def step_time(v):
    # β of each link for its bytes; α for each ring step of each group's collectives
    t = v["comm_bytes_by_link"]["intra_node"] / beta_intra + v["comm_bytes_by_link"]["inter_node"] / beta_inter
    ranks = v["ranks_by_group"]
    return t + alpha * sum(calls * max(0, ranks[g] - 1) for g, calls in v["collectives_by_group"].items())
def predicted(m, nodes):
    # the steady phases of the measured steps, each weighted by its steps (one phase for most
    # modes; a 1-bit optimizer's initialisation step and warm-up are left out, as a long run would)
    r = json.load(open(f"{d}/{m}.estimate.n{nodes}.json"))["optimizer_communication"]["range"]
    steady = [p for p in r["phases"] if p["phase"] not in ("initialisation", "warm-up")]
    return compute + sum(p["steps"] * step_time(p) for p in steady) / sum(p["steps"] for p in steady)
print(f"\npredicted step time (ms), nodes of {per_node} ranks, {inter_gbps:g} GB/s between nodes (α–β model)")
print(f"{'mode':<20}" + "".join(f"{n:>10} nodes" for n in (2, 4, 8, 16, 32, 64)))
for m in modes:
    print(f"{m:<20}" + "".join(f"{predicted(m, n) * 1e3:>16.1f}" for n in (2, 4, 8, 16, 32, 64)))
PY

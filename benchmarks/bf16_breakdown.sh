#!/usr/bin/env bash
# Where a bf16 training step's time goes, kernel by kernel (issue 17). Two runs of the same
# model with the Kokkos Tools kernel timer (benchmarks/kernel_timer.cpp: thread CPU time, so a
# loaded machine moves the figures little), S1 and S2 steps; their difference divided by
# S2 - S1 is one steady step without start-up or first-step warm-up. Then the kernel benchmark
# at gpt-small-cpu's shapes gives each kernel's rate against its own limit: GFLOP/s against
# the 512³ bf16 product (what zero3d's MFU peak measures), GB/s against a plain copy.
# Usage: benchmarks/bf16_breakdown.sh [BUILD_DIR] [CONFIG] [WORKDIR] [--set KEY=VALUE ...]
# (one rank, 1 BLAS thread; the --set arguments go to both runs)
# SKIP_BENCH=1 prints the step's table only; ZERO3D_ATTENTION_KERNEL=tiled runs the tiled bf16
# attention instead of the fused one (A/B pairs in one binary); DTYPE=fp16 or fp32 times the same
# step in that precision. On a GPU (benchmarks/gpu_check.sh): ZERO3D and TIMER name the binary
# and the timer library where they are not under BUILD_DIR, and ZERO3D_KERNEL_TIMER_CLOCK=wall
# times each kernel's device work (kernel_timer.cpp).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
CONFIG=${2:-input/gpt-small-cpu.json}
DIR=${3:-output/bf16_breakdown}
S1=${S1:-2}
S2=${S2:-8}
DTYPE=${DTYPE:-bf16}
ZERO3D=${ZERO3D:-$BUILD/zero3d}
TIMER=${TIMER:-$BUILD/benchmarks/libzero3d_kernel_timer.so}
sets=("${@:4}")
precision=()
[ "$DTYPE" != fp32 ] && precision=(--set "$DTYPE.enabled=true")
mkdir -p "$DIR"
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
for steps in "$S1" "$S2"; do
  KOKKOS_PROFILE_LIBRARY="$TIMER" ZERO3D_KERNEL_TIMER_OUT="$DIR/timer_s$steps" \
    "$ZERO3D" train "$CONFIG" "${precision[@]}" "${sets[@]}" --set training.steps="$steps" --output "$DIR/run_s$steps" \
    > "$DIR/run_s$steps.log" 2>&1
done
python3 - "$DIR/timer_s$S1.0.tsv" "$DIR/timer_s$S2.0.tsv" $((S2 - S1)) "$CONFIG" "$DTYPE" \
  "${ZERO3D_KERNEL_TIMER_CLOCK:-cpu}" <<'PY'
import csv, sys
def load(path):
    return {r["name"]: (int(r["calls"]), float(r["exclusive_ms"])) for r in csv.DictReader(open(path), delimiter="\t")}
a, b, steps = load(sys.argv[1]), load(sys.argv[2]), float(sys.argv[3])
rows = [(k, (b[k][0] - a.get(k, (0, 0))[0]) / steps, (b[k][1] - a.get(k, (0, 0))[1]) / steps) for k in b]
# Start-up allocations (first-touch zeroing of the big buffers) vary from run to run by
# seconds; they are no part of a step, so they leave both the total and the table.
startup = sum(ms for k, _, ms in rows if k.startswith("Kokkos::View::init"))
step = next(ms for k, _, ms in rows if k == "(process)") - startup
rows = sorted((r for r in rows if r[0] != "(process)" and not r[0].startswith("Kokkos::View::init")), key=lambda r: -r[2])
named = sum(ms for _, _, ms in rows)
groups = {"products": ("gemm_",), "attention": ("attention_",), "casts": ("convert",),
          "optimizer": ("adam", "lion", "adagrad", "sgd", "lamb", "sum_of_squares", "scale_in_place", "Kokkos::ViewFill")}
clock = ("ms per step (wall clock, the device fenced around each kernel)" if sys.argv[6] == "wall"
         else "ms of CPU per step")
print(f"{sys.argv[5]} step of {sys.argv[4]}, one rank: {step:.1f} {clock} (steady state)\n")
print(f"{'kernel':<34}{'calls':>8}{'ms/step':>10}{'share':>8}")
for name, calls, ms in rows:
    if ms >= 0.05:
        print(f"{name[:34]:<34}{calls:>8.0f}{ms:>10.2f}{100 * ms / step:>7.1f}%")
print(f"{'(outside named kernels)':<34}{'':>8}{step - named:>10.2f}{100 * (step - named) / step:>7.1f}%")
print()
for g, prefixes in groups.items():
    ms = sum(m for n, _, m in rows if n.startswith(prefixes))
    print(f"  {g:<12}{ms:>8.1f} ms  {100 * ms / step:5.1f}%")
PY
[ -n "${SKIP_BENCH:-}" ] && exit 0
echo
echo "Each kernel's rate at gpt-small-cpu's shapes (B=8, T=256, C=384), against its limit:"
"$BUILD/benchmarks/zero3d_bench" --benchmark_min_time=0.2 \
  --benchmark_filter='GemmBf16/512/|GemmBf16/2048/1152|LinearTrainingProducts/.*/1$|AttentionForward/1|AttentionBackward/1|LayerNorm|Gelu|Convert|CopyStream|AdamW' 2>&1 |
  grep -E '^BM_'

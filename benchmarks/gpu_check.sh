#!/bin/sh
# gpu_check.sh — the GPU issue's check on a lent GPU machine, as one prepared run from the
# repository root with gpu-carry.tar.xz beside it (benchmarks/gpu_bundle.sh): the device, the
# `gpu` label's tests (kernels at GPT-2 124M shapes against host references; training against
# the CPU build's losses, run-to-run identity, np 2 sharing the GPU, a checkpoint resumed on the
# CPU), the per-kernel table, and GPT-2 124M throughput (micro-batch 16, T 1024) in bf16 and
# fp32. Every result goes under $OUT (default /tmp/gpu-check); a failing part does not stop
# the rest. Budget: about 6 minutes on an H100/H200.
set -u
out=${OUT:-/tmp/gpu-check}
mkdir -p "$out"
root=$(pwd)
carry=$(mktemp -d)
tar -C "$carry" -xJf gpu-carry.tar.xz
bin=$carry/gpu-carry/bin
export LD_LIBRARY_PATH="$carry/gpu-carry/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
export PATH="$bin:$PATH"
export OPENBLAS_NUM_THREADS=1
export ZERO3D_TEST_EXE="$bin/zero3d" ZERO3D_TEST_MPIEXEC="$bin/mpiexec.hydra" ZERO3D_TEST_SOURCE_DIR="$root"
[ -x "$bin/zero3d-cpu" ] && export ZERO3D_CPU_EXE="$bin/zero3d-cpu"

step() {  # step NAME SECONDS COMMAND...: runs it with a time limit, its output in $out/NAME.txt
  name=$1 limit=$2
  shift 2
  start=$(date +%s)
  timeout "$limit" "$@" >"$out/$name.txt" 2>&1
  rc=$?
  echo "$name: exit $rc after $(($(date +%s) - start)) s" | tee -a "$out/summary.txt"
}

step device 30 sh -c 'nvidia-smi; zero3d --version'
step gpu_tests 300 zero3d_gpu_tests --gtest_output="json:$out/gpu_tests.json"
step kernels 150 zero3d_device_bench --benchmark_counters_tabular=true --benchmark_min_time=0.2s \
  --benchmark_out="$out/kernels.json"
for precision in bf16 fp32; do
  set -- --set train_micro_batch_size_per_gpu=16 --set training.steps=12 --set steps_per_print=4
  [ "$precision" = bf16 ] && set -- "$@" --set bf16.enabled=true
  step "gpt2_124m_$precision" 120 zero3d train "$root/input/gpt2-124m.json" --output "$out/gpt2_124m_$precision" "$@"
done
# tokens/s of the last steps (the first ones include cuBLASLt's heuristics and allocations)
for precision in bf16 fp32; do
  f=$out/gpt2_124m_$precision/metrics.jsonl
  [ -f "$f" ] && /usr/bin/env python3 -c "
import json, sys
rows = [json.loads(l) for l in open('$f')][4:]
print('gpt2_124m_$precision: %.0f tokens/s, mfu %.3f over steps 5-%d' % (
    sum(r['tokens_per_s'] for r in rows) / len(rows), sum(r.get('mfu', 0) for r in rows) / len(rows), 4 + len(rows)))
" | tee -a "$out/summary.txt"
done
cat "$out/summary.txt"

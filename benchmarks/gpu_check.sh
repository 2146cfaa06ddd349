#!/bin/sh
# gpu_check.sh — the GPU issue's check on a lent GPU machine, as one prepared run from the
# repository root with gpu-carry.tar.xz beside it (benchmarks/gpu_bundle.sh): the device, the
# `gpu` label's tests (kernels at GPT-2 124M shapes against host references; training against
# the CPU build's losses, run-to-run identity, np 2 sharing the GPU, checkpoints crossing to and
# from the CPU, offload, sparse attention, MoE, generation; the Llama family's kernels and
# training likewise), GPT-2 124M and Llama 125M throughput (micro-batch 16, T 1024) in bf16 and
# fp32 with PyTorch's on the same GPU, the per-kernel table, profiles and generation speed.
#
# Device time is short and a machine goes back soon after a call, so the steps run in the order
# of what matters most (a training step that works, the headline figures, their peer and where
# the step's time goes, the checks no device has run yet, then the rest), each within its own limit and within
# GPU_CHECK_BUDGET seconds in all (default: no overall limit): a step that would start with
# under 15 s left is skipped and says so. Results go under $OUT (default /tmp/gpu-check) as
# they come: summary.txt line by line and results.tar.gz (every step's output) after each step,
# so a run stopped from outside still returns what it did. A failing step does not stop the rest.
# GPU_CHECK_PARTS="smoke gpt2_124m_bf16 ...": only the steps named (a rerun).
set -u
final=${OUT:-/tmp/gpu-check}
mkdir -p "$final"
summary=$final/summary.txt
: >"$summary"
out=$(mktemp -d)
root=$(pwd)
carry=$(mktemp -d)
tar -C "$carry" -xJf gpu-carry.tar.xz
bin=$carry/gpu-carry/bin
export LD_LIBRARY_PATH="$carry/gpu-carry/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
export PATH="$bin:$PATH"
export OPENBLAS_NUM_THREADS=1
export ZERO3D_TEST_EXE="$bin/zero3d" ZERO3D_TEST_MPIEXEC="$bin/mpiexec.hydra" ZERO3D_TEST_SOURCE_DIR="$root"
[ -x "$bin/zero3d-cpu" ] && export ZERO3D_CPU_EXE="$bin/zero3d-cpu"
began=$(date +%s)
budget=${GPU_CHECK_BUDGET:-1000000}

note() { echo "$*" | tee -a "$summary"; }
save() { tar -C "$out" --exclude='*.h5' --exclude='checkpoints' -czf "$final/results.tar.gz" . 2>/dev/null; }
ran() { grep -q "^$1: exit 0 after" "$summary"; }

step() {  # step NAME SECONDS COMMAND...: runs it within its limit and the budget's rest, output in $out/NAME.txt
  name=$1 limit=$2
  shift 2
  case "$name" in
    *_blocking | *_memcheck) ;;  # a diagnosis, run only where the step it diagnoses ran and failed
    *) case " ${GPU_CHECK_PARTS:-all} " in *" all "* | *" $name "*) ;; *) return 0 ;; esac ;;
  esac
  left=$((budget - ($(date +%s) - began)))
  if [ "$left" -lt 15 ]; then
    note "$name: skipped, ${left} s of the budget left"
    return 0
  fi
  [ "$left" -lt "$limit" ] && limit=$left
  start=$(date +%s)
  timeout -k 5 "$limit" "$@" >"$out/$name.txt" 2>&1
  rc=$?
  note "$name: exit $rc after $(($(date +%s) - start)) s"
  save
}

# tokens/s, MFU and the last loss of a training run's steps 5 on (the first ones include
# cuBLASLt's heuristics and the allocations)
throughput() {
  f=$out/$1/metrics.jsonl
  [ -f "$f" ] && /usr/bin/env python3 -c "
import json, sys
rows = [json.loads(l) for l in open('$f')]
tail = rows[4:]
if not tail: sys.exit('$1: fewer than 5 steps in metrics.jsonl')
print('$1: %.0f tokens/s, mfu %.3f over steps 5-%d; loss %.6f at step %d' % (
    sum(r['tokens_per_s'] for r in tail) / len(tail), sum(r.get('mfu', 0) for r in tail) / len(tail),
    4 + len(tail), rows[-1]['loss'], rows[-1]['step']))
" 2>&1 | tee -a "$summary"
  # the device's measured peak beside the plan's (PyTorch's peer prints its peak_mem_mb)
  [ -f "$out/$1.txt" ] && grep -m1 "^memory plan:" "$out/$1.txt" | sed "s/^/$1: /" | tee -a "$summary"
}

train() {  # train NAME LIMIT MODEL [ENV=VALUE...] -- [--set ...]: a throughput run of input/MODEL.json
  name=$1 limit=$2 model=$3
  shift 3
  envs=""
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do envs="$envs $1"; shift; done
  [ $# -gt 0 ] && shift
  step "$name" "$limit" env $envs zero3d train "$root/input/$model.json" --output "$out/$name" \
    --set train_micro_batch_size_per_gpu=16 --set steps_per_print=4 "$@"
  throughput "$name"
}

# The Python there that has torch with CUDA (a venv, or the system's), for the peers.
peer_python=""
for py in python3 /opt/*/.venv/bin/python3 /opt/*/bin/python3 /root/*/bin/python3 /usr/local/bin/python3; do
  if [ -x "$(command -v "$py")" ] && "$py" -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
    peer_python=$py
    break
  fi
done
peer() {  # peer NAME LIMIT MODELS MODES: benchmarks/pytorch_gpu_peer.py's lines into the summary
  [ -n "$peer_python" ] || { note "$1: no Python with torch and CUDA here"; return 0; }
  step "$1" "$2" env -u LD_PRELOAD "$peer_python" "$root/benchmarks/pytorch_gpu_peer.py" --models "$3" --modes "$4"
  [ -f "$out/$1.txt" ] && grep "^peer\|^torch" "$out/$1.txt" | tee -a "$summary"
}

sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
export LD_PRELOAD="$carry/gpu-carry/lib/libfault_backtrace.so"  # a fault prints its stack (fault_backtrace.c)

# 1. The device, and the quick-start alone: a failure here is the first thing to fix, so it is run
# again with every launch synchronous and, where the machine has it, under compute-sanitizer.
step device 20 sh -c 'nvidia-smi; zero3d --version; nproc; grep -m1 "model name" /proc/cpuinfo'
step smoke 45 zero3d train "$root/input/quickstart.json" --output "$out/smoke" --set training.steps=4
if ! ran smoke; then
  step smoke_blocking 45 env CUDA_LAUNCH_BLOCKING=1 zero3d train "$root/input/quickstart.json" --output "$out/smoke_b" \
    --set training.steps=2
  [ -n "$sanitizer" ] && step smoke_memcheck 90 "$sanitizer" --print-limit 20 zero3d train \
    "$root/input/quickstart.json" --output "$out/smoke_m" --set training.steps=1
fi

# 2. The headline: GPT-2 124M bf16 (the portable attention and the fused CUDA one) and fp32,
# and PyTorch's GPT-2 on the same GPU.
train gpt2_124m_bf16 60 gpt2-124m -- --set training.steps=12 --set bf16.enabled=true
train gpt2_124m_bf16_flash 60 gpt2-124m ZERO3D_ATTENTION_KERNEL=flash -- --set training.steps=12 --set bf16.enabled=true
train gpt2_124m_fp32 60 gpt2-124m -- --set training.steps=12
peer pytorch_peer_gpt2 150 gpt2-124m eager-bf16,eager-fp32,compile-bf16

# Where a bf16 step's time goes: the flops profiler's per-module latencies at step 6 (each
# module's boundaries wait for the device) and the forward/backward/step breakdown.
train gpt2_124m_bf16_flash_profile 45 gpt2-124m ZERO3D_ATTENTION_KERNEL=flash -- --set training.steps=6 \
  --set bf16.enabled=true --set flops_profiler.enabled=true --set flops_profiler.profile_step=6 \
  --set wall_clock_breakdown=true --set steps_per_print=1

# The same step kernel by kernel: the kernel timer on the wall clock with the device fenced around
# every kernel and product (kernel_timer.cpp), runs of 3 and 6 steps differenced
# (bf16_breakdown.sh): each memory-bound kernel's share beside the products' and attention's.
step gpt2_124m_bf16_kernels 90 env ZERO3D="$bin/zero3d" TIMER="$carry/gpu-carry/lib/libzero3d_kernel_timer.so" \
  ZERO3D_KERNEL_TIMER_CLOCK=wall S1=3 S2=6 SKIP_BENCH=1 bash "$root/benchmarks/bf16_breakdown.sh" "$carry" \
  "$root/input/gpt2-124m.json" "$out/gpt2_124m_bf16_kernels" --set train_micro_batch_size_per_gpu=16
[ -f "$out/gpt2_124m_bf16_kernels.txt" ] &&
  sed -n '1,/^  optimizer/p' "$out/gpt2_124m_bf16_kernels.txt" | head -40 >>"$summary"

# 3. The kernels, then the training checks no device has run yet.
step gpu_kernel_tests 60 zero3d_gpu_tests --gtest_filter='GpuKernels.*:GpuProducts.*:GpuAttention.*:GpuLlamaKernels.*:GpuCopyStream.*' \
  --gtest_output="json:$out/gpu_kernel_tests.json"
step gpu_flash_attention_test 45 env ZERO3D_ATTENTION_KERNEL=flash zero3d_gpu_tests \
  --gtest_filter='GpuAttention.Bf16*' --gtest_output="json:$out/gpu_flash_attention_test.json"
if [ -f "$out/gpu_flash_attention_test.txt" ] && ! ran gpu_flash_attention_test && [ -n "$sanitizer" ]; then
  step gpu_flash_attention_memcheck 90 env ZERO3D_ATTENTION_KERNEL=flash "$sanitizer" --print-limit 20 zero3d_gpu_tests \
    --gtest_filter='GpuAttention.Bf16*'
fi
step gpu_training_tests_new 200 zero3d_gpu_tests \
  --gtest_filter='GpuTraining.TwoRanksSharingOneGpuSay*:GpuTraining.ZeroOffload*:GpuTraining.ParameterOffload*:GpuTraining.SparseAttention*:GpuTraining.MixtureOfExperts*:GpuTraining.ACheckpointSavedOnTheCpu*:GpuTraining.TensorRanksKeepingBf16*:GpuGenerate.*' \
  --gtest_output="json:$out/gpu_training_tests_new.json"

# 4. ZeRO-Offload's GPU form and ZeRO-Infinity's parameter offload: GPT-2 124M bf16 with
# DeepSpeed's CPU Adam over a page-locked host tier, then stage 3 with the partition in
# page-locked host memory that the kernels read in place.
train gpt2_124m_bf16_offload 60 gpt2-124m -- --set training.steps=8 --set bf16.enabled=true \
  --set zero_optimization.stage=2 --set zero_optimization.offload_optimizer.device=cpu
train gpt2_124m_bf16_offload_param 60 gpt2-124m -- --set training.steps=8 --set bf16.enabled=true \
  --set zero_optimization.stage=3 --set zero_optimization.offload_optimizer.device=cpu \
  --set zero_optimization.offload_param.device=cpu --set memory_breakdown=true

# 5. The training checks a device has run before.
step gpu_training_tests 150 zero3d_gpu_tests \
  --gtest_filter='GpuTraining.*:-GpuTraining.TwoRanksSharingOneGpuSay*:GpuTraining.ZeroOffload*:GpuTraining.ParameterOffload*:GpuTraining.SparseAttention*:GpuTraining.MixtureOfExperts*:GpuTraining.ACheckpointSavedOnTheCpu*:GpuTraining.TensorRanksKeepingBf16*' \
  --gtest_output="json:$out/gpu_training_tests.json"

# 6. The Llama family's throughput, and its peer.
train llama_125m_bf16 60 llama-125m -- --set training.steps=12 --set bf16.enabled=true
train llama_125m_bf16_flash 60 llama-125m ZERO3D_ATTENTION_KERNEL=flash -- --set training.steps=12 --set bf16.enabled=true
peer pytorch_peer_llama 60 llama-125m eager-bf16

# 7. Two ranks sharing the GPU: ZeRO-3, every C++ throw's stack printed (fault_backtrace.c).
step zero3_np2 45 env FAULT_BACKTRACE_THROW=1 mpiexec.hydra -np 2 zero3d train "$root/input/quickstart.json" \
  --output "$out/zero3_np2" --set zero_optimization.stage=3 --set training.steps=3
# GPT-2 124M bf16 at t = 2, the two ranks sharing the GPU: a tensor rank's bf16 saves and logits
# (src/model/bf16_activations.hpp): tokens/s (collectives staged through the host), and the
# device's measured peak beside the plan's.
step gpt2_124m_bf16_t2 60 mpiexec.hydra -np 2 zero3d train "$root/input/gpt2-124m.json" --output "$out/gpt2_124m_bf16_t2" \
  --set train_micro_batch_size_per_gpu=8 --set training.steps=6 --set steps_per_print=2 --set bf16.enabled=true \
  --set tensor_parallel.autotp_size=2
throughput gpt2_124m_bf16_t2

# 8. The per-kernel table, attention's row with the fused CUDA kernel, and attention's kernels
# under Nsight Compute.
step kernels 60 zero3d_device_bench --benchmark_counters_tabular=true --benchmark_min_time=0.1 \
  --benchmark_out="$out/kernels.json"
step kernels_flash 30 env ZERO3D_ATTENTION_KERNEL=flash zero3d_device_bench --benchmark_filter=BM_Attention \
  --benchmark_counters_tabular=true --benchmark_min_time=0.1 --benchmark_out="$out/kernels_flash.json"
# Where bf16 attention's time goes, kernel by kernel (Nsight Compute, where the machine has it):
# every kernel of the benchmark's first passes in the portable form (the buffers' fills first),
# then the fused CUDA kernel's four with their occupancy and what their warps wait on.
ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null)
if [ -n "$ncu" ]; then
  step attention_ncu_tiled 90 env ZERO3D_ATTENTION_KERNEL=tiled "$ncu" --clock-control none --launch-count 40 \
    --section SpeedOfLight zero3d_device_bench --benchmark_filter=BM_Attention/1 --benchmark_min_time=0.001
  step attention_ncu_flash 90 env ZERO3D_ATTENTION_KERNEL=flash "$ncu" --clock-control none \
    -k 'regex:forward_kernel|dkdv_kernel|dq_kernel|row_dot_kernel' --launch-count 4 --section SpeedOfLight \
    --section Occupancy --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis \
    zero3d_device_bench --benchmark_filter=BM_Attention/1 --benchmark_min_time=0.001
fi

# 9. Generation: GPT-2 124M (its seed's weights), greedy, 2 batches of B prompts of 128 ids, 64
# new tokens each; prefill and decode tokens/s (the JSON's last line), PyTorch's beside it.
for B in 1 16; do
  /usr/bin/env python3 -c "
import random
random.seed($B)
for _ in range(2 * $B): print(','.join(str(random.randrange(50257)) for _ in range(128)))" >"$out/prompts_$B.txt"
  for precision in fp32 bf16; do
    set -- --prompt-ids-file "$out/prompts_$B.txt" --batch-size "$B" --max-new-tokens 64 --greedy --eos-id -1 --json
    [ "$precision" = bf16 ] && set -- "$@" --set bf16.enabled=true
    step "generate_${precision}_b$B" 45 zero3d generate "$root/input/gpt2-124m.json" "$@"
    [ -f "$out/generate_${precision}_b$B.txt" ] && tail -n 1 "$out/generate_${precision}_b$B.txt" | /usr/bin/env python3 -c "
import json, sys
d = json.loads(sys.stdin.read())
print('generate $precision batch $B: prefill %.0f tokens/s, decode %.0f tokens/s' % (d['prefill_tokens_per_s'], d['decode_tokens_per_s']))
" 2>/dev/null | tee -a "$summary"
    [ -n "$peer_python" ] || continue
    step "pytorch_generate_${precision}_b$B" 45 env -u LD_PRELOAD "$peer_python" "$root/benchmarks/pytorch_generate_peer.py" \
      --device cuda --batch "$B" --prompt 128 --new 64 --dtype "$precision" --repeats 2
    [ -f "$out/pytorch_generate_${precision}_b$B.txt" ] && tail -n 1 "$out/pytorch_generate_${precision}_b$B.txt" | "$peer_python" -c "
import json, sys
d = json.loads(sys.stdin.read())
print('peer generate $precision batch $B: prefill %.0f tokens/s, decode %.0f tokens/s' % (d['prefill_tokens_per_s'], d['decode_tokens_per_s']))
" 2>/dev/null | tee -a "$summary"
  done
done

# What failed, in the reply itself.
for f in "$out"/*.txt; do
  name=$(basename "$f" .txt)
  case "$name" in device | prompts_*) continue ;; esac
  ran "$name" && continue
  echo "=== $name (last lines)"
  grep -v "^\[ *\(RUN\|OK\) " "$f" | tail -25
done
save
note "gpu_check: $(($(date +%s) - began)) s in all"

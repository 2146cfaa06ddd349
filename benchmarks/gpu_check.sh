#!/bin/sh
# gpu_check.sh — the GPU issue's check on a lent GPU machine, as one prepared run from the
# repository root with gpu-carry.tar.xz beside it (benchmarks/gpu_bundle.sh): the device, the
# `gpu` label's tests (kernels at GPT-2 124M shapes against host references; training against
# the CPU build's losses, run-to-run identity, np 2 sharing the GPU, a checkpoint resumed on the
# CPU; the Llama family's kernels and training likewise), the per-kernel table, GPT-2 124M and
# Llama 125M throughput (micro-batch 16, T 1024) in bf16 and fp32, and PyTorch's on the same GPU.
# Every result goes under $OUT (default /tmp/gpu-check); a
# failing part does not stop the rest. On an H100 it all takes about 100 s (each step has its
# own limit, for a hang).
set -u
# The device tool returns only a few files from $OUT: the results go to a work folder and
# come back as one results.tar.gz beside summary.txt.
final=${OUT:-/tmp/gpu-check}
mkdir -p "$final"
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

# GPU_CHECK_PARTS="smoke gpt2_124m_bf16 ...": only the steps named (a rerun that fits the device
# time left); default: every step.
step() {  # step NAME SECONDS COMMAND...: runs it with a time limit, its output in $out/NAME.txt
  name=$1 limit=$2
  shift 2
  case " ${GPU_CHECK_PARTS:-all} " in *" all "* | *" $name "*) ;; *) return 0 ;; esac
  start=$(date +%s)
  timeout "$limit" "$@" >"$out/$name.txt" 2>&1
  rc=$?
  echo "$name: exit $rc after $(($(date +%s) - start)) s" | tee -a "$out/summary.txt"
}

export LD_PRELOAD="$carry/gpu-carry/lib/libfault_backtrace.so"  # a fault prints its stack (fault_backtrace.c)

step device 20 sh -c 'nvidia-smi; zero3d --version'
# The quick-start first, alone: a failure here is the first thing to fix, so it is run again
# with every launch synchronous and, where the machine has it, under compute-sanitizer.
step smoke 45 zero3d train "$root/input/quickstart.json" --output "$out/smoke" --set training.steps=4
if ! grep -q "smoke: exit 0" "$out/summary.txt"; then
  step smoke_blocking 45 env CUDA_LAUNCH_BLOCKING=1 zero3d train "$root/input/quickstart.json" --output "$out/smoke_b" \
    --set training.steps=2
  sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
  [ -n "$sanitizer" ] && step smoke_memcheck 90 "$sanitizer" --print-limit 20 zero3d train \
    "$root/input/quickstart.json" --output "$out/smoke_m" --set training.steps=1
fi
# ZeRO-3 with two ranks sharing the GPU, every C++ throw's stack printed (fault_backtrace.c).
step zero3_np2 60 env FAULT_BACKTRACE_THROW=1 mpiexec.hydra -np 2 zero3d train "$root/input/quickstart.json" \
  --output "$out/zero3_np2" --set zero_optimization.stage=3 --set training.steps=3
step gpu_kernel_tests 90 zero3d_gpu_tests --gtest_filter='GpuKernels.*:GpuProducts.*:GpuAttention.*:GpuLlamaKernels.*:GpuCopyStream.*' \
  --gtest_output="json:$out/gpu_kernel_tests.json"
# The fused CUDA attention (opt-in until this check has passed; GPT-2's bf16 attention and the
# Llama family's grouped-query form with its sliding window): its kernel tests, then each
# family's bf16 throughput with it, beside the portable form's runs below.
step gpu_flash_attention_test 60 env ZERO3D_ATTENTION_KERNEL=flash zero3d_gpu_tests \
  --gtest_filter='GpuAttention.Bf16*' --gtest_output="json:$out/gpu_flash_attention_test.json"
for model in gpt2_124m llama_125m; do
  step "${model}_bf16_flash" 75 env ZERO3D_ATTENTION_KERNEL=flash zero3d train \
    "$root/input/$(echo $model | tr _ -).json" --output "$out/${model}_bf16_flash" --set train_micro_batch_size_per_gpu=16 \
    --set training.steps=12 --set steps_per_print=4 --set bf16.enabled=true
done
# ZeRO-Offload's GPU form (opt-in until this check has passed): GPT-2 124M bf16 with DeepSpeed's
# CPU Adam over a page-locked host tier, its step time beside the device optimizer's run below.
step gpt2_124m_bf16_offload 90 env ZERO3D_GPU_OFFLOAD=1 zero3d train "$root/input/gpt2-124m.json" \
  --output "$out/gpt2_124m_bf16_offload" --set train_micro_batch_size_per_gpu=16 --set training.steps=8 \
  --set steps_per_print=4 --set bf16.enabled=true --set zero_optimization.stage=2 \
  --set zero_optimization.offload_optimizer.device=cpu
# ZeRO-Infinity's parameter offload (the same opt-in): stage 3 with the partition in page-locked
# host memory that the kernels read in place, the optimizer's state on the host as well.
step gpt2_124m_bf16_offload_param 90 env ZERO3D_GPU_OFFLOAD=1 zero3d train "$root/input/gpt2-124m.json" \
  --output "$out/gpt2_124m_bf16_offload_param" --set train_micro_batch_size_per_gpu=16 --set training.steps=8 \
  --set steps_per_print=4 --set bf16.enabled=true --set zero_optimization.stage=3 \
  --set zero_optimization.offload_optimizer.device=cpu --set zero_optimization.offload_param.device=cpu \
  --set memory_breakdown=true
step gpu_training_tests 360 zero3d_gpu_tests --gtest_filter='GpuTraining.*:GpuGenerate.*' --gtest_output="json:$out/gpu_training_tests.json"
step kernels 75 zero3d_device_bench --benchmark_counters_tabular=true --benchmark_min_time=0.1 \
  --benchmark_out="$out/kernels.json"
for model in gpt2_124m llama_125m; do
  for precision in bf16 fp32; do
    set -- --set train_micro_batch_size_per_gpu=16 --set training.steps=12 --set steps_per_print=4
    [ "$precision" = bf16 ] && set -- "$@" --set bf16.enabled=true
    step "${model}_$precision" 75 zero3d train "$root/input/$(echo $model | tr _ -).json" --output "$out/${model}_$precision" "$@"
  done
done
# Where a bf16 step's time goes: the flops profiler's per-module latencies at step 6 (each
# module's boundaries wait for the device) and the forward/backward/step breakdown.
for model in gpt2_124m llama_125m; do
  step "${model}_bf16_profile" 60 zero3d train "$root/input/$(echo $model | tr _ -).json" \
    --output "$out/${model}_bf16_profile" --set train_micro_batch_size_per_gpu=16 --set training.steps=6 \
    --set bf16.enabled=true --set flops_profiler.enabled=true --set flops_profiler.profile_step=6 \
    --set wall_clock_breakdown=true --set steps_per_print=1
done
# Generation: GPT-2 124M (its seed's weights), greedy, 2 batches of B prompts of 128 ids, 64 new
# tokens each; prefill and decode tokens/s (the JSON's last line), PyTorch's beside it below.
for B in 1 16; do
  /usr/bin/env python3 -c "
import random
random.seed($B)
for _ in range(2 * $B): print(','.join(str(random.randrange(50257)) for _ in range(128)))" >"$out/prompts_$B.txt"
  for precision in fp32 bf16; do
    set -- --prompt-ids-file "$out/prompts_$B.txt" --batch-size "$B" --max-new-tokens 64 --greedy --eos-id -1 --json
    [ "$precision" = bf16 ] && set -- "$@" --set bf16.enabled=true
    step "generate_${precision}_b$B" 60 zero3d generate "$root/input/gpt2-124m.json" "$@"
    tail -n 1 "$out/generate_${precision}_b$B.txt" | /usr/bin/env python3 -c "
import json, sys
d = json.loads(sys.stdin.read())
print('generate $precision batch $B: prefill %.0f tokens/s, decode %.0f tokens/s' % (d['prefill_tokens_per_s'], d['decode_tokens_per_s']))
" 2>/dev/null | tee -a "$out/summary.txt"
  done
done
# The PyTorch peer on the same GPU, where a Python there has torch with CUDA (a venv, or the system's).
for py in python3 /opt/*/bin/python3 /root/*/bin/python3 /workspace/*/bin/python3 /usr/local/bin/python3; do
  [ -x "$(command -v "$py")" ] && "$py" -c "import torch; assert torch.cuda.is_available()" 2>/dev/null || continue
  step pytorch_peer 240 env -u LD_PRELOAD "$py" "$root/benchmarks/pytorch_gpu_peer.py" --models gpt2-124m,llama-125m  # fault_backtrace is zero3d's
  grep "^peer\|^torch" "$out/pytorch_peer.txt" | tee -a "$out/summary.txt"
  for B in 1 16; do
    for precision in fp32 bf16; do
      step "pytorch_generate_${precision}_b$B" 60 env -u LD_PRELOAD "$py" "$root/benchmarks/pytorch_generate_peer.py" \
        --device cuda --batch "$B" --prompt 128 --new 64 --dtype "$precision" --repeats 2
      tail -n 1 "$out/pytorch_generate_${precision}_b$B.txt" | "$py" -c "
import json, sys
d = json.loads(sys.stdin.read())
print('peer generate $precision batch $B: prefill %.0f tokens/s, decode %.0f tokens/s' % (d['prefill_tokens_per_s'], d['decode_tokens_per_s']))
" 2>/dev/null | tee -a "$out/summary.txt"
    done
  done
  break
done
# tokens/s of the last steps (the first ones include cuBLASLt's heuristics and allocations)
for run in gpt2_124m_bf16 gpt2_124m_bf16_flash gpt2_124m_fp32 llama_125m_bf16 llama_125m_bf16_flash llama_125m_fp32 gpt2_124m_bf16_offload gpt2_124m_bf16_offload_param; do
  f=$out/$run/metrics.jsonl
  [ -f "$f" ] && /usr/bin/env python3 -c "
import json, sys
rows = [json.loads(l) for l in open('$f')][4:]
if not rows: sys.exit('$run: fewer than 5 steps in metrics.jsonl')
print('$run: %.0f tokens/s, mfu %.3f over steps 5-%d' % (
    sum(r['tokens_per_s'] for r in rows) / len(rows), sum(r.get('mfu', 0) for r in rows) / len(rows), 4 + len(rows)))
" | tee -a "$out/summary.txt"
done
# what failed, in the reply itself
for f in "$out"/*.txt; do
  case "$f" in */summary.txt|*/device.txt) continue ;; esac
  grep -q "exit 0 after" "$out/summary.txt" && grep -q "^$(basename "$f" .txt): exit 0 after" "$out/summary.txt" && continue
  echo "=== $(basename "$f") (last lines)"; grep -v "^\[ *\(RUN\|OK\) " "$f" | tail -25
done
tar -C "$out" -czf "$final/results.tar.gz" .
cp "$out/summary.txt" "$final/"
cat "$out/summary.txt"

#!/usr/bin/python3
"""Writes tests/golden/gpu_plan.json: a GPU build's own memory plans, which
tests/cli/test_cli_estimate_device.cpp holds `zero3d estimate --device gpu` of a CPU build to.

Independent reference: a CUDA build of zero3d (a Kokkos with its CUDA backend, see the README's
GPU build), whose `estimate` plans with the sizes its own kernels allocate: the GPU's attention
kernels (dense products in causal blocks, or the fused CUDA kernel under
ZERO3D_ATTENTION_KERNEL=flash), bf16 logits, the vocabulary padded to 128, page-locked offload
stages, device memory. A CPU build planning a GPU run must give the same bytes, field for field.
The CUDA build needs no GPU for `estimate` (it starts no device); where the machine has no CUDA
driver, the toolkit's stub stands in for libcuda.so.1 (it is only loaded, never called):

  mkdir -p /tmp/cudastub && ln -sf /usr/local/cuda/lib64/stubs/libcuda.so /tmp/cudastub/libcuda.so.1
  LD_LIBRARY_PATH=/tmp/cudastub /usr/bin/python3 tests/golden/make_gpu_plan_goldens.py BUILD-CUDA/zero3d

Run from the repository root (the cases name configs under input/). Every case gives its
micro-batch: an "auto" one depends on the machine's memory.
"""
import json
import os
import subprocess
import sys

GPT2 = "input/gpt2-124m.json"
LLAMA = "input/llama-125m.json"

# name, config, --set overrides, environment, further options
CASES = [
    ("gpt2_fp32", GPT2, ["train_micro_batch_size_per_gpu=4"], {}, []),
    ("gpt2_bf16", GPT2, ["bf16.enabled=true", "train_micro_batch_size_per_gpu=16"], {},
     ["--memory-per-rank", "40GiB"]),
    ("gpt2_fp16", GPT2, ["fp16.enabled=true", "train_micro_batch_size_per_gpu=8"], {}, []),
    ("gpt2_bf16_attention_dropout", GPT2,
     ["bf16.enabled=true", "train_micro_batch_size_per_gpu=8", "model.attn_pdrop=0.1"], {}, []),
    ("gpt2_bf16_flash", GPT2, ["bf16.enabled=true", "train_micro_batch_size_per_gpu=16"],
     {"ZERO3D_ATTENTION_KERNEL": "flash"}, ["--memory-per-rank", "24GiB"]),
    ("gpt2_bf16_offload_optimizer", GPT2,
     ["bf16.enabled=true", "train_micro_batch_size_per_gpu=8", "zero_optimization.stage=2",
      "zero_optimization.offload_optimizer.device=cpu"], {}, ["--world-size", "2"]),
    ("gpt2_bf16_cpu_checkpointing", GPT2,
     ["bf16.enabled=true", "train_micro_batch_size_per_gpu=16", "pipeline.activation_checkpoint_interval=1",
      "activation_checkpointing.cpu_checkpointing=true"], {}, []),
    ("gpt2_bf16_tensor_parallel", GPT2,
     ["bf16.enabled=true", "train_micro_batch_size_per_gpu=8", "tensor_parallel.autotp_size=2"], {},
     ["--world-size", "2"]),
    ("gpt2_fp32_pipeline", GPT2, ["train_micro_batch_size_per_gpu=4", "pipeline.stages=2"], {},
     ["--world-size", "2"]),
    ("gpt2_sparse_attention", GPT2,
     ["train_micro_batch_size_per_gpu=2", "sparse_attention.mode=fixed", "sparse_attention.block=16"], {}, []),
    ("gpt2_bf16_moe", GPT2,
     ["bf16.enabled=true", "train_micro_batch_size_per_gpu=4", "model.moe.num_experts=4", "model.moe.k=2"], {},
     ["--world-size", "2"]),
    ("llama_fp32", LLAMA, ["train_micro_batch_size_per_gpu=4"], {}, []),
    ("llama_bf16", LLAMA, ["bf16.enabled=true", "train_micro_batch_size_per_gpu=8"], {},
     ["--memory-per-rank", "16GiB"]),
    ("llama_bf16_flash", LLAMA, ["bf16.enabled=true", "train_micro_batch_size_per_gpu=8"],
     {"ZERO3D_ATTENTION_KERNEL": "flash"}, []),
    ("llama_bf16_attention_dropout", LLAMA,
     ["bf16.enabled=true", "train_micro_batch_size_per_gpu=8", "model.attention_dropout=0.1"], {}, []),
    ("mistral_bf16_window", LLAMA,
     ["bf16.enabled=true", "train_micro_batch_size_per_gpu=8", "model.architecture=mistral",
      "model.sliding_window=256"], {}, []),
    ("llama_bf16_tensor_parallel_sequence_parallel", LLAMA,
     ["bf16.enabled=true", "train_micro_batch_size_per_gpu=8", "tensor_parallel.autotp_size=2",
      "tensor_parallel.sequence_parallel=true"], {}, ["--world-size", "2"]),
    ("mixtral_bf16", LLAMA,
     ["bf16.enabled=true", "train_micro_batch_size_per_gpu=4", "model.architecture=mixtral",
      "model.num_local_experts=4", "model.num_experts_per_tok=2"], {}, ["--world-size", "2"]),
]


def command(zero3d, config, sets, options):
    args = [zero3d, "estimate", "--config", config, "--json"] + options
    for s in sets:
        args += ["--set", s]
    return args


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: make_gpu_plan_goldens.py CUDA-BUILD/zero3d")
    zero3d = sys.argv[1]
    version = subprocess.run([zero3d, "--version"], capture_output=True, text=True, check=True).stdout.strip()
    if "CUDA" not in version:
        sys.exit(f"{zero3d} is not a CUDA build: {version}")
    cases = []
    for name, config, sets, env, options in CASES:
        run = subprocess.run(command(zero3d, config, sets, options), capture_output=True, text=True,
                             env={**os.environ, **env})
        if run.returncode != 0:
            sys.exit(f"{name}: exit {run.returncode}: {run.stderr.strip()}")
        cases.append({"name": name, "config": config, "set": sets, "env": env, "options": options,
                      "estimate": json.loads(run.stdout)})
    with open("tests/golden/gpu_plan.json", "w") as f:
        json.dump({"made_by": version, "cases": cases}, f, indent=1, sort_keys=True)
        f.write("\n")
    print(f"tests/golden/gpu_plan.json: {len(cases)} cases from {version}")


if __name__ == "__main__":
    main()

#!/bin/sh
# make_cpu_reference.sh ZERO3D — writes cpu_reference_losses.json beside this script: the
# 10-step losses of input/quickstart.json, input/gpt-small-cpu.json and input/llama-tiny.json in fp32
# and bf16, of the quick-start with two block-sparse attention layouts in fp32, and of two
# Mixture-of-Experts models in fp32 (a GPT-2 MoE on the quick-start, a Mixtral from llama-tiny), trained
# by ZERO3D (the CPU build) on one rank, which the `gpu` label's training checks compare with.
set -eu
exe=${1:?usage: make_cpu_reference.sh path/to/cpu/zero3d}
here=$(cd "$(dirname "$0")" && pwd)
src=$(cd "$here/../.." && pwd)
args="--set training.steps=10"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
export OPENBLAS_NUM_THREADS=1
for model in quickstart gpt-small-cpu llama-tiny; do
  "$exe" train "$src/input/$model.json" --output "$tmp/$model-fp32" $args >/dev/null
  "$exe" train "$src/input/$model.json" --output "$tmp/$model-bf16" $args --set bf16.enabled=true >/dev/null
done
# Block-sparse attention on the quick-start, fp32 (GpuTraining.SparseAttentionTrainsTheLossesOfTheCpuBuild):
# per-head fixed layouts, and bigbird's random blocks under attention dropout.
sparse_fixed="--set sparse_attention.mode=fixed --set sparse_attention.block=16 --set sparse_attention.num_local_blocks=2 \
--set sparse_attention.different_layout_per_head=true --set sparse_attention.num_different_global_patterns=2"
sparse_bigbird="--set sparse_attention.mode=bigbird --set sparse_attention.block=16 --set sparse_attention.num_random_blocks=2 \
--set sparse_attention.different_layout_per_head=true --set model.attn_pdrop=0.1"
"$exe" train "$src/input/quickstart.json" --output "$tmp/sparse-fixed" $args $sparse_fixed >/dev/null
"$exe" train "$src/input/quickstart.json" --output "$tmp/sparse-bigbird_dropout" $args $sparse_bigbird >/dev/null
# Mixture of Experts, fp32 (GpuTraining.MixtureOfExpertsTrainsTheLossesOfTheCpuBuild): DeepSpeed's
# top-2 gate dropping about half the choices, with Jitter and a sampled second expert; Mixtral's
# renormalised top-2 with router jitter.
moe_gpt2="--set model.moe.num_experts=4 --set model.moe.k=2 --set model.moe.capacity_factor=0.5 \
--set model.moe.noisy_gate_policy=Jitter"
moe_mixtral="--set model.architecture=mixtral --set model.num_local_experts=4 --set model.num_experts_per_tok=2 \
--set model.router_jitter_noise=0.1"
"$exe" train "$src/input/quickstart.json" --output "$tmp/moe-gpt2_top2" $args $moe_gpt2 >/dev/null
"$exe" train "$src/input/llama-tiny.json" --output "$tmp/moe-mixtral_top2" $args $moe_mixtral >/dev/null
/usr/bin/python3 - "$tmp" "$args" "$("$exe" --version)" "$sparse_fixed" "$sparse_bigbird" "$moe_gpt2" "$moe_mixtral" \
  >"$here/cpu_reference_losses.json" <<'PY'
import json, sys
tmp, args, version, sparse_fixed, sparse_bigbird, moe_gpt2, moe_mixtral = sys.argv[1:]
def losses(d):
    return [json.loads(l)["loss"] for l in open(f"{tmp}/{d}/metrics.jsonl")]
ref = {"made_by": "tests/gpu/make_cpu_reference.sh with " + version, "args": args}
for model in ("quickstart", "gpt-small-cpu", "llama-tiny"):
    ref[model] = {p: losses(f"{model}-{p}") for p in ("fp32", "bf16")}
ref["sparse_attention"] = {v: {"args": " ".join(a.split()), "fp32": losses(f"sparse-{v}")}
                           for v, a in (("fixed", sparse_fixed), ("bigbird_dropout", sparse_bigbird))}
ref["moe"] = {v: {"model": m, "args": " ".join(a.split()), "fp32": losses(f"moe-{v}")}
             for v, m, a in (("gpt2_top2", "quickstart", moe_gpt2), ("mixtral_top2", "llama-tiny", moe_mixtral))}
print(json.dumps(ref, indent=1))
PY

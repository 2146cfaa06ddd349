#!/bin/sh
# make_cpu_reference.sh ZERO3D — writes cpu_reference_losses.json beside this script: the
# 10-step losses of input/quickstart.json, input/gpt-small-cpu.json and input/llama-tiny.json in fp32
# and bf16, trained
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
/usr/bin/python3 - "$tmp" "$args" "$("$exe" --version)" >"$here/cpu_reference_losses.json" <<'PY'
import json, sys
tmp, args, version = sys.argv[1:]
def losses(d):
    return [json.loads(l)["loss"] for l in open(f"{tmp}/{d}/metrics.jsonl")]
ref = {"made_by": "tests/gpu/make_cpu_reference.sh with " + version, "args": args}
for model in ("quickstart", "gpt-small-cpu", "llama-tiny"):
    ref[model] = {p: losses(f"{model}-{p}") for p in ("fp32", "bf16")}
print(json.dumps(ref, indent=1))
PY

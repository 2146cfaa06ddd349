#!/usr/bin/env bash
# Generation speed (issue 33): GPT-2 124M (input/gpt2-124m.json's shape, weights from its seed),
# one rank, greedy, prefill and decode tokens/s at batch 1 and 16, fp32 and bf16, beside PyTorch
# with a KV cache on the same machine (benchmarks/pytorch_generate_peer.py: the module of
# tests/golden/make_generate_goldens.py, logits of the last position only in the prefill).
# Both run one thread (OPENBLAS_NUM_THREADS=1, torch.set_num_threads(1)); each row also gives
# tokens per second of process CPU time, which a machine shared with other jobs leaves far less
# disturbed than the wall-clock rates. zero3d's figures are
# summed over REPEATS batches of B prompts, PyTorch's over REPEATS runs, the first (cold) one
# included on both sides. Prompts: P random ids each, all of one length (no padding).
# Usage: benchmarks/generate_speed.sh [BUILD_DIR] [WORKDIR]   (BATCHES, DTYPES, P, N, REPEATS)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
DIR=${2:-output/generate_speed}
BATCHES=${BATCHES:-"1 16"}
DTYPES=${DTYPES:-"fp32 bf16"}
P=${P:-128}
N=${N:-64}
REPEATS=${REPEATS:-2}
mkdir -p "$DIR"
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1

printf "%-6s %5s | %-31s | %-31s | %-31s | %-31s\n" "" "" "prefill tokens/s (wall clock)" "decode tokens/s (wall clock)" \
  "prefill tokens per CPU second" "decode tokens per CPU second"
printf "%-6s %5s | %15s %15s | %15s %15s | %15s %15s | %15s %15s\n" dtype batch zero3d PyTorch zero3d PyTorch zero3d \
  PyTorch zero3d PyTorch
for dtype in $DTYPES; do
  set_dtype=()
  [ "$dtype" != fp32 ] && set_dtype=(--set "$dtype.enabled=true")
  for B in $BATCHES; do
    prompts="$DIR/prompts-$B.txt"
    python3 -c "
import random
random.seed($B)
for _ in range($B * $REPEATS): print(','.join(str(random.randrange(50257)) for _ in range($P)))" > "$prompts"
    "$BUILD/zero3d" generate input/gpt2-124m.json --prompt-ids-file "$prompts" --batch-size "$B" \
      --max-new-tokens "$N" --greedy --eos-id -1 --json "${set_dtype[@]}" > "$DIR/zero3d-$dtype-$B.log" 2>&1
    /usr/bin/python3 benchmarks/pytorch_generate_peer.py --batch "$B" --prompt "$P" --new "$N" --dtype "$dtype" --repeats "$REPEATS" \
      > "$DIR/pytorch-$dtype-$B.log" 2>&1
    python3 - "$DIR/zero3d-$dtype-$B.log" "$DIR/pytorch-$dtype-$B.log" "$dtype" "$B" <<'PY'
import json, sys
z = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
t = json.loads(open(sys.argv[2]).read().strip().splitlines()[-1])
print("%-6s %5s | %15.1f %15.1f | %15.1f %15.1f | %15.1f %15.1f | %15.1f %15.1f" % (
    sys.argv[3], sys.argv[4], z["prefill_tokens_per_s"], t["prefill_tokens_per_s"], z["decode_tokens_per_s"],
    t["decode_tokens_per_s"], z["prefill_tokens"] / (z["prefill_cpu_ms"] / 1e3), t["prefill_tokens_per_cpu_s"],
    z["decode_tokens"] / (z["decode_cpu_ms"] / 1e3), t["decode_tokens_per_cpu_s"]))
PY
  done
done

#!/usr/bin/env bash
# Issue 17's speed figures in one command: zero3d in fp32, bf16 and fp16 at np 1 and np 2 beside
# its PyTorch peers (benchmarks/pytorch_peer.py: one process and DDP, fp32 and autocast bf16),
# on gpt-small-cpu, on the real GPT-2 124M shape (input/gpt2-124m.json, micro-batch 1) and on
# llama-small-cpu (the Llama family at gpt-small-cpu's size; MODELS="llama-small-cpu").
# Each row: tokens/s (mean over the steps after the first, which warms caches), MFU against the
# machine's bf16 GEMM peak as zero3d measures it at start-up (the highest per-rank figure of the
# model's runs times the rank count, the same for every row of a model so that rows compare), peak resident memory per rank, and
# the ratio to the PyTorch peer of the same dtype and rank count. Run on a quiet machine.
# Usage: benchmarks/bf16_speed.sh [BUILD_DIR] [WORKDIR]   (MODELS="gpt2-124m" to run one model;
# NPS=2 reruns only the np 2 rows into a WORKDIR that holds the np 1 ones)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
DIR=${2:-output/bf16_speed}
MODELS=${MODELS:-"gpt-small-cpu gpt2-124m"}
mkdir -p "$DIR"
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1

for model in $MODELS; do
  if [ "$model" = gpt2-124m ]; then steps=3 micro=1; else steps=8 micro=8; fi
  for np in ${NPS:-1 2}; do
    for dtype in fp32 bf16 fp16; do
      set_dtype=()
      [ "$dtype" != fp32 ] && set_dtype=(--set "$dtype.enabled=true")
      out="$DIR/$model-$dtype-np$np"
      mpirun -np $np "$BUILD/zero3d" train "input/$model.json" --set training.steps=$steps \
        --set train_batch_size=$((np * micro)) "${set_dtype[@]}" --output "$out" > "$out.log" 2>&1
    done
    for dtype in fp32 bf16; do
      /usr/bin/python3 benchmarks/pytorch_peer.py --model "$model" --dtype $dtype --np $np > "$DIR/$model-peer-$dtype-np$np.log" 2>&1
    done
  done
done

python3 - "$DIR" "$MODELS" <<'PY'
import json, os, re, sys
d, models = sys.argv[1], sys.argv[2].split()
def zero3d(model, dtype, np):
    rows = [json.loads(l) for l in open(f"{d}/{model}-{dtype}-np{np}/metrics.jsonl")]
    timed = rows[1:] or rows
    tps = sum(r["tokens_per_s"] for r in timed) / len(timed)
    log = open(f"{d}/{model}-{dtype}-np{np}.log").read()
    peak = float(re.search(r"MFU peak ([0-9.]+) GFLOP/s", log).group(1))
    flops = float(re.search(r": (\d+) parameters", log).group(1))
    rss = max(r.get("peak_rss_bytes", 0) for r in rows) / 1e6
    return tps, peak, rss, int(flops)
def peer(model, dtype, np):
    line = open(f"{d}/{model}-peer-{dtype}-np{np}.log").read()
    m = re.search(r"tokens/s ([0-9.]+) \| GFLOP/s ([0-9.]+) \| peak_rss_mb_per_rank ([0-9.]+)", line)
    return float(m.group(1)), float(m.group(2)), float(m.group(3))
for model in models:
    cfg = json.load(open(f"input/{model}.json"))["model"]
    llama = cfg.get("architecture", "gpt2") != "gpt2"  # Hugging Face's names for the same sizes
    L, T, C = (cfg["num_hidden_layers"], cfg["seq_length"], cfg["hidden_size"]) if llama else \
              (cfg["n_layer"], cfg["n_positions"], cfg["n_embd"])
    H = cfg["num_attention_heads" if llama else "n_head"]
    lookup = cfg["vocab_size"] * C if llama else 0  # the untied input embedding: a lookup, no FLOPs
    shape = f"KV={cfg['num_key_value_heads']} I={cfg['intermediate_size']} " if llama else ""
    print(f"\n{model} (V={cfg['vocab_size']} T={T} L={L} H={H} {shape}C={C}), 1 BLAS thread per rank")
    print(f"{'run':<26}{'tokens/s':>10}{'MFU':>8}{'peak MB/rank':>14}{'vs PyTorch':>12}")
    # The bf16 GEMM peak per rank: the highest any of the model's six runs measured at start-up
    # (a neighbour's burst during one run's measurement would otherwise lift its MFU past 100%).
    # the rank counts this WORKDIR holds (NPS=1 runs only the np 1 rows)
    nps = [p for p in (1, 2) if os.path.exists(f"{d}/{model}-bf16-np{p}.log")]
    per_rank = max(zero3d(model, dt, p)[1] / p for dt in ("fp32", "bf16", "fp16") for p in nps)
    for np in nps:
        n = zero3d(model, "bf16", np)[3] - lookup
        bf16_peak = per_rank * np
        fpt = 6 * n + 12 * L * T * C
        mfu = lambda tps: 100 * fpt * tps / (bf16_peak * 1e9)
        peers = {dt: peer(model, dt, np) for dt in ("fp32", "bf16")}
        for dtype in ("fp32", "bf16", "fp16"):
            tps, _, rss, _ = zero3d(model, dtype, np)
            ref = peers["bf16" if dtype == "bf16" else "fp32"][0]
            print(f"{'zero3d ' + dtype + f' np{np}':<26}{tps:>10.0f}{mfu(tps):>7.1f}%{rss:>14.0f}{tps / ref:>11.2f}x")
        for dt in ("fp32", "bf16"):
            tps, _, rss = peers[dt]
            name = ("PyTorch " if np == 1 else "PyTorch DDP ") + ("fp32" if dt == "fp32" else "autocast bf16")
            print(f"{name + f' np{np}':<26}{tps:>10.0f}{mfu(tps):>7.1f}%{rss:>14.0f}{'':>12}")
        print(f"  (MFU against {bf16_peak:.0f} GFLOP/s: zero3d's measured bf16 GEMM peak, {per_rank:.0f} per rank)")
PY

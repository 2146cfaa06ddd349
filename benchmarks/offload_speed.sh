#!/usr/bin/env bash
# offload_speed.sh — what ZeRO-Offload / ZeRO-Infinity cost here: tokens/s and per-rank peak
# resident memory of gpt-small-cpu (ZeRO-2, np 2) with offload_optimizer none, cpu and nvme,
# and the swap bandwidth during the optimizer step next to the raw sequential direct-I/O
# bandwidth of the same disk (dd with O_DIRECT, 1 MiB blocks).
#
#   benchmarks/offload_speed.sh [BUILD_DIR] [SWAP_DIR]     (defaults: build, output/offload_bench/swap)
#   NP=2 STEPS=20 BIG=1 benchmarks/offload_speed.sh ...    BIG=1 adds the 2-billion-parameter run
#
# BIG=1 trains a 2.05e9-parameter GPT (C=2560, L=26, V=256, T=32) at np 2 in bf16 with ZeRO-3
# and NVMe offload of optimizer and parameters for 5 steps: fp32 Adam state of 32.8 GB, more
# than this machine's memory. It needs ~30 GB free under SWAP_DIR and takes several minutes.
set -euo pipefail
BUILD=${1:-build}
SWAP=${2:-output/offload_bench/swap}
NP=${NP:-2}
STEPS=${STEPS:-20}
EXE=$BUILD/zero3d
OUT=output/offload_bench
export OPENBLAS_NUM_THREADS=1
mkdir -p "$OUT" "$SWAP"

echo "== raw disk under $SWAP (dd, O_DIRECT, 1 MiB blocks, 2 GiB)"
dd if=/dev/zero of="$SWAP/dd.bin" bs=1M count=2048 oflag=direct conv=fsync 2>&1 | tail -1 | tee "$OUT/dd_write.txt"
dd if="$SWAP/dd.bin" of=/dev/null bs=1M iflag=direct 2>&1 | tail -1 | tee "$OUT/dd_read.txt"
rm -f "$SWAP/dd.bin"

NVME_ARGS="--set zero_optimization.offload_optimizer.nvme_path=$SWAP --set zero_optimization.offload_optimizer.buffer_count=6 \
  --set zero_optimization.offload_optimizer.pipeline_read=true --set zero_optimization.offload_optimizer.pipeline_write=true \
  --set zero_optimization.sub_group_size=2000000 --set aio.queue_depth=16"
for mode in none cpu nvme; do
  args="--set zero_optimization.stage=2 --set training.steps=$STEPS --set zero_optimization.offload_optimizer.device=$mode"
  [ "$mode" = nvme ] && args="$args $NVME_ARGS"
  echo "== gpt-small-cpu, np $NP, ZeRO-2, offload_optimizer $mode"
  # shellcheck disable=SC2086
  mpiexec -np "$NP" "$EXE" train input/gpt-small-cpu.json --output "$OUT/$mode" $args > "$OUT/$mode.log"
  grep -E '^(offload|memory)' "$OUT/$mode.log" || true
done

python3 - "$OUT" <<'EOF'
import json, re, statistics, sys
out = sys.argv[1]
def rows(mode):
    return [json.loads(l) for l in open(f"{out}/{mode}/metrics.jsonl")]
def dd(name):
    m = re.search(r"([\d.]+) ([GM])B/s", open(f"{out}/{name}").read())
    return float(m.group(1)) * (1 if m.group(2) == "G" else 1e-3)
base = None
print(f"{'offload':8} {'tokens/s':>9} {'step ms':>8} {'vs none':>8} {'peak RSS/rank':>14} {'in memory':>10} {'on nvme':>9}"
      f" {'swap rd GB/s':>12} {'swap wr GB/s':>12}")
for mode in ("none", "cpu", "nvme"):
    r = rows(mode)[2:]  # the first steps warm up
    tok = statistics.median(x["tokens_per_s"] for x in r)
    ms = statistics.median(x["elapsed_ms"] for x in r)
    base = base or ms
    mem = r[-1]["memory"]
    in_mem = mem["params"] + mem["grads"] + mem["master"] + mem["optimizer_states"]
    sw = [x["swap"] for x in r if "swap" in x and x["swap"]["read_bytes"] > 0]
    rd = statistics.median(s["read_gbps"] for s in sw) if sw else 0.0
    wr = statistics.median(s["write_gbps"] for s in sw) if sw else 0.0
    print(f"{mode:8} {tok:9.0f} {ms:8.1f} {100 * (ms / base - 1):+7.1f}% {r[-1]['peak_rss_bytes'] / 2**20:11.0f} MiB"
          f" {in_mem / 2**20:7.1f} MiB {mem.get('nvme', 0) / 2**20:6.1f} MiB {rd:12.2f} {wr:12.2f}")
print(f"raw disk (dd O_DIRECT): write {dd('dd_write.txt'):.2f} GB/s, read {dd('dd_read.txt'):.2f} GB/s")
EOF

if [ "${BIG:-0}" = 1 ]; then
  echo "== 2.05e9 parameters, np $NP, bf16, ZeRO-3, optimizer and parameters on nvme, 5 steps"
  cat > "$OUT/big.json" <<EOF
{"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 1,
 "optimizer": {"type": "AdamW", "params": {"lr": 3e-5, "weight_decay": 0.0}},
 "bf16": {"enabled": true},
 "model": {"vocab_size": 256, "n_positions": 32, "n_layer": 26, "n_head": 20, "n_embd": 2560},
 "data": {"source": "synthetic"},
 "training": {"steps": 5, "seed": 1, "peak_gflops": 100},
 "zero_optimization": {"stage": 3, "reduce_bucket_size": 20000000, "prefetch_bucket_size": 20000000,
   "max_live_parameters": 100000000, "max_reuse_distance": 0, "sub_group_size": 20000000,
   "offload_optimizer": {"device": "nvme", "nvme_path": "$SWAP", "buffer_count": 6,
                         "pipeline_read": true, "pipeline_write": false},
   "offload_param": {"device": "nvme", "nvme_path": "$SWAP", "max_in_cpu": 100000000}},
 "aio": {"queue_depth": 16}}
EOF
  mpiexec -np "$NP" "$EXE" train "$OUT/big.json" --output "$OUT/big" | tee "$OUT/big.log" | grep -E '^(offload|memory|step)'
  python3 - "$OUT" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(f"{sys.argv[1]}/big/metrics.jsonl")]
for r in rows:
    s = r["swap"]
    print(f"step {r['step']}: loss {r['loss']:.4f}, {r['elapsed_ms'] / 1e3:.1f} s, peak RSS (rank 0) "
          f"{r['peak_rss_bytes'] / 2**30:.2f} GiB, swap read {s['read_bytes'] / 1e9:.1f} GB at {s['read_gbps']:.2f} GB/s, "
          f"write {s['write_bytes'] / 1e9:.1f} GB at {s['write_gbps']:.2f} GB/s")
EOF
fi

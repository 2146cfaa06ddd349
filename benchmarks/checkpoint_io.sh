#!/usr/bin/env bash
# Checkpoint save/load throughput of a >= 1 GB checkpoint (85M parameters: fp32 master + Adam
# moments = 1.02 GB) against the disk's sequential write bandwidth measured by dd with
# conv=fdatasync in the same run. Usage: benchmarks/checkpoint_io.sh [DIR] [NP]
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-output/checkpoint_io}
NP=${2:-2}
export OPENBLAS_NUM_THREADS=1
rm -rf "$DIR" && mkdir -p "$DIR"
echo "== dd: 1 GiB sequential write with fdatasync"
dd if=/dev/zero of="$DIR/dd.bin" bs=1M count=1024 conv=fdatasync 2>&1 | tail -1
rm -f "$DIR/dd.bin"
cat > "$DIR/io.json" <<JSON
{"train_batch_size": $NP, "train_micro_batch_size_per_gpu": 1,
 "model": {"vocab_size": 256, "n_positions": 16, "n_layer": 12, "n_head": 12, "n_embd": 768},
 "zero_optimization": {"stage": 2},
 "training": {"steps": 1, "save_interval": 1, "peak_gflops": 100, "save_dir": "$DIR/checkpoints"}}
JSON
echo "== zero3d save (np $NP)"
mpirun -np "$NP" build/zero3d train "$DIR/io.json" --output "$DIR/run" | grep -E "^checkpoint|^model"
echo "== zero3d load (np $NP, resharded reads of the same checkpoint)"
mpirun -np "$NP" build/zero3d train "$DIR/io.json" --output "$DIR/run2" --set training.resume=latest \
  --set training.steps=1 | grep -E "^resume"
du -sh "$DIR/checkpoints/global_step1"

#!/usr/bin/python3
"""A converted zero3d checkpoint loaded by PyTorch computes zero3d's loss on the same batch.

Trains 10 steps at np 2 ZeRO stage 2 on a periodic text (every micro-batch is the same window),
converts the checkpoint to HDF5 with Hugging Face names, runs 1 zero3d step from the converted
weights (its loss is computed before any update), then evaluates the same weights and batch
with the independent PyTorch GPT-2 of tests/golden/make_goldens.py (float64).

  check_converted_with_torch.py ZERO3D MPIEXEC WORKDIR
"""
import json
import os
import subprocess
import sys

import h5py
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden"))
from make_goldens import gpt_forward  # noqa: E402  (float64 reference GPT-2)


def main():
    zero3d, mpiexec, work = sys.argv[1:4]
    os.makedirs(work, exist_ok=True)
    text = os.path.join(work, "periodic.txt")
    with open(text, "w") as f:
        f.write("zero3d trains GPT models, fast!\n" * 400)  # 32 bytes: divides B*T = 2*16
    cfg = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2,
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
           "model": {"vocab_size": 256, "n_positions": 16, "n_layer": 2, "n_head": 2, "n_embd": 32},
           "data": {"source": "text", "path": text},
           "zero_optimization": {"stage": 2},
           "training": {"steps": 10, "seed": 11, "save_interval": 10, "peak_gflops": 50}}
    path = os.path.join(work, "torch_check.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    run = lambda *a: subprocess.run(list(a), check=True, env=env, capture_output=True)  # noqa: E731
    run(mpiexec, "-np", "2", zero3d, "train", path, "--output", os.path.join(work, "src"))
    converted = os.path.join(work, "model.h5")
    run(zero3d, "convert", os.path.join(work, "src", "checkpoints"), converted)
    run(zero3d, "train", path, "--output", os.path.join(work, "dst"), "--set", "training.steps=1",
        "--set", "training.save_interval=0", "--set", "model.init_from=" + converted,
        "--set", "train_batch_size=2")
    with open(os.path.join(work, "dst", "metrics.jsonl")) as f:
        zero3d_loss = json.loads(f.readline())["loss"]

    with h5py.File(converted) as f:
        params = {name: torch.tensor(f[name][...], dtype=torch.float64) for name in f.keys()}
    data = torch.tensor(list(open(text, "rb").read()[:2 * 16 + 1]), dtype=torch.long)
    tokens, targets = data[:-1].view(2, 16), data[1:].view(2, 16)
    logits = gpt_forward(params, tokens, L=2, H=2)
    torch_loss = torch.nn.functional.cross_entropy(logits.view(-1, 256), targets.reshape(-1)).item()
    rel = abs(zero3d_loss - torch_loss) / torch_loss
    print(f"zero3d loss {zero3d_loss:.8f}, PyTorch loss {torch_loss:.8f}, relative difference {rel:.2e}")
    sys.exit(0 if rel <= 1e-5 else 1)


if __name__ == "__main__":
    main()

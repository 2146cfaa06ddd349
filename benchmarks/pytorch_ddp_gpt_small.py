#!/usr/bin/python3
"""PyTorch DDP peer for the data-parallel speed target: gpt-small-cpu on 2 processes (gloo),
1 thread each, micro-batch 8 per process = global batch 16, AdamW, clip 1.0. Peers are
started with torch.multiprocessing.spawn (Debian's torchrun fails under Python 3.11).

Run beside zero3d on the same machine:
  /usr/bin/python3 benchmarks/pytorch_ddp_gpt_small.py
  OPENBLAS_NUM_THREADS=1 mpirun -np 2 build/zero3d train input/gpt-small-cpu.json --set train_batch_size=16
"""
import os
import sys
import time

os.environ["OPENBLAS_NUM_THREADS"] = "1"  # before torch loads OpenBLAS
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pytorch_gpt_small import GPT  # noqa: E402

V, T, L, H, C, B = 256, 256, 6, 6, 384, 8
STEPS, WARMUP = 8, 2


def worker(rank, world, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29517")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(GPT(V, T, L, H, C))
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(rank)
    idx, tgt = torch.randint(0, V, (B, T), generator=gen), torch.randint(0, V, (B, T), generator=gen)
    times = []
    for step in range(WARMUP + STEPS):
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        model(idx, tgt).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step >= WARMUP:
            times.append(time.perf_counter() - t0)
    if rank == 0:
        n_params = sum(p.numel() for p in model.parameters())
        results.put((n_params, world * B * T * len(times) / sum(times)))
    dist.destroy_process_group()


def main():
    world = 2
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    mp.spawn(worker, args=(world, results), nprocs=world, join=True)
    n_params, tps = results.get()
    flops = 6 * n_params + 12 * L * T * C
    print(f"pytorch {torch.__version__} DDP gloo x{world}: {tps:.0f} tokens/s, {flops * tps / 1e9:.1f} GFLOP/s")


if __name__ == "__main__":
    main()

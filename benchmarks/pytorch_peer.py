#!/usr/bin/python3
"""PyTorch peer of a zero3d speed run: the same GPT-2 (nanoGPT style, tied head, tanh GELU) or
Llama (benchmarks/pytorch_llama.py), AdamW, clip 1.0, at a named shape, one process or DDP over gloo with torch.multiprocessing
(Debian's torchrun fails under Python 3.11), fp32 or torch.autocast("cpu", bfloat16), one
thread per process. Prints one line:

  peer MODEL DTYPE npN: tokens/s T | GFLOP/s G | peak_rss_mb_per_rank M

with zero3d's FLOPs formula (6N + 12·L·T·C per token; the Llama's N without its input
embedding, a lookup, as zero3d counts it), so benchmarks/bf16_speed.sh can set it
beside zero3d's figures for the same shape. Shapes:
  gpt-small-cpu  V=256   T=256  L=6  H=6  C=384, micro-batch 8 (input/gpt-small-cpu.json)
  gpt2-124m      V=50257 T=1024 L=12 H=12 C=768, micro-batch 1 (input/gpt2-124m.json)
  llama-small-cpu  V=256 T=256 L=6 H=6 KV=2 C=384 I=1024, micro-batch 8 (input/llama-small-cpu.json)

  OPENBLAS_NUM_THREADS=1 /usr/bin/python3 benchmarks/pytorch_peer.py --model gpt2-124m --dtype bf16 --np 2
"""
import argparse
import os
import resource
import sys
import time

os.environ["OPENBLAS_NUM_THREADS"] = "1"  # before torch loads OpenBLAS (set_num_threads does not limit it)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pytorch_gpt_small import GPT  # noqa: E402
from pytorch_llama import Llama  # noqa: E402

SHAPES = {  # V, T, L, H, C, micro-batch
    "gpt-small-cpu": (256, 256, 6, 6, 384, 8),
    "gpt2-124m": (50257, 1024, 12, 12, 768, 1),
    "llama-small-cpu": (256, 256, 6, 6, 384, 8),
}
LLAMA = {"llama-small-cpu": dict(KV=2, I=1024)}  # the Llama shapes' K/V heads and SwiGLU width


def build(name):
    V, T, L, H, C, _ = SHAPES[name]
    return Llama(V, T, L, H, LLAMA[name]["KV"], C, LLAMA[name]["I"]) if name in LLAMA else GPT(V, T, L, H, C)


def train(rank, world, args, results):
    torch.set_num_threads(1)
    V, T, L, H, C, B = SHAPES[args.model]
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = build(args.model)
    n_params = sum(p.numel() for p in model.parameters()) - (V * C if args.model in LLAMA else 0)
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(rank)
    idx, tgt = torch.randint(0, V, (B, T), generator=gen), torch.randint(0, V, (B, T), generator=gen)
    times = []
    for step in range(args.warmup + args.steps):
        if world > 1:
            dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.dtype == "bf16"):
            loss = model(idx, tgt)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB
    rss = torch.tensor([rss_mb])
    if world > 1:
        dist.all_reduce(rss, op=dist.ReduceOp.MAX)
        dist.destroy_process_group()
    if rank == 0:
        results.put((n_params, world * B * T * len(times) / sum(times), float(rss[0])))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=sorted(SHAPES), default="gpt-small-cpu")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--np", type=int, default=1)
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default: 6 small, 2 for gpt2-124m)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--port", type=int, default=29531)
    args = ap.parse_args()
    if args.steps is None:
        args.steps = 2 if args.model == "gpt2-124m" else 6
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    if args.np == 1:
        train(0, 1, args, results)
    else:
        mp.spawn(train, args=(args.np, args, results), nprocs=args.np, join=True)
    n_params, tps, rss_mb = results.get()
    V, T, L, H, C, B = SHAPES[args.model]
    flops = 6 * n_params + 12 * L * T * C
    print(f"peer {args.model} {args.dtype} np{args.np}: tokens/s {tps:.1f} | GFLOP/s {flops * tps / 1e9:.1f} | "
          f"peak_rss_mb_per_rank {rss_mb:.0f} | params {n_params} | pytorch {torch.__version__}")


if __name__ == "__main__":
    main()

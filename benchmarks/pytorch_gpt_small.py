#!/usr/bin/python3
"""PyTorch peer for the gpt-small-cpu speed target: the same GPT-2 (V=256, T=256, L=6, H=6,
C=384, micro-batch 8, fp32, AdamW, clip 1.0) written as a PyTorch user would (nanoGPT style),
one thread. Prints tokens/s and MFU with zero3d's formula (6N + 12·L·T·C FLOPs per token).

Run beside zero3d on the same machine:
  OPENBLAS_NUM_THREADS=1 /usr/bin/python3 benchmarks/pytorch_gpt_small.py
  OPENBLAS_NUM_THREADS=1 build/zero3d train input/gpt-small-cpu.json
"""
import argparse
import math
import os
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # Debian's torch uses OpenBLAS; set_num_threads does not limit it
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402


class Block(nn.Module):
    def __init__(self, C, H):
        super().__init__()
        self.H = H
        self.ln_1, self.ln_2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.c_attn, self.attn_proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
        self.c_fc, self.mlp_proj = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)

    def forward(self, x, mask):
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.H, C // self.H).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(C // self.H))
        att = att.masked_fill(mask[:, :, :T, :T] == 0, float("-inf")).softmax(dim=-1)
        x = x + self.attn_proj((att @ v).transpose(1, 2).reshape(B, T, C))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, V, T, L, H, C):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, C), nn.Embedding(T, C)
        self.h = nn.ModuleList(Block(C, H) for _ in range(L))
        self.ln_f = nn.LayerNorm(C)
        self.register_buffer("mask", torch.tril(torch.ones(T, T)).view(1, 1, T, T))

    def forward(self, idx, targets):
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T))
        for block in self.h:
            x = block(x, self.mask)
        logits = self.ln_f(x) @ self.wte.weight.T  # tied head
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    V, T, L, H, C, B = 256, 256, 6, 6, 384, 8
    model = GPT(V, T, L, H, C)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1)
    idx = torch.randint(0, V, (B, T))
    tgt = torch.randint(0, V, (B, T))
    times = []
    for step in range(a.warmup + a.steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = model(idx, tgt)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step >= a.warmup:
            times.append(time.perf_counter() - t0)
    tps = B * T * len(times) / sum(times)
    flops = 6 * n_params + 12 * L * T * C
    # Peak: best of a few 512^3 sgemms, as zero3d measures it.
    m = torch.ones(512, 512)
    best = 0.0
    for _ in range(20):
        t0 = time.perf_counter()
        m @ m
        best = max(best, 2 * 512**3 / (time.perf_counter() - t0) / 1e9)
    print(f"pytorch {torch.__version__}: {n_params} params, {tps:.0f} tokens/s, "
          f"{flops * tps / 1e9:.1f} GFLOP/s, MFU {100 * flops * tps / (best * 1e9):.1f}% of {best:.1f} GFLOP/s sgemm peak")


if __name__ == "__main__":
    main()

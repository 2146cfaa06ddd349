#!/usr/bin/env python3
"""PyTorch peer of zero3d on a GPU (issue 31): GPT-2 124M (V 50257, T 1024, L 12, H 12, C 768;
nanoGPT's model: tied head, tanh GELU, fused QKV) and input/llama-125m.json's Llama (V 32000,
12 layers, hidden 768, 12 query heads over 4 K/V heads, SwiGLU 2048, RMSNorm, RoPE, untied head;
transformers' LlamaForCausalLM written out, K/V heads repeated for SDPA as transformers'
repeat_kv does) at micro-batch 16 on one CUDA device, AdamW
(fused where this PyTorch has it), clip 1.0, on random tokens. Modes: eager fp32 (TF32 off, as
zero3d's fp32 products), eager bf16 (torch.autocast, scaled_dot_product_attention), compiled
bf16 (torch.compile). Prints one line per mode, with zero3d's FLOPs formula (6N + 12·L·T·C per
token) and the same measured-GEMM denominator zero3d's MFU uses (an 8192³ product):

  peer MODEL MODE: tokens/s T | step_ms S | mfu M | peak_mem_mb P

benchmarks/gpu_check.sh runs it on the GPU machine when a Python there has torch with CUDA.
"""
import argparse
import math
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pytorch_llama import Llama  # noqa: E402

V, T, L, H, C = 50257, 1024, 12, 12, 768


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.c_attn, self.attn_proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
        self.c_fc, self.mlp_proj = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)

    def forward(self, x):
        B, Tn, _ = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, Tn, H, C // H).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).contiguous().view(B, Tn, C)
        x = x + self.attn_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, C), nn.Embedding(T, C)
        self.h = nn.ModuleList(Block() for _ in range(L))
        self.ln_f = nn.LayerNorm(C)
        for name, p in self.named_parameters():  # GPT-2's initialisation
            if p.dim() >= 2:
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * L) if name.endswith("proj.weight") else 0.02)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for b in self.h:
            x = b(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)
        return F.cross_entropy(logits.float().view(-1, V), targets.view(-1))


LV, LC, LI, LH, LKV, LL = 32000, 768, 2048, 12, 4, 12  # input/llama-125m.json


def gemm_peak_tflops(dtype):
    a = torch.full((8192, 8192), 0.5, device="cuda", dtype=dtype)
    best = 0.0
    for rep in range(6):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        a @ a
        torch.cuda.synchronize()
        if rep:
            best = max(best, 2 * 8192**3 / (time.perf_counter() - t0) / 1e12)
    return best


def run(name, mode, steps, warmup, B):
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = (GPT() if name == "gpt2-124m" else Llama(LV, T, LL, LH, LKV, LC, LI)).cuda()
    vocab = V if name == "gpt2-124m" else LV
    params = sum(p.numel() for p in model.parameters())
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    except (TypeError, RuntimeError):
        opt = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1)
    step_fn = torch.compile(model) if mode == "compile-bf16" else model
    bf16 = mode != "eager-fp32"
    idx = torch.randint(0, vocab, (B, T), device="cuda")
    tgt = torch.randint(0, vocab, (B, T), device="cuda")
    torch.cuda.reset_peak_memory_stats()
    times = []
    for s in range(warmup + steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            loss = step_fn(idx, tgt)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if s >= warmup:
            times.append(time.perf_counter() - t0)
    step = sum(times) / len(times)
    tps = B * T / step
    # zero3d's formula: 6·(parameters less the position table; the input embedding, a lookup,
    # counts for Llama as zero3d counts it) + 12·L·T·(attention width)
    flops_per_token = (6 * (params - T * C) + 12 * L * T * C if name == "gpt2-124m" else
                       6 * (params - LV * LC) + 12 * LL * T * LC)
    peak = gemm_peak_tflops(torch.bfloat16 if bf16 else torch.float32)
    print("peer %s %s: tokens/s %.0f | step_ms %.1f | mfu %.3f | peak_mem_mb %.0f" % (
        name, mode, tps, step * 1e3, flops_per_token * tps / (peak * 1e12), torch.cuda.max_memory_allocated() / 2**20),
        flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="gpt2-124m")
    ap.add_argument("--modes", default="eager-fp32,eager-bf16,compile-bf16")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--micro-batch", type=int, default=16)
    args = ap.parse_args()
    print("torch %s on %s" % (torch.__version__, torch.cuda.get_device_name()), flush=True)
    for name in args.models.split(","):
        for mode in args.modes.split(","):
            run(name, mode, args.steps, args.warmup, args.micro_batch)


if __name__ == "__main__":
    main()

#!/usr/bin/python3
"""The PyTorch Llama both speed peers run (benchmarks/pytorch_peer.py on the CPU,
benchmarks/pytorch_gpu_peer.py on a GPU): transformers' LlamaForCausalLM written out — RMSNorm
with fp32 statistics, rotate_half RoPE, grouped-query attention with the K/V heads repeated as
transformers' repeat_kv does, SwiGLU, an untied head — at any size. Attention is
scaled_dot_product_attention where the PyTorch has it (2.0 and later), else the masked softmax
a PyTorch 1.x user writes.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, n, eps=1e-5):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(n)), eps

    def forward(self, x):  # LlamaRMSNorm: statistics in fp32
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def causal_attention(q, k, v):
    if hasattr(F, "scaled_dot_product_attention"):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    T = q.shape[-2]
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    return att.masked_fill(~mask, float("-inf")).softmax(dim=-1) @ v


class LlamaBlock(nn.Module):
    def __init__(self, C, I, H, KV):
        super().__init__()
        self.C, self.H, self.KV, self.d = C, H, KV, C // H
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(C), RMSNorm(C)
        self.q_proj = nn.Linear(C, H * self.d, bias=False)
        self.k_proj, self.v_proj = nn.Linear(C, KV * self.d, bias=False), nn.Linear(C, KV * self.d, bias=False)
        self.o_proj = nn.Linear(H * self.d, C, bias=False)
        self.gate_proj, self.up_proj = nn.Linear(C, I, bias=False), nn.Linear(C, I, bias=False)
        self.down_proj = nn.Linear(I, C, bias=False)

    def forward(self, x, cos, sin):
        B, Tn, _ = x.shape
        h = self.input_layernorm(x)
        q = self.q_proj(h).view(B, Tn, self.H, self.d).transpose(1, 2)
        k = self.k_proj(h).view(B, Tn, self.KV, self.d).transpose(1, 2)
        v = self.v_proj(h).view(B, Tn, self.KV, self.d).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = k.repeat_interleave(self.H // self.KV, dim=1), v.repeat_interleave(self.H // self.KV, dim=1)
        y = causal_attention(q, k, v).transpose(1, 2).reshape(B, Tn, self.C)
        x = x + self.o_proj(y)
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class Llama(nn.Module):
    def __init__(self, V, T, L, H, KV, C, I, rope_theta=10000.0):
        super().__init__()
        self.V = V
        self.embed_tokens = nn.Embedding(V, C)
        self.layers = nn.ModuleList(LlamaBlock(C, I, H, KV) for _ in range(L))
        self.norm = RMSNorm(C)
        self.lm_head = nn.Linear(C, V, bias=False)
        d = C // H
        inv_freq = 1.0 / (rope_theta ** (torch.arange(0, d, 2).float() / d))
        angles = torch.outer(torch.arange(T).float(), inv_freq)
        emb = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)
        for p in self.parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx, targets):
        x = self.embed_tokens(idx)
        cos, sin = self.cos[: idx.shape[1]].to(x.dtype), self.sin[: idx.shape[1]].to(x.dtype)
        for b in self.layers:
            x = b(x, cos, sin)
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits.float().view(-1, self.V), targets.view(-1))

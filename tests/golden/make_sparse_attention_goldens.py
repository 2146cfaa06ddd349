#!/usr/bin/python3
"""Writes tests/golden/sparse_attention.h5, the reference tests/model/test_sparse_attention.cpp compares
zero3d's sparse attention (src/model/sparse_attention.cpp layouts, kernels/attention_sparse.hpp) against.

Independent of zero3d and of DeepSpeed's code: the layouts are rebuilt here in NumPy from the
rules of DeepSpeed's SparsityConfig classes as DEEPSPEED-FACTS-2 §8.2 states them (dense, fixed,
variable, bigbird, bslongformer; random blocks are zero in every case, since DeepSpeed draws
them from Python's `random`), and the attention is PyTorch's dense causal attention in float64
with a token mask expanded from the layout; autograd gives the gradients.

Groups:
  /layouts/<case>     attrs config (the sparse_attention section, JSON), heads, seq_len;
                      dataset layout [heads, nb, nb] int32
  /attention/<case>   attrs config, B, T, C, H; datasets layout [H, nb, nb] int32,
                      qkv [B,T,3C], d_out [B,T,C] (upstream gradient), out [B,T,C], d_qkv [B,T,3C]

Run:  OPENBLAS_NUM_THREADS=1 /usr/bin/python3 tests/golden/make_sparse_attention_goldens.py tests/golden
"""
import json
import math
import os
import sys

import h5py
import numpy as np
import torch


def window(lay, w0, w1, uni):
    for r in range(w0, w1):
        lay[r, w0:(r + 1 if uni else w1)] = 1


def fixed(lay, h, c):
    nb = lay.shape[0]
    L, G = c.get("num_local_blocks", 4), c.get("num_global_blocks", 1)
    uni = c.get("attention", "bidirectional") == "unidirectional"
    horiz = c.get("horizontal_global_attention", False)
    patterns = c.get("num_different_global_patterns", 1)
    for i in range(0, nb, L):
        window(lay, i, min(i + L, nb), uni)
    first = L - (1 + h % patterns) * G
    end = nb - nb % L
    starts = list(range(first, end, L))
    if end < nb:
        starts.append(min(end + first, nb - G))
    for g in starts:
        lay[(g if uni else 0):, g:g + G] = 1
        if horiz:
            lay[g:g + G, :] = 1


def global_ranges(c, nb):
    starts = c.get("global_block_indices", [0])
    ends = c.get("global_block_end_indices")
    for k, g in enumerate(starts):
        if g < nb:
            yield g, (g + 1 if ends is None else min(ends[k], nb))


def variable(lay, h, c):
    nb = lay.shape[0]
    uni = c.get("attention", "bidirectional") == "unidirectional"
    horiz = c.get("horizontal_global_attention", False)
    assert c.get("num_random_blocks", 0) == 0
    start = 0
    sizes = c.get("local_window_blocks", [4])
    for w in sizes:
        window(lay, start, min(start + w, nb), uni)
        start += w
    while start < nb:
        window(lay, start, min(start + sizes[-1], nb), uni)
        start += sizes[-1]
    for g0, g1 in global_ranges(c, nb):
        if horiz:
            lay[g0:g1, :] = 1
        lay[(g0 if uni else 0):, g0:g1] = 1


def sliding(lay, blocks):
    nb = lay.shape[0]
    w = blocks // 2
    for r in range(nb):
        lay[r, max(0, r - w):min(r + w + 1, nb)] = 1


def bigbird(lay, h, c):
    assert c.get("num_random_blocks", 0) == 0
    sliding(lay, c.get("num_sliding_window_blocks", 3))
    G = c.get("num_global_blocks", 1)
    lay[:G, :] = 1
    lay[:, :G] = 1


def bslongformer(lay, h, c):
    sliding(lay, c.get("num_sliding_window_blocks", 3))
    for g0, g1 in global_ranges(c, lay.shape[0]):
        lay[g0:g1, :] = 1
        lay[:, g0:g1] = 1


def make_layout(c, heads, seq_len):
    block = c.get("block", 16)
    nb = seq_len // block
    lay = np.zeros((heads, nb, nb), dtype=np.int32)
    mode = c.get("mode", "fixed")
    per_head = c.get("different_layout_per_head", False)
    for h in range(heads if per_head else 1):
        if mode == "dense":
            lay[h] = 1
        else:
            {"fixed": fixed, "variable": variable, "bigbird": bigbird, "bslongformer": bslongformer}[mode](lay[h], h, c)
    if not per_head:
        lay[1:] = lay[0]
    return lay


LAYOUTS = {
    "dense": ({"mode": "dense", "block": 8}, 2, 64),
    "fixed_bidirectional": ({"mode": "fixed", "block": 8}, 2, 128),
    "fixed_unidirectional": ({"mode": "fixed", "block": 8, "num_local_blocks": 4, "num_global_blocks": 2,
                              "attention": "unidirectional"}, 1, 128),
    "fixed_short_last_window": ({"mode": "fixed", "block": 16, "num_local_blocks": 4}, 1, 16 * 10),
    "fixed_per_head_patterns": ({"mode": "fixed", "block": 16, "different_layout_per_head": True,
                                 "num_local_blocks": 4, "num_global_blocks": 1, "attention": "bidirectional",
                                 "horizontal_global_attention": False, "num_different_global_patterns": 4}, 6, 128),
    "fixed_horizontal": ({"mode": "fixed", "block": 8, "num_local_blocks": 3, "horizontal_global_attention": True},
                         1, 8 * 11),
    "variable_windows": ({"mode": "variable", "block": 8, "local_window_blocks": [1, 2, 3],
                          "global_block_indices": [0, 5]}, 1, 8 * 13),
    "variable_ranges_unidirectional": ({"mode": "variable", "block": 8, "local_window_blocks": [2],
                                        "global_block_indices": [1, 6], "global_block_end_indices": [3, 9],
                                        "attention": "unidirectional"}, 2, 8 * 12),
    "bigbird": ({"mode": "bigbird", "block": 8, "num_sliding_window_blocks": 3, "num_global_blocks": 2}, 1, 80),
    "bslongformer": ({"mode": "bslongformer", "block": 8, "num_sliding_window_blocks": 5,
                      "global_block_indices": [0, 4]}, 1, 80),
    "bslongformer_ranges": ({"mode": "bslongformer", "block": 8, "global_block_indices": [2],
                             "global_block_end_indices": [4]}, 1, 64),
}

ATTENTION = {
    # B, T, C, H: head size C/H = 8
    "fixed_per_head": ({"mode": "fixed", "block": 8, "different_layout_per_head": True, "num_local_blocks": 2,
                        "num_different_global_patterns": 2}, 2, 64, 32, 4),
    "variable_unidirectional": ({"mode": "variable", "block": 4, "local_window_blocks": [3, 1],
                                 "global_block_indices": [2], "attention": "unidirectional"}, 1, 48, 16, 2),
    "bslongformer": ({"mode": "bslongformer", "block": 8, "num_sliding_window_blocks": 3}, 1, 64, 16, 2),
    "dense": ({"mode": "dense", "block": 8}, 2, 32, 16, 2),
}


def attention_case(c, B, T, C, H, gen):
    lay = make_layout(c, H, T)
    block = c.get("block", 16)
    hs = C // H
    qkv = torch.randn(B, T, 3 * C, generator=gen, dtype=torch.float32).to(torch.float64).requires_grad_(True)
    d_out = torch.randn(B, T, C, generator=gen, dtype=torch.float32).to(torch.float64)
    q, k, v = qkv.split(C, dim=2)
    q, k, v = (t.reshape(B, T, H, hs).transpose(1, 2) for t in (q, k, v))  # [B, H, T, hs]
    token = torch.from_numpy(np.kron(lay, np.ones((block, block), dtype=np.int32))).bool()  # [H, T, T]
    causal = torch.tril(torch.ones(T, T, dtype=torch.bool))
    allowed = token & causal
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(hs)
    scores = scores.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(scores, dim=-1)
    out = (p @ v).transpose(1, 2).reshape(B, T, C)
    (out * d_out).sum().backward()
    return lay, qkv.detach(), d_out, out.detach(), qkv.grad


def main(out_dir):
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(2024)
    with h5py.File(os.path.join(out_dir, "sparse_attention.h5"), "w") as f:
        for name, (c, heads, seq_len) in LAYOUTS.items():
            g = f.create_group("layouts/" + name)
            g.attrs["config"] = np.bytes_(json.dumps(c))  # fixed-length, as zero3d's h5 reader expects
            g.attrs["heads"] = np.int64(heads)
            g.attrs["seq_len"] = np.int64(seq_len)
            g["layout"] = make_layout(c, heads, seq_len)
        for name, (c, B, T, C, H) in ATTENTION.items():
            lay, qkv, d_out, out, d_qkv = attention_case(c, B, T, C, H, gen)
            g = f.create_group("attention/" + name)
            g.attrs["config"] = np.bytes_(json.dumps(c))  # fixed-length, as zero3d's h5 reader expects
            for key, val in (("B", B), ("T", T), ("C", C), ("H", H)):
                g.attrs[key] = np.int64(val)
            g["layout"] = lay
            g["qkv"] = qkv.numpy().astype(np.float32)
            g["d_out"] = d_out.numpy().astype(np.float32)
            g["out"] = out.numpy().astype(np.float32)
            g["d_qkv"] = d_qkv.numpy().astype(np.float32)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__)))

#!/usr/bin/python3
"""Writes tests/golden/llama_kernels.h5, the reference tests/kernels/test_llama_kernels.cpp compares
the Llama-family kernels (kernels/rmsnorm.hpp, kernels/rope.hpp, kernels/swiglu.hpp) against.

Independent references in plain PyTorch (Debian's python3-torch 1.13; transformers is not
installed), written from Hugging Face's definitions, not imported:
  * RMSNorm as LlamaRMSNorm (models/llama/modeling_llama.py): w · x · rsqrt(mean(x²) + eps);
  * RoPE as apply_rotary_pos_emb with rotate_half (the non-interleaved halves), cos/sin =
    cos/sin(position · inv_freq) repeated over both halves and multiplied by the attention
    factor, inv_freq from the formulas of transformers' src/transformers/modeling_rope_utils.py
    (_compute_default_rope_parameters, _compute_linear_scaling_rope_parameters,
    _compute_dynamic_ntk_parameters, _compute_yarn_parameters, _compute_llama3_parameters), with
    GQA (q has H heads, k and v Hkv) in a fused [q | k | v] row per token;
  * SwiGLU as LlamaMLP's act_fn(gate) · up with act_fn = F.silu.
Everything runs in float64 from float32-rounded inputs; autograd gives the gradients of
loss = Σ output ⊙ d_out. Stored as float32.

The file holds
  rmsnorm/  x [N,C], weight [C], d_out [N,C], out [N,C], rstd [N], grads/x [N,C], grads/weight [C],
            eps []
  swiglu/   gate [N,I], up [N,I], d_out [N,I], out [N,I], grads/gate [N,I], grads/up [N,I]
  rope/<case>/  qkv [B,T,(H+2Hkv)·hd], d_out (same), out (same: q and k rotated, v as it was),
            grads/qkv (same), inv_freq [hd/2], attention_factor [], params [see ROPE_PARAMS]
  attributes B, T, C, I, H, Hkv, head_dim

Run:  OPENBLAS_NUM_THREADS=1 /usr/bin/python3 tests/golden/make_llama_kernels_golden.py tests/golden
"""
import math
import os
import sys

import h5py
import numpy as np
import torch

torch.set_num_threads(1)
torch.set_default_dtype(torch.float64)

B, T, C, I, H, HKV, HEAD_DIM = 2, 8, 64, 96, 4, 2, 16
RMS_EPS = 1e-6

# The order of /rope/<case>/params; a key a rope type does not read is stored as it is here.
ROPE_PARAMS = ["theta", "factor", "max_position_embeddings", "original_max_position_embeddings", "low_freq_factor",
               "high_freq_factor", "beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim",
               "seq_len"]
BASE = dict(theta=10000.0, factor=1.0, max_position_embeddings=2048, original_max_position_embeddings=0,
            low_freq_factor=1.0, high_freq_factor=4.0, beta_fast=32.0, beta_slow=1.0, attention_factor=0.0,
            mscale=0.0, mscale_all_dim=0.0, seq_len=T)  # 0: not given (HF's None)

ROPE_CASES = {
    "default": dict(type="default"),
    "linear": dict(type="linear", factor=4.0),
    # max_position_embeddings 4 < T 8: the dynamic NTK base grows (HF's seq_len = max position + 1)
    "dynamic": dict(type="dynamic", factor=2.0, max_position_embeddings=4),
    # original 2048 at head_dim 16: the ramp runs over dimensions 2..6 of 8, so every branch shows
    "yarn": dict(type="yarn", factor=4.0, max_position_embeddings=8192, original_max_position_embeddings=2048),
    # explicit betas and DeepSeek's mscale pair (attention_factor = mscale(f, m) / mscale(f, m_all))
    "yarn_mscale": dict(type="yarn", factor=8.0, max_position_embeddings=8192, original_max_position_embeddings=1024,
                        beta_fast=16.0, beta_slow=2.0, mscale=1.0, mscale_all_dim=0.8, theta=50000.0),
    # wavelengths 6.3 … 19870 against 8192/1 and 8192/4: all three llama3 regions
    "llama3": dict(type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192, theta=10000.0, max_position_embeddings=131072),
}


def default_inv_freq(base, dim):
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).double() / dim))


def rope_inv_freq(p, dim):
    """(inv_freq [dim/2], attention_factor), modeling_rope_utils.py's formulas, in float64."""
    t, base = p["type"], p["theta"]
    if t == "default":
        return default_inv_freq(base, dim), 1.0
    if t == "linear":
        return default_inv_freq(base, dim) / p["factor"], 1.0
    if t == "dynamic":
        max_pos = p["max_position_embeddings"]
        seq_len = max(p["seq_len"], max_pos)
        base = base * ((p["factor"] * seq_len / max_pos) - (p["factor"] - 1)) ** (dim / (dim - 2))
        return default_inv_freq(base, dim), 1.0
    if t == "yarn":
        factor = p["factor"]
        orig = p["original_max_position_embeddings"] or p["max_position_embeddings"]

        def get_mscale(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if p["attention_factor"]:
            attention = p["attention_factor"]
        elif p["mscale"] and p["mscale_all_dim"]:
            attention = get_mscale(factor, p["mscale"]) / get_mscale(factor, p["mscale_all_dim"])
        else:
            attention = get_mscale(factor)

        def correction_dim(rotations):
            return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

        low = max(math.floor(correction_dim(p["beta_fast"])), 0)
        high = min(math.ceil(correction_dim(p["beta_slow"])), dim - 1)
        if low == high:
            high += 0.001
        ramp = torch.clamp((torch.arange(dim // 2).double() - low) / (high - low), 0, 1)
        pos_freqs = base ** (torch.arange(0, dim, 2).double() / dim)
        extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
        extrapolation_factor = 1 - ramp
        return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor, attention
    if t == "llama3":
        inv = default_inv_freq(base, dim)
        factor, lo, hi = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
        old = p["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / hi) * ~(wavelen > old / lo)
        return torch.where(medium, smoothed, scaled), 1.0
    raise ValueError(t)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def rope_reference(qkv, inv_freq, attention):
    """HF's rotary embedding + apply_rotary_pos_emb on a fused [B, T, (H + 2Hkv)·hd] buffer."""
    pos = torch.arange(T).double()
    freqs = pos[:, None] * inv_freq[None, :]  # [T, hd/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = (emb.cos() * attention)[None, None], (emb.sin() * attention)[None, None]  # [1, 1, T, hd]
    q = qkv[..., : H * HEAD_DIM].reshape(B, T, H, HEAD_DIM).transpose(1, 2)
    k = qkv[..., H * HEAD_DIM: (H + HKV) * HEAD_DIM].reshape(B, T, HKV, HEAD_DIM).transpose(1, 2)
    v = qkv[..., (H + HKV) * HEAD_DIM:]
    q_embed = q * cos + rotate_half(q) * sin
    k_embed = k * cos + rotate_half(k) * sin
    return torch.cat((q_embed.transpose(1, 2).reshape(B, T, -1), k_embed.transpose(1, 2).reshape(B, T, -1), v), -1)


def f32(t):
    return t.detach().numpy().astype(np.float32)


def leaf(shape, gen, scale=1.0, shift=0.0):
    x = (torch.randn(*shape, generator=gen) * scale + shift).float().double()  # float32-rounded
    return x.requires_grad_(True)


def main(out_dir):
    gen = torch.Generator().manual_seed(32)
    path = os.path.join(out_dir, "llama_kernels.h5")
    with h5py.File(path, "w") as f:
        for k, v in dict(B=B, T=T, C=C, I=I, H=H, Hkv=HKV, head_dim=HEAD_DIM).items():
            f.attrs[k] = np.int64(v)

        # RMSNorm (Zhang & Sennrich 2019) as LlamaRMSNorm, fp32 statistics (here float64)
        x = leaf((B * T, C), gen, 1.0, 0.3)
        w = leaf((C,), gen, 0.2, 1.0)
        d = leaf((B * T, C), gen).detach()
        variance = x.pow(2).mean(-1, keepdim=True)
        rstd = torch.rsqrt(variance + RMS_EPS)
        out = w * (x * rstd)
        (out * d).sum().backward()
        g = f.create_group("rmsnorm")
        for name, t in dict(x=x, weight=w, d_out=d, out=out, rstd=rstd.reshape(-1)).items():
            g.create_dataset(name, data=f32(t))
        g.create_dataset("grads/x", data=f32(x.grad))
        g.create_dataset("grads/weight", data=f32(w.grad))
        g.create_dataset("eps", data=np.float64(RMS_EPS))

        # SwiGLU (Shazeer 2020) as LlamaMLP's silu(gate) · up
        gate = leaf((B * T, I), gen, 2.0)
        up = leaf((B * T, I), gen)
        d = leaf((B * T, I), gen).detach()
        out = torch.nn.functional.silu(gate) * up
        (out * d).sum().backward()
        g = f.create_group("swiglu")
        for name, t in dict(gate=gate, up=up, d_out=d, out=out).items():
            g.create_dataset(name, data=f32(t))
        g.create_dataset("grads/gate", data=f32(gate.grad))
        g.create_dataset("grads/up", data=f32(up.grad))

        # RoPE (Su et al., RoFormer), one case per rope type
        width = (H + 2 * HKV) * HEAD_DIM
        for case, spec in ROPE_CASES.items():
            p = dict(BASE, **spec)
            inv_freq, attention = rope_inv_freq(p, HEAD_DIM)
            qkv = leaf((B, T, width), gen)
            d = leaf((B, T, width), gen).detach()
            out = rope_reference(qkv, inv_freq, attention)
            (out * d).sum().backward()
            g = f.create_group("rope/" + case)
            g.attrs["type"] = p["type"]
            g.create_dataset("params", data=np.array([float(p[k]) for k in ROPE_PARAMS], dtype=np.float64))
            g.create_dataset("qkv", data=f32(qkv))
            g.create_dataset("d_out", data=f32(d))
            g.create_dataset("out", data=f32(out))
            g.create_dataset("grads/qkv", data=f32(qkv.grad))
            g.create_dataset("inv_freq", data=inv_freq.numpy())
            g.create_dataset("attention_factor", data=np.float64(attention))
            print(case, "inv_freq", " ".join("%.4g" % v for v in inv_freq.tolist()), "attention %.6f" % attention)
    print("wrote", path)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__)))

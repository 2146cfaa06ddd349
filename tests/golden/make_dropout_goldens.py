#!/usr/bin/python3
"""Writes dropout.h5, the dropout goldens tests/model/test_dropout.cpp compares zero3d against.

Independent reference, written here without zero3d's code:
  * the mask stream of kernels/dropout.hpp, re-implemented in NumPy from its description:
    element e of global sample s at (layer, site) is kept when the top 24 bits of
    splitmix64(stream + (e + 1)·γ) are >= floor(p·2^24), where
    stream = mix(mix(mix(seed ^ K) ^ s) ^ (layer·256 + site)), mix SplitMix64's finaliser,
    γ = 0x9E3779B97F4A7C15, K = 0xD1B54A32D192ED03; kept values are scaled by 1/(1 - p).
    Sites: 0 the embedding sum (element t·C + c), 1 the attention probabilities (element
    (h·T + i)·T + j), 2 attn.c_proj's output and 3 mlp.c_proj's (element t·C + c).
  * Hugging Face's GPT-2 with dropout (modeling_gpt2.py: GPT2Model.drop after wte + wpe,
    GPT2Attention.attn_dropout on the softmax probabilities and resid_dropout on c_proj's output,
    GPT2MLP.dropout on its c_proj's output), in float64 PyTorch, on gpt_tiny.h5's weights, batch
    and AdamW settings (make_goldens.py), with the masks above multiplied in where nn.Dropout sits.
  * Hugging Face's Llama with attention_dropout (LlamaAttention: dropout on attn_weights in
    training), make_llama_goldens.py's float64 model on llama_gqa.h5's weights, the masks at site 1.
  * Causal attention alone with attn_pdrop, in float64 PyTorch: dense (the reference of the fp32
    and bf16 kernels), and block-sparse with make_sparse_attention_goldens.py's layout expanded to a
    token mask: the probabilities of the computed blocks times the dense mask's factors at
    element (h·T + i)·T + j (the global key j), which is what every layout draws.
Step s (0-based) of B samples draws samples s·B .. s·B + B - 1 (zero3d's global sample index).

dropout.h5:
  /mask/keep [3, 4096] int8: sample 0..2 of (seed 99, first sample 5, layer 3, site 1, p 0.3), elements 0..4095
  /<case>/adamw_losses [S], /<case>/grad_norms [S] (before clipping), attributes seed, embd, attn, resid
  case gpt2: gpt_tiny.h5;  case llama: llama_gqa.h5 (its hf_config with attention_dropout)
  /attention/<case>: attrs config (sparse_attention, JSON), B, T, C, H, seed, first_sample, layer, p;
    layout [H, nb, nb] int32, qkv [B,T,3C], d_out [B,T,C], out [B,T,C], d_qkv [B,T,3C] (float32,
    gradients of sum(out * d_out));  case dense (T 128), fixed (DeepSpeed's fixed layout, per head)

Run:  OPENBLAS_NUM_THREADS=1 /usr/bin/python3 tests/golden/make_dropout_goldens.py tests/golden
"""
import json
import math
import os
import sys

import h5py
import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_llama_goldens as llama  # noqa: E402  (the float64 Llama's pieces: norms, RoPE, head)
import make_sparse_attention_goldens as sparse  # noqa: E402  (DeepSpeed's layouts, rebuilt in NumPy)

torch.set_num_threads(1)
torch.set_default_dtype(torch.float64)

MASK64 = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15
STEPS = 5
EMBEDDING, PROBABILITIES, ATTENTION_OUTPUT, MLP_OUTPUT = 0, 1, 2, 3


def mix_int(z):
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def mix_array(z):
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def stream(seed, sample, layer, site):
    h = mix_int(seed ^ 0xD1B54A32D192ED03)
    h = mix_int(h ^ sample)
    return mix_int(h ^ (layer * 256 + site))


def keep_bits(p, seed, sample, layer, site, n):
    """bool [n]: which of elements 0..n-1 of the sample's stream are kept."""
    e = np.arange(n, dtype=np.uint64)
    with np.errstate(over="ignore"):
        x = mix_array(np.uint64(stream(seed, sample, layer, site)) + (e + np.uint64(1)) * np.uint64(GAMMA))
    return (x >> np.uint64(40)) >= np.uint64(math.floor(p * 16777216.0))


def mask(p, seed, first, layer, site, shape):
    """[B, *shape] float64 factors (0 or 1/(1 - p)) of samples first .. first + B - 1; None for p 0."""
    if p == 0.0:
        return None
    B, n = shape[0], int(np.prod(shape[1:]))
    m = np.stack([keep_bits(p, seed, first + b, layer, site, n) for b in range(B)]) / (1.0 - p)
    return torch.tensor(m.reshape(shape))


def dropped(x, m):
    return x if m is None else x * m


def layernorm(x, w, b):
    return torch.nn.functional.layer_norm(x, (x.shape[-1],), w, b, eps=1e-5)


def gpt2_forward(p, tokens, L, H, rates, seed, first):
    B, T = tokens.shape
    C = p["wte.weight"].shape[1]
    hs = C // H
    x = dropped(p["wte.weight"][tokens] + p["wpe.weight"][:T], mask(rates["embd"], seed, first, 0, EMBEDDING, (B, T, C)))
    causal = torch.tril(torch.ones(T, T, dtype=torch.bool))
    for l in range(L):
        n = f"h.{l}."
        h = layernorm(x, p[n + "ln_1.weight"], p[n + "ln_1.bias"])
        qkv = h @ p[n + "attn.c_attn.weight"] + p[n + "attn.c_attn.bias"]
        q, k, v = (t.view(B, T, H, hs).transpose(1, 2) for t in qkv.split(C, dim=2))
        att = ((q @ k.transpose(-2, -1)) / math.sqrt(hs)).masked_fill(~causal, float("-inf")).softmax(dim=-1)
        att = dropped(att, mask(rates["attn"], seed, first, l, PROBABILITIES, (B, H, T, T)))
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        y = y @ p[n + "attn.c_proj.weight"] + p[n + "attn.c_proj.bias"]
        x = x + dropped(y, mask(rates["resid"], seed, first, l, ATTENTION_OUTPUT, (B, T, C)))
        h = layernorm(x, p[n + "ln_2.weight"], p[n + "ln_2.bias"])
        h = torch.nn.functional.gelu(h @ p[n + "mlp.c_fc.weight"] + p[n + "mlp.c_fc.bias"], approximate="tanh")
        h = h @ p[n + "mlp.c_proj.weight"] + p[n + "mlp.c_proj.bias"]
        x = x + dropped(h, mask(rates["resid"], seed, first, l, MLP_OUTPUT, (B, T, C)))
    x = layernorm(x, p["ln_f.weight"], p["ln_f.bias"])
    return x @ p["wte.weight"].T


def llama_forward(p, tokens, s, rate, seed, first):
    B, T = tokens.shape
    cos, sin = llama.rope_cos_sin(s, T)
    x = p["model.embed_tokens.weight"][tokens]
    for l in range(s.L):
        n = f"model.layers.{l}."
        x = llama.attention_half(p, n, x, s, l, cos, sin, mask(rate, seed, first, l, PROBABILITIES, (B, s.H, T, T)))
        h = llama.rms_norm(x, p[n + "post_attention_layernorm.weight"], s.eps)
        gate, up = llama.linear(h, p, n + "mlp.gate_proj"), llama.linear(h, p, n + "mlp.up_proj")
        x = x + llama.linear(torch.nn.functional.silu(gate) * up, p, n + "mlp.down_proj")
    return llama.lm_head(p, x, s)


def attention_case(f, name, c, B, T, C, H, p, seed, first, layer, gen):
    """Causal attention with the probabilities of the layout's blocks dropped; output and gradients."""
    lay = sparse.make_layout(c, H, T)
    block, hs = c["block"], C // H
    qkv = torch.randn(B, T, 3 * C, generator=gen, dtype=torch.float32).to(torch.float64).requires_grad_(True)
    d_out = torch.randn(B, T, C, generator=gen, dtype=torch.float32).to(torch.float64)
    q, k, v = (t.reshape(B, T, H, hs).transpose(1, 2) for t in qkv.split(C, dim=2))
    allowed = torch.from_numpy(np.kron(lay, np.ones((block, block), dtype=np.int32))).bool()
    allowed = allowed & torch.tril(torch.ones(T, T, dtype=torch.bool))
    att = ((q @ k.transpose(-1, -2)) / math.sqrt(hs)).masked_fill(~allowed, float("-inf")).softmax(dim=-1)
    out = (dropped(att, mask(p, seed, first, layer, PROBABILITIES, (B, H, T, T))) @ v).transpose(1, 2).reshape(B, T, C)
    (out * d_out).sum().backward()
    g = f.create_group("attention/" + name)
    g.attrs["config"] = np.bytes_(json.dumps(c))  # fixed-length, as zero3d's h5 reader expects
    for key, val in (("B", B), ("T", T), ("C", C), ("H", H), ("seed", seed), ("first_sample", first), ("layer", layer)):
        g.attrs[key] = np.int64(val)
    g.attrs["p"] = p
    g["layout"] = lay
    for key, val in (("qkv", qkv.detach()), ("d_out", d_out), ("out", out.detach()), ("d_qkv", qkv.grad)):
        g[key] = val.numpy().astype(np.float32)
    print(f"attention/{name}: |out| {out.abs().mean().item():.4f}, |d_qkv| {qkv.grad.abs().mean().item():.4f}")


def read_golden(path):
    with h5py.File(path, "r") as f:
        params = {name: torch.tensor(np.array(f[name]), dtype=torch.float64).requires_grad_(True)
                  for name in f.keys() if name != "golden"}
        tokens = torch.tensor(np.array(f["golden/inputs"]), dtype=torch.long)
        targets = torch.tensor(np.array(f["golden/targets"]), dtype=torch.long)
        hp = [float(v) for v in np.array(f["golden/hparams"])]
        attrs = dict(f.attrs)
    return params, tokens, targets, hp, attrs


def adamw(params, hp, logits_of, targets, V):
    """STEPS AdamW steps; logits_of(step) is the forward of step s. Losses and norms before clipping."""
    lr, b1, b2, eps, wd, clip = hp
    opt = torch.optim.AdamW(params.values(), lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
    losses, norms = [], []
    for step in range(STEPS):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(logits_of(step).reshape(-1, V), targets.reshape(-1))
        losses.append(loss.item())
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(params.values(), clip if clip > 0 else float("inf")).item())
        opt.step()
    return losses, norms


def write_case(f, name, losses, norms, seed, rates):
    g = f.create_group(name)
    g.attrs["seed"] = np.int64(seed)
    for key, value in rates.items():
        g.attrs[key] = value
    g.create_dataset("adamw_losses", data=np.array(losses))
    g.create_dataset("grad_norms", data=np.array(norms))
    print(f"{name}: loss {losses[0]:.6f} -> {losses[-1]:.6f}, grad norm {norms[0]:.4f}")


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
    with h5py.File(os.path.join(out, "dropout.h5"), "w") as f:
        f.create_dataset("mask/keep", data=np.stack([keep_bits(0.3, 99, 5 + b, 3, PROBABILITIES, 4096)
                                                     for b in range(3)]).astype(np.int8))

        params, tokens, targets, hp, attrs = read_golden(os.path.join(out, "gpt_tiny.h5"))
        L, H, V = int(attrs["n_layer"]), int(attrs["n_head"]), int(attrs["vocab_size"])
        B = tokens.shape[0]
        rates, seed = dict(embd=0.1, attn=0.2, resid=0.15), 1234
        losses, norms = adamw(params, hp, lambda s: gpt2_forward(params, tokens, L, H, rates, seed, s * B), targets, V)
        write_case(f, "gpt2", losses, norms, seed, rates)

        params, tokens, targets, hp, attrs = read_golden(os.path.join(out, "llama_gqa.h5"))
        cfg = json.loads(attrs["hf_config"])
        s = llama.Shape(cfg, tokens.shape[1])
        B, rate, seed = tokens.shape[0], 0.25, 4321
        losses, norms = adamw(params, hp, lambda st: llama_forward(params, tokens, s, rate, seed, st * B), targets, s.V)
        write_case(f, "llama", losses, norms, seed, dict(embd=0.0, attn=rate, resid=0.0))

        gen = torch.Generator().manual_seed(32)
        attention_case(f, "dense", {"mode": "dense", "block": 8}, 2, 128, 16, 2, 0.2, 17, 6, 1, gen)
        attention_case(f, "fixed", {"mode": "fixed", "block": 8, "different_layout_per_head": True,
                                    "num_local_blocks": 2, "num_different_global_patterns": 2},
                       2, 64, 16, 4, 0.3, 77, 3, 2, gen)


if __name__ == "__main__":
    main()

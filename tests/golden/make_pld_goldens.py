#!/usr/bin/python3
"""Writes pld.h5, the progressive-layer-drop goldens tests/model/test_pld.cpp compares against.

Independent references, written here without zero3d's code:
  * DeepSpeed's ProgressiveLayerDrop (runtime/progressive_layer_drop.py; DEEPSPEED-FACTS-2 §7.2):
    current_theta starts at 1.0 and update_state(global_step) sets
    (1 - theta) * np.exp(-gamma * global_step) + theta. DeepSpeed's tests/unit/runtime/test_pld.py
    checks get_pld_theta() after step i against that formula for theta in {0, 0.1, 0.9, 1.0},
    gamma 0.001. /theta/<name> holds get_theta() after update_state(i), i = 0..N-1.
  * Training with layer drop on the tiny goldens of make_goldens.py (gpt_tiny.h5, gpt_ragged.h5:
    their weights, batch and AdamW hyper-parameters), in float64 PyTorch. Each step s (0-based)
    runs with the theta DeepSpeed holds then (1.0, then theta(s-1)); block l of L is kept with
    p = 1 - l*(1 - theta)/L (DeepSpeedExamples' BertEncoder: the first block always runs), the
    decision a uniform draw of zero3d's counter RNG (SplitMix64, reimplemented below) keyed by
    (seed, step, micro-batch 0, block) below p; a dropped block is the identity, a kept one adds
    attn/p and mlp/p to the residual stream (BertLayer's 1/keep_prob on both branches).
    /<config>/losses [S], /<config>/scales [S, L] (0 dropped, else 1/p), attributes seed, theta, gamma.

Run:  OPENBLAS_NUM_THREADS=1 /usr/bin/python3 tests/golden/make_pld_goldens.py tests/golden
"""
import math
import os
import sys

import h5py
import numpy as np
import torch

torch.set_num_threads(1)
torch.set_default_dtype(torch.float64)

MASK = (1 << 64) - 1
THETAS = {"0": 0.0, "0.1": 0.1, "0.9": 0.9, "1.0": 1.0}
THETA_STEPS = 2000
# (golden file, seed, theta_bar, gamma, steps): gamma large enough that blocks drop within the steps
TRAIN = [("gpt_tiny", 1234, 0.0, 0.5, 10), ("gpt_ragged", 77, 0.2, 0.3, 10)]


class ProgressiveLayerDrop:
    """DeepSpeed's class, as its source defines it."""

    def __init__(self, theta=0.5, gamma=0.001):
        self.theta = theta
        self.gamma = gamma
        self.current_theta = 1.0

    def get_theta(self):
        return self.current_theta

    def update_state(self, global_step):
        def _prob(x, gamma, p):
            return (1. - p) * np.exp(-gamma * x) + p

        self.current_theta = _prob(global_step, self.gamma, self.theta)


def fnv1a(s):
    h = 1469598103934665603
    for c in s.encode():
        h = ((h ^ c) * 1099511628211) & MASK
    return h


def mix(z):
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def uniform(seed, stream):
    """The first uniform() of zero3d's Rng(seed, stream) (src/base/rng.hpp: SplitMix64)."""
    state = ((seed * 0x9E3779B97F4A7C15) & MASK) ^ mix((stream + 1) & MASK)
    state = (state + 0x9E3779B97F4A7C15) & MASK
    return (mix(state) >> 11) * (1.0 / 9007199254740992.0)


def block_scales(seed, step, micro, theta, L):
    out = []
    for l in range(L):
        p = 1.0 - l * (1.0 - theta) / L
        keep = p >= 1.0 or uniform(seed, fnv1a(f"pld/{step}/{micro}/{l}")) < p
        out.append(1.0 / p if keep else 0.0)
    return out


def layernorm(x, w, b):
    return torch.nn.functional.layer_norm(x, (x.shape[-1],), w, b, eps=1e-5)


def forward(p, tokens, L, H, scales):
    B, T = tokens.shape
    C = p["wte.weight"].shape[1]
    hs = C // H
    x = p["wte.weight"][tokens] + p["wpe.weight"][:T]
    mask = torch.tril(torch.ones(T, T, dtype=torch.bool))
    for l in range(L):
        if scales[l] == 0.0:
            continue  # dropped: the identity
        n = f"h.{l}."
        h = layernorm(x, p[n + "ln_1.weight"], p[n + "ln_1.bias"])
        qkv = h @ p[n + "attn.c_attn.weight"] + p[n + "attn.c_attn.bias"]
        q, k, v = (t.view(B, T, H, hs).transpose(1, 2) for t in qkv.split(C, dim=2))
        att = ((q @ k.transpose(-2, -1)) / math.sqrt(hs)).masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        x = x + (y @ p[n + "attn.c_proj.weight"] + p[n + "attn.c_proj.bias"]) * scales[l]
        h = layernorm(x, p[n + "ln_2.weight"], p[n + "ln_2.bias"])
        h = torch.nn.functional.gelu(h @ p[n + "mlp.c_fc.weight"] + p[n + "mlp.c_fc.bias"], approximate="tanh")
        x = x + (h @ p[n + "mlp.c_proj.weight"] + p[n + "mlp.c_proj.bias"]) * scales[l]
    x = layernorm(x, p["ln_f.weight"], p["ln_f.bias"])
    return x @ p["wte.weight"].T


def train(golden, seed, theta_bar, gamma, steps):
    with h5py.File(golden, "r") as f:
        L, H, V = int(f.attrs["n_layer"]), int(f.attrs["n_head"]), int(f.attrs["vocab_size"])
        params = {name: torch.tensor(np.array(f[name]), dtype=torch.float64).requires_grad_(True)
                  for name in f.keys() if name != "golden"}
        tokens = torch.tensor(np.array(f["golden/inputs"]), dtype=torch.long)
        targets = torch.tensor(np.array(f["golden/targets"]), dtype=torch.long)
        lr, b1, b2, eps, wd, clip = (float(v) for v in np.array(f["golden/hparams"]))
    pld = ProgressiveLayerDrop(theta=theta_bar, gamma=gamma)
    opt = torch.optim.AdamW(params.values(), lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
    losses, scales = [], []
    for step in range(steps):
        s = block_scales(seed, step, 0, pld.get_theta(), L)
        scales.append(s)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(forward(params, tokens, L, H, s).view(-1, V), targets.view(-1))
        losses.append(loss.item())
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(params.values(), clip)
        opt.step()
        pld.update_state(step)  # DeepSpeed's step(): the pre-increment global step
    return np.array(losses), np.array(scales)


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
    with h5py.File(os.path.join(out, "pld.h5"), "w") as f:
        g = f.create_group("theta")
        g.attrs["gamma"] = 0.001
        for name, theta in THETAS.items():
            pld = ProgressiveLayerDrop(theta=theta, gamma=0.001)
            values = []
            for i in range(THETA_STEPS):
                pld.update_state(i)
                values.append(float(pld.get_theta()))
            g.create_dataset(name, data=np.array(values, dtype=np.float64))
            g[name].attrs["theta"] = theta
        for name, seed, theta_bar, gamma, steps in TRAIN:
            losses, scales = train(os.path.join(out, name + ".h5"), seed, theta_bar, gamma, steps)
            t = f.create_group(name)
            t.attrs["seed"] = seed
            t.attrs["theta"] = theta_bar
            t.attrs["gamma"] = gamma
            t.create_dataset("losses", data=losses.astype(np.float32))
            t.create_dataset("scales", data=scales.astype(np.float32))
            dropped = int((scales == 0).sum())
            scaled = int(((scales != 0) & (scales != 1)).sum())
            assert dropped > 0 and scaled > 0, "choose a seed whose steps drop and scale blocks"
            print(f"{name}: {dropped} blocks dropped, {scaled} scaled by 1/p; loss {losses[0]:.6f} -> {losses[-1]:.6f}")


if __name__ == "__main__":
    main()

#!/usr/bin/python3
"""Writes the frozen-parameter goldens tests/cli/test_cli_frozen.cpp compares against.

Independent reference, written here without zero3d's code: a fine-tuning run in PyTorch where the
parameters matched by FROZEN (re.search over Hugging Face GPT-2 names, as model.frozen_parameters
matches them) have requires_grad=False and are left out of torch.optim.AdamW's param group, as
DeepSpeed builds its optimizer groups from trainable parameters only. Gradient clipping
(torch.nn.utils.clip_grad_norm_) runs over the trainable parameters alone.

The model is the tiny GPT-2 of make_goldens.py (V 64, T 16, L 2, H 2, C 32, tied head), its
weights drawn here (seed SEED); the data is an llm.c token shard whose sample s is tokens
[s·T, s·T + T + 1) (src/io/data.hpp), step k training on samples k·BATCH .. k·BATCH + BATCH − 1,
the loss their mean token cross-entropy.

Files:
  frozen_init.h5    the initial weights (model.init_from), attributes n_layer, n_head, ...
  frozen_tokens.bin the token shard (header: 256 int32, magic 20240520, version 1, count; uint16)
  frozen.h5         losses [STEPS] (each step's loss before its update), grad_norms [STEPS]
                    (of the trainable parameters, before clipping), final/<name> (every
                    parameter after STEPS steps), attributes frozen (the patterns), hparams.

Run:  OPENBLAS_NUM_THREADS=1 /usr/bin/python3 tests/golden/make_frozen_goldens.py tests/golden
"""
import math
import os
import re
import sys

import h5py
import numpy as np
import torch

torch.set_num_threads(1)
torch.set_default_dtype(torch.float64)

V, T, L, H, C = 64, 16, 2, 2, 32
SEED = 20261127
BATCH, STEPS = 8, 6
LR, B1, B2, EPS, WD, CLIP = 1e-2, 0.9, 0.999, 1e-8, 0.1, 0.5
# Block 0 whole, the position embedding, and one bias of block 1: frozen ranges inside units and,
# at two ranks, across the partition boundary.
FROZEN = [r"^h\.0\.", r"wpe\.weight", r"h\.1\.mlp\.c_fc\.bias"]


def shapes():
    out = {"wte.weight": (V, C), "wpe.weight": (T, C)}
    for l in range(L):
        n = f"h.{l}."
        out.update({n + "ln_1.weight": (C,), n + "ln_1.bias": (C,), n + "attn.c_attn.weight": (C, 3 * C),
                    n + "attn.c_attn.bias": (3 * C,), n + "attn.c_proj.weight": (C, C), n + "attn.c_proj.bias": (C,),
                    n + "ln_2.weight": (C,), n + "ln_2.bias": (C,), n + "mlp.c_fc.weight": (C, 4 * C),
                    n + "mlp.c_fc.bias": (4 * C,), n + "mlp.c_proj.weight": (4 * C, C), n + "mlp.c_proj.bias": (C,)})
    out.update({"ln_f.weight": (C,), "ln_f.bias": (C,)})
    return out


def layernorm(x, w, b):
    return torch.nn.functional.layer_norm(x, (x.shape[-1],), w, b, eps=1e-5)


def forward(p, tokens):
    B, Tn = tokens.shape
    hs = C // H
    x = p["wte.weight"][tokens] + p["wpe.weight"][:Tn]
    mask = torch.tril(torch.ones(Tn, Tn, dtype=torch.bool))
    for l in range(L):
        n = f"h.{l}."
        h = layernorm(x, p[n + "ln_1.weight"], p[n + "ln_1.bias"])
        qkv = h @ p[n + "attn.c_attn.weight"] + p[n + "attn.c_attn.bias"]
        q, k, v = (t.view(B, Tn, H, hs).transpose(1, 2) for t in qkv.split(C, dim=2))
        att = ((q @ k.transpose(-2, -1)) / math.sqrt(hs)).masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(B, Tn, C)
        x = x + y @ p[n + "attn.c_proj.weight"] + p[n + "attn.c_proj.bias"]
        h = layernorm(x, p[n + "ln_2.weight"], p[n + "ln_2.bias"])
        h = torch.nn.functional.gelu(h @ p[n + "mlp.c_fc.weight"] + p[n + "mlp.c_fc.bias"], approximate="tanh")
        x = x + h @ p[n + "mlp.c_proj.weight"] + p[n + "mlp.c_proj.bias"]
    x = layernorm(x, p["ln_f.weight"], p["ln_f.bias"])
    return x @ p["wte.weight"].T  # tied LM head


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
    rng = np.random.default_rng(SEED)
    init = {}
    for name, shape in shapes().items():
        if name.endswith("ln_1.weight") or name.endswith("ln_2.weight") or name == "ln_f.weight":
            init[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            init[name] = (0.2 * rng.standard_normal(shape)).astype(np.float32)
    with h5py.File(os.path.join(out, "frozen_init.h5"), "w") as f:
        for k, v in {"n_layer": L, "n_head": H, "n_embd": C, "n_positions": T, "vocab_size": V}.items():
            f.attrs[k] = v
        for name, v in init.items():
            f.create_dataset(name, data=v)
    n_tokens = STEPS * BATCH * T + 1
    tokens = rng.integers(0, V, size=n_tokens).astype(np.uint16)
    header = np.zeros(256, dtype=np.int32)
    header[0], header[1], header[2] = 20240520, 1, n_tokens
    with open(os.path.join(out, "frozen_tokens.bin"), "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.tobytes())

    params = {n: torch.tensor(v.astype(np.float64)) for n, v in init.items()}
    frozen = {n for n in params if any(re.search(p, n) for p in FROZEN)}
    for n, t in params.items():
        t.requires_grad_(n not in frozen)
    trainable = [t for n, t in params.items() if n not in frozen]
    opt = torch.optim.AdamW(trainable, lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD)
    data = torch.tensor(tokens.astype(np.int64))
    losses, norms = [], []
    for step in range(STEPS):
        rows = [data[s * T: s * T + T + 1] for s in range(step * BATCH, (step + 1) * BATCH)]
        batch = torch.stack(rows)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(forward(params, batch[:, :-1]).reshape(-1, V), batch[:, 1:].reshape(-1))
        losses.append(loss.item())
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(trainable, CLIP).item())
        opt.step()
    assert max(norms) > CLIP, "choose CLIP below the norms so that clipping is exercised"
    with h5py.File(os.path.join(out, "frozen.h5"), "w") as f:
        f.attrs["frozen"] = "\n".join(FROZEN)
        f.create_dataset("losses", data=np.array(losses))
        f.create_dataset("grad_norms", data=np.array(norms))
        f.create_dataset("hparams", data=np.array([LR, B1, B2, EPS, WD, CLIP]))
        g = f.create_group("final")
        for n, t in params.items():
            g.create_dataset(n, data=t.detach().numpy().astype(np.float64))
    print(f"frozen {sorted(frozen)}; losses {losses[0]:.6f} -> {losses[-1]:.6f}; norms {norms}")


if __name__ == "__main__":
    main()

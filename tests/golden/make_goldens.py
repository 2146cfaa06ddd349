#!/usr/bin/python3
"""Writes the golden HDF5 files the C++ tests compare against (tests/model/test_golden.cpp).

Independent reference: a GPT-2 written here in plain PyTorch (Debian's python3-torch 1.13),
computed in float64 and stored as float32. Each file holds
  /<hf name>                    initial weights, Hugging Face GPT-2 names, Conv1D layout [in, out]
  /golden/inputs, /golden/targets   one batch [B, T] (int32)
  /golden/logits [B, T, V], /golden/loss []
  /golden/grads/<hf name>       d(mean cross-entropy)/d(weight)
  /golden/adamw_losses [10]     loss before each of 10 AdamW steps on the same batch
  /golden/hparams               [lr, beta1, beta2, eps, weight_decay, gradient_clipping]
  attributes vocab_size, n_positions, n_layer, n_head, n_embd, batch
gpt_eval.h5 and gpt_eval_val.bin (evaluation, tests/cli/test_cli_eval.cpp): weights as above, the
validation tokens as an llm.c token shard (S·T + 1 tokens: S samples of T, targets shifted by
one), and /golden/eval_loss, the mean cross-entropy over all S·T tokens (forward only, no_grad);
and half_conversions.h5: /fp32 values (ties, subnormals, overflow, inf, NaN, random) with the
bit patterns torch gives them as /bf16_bits and /fp16_bits (.to(dtype), round to nearest even).

Run:  OPENBLAS_NUM_THREADS=1 /usr/bin/python3 tests/golden/make_goldens.py tests/golden
"""
import math
import os
import sys

import h5py
import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from golden_common import write_pass  # noqa: E402

torch.set_num_threads(1)
torch.set_default_dtype(torch.float64)

CONFIGS = {
    # name: (V, T, L, H, C, B, lr, betas, eps, weight_decay, clip)
    "gpt_tiny": (64, 16, 2, 2, 32, 4, 1e-2, (0.9, 0.999), 1e-8, 0.1, 0.0),
    # T=80 spans two attention row blocks (64 + a ragged 16); clipping active.
    "gpt_ragged": (96, 80, 3, 4, 48, 2, 5e-3, (0.9, 0.95), 1e-8, 0.01, 0.5),
}


def block_names(l):
    p = f"h.{l}."
    return [p + n for n in ("ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias",
                            "attn.c_proj.weight", "attn.c_proj.bias", "ln_2.weight", "ln_2.bias",
                            "mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight", "mlp.c_proj.bias")]


def make_params(V, T, L, C, gen):
    """Random (not zero/one) values everywhere so every gradient path is exercised."""
    shapes = {"wte.weight": (V, C), "wpe.weight": (T, C)}
    for l in range(L):
        for name, shape in zip(block_names(l), [(C,), (C,), (C, 3 * C), (3 * C,), (C, C), (C,), (C,), (C,),
                                                (C, 4 * C), (4 * C,), (4 * C, C), (C,)]):
            shapes[name] = shape
    shapes["ln_f.weight"] = (C,)
    shapes["ln_f.bias"] = (C,)
    params = {}
    for name, shape in shapes.items():
        if name.startswith("ln") or ".ln_" in name:
            base = 1.0 if name.endswith("weight") else 0.0
            t = base + 0.1 * torch.randn(shape, generator=gen)
        elif name.endswith("bias"):
            t = 0.02 * torch.randn(shape, generator=gen)
        else:
            t = 0.08 * torch.randn(shape, generator=gen)
        params[name] = t.requires_grad_(True)
    return params


def layernorm(x, w, b):
    return torch.nn.functional.layer_norm(x, (x.shape[-1],), w, b, eps=1e-5)


def gpt_forward(p, tokens, L, H):
    B, T = tokens.shape
    C = p["wte.weight"].shape[1]
    hs = C // H
    x = p["wte.weight"][tokens] + p["wpe.weight"][:T]
    mask = torch.tril(torch.ones(T, T, dtype=torch.bool))
    for l in range(L):
        n = f"h.{l}."
        h = layernorm(x, p[n + "ln_1.weight"], p[n + "ln_1.bias"])
        qkv = h @ p[n + "attn.c_attn.weight"] + p[n + "attn.c_attn.bias"]
        q, k, v = qkv.split(C, dim=2)
        q = q.view(B, T, H, hs).transpose(1, 2)
        k = k.view(B, T, H, hs).transpose(1, 2)
        v = v.view(B, T, H, hs).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(hs)
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        x = x + y @ p[n + "attn.c_proj.weight"] + p[n + "attn.c_proj.bias"]
        h = layernorm(x, p[n + "ln_2.weight"], p[n + "ln_2.bias"])
        h = torch.nn.functional.gelu(h @ p[n + "mlp.c_fc.weight"] + p[n + "mlp.c_fc.bias"], approximate="tanh")
        x = x + h @ p[n + "mlp.c_proj.weight"] + p[n + "mlp.c_proj.bias"]
    x = layernorm(x, p["ln_f.weight"], p["ln_f.bias"])
    return x @ p["wte.weight"].T  # tied LM head


def write(path, name, cfg, seed):
    V, T, L, H, C, B, lr, betas, eps, wd, clip = cfg
    gen = torch.Generator().manual_seed(seed)
    params = make_params(V, T, L, C, gen)
    tokens = torch.randint(0, V, (B, T), generator=gen)
    targets = torch.randint(0, V, (B, T), generator=gen)

    with h5py.File(path, "w") as f:
        for key, val in dict(vocab_size=V, n_positions=T, n_layer=L, n_head=H, n_embd=C, batch=B).items():
            f.attrs[key] = val
        for pname, t in params.items():
            f.create_dataset(pname, data=t.detach().numpy().astype(np.float32))
        # Training starts from the float32-rounded weights the C++ side will load.
        for t in params.values():
            with torch.no_grad():
                t.copy_(t.float().double())
        logits = gpt_forward(params, tokens, L, H)
        loss = torch.nn.functional.cross_entropy(logits.view(-1, V), targets.view(-1))
        loss.backward()
        g = f.create_group("golden")
        write_pass(g, tokens, targets, logits, loss, params)

        opt = torch.optim.AdamW(params.values(), lr=lr, betas=betas, eps=eps, weight_decay=wd)
        losses = []
        for _ in range(10):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(gpt_forward(params, tokens, L, H).view(-1, V), targets.view(-1))
            losses.append(loss.item())
            loss.backward()
            if clip > 0:
                torch.nn.utils.clip_grad_norm_(params.values(), clip)
            opt.step()
        g.create_dataset("adamw_losses", data=np.array(losses, dtype=np.float32))
        g.create_dataset("hparams", data=np.array([lr, betas[0], betas[1], eps, wd, clip], dtype=np.float64))
    print(f"{path}: loss {losses[0]:.6f} -> {losses[-1]:.6f} after 10 AdamW steps")


def write_eval(h5_path, shard_path, seed, V=64, T=16, L=2, H=2, C=32, samples=32):
    """Forward-only reference: the loss `zero3d eval` and in-training evaluation must report."""
    gen = torch.Generator().manual_seed(seed)
    params = make_params(V, T, L, C, gen)
    stream = torch.randint(0, V, (samples * T + 1,), generator=gen)
    with torch.no_grad():
        for t in params.values():  # the float32 weights zero3d loads
            t.copy_(t.float().double())
        logits = gpt_forward(params, stream[:-1].view(samples, T), L, H)
        loss = torch.nn.functional.cross_entropy(logits.view(-1, V), stream[1:].reshape(-1))
    header = np.zeros(256, dtype=np.int32)
    header[:3] = [20240520, 1, stream.numel()]  # llm.c: magic, version, token count; then uint16 tokens
    with open(shard_path, "wb") as f:
        f.write(header.tobytes())
        f.write(stream.numpy().astype(np.uint16).tobytes())
    with h5py.File(h5_path, "w") as f:
        for key, val in dict(vocab_size=V, n_positions=T, n_layer=L, n_head=H, n_embd=C, samples=samples).items():
            f.attrs[key] = val
        for pname, t in params.items():
            f.create_dataset(pname, data=t.detach().numpy().astype(np.float32))
        f.create_dataset("golden/eval_loss", data=np.float64(loss.item()))
    print(f"{h5_path}: eval loss {loss.item():.9f} over {samples} samples of {T} tokens ({shard_path})")


def write_half_conversions(path):
    f32 = np.float32
    special = [0.0, -0.0, 1.0, -1.0, float("inf"), float("-inf"), float("nan"),
               1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-20,     # bf16 ties (to even) and just above
               1 + 2**-11, 1 + 3 * 2**-11,                         # fp16 ties
               65504.0, 65519.0, 65520.0, 70000.0, -1e6,            # fp16 max, last below the tie, overflow
               2**-24, 2**-25, 3 * 2**-26, 1e-8, 6e-5,             # fp16 subnormals and underflow
               3.0e38, 3.4028235e38, 1e-39, -1e-40]                # bf16 near max, fp32 subnormals
    gen = np.random.default_rng(4321)
    random = gen.standard_normal(2000) * np.exp(gen.uniform(-20, 20, 2000))
    x = np.concatenate([np.array(special), random]).astype(f32)
    t = torch.from_numpy(x)
    with h5py.File(path, "w") as f:
        f.create_dataset("fp32", data=x)
        f.create_dataset("bf16_bits", data=t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16))
        f.create_dataset("fp16_bits", data=t.to(torch.float16).view(torch.int16).numpy().view(np.uint16))
    print(f"{path}: {len(x)} conversions")


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
    for i, (name, cfg) in enumerate(CONFIGS.items()):
        write(os.path.join(out, name + ".h5"), name, cfg, seed=1000 + i)
    write_half_conversions(os.path.join(out, "half_conversions.h5"))
    write_eval(os.path.join(out, "gpt_eval.h5"), os.path.join(out, "gpt_eval_val.bin"), seed=1100)


if __name__ == "__main__":
    main()

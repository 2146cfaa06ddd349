"""What every model golden file holds under golden/: one forward and backward pass's inputs,
targets, logits, loss and parameter gradients (make_goldens.py, make_llama_goldens.py)."""

import numpy as np


def write_pass(g, tokens, targets, logits, loss, params, extra=None):
    """The pass's tensors into group g (extra: further int32 arrays by name, e.g. a data stream)."""
    g.create_dataset("inputs", data=tokens.numpy().astype(np.int32))
    g.create_dataset("targets", data=targets.numpy().astype(np.int32))
    for name, t in (extra or {}).items():
        g.create_dataset(name, data=t.numpy().astype(np.int32))
    g.create_dataset("logits", data=logits.detach().numpy().astype(np.float32))
    g.create_dataset("loss", data=np.float32(loss.item()))
    grads = g.create_group("grads")
    for name, t in params.items():
        grads.create_dataset(name, data=t.grad.numpy().astype(np.float32))


def write_adamw_steps(g, params, hp, steps, step_loss):
    """torch.optim.AdamW for `steps` steps, hp = (lr, beta1, beta2, eps, weight_decay, clip; 0: none);
    step_loss() gives (the loss to report, the loss to differentiate). Writes golden/adamw_losses,
    golden/grad_norms (before clipping) and golden/hparams into g; returns (losses, norms)."""
    import torch

    lr, b1, b2, eps, wd, clip = hp
    opt = torch.optim.AdamW(params.values(), lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
    losses, norms = [], []
    for _ in range(steps):
        opt.zero_grad()
        reported, loss = step_loss()
        losses.append(reported.item())
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(params.values(), clip if clip > 0 else float("inf")).item())
        opt.step()
    g.create_dataset("adamw_losses", data=np.array(losses, dtype=np.float64))
    g.create_dataset("grad_norms", data=np.array(norms, dtype=np.float64))
    g.create_dataset("hparams", data=np.array(hp, dtype=np.float64))
    return losses, norms


def rng_uniforms(seed, streams, n):
    """The first n uniform() draws of zero3d's Rng(seed, stream) for each of `streams` (src/base/rng.hpp:
    SplitMix64; draw c is mix(seed·γ ⊕ mix(stream + 1) + (c + 1)·γ)), as float64 [len(streams), n]."""
    gamma = np.uint64(0x9E3779B97F4A7C15)

    def mix(z):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))

    with np.errstate(over="ignore"):  # uint64 arithmetic wraps, as C++'s does
        state = (np.uint64(seed) * gamma) ^ mix(np.asarray(streams, dtype=np.uint64) + np.uint64(1))
        x = mix(state[:, None] + np.arange(1, n + 1, dtype=np.uint64)[None, :] * gamma)
    return (x >> np.uint64(11)).astype(np.float64) * (1.0 / 9007199254740992.0)

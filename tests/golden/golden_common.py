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

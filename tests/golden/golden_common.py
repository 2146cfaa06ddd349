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

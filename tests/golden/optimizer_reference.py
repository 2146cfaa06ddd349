#!/usr/bin/python3
"""References for tests/optim/test_optimizers_lion_adagrad.cpp (issue 18).

Adagrad: torch.optim.Adagrad (torch 1.13, /usr/bin/python3), which DeepSpeed's "adagrad" runs
without offload, and DeepSpeedCPUAdagrad (numpy), which it runs with offload_optimizer. Lion: torch 1.13 has none, so DeepSpeed's FusedLion update
(csrc/lion/multi_tensor_lion.cu) is written out here in numpy float32. Prints the parameters
after each of three steps; the test embeds them.
"""
import numpy as np
import torch

P0 = [0.5, -0.3, 0.0, 1.2]
GRADS = [[0.1, -0.2, 0.0, 0.3], [-0.05, 0.1, 0.2, -0.3], [0.02, 0.02, -0.4, 0.0]]


def adagrad():
    p = torch.nn.Parameter(torch.tensor(P0, dtype=torch.float32))
    opt = torch.optim.Adagrad([p], lr=0.1, lr_decay=0.05, weight_decay=0.01, initial_accumulator_value=0.1, eps=1e-10)
    out = []
    for g in GRADS:
        p.grad = torch.tensor(g, dtype=torch.float32)
        opt.step()
        out.append(p.detach().numpy().tolist())
    return out


def lion(lr=0.01, beta1=0.9, beta2=0.99, wd=0.1):
    f = np.float32
    p = np.array(P0, dtype=f)
    m = np.zeros_like(p)
    out = []
    for g in GRADS:
        g = np.array(g, dtype=f)
        c = f(beta1) * m + (f(1) - f(beta1)) * g
        p = p * (f(1) - f(lr) * f(wd)) + np.where(c > 0, f(-lr), f(lr))
        m = f(beta2) * m + (f(1) - f(beta2)) * g
        out.append(p.tolist())
    return out


def deepspeed_cpu_adagrad(lr=0.1, wd=0.01, eps=1e-10):
    """DeepSpeedCPUAdagrad, which DeepSpeed's "adagrad" runs under offload_optimizer: the scalar
    loop of csrc/adagrad/cpu_adagrad.cpp (Step_1) in numpy float32. The decay enters the
    accumulated square only; the step divides the raw gradient."""
    f = np.float32
    p = np.array(P0, dtype=f)
    v = np.zeros_like(p)
    out = []
    for g in GRADS:
        momentum = np.array(g, dtype=f)
        grad = p * f(wd) + momentum if wd > 0 else momentum
        v = v + grad * grad
        q = momentum / (np.sqrt(v) + f(eps))
        p = q * f(-lr) + p
        out.append(p.tolist())
    return out


if __name__ == "__main__":
    for name, rows in (("adagrad", adagrad()), ("lion", lion()), ("deepspeed_cpu_adagrad", deepspeed_cpu_adagrad())):
        for k, row in enumerate(rows):
            print(name, k + 1, ", ".join("%.9gf" % x for x in row))

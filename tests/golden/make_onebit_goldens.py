#!/usr/bin/python3
"""Writes onebit.h5, the goldens of the 1-bit optimizers' tests (issue 34).

Two references, written here from DEEPSPEED-FACTS-2 §5 and DeepSpeed's Python, without zero3d's code:

  * /allreduce: the error-compensated compressed all-reduce (§5.2; DeepSpeed's
    runtime/comm/mpi.py MpiBackend.compressed_allreduce) simulated in NumPy float32 for W workers
    at once. Per tensor of n elements: padded to a multiple of W·lcm(W, 8) (the optimizer's
    corrected_tensor_size, divider = W·8/gcd(W, 8)), x = pad(buf) + worker_error, worker scale
    ‖x‖₂/sqrt(padded), sign bit x >= 0 (sign(0) = +1), worker_error = x − scale·(±1); chunk j of
    every worker goes to worker j (all-to-all), which sums (±1)·(scale_i·(1/W)) over i, adds its
    server_error, takes the server scale ‖y‖₂/sqrt(chunk) and server_error = y − s·(±1); every
    worker gets chunk j as s_j·(±1) (all-gather), un-padded.
    /allreduce/w<W>/n<n>/input [calls, W, n] (each worker's buffer at each call),
    output [calls, n] (identical on every worker), worker_error [calls, W, padded],
    server_error [calls, W, chunk] (after each call; errors persist from call to call).

  * /onebit_adam/w<W>: DeepSpeed's OnebitAdam.step (runtime/fp16/onebit/adam.py, §5.3) over
    several parameter tensors, W workers simulated in PyTorch float32 with a torch version of the
    compressed all-reduce (a second implementation, cross-checked against the NumPy one here).
    The first step() is the initialisation step (no update, step still counted); while not frozen
    the gradient is the workers' mean (the engine's backward all-reduce), m and v are updated and
    p -= lr·(m/(sqrt(v)+eps) + wd·p) (no bias correction); after the step whose count reaches
    freeze_step the engine's all-reduce is off: m = β1·m + (1−β1)·g_local on each worker, m is
    replaced by compressed_allreduce(m) per tensor, v stays frozen.
    Datasets: sizes [T], p0 [N], grads [S, W, N] (worker w's local gradient at step s), lr [S],
    params [S, N] (after each step); attributes freeze_step, beta1, beta2, eps, weight_decay.

Run:  OPENBLAS_NUM_THREADS=1 /usr/bin/python3 tests/golden/make_onebit_goldens.py tests/golden
"""
import math
import os
import sys

import h5py
import numpy as np
import torch

torch.set_num_threads(1)
f32 = np.float32


def padded_size(n, w):
    divider = w * 8 // math.gcd(w, 8)
    unit = w * divider
    return n if n % unit == 0 else n + unit - n % unit


# ---- NumPy simulation of §5.2 ------------------------------------------------------------------
def np_compressed_allreduce(bufs, worker_err, server_err):
    """bufs: list of W float32 arrays (n); worker_err: W arrays (padded); server_err: W arrays (chunk).
    Returns the common result (n) and updates the error lists in place."""
    w = len(bufs)
    n = bufs[0].size
    padded = worker_err[0].size
    chunk = padded // w
    signs, scales = [], []
    for i in range(w):
        x = np.zeros(padded, dtype=f32)
        x[:n] = bufs[i]
        x = (x + worker_err[i]).astype(f32)
        scale = f32(np.sqrt(np.sum(x.astype(np.float64) ** 2))) / f32(np.sqrt(padded))
        pm = np.where(x >= 0, f32(1), f32(-1))
        worker_err[i] = (x - f32(scale) * pm).astype(f32)
        # the wire: sign bits packed 8 per byte, chunk j for worker j
        signs.append(np.packbits(x >= 0))
        scales.append(f32(scale))
    out = np.zeros(padded, dtype=f32)
    server_signs, server_scales = [], []
    cb = chunk // 8
    for j in range(w):  # worker j as the server of chunk j
        y = np.zeros(chunk, dtype=f32)
        for i in range(w):
            bits = np.unpackbits(signs[i][j * cb:(j + 1) * cb]).astype(f32)
            y = (y + (bits * f32(2) - f32(1)) * (scales[i] * f32(1.0 / w))).astype(f32)
        y = (y + server_err[j]).astype(f32)
        s = f32(np.sqrt(np.sum(y.astype(np.float64) ** 2))) / f32(np.sqrt(chunk))
        pm = np.where(y >= 0, f32(1), f32(-1))
        server_err[j] = (y - f32(s) * pm).astype(f32)
        server_signs.append(np.packbits(y >= 0))
        server_scales.append(f32(s))
    for j in range(w):
        bits = np.unpackbits(server_signs[j]).astype(f32)
        out[j * chunk:(j + 1) * chunk] = (bits * f32(2) - f32(1)) * server_scales[j]
    return out[:n].copy()


# ---- torch version (DeepSpeed's own tensor operations, all workers in one process) -------------
def torch_compressed_allreduce(bufs, worker_err, server_err):
    w = len(bufs)
    n = bufs[0].numel()
    padded = worker_err[0].numel()
    chunk = padded // w
    pms, scales = [], []
    for i in range(w):
        x = torch.cat([bufs[i], torch.zeros(padded - n)]) + worker_err[i]
        scale = torch.linalg.norm(x) / np.sqrt(x.numel())
        pm = x.sign().add_(1).bool().float().add_(-0.5).mul_(2.0)
        worker_err[i] = x - scale * pm
        pms.append(pm)
        scales.append(scale)
    server = []
    for j in range(w):
        recv = torch.stack([pms[i][j * chunk:(j + 1) * chunk] for i in range(w)])
        sc = torch.stack([scales[i] for i in range(w)]).reshape(w, 1).mul_(1 / w)
        y = torch.zeros(chunk)
        for i in range(w):  # the workers' terms in rank order
            y = y + recv[i] * sc[i]
        y = y + server_err[j]
        s = torch.linalg.norm(y) / np.sqrt(y.numel())
        pm = y.sign().add_(1).bool().float().add_(-0.5).mul_(2.0)
        server_err[j] = y - s * pm
        server.append(pm * s)
    return torch.cat(server)[:n].clone()


def allreduce_goldens(f, rng):
    grp = f.create_group("allreduce")
    for w in (2, 3, 4):
        for n in (1, 7, 37, 200, 1003):
            padded = padded_size(n, w)
            chunk = padded // w
            calls = 4
            inputs = np.zeros((calls, w, n), dtype=f32)
            outputs = np.zeros((calls, n), dtype=f32)
            werr = np.zeros((calls, w, padded), dtype=f32)
            serr = np.zeros((calls, w, chunk), dtype=f32)
            we = [np.zeros(padded, dtype=f32) for _ in range(w)]
            se = [np.zeros(chunk, dtype=f32) for _ in range(w)]
            twe = [torch.zeros(padded) for _ in range(w)]
            tse = [torch.zeros(chunk) for _ in range(w)]
            for c in range(calls):
                for i in range(w):
                    v = rng.standard_normal(n).astype(f32) * f32(10.0 ** rng.uniform(-3, 1))
                    v[rng.random(n) < 0.1] = 0.0  # exact zeros: sign(0) = +1
                    inputs[c, i] = v
                out = np_compressed_allreduce([inputs[c, i] for i in range(w)], we, se)
                tout = torch_compressed_allreduce([torch.from_numpy(inputs[c, i].copy()) for i in range(w)], twe, tse)
                assert np.allclose(out, tout.numpy(), rtol=1e-5, atol=1e-7), (w, n, c)
                outputs[c] = out
                for i in range(w):
                    werr[c, i] = we[i]
                    serr[c, i] = se[i]
            g = grp.create_group(f"w{w}/n{n}")
            g.attrs["padded"] = padded
            g.create_dataset("input", data=inputs)
            g.create_dataset("output", data=outputs)
            g.create_dataset("worker_error", data=werr)
            g.create_dataset("server_error", data=serr)


# ---- OnebitAdam, W workers ----------------------------------------------------------------------
ADAM = dict(freeze_step=8, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
SIZES = [5, 24, 37]
STEPS = 20


def onebit_adam(w, p0, grads, lrs):
    c = ADAM
    offs = np.cumsum([0] + SIZES)
    params = [torch.from_numpy(p0[offs[k]:offs[k + 1]].copy()) for k in range(len(SIZES))]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    werr = [[torch.zeros(padded_size(s, w)) for _ in range(w)] for s in SIZES]
    serr = [[torch.zeros(padded_size(s, w) // w) for _ in range(w)] for s in SIZES]
    frozen, initialized, step = False, False, 0
    out = []
    for s in range(STEPS):
        local = [torch.from_numpy(grads[s, i].copy()) for i in range(w)]
        mean = sum(local[1:], local[0].clone()) * (1.0 / w)  # the engine's all-reduce then 1/W
        step += 1
        lr = float(lrs[s])
        for k in range(len(SIZES)):
            sl = slice(offs[k], offs[k + 1])
            if not initialized:
                continue  # m is zero: its compressed all-reduce with zero errors gives zero, no update
            if not frozen:
                m[k].mul_(c["beta1"]).add_(mean[sl], alpha=1 - c["beta1"])
                v[k].mul_(c["beta2"]).addcmul_(mean[sl], mean[sl], value=1 - c["beta2"])
            else:
                ms = [m[k] * c["beta1"] + local[i][sl] * (1 - c["beta1"]) for i in range(w)]
                m[k] = torch_compressed_allreduce(ms, werr[k], serr[k])
            update = m[k] / (v[k].sqrt() + c["eps"])
            if c["weight_decay"] > 0.0:
                update += c["weight_decay"] * params[k]
            params[k].add_(-lr * update)
        if not initialized:
            initialized = True
        elif not frozen and step >= c["freeze_step"]:
            frozen = True
        out.append(torch.cat(params).numpy().copy())
    return np.stack(out)


def adam_goldens(f, rng):
    n = sum(SIZES)
    p0 = rng.standard_normal(n).astype(f32) * f32(0.5)
    lrs = np.array([1e-2 * (1.0 + 0.05 * s) for s in range(STEPS)], dtype=np.float64)
    for w in (2, 4):
        # a common signal plus worker noise, so the local gradients differ but agree in trend
        base = rng.standard_normal((STEPS, 1, n)).astype(f32)
        grads = (base + f32(0.5) * rng.standard_normal((STEPS, w, n)).astype(f32)).astype(f32)
        g = f.create_group(f"onebit_adam/w{w}")
        for key, val in ADAM.items():
            g.attrs[key] = val
        g.create_dataset("sizes", data=np.array(SIZES, dtype=np.int32))
        g.create_dataset("p0", data=p0)
        g.create_dataset("grads", data=grads)
        g.create_dataset("lr", data=lrs)
        g.create_dataset("params", data=onebit_adam(w, p0, grads, lrs))


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
    rng = np.random.default_rng(34)
    with h5py.File(os.path.join(out, "onebit.h5"), "w") as f:
        allreduce_goldens(f, rng)
        adam_goldens(f, rng)


if __name__ == "__main__":
    main()

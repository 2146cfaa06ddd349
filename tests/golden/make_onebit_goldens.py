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


def engine_gradients(grads, s, w, averaged):
    """What each worker's optimizer is given at step s: the engine's all-reduce of the local
    gradients (sum, then 1/W) when it is on, else the worker's own."""
    local = [torch.from_numpy(grads[s, i].copy()) for i in range(w)]
    mean = sum(local[1:], local[0].clone()) * (1.0 / w)
    return [mean if averaged else local[i] for i in range(w)]


def padded_size(n, w):
    divider = w * 8 // math.gcd(w, 8)
    unit = w * divider
    return n if n % unit == 0 else n + unit - n % unit


# ---- NumPy simulation of §5.2 ------------------------------------------------------------------
def np_compress(x):
    """One side's compression with error feedback: the scale ‖x‖₂/sqrt(len), the sign bits
    (x >= 0: sign(0) = +1) packed 8 per byte, and the error x − scale·(±1)."""
    scale = f32(np.sqrt(np.sum(x.astype(np.float64) ** 2))) / f32(np.sqrt(x.size))
    pm = np.where(x >= 0, f32(1), f32(-1))
    return f32(scale), np.packbits(x >= 0), (x - f32(scale) * pm).astype(f32)


def np_decode(bits):
    return np.unpackbits(bits).astype(f32) * f32(2) - f32(1)


def np_compressed_allreduce(bufs, worker_err, server_err):
    """bufs: list of W float32 arrays (n); worker_err: W arrays (padded); server_err: W arrays (chunk).
    Returns the common result (n) and updates the error lists in place."""
    w = len(bufs)
    n = bufs[0].size
    padded = worker_err[0].size
    chunk = padded // w
    signs, scales = [], []
    for i in range(w):  # each worker compresses its padded buffer; the wire: chunk j for worker j
        x = np.zeros(padded, dtype=f32)
        x[:n] = bufs[i]
        scale, bits, worker_err[i] = np_compress((x + worker_err[i]).astype(f32))
        signs.append(bits)
        scales.append(scale)
    out = np.zeros(padded, dtype=f32)
    cb = chunk // 8
    for j in range(w):  # worker j as the server of chunk j
        y = np.zeros(chunk, dtype=f32)
        for i in range(w):
            y = (y + np_decode(signs[i][j * cb:(j + 1) * cb]) * (scales[i] * f32(1.0 / w))).astype(f32)
        s, bits, server_err[j] = np_compress((y + server_err[j]).astype(f32))
        out[j * chunk:(j + 1) * chunk] = np_decode(bits) * s
    return out[:n].copy()


# ---- torch version (DeepSpeed's own tensor operations, all workers in one process) -------------
def torch_compress(x):
    """DeepSpeed's scale, ±1 signs and error of one side: norm/sqrt(numel), sign().add_(1).bool()."""
    scale = torch.linalg.norm(x) / np.sqrt(x.numel())
    pm = x.sign().add_(1).bool().float().add_(-0.5).mul_(2.0)
    return scale, pm, x - scale * pm


def torch_compressed_allreduce(bufs, worker_err, server_err):
    w = len(bufs)
    n = bufs[0].numel()
    padded = worker_err[0].numel()
    chunk = padded // w
    pms, scales = [], []
    for i in range(w):
        scale, pm, worker_err[i] = torch_compress(torch.cat([bufs[i], torch.zeros(padded - n)]) + worker_err[i])
        pms.append(pm)
        scales.append(scale)
    server = []
    for j in range(w):
        recv = torch.stack([pms[i][j * chunk:(j + 1) * chunk] for i in range(w)])
        sc = torch.stack([scales[i] for i in range(w)]).reshape(w, 1).mul_(1 / w)
        y = torch.zeros(chunk)
        for i in range(w):  # the workers' terms in rank order
            y = y + recv[i] * sc[i]
        s, pm, server_err[j] = torch_compress(y + server_err[j])
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


# ---- ZeroOneAdam, W workers (runtime/fp16/onebit/zoadam.py ZeroOneAdam.step, §5.4) ---------------
ZO = dict(var_freeze_step=8, var_update_scaler=2, local_step_scaler=2, local_step_clipper=4, beta1=0.9,
          beta2=0.999, eps=1e-8, weight_decay=0.01)


def zero_one_adam(w, p0, grads, lrs):
    """Each worker's parameters after each step [S, W, N]: between synchronisations of the local
    steps the workers' parameters differ. Per parameter the state DeepSpeed keeps (step,
    var_interval, var_counter, local_step_interval, local_step_counter, lrs: the same on every
    worker, so held once), per worker m, v, the momentum accumulator and the parameters."""
    c = ZO
    b1, b2, eps, wd = c["beta1"], c["beta2"], c["eps"], c["weight_decay"]
    offs = np.cumsum([0] + SIZES)
    K = len(SIZES)
    P = [[torch.from_numpy(p0[offs[k]:offs[k + 1]].copy()) for k in range(K)] for _ in range(w)]
    M = [[torch.zeros(s) for s in SIZES] for _ in range(w)]
    V = [[torch.zeros(s) for s in SIZES] for _ in range(w)]
    ACC = [[torch.zeros(s) for s in SIZES] for _ in range(w)]
    state = [dict(step=0, var_interval=1, var_counter=0, local_step_interval=1, local_step_counter=0, lrs=0.0)
             for _ in range(K)]
    werr = [[torch.zeros(padded_size(s, w)) for _ in range(w)] for s in SIZES]
    serr = [[torch.zeros(padded_size(s, w) // w) for _ in range(w)] for s in SIZES]
    initialize, freeze_key, reinitial_error_buffer = False, False, False
    enable_backward_allreduce = True  # the engine's flag, which the optimizer switches
    out = []
    for s in range(STEPS):
        g = engine_gradients(grads, s, w, enable_backward_allreduce)
        lr = float(lrs[s])
        for k in range(K):
            sl = slice(offs[k], offs[k + 1])
            st = state[k]
            st["step"] += 1
            if initialize:
                if not freeze_key:
                    if st["step"] % st["var_interval"] == 0:
                        for i in range(w):
                            V[i][k].mul_(b2).addcmul_(g[i][sl], g[i][sl], value=1 - b2)
                            M[i][k].mul_(b1).add_(g[i][sl], alpha=1 - b1)
                    elif w > 1:
                        onebit = torch_compressed_allreduce([g[i][sl] for i in range(w)], werr[k], serr[k])
                        for i in range(w):
                            M[i][k].mul_(b1).add_(onebit, alpha=1 - b1)
                else:
                    for i in range(w):
                        M[i][k].mul_(b1).add_(g[i][sl], alpha=1 - b1)
                    st["lrs"] += lr
            # (not initialize: the compressed all-reduce of the zero accumulator gives zero)
            if initialize:
                for i in range(w):
                    update = M[i][k] / (V[i][k].sqrt() + eps)
                    if wd > 0.0:
                        update += wd * P[i][k]
                    P[i][k].add_(-lr * update)
                    if freeze_key:
                        ACC[i][k].add_(-lr * update)
                if st["step"] % st["local_step_interval"] == 0 and freeze_key:
                    for i in range(w):
                        P[i][k].add_(-1 * ACC[i][k])
                        ACC[i][k].mul_(V[i][k].sqrt() + eps)
                    if w > 1:
                        avg = torch_compressed_allreduce([ACC[i][k] for i in range(w)], werr[k], serr[k])
                        for i in range(w):
                            ACC[i][k].copy_(avg)
                    for i in range(w):
                        M[i][k].zero_().add_(ACC[i][k] / st["lrs"], alpha=-1)
                        P[i][k].add_(ACC[i][k] / (V[i][k].sqrt() + eps))
                        ACC[i][k].zero_()
                    st["lrs"] = 0
                if not freeze_key:
                    if st["step"] % st["var_interval"] == 0:
                        st["var_counter"] += 1
                        if st["var_counter"] == c["var_update_scaler"]:
                            st["var_counter"] = 0
                            st["var_interval"] *= 2
                    enable_backward_allreduce = (st["step"] + 1) % st["var_interval"] == 0
                else:
                    st["local_step_counter"] += 1
                    if st["local_step_counter"] == c["local_step_scaler"]:
                        st["local_step_counter"] = 0
                        st["local_step_interval"] = min(c["local_step_clipper"], st["local_step_interval"] * 2)
        if not initialize:
            initialize = True
        else:
            if state[0]["step"] > c["var_freeze_step"]:
                freeze_key = True
                enable_backward_allreduce = False
            if freeze_key and not reinitial_error_buffer:
                for k in range(K):
                    for i in range(w):
                        werr[k][i].zero_()
                        serr[k][i].zero_()
                reinitial_error_buffer = True
        out.append(np.stack([torch.cat(P[i]).numpy().copy() for i in range(w)]))
    return np.stack(out)


# ---- OneBitLamb, W workers (runtime/fp16/onebit/lamb.py OnebitLamb.step, §5.5) ------------------
LAMB = dict(freeze_step=8, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, max_coeff=10.0, min_coeff=0.01,
            coeff_beta=0.9, factor_max=4.0, factor_min=0.5, factor_threshold=0.1)


def onebit_lamb(w, p0, grads, lrs):
    """The parameters after each step [S, N] (the same on every worker: the warm-up averages the
    gradients, the compressed stage the momenta), and each tensor's lamb_coeff_freeze at the end.
    Per worker the state DeepSpeed keeps; the momenta of all parameters and a zero tail up to
    the padded size form exp_avg_flat, which the compressed all-reduce overwrites in place."""
    c = LAMB
    b1, b2, eps, wd = c["beta1"], c["beta2"], c["eps"], c["weight_decay"]
    offs = np.cumsum([0] + SIZES)
    K, N = len(SIZES), sum(SIZES)
    padded = padded_size(N, w)
    P = [[torch.from_numpy(p0[offs[k]:offs[k + 1]].copy()) for k in range(K)] for _ in range(w)]
    st = [[dict(step=0, lamb_coeff_freeze=0.0, last_factor=1.0, exp_avg_sq=torch.zeros(s),
                exp_avg_sq_fresh=torch.zeros(s)) for s in SIZES] for _ in range(w)]
    flat = [torch.zeros(padded) for _ in range(w)]  # exp_avg_flat: exp_avg of parameter k is flat[offs[k]:offs[k+1]]
    M = [[flat[i][offs[k]:offs[k + 1]] for k in range(K)] for i in range(w)]
    werr = [torch.zeros(padded) for _ in range(w)]
    serr = [torch.zeros(padded // w) for _ in range(w)]
    initialize, freeze_key, enable_backward_allreduce = False, False, True
    out = []
    for s in range(STEPS):
        g = engine_gradients(grads, s, w, enable_backward_allreduce)
        lr = float(lrs[s])
        if freeze_key:
            last = [[M[i][k].detach().clone() for k in range(K)] for i in range(w)]
            for i in range(w):
                if "scaling_coeff" not in st[i][0]:
                    scales = [(torch.linalg.vector_norm(M[i][k]) / np.sqrt(torch.numel(M[i][k]))).item()
                              for k in range(K)]
                    united = sum(scales) / len(scales)
                    for k in range(K):
                        st[i][k]["scaling_coeff"] = united / scales[k]
        for k in range(K):
            sl = slice(offs[k], offs[k + 1])
            if not initialize:
                freeze_key = True
            for i in range(w):
                S = st[i][k]
                S["step"] += 1
                m, v, vf = M[i][k], S["exp_avg_sq"], S["exp_avg_sq_fresh"]
                if not freeze_key:
                    m.mul_(b1).add_(g[i][sl], alpha=1 - b1)
                    v.mul_(b2).addcmul_(g[i][sl], g[i][sl], value=1 - b2)
                    if S["step"] == c["freeze_step"]:
                        vf.copy_(v)
                    if initialize:
                        weight_norm = P[i][k].pow(2).sum().sqrt()
                        update = m / (v.sqrt() + eps)
                        if wd > 0.0:
                            update += wd * P[i][k]
                        update_norm = update.pow(2).sum().sqrt()
                        lamb_coeff = 1.0
                        if weight_norm != 0 and update_norm != 0:
                            lamb_coeff = (weight_norm / update_norm).item()
                            if lamb_coeff > c["max_coeff"]:
                                lamb_coeff = c["max_coeff"]
                            if lamb_coeff < c["min_coeff"]:
                                lamb_coeff = c["min_coeff"]
                        if lamb_coeff != 1.0:
                            S["lamb_coeff_freeze"] = c["coeff_beta"] * S["lamb_coeff_freeze"] + \
                                (1 - c["coeff_beta"]) * lamb_coeff
                        P[i][k].add_(-lr * lamb_coeff * update)
                elif initialize:
                    m.mul_(b1).add_(g[i][sl], alpha=1 - b1)
                    m.mul_(S["scaling_coeff"])
        if freeze_key and initialize and w > 1:
            avg = torch_compressed_allreduce([flat[i] for i in range(w)], werr, serr)
            for i in range(w):
                flat[i].copy_(avg)
        if freeze_key and initialize:
            for i in range(w):
                for k in range(K):
                    S = st[i][k]
                    m, v, vf = M[i][k], S["exp_avg_sq"], S["exp_avg_sq_fresh"]
                    m.div_(S["scaling_coeff"])
                    grad_reconstruct = (m - last[i][k] * b1) / (1 - b1)
                    vf.mul_(b2).addcmul_(grad_reconstruct, grad_reconstruct, value=1 - b2)
                    denom = v.sqrt() + eps
                    update_prelim = m / denom
                    update = update_prelim + wd * P[i][k] if wd > 0.0 else update_prelim
                    update_norm = update.pow(2).sum().sqrt()
                    denom_real = vf.sqrt() + eps
                    factor = (denom / denom_real).max().item()
                    if wd > 0.0:
                        update_ratio = min(1.0, (update_prelim.pow(2).sum().sqrt() / update_norm).item())
                        factor = factor * update_ratio + (1.0 - update_ratio)
                    if factor > c["factor_max"]:
                        factor = c["factor_max"]
                    if factor < c["factor_min"]:
                        factor = c["factor_min"]
                    if factor > S["last_factor"] * (1.0 + c["factor_threshold"]):
                        factor = S["last_factor"] * (1.0 + c["factor_threshold"])
                    if factor < S["last_factor"] * (1.0 - c["factor_threshold"]):
                        factor = S["last_factor"] * (1.0 - c["factor_threshold"])
                    S["last_factor"] = factor
                    P[i][k].add_(-lr * (S["lamb_coeff_freeze"] * factor) * update)
        if not initialize:
            freeze_key = False
            initialize = True
        elif not freeze_key and st[0][K - 1]["step"] >= c["freeze_step"]:
            freeze_key = True
            enable_backward_allreduce = False
        for i in range(1, w):
            assert torch.equal(torch.cat(P[i]), torch.cat(P[0])), "the workers agree"
        out.append(torch.cat(P[0]).numpy().copy())
    return np.stack(out), np.array([st[0][k]["lamb_coeff_freeze"] for k in range(K)])


def adam_goldens(f, rng):
    n = sum(SIZES)
    p0 = rng.standard_normal(n).astype(f32) * f32(0.5)
    lrs = np.array([1e-2 * (1.0 + 0.05 * s) for s in range(STEPS)], dtype=np.float64)
    grads_of = {}
    for w in (2, 4):
        # a common signal plus worker noise, so the local gradients differ but agree in trend
        base = rng.standard_normal((STEPS, 1, n)).astype(f32)
        grads = (base + f32(0.5) * rng.standard_normal((STEPS, w, n)).astype(f32)).astype(f32)
        grads_of[w] = grads
        write_run(f, f"onebit_adam/w{w}", ADAM, p0, grads, lrs, onebit_adam(w, p0, grads, lrs))
    # the same parameters, gradients and learning rates for the other two
    for w in (2, 4):
        write_run(f, f"zero_one_adam/w{w}", ZO, p0, grads_of[w], lrs, zero_one_adam(w, p0, grads_of[w], lrs))
        params, coeff = onebit_lamb(w, p0, grads_of[w], lrs)
        g = write_run(f, f"onebit_lamb/w{w}", LAMB, p0, grads_of[w], lrs, params)
        g.create_dataset("lamb_coeff_freeze", data=coeff)


def write_run(f, name, hyper, p0, grads, lrs, params):
    g = f.create_group(name)
    for key, val in hyper.items():
        g.attrs[key] = val
    g.create_dataset("sizes", data=np.array(SIZES, dtype=np.int32))
    g.create_dataset("p0", data=p0)
    g.create_dataset("grads", data=grads)
    g.create_dataset("lr", data=lrs)
    g.create_dataset("params", data=params)
    return g


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
    rng = np.random.default_rng(34)
    with h5py.File(os.path.join(out, "onebit.h5"), "w") as f:
        allreduce_goldens(f, rng)
        adam_goldens(f, rng)


if __name__ == "__main__":
    main()

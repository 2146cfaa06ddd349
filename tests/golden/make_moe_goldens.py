#!/usr/bin/python3
"""Writes tests/golden/moe_gating.h5, the reference tests/kernels/test_moe_gating.cpp compares the MoE
kernels (kernels/moe.hpp) against.

An independent PyTorch model of DeepSpeed's MoE layer, written from the facts
(/work/shared/DEEPSPEED-FACTS-2.md §4.2–4.5), not from DeepSpeed's code and without importing
it: TopKGate (fp32 softmax gate, top-1 / top-2 / top-k), the dense GShard dispatch/combine
einsums over a [S, E, C] combine tensor, GPT-2 expert MLPs and the residual MoE (PR-MoE).
Autograd gives the gradients. Everything runs in float64 from float32-rounded inputs; the
routing (experts, slots, capacity) is also recomputed in float32, as DeepSpeed runs it, and
must come out identical, so a near-tie cannot make the golden file depend on the precision.

Where DeepSpeed leaves an order to torch.topk's tie-breaking, this reference (and zero3d)
defines it explicitly:
  * top-1 without RTS keeps each expert's FIRST C tokens in token order;
  * top-1 with RTS keeps each expert's C tokens with the highest draw U (equal draws: token order);
  * top-k (k > 2, drop policy "probs") keeps each expert's C tokens with the highest gate value
    (equal values: token order), and a token's k experts are its k highest probabilities
    (equal probabilities: lower expert first).

The file has one group per case, /<case>, holding
  attributes  k, num_experts, min_capacity, drop_tokens, use_rts, top2_2nd_expert_sampling,
              training, use_residual (int64), noise ("None" | "Jitter" | "RSample"), capacity
  hparams     [capacity_factor, eval_capacity_factor, aux_loss_coef] (float64)
  inputs      x [S,h]; wg [E,h] (torch Linear layout, as DeepSpeed's gate.wg.weight);
              experts/c_fc_w [E,h,4h], c_fc_b [E,4h], c_proj_w [E,4h,h], c_proj_b [E,h]
              (Hugging Face Conv1D layout [in, out]); d_out [S,h] (upstream gradient);
              draws/jitter [S,h], draws/rts_uniform [S,E], draws/gumbel [S,E] (each only when
              the case consumes it); with use_residual: mlp/c_fc_w [h,4h], mlp/c_fc_b [4h],
              mlp/c_proj_w [4h,h], mlp/c_proj_b [h], coef_w [2,h], coef_b [2]
  outputs     logits [S,E], gates [S,E], expert [S,k] (int32, -1 = dropped), slot [S,k] (int32,
              -1 = dropped), weight [S,k], exp_counts [E] (int32), l_aux [], out [S,h]
  gradients   of  loss = Σ out ⊙ d_out + aux_loss_coef · l_aux:
              grads/logits [S,E], grads/x [S,h], grads/wg [E,h], grads/experts/<name>,
              grads/mlp/<name>, grads/coef_w, grads/coef_b

Run:  OPENBLAS_NUM_THREADS=1 /usr/bin/python3 tests/golden/make_moe_goldens.py tests/golden
"""
import math
import os
import sys

import h5py
import numpy as np
import torch

torch.set_num_threads(1)

F32_EPS = float(np.finfo(np.float32).eps)  # DeepSpeed clamps the top-2/top-k normaliser at fp32 eps

S, H, E = 16, 8, 4

# name: gate settings (k, E, capacity_factor, eval_capacity_factor, min_capacity, drop_tokens,
# use_rts, top2_2nd_expert_sampling, noise, training, use_residual, aux_loss_coef, seed) and
# what the case must show (drops / none).
CASES = {
    # C = ceil(16/4 · 0.5) = 2 per expert: tokens drop; RTS picks the survivors.
    "top1_rts_drops": dict(k=1, cf=0.5, min_capacity=1, use_rts=True, seed=11, expect_drops=True),
    # The same capacity without RTS: each expert keeps its first 2 tokens.
    "top1_first_come_drops": dict(k=1, cf=0.5, min_capacity=1, use_rts=False, seed=11, expect_drops=True),
    # RSample: the argmax sees logits + Gumbel; the weights stay the clean softmax.
    "top1_rsample": dict(k=1, cf=1.0, min_capacity=1, noise="RSample", seed=12, expect_drops=True),
    # Jitter multiplies the gate input by U(0.99, 1.01); residual MoE mixes in a dense MLP.
    "top1_jitter_residual": dict(k=1, cf=0.75, min_capacity=1, noise="Jitter", use_residual=True, seed=13,
                                 expect_drops=True),
    # drop_tokens false: C = the largest expert count, nothing drops.
    "top1_no_drops": dict(k=1, cf=0.25, min_capacity=1, drop_tokens=False, seed=14, expect_drops=False),
    # min_capacity raises ceil(16/4 · 0.1) = 1 to 3.
    "top1_min_capacity": dict(k=1, cf=0.1, min_capacity=3, seed=15, expect_drops=True),
    # Eval: eval_capacity_factor (0.5, not 2.0) and no RSample noise (training only); RTS still on.
    "top1_eval": dict(k=1, cf=2.0, eval_cf=0.5, min_capacity=1, noise="RSample", training=False, seed=16,
                      expect_drops=True),
    # Top-2: C = ceil(16/4 · 2 · 0.75) = 6; second experts sampled from logits + Gumbel.
    "top2_drops": dict(k=2, cf=0.75, min_capacity=1, seed=21, expect_drops=True),
    "top2_no_sampling_drops": dict(k=2, cf=0.75, min_capacity=1, top2_sampling=False, seed=22, expect_drops=True),
    "top2_no_drops": dict(k=2, cf=0.25, min_capacity=1, drop_tokens=False, seed=23, expect_drops=False),
    # Jitter + residual; RSample is not applied by top-2 (only top-1 reads the noisy policy).
    "top2_jitter_residual": dict(k=2, cf=0.75, min_capacity=1, noise="Jitter", use_residual=True, seed=24,
                                 expect_drops=True),
    "top2_eval": dict(k=2, cf=2.0, eval_cf=0.5, min_capacity=1, training=False, seed=25, expect_drops=True),
    # Top-k (k = 3 of 6 experts), drop policy "probs": C = ceil(16/6 · 3 · 0.75) = 6.
    "top3_drops": dict(k=3, E=6, cf=0.75, min_capacity=1, seed=31, expect_drops=True),
    "top3_no_drops": dict(k=3, E=6, cf=0.5, min_capacity=1, drop_tokens=False, seed=32, expect_drops=False),
}

DEFAULTS = dict(E=E, eval_cf=1.0, drop_tokens=True, use_rts=True, top2_sampling=True, noise="None", training=True,
                use_residual=False, aux_coef=0.01)


def capacity(num_tokens, num_experts, capacity_factor, min_capacity):
    """DeepSpeed's _capacity: ceil(S/E · cf) with cf held in a float32 tensor, so the product is
    a float32 one (S=25, E=2, cf=1.2 gives 16, not 15); raised to min_capacity."""
    c = int(math.ceil(np.float32(np.float32(num_tokens / num_experts) * np.float32(capacity_factor))))
    return max(c, min_capacity)


def keep_highest(score, mask, cap):
    """Per expert (column) keep the cap assigned tokens with the highest score; equal scores in
    token order (a stable descending sort)."""
    keep = torch.zeros_like(mask)
    for e in range(mask.shape[1]):
        order = torch.sort(score[:, e], descending=True, stable=True).indices
        chosen = [s for s in order.tolist() if mask[s, e] > 0][:cap]
        keep[chosen, e] = 1
    return keep


def top1(logits, c, draws):
    """Returns (gates, combine [S,E,C], choices, exp_counts, l_aux, C)."""
    num_tokens, num_experts = logits.shape
    gates = torch.softmax(logits, dim=1)
    if c["noise"] == "RSample" and c["training"]:
        idx = torch.argmax(logits + draws["gumbel"], dim=1)  # noisy logits pick; clean gates weigh
    else:
        idx = torch.argmax(gates, dim=1)
    mask1 = torch.nn.functional.one_hot(idx, num_experts).to(logits.dtype)
    exp_counts = mask1.sum(0).to(torch.int64)  # before dropping
    if c["drop_tokens"]:
        cap = capacity(num_tokens, num_experts, c["cf_now"], c["min_capacity"])
    else:
        cap = min(int(exp_counts.max()), num_tokens)
    l_aux = num_experts * torch.sum(gates.mean(0) * mask1.mean(0))
    assert num_tokens >= c["min_capacity"]
    if c["use_rts"]:
        keep = keep_highest(mask1 * draws["rts_uniform"], mask1, cap)
    else:
        keep = (torch.cumsum(mask1, 0) - 1 < cap).to(mask1.dtype) * mask1  # first cap in token order
    mask1 = mask1 * keep
    loc = ((torch.cumsum(mask1, 0) - 1) * mask1).sum(1).to(torch.int64)
    place = torch.nn.functional.one_hot(loc, cap).to(logits.dtype)
    combine = torch.einsum("se,sc->sec", gates * mask1, place)
    return gates, combine, idx.unsqueeze(1), exp_counts, l_aux, cap


def top2(logits, c, draws):
    num_tokens, num_experts = logits.shape
    gates = torch.softmax(logits, dim=1)
    idx1 = torch.argmax(gates, dim=1)
    mask1 = torch.nn.functional.one_hot(idx1, num_experts).to(logits.dtype)
    noisy = logits + draws["gumbel"] if c["top2_sampling"] else logits  # sampled in eval too
    idx2 = torch.argmax(noisy.masked_fill(mask1.bool(), float("-inf")), dim=1)
    mask2 = torch.nn.functional.one_hot(idx2, num_experts).to(logits.dtype)
    loc1 = torch.cumsum(mask1, 0) - 1
    loc2 = torch.cumsum(mask2, 0) - 1 + mask1.sum(0, keepdim=True)  # every first choice comes first
    l_aux = torch.mean(gates.mean(0) * mask1.mean(0)) * num_experts * num_experts  # first choices only
    exp_counts = (mask1 + mask2).sum(0).to(torch.int64)
    if c["drop_tokens"]:
        cap = capacity(num_tokens, num_experts, 2 * c["cf_now"], c["min_capacity"])
        mask1 = mask1 * (loc1 < cap)
        mask2 = mask2 * (loc2 < cap)
    else:
        cap = int(exp_counts.max())
    g1 = (gates * mask1).sum(1)
    g2 = (gates * mask2).sum(1)
    denom = torch.clamp(g1 + g2, min=F32_EPS)
    w1, w2 = g1 / denom, g2 / denom
    place1 = torch.nn.functional.one_hot(((loc1 * mask1).sum(1)).to(torch.int64), cap).to(logits.dtype)
    place2 = torch.nn.functional.one_hot(((loc2 * mask2).sum(1)).to(torch.int64), cap).to(logits.dtype)
    combine = (torch.einsum("se,sc->sec", w1.unsqueeze(1) * mask1, place1) +
               torch.einsum("se,sc->sec", w2.unsqueeze(1) * mask2, place2))
    return gates, combine, torch.stack([idx1, idx2], 1), exp_counts, l_aux, cap


def topk(logits, c, draws):
    num_tokens, num_experts = logits.shape
    k = c["k"]
    gates = torch.softmax(logits, dim=1)
    top_idx = torch.sort(gates, dim=1, descending=True, stable=True).indices[:, :k]
    mask = torch.zeros_like(gates).scatter(1, top_idx, 1.0)
    exp_counts = mask.sum(0).to(torch.int64)
    l_aux = torch.mean(gates.mean(0) * mask.mean(0)) * num_experts * num_experts / k
    if c["drop_tokens"]:
        cap = capacity(num_tokens, num_experts, k * c["cf_now"], c["min_capacity"])
        mask = mask * keep_highest(gates.detach() * mask, mask, cap)  # policy "probs"
    else:
        cap = int(exp_counts.max())
    loc = ((torch.cumsum(mask, 0) - 1) * mask).to(torch.int64)
    w = gates * mask / torch.clamp((gates * mask).sum(1, keepdim=True), min=F32_EPS)
    combine = torch.einsum("se,sec->sec", w, torch.nn.functional.one_hot(loc, cap).to(logits.dtype))
    return gates, combine, top_idx, exp_counts, l_aux, cap


def gate(x, wg, c, draws):
    xg = x * draws["jitter"] if "jitter" in draws else x
    logits = xg @ wg.T
    if logits.requires_grad:
        logits.retain_grad()
    fn = top1 if c["k"] == 1 else top2 if c["k"] == 2 else topk
    return (logits,) + fn(logits, c, draws)


def mlp(x, w):
    h = torch.nn.functional.gelu(x @ w["c_fc_w"] + w["c_fc_b"], approximate="tanh")
    return h @ w["c_proj_w"] + w["c_proj_b"]


def routing_table(combine, choices):
    """Per token and choice: (expert or -1, slot or -1, weight), read back from the dense
    combine tensor (a dropped choice has no nonzero entry)."""
    num_tokens, k = choices.shape
    expert = -np.ones((num_tokens, k), np.int32)
    slot = -np.ones((num_tokens, k), np.int32)
    weight = np.zeros((num_tokens, k))
    cw = combine.detach()
    for s in range(num_tokens):
        for j in range(k):
            e = int(choices[s, j])
            nz = torch.nonzero(cw[s, e]).flatten()
            if len(nz):
                assert len(nz) == 1
                expert[s, j], slot[s, j], weight[s, j] = e, int(nz[0]), float(cw[s, e, nz[0]])
    return expert, slot, weight


def make_case(name, spec):
    c = dict(DEFAULTS, **spec)
    c["cf_now"] = c["cf"] if c["training"] else c["eval_cf"]
    num_experts, k = c["E"], c["k"]
    gen = torch.Generator().manual_seed(c["seed"])
    r = lambda *shape, scale=1.0: (scale * torch.randn(*shape, generator=gen)).float()  # noqa: E731
    inputs = {"x": r(S, H), "wg": r(num_experts, H, scale=0.7), "d_out": r(S, H)}
    experts = {"c_fc_w": r(num_experts, H, 4 * H, scale=0.3), "c_fc_b": r(num_experts, 4 * H, scale=0.1),
               "c_proj_w": r(num_experts, 4 * H, H, scale=0.3), "c_proj_b": r(num_experts, H, scale=0.1)}
    dense = {}
    if c["use_residual"]:
        dense = {"c_fc_w": r(H, 4 * H, scale=0.3), "c_fc_b": r(4 * H, scale=0.1), "c_proj_w": r(4 * H, H, scale=0.3),
                 "c_proj_b": r(H, scale=0.1)}
        inputs["coef_w"], inputs["coef_b"] = r(2, H, scale=0.5), r(2, scale=0.1)
    draws = {}
    if c["noise"] == "Jitter" and c["training"]:
        draws["jitter"] = (0.99 + 0.02 * torch.rand(S, H, generator=gen)).float()
    if k == 1 and c["use_rts"]:
        draws["rts_uniform"] = torch.rand(S, num_experts, generator=gen).float()
    if (k == 1 and c["noise"] == "RSample" and c["training"]) or (k == 2 and c["top2_sampling"]):
        u = torch.rand(S, num_experts, generator=gen).clamp(1e-7, 1 - 1e-7)
        draws["gumbel"] = (-torch.log(-torch.log(u))).float()

    # Routing in float32, as DeepSpeed runs the gate; compared with the float64 routing below.
    with torch.no_grad():
        _, _, comb32, ch32, cnt32, _, cap32 = gate(inputs["x"], inputs["wg"], c, draws)
    route32 = routing_table(comb32, ch32)

    d64 = lambda t: t.double().requires_grad_(True)  # noqa: E731
    P = {key: d64(v) for key, v in inputs.items()}
    X = {key: d64(v) for key, v in experts.items()}
    M = {key: d64(v) for key, v in dense.items()}
    D = {key: v.double() for key, v in draws.items()}
    logits, gates, combine, choices, exp_counts, l_aux, cap = gate(P["x"], P["wg"], c, D)
    dispatch = (combine != 0).to(combine.dtype)  # DeepSpeed's dispatch mask: no gradient
    dispatched = torch.einsum("sec,sm->ecm", dispatch, P["x"])
    expert_out = torch.stack([mlp(dispatched[e], {n: X[n][e] for n in X}) for e in range(num_experts)])
    out = torch.einsum("sec,ecm->sm", combine, expert_out)
    if c["use_residual"]:
        coef = torch.softmax(P["x"] @ P["coef_w"].T + P["coef_b"], dim=-1)
        out = out * coef[:, 0:1] + mlp(P["x"], M) * coef[:, 1:]
    loss = (out * P["d_out"]).sum() + c["aux_coef"] * l_aux
    loss.backward()

    expert, slot, weight = routing_table(combine, choices)
    assert cap == cap32 and torch.equal(exp_counts, cnt32), name
    assert np.array_equal(expert, route32[0]) and np.array_equal(slot, route32[1]), f"{name}: fp32 routing differs"
    dropped = int((expert < 0).sum())
    assert (dropped > 0) == c["expect_drops"], f"{name}: {dropped} dropped"
    by_choice = " ".join(f"{int((expert[:, j] >= 0).sum())}" for j in range(k))
    print(f"{name}: k={k} E={num_experts} C={cap} dropped {dropped}/{S * k} (kept per choice {by_choice}) "
          f"counts {exp_counts.tolist()} l_aux={float(l_aux):.6f}")
    return c, inputs, experts, dense, draws, dict(logits=logits, gates=gates, expert=expert, slot=slot, weight=weight,
                                                   exp_counts=exp_counts, l_aux=l_aux, out=out, cap=cap), P, X, M


def write_case(f, name, spec):
    c, inputs, experts, dense, draws, res, P, X, M = make_case(name, spec)
    g = f.create_group(name)
    for key in ("k", "min_capacity"):
        g.attrs[key] = np.int64(c[key])
    g.attrs["num_experts"] = np.int64(c["E"])
    g.attrs["capacity"] = np.int64(res["cap"])
    for key, attr in (("drop_tokens", "drop_tokens"), ("use_rts", "use_rts"), ("top2_sampling", "top2_2nd_expert_sampling"),
                      ("training", "training"), ("use_residual", "use_residual")):
        g.attrs[attr] = np.int64(int(c[key]))
    g.attrs["noise"] = np.bytes_(c["noise"])  # fixed-length, as zero3d's h5 reader expects
    g.create_dataset("hparams", data=np.array([c["cf"], c["eval_cf"], c["aux_coef"]], np.float64))
    f32 = lambda t: t.detach().numpy().astype(np.float32)  # noqa: E731
    for key, v in inputs.items():
        g.create_dataset(key, data=f32(v))
    for key, v in experts.items():
        g.create_dataset("experts/" + key, data=f32(v))
    for key, v in dense.items():
        g.create_dataset("mlp/" + key, data=f32(v))
    for key, v in draws.items():
        g.create_dataset("draws/" + key, data=f32(v))
    for key in ("logits", "gates", "out"):
        g.create_dataset(key, data=f32(res[key]))
    g.create_dataset("l_aux", data=np.float32(float(res["l_aux"])))
    g.create_dataset("expert", data=res["expert"])
    g.create_dataset("slot", data=res["slot"])
    g.create_dataset("weight", data=res["weight"].astype(np.float32))
    g.create_dataset("exp_counts", data=res["exp_counts"].numpy().astype(np.int32))
    g.create_dataset("grads/logits", data=f32(res["logits"].grad))
    for key in ("x", "wg") + (("coef_w", "coef_b") if c["use_residual"] else ()):
        g.create_dataset("grads/" + key, data=f32(P[key].grad))
    for key, v in X.items():
        g.create_dataset("grads/experts/" + key, data=f32(v.grad))
    for key, v in M.items():
        g.create_dataset("grads/mlp/" + key, data=f32(v.grad))


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
    # Sanity of the capacity arithmetic against the facts' examples before writing anything.
    assert capacity(3, 4, 8.0, 0) == 6 and capacity(8, 2, 4.0, 0) == 16 and capacity(16, 4, 0.1, 3) == 3
    with h5py.File(os.path.join(out, "moe_gating.h5"), "w") as f:
        for name, spec in CASES.items():
            write_case(f, name, spec)
        # Same inputs, same capacity: random token selection must keep other tokens than first-come.
        assert not np.array_equal(f["top1_rts_drops/expert"][()], f["top1_first_come_drops/expert"][()])


if __name__ == "__main__":
    main()

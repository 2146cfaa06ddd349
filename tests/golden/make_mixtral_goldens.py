#!/usr/bin/python3
"""Writes the Mixtral goldens (tests/golden/mixtral_moe.h5, mixtral_jitter.h5) that
tests/cli/test_cli_llama.cpp compares zero3d against.

Independent reference: Hugging Face's MixtralForCausalLM written here in plain PyTorch (Debian's
python3-torch 1.13; transformers is not installed), following models/mixtral/modeling_mixtral.py,
computed in float64:
  * the attention half is Mistral's (make_llama_goldens.py: RMSNorm, RoPE with rotate_half,
    grouped-query attention, the sliding window);
  * MixtralSparseMoeBlock: router_logits = gate(x) (nn.Linear(C, E, bias=False)); routing_weights =
    softmax(router_logits) in fp32 (float64 here); torch.topk of num_experts_per_tok; the top-k
    weights divided by their sum; each expert w2(silu(w1 x) * w3 x) over the tokens that chose it,
    weighted and summed (index_add_); every token kept (no capacity); with router_jitter_noise j,
    in training, its input (router's and experts' alike: hidden_states *= ...) times U(1-j, 1+j);
  * load_balancing_loss_func over the router logits of all layers concatenated:
    E * sum(mean_tokens(one_hot(top-k)) * mean_tokens(softmax)), and, as output_router_logits is
    true, loss = cross-entropy + router_aux_loss_coef * aux_loss.

The jitter is the one zero3d draws (src/model/moe_layer.cpp mixtral_jitter): channel c of global
token g = sample·T + position in layer l is factor 1 - j + 2j·u, u draw c of zero3d's
Rng(seed ^ 0x6a6974746572, g·L + l) (golden_common.rng_uniforms re-implements SplitMix64), with
seed the run's training.seed (attribute jitter_seed) and sample counting from 0 at the first step,
B samples a step: PyTorch's own uniform_ would give other numbers, so the stream is fixed here.

The file holds what make_llama_goldens.py's files hold (weights by Hugging Face name, golden/...,
the config.json text as attribute hf_config); golden/loss and golden/adamw_losses are the
cross-entropy alone (what zero3d reports), golden/aux_loss the load-balancing loss of the first
pass, and golden/grads and golden/grad_norms are those of the whole loss.

Run:  OPENBLAS_NUM_THREADS=1 /usr/bin/python3 tests/golden/make_mixtral_goldens.py tests/golden
"""
import json
import os
import sys

import h5py
import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from golden_common import rng_uniforms, write_adamw_steps, write_pass  # noqa: E402
from make_llama_goldens import Shape, attention_half, linear, lm_head, param_shapes, rms_norm, rope_cos_sin  # noqa: E402

torch.set_num_threads(1)
torch.set_default_dtype(torch.float64)

STEPS = 8

# GQA (4 query heads over 2 K/V heads), a sliding window (12) below T (16), 4 SwiGLU experts, top-2,
# and a load-balancing loss weighed in (router_aux_loss_coef above the default so that it shows).
CASE = dict(
    config=dict(model_type="mixtral", vocab_size=64, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=64,
                rope_theta=1000000.0, sliding_window=12, tie_word_embeddings=False, hidden_act="silu",
                num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.02, router_jitter_noise=0.0,
                output_router_logits=True),
    T=16, B=4, hparams=(3e-3, 0.9, 0.95, 1e-8, 0.01, 1.0))
# The same model with the router's jitter at 0.2 (large enough to change routing), drawn with
# training.seed 5 (test_cli_llama.cpp's golden_run).
JITTER_CASE = dict(CASE, config=dict(CASE["config"], router_jitter_noise=0.2), jitter_seed=5)
JITTER_KEY = 0x6a6974746572  # zero3d's key of the jitter stream ("jitter")


def mixtral_param_shapes(s, cfg):
    """LlamaForCausalLM's names with each layer's mlp.* replaced by the sparse MoE block's."""
    E = cfg["num_local_experts"]
    shapes = {}
    for name, shape in param_shapes(s).items():
        if ".mlp." in name:
            continue
        shapes[name] = shape
        if name.endswith("post_attention_layernorm.weight"):
            n = name[: -len("post_attention_layernorm.weight")] + "block_sparse_moe."
            shapes[n + "gate.weight"] = (E, s.C)
            for e in range(E):
                shapes[n + f"experts.{e}.w1.weight"] = (s.I, s.C)
                shapes[n + f"experts.{e}.w3.weight"] = (s.I, s.C)
                shapes[n + f"experts.{e}.w2.weight"] = (s.C, s.I)
    return shapes


def make_params(shapes, gen):
    params = {}
    for name, shape in shapes.items():
        t = 1.0 + 0.1 * torch.randn(shape, generator=gen) if "norm" in name else 0.08 * torch.randn(shape, generator=gen)
        params[name] = t.float().double().requires_grad_(True)  # the float32 weights zero3d loads
    return params


def jitter_factors(seed, j, first_token, tokens, L, l, C):
    """zero3d's jitter factors [tokens, C] of layer l for global tokens first_token, first_token + 1, ..."""
    streams = (np.arange(first_token, first_token + tokens, dtype=np.uint64) * np.uint64(L) + np.uint64(l))
    u = rng_uniforms(seed ^ JITTER_KEY, streams, C)
    return torch.from_numpy((1.0 - j + 2.0 * j * u).astype(np.float32).astype(np.float64))


def sparse_moe_block(p, n, h, cfg, noise=None):
    """MixtralSparseMoeBlock.forward: (output [B, T, C], router_logits [B·T, E]); noise [B·T, C]: the
    training jitter's factors, or None."""
    B, T, C = h.shape
    E, k = cfg["num_local_experts"], cfg["num_experts_per_tok"]
    x = h.reshape(-1, C)
    if noise is not None:
        x = x * noise
    router_logits = x @ p[n + "gate.weight"].T
    routing_weights = router_logits.softmax(dim=-1)
    top_weights, top_experts = torch.topk(routing_weights, k, dim=-1)
    top_weights = top_weights / top_weights.sum(dim=-1, keepdim=True)
    out = torch.zeros_like(x)
    for e in range(E):
        rows, slot = torch.nonzero(top_experts == e, as_tuple=True)
        if rows.numel() == 0:
            continue
        xe = x[rows]
        m = f"{n}experts.{e}."
        y = linear(torch.nn.functional.silu(linear(xe, p, m + "w1")) * linear(xe, p, m + "w3"), p, m + "w2")
        out = out.index_add(0, rows, y * top_weights[rows, slot, None])
    return out.view(B, T, C), router_logits


def load_balancing_loss(router_logits, E, k):
    """transformers' load_balancing_loss_func without an attention mask."""
    logits = torch.cat(router_logits, dim=0)
    routing_weights = logits.softmax(dim=-1)
    _, selected = torch.topk(routing_weights, k, dim=-1)
    expert_mask = torch.nn.functional.one_hot(selected, E)  # [tokens, k, E]
    tokens_per_expert = expert_mask.double().mean(dim=0)
    router_prob_per_expert = routing_weights.mean(dim=0)
    return (tokens_per_expert * router_prob_per_expert.unsqueeze(0)).sum() * E


def forward(p, tokens, s, cfg, noise_of=None):
    """(logits, load-balancing loss); noise_of(l): layer l's jitter factors (None: no jitter)."""
    cos, sin = rope_cos_sin(s, tokens.shape[1])
    x = p["model.embed_tokens.weight"][tokens]
    router_logits = []
    for l in range(s.L):
        n = f"model.layers.{l}."
        x = attention_half(p, n, x, s, l, cos, sin)
        h = rms_norm(x, p[n + "post_attention_layernorm.weight"], s.eps)
        moe, logits = sparse_moe_block(p, n + "block_sparse_moe.", h, cfg, noise_of(l) if noise_of else None)
        x = x + moe
        router_logits.append(logits)
    return lm_head(p, x, s), load_balancing_loss(router_logits, cfg["num_local_experts"], cfg["num_experts_per_tok"])


def write(path, case, seed):
    cfg, T, B, hp = case["config"], case["T"], case["B"], case["hparams"]
    s = Shape(cfg, T)
    coef = cfg["router_aux_loss_coef"]
    gen = torch.Generator().manual_seed(seed)
    params = make_params(mixtral_param_shapes(s, cfg), gen)
    stream = torch.randint(0, s.V, (B * T + 1,), generator=gen)
    tokens, targets = stream[:-1].view(B, T), stream[1:].view(B, T)

    j = cfg["router_jitter_noise"]
    step = [0]  # the step whose forward runs next: its B samples are step·B, ..., step·B + B - 1

    def losses_of():
        noise_of = None
        if j > 0:
            noise_of = lambda l: jitter_factors(case["jitter_seed"], j, step[0] * B * T, B * T, s.L, l, s.C)  # noqa: E731
        logits, aux = forward(params, tokens, s, cfg, noise_of)
        ce = torch.nn.functional.cross_entropy(logits.view(-1, s.V), targets.reshape(-1))
        return logits, ce, aux

    with h5py.File(path, "w") as f:
        f.attrs["batch"] = np.int64(B)
        f.attrs["steps"] = np.int64(STEPS)
        f.attrs["hf_config"] = np.bytes_(json.dumps(cfg, indent=2))  # fixed-length: zero3d's h5 reads those
        if j > 0:
            f.attrs["jitter_seed"] = np.int64(case["jitter_seed"])
        for name, t in params.items():
            f.create_dataset(name, data=t.detach().numpy().astype(np.float32))
        logits, ce, aux = losses_of()
        (ce + coef * aux).backward()
        g = f.create_group("golden")
        write_pass(g, tokens, targets, logits, ce, params, extra={"stream": stream})
        g.create_dataset("aux_loss", data=np.float32(aux.item()))

        def step_loss():
            _, ce, aux = losses_of()
            step[0] += 1
            return ce, ce + coef * aux

        losses, norms = write_adamw_steps(g, params, hp, STEPS, step_loss)
    print(f"{path}: loss {losses[0]:.6f} -> {losses[-1]:.6f} after {STEPS} AdamW steps, grad norm {norms[0]:.4f}, "
          f"aux {float(aux):.6f}")


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
    write(os.path.join(out, "mixtral_moe.h5"), CASE, seed=3300)
    write(os.path.join(out, "mixtral_jitter.h5"), JITTER_CASE, seed=3300)


if __name__ == "__main__":
    main()

#!/usr/bin/python3
"""Writes the Llama-family model goldens (tests/golden/llama_*.h5) that tests/model/test_llama_golden.cpp
and tests/cli/test_cli_llama.cpp compare zero3d against.

Independent reference: Hugging Face's LlamaForCausalLM written here in plain PyTorch (Debian's
python3-torch 1.13; transformers is not installed), following models/llama/modeling_llama.py,
models/mistral and models/qwen2 (which reuse its block), computed in float64:
  * LlamaRMSNorm: weight · x · rsqrt(mean(x²) + eps);
  * q/k/v/o_proj and gate/up/down_proj as nn.Linear (x @ Wᵀ + b, weights [out, in]);
  * RoPE as apply_rotary_pos_emb with rotate_half, inv_freq and the attention factor of each rope
    type from make_llama_kernels_golden.py (modeling_rope_utils.py's formulas);
  * grouped-query attention through repeat_kv, scaling head_dim**-0.5, the causal mask and, for
    a sliding layer, masking_utils' sliding_window_overlay (key j visible to query i iff
    i - window < j <= i);
  * LlamaMLP: down_proj(silu(gate_proj(x)) * up_proj(x));
  * the final model.norm, then lm_head (or embed_tokens.weight with tie_word_embeddings).

Each file holds
  /<hf name>                      the initial weights, Hugging Face names and shapes, float32
  /golden/inputs, /golden/targets [B, T] int32: sample b is stream[b·T : b·T + T], its targets one later
  /golden/stream [B·T + 1] int32   the token stream (an llm.c token shard of exactly one batch)
  /golden/logits [B, T, V], /golden/loss []
  /golden/grads/<hf name>          d(mean cross-entropy)/d(weight) at the initial weights
  /golden/adamw_losses [S], /golden/grad_norms [S]   loss and global gradient norm (before clipping)
                                   before each of S AdamW steps on that batch
  /golden/hparams                  [lr, beta1, beta2, eps, weight_decay, gradient_clipping]
  attributes batch, steps, and hf_config: the config.json text a Hugging Face directory would hold

Run:  OPENBLAS_NUM_THREADS=1 /usr/bin/python3 tests/golden/make_llama_goldens.py tests/golden
"""
import json
import math
import os
import sys

import h5py
import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from golden_common import write_adamw_steps, write_pass  # noqa: E402
from make_llama_kernels_golden import rope_inv_freq  # noqa: E402  (modeling_rope_utils.py's formulas)

torch.set_num_threads(1)
torch.set_default_dtype(torch.float64)

STEPS = 8

# Each case: a Hugging Face config.json (the keys zero3d reads), the batch, and AdamW's settings.
CASES = {
    # Llama: GQA (4 query heads over 2 K/V heads), head_dim 16 != hidden_size/heads, llama3 RoPE
    # over all three of its wavelength regions, untied head, no biases; clipping active.
    "llama_gqa": dict(
        config=dict(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                    max_position_embeddings=131072, rope_theta=10000.0,
                    rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                      original_max_position_embeddings=8192),
                    tie_word_embeddings=False, attention_bias=False, mlp_bias=False, hidden_act="silu"),
        T=16, B=4, hparams=(3e-3, 0.9, 0.95, 1e-8, 0.01, 0.5)),
    # Llama with every bias (attention_bias, mlp_bias), multi-query attention (1 K/V head) and
    # linear RoPE scaling.
    "llama_biases": dict(
        config=dict(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=1, rms_norm_eps=1e-5, max_position_embeddings=64,
                    rope_theta=500.0, rope_scaling=dict(type="linear", factor=2.0), tie_word_embeddings=False,
                    attention_bias=True, mlp_bias=True, hidden_act="silu"),
        T=16, B=2, hparams=(3e-3, 0.9, 0.999, 1e-8, 0.1, 0.0)),
    # Qwen2: q/k/v biases (o_proj none), a tied head as Qwen2-0.5B has, and a sliding window on the
    # layers from max_window_layers (layer 1 slides, layer 0 does not).
    "qwen2_bias": dict(
        config=dict(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=32768,
                    rope_theta=1000000.0, tie_word_embeddings=True, use_sliding_window=True, sliding_window=6,
                    max_window_layers=1, hidden_act="silu"),
        T=16, B=4, hparams=(3e-3, 0.9, 0.95, 1e-8, 0.01, 0.0)),
    # Mistral: a sliding window (20) far below T (72, which spans two of the kernel's 64-row
    # blocks) on every layer, and dynamic NTK RoPE growing its base past max_position_embeddings.
    "mistral_window": dict(
        config=dict(model_type="mistral", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=32,
                    rope_theta=10000.0, rope_scaling=dict(rope_type="dynamic", factor=2.0), sliding_window=20,
                    tie_word_embeddings=False, hidden_act="silu"),
        T=72, B=2, hparams=(3e-3, 0.9, 0.95, 1e-8, 0.01, 1.0)),
}


class Shape:
    def __init__(self, cfg, T):
        self.V, self.C, self.I = cfg["vocab_size"], cfg["hidden_size"], cfg["intermediate_size"]
        self.L, self.H = cfg["num_hidden_layers"], cfg["num_attention_heads"]
        self.Hkv = cfg.get("num_key_value_heads") or self.H
        self.d = cfg.get("head_dim") or self.C // self.H
        self.T, self.eps = T, cfg["rms_norm_eps"]
        self.tied = cfg.get("tie_word_embeddings", False)
        qwen2 = cfg["model_type"] == "qwen2"
        self.qkv_bias = qwen2 or cfg.get("attention_bias", False)
        self.o_bias = cfg.get("attention_bias", False)
        self.mlp_bias = cfg.get("mlp_bias", False)
        # the sliding window of each layer (None: full causal attention)
        if cfg["model_type"] in ("mistral", "mixtral"):
            self.windows = [cfg.get("sliding_window")] * self.L
        elif qwen2 and cfg.get("use_sliding_window", False):
            self.windows = [cfg["sliding_window"] if l >= cfg["max_window_layers"] else None for l in range(self.L)]
        else:
            self.windows = [None] * self.L
        scaling = dict(cfg.get("rope_scaling") or {})
        p = dict(theta=cfg.get("rope_theta", 10000.0), factor=1.0,
                 max_position_embeddings=cfg["max_position_embeddings"], original_max_position_embeddings=0,
                 low_freq_factor=1.0, high_freq_factor=4.0, beta_fast=32.0, beta_slow=1.0, attention_factor=0.0,
                 mscale=0.0, mscale_all_dim=0.0, seq_len=T, type=scaling.pop("rope_type", scaling.pop("type", "default")))
        p.update(scaling)
        self.inv_freq, self.attention_factor = rope_inv_freq(p, self.d)


def param_shapes(s):
    A, KV = s.H * s.d, s.Hkv * s.d
    shapes = {"model.embed_tokens.weight": (s.V, s.C)}
    for l in range(s.L):
        p = f"model.layers.{l}."
        shapes[p + "input_layernorm.weight"] = (s.C,)
        shapes[p + "self_attn.q_proj.weight"] = (A, s.C)
        shapes[p + "self_attn.k_proj.weight"] = (KV, s.C)
        shapes[p + "self_attn.v_proj.weight"] = (KV, s.C)
        if s.qkv_bias:
            shapes[p + "self_attn.q_proj.bias"] = (A,)
            shapes[p + "self_attn.k_proj.bias"] = (KV,)
            shapes[p + "self_attn.v_proj.bias"] = (KV,)
        shapes[p + "self_attn.o_proj.weight"] = (s.C, A)
        if s.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (s.C,)
        shapes[p + "post_attention_layernorm.weight"] = (s.C,)
        shapes[p + "mlp.gate_proj.weight"] = (s.I, s.C)
        shapes[p + "mlp.up_proj.weight"] = (s.I, s.C)
        shapes[p + "mlp.down_proj.weight"] = (s.C, s.I)
        if s.mlp_bias:
            shapes[p + "mlp.gate_proj.bias"] = (s.I,)
            shapes[p + "mlp.up_proj.bias"] = (s.I,)
            shapes[p + "mlp.down_proj.bias"] = (s.C,)
    shapes["model.norm.weight"] = (s.C,)
    if not s.tied:
        shapes["lm_head.weight"] = (s.V, s.C)
    return shapes


def make_params(s, gen):
    """Random (not zero/one) values everywhere so that every gradient path is exercised."""
    params = {}
    for name, shape in param_shapes(s).items():
        if "norm" in name:
            t = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif name.endswith("bias"):
            t = 0.05 * torch.randn(shape, generator=gen)
        else:
            t = 0.08 * torch.randn(shape, generator=gen)
        params[name] = t.float().double().requires_grad_(True)  # the float32 weights zero3d loads
    return params


def rms_norm(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def linear(x, p, name):
    y = x @ p[name + ".weight"].T
    return y + p[name + ".bias"] if name + ".bias" in p else y


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def rope_cos_sin(s, T):
    """cos and sin [T, d] of positions 0..T-1 (the attention factor folded in)."""
    pos = torch.arange(T).double()
    freqs = pos[:, None] * s.inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * s.attention_factor, emb.sin() * s.attention_factor


def attention_half(p, n, x, s, l, cos, sin, att_mask=None):
    """x + o_proj(attention(...)) on input_layernorm(x), layer l with parameter prefix n; att_mask
    (make_dropout_goldens.py): factors multiplying the probabilities, LlamaAttention's dropout."""
    B, T = x.shape[0], x.shape[1]
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    h = rms_norm(x, p[n + "input_layernorm.weight"], s.eps)
    q = linear(h, p, n + "self_attn.q_proj").view(B, T, s.H, s.d).transpose(1, 2)
    k = linear(h, p, n + "self_attn.k_proj").view(B, T, s.Hkv, s.d).transpose(1, 2)
    v = linear(h, p, n + "self_attn.v_proj").view(B, T, s.Hkv, s.d).transpose(1, 2)
    q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    G = s.H // s.Hkv  # repeat_kv
    k = k[:, :, None].expand(B, s.Hkv, G, T, s.d).reshape(B, s.H, T, s.d)
    v = v[:, :, None].expand(B, s.Hkv, G, T, s.d).reshape(B, s.H, T, s.d)
    visible = j <= i
    if s.windows[l] is not None:
        visible = visible & (j > i - s.windows[l])
    att = (q @ k.transpose(-2, -1)) * s.d ** -0.5
    att = att.masked_fill(~visible, float("-inf")).softmax(dim=-1)
    if att_mask is not None:
        att = att * att_mask
    y = (att @ v).transpose(1, 2).reshape(B, T, s.H * s.d)
    return x + linear(y, p, n + "self_attn.o_proj")


def lm_head(p, x, s):
    """The final model.norm, then lm_head (or embed_tokens.weight with tie_word_embeddings)."""
    x = rms_norm(x, p["model.norm.weight"], s.eps)
    head = p["model.embed_tokens.weight"] if s.tied else p["lm_head.weight"]
    return x @ head.T


def forward(p, tokens, s):
    cos, sin = rope_cos_sin(s, tokens.shape[1])
    x = p["model.embed_tokens.weight"][tokens]
    for l in range(s.L):
        n = f"model.layers.{l}."
        x = attention_half(p, n, x, s, l, cos, sin)
        h = rms_norm(x, p[n + "post_attention_layernorm.weight"], s.eps)
        gate, up = linear(h, p, n + "mlp.gate_proj"), linear(h, p, n + "mlp.up_proj")
        x = x + linear(torch.nn.functional.silu(gate) * up, p, n + "mlp.down_proj")
    return lm_head(p, x, s)


def write(path, case, seed):
    cfg, T, B, hp = case["config"], case["T"], case["B"], case["hparams"]
    s = Shape(cfg, T)
    gen = torch.Generator().manual_seed(seed)
    params = make_params(s, gen)
    stream = torch.randint(0, s.V, (B * T + 1,), generator=gen)
    tokens, targets = stream[:-1].view(B, T), stream[1:].view(B, T)
    with h5py.File(path, "w") as f:
        f.attrs["batch"] = np.int64(B)
        f.attrs["steps"] = np.int64(STEPS)
        f.attrs["hf_config"] = np.bytes_(json.dumps(cfg, indent=2))  # fixed-length: zero3d's h5 reads those
        for name, t in params.items():
            f.create_dataset(name, data=t.detach().numpy().astype(np.float32))
        logits = forward(params, tokens, s)
        loss = torch.nn.functional.cross_entropy(logits.view(-1, s.V), targets.reshape(-1))
        loss.backward()
        g = f.create_group("golden")
        write_pass(g, tokens, targets, logits, loss, params, extra={"stream": stream})

        def step_loss():
            loss = torch.nn.functional.cross_entropy(forward(params, tokens, s).view(-1, s.V), targets.reshape(-1))
            return loss, loss

        losses, norms = write_adamw_steps(g, params, hp, STEPS, step_loss)
    print(f"{path}: loss {losses[0]:.6f} -> {losses[-1]:.6f} after {STEPS} AdamW steps, grad norm {norms[0]:.4f}")


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
    for k, (name, case) in enumerate(CASES.items()):
        write(os.path.join(out, name + ".h5"), case, seed=3200 + k)


if __name__ == "__main__":
    main()

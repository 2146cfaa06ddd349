#!/usr/bin/python3
"""Writes the generation goldens (tests/golden/generate_*.h5) that tests/infer/test_generate_golden.cpp
and tests/cli/test_cli_generate.cpp compare `zero3d generate` against.

An independent reference, written from Hugging Face's modeling files and generation utilities
(transformers is not installed here; Debian's python3-torch 1.13 is), sharing no code with zero3d
or with the other golden scripts:

  * GPT-2 (modeling_gpt2.py GPT2LMHeadModel): learned positions, pre-LayerNorm blocks (eps 1e-5),
    Conv1D projections (x @ W + b, W [in, out]), gelu_new (tanh GELU), the LM head tied to wte.
  * The Llama family (modeling_llama.py LlamaForCausalLM; Mistral and Qwen2 reuse its block):
    RMSNorm, q/k/v/o and gate/up/down as nn.Linear, RoPE with rotate_half at each token's
    position (default rope: inv_freq = 1 / theta^(2i/d)), grouped-query attention through
    repeat_kv, a sliding window where the config asks (key j visible to query i iff
    i - window < j <= i), untied or tied LM head.
  * A KV cache of its own (the legacy past_key_values tuple: per layer K and V [B, Hkv, t, d]):
    a prefill over the prompt, then one token per step attending over the cache. Before writing,
    the script checks that every cached step's logits equal a full recompute without cache.
  * Sampling as GenerationMixin._sample applies its warpers (generation/logits_process.py):
    MinNewTokensLengthLogitsProcessor (EOS to -inf), then TemperatureLogitsWarper, TopKLogitsWarper
    (scores < the k-th largest -> -inf), TopPLogitsWarper (sort ascending, remove where the
    cumulative softmax <= 1 - top_p, always keep the last, i.e. the most probable, token), then
    softmax in float32. torch.multinomial's own stream cannot be reproduced outside torch, so the
    draw is fixed instead: token = the first id (in vocabulary order) whose cumulative probability
    exceeds u, for given uniforms u: zero3d's inverse-CDF draw with the same u picks the same token.

Models compute in float64 from float32 weights (what the file holds and zero3d loads).

Each generate_<family>.h5 holds
  /<hf name>                        the weights, Hugging Face names and shapes, float32
  /golden/prompt_<k>                [P_k] int32 prompt k
  /golden/greedy_<k>                [N] int32 its greedy continuation (N new tokens, no EOS)
  /golden/logits_<k>                [N, V] float32 the last position's logits before each new token
  attributes prompts (count), new_tokens (N), config (the zero3d model section, JSON text)
generate_gpt2.h5 also holds the sampling cases:
  /sampling/logits                  [S, V] float32 raw logits
  /sampling/params                  [S, 5] float64 temperature, top_k, top_p, eos id masked (-1: none), greedy
  /sampling/probs                   [S, V] float32 the distribution after the processors
  /sampling/uniforms                [U] float64
  /sampling/tokens                  [S, U] int32 the token each uniform draws

Run:  OPENBLAS_NUM_THREADS=1 /usr/bin/python3 tests/golden/make_generate_goldens.py tests/golden
"""
import json
import math
import os
import sys

import numpy as np
import torch
from torch import nn

torch.set_num_threads(1)


# --------------------------------------------------------------------------------------------
# GPT-2


class Conv1D(nn.Module):
    """transformers.pytorch_utils.Conv1D: y = x @ weight + bias, weight [in, out]."""

    def __init__(self, nin, nout):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(nin, nout))
        self.bias = nn.Parameter(torch.zeros(nout))

    def forward(self, x):
        return x @ self.weight + self.bias


class GPT2Attention(nn.Module):
    def __init__(self, C, H):
        super().__init__()
        self.H, self.d = H, C // H
        self.c_attn = Conv1D(C, 3 * C)
        self.c_proj = Conv1D(C, C)

    def forward(self, x, past, mask):
        B, n, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        heads = lambda t: t.view(B, n, self.H, self.d).transpose(1, 2)  # [B, H, n, d]
        q, k, v = heads(q), heads(k), heads(v)
        if past is not None:
            k = torch.cat([past[0], k], dim=2)
            v = torch.cat([past[1], v], dim=2)
        s = q @ k.transpose(-1, -2) / math.sqrt(self.d)
        s = s.masked_fill(~mask, float("-inf"))
        y = torch.softmax(s, dim=-1) @ v
        return self.c_proj(y.transpose(1, 2).reshape(B, n, C)), (k, v)


class GPT2MLP(nn.Module):
    def __init__(self, C):
        super().__init__()
        self.c_fc = Conv1D(C, 4 * C)
        self.c_proj = Conv1D(4 * C, C)

    def forward(self, x):
        return self.c_proj(nn.functional.gelu(self.c_fc(x), approximate="tanh"))  # gelu_new


class GPT2Block(nn.Module):
    def __init__(self, C, H):
        super().__init__()
        self.ln_1 = nn.LayerNorm(C, eps=1e-5)
        self.attn = GPT2Attention(C, H)
        self.ln_2 = nn.LayerNorm(C, eps=1e-5)
        self.mlp = GPT2MLP(C)

    def forward(self, x, past, mask):
        a, present = self.attn(self.ln_1(x), past, mask)
        x = x + a
        return x + self.mlp(self.ln_2(x)), present


class GPT2(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        V, T, L, H, C = (cfg[k] for k in ("vocab_size", "n_positions", "n_layer", "n_head", "n_embd"))
        self.wte = nn.Embedding(V, C)
        self.wpe = nn.Embedding(T, C)
        self.h = nn.ModuleList(GPT2Block(C, H) for _ in range(L))
        self.ln_f = nn.LayerNorm(C, eps=1e-5)

    def forward(self, ids, past=None, last_only=False):
        """ids [B, n] at positions past_len .. past_len + n - 1; returns logits [B, n, V] (the last
        position's alone with last_only, as generate needs) and the cache."""
        past_len = 0 if past is None else past[0][0].shape[2]
        n = ids.shape[1]
        pos = torch.arange(past_len, past_len + n, device=ids.device)
        x = self.wte(ids) + self.wpe(pos)[None]
        mask = causal_mask(past_len, n, 0).to(ids.device)
        presents = []
        for l, block in enumerate(self.h):
            x, p = block(x, None if past is None else past[l], mask)
            presents.append(p)
        if last_only:
            x = x[:, -1:]
        return self.ln_f(x) @ self.wte.weight.T, presents


# --------------------------------------------------------------------------------------------
# The Llama family


class RMSNorm(nn.Module):
    def __init__(self, C, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(C))
        self.eps = eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class LlamaAttention(nn.Module):
    def __init__(self, cfg, window):
        super().__init__()
        C, self.H, self.Hkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.d = C // self.H
        qkv_bias = cfg.get("attention_bias", False) or cfg["architecture"] == "qwen2"
        self.q_proj = nn.Linear(C, self.H * self.d, bias=qkv_bias)
        self.k_proj = nn.Linear(C, self.Hkv * self.d, bias=qkv_bias)
        self.v_proj = nn.Linear(C, self.Hkv * self.d, bias=qkv_bias)
        self.o_proj = nn.Linear(self.H * self.d, C, bias=cfg.get("attention_bias", False))
        self.theta = cfg.get("rope_theta", 10000.0)
        self.window = window

    def rope(self, x, pos):
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, self.d, 2, dtype=torch.float64) / self.d))
        ang = pos[:, None].double() * inv_freq[None]  # [n, d/2]
        emb = torch.cat((ang, ang), dim=-1)
        return x * emb.cos()[None, None] + rotate_half(x) * emb.sin()[None, None]

    def forward(self, x, pos, past, past_len):
        B, n, _ = x.shape
        q = self.q_proj(x).view(B, n, self.H, self.d).transpose(1, 2)
        k = self.k_proj(x).view(B, n, self.Hkv, self.d).transpose(1, 2)
        v = self.v_proj(x).view(B, n, self.Hkv, self.d).transpose(1, 2)
        q, k = self.rope(q, pos), self.rope(k, pos)
        if past is not None:
            k = torch.cat([past[0], k], dim=2)
            v = torch.cat([past[1], v], dim=2)
        g = self.H // self.Hkv  # repeat_kv
        kr, vr = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        s = q @ kr.transpose(-1, -2) / math.sqrt(self.d)
        s = s.masked_fill(~causal_mask(past_len, n, self.window), float("-inf"))
        y = torch.softmax(s, dim=-1) @ vr
        return self.o_proj(y.transpose(1, 2).reshape(B, n, self.H * self.d)), (k, v)


class LlamaMLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        C, I, b = cfg["hidden_size"], cfg["intermediate_size"], cfg.get("mlp_bias", False)
        self.gate_proj = nn.Linear(C, I, bias=b)
        self.up_proj = nn.Linear(C, I, bias=b)
        self.down_proj = nn.Linear(I, C, bias=b)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg, window):
        super().__init__()
        eps = cfg["rms_norm_eps"]
        self.input_layernorm = RMSNorm(cfg["hidden_size"], eps)
        self.self_attn = LlamaAttention(cfg, window)
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, x, pos, past, past_len):
        a, present = self.self_attn(self.input_layernorm(x), pos, past, past_len)
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x)), present


class LlamaModel(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        L = cfg["num_hidden_layers"]
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, window_of(cfg, l)) for l in range(L))
        self.norm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.model = LlamaModel(cfg)
        self.tied = cfg.get("tie_word_embeddings", False)
        if not self.tied:
            self.lm_head = nn.Linear(cfg["hidden_size"], cfg["vocab_size"], bias=False)

    def forward(self, ids, past=None):
        past_len = 0 if past is None else past[0][0].shape[2]
        pos = torch.arange(past_len, past_len + ids.shape[1])
        x = self.model.embed_tokens(ids)
        presents = []
        for l, layer in enumerate(self.model.layers):
            x, p = layer(x, pos, None if past is None else past[l], past_len)
            presents.append(p)
        head = self.model.embed_tokens.weight if self.tied else self.lm_head.weight
        return self.model.norm(x) @ head.T, presents


def window_of(cfg, l):
    """The layer's sliding window (0: full causal): Mistral on every layer, Qwen2 from max_window_layers."""
    if cfg["architecture"] == "mistral":
        return cfg.get("sliding_window") or 0
    if cfg["architecture"] == "qwen2" and cfg.get("use_sliding_window"):
        return cfg["sliding_window"] if l >= cfg.get("max_window_layers", 28) else 0
    return 0


def causal_mask(past_len, n, window):
    """[n, past_len + n]: query i (at position past_len + i) sees key j iff j <= its position and,
    with a window W, position - W < j."""
    qpos = torch.arange(past_len, past_len + n)[:, None]
    kpos = torch.arange(past_len + n)[None, :]
    m = kpos <= qpos
    if window:
        m &= kpos > qpos - window
    return m


# --------------------------------------------------------------------------------------------
# Generation with the cache, and the sampling warpers


class CloseCall(Exception):
    """A greedy step whose two best logits lie within 1e-3: float32 may pick either."""


def greedy_with_cache(model, prompt, new_tokens):
    """Prefill, then one token a step over the cache: the ids and each step's last-position logits."""
    with torch.no_grad():
        logits, past = model(torch.tensor([prompt]))
        ids, steps = list(prompt), []
        for _ in range(new_tokens):
            last = logits[0, -1]
            steps.append(last.clone())
            top2 = torch.topk(last, 2).values
            if top2[0] - top2[1] <= 1e-3:
                raise CloseCall()
            nxt = int(torch.argmax(last))
            ids.append(nxt)
            logits, past = model(torch.tensor([[nxt]]), past)
            full, _ = model(torch.tensor([ids]))  # the same logits recomputed without a cache
            assert torch.allclose(full[0, -1], logits[0, -1], atol=1e-10), "cached step differs from recompute"
    return ids[len(prompt):], torch.stack(steps)


def warp(logits, temperature, top_k, top_p, eos_masked):
    """GenerationMixin's processors and warpers in their order, float32 as scores are there."""
    scores = logits.clone().float()[None]
    if eos_masked >= 0:  # MinNewTokensLengthLogitsProcessor
        scores[:, eos_masked] = float("-inf")
    if temperature != 1.0:  # TemperatureLogitsWarper
        scores = scores / temperature
    if top_k > 0:  # TopKLogitsWarper(top_k, min_tokens_to_keep=1)
        k = min(max(top_k, 1), scores.size(-1))
        remove = scores < torch.topk(scores, k)[0][..., -1, None]
        scores = scores.masked_fill(remove, float("-inf"))
    if top_p < 1.0:  # TopPLogitsWarper(top_p, min_tokens_to_keep=1)
        sorted_logits, sorted_indices = torch.sort(scores, descending=False)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        sorted_remove = cumulative <= (1 - top_p)
        sorted_remove[..., -1:] = 0
        remove = sorted_remove.scatter(1, sorted_indices, sorted_remove)
        scores = scores.masked_fill(remove, float("-inf"))
    return torch.softmax(scores, dim=-1)[0]


def inverse_cdf(probs, u):
    """The first id whose cumulative probability exceeds u (accumulated in float64)."""
    c = np.cumsum(probs.double().numpy())
    i = int(np.searchsorted(c, u * c[-1], side="right"))
    return min(i, len(c) - 1)


# --------------------------------------------------------------------------------------------

GPT2_CFG = dict(architecture="gpt2", vocab_size=64, n_positions=32, n_layer=2, n_head=2, n_embd=32)
LLAMA_BASE = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=64, rope_theta=10000.0)
CASES = {
    "gpt2": GPT2_CFG,
    # GQA (4 query heads over 2 K/V heads), untied head
    "llama": dict(LLAMA_BASE, architecture="llama", tie_word_embeddings=False),
    # every layer slides over 5 keys: prompt + new tokens run well past it
    "mistral": dict(LLAMA_BASE, architecture="mistral", sliding_window=5, tie_word_embeddings=False),
    # q/k/v biases, tied head, layer 1 slides (window 4), layer 0 does not
    "qwen2": dict(LLAMA_BASE, architecture="qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=1,
                  tie_word_embeddings=True),
}
PROMPTS = [[3, 17, 42, 8, 51], [60, 2], [9, 9, 33, 14, 0, 27, 45]]
NEW_TOKENS = 10


def randomise(model, gen):
    """Weights large enough that the continuation depends on every layer: N(0, 0.25) matrices,
    norms' weights 1 + N(0, 0.1), biases N(0, 0.05)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
            elif p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.25 * torch.randn(p.shape, generator=gen))
        # float32 weights, as the file stores them; the model then computes in float64 from them
        for p in model.parameters():
            p.copy_(p.float().double())


def write_model(path, name, cfg, seed):
    import h5py  # here, so that benchmarks/pytorch_generate_peer.py needs only torch

    torch.set_default_dtype(torch.float64)
    # The first seed from `seed` on whose greedy choices are all clear in float32 (a margin of 1e-3).
    while True:
        gen = torch.Generator().manual_seed(seed)
        model = GPT2(cfg) if cfg["architecture"] == "gpt2" else LlamaForCausalLM(cfg)
        randomise(model, gen)
        try:
            runs = [greedy_with_cache(model, prompt, NEW_TOKENS) for prompt in PROMPTS]
            break
        except CloseCall:
            seed += 100
    with h5py.File(path, "w") as f:
        f.attrs["prompts"] = np.int64(len(PROMPTS))
        f.attrs["new_tokens"] = np.int64(NEW_TOKENS)
        f.attrs["config"] = np.bytes_(json.dumps(cfg))  # fixed-length: zero3d's h5 reads those
        for n, t in model.state_dict().items():
            f.create_dataset(n, data=t.numpy().astype(np.float32))
        g = f.create_group("golden")
        f.attrs["seed"] = np.int64(seed)
        for k, (prompt, (ids, logits)) in enumerate(zip(PROMPTS, runs)):
            g.create_dataset(f"prompt_{k}", data=np.array(prompt, dtype=np.int32))
            g.create_dataset(f"greedy_{k}", data=np.array(ids, dtype=np.int32))
            g.create_dataset(f"logits_{k}", data=logits.numpy().astype(np.float32))
            print(f"{name} prompt {k}: {prompt} -> {ids}")
    return model


def write_sampling(path):
    import h5py

    gen = torch.Generator().manual_seed(77)
    V = 64
    params = [  # temperature, top_k, top_p, eos masked, (greedy flag unused here: 0)
        (1.0, 0, 1.0, -1), (0.7, 0, 1.0, -1), (1.0, 10, 1.0, -1), (1.0, 0, 0.9, -1), (0.8, 20, 0.8, -1),
        (1.3, 5, 0.5, 7), (1.0, 0, 0.05, -1), (2.0, 50, 0.95, 3), (0.5, 64, 0.3, -1), (1.0, 1, 1.0, -1),
    ]
    logits = 2.0 * torch.randn(len(params), V, generator=gen, dtype=torch.float64)
    uniforms = np.array([0.0, 0.1, 0.37, 0.5, 0.77, 0.93, 0.999999], dtype=np.float64)
    probs, tokens = [], []
    for i, (t, k, p, eos) in enumerate(params):
        pr = warp(logits[i].float(), t, k, p, eos)
        probs.append(pr)
        tokens.append([inverse_cdf(pr, u) for u in uniforms])
    with h5py.File(path, "a") as f:
        s = f.create_group("sampling")
        s.create_dataset("logits", data=logits.numpy().astype(np.float32))
        s.create_dataset("params", data=np.array([list(x) + [0] for x in params], dtype=np.float64))
        s.create_dataset("probs", data=torch.stack(probs).numpy().astype(np.float32))
        s.create_dataset("uniforms", data=uniforms)
        s.create_dataset("tokens", data=np.array(tokens, dtype=np.int32))


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
    for i, (name, cfg) in enumerate(CASES.items()):
        write_model(os.path.join(out, f"generate_{name}.h5"), name, cfg, seed=2024 + i)
    write_sampling(os.path.join(out, "generate_gpt2.h5"))


if __name__ == "__main__":
    main()

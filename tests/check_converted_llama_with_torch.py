#!/usr/bin/python3
"""A converted Llama-family checkpoint, loaded by a PyTorch Llama built from its config.json
alone, computes zero3d's loss on the same batch.

For each model (input/llama-tiny.json's Llama; a Llama with every bias, a tied head and llama3
RoPE, written as shards; a Qwen2 with its q/k/v biases and a sliding window on its second
layer; a Mistral with a sliding window shorter than the sequence, linear RoPE and a head_dim
other than hidden_size / heads; a Mixtral with 4 SwiGLU experts, top-2 routing, the
load-balancing loss on and a sliding window, trained with its experts split over 2 ranks):

  1. zero3d trains it 10 steps at np 2, ZeRO stage 2, on a periodic text (every micro-batch is
     the same window) and saves a checkpoint;
  2. `zero3d convert` writes model.safetensors (or shards and model.safetensors.index.json) and
     config.json; every tensor must equal the checkpoint's (index.h5's virtual datasets, read
     with h5py) bit for bit in fp32, under the same name;
  3. zero3d trains 1 step from the converted directory alone (model.hf_config and
     model.init_from; the loss of that step is computed before any update): the loss must be
     the one the uninterrupted run logged at step 11 (same weights, same batch);
  4. the Llama below, written here from transformers' modeling_llama.py / modeling_qwen2.py /
     modeling_mistral.py semantics (RMSNorm, rotate_half RoPE with the config's rope_theta and
     rope_scaling, repeat_kv grouped-query attention, the sliding window of masking_utils,
     SwiGLU, or modeling_mixtral.py's MixtralSparseMoeBlock, the tied or untied head) in float64,
     built from config.json only, with the
     weights read from the safetensors files by a reader written from the format's
     specification (no safetensors or transformers package), must give zero3d's loss within a
     relative 1e-5. Its parameter names and shapes come from config.json, and must be exactly
     the file's.

And --dtype bf16 must hold torch's .to(torch.bfloat16) of the fp32 weights bit for bit.

  check_converted_llama_with_torch.py ZERO3D MPIEXEC WORKDIR
"""
import json
import math
import os
import subprocess
import sys

import h5py
import torch

from check_converted_with_torch import fresh_work_dir, read_safetensors  # what both checks share

TEXT = "zero3d trains GPT models, fast!\n"  # 32 bytes: divides every B*T below

# The models: zero3d model sections (Hugging Face's config.json keys), and how each is converted.
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "input", "llama-tiny.json")) as _f:
    LLAMA_TINY = json.load(_f)["model"]
MODELS = {
    "llama_tiny": dict(model=LLAMA_TINY, convert=[]),
    "llama_biases": dict(model={
        "architecture": "llama", "vocab_size": 256, "hidden_size": 48, "intermediate_size": 80,
        "num_hidden_layers": 2, "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 10,
        "attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True, "rms_norm_eps": 1e-5,
        "rope_theta": 50000.0, "max_position_embeddings": 64, "bos_token_id": 1, "eos_token_id": [2, 3],
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 16},
        "seq_length": 32}, convert=["--max-shard-size", "40KB"]),
    "qwen2_window": dict(model={
        "architecture": "qwen2", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1, "rope_theta": 1000000.0,
        "max_position_embeddings": 128, "seq_length": 32}, convert=[]),
    "mistral_window": dict(model={
        "architecture": "mistral", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 12,
        "sliding_window": 8, "rope_theta": 10000.0, "rope_scaling": {"type": "linear", "factor": 2.0},
        "max_position_embeddings": 128, "seq_length": 32}, convert=[]),
    # ep_size 2: each rank trains half the experts; the checkpoint still holds every expert whole
    "mixtral_experts": dict(model={
        "architecture": "mixtral", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 48,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "sliding_window": 12,
        "num_local_experts": 4, "num_experts_per_tok": 2, "output_router_logits": True,
        "router_aux_loss_coef": 0.02, "max_position_embeddings": 128, "seq_length": 32,
        "moe": {"ep_size": 2}}, convert=["--max-shard-size", "60KB"]),
}


def read_directory(directory):
    """Every tensor of a Hugging Face directory: model.safetensors, or the shards its index names."""
    index = os.path.join(directory, "model.safetensors.index.json")
    if not os.path.exists(index):
        return read_safetensors(os.path.join(directory, "model.safetensors"))[1]
    with open(index) as f:
        weight_map = json.load(f)["weight_map"]
    tensors = {}
    for shard in sorted(set(weight_map.values())):
        _, part = read_safetensors(os.path.join(directory, shard))
        for name, t in part.items():
            if weight_map.get(name) != shard:
                sys.exit(f"{shard}: holds {name}, which the index puts in {weight_map.get(name)}")
            tensors[name] = t
    if set(tensors) != set(weight_map):
        sys.exit(f"{index}: names tensors the shards do not hold: {sorted(set(weight_map) - set(tensors))[:4]}")
    return tensors


def expected_parameters(cfg):
    """LlamaForCausalLM's / MistralForCausalLM's / Qwen2ForCausalLM's / MixtralForCausalLM's
    state_dict names and shapes (Mixtral's experts under their on-disk names, w1/w3/w2)."""
    C, I, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    H, L = cfg["num_attention_heads"], cfg["num_hidden_layers"]
    KV = cfg.get("num_key_value_heads") or H
    d = cfg.get("head_dim") or C // H
    qkv_bias = cfg["model_type"] == "qwen2" or cfg.get("attention_bias", False)
    o_bias = cfg["model_type"] == "llama" and cfg.get("attention_bias", False)
    mlp_bias = cfg["model_type"] == "llama" and cfg.get("mlp_bias", False)
    p = {"model.embed_tokens.weight": [V, C], "model.norm.weight": [C]}
    for l in range(L):
        b = f"model.layers.{l}."
        p[b + "input_layernorm.weight"] = [C]
        p[b + "post_attention_layernorm.weight"] = [C]
        for name, rows in (("q", H * d), ("k", KV * d), ("v", KV * d)):
            p[b + f"self_attn.{name}_proj.weight"] = [rows, C]
            if qkv_bias:
                p[b + f"self_attn.{name}_proj.bias"] = [rows]
        p[b + "self_attn.o_proj.weight"] = [C, H * d]
        if o_bias:
            p[b + "self_attn.o_proj.bias"] = [C]
        if cfg["model_type"] == "mixtral":
            E = cfg["num_local_experts"]
            p[b + "block_sparse_moe.gate.weight"] = [E, C]
            for e in range(E):
                for name, shape in (("w1", [I, C]), ("w3", [I, C]), ("w2", [C, I])):
                    p[b + f"block_sparse_moe.experts.{e}.{name}.weight"] = shape
            continue
        for name, shape in (("gate", [I, C]), ("up", [I, C]), ("down", [C, I])):
            p[b + f"mlp.{name}_proj.weight"] = shape
            if mlp_bias:
                p[b + f"mlp.{name}_proj.bias"] = [shape[0]]
    if not cfg.get("tie_word_embeddings", False):
        p["lm_head.weight"] = [V, C]
    return p


def inv_freq(cfg, d, seq_len):
    """modeling_rope_utils' inverse frequencies for the config's rope type (float64)."""
    theta = cfg.get("rope_theta", 10000.0)
    rs = cfg.get("rope_scaling") or {}
    kind = rs.get("rope_type", rs.get("type", "default"))
    plain = lambda base: 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)  # noqa: E731
    if kind == "default":
        return plain(theta)
    if kind == "linear":
        return plain(theta) / rs["factor"]
    if kind == "dynamic":
        max_pos, factor = cfg["max_position_embeddings"], rs["factor"]
        if seq_len > max_pos:
            theta = theta * ((factor * seq_len / max_pos) - (factor - 1)) ** (d / (d - 2))
        return plain(theta)
    if kind == "llama3":
        factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        orig = rs["original_max_position_embeddings"]
        freq = plain(theta)
        wavelen = 2 * math.pi / freq
        scaled = torch.where(wavelen > orig / low, freq / factor, freq)
        smooth = (orig / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < orig / high) & ~(wavelen > orig / low)
        return torch.where(medium, smoothed, scaled)
    sys.exit(f"config.json: rope type {kind!r} is not one this check implements")


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def windows_of(cfg):
    """Each layer's sliding window (None: full causal attention), as each family decides it."""
    L, w = cfg["num_hidden_layers"], cfg.get("sliding_window")
    if cfg["model_type"] in ("mistral", "mixtral"):
        return [w] * L
    if cfg["model_type"] == "qwen2":
        if not cfg.get("use_sliding_window", False) or w is None:
            return [None] * L
        types = cfg.get("layer_types") or ["sliding_attention" if l >= cfg.get("max_window_layers", 28)
                                           else "full_attention" for l in range(L)]
        return [w if t == "sliding_attention" else None for t in types]
    return [None] * L


def sparse_moe_block(cfg, h, linear, n):
    """MixtralSparseMoeBlock: softmax over the router's logits, the top num_experts_per_tok
    probabilities renormalised to sum to one, every token kept. Written densely: each token's
    combine weights are zero outside its top-k, and every expert runs on every token."""
    E, k = cfg["num_local_experts"], cfg["num_experts_per_tok"]
    probs = torch.softmax(linear(h, n + "gate"), dim=-1)
    top, chosen = torch.topk(probs, k, dim=-1)
    weights = torch.zeros_like(probs).scatter(-1, chosen, top / top.sum(dim=-1, keepdim=True))
    out = torch.zeros_like(h)
    for e in range(E):
        x = f"{n}experts.{e}."
        y = linear(torch.nn.functional.silu(linear(h, x + "w1")) * linear(h, x + "w3"), x + "w2")
        out = out + weights[..., e:e + 1] * y
    return out


def llama_loss(cfg, params, tokens, targets):
    """The loss of the model config.json describes, with these weights (float64)."""
    C, H = cfg["hidden_size"], cfg["num_attention_heads"]
    KV = cfg.get("num_key_value_heads") or H
    d = cfg.get("head_dim") or C // H
    eps = cfg["rms_norm_eps"]
    B, T = tokens.shape
    w = {name: t.to(torch.float64) for name, t in params.items()}

    def rms_norm(x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def linear(x, name):
        y = x @ w[name + ".weight"].T
        return y + w[name + ".bias"] if name + ".bias" in w else y

    freqs = torch.outer(torch.arange(T, dtype=torch.float64), inv_freq(cfg, d, T))
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    i = torch.arange(T).view(T, 1)
    j = torch.arange(T).view(1, T)
    x = w["model.embed_tokens.weight"][tokens]
    for l, window in enumerate(windows_of(cfg)):
        b = f"model.layers.{l}."
        h = rms_norm(x, w[b + "input_layernorm.weight"])
        q = linear(h, b + "self_attn.q_proj").view(B, T, H, d).transpose(1, 2)
        k = linear(h, b + "self_attn.k_proj").view(B, T, KV, d).transpose(1, 2)
        v = linear(h, b + "self_attn.v_proj").view(B, T, KV, d).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k = k.repeat_interleave(H // KV, dim=1)  # repeat_kv: query head h reads K/V head h // (H/KV)
        v = v.repeat_interleave(H // KV, dim=1)
        visible = j <= i
        if window is not None:
            visible = visible & (j > i - window)  # sliding_window_overlay
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(d)
        scores = scores.masked_fill(~visible, float("-inf"))
        att = torch.softmax(scores, dim=-1) @ v
        x = x + linear(att.transpose(1, 2).reshape(B, T, H * d), b + "self_attn.o_proj")
        h = rms_norm(x, w[b + "post_attention_layernorm.weight"])
        if cfg["model_type"] == "mixtral":
            x = x + sparse_moe_block(cfg, h, linear, b + "block_sparse_moe.")
            continue
        gate = linear(h, b + "mlp.gate_proj")
        x = x + linear(torch.nn.functional.silu(gate) * linear(h, b + "mlp.up_proj"), b + "mlp.down_proj")
    x = rms_norm(x, w["model.norm.weight"])
    head = w["model.embed_tokens.weight"] if cfg.get("tie_word_embeddings", False) else w["lm_head.weight"]
    logits = x @ head.T
    return torch.nn.functional.cross_entropy(logits.view(-1, cfg["vocab_size"]), targets.reshape(-1)).item()


def check_config(cfg, model):
    """config.json names the family's class and holds the trained model's sizes."""
    classes = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "mixtral": "MixtralForCausalLM"}
    problems = []
    if cfg.get("model_type") != model["architecture"]:
        problems.append(f"model_type {cfg.get('model_type')!r}, expected {model['architecture']!r}")
    if cfg.get("architectures") != [classes[model["architecture"]]]:
        problems.append(f"architectures {cfg.get('architectures')!r}")
    for key, value in model.items():
        if key in ("architecture", "seq_length", "moe"):  # not the model's: the run's length and expert split
            continue
        got = cfg.get(key, "absent")
        if key == "rope_scaling":  # the legacy "type" alias is written as rope_type
            value = {("rope_type" if k == "type" else k): v for k, v in value.items()}
        if got != value:
            problems.append(f"{key} is {got!r}, the trained model's is {value!r}")
    if cfg.get("torch_dtype") != "float32":
        problems.append(f"torch_dtype {cfg.get('torch_dtype')!r}")
    return problems


def main():
    zero3d, mpiexec, work = sys.argv[1:4]
    text = fresh_work_dir(work, TEXT)
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")

    def run(*args):
        r = subprocess.run(list(args), env=env, capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"{' '.join(args)} exited {r.returncode}:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
        return r

    def write_config(name, cfg):
        path = os.path.join(work, name)
        with open(path, "w") as f:
            json.dump(cfg, f)
        return path

    def first_losses(out):
        with open(os.path.join(out, "metrics.jsonl")) as f:
            return [json.loads(line)["loss"] for line in f]

    ok = True
    for name, spec in MODELS.items():
        model = spec["model"]
        T = model["seq_length"]
        base = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2,
                "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
                "data": {"source": "text", "path": text},
                "zero_optimization": {"stage": 2},
                "training": {"steps": 11, "seed": 5, "save_interval": 10, "peak_gflops": 50}}
        src = os.path.join(work, name, "src")
        run(mpiexec, "-np", "2", zero3d, "train", write_config(name + ".json", dict(base, model=model)), "--output", src)
        trained_loss = first_losses(src)[10]  # step 11: the weights saved at step 10, the same batch

        # 2. converted tensors equal the checkpoint's, bit for bit, under the same names
        hf = os.path.join(work, name, "hf")
        run(zero3d, "convert", os.path.join(src, "checkpoints"), os.path.join(hf, "model.safetensors"),
            "--tag", "global_step10", *spec["convert"])
        with open(os.path.join(hf, "config.json")) as f:
            cfg = json.load(f)
        tensors = read_directory(hf)
        with h5py.File(os.path.join(src, "checkpoints", "global_step10", "index.h5")) as f:
            saved = {n: torch.from_numpy(f[n][...]) for n in f.keys()  # the parameters (not meta, segments)
                     if isinstance(f[n], h5py.Dataset) and f[n].dtype.kind == "f"}
        differ = [n for n in saved if n not in tensors or tensors[n].dtype != torch.float32 or
                  not torch.equal(tensors[n].view(torch.int32), saved[n].view(torch.int32))]
        extra = sorted(set(tensors) - set(saved))
        print(f"{name}: {len(saved) - len(differ)} of {len(saved)} checkpoint tensors converted bit for bit"
              f"{', extra: ' + str(extra) if extra else ''}")
        ok = ok and not differ and not extra

        # the config alone describes the file's tensors, and the trained model
        expected = expected_parameters(cfg)
        shapes = {n: list(t.shape) for n, t in tensors.items()}
        if shapes != expected:
            wrong = sorted(n for n in set(shapes) | set(expected) if shapes.get(n) != expected.get(n))
            print(f"{name}: config.json describes other tensors than the file holds: {wrong[:6]}")
            ok = False
        for problem in check_config(cfg, model):
            print(f"{name}: config.json: {problem}")
            ok = False

        # 3. zero3d from the converted directory alone
        weights = os.path.join(hf, "model.safetensors.index.json" if spec["convert"] else "model.safetensors")
        reload = dict(base, train_batch_size=2, model={"hf_config": hf, "init_from": weights, "seq_length": T})
        reload["training"] = dict(base["training"], steps=1, save_interval=0)
        dst = os.path.join(work, name, "dst")
        run(zero3d, "train", write_config(name + "_reload.json", reload), "--output", dst)
        zero3d_loss = first_losses(dst)[0]
        same = abs(zero3d_loss - trained_loss) <= 1e-6 * abs(trained_loss)
        print(f"{name}: zero3d from the converted directory {zero3d_loss:.8f}, the trained run's step 11 "
              f"{trained_loss:.8f}")
        ok = ok and same

        # 4. PyTorch from config.json and the safetensors
        data = torch.tensor(list(open(text, "rb").read()[:2 * T + 1]), dtype=torch.long)
        tokens, targets = data[:-1].view(2, T), data[1:].view(2, T)
        torch_loss = llama_loss(cfg, tensors, tokens, targets)
        rel = abs(zero3d_loss - torch_loss) / torch_loss
        print(f"{name}: PyTorch loss {torch_loss:.8f}, relative difference {rel:.2e}")
        ok = ok and rel <= 1e-5

        if name == "qwen2_window":  # --dtype bf16 is torch's rounding
            half = os.path.join(work, name, "hf_bf16")
            run(zero3d, "convert", os.path.join(src, "checkpoints"), os.path.join(half, "model.safetensors"),
                "--tag", "global_step10", "--dtype", "bf16")
            b16 = read_directory(half)
            with open(os.path.join(half, "config.json")) as f:
                ok = ok and json.load(f).get("torch_dtype") == "bfloat16"
            bad = [n for n in tensors if b16[n].dtype != torch.bfloat16 or
                   not torch.equal(b16[n].view(torch.int16), tensors[n].to(torch.bfloat16).view(torch.int16))]
            print(f"{name}: --dtype bf16: {len(tensors) - len(bad)} of {len(tensors)} tensors equal torch's "
                  ".to(torch.bfloat16) bit for bit")
            ok = ok and not bad
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

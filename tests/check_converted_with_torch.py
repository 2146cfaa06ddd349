#!/usr/bin/python3
"""A converted zero3d checkpoint loaded by PyTorch computes zero3d's loss on the same batch.

Trains 10 steps at np 2 ZeRO stage 2 on a periodic text (every micro-batch is the same window),
converts the checkpoint to HDF5 with Hugging Face names, runs 1 zero3d step from the converted
weights (its loss is computed before any update), then evaluates the same weights and batch
with the independent PyTorch GPT-2 of tests/golden/make_goldens.py (float64).

Then as a Hugging Face user: converts to model.safetensors (the format from the extension),
builds that GPT-2 from the config.json beside it and the safetensors weights (read here from
the format's specification: no safetensors or transformers package needed) and expects the
same loss; and checks that --dtype fp16 holds exactly torch's .half() of the fp32 weights.

  check_converted_with_torch.py ZERO3D MPIEXEC WORKDIR
"""
import json
import os
import shutil
import subprocess
import sys

import h5py
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden"))
from make_goldens import gpt_forward  # noqa: E402  (float64 reference GPT-2)


def read_safetensors(path):
    """The header's __metadata__ and every tensor of a safetensors file, with each dtype; the
    tensors must cover the data bytes exactly (the format leaves no gaps)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        data = f.read()
    dtypes = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
    tensors = {}
    end_of_data = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        end_of_data = max(end_of_data, end)
        flat = torch.frombuffer(bytearray(data[begin:end]), dtype=dtypes[entry["dtype"]])
        tensors[name] = flat.reshape(entry["shape"])
    if end_of_data != len(data):
        sys.exit(f"{path}: the tensors cover {end_of_data} of the {len(data)} data bytes")
    return header.get("__metadata__", {}), tensors


def hugging_face_loss(directory, tokens, targets):
    """The loss of the GPT-2 that config.json describes, with the weights of model.safetensors."""
    with open(os.path.join(directory, "config.json")) as f:
        config = json.load(f)
    # What gpt_forward computes: GPT-2 with tanh GELU, LayerNorm eps 1e-5, 4·n_embd MLP, tied head.
    expected = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "activation_function": "gelu_new",
                "layer_norm_epsilon": 1e-5, "n_inner": None, "tie_word_embeddings": True}
    for key, value in expected.items():
        if config.get(key, "absent") != value:
            sys.exit(f"config.json: {key} is {config.get(key, 'absent')!r}, expected {value!r}")
    metadata, tensors = read_safetensors(os.path.join(directory, "model.safetensors"))
    for key in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"):
        if metadata.get(key) != str(config[key]):
            sys.exit(f"model.safetensors: __metadata__ {key} is {metadata.get(key)!r}, config.json says {config[key]}")
    params = {name: t.to(torch.float64) for name, t in tensors.items()}
    if params["wte.weight"].shape[0] != config["vocab_size"] or params["wpe.weight"].shape[0] != config["n_positions"]:
        sys.exit("config.json: vocab_size or n_positions does not match the weights")
    logits = gpt_forward(params, tokens, L=config["n_layer"], H=config["n_head"])
    return torch.nn.functional.cross_entropy(logits.view(-1, config["vocab_size"]), targets.reshape(-1)).item()


def fresh_work_dir(work, line):
    """An empty work directory (a rerun starts fresh: zero3d refuses to overwrite a run's
    checkpoints) holding periodic.txt, `line` 400 times; its path."""
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    text = os.path.join(work, "periodic.txt")
    with open(text, "w") as f:
        f.write(line * 400)
    return text


def main():
    zero3d, mpiexec, work = sys.argv[1:4]
    text = fresh_work_dir(work, "zero3d trains GPT models, fast!\n")  # 32 bytes: divides B*T = 2*16
    cfg = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2,
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
           "model": {"vocab_size": 256, "n_positions": 16, "n_layer": 2, "n_head": 2, "n_embd": 32},
           "data": {"source": "text", "path": text},
           "zero_optimization": {"stage": 2},
           "training": {"steps": 10, "seed": 11, "save_interval": 10, "peak_gflops": 50}}
    path = os.path.join(work, "torch_check.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    run = lambda *a: subprocess.run(list(a), check=True, env=env, capture_output=True)  # noqa: E731
    run(mpiexec, "-np", "2", zero3d, "train", path, "--output", os.path.join(work, "src"))
    converted = os.path.join(work, "model.h5")
    run(zero3d, "convert", os.path.join(work, "src", "checkpoints"), converted)
    run(zero3d, "train", path, "--output", os.path.join(work, "dst"), "--set", "training.steps=1",
        "--set", "training.save_interval=0", "--set", "model.init_from=" + converted,
        "--set", "train_batch_size=2")
    with open(os.path.join(work, "dst", "metrics.jsonl")) as f:
        zero3d_loss = json.loads(f.readline())["loss"]

    with h5py.File(converted) as f:
        params = {name: torch.tensor(f[name][...], dtype=torch.float64) for name in f.keys()}
    data = torch.tensor(list(open(text, "rb").read()[:2 * 16 + 1]), dtype=torch.long)
    tokens, targets = data[:-1].view(2, 16), data[1:].view(2, 16)
    logits = gpt_forward(params, tokens, L=2, H=2)
    torch_loss = torch.nn.functional.cross_entropy(logits.view(-1, 256), targets.reshape(-1)).item()
    rel = abs(zero3d_loss - torch_loss) / torch_loss
    print(f"zero3d loss {zero3d_loss:.8f}, PyTorch loss {torch_loss:.8f}, relative difference {rel:.2e}")
    ok = rel <= 1e-5

    checkpoints = os.path.join(work, "src", "checkpoints")
    hf = os.path.join(work, "hf")
    run(zero3d, "convert", checkpoints, os.path.join(hf, "model.safetensors"))
    hf_loss = hugging_face_loss(hf, tokens, targets)
    rel = abs(zero3d_loss - hf_loss) / hf_loss
    print(f"config.json + model.safetensors: PyTorch loss {hf_loss:.8f}, relative difference {rel:.2e}")
    ok = ok and rel <= 1e-5

    half_dir = os.path.join(work, "hf_fp16")
    run(zero3d, "convert", checkpoints, os.path.join(half_dir, "model.safetensors"), "--dtype", "fp16")
    _, full = read_safetensors(os.path.join(hf, "model.safetensors"))
    _, half = read_safetensors(os.path.join(half_dir, "model.safetensors"))
    differ = [n for n in full if half[n].dtype != torch.float16 or
              not torch.equal(half[n].view(torch.int16), full[n].half().view(torch.int16))]
    print(f"--dtype fp16: {len(full) - len(differ)} of {len(full)} tensors equal torch's .half() bit for bit")
    ok = ok and not differ
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

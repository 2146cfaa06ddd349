#!/usr/bin/python3
"""PyTorch's generation speed on the same machine, for benchmarks/generate_speed.sh: GPT-2 124M
(input/gpt2-124m.json's shape, random N(0, 0.02) weights) as tests/golden/make_generate_goldens.py
writes it in plain torch modules with its own KV cache (the legacy past_key_values), greedy:
a prefill over B prompts of P tokens (logits of the last position only, as Hugging Face's
generate keeps them), then N - 1 decode steps of one token per prompt.

Prints one JSON line: prefill_tokens_per_s (B·P / prefill time), decode_tokens_per_s
(B·(N - 1) / decode time), summed over --repeats runs (the first, cold one included, as zero3d's
figures in generate_speed.sh are), and the same
per second of process CPU time (*_per_cpu_s: on a shared machine, the code's rate rather than the load's).
Usage: pytorch_generate_peer.py --batch B --prompt P --new N --dtype fp32|bf16 [--threads 1] [--device cuda]
(--device cuda: on a GPU, timed between device synchronisations; benchmarks/gpu_check.sh.)
"""
import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "golden"))
from make_generate_goldens import GPT2  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--batch", type=int, default=1)
ap.add_argument("--prompt", type=int, default=128)
ap.add_argument("--new", type=int, default=64)
ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
ap.add_argument("--threads", type=int, default=1)
ap.add_argument("--repeats", type=int, default=2)
ap.add_argument("--device", default="cpu")
a = ap.parse_args()
torch.set_num_threads(a.threads)
dtype = torch.float32 if a.dtype == "fp32" else torch.bfloat16
torch.set_default_dtype(torch.float32)
model = GPT2(dict(vocab_size=50257, n_positions=1024, n_layer=12, n_head=12, n_embd=768))
gen = torch.Generator().manual_seed(1234)
with torch.no_grad():
    for name, p in model.named_parameters():
        p.copy_(torch.ones_like(p) if name.endswith("weight") and p.dim() == 1 else 0.02 * torch.randn(p.shape, generator=gen))
model = model.to(device=a.device, dtype=dtype).eval()
prompts = torch.randint(0, 50257, (a.batch, a.prompt), generator=gen).to(a.device)


def sync():
    if a.device != "cpu":
        torch.cuda.synchronize()


def run():
    """(prefill, decode) wall-clock and process CPU seconds."""
    with torch.no_grad():
        sync()
        t0, c0 = time.perf_counter(), time.process_time()
        logits, past = model(prompts, last_only=True)
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        sync()
        t1, c1 = time.perf_counter(), time.process_time()
        for _ in range(a.new - 1):
            logits, past = model(nxt, past)
            nxt = logits[:, -1].argmax(-1, keepdim=True)
        sync()
        t2, c2 = time.perf_counter(), time.process_time()
    return (t1 - t0, t2 - t1), (c1 - c0, c2 - c1)


# Summed over --repeats runs, the first included: zero3d's protocol (generate_speed.sh runs
# REPEATS batches through one `zero3d generate` and reports the sums).
wall, cpu = [0.0, 0.0], [0.0, 0.0]
for _ in range(a.repeats):
    w, c = run()
    wall = [x + y for x, y in zip(wall, w)]
    cpu = [x + y for x, y in zip(cpu, c)]
prefill_tokens, decode_tokens = a.repeats * a.batch * a.prompt, a.repeats * a.batch * (a.new - 1)
print(json.dumps({"peer": "pytorch " + torch.__version__, "device": a.device, "dtype": a.dtype, "batch": a.batch, "prompt": a.prompt,
                  "new": a.new, "threads": a.threads,
                  "prefill_tokens_per_s": prefill_tokens / wall[0], "decode_tokens_per_s": decode_tokens / wall[1],
                  "prefill_tokens_per_cpu_s": prefill_tokens / cpu[0],
                  "decode_tokens_per_cpu_s": decode_tokens / cpu[1]}))

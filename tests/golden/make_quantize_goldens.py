#!/usr/bin/python3
"""Writes quantize.h5, the golden of ZeRO++ qwZ's int8 quantiser (kernels/quantize.hpp).

A NumPy float32 reference written from DeepSpeed, without zero3d's code:
  * the group count, CUDAQuantizer.quantize (runtime/zero/partition_parameters.py): groups =
    ceil(n / 8000), increased until n % (8·groups) == 0, then doubled while n % (16·groups) == 0
    and n / groups > 8000 (both loops as written there). DeepSpeed asserts n % 8 == 0; zero3d
    pads a slice with zeros to the next multiple of 8 first, and so does this reference;
  * the symmetric 8-bit kernel (csrc/includes/quantization_utils.h, Params<Symmetric, 8>): per
    group, max = max|x|, scale = 2^8 / (2·max) (1.0 when max == 0), q = __float2int_rn(x·scale)
    (round half to even) clamped to [-128, 127], the stored scale 1 / scale, and the dequantised
    value q · stored (dequantization_utils.h).

Groups /n<N> for several sizes N: x [N], q [padded N] (int32), scales [groups], x_hat [N]: exact
ties (x·scale = k + 1/2), an all-zero group, random values in several groups and in padded ones.

Run:  /usr/bin/python3 tests/golden/make_quantize_goldens.py tests/golden
"""
import math
import os
import sys

import h5py
import numpy as np

f32 = np.float32
TARGET_GROUP = 8000


def groups_of(n):
    """CUDAQuantizer.quantize's adaptive group count for a tensor of n elements (n % 8 == 0)."""
    groups = math.ceil(n / TARGET_GROUP)
    while groups < n:
        if n % (8 * groups) == 0:
            break
        groups += 1
    while True:
        if n % (8 * groups * 2) == 0 and n / groups > TARGET_GROUP:
            groups *= 2
        else:
            break
    assert n % (8 * groups) == 0 and n / groups < 16000 and n > groups
    return groups


def quantize(x):
    padded = np.concatenate([x, np.zeros((-x.size) % 8, dtype=f32)])
    groups = groups_of(padded.size)
    rows = padded.reshape(groups, -1)
    top = np.max(np.abs(rows), axis=1)
    scale = np.where(top == 0, f32(1), f32(256) / (f32(2) * np.where(top == 0, f32(1), top))).astype(f32)
    q = np.clip(np.rint((rows * scale[:, None]).astype(f32)), -128, 127).astype(np.int32)
    stored = (f32(1) / scale).astype(f32)
    x_hat = (q.astype(f32) * stored[:, None]).astype(f32).reshape(-1)[:x.size]
    return q.reshape(-1), stored, x_hat


def main(out_dir):
    rng = np.random.default_rng(34)
    # ties: with max 128 the scale is 1, so x·scale = x exactly: 2.5 -> 2, 3.5 -> 4, -0.5 -> -0, 128 -> 127
    ties = np.array([128.0, -127.5, 2.5, 3.5, -0.5, 0.5, 1.5, -2.5] * 100, dtype=f32)
    cases = [
        ties,  # 800: one group, scale 1
        np.zeros(16, dtype=f32),  # an all-zero group: scale 1, every q 0
        (rng.standard_normal(16800) * 0.02).astype(f32),  # 3 groups of 5600
        (rng.standard_normal(3) * 5).astype(f32),  # padded to 8: one group
        (rng.standard_normal(2049) * 1e-3).astype(f32),  # padded to 2056: one group
        (rng.standard_normal(8072) * 0.1).astype(f32),  # 8072 = 8·1009, 1009 prime: 1009 groups of 8
    ]
    with h5py.File(os.path.join(out_dir, "quantize.h5"), "w") as f:
        for x in cases:
            q, scales, x_hat = quantize(x)
            g = f.create_group("n%d" % x.size)
            g.create_dataset("x", data=x)
            g.create_dataset("q", data=q)
            g.create_dataset("scales", data=scales)
            g.create_dataset("x_hat", data=x_hat)
            print("n%d: %d groups, max |x - x_hat| %.3g" % (x.size, scales.size, np.max(np.abs(x - x_hat))))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__)))

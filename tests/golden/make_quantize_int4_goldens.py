#!/usr/bin/python3
"""Writes quantize_int4.h5, the golden of ZeRO++ qgZ (kernels/quantize_int4.hpp and
parallel/quantized_reduce_scatter.hpp).

A NumPy float32 reference written from DeepSpeed, without zero3d's code:
  * the symmetric 4-bit kernel (csrc/includes/quantization_utils.h, Params<Symmetric, 4>): per
    group max = max|x|, scale = 2^4 / (2·max) (1.0 when max == 0), q = __float2int_rn(x·scale)
    (round half to even) clamped to [-8, 7], the stored scale 1 / scale, the dequantised value
    q · stored (dequantization_utils.h);
  * packing (quantization.h PackedInt4 {high: 4, low: 4}, quantization_utils.h _chunk): byte j
    holds value 2j in its upper nibble and value 2j+1 in its lower one;
  * all_to_all_quant_reduce (runtime/comm/coalesced_collectives.py) with the swizzle of
    swizzled_quantize.cu and the reduction of quant_reduce.cu: every rank quantises the block of
    each destination rank d = node·k + local; the blocks for local index l (every node's) go to
    local peer l (intra-node all-to-all); each receiver dequantises the k copies of each block,
    adds them in peer order, requantises the sum with groups of the same size; the block for node
    n goes to node n's rank at the same local index (inter-node all-to-all), which dequantises
    the copies and adds them in node order (coalesced_collectives.py: sum(final_output.chunk
    (num_nodes))).
zero3d's groups: a bucket's groups are `group`-value runs from its first value, cut where a
destination's block ends (a block's first value at position `phase` of its group).

/kernel_<i>: x, phase, group, packed (uint8 as int32), scales, x_hat.
/reduce_<name>: nodes, per_node, group, counts [world], x [world, total] (each rank's bucket),
out_<d> [counts[d]] (rank d's reduced block).

Run:  /usr/bin/python3 tests/golden/make_quantize_int4_goldens.py tests/golden
"""
import os
import sys

import h5py
import numpy as np

f32 = np.float32


def quantize(x, phase, group):
    n = x.size
    gid = (phase + np.arange(n)) // group
    groups = 0 if n == 0 else (phase + n + group - 1) // group
    top = np.zeros(groups, dtype=f32)
    np.maximum.at(top, gid, np.abs(x))
    scale = np.where(top == 0, f32(1), f32(16) / (f32(2) * np.where(top == 0, f32(1), top))).astype(f32)
    q = np.clip(np.rint((x * scale[gid]).astype(f32)), -8, 7).astype(np.int32)
    stored = (f32(1) / scale).astype(f32)
    padded = np.concatenate([q, np.zeros(n % 2, dtype=np.int32)])
    packed = ((padded[0::2] & 0xF) << 4) | (padded[1::2] & 0xF)
    return packed.astype(np.int32), stored


def dequantize(packed, stored, n, phase, group):
    hi = (packed >> 4) & 0xF
    lo = packed & 0xF
    q = np.empty(2 * packed.size, dtype=np.int32)
    q[0::2], q[1::2] = hi, lo
    q = np.where(q >= 8, q - 16, q)[:n]
    gid = (phase + np.arange(n)) // group
    return (q.astype(f32) * stored[gid]).astype(f32)


def hierarchical_reduce(xs, counts, group, nodes, k):
    """Every rank's result block after qgZ's two all-to-alls (xs: world buckets)."""
    world = nodes * k
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    phases = starts % group
    # intra-node: local peer l of node n receives every copy of the blocks (m, l), m over nodes,
    # from the node's k ranks, adds them in peer order and requantises
    reduced = {}  # (node of the reducer, destination) -> (packed, scales)
    for node in range(nodes):
        for l in range(k):
            for m in range(nodes):
                d = m * k + l
                acc = np.zeros(counts[d], dtype=f32)
                for peer in range(k):
                    src = node * k + peer
                    block = xs[src][starts[d]:starts[d] + counts[d]]
                    p, s = quantize(block, phases[d], group)
                    acc = (acc + dequantize(p, s, counts[d], phases[d], group)).astype(f32)
                reduced[(node, d)] = quantize(acc, phases[d], group)
    outs = []
    for d in range(world):
        acc = np.zeros(counts[d], dtype=f32)
        for node in range(nodes):  # inter-node: the copy from each node, in node order
            p, s = reduced[(node, d)]
            acc = (acc + dequantize(p, s, counts[d], phases[d], group)).astype(f32)
        outs.append(acc)
    return outs


def main(out_dir):
    rng = np.random.default_rng(3406)
    # ties: max 8 makes the scale 1, so x·scale = x: 2.5 -> 2, 3.5 -> 4, -0.5 -> -0, 8 -> 7, -8 stays
    ties = np.array([8.0, -7.5, 2.5, 3.5, -0.5, 0.5, 1.5, -2.5, -8.0, 6.5], dtype=f32)
    kernels = [
        (ties, 0, 10),
        (np.zeros(6, dtype=f32), 0, 4),  # all-zero groups: stored scale 1, every nibble 0
        ((rng.standard_normal(37) * 0.02).astype(f32), 5, 16),  # odd, a partial first and last group
        ((rng.standard_normal(64) * 3).astype(f32), 0, 64),
        ((rng.standard_normal(101) * 1e-3).astype(f32), 31, 32),
    ]
    with h5py.File(os.path.join(out_dir, "quantize_int4.h5"), "w") as f:
        for i, (x, phase, group) in enumerate(kernels):
            packed, scales = quantize(x, phase, group)
            x_hat = dequantize(packed, scales, x.size, phase, group)
            g = f.create_group("kernel_%d" % i)
            g.create_dataset("x", data=x)
            g.create_dataset("phase", data=np.array([phase], dtype=np.int32))
            g.create_dataset("group", data=np.array([group], dtype=np.int32))
            g.create_dataset("packed", data=packed)
            g.create_dataset("scales", data=scales)
            g.create_dataset("x_hat", data=x_hat)
            print("kernel_%d: n %d, %d groups, max |x - x_hat| %.3g" % (i, x.size, scales.size, np.max(np.abs(x - x_hat))))
        # buckets as zero3d's partitions cut them: uneven blocks, an empty one, odd lengths
        reduces = {
            "w4_nodes2": (2, 2, 12, [40, 33, 0, 27]),
            "w2_nodes2": (2, 1, 8, [21, 30]),
        }
        for name, (nodes, k, group, counts) in reduces.items():
            world = nodes * k
            total = sum(counts)
            xs = [(rng.standard_normal(total) * (0.1 + r)).astype(f32) for r in range(world)]
            outs = hierarchical_reduce(xs, counts, group, nodes, k)
            g = f.create_group("reduce_" + name)
            g.create_dataset("nodes", data=np.array([nodes], dtype=np.int32))
            g.create_dataset("per_node", data=np.array([k], dtype=np.int32))
            g.create_dataset("group", data=np.array([group], dtype=np.int32))
            g.create_dataset("counts", data=np.array(counts, dtype=np.int32))
            g.create_dataset("x", data=np.stack(xs))
            exact = np.sum(np.stack(xs), axis=0)
            starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
            for d in range(world):
                g.create_dataset("out_%d" % d, data=outs[d])
                if counts[d]:
                    err = np.max(np.abs(outs[d] - exact[starts[d]:starts[d] + counts[d]]))
                    print("reduce_%s rank %d: max |out - exact sum| %.3g" % (name, d, err))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__)))

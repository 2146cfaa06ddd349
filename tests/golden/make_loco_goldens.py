#!/usr/bin/python3
"""Writes loco.h5, the golden of LoCo-ZeRO++ (zeropp_loco_param): qgZ's two-stage quantised
reduce with error feedback (parallel/quantized_reduce_scatter.hpp, kernels/loco.hpp).

A NumPy float32 reference written from DeepSpeed, without zero3d's code:
  * runtime/comm/coalesced_collectives.py all_to_all_loco_quant_reduce: per tensor, an error
    buffer for the intra-node quantisation (intra_ef_buf, the gradient's shape) and one for the
    inter-node quantisation (inter_ef_buf, numel / local_world_size), each kept as 8-bit
    symmetric groups (quantizer_module.quantize(err, groups, 8, Symmetric)) with the group count
    of the 4-bit quantisation it compensates, dequantised before use;
  * the counter loco_idx (a module global over every tensor reduced): a tensor without buffers,
    or reached while loco_idx > reset_T, starts from zero errors and sets loco_idx = 0; every
    tensor reduced adds 1;
  * swizzled_quantize.cu loco_swizzled_quant_kernel and quant_reduce.cu loco_dequant_reduce:
    y = x + e (x: the gradient, or the sum of the dequantised copies), quantised to 4 bits,
    then e = err_beta·e + (1 − err_beta)·(y − dequant(quant(y))) in float; written here as one
    fused multiply-add fma(err_beta, e, (1 − err_beta)·(y − ŷ)) rounded once (what nvcc makes of
    DeepSpeed's expression; zero3d writes the same fmaf);
  * the two all-to-alls and the 4-bit quantiser as make_quantize_int4_goldens.py simulates them
    (imported from it), and the 8-bit quantiser of quantization_utils.h Params<Symmetric, 8>:
    scale 2^8 / (2·max) (1 when max = 0), q = rint(x·scale) clamped to [−128, 127], stored 1/scale.
DeepSpeed computes in __half; this reference (and zero3d) in float32. A bucket's tensors are
counted from the last (backward's order), as zero3d's buckets hold them.

/loco_<name>: nodes, per_node, group, counts [world], tensors (sizes filling the bucket),
err_beta, reset_T, x [steps, world, total] (each rank's bucket each step), out_<d> [steps,
counts[d]] (rank d's reduced block each step), counter (loco_idx after the last step), and rank
d's kept errors after the last step: intra_codes_<d>, intra_scales_<d>, inter_codes_<d>,
inter_scales_<d> (codes as int32), resets [steps, tensors] (1 where a tensor started from zero).

Run:  /usr/bin/python3 tests/golden/make_loco_goldens.py tests/golden
"""
import os
import sys
from fractions import Fraction

import h5py
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_quantize_int4_goldens import dequantize as dequantize4  # noqa: E402
from make_quantize_int4_goldens import quantize as quantize4  # noqa: E402

f32 = np.float32


def groups_of(n, phase, group):
    return 0 if n == 0 else (phase + n + group - 1) // group


def quantize8(x, phase, group):
    n = x.size
    gid = (phase + np.arange(n)) // group
    top = np.zeros(groups_of(n, phase, group), dtype=f32)
    np.maximum.at(top, gid, np.abs(x))
    scale = np.where(top == 0, f32(1), f32(256) / (f32(2) * np.where(top == 0, f32(1), top))).astype(f32)
    q = np.clip(np.rint((x * scale[gid]).astype(f32)), -128, 127).astype(np.int32)
    return q, (f32(1) / scale).astype(f32)


def dequantize8(q, stored, phase, group):
    gid = (phase + np.arange(q.size)) // group
    return (q.astype(f32) * stored[gid]).astype(f32)


def round_to_f32(v):
    """The float32 nearest the exact rational v, ties to even."""
    r = np.float32(float(v))
    best = None
    for c in (np.nextafter(r, f32(-np.inf)), r, np.nextafter(r, f32(np.inf))):
        d = abs(Fraction(float(c)) - v)
        even = (np.array([c], dtype=f32).view(np.int32)[0] & 1) == 0
        if best is None or d < best[0] or (d == best[0] and even):
            best = (d, c)
    return best[1]


def fma32(a, b, c):
    """fmaf(a, b, c) elementwise: a·b + c rounded once to float32."""
    fa = Fraction(float(a))
    return np.array([round_to_f32(fa * Fraction(float(bi)) + Fraction(float(ci))) for bi, ci in zip(b, c)], dtype=f32)


def compensated(x, e_codes, e_scales, phase, group, beta):
    """One LoCo quantisation of block x: its 4-bit form and the kept error after it (int8)."""
    e = dequantize8(e_codes, e_scales, phase, group)
    y = (x + e).astype(f32)
    packed, scales = quantize4(y, phase, group)
    y_hat = dequantize4(packed, scales, x.size, phase, group)
    take = f32(f32(1) - beta)
    e = fma32(beta, e, (take * (y - y_hat).astype(f32)).astype(f32))
    codes, code_scales = quantize8(e, phase, group)
    return (packed, scales), codes, code_scales


class RankErrors:
    """One rank's kept errors: every block of the bucket (step 1), the blocks (m, local) (step 2)."""

    def __init__(self, counts, group, nodes, k, local):
        self.blocks = []
        at = 0
        for n in counts:
            self.blocks.append((at, n, at % group))
            at += n
        self.intra = np.zeros(at, dtype=np.int32)
        self.intra_scales = [np.ones(groups_of(n, ph, group), dtype=f32) for (_, n, ph) in self.blocks]
        self.mine = [m * k + local for m in range(nodes)]
        self.inter = [np.zeros(counts[d], dtype=np.int32) for d in self.mine]
        self.inter_scales = [np.ones(groups_of(counts[d], self.blocks[d][2], group), dtype=f32) for d in self.mine]

    def clear(self, lo, hi):
        self.intra[lo:hi] = 0
        for i, d in enumerate(self.mine):
            start, n, _ = self.blocks[d]
            a, b = max(lo, start), min(hi, start + n)
            if a < b:
                self.inter[i][a - start:b - start] = 0


def loco_reduce(steps_x, counts, tensors, group, nodes, k, beta, reset_T):
    world = nodes * k
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    phases = starts % group
    state = [RankErrors(counts, group, nodes, k, r % k) for r in range(world)]
    live = [False] * len(tensors)
    counter = 0
    outs, resets = [], []
    ends = np.cumsum(tensors)
    for xs in steps_x:
        # loco_idx, tensor by tensor from the last
        reset = [0] * len(tensors)
        for t in reversed(range(len(tensors))):
            if not live[t] or counter > reset_T:
                counter = 0
                live[t] = True
                reset[t] = 1
                for st in state:
                    st.clear(ends[t] - tensors[t], ends[t])
            counter += 1
        resets.append(reset)
        # step 1: every rank quantises every block, compensated by its intra error
        sent = {}
        for r in range(world):
            st = state[r]
            for d in range(world):
                s0, n = starts[d], counts[d]
                q, codes, cs = compensated(xs[r][s0:s0 + n], st.intra[s0:s0 + n], st.intra_scales[d], phases[d], group,
                                           beta)
                sent[(r, d)] = q
                st.intra[s0:s0 + n] = codes
                st.intra_scales[d] = cs
        # step 2: local peer l of each node sums the node's copies of blocks (m, l), compensated by
        # its inter error, and sends node m's
        reduced = {}
        for node in range(nodes):
            for l in range(k):
                r = node * k + l
                st = state[r]
                for i, m in enumerate(range(nodes)):
                    d = m * k + l
                    acc = np.zeros(counts[d], dtype=f32)
                    for peer in range(k):
                        p, s = sent[(node * k + peer, d)]
                        acc = (acc + dequantize4(p, s, counts[d], phases[d], group)).astype(f32)
                    q, codes, cs = compensated(acc, st.inter[i], st.inter_scales[i], phases[d], group, beta)
                    reduced[(node, d)] = q
                    st.inter[i] = codes
                    st.inter_scales[i] = cs
        step_out = []
        for d in range(world):
            acc = np.zeros(counts[d], dtype=f32)
            for node in range(nodes):
                p, s = reduced[(node, d)]
                acc = (acc + dequantize4(p, s, counts[d], phases[d], group)).astype(f32)
            step_out.append(acc)
        outs.append(step_out)
    return outs, state, counter, resets


def main(out_dir):
    rng = np.random.default_rng(3434)
    # (nodes, per_node, group, counts, tensors (group multiples, as qgZ's), err_beta, reset_T, steps)
    cases = {
        "w4_nodes2": (2, 2, 8, [40, 33, 0, 23], [32, 40, 24], 0.8, 3, 5),
        "w2_nodes2": (2, 1, 12, [50, 46], [48, 48], 0.5, 2, 5),
    }
    with h5py.File(os.path.join(out_dir, "loco.h5"), "w") as f:
        for name, (nodes, k, group, counts, tensors, beta, reset_T, steps) in cases.items():
            world = nodes * k
            total = sum(counts)
            assert sum(tensors) == total
            steps_x = [[(rng.standard_normal(total) * (0.1 + r)).astype(f32) for r in range(world)] for _ in range(steps)]
            outs, state, counter, resets = loco_reduce(steps_x, counts, tensors, group, nodes, k, f32(beta), reset_T)
            g = f.create_group("loco_" + name)
            for key, v in (("nodes", [nodes]), ("per_node", [k]), ("group", [group]), ("counts", counts),
                           ("tensors", tensors), ("reset_T", [reset_T]), ("counter", [counter])):
                g.create_dataset(key, data=np.array(v, dtype=np.int32))
            g.create_dataset("err_beta", data=np.array([beta], dtype=f32))
            g.create_dataset("x", data=np.array(steps_x))
            g.create_dataset("resets", data=np.array(resets, dtype=np.int32))
            starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
            for d in range(world):
                g.create_dataset("out_%d" % d, data=np.array([outs[s][d] for s in range(steps)]).reshape(steps, counts[d]))
                st = state[d]
                g.create_dataset("intra_codes_%d" % d, data=st.intra)
                g.create_dataset("intra_scales_%d" % d, data=np.concatenate(st.intra_scales))
                g.create_dataset("inter_codes_%d" % d, data=np.concatenate(st.inter))
                g.create_dataset("inter_scales_%d" % d, data=np.concatenate(st.inter_scales))
            # how far the summed gradients land from the exact sums, with and without the feedback
            for s in range(steps):
                exact = np.sum(np.array(steps_x[s]), axis=0)
                err = max(float(np.max(np.abs(outs[s][d] - exact[starts[d]:starts[d] + counts[d]])))
                          for d in range(world) if counts[d])
                print("loco_%s step %d: max |out - exact sum| %.3g, resets %s" % (name, s + 1, err, resets[s]))
            print("loco_%s: counter %d after %d steps" % (name, counter, steps))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__)))

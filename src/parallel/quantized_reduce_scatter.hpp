// quantized_reduce_scatter.hpp — ZeRO++'s qgZ (Wang et al. 2023 §4.2; DeepSpeed
// runtime/comm/coalesced_collectives.py all_to_all_quant_reduce): stage 3's gradient
// reduce-scatter as two all-to-alls of int4 blocks (kernels/quantize_int4.hpp), the first inside
// each node and the second across nodes, so that what crosses nodes is already summed over the
// node and quantised: about 1/8 of fp32's volume (int4 plus a scale a group).
//
// The data group's ranks fill nodes in order, k a node (d = node·k + local, as DeepSpeed's
// _get_local_all_to_all_group builds "local_<node>" and "global_<local>"): `intra` is this rank's
// node (rank = local), `inter` the ranks at this local index on every node (rank = node).
// One bucket, blocks in data-rank order, counts[d] values for rank d:
//  1. every rank quantises each destination's block (swizzled_quantize.cu: the blocks for local
//     index l, every node's, travel together to local peer l) and all-to-alls them in `intra`;
//  2. each rank dequantises the k copies of every block it received, adds them in peer order,
//     requantises each sum (quant_reduce.cu) and sends the block of node n to node n (`inter`);
//  3. each rank dequantises the copies of its own block and adds them in node order.
// The result is the sum over the data group of what each rank quantised (the caller scales:
// GradientReducer divides by W beforehand, giving the mean a reduce-scatter gives; DeepSpeed's
// all_to_all_quant_reduce divides its sum by the node count instead, k times the mean, where
// its reduce_scatter_coalesced divides by W — zero3d keeps the mean so that clipping, the
// gradient norm and the loss scale see the ZeRO-3 quantities).
//
// Groups: a bucket holds whole tensors of one group size (gradient_segments picks it from the
// tensor's shape as DeepSpeed does), cut into `group`-value groups from its first value; a group
// that straddles two ranks' blocks is cut there (block d starts at phase (Σ_{q<d} counts[q]) mod
// group of its group). Values and scales go in separate all-to-alls, as DeepSpeed sends them.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/memory.hpp"
#include "parallel/comm.hpp"

namespace zero3d {

// The bytes of block d of a bucket (its packed values and its scales).
struct QgzBlock {
  int64_t count = 0, phase = 0, values = 0, scales = 0;  // values, position in its group, bytes, scales
};
std::vector<QgzBlock> qgz_blocks(const std::vector<int64_t>& counts, int64_t group);

// Bytes data rank d sends inside its node and across nodes for one bucket (the all-to-alls' bus
// bytes, as Communicator::all_to_all_v counts them: what leaves the rank).
struct QgzBytes {
  int64_t intra = 0, inter = 0;
};
QgzBytes qgz_sent_bytes(const std::vector<int64_t>& counts, int64_t group, int nodes, int per_node, int d);

// The bytes reduce() fits each staging buffer to for one bucket at data rank d (the send of
// step 1, reused for step 2's requantised sums; the receive of both all-to-alls; the fp32 sum and
// copy of a block). The buffers only grow, so a run holds each one's largest over its buckets:
// the memory planner grows a QgzStaging over a step's buckets the same way.
struct QgzStaging {
  int64_t send = 0, send_scales = 0, recv = 0, recv_scales = 0, sum = 0, copy = 0;
  void grow(const QgzStaging& o);
  int64_t total() const { return send + send_scales + recv + recv_scales + sum + copy; }
};
QgzStaging qgz_staging(const std::vector<QgzBlock>& blocks, int nodes, int per_node, int d);

class QuantizedReduceScatter {
 public:
  QuantizedReduceScatter(Communicator& intra, Communicator& inter) : intra_(intra), inter_(inter) {}
  int nodes() const { return inter_.size(); }
  int per_node() const { return intra_.size(); }
  int data_rank() const { return inter_.rank() * intra_.size() + intra_.rank(); }

  // src: the bucket (Σ counts fp32, model memory); out: this rank's block, counts[data_rank()]
  // fp32, the sum over the data group. Blocking.
  void reduce(const float* src, const std::vector<int64_t>& counts, int64_t group, float* out);

  // Bytes of its staging buffers (quantised blocks sent and received, the fp32 sums).
  int64_t staging_bytes() const;

 private:
  // sum (+)= one dequantised copy of block b (first: sum = it, as 0 + it)
  void add_copy(const uint8_t* packed, const float* scales, const QgzBlock& b, int64_t group, float* sum, bool first);

  Communicator &intra_, &inter_;
  kernels::StagingBuffer send_, recv_, send_scales_, recv_scales_, sum_, copy_;
};

}  // namespace zero3d

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
//
// LoCo (zeropp_loco_param; DeepSpeed all_to_all_loco_quant_reduce, kernels/loco.hpp): both
// quantisations are compensated with the error kept from the last reduction of the same
// tensor: step 1's over the whole bucket on every rank (DeepSpeed's intra_ef_buf, the gradient's
// shape), step 2's over the blocks (m, local) this rank requantises (inter_ef_buf, numel / k).
// Kept as int8 groups cut as the int4 ones (DeepSpeed quantises both buffers to 8 bits with the
// int4 quantisation's group counts) in model memory, one set a bucket; fp32 while in use.
// DeepSpeed's counter (the module global loco_idx) runs over every tensor reduced, one after the
// other: a tensor with no errors yet, or reached while the counter exceeds reset_T, starts from
// zero and sets the counter to 0; each tensor reduced then adds 1. A bucket's tensors count from
// its last one down (the order backward completes them, as DeepSpeed's bucket holds them).
// With fp16's dynamic loss scale (stage3.py _loco_err_buf_update) an overflow drops every
// error and a new scale rescales the kept ones by new/old.
#pragma once

#include <cstdint>
#include <map>
#include <string>
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
// copy of a block; with LoCo, the fp32 error and compensated values of the largest block). The
// buffers only grow, so a run holds each one's largest over its buckets: the memory planner grows
// a QgzStaging over a step's buckets the same way.
struct QgzStaging {
  int64_t send = 0, send_scales = 0, recv = 0, recv_scales = 0, sum = 0, copy = 0, err = 0, comp = 0;
  void grow(const QgzStaging& o);
  int64_t total() const { return send + send_scales + recv + recv_scales + sum + copy + err + comp; }
};
QgzStaging qgz_staging(const std::vector<QgzBlock>& blocks, int nodes, int per_node, int d, bool loco = false);

// Bytes LoCo keeps on data rank d for one bucket: an int8 code a value and an fp32 scale a group,
// over the whole bucket (step 1's errors) and over the blocks (m, local) (step 2's).
int64_t loco_kept_bytes(const std::vector<int64_t>& counts, int64_t group, int nodes, int per_node, int d);

// zeropp_loco_param (config.hpp LocoConfig) as the reduction uses it.
struct LocoParams {
  float err_beta = 0.8f;
  int64_t reset_T = 1024;
};

// LoCo's state on one rank (checkpoints carry it: io/checkpoint.hpp ShardSlice::rank_state).
// meta: the counter and, a bucket, its place, blocks and tensors' live flags (JSON text);
// codes: every bucket's int8 errors (step 1's, then step 2's); scales: their group scales.
struct LocoState {
  std::string meta;
  std::vector<int8_t> codes;
  std::vector<float> scales;
};

class QuantizedReduceScatter {
 public:
  QuantizedReduceScatter(Communicator& intra, Communicator& inter) : intra_(intra), inter_(inter) {}
  int nodes() const { return inter_.size(); }
  int per_node() const { return intra_.size(); }
  int data_rank() const { return inter_.rank() * intra_.size() + intra_.rank(); }

  // src: the bucket (Σ counts fp32, model memory); out: this rank's block, counts[data_rank()]
  // fp32, the sum over the data group. Blocking.
  // LoCo: `begin` (the bucket's global first element) names the bucket's errors; `tensors`: the
  // bucket's tensors' sizes in order (they fill it).
  void reduce(const float* src, const std::vector<int64_t>& counts, int64_t group, float* out, int64_t begin = 0,
              const std::vector<int64_t>& tensors = {});

  // Bytes of its staging buffers (quantised blocks sent and received, the fp32 sums, LoCo's
  // fp32 errors in use).
  int64_t staging_bytes() const;

  // --- LoCo (zeropp_loco_param): error feedback from now on.
  void enable_loco(const LocoParams& p) { loco_ = p, loco_on_ = true; }
  bool loco() const { return loco_on_; }
  // Bytes of the kept errors (int8 codes and fp32 scales of every bucket reduced so far).
  int64_t loco_bytes() const;
  // fp16's loss scale (stage3.py _loco_err_buf_update): overflow drops every kept error (each
  // tensor starts again from zero, resetting the counter); else a scale changed by `ratio`
  // rescales them.
  void loss_scale_changed(bool overflow, double ratio);
  LocoState loco_state() const;
  // Restores a state saved by a run whose buckets were these (InputError naming what differs).
  void set_loco_state(const LocoState& s);

 private:
  // One bucket's kept errors: step 1's over the bucket (block by block, in data-rank order),
  // step 2's over the blocks (m, local) in node order; a tensor's flag says it has them.
  struct LocoBucket {
    int64_t end = 0;
    std::vector<int64_t> counts, tensors;
    std::vector<char> live;
    kernels::StagingBuffer intra, intra_scales, inter, inter_scales;
  };
  // sum (+)= one dequantised copy of block b (first: sum = it, as 0 + it)
  void add_copy(const uint8_t* packed, const float* scales, const QgzBlock& b, int64_t group, float* sum, bool first);
  // The bucket's errors, made (zero) on its first reduction, with DeepSpeed's counter applied.
  LocoBucket& loco_bucket(int64_t begin, const std::vector<int64_t>& counts, int64_t group,
                          const std::vector<int64_t>& tensors);
  // Quantises x (block b) into `packed`/`scales`; with LoCo, compensated by the kept error at
  // `codes`/`code_scales` and the error updated there.
  void quantize_block(const float* x, const QgzBlock& b, int64_t group, uint8_t* packed, float* scales, int8_t* codes,
                      float* code_scales);

  Communicator &intra_, &inter_;
  kernels::StagingBuffer send_, recv_, send_scales_, recv_scales_, sum_, copy_, err_, comp_;
  LocoParams loco_;
  bool loco_on_ = false;
  int64_t loco_counter_ = 0;  // DeepSpeed's loco_idx
  std::map<int64_t, LocoBucket> loco_buckets_;  // by the bucket's first global element
};

}  // namespace zero3d

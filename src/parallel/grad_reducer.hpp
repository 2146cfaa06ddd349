// grad_reducer.hpp — data-parallel gradient reduction in buckets of reduce_bucket_size elements.
//
// Two modes over the same bucketing:
//  * AllReduce (ZeRO stage 0): every rank ends with the averaged full gradient.
//  * ReduceScatter (stages 1-3): each bucket [a, b) is reduce-scattered with per-rank counts
//    |[a, b) ∩ partition r|, so each rank receives only the averaged part it owns, staged in a
//    partition-sized buffer and then written (stage 1) or added (stages 2-3, which reduce
//    every micro-batch) into the rank's gradient partition.
// Buckets are cut from the end of a range down, the order in which backward completes the
// flat buffer. Given the tensors (segments), buckets hold whole gradients as DeepSpeed fills
// its IPG bucket (FACTS §5.3): gradients join a bucket until the next would overflow
// reduce_bucket_size, a gradient larger than the bucket is reduced alone (so a bucket size of
// 0 or 1 means one gradient per bucket), and a bucket holds one communication dtype. Without
// segments the range is cut into bucket-sized pieces. With overlap_comm, buckets are launched
// non-blocking as soon as their range is final and progress() is polled between kernels
// (MPICH advances non-blocking collectives only inside MPI calls), at most two at a time:
// DeepSpeed double-buffers its bucket, so a third waits for the first and the staging is two
// buckets' worth, not the gradient partition's. Otherwise each bucket is reduced when
// launched, blocking.
//
// Example (AllReduce, 10 elements, no segments, bucket 4): ready(6) -> launch [6,10); ready(0)
// -> launch [2,6); finish() -> launch [0,2), wait for all three; each bucket is scaled by 1/W.
//
// Types: the collective runs in the communication dtype (DeepSpeed's communication_data_type,
// FACTS §5.5). A source in another type is converted bucket by bucket into a send buffer; the
// received result is converted into the destination's type (RNE) while it is averaged.
//
// Averaging: each bucket is multiplied by `pre` before the collective and by `post` after it
// (reduce_scaling: DeepSpeed's prescale_gradients and gradient_predivide_factor). The default
// pre = 1, post = 1/W sums first; prescaling divides first, so that a 16-bit sum of W large
// gradients stays in range (DeepSpeed's reason for both keys).
#pragma once

#include <memory>
#include <vector>

#include "kernels/memory.hpp"
#include "kernels/typed.hpp"
#include "parallel/comm.hpp"
#include "parallel/partition.hpp"
#include "parallel/quantized_reduce_scatter.hpp"

namespace zero3d {

// Factors around the data-parallel sum of a bucket (DEEPSPEED-FACTS §5.6; DeepSpeed's
// engine.py allreduce_bucket and stage_1_and_2.py gradient_reduction_w_predivide).
struct ReduceScaling {
  double pre = 1.0, post = 1.0;
};
// prescale: 1/W before, nothing after. Otherwise (DeepSpeed's postscale) 1/f before when the
// predivide factor f is not 1, and f/W after when f is not W: (Σ g/f)·f/W, the mean either way.
// zero_partitioned (ZeRO stage 1-3) with neither set: 1/W before, as DeepSpeed's ZeRO reduce-
// scatter divides every bucket before the collective (FACTS §5.3, §5.4), so W fp16 gradients
// that fit one by one never overflow in their sum; stage 0 sums first, as its all-reduce does.
ReduceScaling reduce_scaling(bool prescale_gradients, double gradient_predivide_factor, int world,
                             bool zero_partitioned = false);

// Global elements [begin, end) form one gradient (a tensor, or the partition's padding) that
// is communicated in `type`. Segments are sorted and cover the reduced buffer, except for gaps
// that are not reduced at all (frozen tensors: zero/zero.hpp StateTypes::frozen_tensors).
// quant_group > 0: a tensor qgZ reduces as int4 groups of that many values (type F32: the fp32
// window it is quantised from; parallel/quantized_reduce_scatter.hpp).
struct CommSegment {
  int64_t begin = 0, end = 0;
  DType type = DType::F32;
  int64_t quant_group = 0;
};
struct ReduceBucket {
  int64_t begin = 0, end = 0;
  DType type = DType::F32;
  int64_t quant_group = 0;
};
// The buckets of [lo, hi), highest first: whole segments (clipped to the range) while they fit
// in `bucket_elems` and share a type, a larger segment alone; no segments: bucket-sized pieces
// of `type`.
std::vector<ReduceBucket> cut_buckets(const std::vector<CommSegment>& segments, int64_t lo, int64_t hi,
                                      int64_t bucket_elems, DType type);

// Staging bytes of the bucket slots: the send buffer of a bucket converted from `source` to its
// communication type, and the part of a reduce-scattered bucket a rank receives (the largest
// rank's). One slot, or two with overlap_comm, taken in turn: bucket i of a pass (`buckets` in
// launch order) uses slot i mod 2, so a pass with one large bucket (the embeddings') grows one
// slot to it and the other stays the size of its neighbours'.
struct StagingBytes {
  int64_t send = 0, recv = 0;
};
std::vector<StagingBytes> slot_staging_bytes(const std::vector<ReduceBucket>& buckets, DType source, bool scatter,
                                             const Partition& partition, bool overlap);

class GradientReducer {
 public:
  enum class Mode { AllReduce, ReduceScatter };

  // AllReduce over a flat buffer of n elements of grad_type.
  // segments: the gradients of the buffer and their communication dtypes (empty: the whole
  // buffer in comm_type, cut in bucket-sized pieces).
  GradientReducer(Communicator& comm, void* grads, DType grad_type, int64_t n, int64_t bucket_elems, bool overlap,
                  DType comm_type, std::vector<CommSegment> segments = {});
  // ReduceScatter into `dest` (this rank's partition, part elements of dest_type);
  // accumulate: += instead of =. flat_type: the type of the flat buffer begin() is given.
  GradientReducer(Communicator& comm, const Partition& partition, void* dest, DType dest_type, bool accumulate,
                  int64_t bucket_elems, bool overlap, DType comm_type, DType flat_type,
                  std::vector<CommSegment> segments = {});

  // The buckets of [lo, hi) as this reducer cuts them.
  std::vector<ReduceBucket> buckets(int64_t lo, int64_t hi) const {
    return cut_buckets(segments_, lo, hi, bucket_, comm_type_);
  }
  // Allocates the bucket slots for one backward's reductions of `ranges`, in the order they
  // are launched, from a source of `source` type (the flat buffer's, or fp32 windows), so that
  // the staging exists before the first backward. (Another order may grow them.)
  void reserve_staging(const std::vector<std::pair<int64_t, int64_t>>& ranges, DType source);
  // A backward begins (window use): its first bucket takes the first slot again.
  void begin_pass() { launched_ = 0; }

  // --- flat-buffer use (stages 0 and 1): a frontier that moves from the end down to 0.
  void begin(void* flat_grads = nullptr);
  void grads_ready(int64_t offset);  // [offset, end) of the flat buffer is final
  void progress();
  // Launches what is left of the flat buffer, waits for everything, applies results
  // (AllReduce: scales by 1/W). Returns the number of buckets of this reduction.
  int64_t finish();

  // --- window use (stages 2 and 3): reduce src (fp32, holding global range [begin, end)) now.
  void reduce_range(const float* src, int64_t begin, int64_t end, int tag);
  void wait_tag(int tag);  // until no bucket read from window `tag` is in flight
  void wait_all();

  // Bytes of staging held: the bucket slots' send buffers (converted buckets) and received parts.
  int64_t staging_peak_bytes() const;

  // The factors around the sum (default: pre 1, post 1/W). A source in the communication type
  // is scaled where it lies before the collective reads it (DeepSpeed scales its bucket in place).
  void set_scaling(const ReduceScaling& s);
  const ReduceScaling& scaling() const { return scaling_; }
  // ZeRO++'s qgZ (ReduceScatter mode): the buckets of quant_group > 0 are reduced through it
  // (the data group's ranks, this reducer's comm, in its node-major order).
  void set_quantized(QuantizedReduceScatter* qgz) { qgz_ = qgz; }

 private:
  struct InFlight {
    std::unique_ptr<CommRequest> request;
    int64_t begin, end;  // global range of the bucket
    int tag;
    void* src;             // the bucket's first element in the source
    DType src_type, type;  // the source's type and the bucket's communication type
    int slot;              // the staging slot it uses
  };
  // A bucket's staging: `send` holds it in its communication type when the source has another
  // (else unused), `recv` this rank's part of a reduce-scattered bucket. Kept from bucket to
  // bucket: a fresh buffer per bucket costs a zero fill and page faults every time.
  struct Slot {
    kernels::StagingBuffer send, recv;  // in model memory, where the conversions that fill and drain them run
  };
  void launch(const void* src, DType src_type, const ReduceBucket& bucket, int tag);
  void complete(InFlight& f);
  void wait_slot(int slot);                 // completes the bucket in flight in `slot`, if any

  Communicator& comm_;
  Mode mode_;
  Partition partition_;
  DType comm_type_, flat_type_, dest_type_ = DType::F32;
  void* flat_ = nullptr;  // AllReduce / flat-buffer source
  void* dest_ = nullptr;  // ReduceScatter destination (partition)
  bool accumulate_ = false;
  std::vector<CommSegment> segments_;
  Slot slots_[2];
  int64_t n_ = 0, bucket_;
  bool overlap_;
  std::vector<ReduceBucket> flat_buckets_;  // the flat buffer's buckets, highest first
  size_t next_bucket_ = 0;                  // the next of them to launch
  int64_t launched_ = 0;
  std::vector<InFlight> inflight_;
  ReduceScaling scaling_;
  float pre_ = 1.0f, post_ = 1.0f;  // scaling_ in fp32, as the buckets are multiplied
  QuantizedReduceScatter* qgz_ = nullptr;
};

}  // namespace zero3d

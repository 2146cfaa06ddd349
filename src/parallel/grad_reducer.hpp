// grad_reducer.hpp — data-parallel gradient reduction in buckets of reduce_bucket_size elements.
//
// Two modes over the same bucketing:
//  * AllReduce (ZeRO stage 0): every rank ends with the averaged full gradient.
//  * ReduceScatter (stages 1-3): each bucket [a, b) is reduce-scattered with per-rank counts
//    |[a, b) ∩ partition r|, so each rank receives only the averaged part it owns, staged in a
//    partition-sized buffer and then written (stage 1) or added (stages 2-3, which reduce
//    every micro-batch) into the rank's gradient partition.
// Buckets are cut from the end of a range down, the order in which backward completes the
// flat buffer. With overlap_comm, buckets are launched non-blocking as soon as their range is
// final and progress() is polled between kernels (MPICH advances non-blocking collectives only
// inside MPI calls); otherwise each bucket is reduced when launched, blocking.
//
// Example (AllReduce, 10 elements, bucket 4): ready(6) -> launch [6,10); ready(0) -> launch
// [2,6); finish() -> launch [0,2), wait for all three; each bucket is scaled by 1/W as it lands.
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

#include "base/byte_pool.hpp"
#include "kernels/memory.hpp"
#include "kernels/typed.hpp"
#include "parallel/comm.hpp"
#include "parallel/partition.hpp"

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

class GradientReducer {
 public:
  enum class Mode { AllReduce, ReduceScatter };

  // AllReduce over a flat buffer of n elements of grad_type.
  GradientReducer(Communicator& comm, void* grads, DType grad_type, int64_t n, int64_t bucket_elems, bool overlap,
                  DType comm_type);
  // ReduceScatter into `dest` (this rank's partition, part elements of dest_type);
  // accumulate: += instead of =. flat_type: the type of the flat buffer begin() is given.
  GradientReducer(Communicator& comm, const Partition& partition, void* dest, DType dest_type, bool accumulate,
                  int64_t bucket_elems, bool overlap, DType comm_type, DType flat_type);

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

  // Peak bytes of staging held at once: received parts, and send buffers of converted buckets
  // (in flight, or kept for the next bucket).
  int64_t staging_peak_bytes() const { return staging_.peak_bytes(); }

  // The factors around the sum (default: pre 1, post 1/W). A source in the communication type
  // is scaled where it lies before the collective reads it (DeepSpeed scales its bucket in place).
  void set_scaling(const ReduceScaling& s);
  const ReduceScaling& scaling() const { return scaling_; }

 private:
  struct InFlight {
    std::unique_ptr<CommRequest> request;
    int64_t begin, end;  // global range of the bucket
    int tag;
    void* src;             // the bucket's first element in the source
    DType src_type;
    kernels::StagingBuffer send;     // the bucket in comm_type_ when the source has another type (else empty)
    kernels::StagingBuffer staging;  // ReduceScatter: receives this rank's part of the bucket
  };
  void launch(const void* src, DType src_type, int64_t begin, int64_t end, int tag);
  void complete(InFlight& f);

  Communicator& comm_;
  Mode mode_;
  Partition partition_;
  DType comm_type_, flat_type_, dest_type_ = DType::F32;
  void* flat_ = nullptr;  // AllReduce / flat-buffer source
  void* dest_ = nullptr;  // ReduceScatter destination (partition)
  bool accumulate_ = false;
  // Send and receive buffers of the buckets, kept for the next ones; in model memory, where the
  // conversions that fill and drain them run.
  BasicPool<kernels::StagingBuffer> staging_;
  int64_t n_ = 0, bucket_;
  bool overlap_;
  int64_t frontier_ = 0;  // [frontier_, n_) has been launched
  int64_t launched_ = 0;
  std::vector<InFlight> inflight_;
  ReduceScaling scaling_;
  float pre_ = 1.0f, post_ = 1.0f;  // scaling_ in fp32, as the buckets are multiplied
};

}  // namespace zero3d

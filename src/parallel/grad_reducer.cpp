// grad_reducer.cpp
#include "parallel/grad_reducer.hpp"
#include "parallel/staging.hpp"

#include <algorithm>

namespace zero3d {

ReduceScaling reduce_scaling(bool prescale_gradients, double gradient_predivide_factor, int world,
                             bool zero_partitioned) {
  const double w = static_cast<double>(world), f = gradient_predivide_factor;
  if (prescale_gradients || (zero_partitioned && f == 1.0)) return {1.0 / w, 1.0};
  return {f != 1.0 ? 1.0 / f : 1.0, f != w ? f / w : 1.0};
}

std::vector<ReduceBucket> cut_buckets(const std::vector<CommSegment>& segments, int64_t lo, int64_t hi,
                                      int64_t bucket_elems, DType type) {
  const int64_t cap = std::max<int64_t>(1, bucket_elems);
  std::vector<ReduceBucket> out;
  if (segments.empty()) {
    for (int64_t b = hi; b > lo; b -= cap) out.push_back({std::max(lo, b - cap), b, type});
    return out;
  }
  // From the last segment down (backward's order), DeepSpeed's IPG rule: a gradient joins the
  // open bucket if it fits and has the bucket's dtype, else the bucket is reduced and it opens
  // the next one, however large it is. qgZ's tensors (quant_group > 0) share a bucket only with
  // tensors of their group size, as they share one with tensors of their dtype.
  ReduceBucket open{hi, hi, type};
  for (auto it = segments.rbegin(); it != segments.rend(); ++it) {
    const int64_t a = std::max(lo, it->begin), b = std::min(hi, it->end);
    if (a >= b) continue;
    // A gap (a frozen tensor, which has no gradient to reduce) also closes the bucket.
    if (open.begin < open.end &&
        (it->type != open.type || it->quant_group != open.quant_group || open.end - a > cap || b != open.begin)) {
      out.push_back(open);
      open = {b, b, it->type, it->quant_group};
    }
    if (open.begin == open.end) open = {a, b, it->type, it->quant_group};
    else open.begin = a;
  }
  if (open.begin < open.end) out.push_back(open);
  return out;
}

std::vector<StagingBytes> slot_staging_bytes(const std::vector<ReduceBucket>& buckets, DType source, bool scatter,
                                             const Partition& partition, bool overlap) {
  std::vector<StagingBytes> slots(overlap ? 2 : 1);
  for (size_t i = 0; i < buckets.size(); ++i) {
    const ReduceBucket& b = buckets[i];
    StagingBytes& s = slots[i % slots.size()];
    const auto esize = static_cast<int64_t>(dtype_size(b.type));
    if (b.type != source) s.send = std::max(s.send, (b.end - b.begin) * esize);
    if (!scatter) continue;
    for (int r = 0; r < partition.world; ++r) {
      const auto [lo, hi] = partition.owned(r, b.begin, b.end);
      s.recv = std::max(s.recv, (hi - lo) * esize);
    }
  }
  return slots;
}

GradientReducer::GradientReducer(Communicator& comm, void* grads, DType grad_type, int64_t n, int64_t bucket_elems,
                                 bool overlap, DType comm_type, std::vector<CommSegment> segments)
    : comm_(comm), mode_(Mode::AllReduce), comm_type_(comm_type), flat_type_(grad_type), flat_(grads),
      segments_(std::move(segments)), n_(n), bucket_(std::max<int64_t>(1, bucket_elems)), overlap_(overlap) {
  partition_ = Partition(n, 1);
  flat_buckets_ = buckets(0, n_);
  set_scaling(reduce_scaling(false, 1.0, comm.size()));
}

GradientReducer::GradientReducer(Communicator& comm, const Partition& partition, void* dest, DType dest_type,
                                 bool accumulate, int64_t bucket_elems, bool overlap, DType comm_type, DType flat_type,
                                 std::vector<CommSegment> segments)
    : comm_(comm), mode_(Mode::ReduceScatter), partition_(partition), comm_type_(comm_type), flat_type_(flat_type),
      dest_type_(dest_type), dest_(dest), accumulate_(accumulate), segments_(std::move(segments)), n_(partition.padded),
      bucket_(std::max<int64_t>(1, bucket_elems)), overlap_(overlap) {
  flat_buckets_ = buckets(0, n_);
  set_scaling(reduce_scaling(false, 1.0, comm.size()));
}

void GradientReducer::reserve_staging(const std::vector<std::pair<int64_t, int64_t>>& ranges, DType source) {
  std::vector<ReduceBucket> sequence;
  for (const auto& [lo, hi] : ranges)
    for (const ReduceBucket& b : buckets(lo, hi)) sequence.push_back(b);
  const std::vector<StagingBytes> need =
      slot_staging_bytes(sequence, source, mode_ == Mode::ReduceScatter, partition_, overlap_);
  for (size_t k = 0; k < need.size(); ++k) {
    fit(slots_[k].send, need[k].send);
    fit(slots_[k].recv, need[k].recv);
  }
}

int64_t GradientReducer::staging_peak_bytes() const {
  int64_t n = 0;
  for (const Slot& s : slots_) n += static_cast<int64_t>(s.send.size() + s.recv.size());
  return n;
}

void GradientReducer::set_scaling(const ReduceScaling& s) {
  scaling_ = s;
  pre_ = static_cast<float>(s.pre);
  // The default mean keeps its single-precision 1/W, as before the factors existed.
  post_ = s.pre == 1.0 && s.post == 1.0 / comm_.size() ? 1.0f / static_cast<float>(comm_.size())
                                                       : static_cast<float>(s.post);
}

void GradientReducer::begin(void* flat_grads) {
  if (flat_grads) flat_ = flat_grads;
  next_bucket_ = 0;
  launched_ = 0;
}

void GradientReducer::wait_slot(int slot) {
  for (auto it = inflight_.begin(); it != inflight_.end(); ++it)
    if (it->slot == slot) {
      it->request->wait();
      complete(*it);
      inflight_.erase(it);
      return;
    }
}

void GradientReducer::launch(const void* src, DType src_type, const ReduceBucket& bucket, int tag) {
  // Two slots with overlap_comm (the one launched two buckets ago is waited for), one without.
  const int slot = overlap_ ? static_cast<int>(launched_ % 2) : 0;
  wait_slot(slot);
  ++launched_;
  const int64_t begin = bucket.begin, end = bucket.end;
  const DType type = bucket.type;
  const size_t esize = dtype_size(type);
  InFlight f{nullptr, begin, end, tag, const_cast<void*>(src), src_type, type, slot};
  Slot& s = slots_[slot];
  const void* send = src;
  if (src_type != type) {
    fit(s.send, (end - begin) * static_cast<int64_t>(esize));
    convert_any(s.send.data(), type, src, src_type, end - begin, pre_);
    send = s.send.data();
  } else if (pre_ != 1.0f) {
    convert_any(const_cast<void*>(src), src_type, src, src_type, end - begin, pre_);  // in place, as DeepSpeed's mul_
  }
  if (qgz_ && bucket.quant_group > 0) {  // qgZ: blocking, as DeepSpeed's all_to_all_quant_reduce
    const std::vector<int64_t> counts = partition_.counts(begin, end);
    fit(s.recv, counts[comm_.rank()] * static_cast<int64_t>(sizeof(float)));
    std::vector<int64_t> tensors;  // LoCo keeps errors by tensor
    if (qgz_->loco())
      for (const CommSegment& g : segments_)
        if (g.end > begin && g.begin < end) tensors.push_back(std::min(g.end, end) - std::max(g.begin, begin));
    qgz_->reduce(static_cast<const float*>(send), counts, bucket.quant_group, reinterpret_cast<float*>(s.recv.data()),
                 begin, tensors);
    complete(f);
    return;
  }
  if (mode_ == Mode::AllReduce) {
    f.request = comm_.all_reduce_async(const_cast<void*>(send), end - begin, type, ReduceOp::Sum);
  } else {
    const std::vector<int64_t> counts = partition_.counts(begin, end);
    fit(s.recv, counts[comm_.rank()] * static_cast<int64_t>(esize));
    f.request = comm_.reduce_scatter_v_async(send, s.recv.data(), counts, type, ReduceOp::Sum);
  }
  inflight_.push_back(std::move(f));
  if (!overlap_) {  // blocking: finish this bucket before the caller goes on
    inflight_.back().request->wait();
    complete(inflight_.back());
    inflight_.pop_back();
  }
}

// Applies a finished bucket, averaged over the group: AllReduce back into the source,
// ReduceScatter into this rank's partition.
void GradientReducer::complete(InFlight& f) {
  const float inv = post_;
  const Slot& s = slots_[f.slot];
  if (mode_ == Mode::AllReduce) {
    const void* result = f.src_type == f.type ? f.src : s.send.data();
    convert_any(f.src, f.src_type, result, f.type, f.end - f.begin, inv);
  } else {
    const int r = comm_.rank();
    const auto [lo, hi] = partition_.owned(r, f.begin, f.end);
    void* d = static_cast<char*>(dest_) + (lo - partition_.begin(r)) * static_cast<int64_t>(dtype_size(dest_type_));
    convert_any(d, dest_type_, s.recv.data(), f.type, hi - lo, inv, accumulate_);
  }
}

void GradientReducer::grads_ready(int64_t offset) {
  if (!overlap_) return;  // without overlap the whole buffer is reduced in finish()
  const int64_t esize = static_cast<int64_t>(dtype_size(flat_type_));
  while (next_bucket_ < flat_buckets_.size() && flat_buckets_[next_bucket_].begin >= offset) {
    const ReduceBucket& b = flat_buckets_[next_bucket_++];
    launch(static_cast<char*>(flat_) + b.begin * esize, flat_type_, b, 0);
  }
  progress();
}

// Advances every bucket in flight; finished buckets are applied and their staging goes back to
// the spares right away, for the next bucket to reuse.
void GradientReducer::progress() {
  for (auto it = inflight_.begin(); it != inflight_.end();) {
    if (it->request->test()) {
      complete(*it);
      it = inflight_.erase(it);
    } else {
      ++it;
    }
  }
}

int64_t GradientReducer::finish() {
  const int64_t esize = static_cast<int64_t>(dtype_size(flat_type_));
  while (next_bucket_ < flat_buckets_.size()) {
    const ReduceBucket& b = flat_buckets_[next_bucket_++];
    launch(static_cast<char*>(flat_) + b.begin * esize, flat_type_, b, 0);
  }
  wait_all();
  return launched_;
}

void GradientReducer::reduce_range(const float* src, int64_t begin, int64_t end, int tag) {
  for (const ReduceBucket& b : buckets(begin, end)) launch(src + (b.begin - begin), DType::F32, b, tag);
  progress();
}

void GradientReducer::wait_tag(int tag) {
  for (auto it = inflight_.begin(); it != inflight_.end();) {
    if (it->tag != tag) {
      ++it;
      continue;
    }
    it->request->wait();
    complete(*it);
    it = inflight_.erase(it);
  }
}

void GradientReducer::wait_all() {
  for (auto& f : inflight_) {
    f.request->wait();
    complete(f);
  }
  inflight_.clear();
}

}  // namespace zero3d

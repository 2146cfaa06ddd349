// grad_reducer.cpp
#include "parallel/grad_reducer.hpp"

#include <algorithm>

namespace zero3d {

ReduceScaling reduce_scaling(bool prescale_gradients, double gradient_predivide_factor, int world,
                             bool zero_partitioned) {
  const double w = static_cast<double>(world), f = gradient_predivide_factor;
  if (prescale_gradients || (zero_partitioned && f == 1.0)) return {1.0 / w, 1.0};
  return {f != 1.0 ? 1.0 / f : 1.0, f != w ? f / w : 1.0};
}

GradientReducer::GradientReducer(Communicator& comm, void* grads, DType grad_type, int64_t n, int64_t bucket_elems,
                                 bool overlap, DType comm_type)
    : comm_(comm), mode_(Mode::AllReduce), comm_type_(comm_type), flat_type_(grad_type), flat_(grads), n_(n),
      bucket_(std::max<int64_t>(1, bucket_elems)), overlap_(overlap) {
  set_scaling(reduce_scaling(false, 1.0, comm.size()));
}

GradientReducer::GradientReducer(Communicator& comm, const Partition& partition, void* dest, DType dest_type,
                                 bool accumulate, int64_t bucket_elems, bool overlap, DType comm_type, DType flat_type)
    : comm_(comm), mode_(Mode::ReduceScatter), partition_(partition), comm_type_(comm_type), flat_type_(flat_type),
      dest_type_(dest_type), dest_(dest), accumulate_(accumulate), n_(partition.padded),
      bucket_(std::max<int64_t>(1, bucket_elems)), overlap_(overlap) {
  set_scaling(reduce_scaling(false, 1.0, comm.size()));
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
  frontier_ = n_;
  launched_ = 0;
}

void GradientReducer::launch(const void* src, DType src_type, int64_t begin, int64_t end, int tag) {
  ++launched_;
  const size_t esize = dtype_size(comm_type_);
  InFlight f{nullptr, begin, end, tag, const_cast<void*>(src), src_type, {}, {}};
  const void* send = src;
  if (src_type != comm_type_) {
    f.send = staging_.take((end - begin) * static_cast<int64_t>(esize));
    convert_any(f.send.data(), comm_type_, src, src_type, end - begin, pre_);
    send = f.send.data();
  } else if (pre_ != 1.0f) {
    convert_any(const_cast<void*>(src), src_type, src, src_type, end - begin, pre_);  // in place, as DeepSpeed's mul_
  }
  if (mode_ == Mode::AllReduce) {
    f.request = comm_.all_reduce_async(const_cast<void*>(send), end - begin, comm_type_, ReduceOp::Sum);
  } else {
    std::vector<int64_t> counts(static_cast<size_t>(comm_.size()));
    for (int r = 0; r < comm_.size(); ++r) {
      const auto [lo, hi] = partition_.owned(r, begin, end);
      counts[r] = hi - lo;
    }
    f.staging = staging_.take(counts[comm_.rank()] * static_cast<int64_t>(esize));
    f.request = comm_.reduce_scatter_v_async(send, f.staging.data(), counts, comm_type_, ReduceOp::Sum);
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
  if (mode_ == Mode::AllReduce) {
    const void* result = f.send.empty() ? f.src : f.send.data();
    convert_any(f.src, f.src_type, result, comm_type_, f.end - f.begin, inv);
  } else {
    const int r = comm_.rank();
    const auto [lo, hi] = partition_.owned(r, f.begin, f.end);
    void* d = static_cast<char*>(dest_) + (lo - partition_.begin(r)) * static_cast<int64_t>(dtype_size(dest_type_));
    convert_any(d, dest_type_, f.staging.data(), comm_type_, hi - lo, inv, accumulate_);
  }
  staging_.give_back(std::move(f.send));
  staging_.give_back(std::move(f.staging));
}

void GradientReducer::grads_ready(int64_t offset) {
  if (!overlap_) return;  // without overlap the whole buffer is reduced in finish()
  const int64_t esize = static_cast<int64_t>(dtype_size(flat_type_));
  while (frontier_ - offset >= bucket_) {
    launch(static_cast<char*>(flat_) + (frontier_ - bucket_) * esize, flat_type_, frontier_ - bucket_, frontier_, 0);
    frontier_ -= bucket_;
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
  while (frontier_ > 0) {
    const int64_t begin = std::max<int64_t>(0, frontier_ - bucket_);
    launch(static_cast<char*>(flat_) + begin * esize, flat_type_, begin, frontier_, 0);
    frontier_ = begin;
  }
  wait_all();
  return launched_;
}

void GradientReducer::reduce_range(const float* src, int64_t begin, int64_t end, int tag) {
  for (int64_t hi = end; hi > begin;) {
    const int64_t lo = std::max(begin, hi - bucket_);
    launch(src + (lo - begin), DType::F32, lo, hi, tag);
    hi = lo;
  }
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

// grad_reducer.cpp
#include "grad_reducer.hpp"

#include <algorithm>

#include "reduce.hpp"

namespace zero3d {

GradientReducer::GradientReducer(Communicator& comm, float* grads, int64_t n, int64_t bucket_elems, bool overlap)
    : comm_(comm), mode_(Mode::AllReduce), flat_(grads), n_(n), bucket_(std::max<int64_t>(1, bucket_elems)),
      overlap_(overlap) {}

GradientReducer::GradientReducer(Communicator& comm, const Partition& partition, float* dest, bool accumulate,
                                 int64_t bucket_elems, bool overlap)
    : comm_(comm), mode_(Mode::ReduceScatter), partition_(partition), dest_(dest), accumulate_(accumulate),
      n_(partition.padded), bucket_(std::max<int64_t>(1, bucket_elems)),
      overlap_(overlap) {}

void GradientReducer::begin(float* flat_grads) {
  if (flat_grads) flat_ = flat_grads;
  frontier_ = n_;
  launched_ = 0;
}

void GradientReducer::launch(const float* src, int64_t begin, int64_t end, int tag) {
  ++launched_;
  InFlight f{nullptr, begin, end, tag, {}};
  if (mode_ == Mode::AllReduce) {
    f.request = comm_.all_reduce_async(const_cast<float*>(src), end - begin, DType::F32, ReduceOp::Sum);
  } else {
    std::vector<int64_t> counts(static_cast<size_t>(comm_.size()));
    for (int r = 0; r < comm_.size(); ++r) {
      const auto [lo, hi] = partition_.owned(r, begin, end);
      counts[r] = hi - lo;
    }
    f.staging.resize(static_cast<size_t>(counts[comm_.rank()]));
    staging_live_ += counts[comm_.rank()];
    staging_peak_ = std::max(staging_peak_, staging_live_);
    f.request = comm_.reduce_scatter_v_async(src, f.staging.data(), counts, DType::F32, ReduceOp::Sum);
  }
  inflight_.push_back(std::move(f));
  if (!overlap_) {  // blocking: finish this bucket before the caller goes on
    inflight_.back().request->wait();
    complete(inflight_.back());
    inflight_.pop_back();
  }
}

// Applies a finished ReduceScatter bucket to this rank's partition, averaged over the group.
void GradientReducer::complete(InFlight& f) {
  if (mode_ == Mode::AllReduce) return;  // averaged once over the whole buffer in finish()
  const int r = comm_.rank();
  const auto [lo, hi] = partition_.owned(r, f.begin, f.end);
  const int64_t off = lo - partition_.begin(r), n = hi - lo;
  const float inv = 1.0f / static_cast<float>(comm_.size());
  float* d = dest_ + off;
  const float* s = f.staging.data();
  staging_live_ -= n;
  if (accumulate_)
    Kokkos::parallel_for("zero_grad_accumulate", kernels::range(n), KOKKOS_LAMBDA(kernels::Index i) { d[i] += s[i] * inv; });
  else
    Kokkos::parallel_for("zero_grad_assign", kernels::range(n), KOKKOS_LAMBDA(kernels::Index i) { d[i] = s[i] * inv; });
}

void GradientReducer::grads_ready(int64_t offset) {
  if (!overlap_) return;  // without overlap the whole buffer is reduced in finish()
  while (frontier_ - offset >= bucket_) {
    launch(flat_ + frontier_ - bucket_, frontier_ - bucket_, frontier_, 0);
    frontier_ -= bucket_;
  }
  progress();
}

// Advances every bucket in flight; finished ReduceScatter buckets are applied and their
// staging freed right away, so staging holds only what is really in flight.
void GradientReducer::progress() {
  for (auto it = inflight_.begin(); it != inflight_.end();) {
    if (it->request->test() && mode_ == Mode::ReduceScatter) {
      complete(*it);
      it = inflight_.erase(it);
    } else {
      ++it;
    }
  }
}

int64_t GradientReducer::finish() {
  while (frontier_ > 0) {
    const int64_t begin = std::max<int64_t>(0, frontier_ - bucket_);
    launch(flat_ + begin, begin, frontier_, 0);
    frontier_ = begin;
  }
  wait_all();
  if (mode_ == Mode::AllReduce) kernels::scale_in_place(flat_, n_, 1.0f / static_cast<float>(comm_.size()));
  return launched_;
}

void GradientReducer::reduce_range(const float* src, int64_t begin, int64_t end, int tag) {
  for (int64_t hi = end; hi > begin;) {
    const int64_t lo = std::max(begin, hi - bucket_);
    launch(src + (lo - begin), lo, hi, tag);
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

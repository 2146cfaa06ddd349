// grad_reducer.cpp
#include "grad_reducer.hpp"

#include <algorithm>

#include "reduce.hpp"

namespace zero3d {

GradientReducer::GradientReducer(Communicator& comm, float* grads, int64_t n, int64_t bucket_elems, bool overlap)
    : comm_(comm), grads_(grads), n_(n), bucket_(std::max<int64_t>(1, bucket_elems)), overlap_(overlap) {}

void GradientReducer::begin() {
  frontier_ = n_;
  launched_ = 0;
  inflight_.clear();
}

void GradientReducer::launch(int64_t begin, int64_t end) {
  ++launched_;
  if (overlap_)
    inflight_.push_back(comm_.all_reduce_async(grads_ + begin, end - begin, DType::F32, ReduceOp::Sum));
  else
    comm_.all_reduce(grads_ + begin, end - begin, DType::F32, ReduceOp::Sum);
}

void GradientReducer::grads_ready(int64_t offset) {
  if (!overlap_) return;
  while (frontier_ - offset >= bucket_) {
    launch(frontier_ - bucket_, frontier_);
    frontier_ -= bucket_;
  }
  progress();
}

void GradientReducer::progress() {
  for (auto& r : inflight_) r->test();
}

int64_t GradientReducer::finish() {
  while (frontier_ > 0) {
    const int64_t begin = std::max<int64_t>(0, frontier_ - bucket_);
    launch(begin, frontier_);
    frontier_ = begin;
  }
  for (auto& r : inflight_) r->wait();
  inflight_.clear();
  kernels::scale_in_place(grads_, n_, 1.0f / static_cast<float>(comm_.size()));
  return launched_;
}

}  // namespace zero3d

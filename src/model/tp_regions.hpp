// tp_regions.hpp — the column-parallel backward region both block families share (GPT::
// column_parallel_backward, declared in model.hpp): a template, so model.cpp and llama_block.cpp
// each instantiate it with their own products (Conv1D's matmul_backward, nn.Linear's
// linear_backward).
#pragma once

#include <memory>

#include "model/model.hpp"
#include "parallel/comm.hpp"
#include "parallel/tensor_parallel.hpp"

namespace zero3d {

template <typename In, typename Product>
void GPT::column_parallel_backward(float* dinp_shard, float* dweight, float* dbias, const In* x, int64_t IC,
                                   ParamStore& store, const Product& product) {
  const bool tp = part_.tp_size > 1, sp = tp_.sequence_parallel;
  const int64_t BT = B_ * T_;
  if (sp && dweight) {  // all tokens, for the weight product, in the shard's type
    In* full = reinterpret_cast<In*>(gathered_);
    gather_from_sequence_parallel_region_forward(tp_, x, full, Ns_ * IC);
    x = full;
  }
  float* dinp = sp && dinp_shard ? row_out_ : dinp_shard;
  if (tp && tp_.overlap && !sp && dinp && dweight) {
    product(dinp, nullptr, nullptr, x);
    const std::unique_ptr<CommRequest> pending = tp_.all_reduce_sum_async(dinp, BT * IC);
    product(nullptr, dweight, dbias, x);
    store.progress();
    pending->wait();
    return;
  }
  product(dinp, dweight, dbias, x);
  if (!dinp) return;
  if (sp) gather_from_sequence_parallel_region_backward(tp_, dinp, dinp_shard, Ns_ * IC);
  else copy_to_tp_region_backward(tp_, dinp, BT * IC);
}

}  // namespace zero3d

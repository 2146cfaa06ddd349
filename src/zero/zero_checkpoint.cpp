// zero_checkpoint.cpp — what the ZeRO optimizer saves (its states over this rank's range, read
// through host memory) and how it reads them back, at the same layout or another (zero.hpp).
#include <algorithm>
#include <cstring>

#include "base/errors.hpp"
#include "kernels/memory.hpp"
#include "zero/model_memory_io.hpp"
#include "zero/zero.hpp"

namespace zero3d {

using zero_io::in_model_memory;
using zero_io::packed_pieces;
using zero_io::read_model;

std::vector<std::string> ZeroOptimizer::checkpoint_states() const {
  std::vector<std::string> names = {"params"};
  for (const std::string& n : offloaded_ ? offloaded_->optimizer_states() : optimizer_->state_names()) names.push_back(n);
  return names;
}

// Stage 0 holds full moments (index = flat offset); stages 1-3 hold partitions (index 0 =
// part.begin(rank)). Parameters are full except at stage 3.
std::pair<int64_t, int64_t> ZeroOptimizer::checkpoint_range() const { return part_.owned(rank_, 0, layout_.total()); }

std::pair<int64_t, int64_t> ZeroOptimizer::save_range() const {
  const auto r = checkpoint_range();
  return shards_.replicas && shards_.replicas->rank() > 0 ? std::make_pair(r.first, r.first) : r;
}

std::vector<std::pair<std::string, const float*>> ZeroOptimizer::checkpoint_arrays() {
  const std::pair<int64_t, int64_t> range = checkpoint_range();  // (not a structured binding: a lambda reads b)
  const int64_t b = range.first, e = range.second, pb = part_.begin(rank_), n = e - b;
  const int64_t at = stage_ == 0 ? b : b - pb;  // element b in a buffer held whole (stage 0) or as the partition
  // Checkpoints hold fp32, loadable at any precision: the master copy when mixed. What lies
  // elsewhere or in 16 bits (offloaded state, bf16 master weights, bf16 optimizer states) is
  // read back or widened into staging (model memory) kept until the next step.
  ckpt_staging_.clear();
  ckpt_staging_.reserve(8);
  auto staging = [&]() {
    ckpt_staging_.push_back(make_flat_buffer("checkpoint_staging", n));
    return ckpt_staging_.back().data();
  };
  // The offload tiers are read by the host thread (OffloadedOptimizer::read): through host memory
  // into the staging, where model memory is not host memory.
  std::vector<float> host(kernels::kHostIsDevice ? 0 : static_cast<size_t>(n));  // one for every state
  auto offloaded = [&](const std::string& state) {
    float* s = staging();
    offloaded_->read(state, b - pb, n, kernels::kHostIsDevice ? s : host.data());
    if (!kernels::kHostIsDevice) kernels::copy_to_device(s, host.data(), host.size() * sizeof(float));
    return s;
  };
  std::vector<std::pair<std::string, const float*>> arrays;
  if (quantized_frozen_) {  // the frozen elements dequantised (their int8 store goes in the rank state)
    float* s = staging();
    quantized_partition_values(s);
    arrays.emplace_back("params", s);
  } else if (mixed_ && offloaded_) {
    arrays.emplace_back("params", offloaded("master"));
  } else if (mixed_ && trainable_) {
    // Packed master: the frozen elements as the 16-bit parameters hold them (widened, as
    // DeepSpeed saves frozen parameters from the module), the trainable ones from the master.
    float* s = staging();
    convert_any(s, DType::F32, params_.at(stage_ == 3 ? b - pb : b), types_.param, n);
    packed_pieces(*trainable_, at, n, [&](int64_t x, int64_t packed, int64_t c) {
      convert_any(s + (x - at), DType::F32, master_.data() + packed, DType::F32, c);
    });
    arrays.emplace_back("params", s);
  } else if (mixed_) {
    arrays.emplace_back("params", master_.data() + at);
  } else if (param_swap_) {  // the partition lies in its swap files: read and widened by the host
    float* s = staging();
    std::vector<char> bits(static_cast<size_t>(n) * dtype_size(types_.param));
    read_params(b - pb, n, bits.data());
    convert_on_host(kernels::kHostIsDevice ? s : host.data(), DType::F32, bits.data(), types_.param, n);
    if (!kernels::kHostIsDevice) kernels::copy_to_device(s, host.data(), host.size() * sizeof(float));
    arrays.emplace_back("params", s);
  } else if (master16_) {  // bf16 master weights: the parameters, widened
    float* s = staging();
    convert_any(s, DType::F32, params_.at(stage_ == 3 ? b - pb : b), types_.param, n);
    arrays.emplace_back("params", s);
  } else {
    arrays.emplace_back("params", params_.as<float>() + (stage_ == 3 ? b - pb : b));
  }
  if (offloaded_) {
    for (const std::string& state : offloaded_->optimizer_states()) arrays.emplace_back(state, offloaded(state));
    return arrays;
  }
  const auto names = optimizer_->state_names();
  const auto buffers = optimizer_->state_buffers();
  for (size_t k = 0; k < names.size(); ++k) {
    if (const auto& trainable = optimizer_->trainable()) {
      // Frozen elements have no state: saved as zeros, so that any run (frozen or not) loads it.
      float* s = staging();
      packed_pieces(*trainable, at, n, [&](int64_t x, int64_t packed, int64_t c) {
        convert_any(s + (x - at), DType::F32, buffers[k]->at(packed), buffers[k]->type(), c);
      });
      arrays.emplace_back(names[k], s);
      continue;
    }
    if (buffers[k]->type() == DType::F32) {
      arrays.emplace_back(names[k], buffers[k]->as<float>() + at);
      continue;
    }
    float* s = staging();
    convert_any(s, DType::F32, buffers[k]->at(at), buffers[k]->type(), n);
    arrays.emplace_back(names[k], s);
  }
  return arrays;
}

void ZeroOptimizer::read_checkpoint(const RangeReader& read, int64_t optimizer_step) {
  const auto range = checkpoint_range();
  const int64_t b = range.first, e = range.second;  // named, not bound: `staged` captures them (C++17)
  const int64_t pb = part_.begin(rank_), n = e - b;
  const int64_t at = stage_ == 0 ? b : b - pb;
  // State that does not lie in fp32 where this rank holds it goes through a staging range.
  std::vector<float> staging;
  auto staged = [&](const std::string& state) {
    staging.resize(static_cast<size_t>(n));
    read(state, b, e, staging.data());
    return staging.data();
  };
  if (quantized_frozen_) {
    // The frozen pieces quantised afresh from the saved values; a save of the same pieces then
    // restores their codes and scales bit for bit (restore_quantized_frozen).
    load_quantized_partition([&](float* out, int64_t lo, int64_t hi) { read("params", lo, hi, out); });
  } else if (mixed_ && offloaded_) {
    offloaded_->write("master", b - pb, n, staged("params"));
  } else if (mixed_ && trainable_) {
    // Packed master: the values rounded into the 16-bit parameters, the trainable ones also kept
    // in the master; stage 0 reads its whole buffer (finish_checkpoint_load gathers no packed master).
    const int64_t lo = stage_ == 0 ? 0 : b, hi = stage_ == 0 ? layout_.total() : e, view = stage_ == 0 ? 0 : at;
    staging.resize(static_cast<size_t>(hi - lo));
    read("params", lo, hi, staging.data());
    if (stage_ == 0) convert_any(params_.data(), types_.param, in_model_memory(staging.data(), hi - lo, staging_), DType::F32, hi - lo);
    else cast_range_to_params(lo - pb, hi - lo, staging.data());
    const float* values = in_model_memory(staging.data(), hi - lo, staging_);
    packed_pieces(*trainable_, view, hi - lo, [&](int64_t x, int64_t packed, int64_t c) {
      convert_any(master_.data() + packed, DType::F32, values + (x - view), DType::F32, c);
    });
  } else if (mixed_) {
    read_model(read, "params", b, e, master_.data() + at);
  } else if (param_swap_) {  // into the swap files, rounded by the host
    const float* values = staged("params");
    std::vector<char> bits(static_cast<size_t>(n) * dtype_size(types_.param));
    convert_on_host(bits.data(), types_.param, values, DType::F32, n);
    write_params(b - pb, n, bits.data());
  } else if (master16_) {  // bf16 master weights: the parameters, rounded
    convert_any(params_.at(stage_ == 3 ? b - pb : b), types_.param, in_model_memory(staged("params"), n, staging_),
                DType::F32, n);
  } else {
    read_model(read, "params", b, e, params_.as<float>() + (stage_ == 3 ? b - pb : b));
  }
  if (offloaded_) {
    for (const std::string& state : offloaded_->optimizer_states()) offloaded_->write(state, b - pb, n, staged(state));
    offloaded_->set_step_count(optimizer_step);
    return;
  }
  const auto names = optimizer_->state_names();
  const auto buffers = optimizer_->state_buffers();
  if (const auto& trainable = optimizer_->trainable()) {
    // Packed states: stage 0 reads its whole view here (finish_checkpoint_load's all-gather of
    // owned ranges does not apply to packed buffers); stages 1-3 their partition's range.
    const int64_t lo = stage_ == 0 ? 0 : b, hi = stage_ == 0 ? layout_.total() : e;
    const int64_t view = stage_ == 0 ? 0 : at;
    for (size_t k = 0; k < names.size(); ++k) {
      staging.resize(static_cast<size_t>(hi - lo));
      read(names[k], lo, hi, staging.data());
      const float* values = in_model_memory(staging.data(), hi - lo, staging_);
      packed_pieces(*trainable, view, hi - lo, [&](int64_t x, int64_t packed, int64_t c) {
        convert_any(buffers[k]->at(packed), buffers[k]->type(), values + (x - view), DType::F32, c);
      });
    }
    optimizer_->set_step_count(optimizer_step);
    return;
  }
  for (size_t k = 0; k < names.size(); ++k) {
    if (buffers[k]->type() == DType::F32) read_model(read, names[k], b, e, buffers[k]->as<float>() + at);
    else convert_any(buffers[k]->at(at), buffers[k]->type(), in_model_memory(staged(names[k]), n, staging_), DType::F32, n);
  }
  optimizer_->set_step_count(optimizer_step);
}

void ZeroOptimizer::all_gather_replicated(void* full, DType type) {
  std::vector<int64_t> counts(world_), displs(world_);
  for (int r = 0; r < world_; ++r) {
    const auto [lo, hi] = part_.owned(r, 0, layout_.total());
    counts[r] = hi - lo;
    displs[r] = lo;
  }
  dp_.all_gather_v_async(full, counts, displs, type)->wait();
}

void ZeroOptimizer::finish_checkpoint_load() {
  if (!mixed_) {  // fp32 parameters, or bf16 master weights: the parameters themselves
    if (stage_ < 3) all_gather_replicated(params_.data(), types_.param);
  } else if (stage_ == 0) {
    if (!trainable_) all_gather_replicated(master_.data(), DType::F32);  // a packed master was read whole
    cast_master_to_params();
  } else if (quantized_frozen_) {  // read_checkpoint filled the packed parameters and master both
  } else {
    cast_master_to_params();
    if (stage_ < 3) all_gather_replicated(params_.data(), types_.param);
  }
  if (stage_ == 0 && optimizer_ && !optimizer_->trainable())  // packed states were read whole
    for (TypedBuffer* m : optimizer_->state_buffers()) all_gather_replicated(m->data(), m->type());
  dp_.reset_bus_bytes();
}

}  // namespace zero3d

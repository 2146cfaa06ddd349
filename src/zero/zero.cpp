// zero.cpp — see zero.hpp for the stage table. The parameter gathers and their fetch trace are
// in param_fetch.cpp, what a checkpoint saves and reads in zero_checkpoint.cpp.
#include "zero/zero.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <cstring>

#include "base/errors.hpp"
#include "kernels/memory.hpp"
#include "kernels/reduce.hpp"
#include "zero/model_memory_io.hpp"

namespace zero3d {

using zero_io::fill_model;
using zero_io::in_model_memory;
using zero_io::packed_pieces;

namespace {
constexpr int kEmbedWindow = -1, kLastWindow = -2;  // window keys besides the two block windows 0/1

ParamLayout partition_layout(int64_t part) {
  ParamLayout l;
  l.add("partition", {part});
  return l;
}

}  // namespace

int64_t qgz_group_size(const TensorSpec& tensor, int64_t world) {
  if (tensor.shape.size() < 2 || tensor.numel % (2 * world) != 0) return 0;
  return tensor.numel / std::max({tensor.shape[0], tensor.shape[1], world});
}

std::vector<CommSegment> gradient_segments(const ParamLayout& layout, int64_t n, const StateTypes& types,
                                           int64_t qgz_world) {
  std::vector<CommSegment> out;
  const std::vector<TensorSpec>& tensors = layout.tensors();
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (types.frozen(i)) continue;  // requires_grad=False: no gradient takes part in the reduction
    const int64_t group = qgz_world > 0 ? qgz_group_size(tensors[i], qgz_world) : 0;
    // qgZ quantises the fp32 window itself, whatever the communication dtype
    const DType type = group > 0 ? DType::F32 : types.low(i) ? types.autocast : types.comm;
    out.push_back({tensors[i].offset, tensors[i].offset + tensors[i].numel, type, group});
  }
  if (n > layout.total()) out.push_back({layout.total(), n, types.comm});
  return out;
}

std::vector<std::pair<int64_t, int64_t>> trainable_ranges(const ParamLayout& layout, const StateTypes& types,
                                                          int64_t begin, int64_t end) {
  std::vector<std::pair<int64_t, int64_t>> out;
  const std::vector<TensorSpec>& tensors = layout.tensors();
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (types.frozen(i)) continue;
    const int64_t a = std::max(begin, tensors[i].offset), b = std::min(end, tensors[i].offset + tensors[i].numel);
    if (a >= b) continue;
    if (!out.empty() && out.back().second == a - begin) out.back().second = b - begin;  // adjacent tensors: one range
    else out.emplace_back(a - begin, b - begin);
  }
  return out;
}

std::vector<std::pair<int64_t, int64_t>> frozen_ranges(const ParamLayout& layout, const StateTypes& types) {
  std::vector<std::pair<int64_t, int64_t>> out;
  const std::vector<TensorSpec>& tensors = layout.tensors();
  for (size_t i = 0; i < tensors.size(); ++i)
    if (types.frozen(i)) out.emplace_back(tensors[i].offset, tensors[i].offset + tensors[i].numel);
  return out;
}

ReduceWork reduce_work(int stage, const ZeroConfig& zero, const StateTypes& types, const ParamLayout& layout,
                       const std::vector<ParamUnit>& units, const Partition& part, int64_t qgz_world) {
  ReduceWork w;
  if (stage >= 2) {  // each unit's fp32 window as backward completes them: the last unit first
    for (auto u = units.rbegin(); u != units.rend(); ++u) w.ranges.emplace_back(u->offset, u->offset + u->numel);
  } else if (stage == 1 || part.world > 1) {  // stage 1 reduce-scatters even on one rank
    w.ranges.emplace_back(0, stage == 0 ? layout.total() : part.padded);
    w.source = types.grad;
  }
  const int64_t n = stage == 0 ? layout.total() : part.padded;
  const std::vector<CommSegment> segments = gradient_segments(layout, n, types, qgz_world);
  for (const auto& [lo, hi] : w.ranges)  // as GradientReducer::reserve_staging cuts them
    for (const ReduceBucket& b : cut_buckets(segments, lo, hi, zero.reduce_bucket_size, types.comm)) w.buckets.push_back(b);
  for (const StagingBytes& s : slot_staging_bytes(w.buckets, w.source, stage >= 1, part, zero.overlap_comm))
    w.staging_bytes += s.send + s.recv;
  return w;
}

double unscale_clip_multiplier(double norm_scaled, double loss_scale, double clip) {
  double combined = loss_scale;
  if (clip > 0.0) {
    const double c = ((norm_scaled / loss_scale) + 1e-6) / clip;
    if (c > 1.0) combined = c * loss_scale;
  }
  return 1.0 / combined;
}

ZeroOptimizer::ZeroOptimizer(const ZeroConfig& zero, const OptimizerConfig& opt, StateTypes types,
                             const ParamLayout& layout, std::vector<ParamUnit> units, Communicator& dp,
                             int64_t partition_numel, bool ordered_backward, int global_rank, ShardGroups shards)
    : cfg_(zero), types_(types), mixed_(types.param != DType::F32 && zero.master_weights == DType::F32),
      master16_(types.param != DType::F32 && zero.master_weights != DType::F32),
      use_windows_(zero.stage >= 2 || types.grad != DType::F32), layout_(layout), units_(std::move(units)), dp_(dp),
      rank_(dp.rank()), world_(dp.size()), stage_(zero.stage),
      part_(partition_numel < 0 ? layout.total() : partition_numel, dp.size()) {
  ordered_backward_ = ordered_backward;
  shards_ = shards;
  const int64_t qgz_world = stage_ == 3 && shards_.qgz_intra ? world_ : 0;
  const ZeroStateElems elems = zero_state_elems(stage_, layout.total(), part_);
  const bool params_on_nvme = stage_ == 3 && zero.offload_param.device == OffloadDevice::Nvme;
  // Frozen parameters: the optimizer's view (the flat buffer, or this rank's partition) keeps
  // state for and updates the trainable ranges only; the fp32 master copy holds them packed as
  // the optimizer's states (the frozen elements live in the 16-bit parameters alone, as DeepSpeed's
  // fp32 partitions hold trainable parameters only).
  if (types_.any_frozen()) {
    const int64_t first = stage_ == 0 ? 0 : part_.begin(rank_);
    trainable_ = trainable_ranges(layout, types_, first, stage_ == 0 ? layout.total() : first + part_.part);
    frozen_ = frozen_ranges(layout, types_);
  }
  int64_t trainable_elems = elems.state;
  if (trainable_) {
    trainable_elems = 0;
    for (const auto& [a, b] : *trainable_) trainable_elems += b - a;
  }
  // zero_quantized_nontrainable_weights: the partition keeps the trainable elements alone, packed;
  // the frozen ones are int8 groups (quantized_frozen.hpp).
  quantized_frozen_ = stage_ == 3 && zero.quantized_nontrainable_weights && trainable_.has_value();
  // offload_param cpu: the partition lives in page-locked host memory, where a GPU build's kernels
  // (the gathers' copies, the step) read and write it in place, so it takes no device memory
  // (DeepSpeed keeps ds_tensor in pinned CPU memory, FACTS-2 §3).
  const bool params_on_host = stage_ == 3 && zero.offload_param.device == OffloadDevice::Cpu;
  params_ = TypedBuffer("params", types_.param, params_on_nvme ? 0 : quantized_frozen_ ? trainable_elems : elems.params,
                        /*zero=*/true, params_on_host ? BufferPlace::PinnedHost : BufferPlace::Model);
  if (quantized_frozen_) setup_quantized_frozen();
  if (params_on_nvme) {
    std::vector<std::pair<int64_t, int64_t>> slices;
    const int64_t pb = part_.begin(rank_);
    for (const ParamUnit& u : units_) {
      const auto [lo, hi] = part_.owned(rank_, u.offset, u.offset + u.numel);
      slices.emplace_back(std::max<int64_t>(lo - pb, 0), std::max<int64_t>(hi - pb, 0));
    }
    const std::string dtype = types_.param == DType::F32 ? "float32" : types_.param == DType::BF16 ? "bfloat16" : "float16";
    param_swap_ = std::make_unique<offload::ParamSwapper>(
        zero.offload_param, zero.aio, types_.param, std::move(slices),
        zero.offload_param.nvme_path + "/zero_stage_3/" + dtype + "params/rank" +
            std::to_string(global_rank < 0 ? rank_ : global_rank));
  }
  grads_ = TypedBuffer("grads", types_.grad, elems.grads);
  const bool offload = zero.offload_optimizer.device != OffloadDevice::None && stage_ >= 1;
  if (mixed_ && !offload) master_ = make_flat_buffer("master_params", trainable_elems);
  if (master16_ && (stage_ == 0 || types_.param != zero.master_weights))
    throw std::logic_error("bf16 master weights need ZeRO stage 1-3 and bf16 parameters");
  if (stage_ == 0) {
    optimizer_ = std::make_unique<Optimizer>(opt, layout_, zero.optimizer_states, &dp_, trainable_);
    reducer_ = std::make_unique<GradientReducer>(dp_, grads_.data(), types_.grad, layout.total(),
                                                 cfg_.reduce_bucket_size, cfg_.overlap_comm, types_.comm,
                                                 gradient_segments(layout, layout.total(), types_));
  } else {
    state_layout_ = partition_layout(part_.part);
    if (offload) {
      // DeepSpeed's folder for this rank's optimizer swap files (FACTS-2 §3.3)
      const std::string dir = zero.offload_optimizer.device != OffloadDevice::Nvme ? std::string()
                              : zero.offload_optimizer.nvme_path + "/zero_stage_" + std::to_string(stage_) +
                                    "/optimizer/rank" + std::to_string(global_rank < 0 ? rank_ : global_rank);
      offloaded_ = std::make_unique<offload::OffloadedOptimizer>(zero.offload_optimizer, zero.aio, opt, part_.part,
                                                                 zero.sub_group_size, mixed_, dir,
                                                                 zero.optimizer_states);
    } else {
      optimizer_ = std::make_unique<Optimizer>(opt, state_layout_, zero.optimizer_states, nullptr, trainable_);
    }
    // Stage 1 writes the averaged partition into the full gradient buffer; 2-3 accumulate
    // every micro-batch into the partition buffer.
    void* dest = stage_ == 1 ? grads_.at(part_.begin(rank_)) : grads_.data();
    reducer_ = std::make_unique<GradientReducer>(dp_, part_, dest, types_.grad, stage_ >= 2, cfg_.reduce_bucket_size,
                                                 cfg_.overlap_comm, types_.comm, types_.grad,
                                                 gradient_segments(layout, part_.padded, types_, qgz_world));
  }
  // it steps the packed master, or the packed parameters themselves
  if (optimizer_ && trainable_ && (mixed_ || quantized_frozen_)) optimizer_->set_params_packed(true);
  if (qgz_world > 0) {
    qgz_ = std::make_unique<QuantizedReduceScatter>(*shards_.qgz_intra, *shards_.qgz_inter);
    if (qgz_->data_rank() != rank_) throw std::logic_error("qgZ's groups do not rank the data group node by node");
    reducer_->set_quantized(qgz_.get());
    if (zero.loco.enabled) qgz_->enable_loco({static_cast<float>(zero.loco.err_beta), zero.loco.reset_T});
  }
  // The bucket slots, allocated now: the start-up table and the memory plan (reduce_work) count them.
  const ReduceWork work = reduce_work(stage_, cfg_, types_, layout, units_, part_, qgz_world);
  reducer_->reserve_staging(work.ranges, work.source);
  // MiCS: the mean over every replica's ranks, completed by the replicas' all-reduce (shard_groups.hpp)
  reducer_->set_scaling(reduce_scaling(zero.prescale_gradients, zero.gradient_predivide_factor,
                                       world_ * shards_.replica_count(), stage_ >= 1));
  if (stage_ == 3 && types_.autocast != DType::F32) {  // each unit's tensors and the dtype each is gathered in
    const std::vector<TensorSpec>& tensors = layout.tensors();
    for (const ParamUnit& u : units_) {
      std::vector<CommSegment> mine;
      bool mixed = false;
      for (size_t i = 0; i < tensors.size(); ++i) {
        const int64_t a = std::max(tensors[i].offset, u.offset), b = std::min(tensors[i].offset + tensors[i].numel, u.offset + u.numel);
        if (a >= b) continue;
        mine.push_back({a, b, types_.low(i) ? types_.autocast : types_.param});
        mixed = mixed || types_.low(i);
      }
      gather_segments_.push_back(std::move(mine));
      gather_mixed_.push_back(mixed);
    }
  }
  if (stage_ == 3) {
    persistent_ = persistent_units(cfg_, units_);  // they stay gathered
  }
  if (use_windows_) {  // gradient windows, allocated up front so the start-up table is complete
    const int last = static_cast<int>(units_.size()) - 1;
    // embeddings, ln_f and one block window; a second one lets overlap_comm reduce block l
    // while block l-1 computes
    for (int u : {0, last, 1, 2})
      if (u <= last && (u != 2 || cfg_.overlap_comm)) window_for(u);
  }
  if (stage_ == 3) {
    // The order in which one micro-batch of a one-stage model fetches units: forward
    // (embeddings, blocks, ln_f, tied head) then backward (tied head, ln_f, blocks in reverse).
    const int last = static_cast<int>(units_.size()) - 1;
    for (int u = 0; u <= last; ++u) trace_.push_back(u);
    trace_.push_back(0);
    trace_.push_back(0);
    backward_.assign(trace_.size() - 1, false);  // the tied head's second use is its backward
    for (int u = last; u >= 1; --u) trace_.push_back(u);
    backward_.resize(trace_.size(), true);
  }
  if (shards_.hpz) {
    secondary_.resize(units_.size());
    secondary_valid_.assign(units_.size(), false);
  }
}

void ZeroOptimizer::set_fetch_trace(std::vector<int> trace, std::vector<bool> backward) {
  drop_gathered_params();
  trace_ = std::move(trace);
  backward_ = std::move(backward);
  trace_pos_ = 0;
}

// --- parameters ----------------------------------------------------------------------------

void ZeroOptimizer::init_params(const std::function<void(float*, int64_t, int64_t)>& fill) {
  const int64_t total = layout_.total(), pb = part_.begin(rank_);
  const auto [lo, hi] = part_.owned(rank_, 0, total);
  if (quantized_frozen_) {
    load_quantized_partition(fill);
    return;
  }
  if (!mixed_ && !master16_) {
    if (stage_ < 3) {
      fill_model(params_.as<float>(), 0, total, fill);
    } else if (param_swap_) {
      std::vector<float> chunk;
      for (int64_t a = lo; a < hi; a += kInitFillElems) {
        const int64_t b = std::min(hi, a + kInitFillElems);
        chunk.resize(static_cast<size_t>(b - a));
        fill(chunk.data(), a, b);
        write_params(a - pb, b - a, chunk.data());
      }
    } else if (hi > lo) {
      fill_model(params_.as<float>(), lo, hi, fill);  // the partition buffer starts at part.begin(rank)
    }
    return;
  }
  if (offloaded_ || master16_) {
    // The master copy goes straight to its tier (bf16 master weights: none but the parameters),
    // a bounded chunk at a time.
    std::vector<float> chunk;
    for (int64_t a = lo; a < hi; a += kInitFillElems) {
      const int64_t b = std::min(hi, a + kInitFillElems);
      chunk.resize(static_cast<size_t>(b - a));
      fill(chunk.data(), a, b);
      if (mixed_) offloaded_->write("master", a - pb, b - a, chunk.data());
      cast_range_to_params(a - pb, b - a, chunk.data());
    }
  } else if (trainable_) {
    // Packed master: each chunk's values go to the 16-bit parameters whole, and their trainable
    // pieces to the master copy.
    const int64_t first = stage_ == 0 ? 0 : lo, last = stage_ == 0 ? total : hi, base = stage_ == 0 ? 0 : pb;
    std::vector<float> chunk;
    for (int64_t a = first; a < last; a += kInitFillElems) {
      const int64_t b = std::min(last, a + kInitFillElems);
      chunk.resize(static_cast<size_t>(b - a));
      fill(chunk.data(), a, b);
      const float* values = in_model_memory(chunk.data(), b - a, staging_);
      if (stage_ == 0) convert_any(params_.at(a), types_.param, values, DType::F32, b - a);
      else cast_range_to_params(a - pb, b - a, chunk.data());
      values = in_model_memory(chunk.data(), b - a, staging_);  // (cast_range_to_params reuses the scratch)
      packed_pieces(*trainable_, a - base, b - a, [&](int64_t x, int64_t packed, int64_t c) {
        convert_any(master_.data() + packed, DType::F32, values + (x - (a - base)), DType::F32, c);
      });
    }
  } else {
    if (stage_ == 0) fill_model(master_.data(), 0, total, fill);
    else if (hi > lo) fill_model(master_.data() + (lo - pb), lo, hi, fill);
    cast_master_to_params();
  }
  if (stage_ == 1 || stage_ == 2) {
    // The other ranks' ranges of the 16-bit copy, filled tensor group by tensor group so that
    // no full fp32 copy ever exists (and no collective is needed at start-up).
    std::vector<float> chunk;
    int64_t a = 0;
    for (const TensorSpec& t : layout_.tensors()) {
      const int64_t b = t.offset + t.numel;
      if (b - a < kInitFillElems && b < total) continue;
      chunk.resize(static_cast<size_t>(b - a));
      fill(chunk.data(), a, b);
      convert_any(params_.at(a), types_.param, in_model_memory(chunk.data(), b - a, staging_), DType::F32, b - a);
      a = b;
    }
  }
}

void ZeroOptimizer::cast_range_to_params(int64_t begin, int64_t n, const float* values) {
  const int64_t pb = part_.begin(rank_);
  const auto [lo, hi] = part_.owned(rank_, pb + begin, pb + begin + n);
  if (hi <= lo) return;
  if (param_swap_) {  // host values rounded by the host into the swap files
    std::vector<char> rounded(static_cast<size_t>(hi - lo) * dtype_size(types_.param));
    convert_on_host(rounded.data(), types_.param, values + (lo - pb - begin), DType::F32, hi - lo);
    write_params(lo - pb, hi - lo, rounded.data());
    return;
  }
  if (params_.place() == BufferPlace::PinnedHost) {  // offload_param cpu: host memory, rounded by the host
    convert_on_host(params_.at(lo - pb), types_.param, values + (lo - pb - begin), DType::F32, hi - lo);
    return;
  }
  convert_any(params_.at(stage_ == 3 ? lo - pb : lo), types_.param,
              in_model_memory(values + (lo - pb - begin), hi - lo, staging_), DType::F32, hi - lo);
}

void ZeroOptimizer::read_params(int64_t begin, int64_t n, void* out) {
  if (param_swap_) param_swap_->read(begin, n, out);
  else kernels::copy_to_host(out, params_.at(stage_ == 3 ? begin : part_.begin(rank_) + begin), n * dtype_size(types_.param));
}

void ZeroOptimizer::write_params(int64_t begin, int64_t n, const void* in) {
  if (param_swap_) param_swap_->write(begin, n, in);
  else kernels::copy_to_device(params_.at(stage_ == 3 ? begin : part_.begin(rank_) + begin), in, n * dtype_size(types_.param));
}

// The swapped partition's [begin, begin + n) into model memory at `model` (to_model), or back
// from it: in place on a CPU build; through a bounded host chunk where model memory is the device's.
void ZeroOptimizer::move_params_through_host(int64_t begin, int64_t n, void* model, bool to_model) {
  if (kernels::kHostIsDevice) return to_model ? read_params(begin, n, model) : write_params(begin, n, model);
  const size_t es = dtype_size(types_.param);
  std::vector<char> chunk;
  for (int64_t a = begin; a < begin + n; a += kInitFillElems) {
    const int64_t c = std::min(begin + n, a + kInitFillElems) - a;
    chunk.resize(static_cast<size_t>(c) * es);
    char* at = static_cast<char*>(model) + (a - begin) * static_cast<int64_t>(es);
    if (to_model) {
      read_params(a, c, chunk.data());
      kernels::copy_to_device(at, chunk.data(), chunk.size());
    } else {
      kernels::copy_to_host(chunk.data(), at, chunk.size());
      write_params(a, c, chunk.data());
    }
  }
}

void ZeroOptimizer::cast_master_to_params() {
  if (offloaded_) {
    const int64_t pb = part_.begin(rank_);
    const auto [lo, hi] = part_.owned(rank_, 0, layout_.total());
    std::vector<float> chunk;
    for (int64_t a = lo; a < hi; a += kInitFillElems) {
      const int64_t b = std::min(hi, a + kInitFillElems);
      chunk.resize(static_cast<size_t>(b - a));
      offloaded_->read("master", a - pb, b - a, chunk.data());
      cast_range_to_params(a - pb, b - a, chunk.data());
    }
    return;
  }
  if (param_swap_ && stage_ > 0) {  // the 16-bit partition lies in its swap files: written back a bounded chunk at a time
    const int64_t pb = part_.begin(rank_);
    const auto [lo, hi] = part_.owned(rank_, 0, layout_.total());
    kernels::HostBuffer master_chunk;  // the master's chunk for the host (a GPU build)
    for (int64_t a = lo; a < hi; a += kInitFillElems) {
      const int64_t c = std::min(hi, a + kInitFillElems) - a;
      const auto* values = reinterpret_cast<const float*>(
          kernels::host_view_of(master_chunk, master_.data() + (a - pb), static_cast<size_t>(c) * sizeof(float)));
      cast_range_to_params(a - pb, c, values);
    }
    return;
  }
  if (quantized_frozen_) {  // the parameters are packed as the master is
    convert_any(params_.data(), types_.param, master_.data(), DType::F32, params_.size());
    return;
  }
  if (trainable_) {  // packed master: its pieces to their places in the view (owned part only)
    const int64_t pb = stage_ == 0 ? 0 : part_.begin(rank_);
    const auto [lo, hi] = stage_ == 0 ? std::make_pair<int64_t, int64_t>(0, layout_.total()) : part_.owned(rank_, 0, layout_.total());
    if (hi <= lo) return;
    packed_pieces(*trainable_, lo - pb, hi - lo, [&](int64_t x, int64_t packed, int64_t c) {
      convert_any(params_.at(stage_ == 3 ? x : pb + x), types_.param, master_.data() + packed, DType::F32, c);
    });
    return;
  }
  const MasterCast c = master_cast();
  if (c.count > 0) convert_any(c.params.data, c.params.type, master_.data() + c.master_offset, DType::F32, c.count);
}

// Where the fp32 master's elements go in the in-memory 16-bit parameters: all of them at stage
// 0, this rank's owned range of its partition otherwise.
ZeroOptimizer::MasterCast ZeroOptimizer::master_cast() {
  if (stage_ == 0) return {{params_.data(), types_.param}, 0, layout_.total()};
  const int64_t pb = part_.begin(rank_);
  const auto [lo, hi] = part_.owned(rank_, 0, layout_.total());
  return {{params_.at(stage_ == 3 ? lo - pb : lo), types_.param}, lo - pb, std::max<int64_t>(0, hi - lo)};
}

// --- gradients -----------------------------------------------------------------------------

// Blocks alternate between two windows with overlap_comm, else share one.
int ZeroOptimizer::window_key(int u) const {
  const int last = static_cast<int>(units_.size()) - 1;
  return u == 0 ? kEmbedWindow : u == last ? kLastWindow : cfg_.overlap_comm ? u % 2 : 1;
}

float* ZeroOptimizer::window_for(int u) {
  const int last = static_cast<int>(units_.size()) - 1;
  const int key = window_key(u);
  auto it = windows_.find(key);
  if (it == windows_.end()) {
    int64_t size = units_[u].numel;
    if (key == 0 || key == 1)  // block windows are shared by every block
      for (int b = 1; b < last; ++b) size = std::max(size, units_[b].numel);
    it = windows_.emplace(key, make_flat_buffer("grad_window", size)).first;
  }
  if (stage_ >= 2) reducer_->wait_tag(key);  // the window's previous reduction must be done before reuse
  Kokkos::deep_copy(Kokkos::subview(it->second, std::make_pair(int64_t(0), units_[u].numel)), 0.0f);
  return it->second.data();
}

float* ZeroOptimizer::grad_target(int u) {
  if (!use_windows_) return grads_.as<float>() + units_[u].offset;
  return window_for(u);
}

void ZeroOptimizer::grads_done(int u) {
  if (stage_ < 2) {
    if (use_windows_)  // round the unit's fp32 gradients into the accumulation buffer
      convert_any(grads_.at(units_[u].offset), types_.grad, windows_.at(window_key(u)).data(), DType::F32,
                  units_[u].numel, 1.0f, /*accumulate=*/true);
    if (boundary_ && world_ > 1 && ordered_backward_ && reduces_gradients()) reducer_->grads_ready(units_[u].offset);
    return;
  }
  const int key = window_key(u);
  const ParamUnit& unit = units_[u];
  reducer_->reduce_range(windows_.at(key).data(), unit.offset, unit.offset + unit.numel, key);
  if (u == 0) reducer_->wait_all();  // the backward pass is over: windows free again, staging back in its pool
}

void ZeroOptimizer::progress() {
  if (stage_ >= 2 || (reduction_begun_ && world_ > 1)) reducer_->progress();
  for (auto& [u, g] : gathered_)
    if (g.pending) g.pending->test();
}

void ZeroOptimizer::begin_micro_step(bool boundary) {
  boundary_ = boundary;
  if (stage_ >= 2) reducer_->begin_pass();  // the same slot for the same bucket in every backward
  if (stage_ < 2 && boundary && world_ > 1 && ordered_backward_ && !reduction_begun_ && reduces_gradients()) {
    reducer_->begin(grads_.data());
    reduction_begun_ = true;
  }
}

void ZeroOptimizer::finish_reduction() {
  if (stage_ < 2) {
    // Stage 1 reduce-scatters even on one rank: its optimizer reads the partition written here.
    if ((world_ > 1 || stage_ == 1) && reduces_gradients()) {
      if (!reduction_begun_) reducer_->begin(grads_.data());
      reducer_->finish();
    }
    reduction_begun_ = false;
  } else {
    reducer_->wait_all();
    if (shards_.replicas && reduces_gradients()) reduce_over_replicas();
  }
}

// --- the step ------------------------------------------------------------------------------

void ZeroOptimizer::gather_updated_params() {
  std::vector<std::unique_ptr<CommRequest>> inflight;
  const int64_t bucket = std::max<int64_t>(2 * world_, cfg_.allgather_bucket_size);
  for (int64_t a = 0; a < part_.padded; a += bucket) {
    const int64_t b = std::min(part_.padded, a + bucket);
    std::vector<int64_t> counts(world_), displs(world_);
    for (int r = 0; r < world_; ++r) {
      const auto [lo, hi] = part_.owned(r, a, b);
      counts[r] = hi - lo;
      displs[r] = lo - a;
    }
    inflight.push_back(dp_.all_gather_v_async(params_.at(a), counts, displs, types_.param));
  }
  for (auto& r : inflight) r->wait();
}

GradStats ZeroOptimizer::grad_stats(Communicator* sq_group, const std::vector<std::pair<int64_t, int64_t>>& skip) {
  // The held gradients cover local [first, first + n): the whole buffer (stage 0) or the partition.
  const int64_t first = stage_ == 0 ? 0 : part_.begin(rank_);
  const int64_t n = stage_ == 0 ? layout_.total() : std::max<int64_t>(0, std::min(part_.part, layout_.total() - first));
  const char* g = static_cast<const char*>(grad_partition());
  const size_t es = dtype_size(types_.grad);
  // Frozen tensors have no gradient (requires_grad=False): left out of the norm with `skip`.
  std::vector<std::pair<int64_t, int64_t>> left_out = skip;
  if (!frozen_.empty()) {
    left_out.insert(left_out.end(), frozen_.begin(), frozen_.end());
    std::sort(left_out.begin(), left_out.end());
  }
  double sq = 0.0;
  int64_t at = 0;  // sum the pieces between the skipped ranges (overlapping ones merge: `at` only grows)
  for (const auto& [b, e] : left_out) {
    const int64_t lo = std::clamp(b - first, at, n), hi = std::clamp(e - first, lo, n);
    sq += sum_of_squares_any(g + at * es, types_.grad, lo - at);
    at = hi;
  }
  sq += sum_of_squares_any(g + at * es, types_.grad, n - at);
  // Stage 0 gradients are already identical on every rank; partitions need the sum over the
  // group. inf/NaN survive the sum, so the result is also the group's agreed overflow flag.
  if (stage_ > 0) dp_.all_reduce(&sq, 1, DType::F64, ReduceOp::Sum);
  // A 1-bit optimizer past its freeze holds local gradients, and clips them by their local norm
  // as DeepSpeed's engine does (no data-parallel all-reduce of the gradients or their norm);
  // but a step skipped on overflow must be skipped by every rank, or the compressed all-reduce
  // of the others would wait for it: the ranks agree on the flag (8 bytes).
  if (!reduces_gradients() && world_ > 1) {
    int64_t overflow = std::isfinite(sq) ? 0 : 1;
    dp_.all_reduce(&overflow, 1, DType::I64, ReduceOp::Max);
    if (overflow && std::isfinite(sq)) sq = std::numeric_limits<double>::infinity();
  }
  if (sq_group && sq_group->size() > 1) sq_group->all_reduce(&sq, 1, DType::F64, ReduceOp::Sum);
  return GradStats{std::sqrt(sq), std::isfinite(sq)};
}

void ZeroOptimizer::sum_grad_range(int64_t begin, int64_t end, Communicator& group) {
  if (group.size() <= 1) return;
  if (stage_ == 0) {
    group.all_reduce(grads_.at(begin), end - begin, types_.grad, ReduceOp::Sum);
    return;
  }
  const auto [lo, hi] = part_.owned(rank_, begin, end);
  if (hi <= lo) return;
  // stage 1 keeps the full buffer (its partition region holds the reduced values); 2-3 the partition
  group.all_reduce(grads_.at(stage_ == 1 ? lo : lo - part_.begin(rank_)), hi - lo, types_.grad, ReduceOp::Sum);
}

void ZeroOptimizer::apply_step(double lr, std::optional<std::pair<double, double>> betas, double clip,
                               double loss_scale, const GradStats& stats) {
  const float mul = static_cast<float>(unscale_clip_multiplier(stats.norm_scaled, loss_scale, clip));
  ckpt_staging_.clear();
  if (offloaded_) {
    offload::ParamAccess params;
    const int64_t own = stage_ == 3 ? 0 : part_.begin(rank_);  // the partition's first element in params_
    params.acquire = [&](int64_t begin, int64_t n) -> TypedSpan {
      if (mixed_) return {};
      if (!param_swap_) return {params_.at(own + begin), types_.param};
      // One sub-group's parameters read from their swap files into page-locked memory, which the
      // CPU optimizer and (a sub-group kept in device memory) the device's kernels both update in place.
      char* at = swap_step_stage_.grow(static_cast<size_t>(n) * dtype_size(types_.param));
      read_params(begin, n, at);
      return {at, types_.param};
    };
    params.release = [&](int64_t begin, int64_t n, TypedSpan updated) {
      if (mixed_) cast_range_to_params(begin, n, static_cast<const float*>(updated.data));
      else if (param_swap_) write_params(begin, n, updated.data);
    };
    // The CPU optimizer updates a partition in host memory (swap files' staging, or offload_param
    // cpu's page-locked partition) in place; one in model memory travels to the host and back.
    params.in_model_memory = !param_swap_ && params_.place() == BufferPlace::Model;
    offloaded_->step(params, grad_partition(), types_.grad, mul, lr, betas);
    if (stage_ == 1 || stage_ == 2) gather_updated_params();
    drop_gathered_params();
    return;
  }
  if (param_swap_ && !mixed_) {
    // The parameters are the optimizer's (fp32, or bf16 master weights) and lie in swap files:
    // read into memory for the step, updated, written back (DeepSpeed likewise keeps the
    // partition it updates in device memory while the parameters live on NVMe, FACTS-2 §3).
    TypedBuffer staged("params_step", types_.param, part_.part, /*zero=*/false);
    move_params_through_host(0, part_.part, staged.data(), /*to_model=*/true);
    optimizer_->step(TypedSpan{staged.data(), types_.param}, grad_partition(), types_.grad, mul, lr, betas);
    move_params_through_host(0, part_.part, staged.data(), /*to_model=*/false);
    drop_gathered_params();
    return;
  }
  // The fp32 master copy, or the parameters themselves (fp32, or bf16 master weights).
  const TypedSpan p = mixed_ ? TypedSpan{master_.data(), DType::F32}
                             : TypedSpan{params_.at(stage_ == 1 || stage_ == 2 ? part_.begin(rank_) : 0), types_.param};
  // fp32 master weights: the model's 16-bit copy is cast in the optimizer's own pass (chunk by
  // chunk in cache) where it lies in memory; with its partition in swap files, afterwards.
  MasterCast cast;
  if (mixed_ && !param_swap_ && !trainable_) cast = master_cast();  // packed master: cast after the step
  const bool fused = cast.params.data && cast.master_offset == 0;  // the step's chunks start at the master's first element
  optimizer_->step(p, grad_partition(), types_.grad, mul, lr, betas, fused ? cast.params : TypedSpan{},
                   fused ? cast.count : 0);
  if (mixed_ && !fused) cast_master_to_params();
  if (stage_ == 1 || stage_ == 2) gather_updated_params();
  drop_gathered_params();
}

void ZeroOptimizer::skip_step() { drop_gathered_params(); }

void ZeroOptimizer::loss_scale_changed(bool overflow, double ratio) {
  if (qgz_ && qgz_->loco()) qgz_->loss_scale_changed(overflow, ratio);
}

// At stage 3 the gathered copies go either way at the end of a step (after an update they are
// stale) and the next micro-batch replays the trace from its start.
void ZeroOptimizer::drop_gathered_params() {
  if (stage_ == 3) {
    while (!gathered_.empty()) free_gathered(gathered_.begin()->first);
    trace_pos_ = 0;
    secondary_valid_.assign(secondary_valid_.size(), false);  // hpZ: the next step gathers afresh
  }
}

void ZeroOptimizer::zero_grad() {
  zero_any(grads_.data(), grads_.type(), grads_.size());
  trace_pos_ = 0;  // a step replays the fetch trace from its start
}

MemoryBytes ZeroOptimizer::memory() const {
  MemoryBytes m;
  m.params = params_.bytes() + frozen_store_.bytes();  // quantized frozen pieces: their int8 store
  m.grads = grads_.bytes();
  m.master = static_cast<int64_t>(master_.extent(0) * sizeof(float));  // 0 in fp32: the parameters are the master
  if (offloaded_) {
    const offload::TierBytes t = offloaded_->bytes();
    m.master = t.master;  // the fp32 master copy in memory (0 when swapped out, or without one)
    m.optimizer_states = t.moments;
    m.host = t.host;
    m.nvme = t.nvme;
    m.swap_buffers = t.swap_buffers;
    if (param_swap_) {
      m.nvme += param_swap_->nvme_bytes();
      m.swap_buffers += param_swap_->cached_peak_bytes();
    }
  } else {
    m.optimizer_states = optimizer_->state_bytes();
    if (param_swap_) {  // parameters on NVMe with the optimizer in memory
      m.nvme = param_swap_->nvme_bytes();
      m.swap_buffers = param_swap_->cached_peak_bytes();
    }
  }
  if (params_.place() == BufferPlace::PinnedHost) m.host += m.params;  // offload_param cpu, with or without the optimizer
  m.comm_buffers = reducer_->staging_peak_bytes() + (qgz_ ? qgz_->staging_bytes() + qgz_->loco_bytes() : 0);
  for (const auto& [key, w] : windows_) m.comm_buffers += static_cast<int64_t>(w.extent(0) * sizeof(float));
  m.live_params_peak = live_peak_elems_ * static_cast<int64_t>(dtype_size(types_.param));
  // The gather buffers, and the staging their packed gathers take (qwZ, autocast, MiCS
  // hierarchical): the pool's peak, in use and kept for reuse (simulate_gather_staging plans it).
  m.gathered = gathered_bytes_ + gather_staging_.peak_bytes();
  for (const TypedBuffer& b : secondary_) m.secondary += b.bytes();
  return m;
}

std::string ZeroOptimizer::offload_summary() const {
  const ZeroConfig& z = cfg_;
  const bool params_on_host = params_.place() == BufferPlace::PinnedHost;
  const std::string same_memory =
      kernels::kHostIsDevice ? "; CPU-only build: host and device memory are the same memory" : "";
  // where the parameter partition lies (offload_param), for either optimizer placement
  const std::string params_at =
      params_on_host ? "parameter partition in " + std::string(kernels::kHostIsDevice ? "" : "page-locked ") +
                           "host memory: " + std::to_string(params_.bytes()) + " bytes"
      : param_swap_  ? "parameter partition on nvme: " + std::to_string(param_swap_->nvme_bytes()) + " bytes, " +
                          std::to_string(z.offload_param.buffer_count) + " reads ahead, at most " +
                          std::to_string(z.offload_param.max_in_cpu) + " elements cached"
                     : "";
  if (!offloaded_ && params_at.empty()) return "";
  if (!offloaded_)
    return params_at + "; optimizer state in device memory" +
           (param_swap_ ? ", the step reads the partition, updates it and writes it back" : "") + same_memory;
  const bool nvme = z.offload_optimizer.device == OffloadDevice::Nvme;
  const offload::TierBytes t = offloaded_->bytes();
  std::string names;
  for (const std::string& n : offloaded_->state_names()) names += (names.empty() ? "" : ", ") + (n == "master" ? "fp32 master" : n);
  std::string s = "optimizer state (" + names + ") on " +
                  (nvme ? "nvme" : "cpu") + ": " + std::to_string(offloaded_->sub_groups()) + " sub-group" +
                  (offloaded_->sub_groups() == 1 ? "" : "s") + " of <= " + std::to_string(z.sub_group_size) +
                  " elements, " + std::to_string(offloaded_->resident_sub_groups()) + " kept in device memory (ratio " +
                  std::to_string(z.offload_optimizer.ratio).substr(0, 4) + "); bytes per rank: device " +
                  std::to_string(t.device) + ", host " + std::to_string(t.host) + ", nvme " + std::to_string(t.nvme);
  if (nvme)
    s += ", swap buffers " + std::to_string(t.swap_buffers) + " (" + std::to_string(offloaded_->sub_groups_in_flight()) +
         " sub-group" + (offloaded_->sub_groups_in_flight() == 1 ? "" : "s") + " in flight); " +
         (offloaded_->direct_io() ? "O_DIRECT io_uring"
                                  : "io_uring through the page cache (the file system refuses O_DIRECT)") +
         ", block " + std::to_string(z.aio.block_size) + " B, queue depth " + std::to_string(z.aio.queue_depth) + " x " +
         std::to_string(z.aio.intra_op_parallelism) + " thread" + (z.aio.intra_op_parallelism == 1 ? "" : "s");
  if (!params_at.empty()) s += "; " + params_at;
  return s + same_memory;
}

offload::IoStats ZeroOptimizer::take_swap_stats() {
  offload::IoStats s = offloaded_ ? offloaded_->take_io_stats() : offload::IoStats{};
  if (param_swap_) {
    const offload::IoStats p = param_swap_->take_io_stats();
    s.read_bytes += p.read_bytes;
    s.write_bytes += p.write_bytes;
    s.read_s += p.read_s;
    s.write_s += p.write_s;
  }
  return s;
}

}  // namespace zero3d

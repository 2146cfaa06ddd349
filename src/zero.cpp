// zero.cpp — see zero.hpp for the stage table.
#include "zero.hpp"

#include <algorithm>
#include <cmath>

#include "base.hpp"
#include "reduce.hpp"

namespace zero3d {

namespace {
constexpr int kEmbedWindow = -1, kLastWindow = -2;  // window keys besides the two block windows 0/1

ParamLayout partition_layout(int64_t part) {
  ParamLayout l;
  l.add("partition", {part});
  return l;
}
}  // namespace

ZeroOptimizer::ZeroOptimizer(const ZeroConfig& zero, const OptimizerConfig& opt, const ParamLayout& layout,
                             std::vector<ParamUnit> units, Communicator& dp)
    : cfg_(zero), layout_(layout), units_(std::move(units)), dp_(dp), rank_(dp.rank()), world_(dp.size()),
      stage_(zero.stage), part_(layout.total(), dp.size()) {
  const int64_t full = stage_ == 0 ? layout.total() : part_.padded;
  params_ = make_flat_buffer("params", stage_ == 3 ? part_.part : full);
  grads_ = make_flat_buffer("grads", stage_ >= 2 ? part_.part : full);
  if (stage_ == 0) {
    optimizer_ = std::make_unique<Optimizer>(opt, layout_);
    reducer_ = std::make_unique<GradientReducer>(dp_, grads_.data(), layout.total(), cfg_.reduce_bucket_size,
                                                 cfg_.overlap_comm);
  } else {
    state_layout_ = partition_layout(part_.part);
    optimizer_ = std::make_unique<Optimizer>(opt, state_layout_);
    // Stage 1 writes the averaged partition into the full gradient buffer; 2-3 accumulate
    // every micro-batch into the partition buffer.
    float* dest = stage_ == 1 ? grads_.data() + part_.begin(rank_) : grads_.data();
    reducer_ = std::make_unique<GradientReducer>(dp_, part_, dest, stage_ >= 2, cfg_.reduce_bucket_size,
                                                 cfg_.overlap_comm);
  }
  if (stage_ == 3) {
    // Persistent units stay gathered (DeepSpeed: numel <= param_persistence_threshold while
    // the persistent total stays within model_persistence_threshold; here per unit).
    int64_t persistent_total = 0;
    for (const ParamUnit& u : units_) {
      const bool keep = u.numel <= cfg_.param_persistence_threshold &&
                        persistent_total + u.numel <= cfg_.model_persistence_threshold;
      if (keep) persistent_total += u.numel;
      persistent_.push_back(keep);
    }
  }
  if (stage_ >= 2) {  // gradient windows, allocated up front so the start-up table is complete
    const int last = static_cast<int>(units_.size()) - 1;
    // embeddings, ln_f and one block window; a second one lets overlap_comm reduce block l
    // while block l-1 computes
    for (int u : {0, last, 1, 2})
      if (u <= last && (u != 2 || cfg_.overlap_comm)) window_for(u);
  }
  if (stage_ == 3) {
    // The order in which one micro-batch fetches units: forward (embeddings, blocks, ln_f,
    // tied head) then backward (tied head, ln_f, blocks in reverse).
    const int last = static_cast<int>(units_.size()) - 1;
    for (int u = 0; u <= last; ++u) trace_.push_back(u);
    trace_.push_back(0);
    trace_.push_back(0);
    for (int u = last; u >= 1; --u) trace_.push_back(u);
  }
}

// --- parameters ----------------------------------------------------------------------------

void ZeroOptimizer::start_gather(int u) {
  const ParamUnit& unit = units_[u];
  Gathered g;
  g.buffer = make_scratch_buffer("gathered_unit", unit.numel);
  std::vector<int64_t> counts(world_), displs(world_);
  for (int r = 0; r < world_; ++r) {
    const auto [lo, hi] = part_.owned(r, unit.offset, unit.offset + unit.numel);
    counts[r] = hi - lo;
    displs[r] = lo - unit.offset;
  }
  const auto [lo, hi] = part_.owned(rank_, unit.offset, unit.offset + unit.numel);
  float* dst = g.buffer.data() + (lo - unit.offset);
  const float* src = params_.data() + (lo - part_.begin(rank_));
  Kokkos::parallel_for("gather_own_part", kernels::range(hi - lo), KOKKOS_LAMBDA(kernels::Index i) { dst[i] = src[i]; });
  g.pending = dp_.all_gather_v_async(g.buffer.data(), counts, displs, DType::F32);
  live_elems_ += unit.numel;
  live_peak_elems_ = std::max(live_peak_elems_, live_elems_);
  gathered_[u] = std::move(g);
}

void ZeroOptimizer::free_gathered(int u) {
  auto it = gathered_.find(u);
  if (it == gathered_.end()) return;
  if (it->second.pending) it->second.pending->wait();
  live_elems_ -= units_[u].numel;
  gathered_.erase(it);
}

const float* ZeroOptimizer::fetch(int u) {
  if (stage_ < 3) return params_.data() + units_[u].offset;
  // Where are we in the trace? Normally exactly at u; otherwise its next occurrence.
  size_t k = trace_pos_;
  while (k < trace_.size() && trace_[k] != u) ++k;
  if (k == trace_.size()) k = std::find(trace_.begin(), trace_.end(), u) - trace_.begin();
  trace_pos_ = k;
  if (!gathered_.count(u)) {
    // Make room: drop kept (non-persistent) units before exceeding max_live_parameters.
    for (auto it = gathered_.begin(); it != gathered_.end() && live_elems_ + units_[u].numel > cfg_.max_live_parameters;) {
      const int v = (it++)->first;
      if (!persistent_[v] && !gathered_[v].pending) free_gathered(v);
    }
    start_gather(u);
  }
  Gathered& g = gathered_[u];
  if (g.pending) {
    g.pending->wait();
    g.pending.reset();
  }
  // Prefetch what the trace needs next, within min(free live budget, prefetch_bucket_size).
  int64_t budget = std::min(cfg_.max_live_parameters - live_elems_, cfg_.prefetch_bucket_size);
  for (size_t k = trace_pos_ + 1; k < trace_.size() && budget > 0; ++k) {
    const int next = trace_[k];
    if (gathered_.count(next)) continue;
    if (units_[next].numel > budget) break;
    start_gather(next);
    budget -= units_[next].numel;
  }
  return g.buffer.data();
}

bool ZeroOptimizer::keep_after_use(int u) const {
  if (persistent_[u]) return true;
  if (live_elems_ > cfg_.max_live_parameters) return false;
  // Used again within max_reuse_distance parameter elements of the trace? (DeepSpeed's rule)
  int64_t distance = 0;
  for (size_t k = trace_pos_ + 1; k < trace_.size(); ++k) {
    if (trace_[k] == u) return true;
    distance += units_[trace_[k]].numel;
    if (distance > cfg_.max_reuse_distance) return false;
  }
  return false;
}

void ZeroOptimizer::release(int u) {
  if (stage_ < 3) return;
  if (!keep_after_use(u)) free_gathered(u);
  ++trace_pos_;
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
  reducer_->wait_tag(key);  // the window's previous reduction must be done before reuse
  Kokkos::deep_copy(Kokkos::subview(it->second, std::make_pair(int64_t(0), units_[u].numel)), 0.0f);
  return it->second.data();
}

float* ZeroOptimizer::grad_target(int u) {
  if (stage_ < 2) return grads_.data() + units_[u].offset;
  return window_for(u);
}

void ZeroOptimizer::grads_done(int u) {
  if (stage_ < 2) {
    if (boundary_ && world_ > 1) reducer_->grads_ready(units_[u].offset);
    return;
  }
  const int key = window_key(u);
  const ParamUnit& unit = units_[u];
  reducer_->reduce_range(windows_.at(key).data(), unit.offset, unit.offset + unit.numel, key);
  if (u == 0) reducer_->wait_all();  // the backward pass is over: windows and staging free again
}

void ZeroOptimizer::progress() {
  if (stage_ >= 2 || (boundary_ && world_ > 1)) reducer_->progress();
  for (auto& [u, g] : gathered_)
    if (g.pending) g.pending->test();
}

void ZeroOptimizer::begin_micro_step(bool boundary) {
  boundary_ = boundary;
  trace_pos_ = 0;  // each micro-batch replays the same fetch order
  if (stage_ < 2 && boundary && world_ > 1) reducer_->begin(grads_.data());
}

void ZeroOptimizer::finish_reduction() {
  if (stage_ < 2) {
    // Stage 1 reduce-scatters even on one rank: its optimizer reads the partition written here.
    if (world_ > 1 || stage_ == 1) {
      if (world_ == 1) reducer_->begin(grads_.data());
      reducer_->finish();
    }
  } else {
    reducer_->wait_all();
  }
}

// --- the step ------------------------------------------------------------------------------

double ZeroOptimizer::partition_sum_of_squares() const {
  const float* g = stage_ == 1 ? grads_.data() + part_.begin(rank_) : grads_.data();
  return kernels::sum_of_squares(g, part_.part);
}

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
    inflight.push_back(dp_.all_gather_v_async(params_.data() + a, counts, displs, DType::F32));
  }
  for (auto& r : inflight) r->wait();
}

double ZeroOptimizer::step(double lr, std::optional<std::pair<double, double>> betas, double clip) {
  float* p = stage_ == 1 || stage_ == 2 ? params_.data() + part_.begin(rank_) : params_.data();
  float* g = stage_ == 1 ? grads_.data() + part_.begin(rank_) : grads_.data();
  const int64_t n = stage_ == 0 ? layout_.total() : part_.part;
  double sq = stage_ == 0 ? kernels::sum_of_squares(g, n) : partition_sum_of_squares();
  if (stage_ > 0) dp_.all_reduce(&sq, 1, DType::F64, ReduceOp::Sum);  // norm over all partitions
  const double norm = std::sqrt(sq);
  // Global-norm clipping of the averaged gradient, each rank scaling its own part.
  const double coef = clip_coefficient(norm, clip);
  if (coef < 1.0) kernels::scale_in_place(g, n, static_cast<float>(coef));
  optimizer_->step(p, g, lr, betas);
  if (stage_ == 1 || stage_ == 2) gather_updated_params();
  if (stage_ == 3) {  // every gathered copy is stale now
    while (!gathered_.empty()) free_gathered(gathered_.begin()->first);
    trace_pos_ = 0;
  }
  return norm;
}

void ZeroOptimizer::zero_grad() { Kokkos::deep_copy(grads_, 0.0f); }

std::vector<float> ZeroOptimizer::gather_full_params() {
  std::vector<float> full(static_cast<size_t>(part_.padded), 0.0f);
  if (stage_ < 3) {
    std::copy_n(params_.data(), layout_.total(), full.begin());
  } else {
    std::copy_n(params_.data(), part_.part, full.begin() + part_.begin(rank_));
    std::vector<int64_t> counts(world_, part_.part), displs(world_);
    for (int r = 0; r < world_; ++r) displs[r] = part_.begin(r);
    dp_.all_gather_v_async(full.data(), counts, displs, DType::F32)->wait();
  }
  full.resize(static_cast<size_t>(layout_.total()));
  return full;
}

std::vector<std::string> ZeroOptimizer::checkpoint_states() const {
  std::vector<std::string> names = {"params"};
  for (const auto& n : optimizer_->state_names()) names.push_back(n);
  return names;
}

// Stage 0 holds full moments (index = flat offset); stages 1-3 hold partitions (index 0 =
// part.begin(rank)). Parameters are full except at stage 3.
ShardSlice ZeroOptimizer::checkpoint_slice() {
  const auto [b, e] = part_.owned(rank_, 0, layout_.total());
  ShardSlice s;
  s.begin = b;
  s.end = e;
  const int64_t pb = part_.begin(rank_);
  s.arrays.emplace_back("params", params_.data() + (stage_ == 3 ? b - pb : b));
  const auto names = optimizer_->state_names();
  const auto buffers = optimizer_->state_buffers();
  for (size_t k = 0; k < names.size(); ++k)
    s.arrays.emplace_back(names[k], buffers[k]->data() + (stage_ == 0 ? b : b - pb));
  return s;
}

void ZeroOptimizer::read_checkpoint(const CheckpointReader& reader) {
  const auto [b, e] = part_.owned(rank_, 0, layout_.total());
  const int64_t pb = part_.begin(rank_);
  reader.read_range("params", b, e, params_.data() + (stage_ == 3 ? b - pb : b));
  const auto names = optimizer_->state_names();
  const auto buffers = optimizer_->state_buffers();
  for (size_t k = 0; k < names.size(); ++k)
    reader.read_range(names[k], b, e, buffers[k]->data() + (stage_ == 0 ? b : b - pb));
  optimizer_->set_step_count(reader.meta().optimizer_step);
}

void ZeroOptimizer::all_gather_replicated(float* full) {
  std::vector<int64_t> counts(world_), displs(world_);
  for (int r = 0; r < world_; ++r) {
    const auto [lo, hi] = part_.owned(r, 0, layout_.total());
    counts[r] = hi - lo;
    displs[r] = lo;
  }
  dp_.all_gather_v_async(full, counts, displs, DType::F32)->wait();
}

void ZeroOptimizer::finish_checkpoint_load() {
  if (stage_ < 3) all_gather_replicated(params_.data());
  if (stage_ == 0)
    for (FlatBuffer* m : optimizer_->state_buffers()) all_gather_replicated(m->data());
  dp_.reset_bus_bytes();
}

MemoryBytes ZeroOptimizer::memory() const {
  MemoryBytes m;
  m.params = static_cast<int64_t>(params_.extent(0) * sizeof(float));
  m.grads = static_cast<int64_t>(grads_.extent(0) * sizeof(float));
  m.master = 0;  // fp32 training: the parameters are the master copy
  m.optimizer_states = optimizer_->state_bytes();
  m.comm_buffers = reducer_->staging_peak_bytes();
  for (const auto& [key, w] : windows_) m.comm_buffers += static_cast<int64_t>(w.extent(0) * sizeof(float));
  m.live_params_peak = live_peak_elems_ * static_cast<int64_t>(sizeof(float));
  return m;
}

}  // namespace zero3d

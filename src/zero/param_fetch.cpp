// param_fetch.cpp — ZeRO-3's parameter path (see zero.hpp): which units stay gathered
// (persistence, max_live_parameters, max_reuse_distance), the gathers along the fetch trace with
// their prefetch, and the same decisions simulated on unit sizes for the estimator.
#include <algorithm>
#include <map>
#include <set>
#include <utility>

#include "zero/zero.hpp"

namespace zero3d {

std::vector<bool> persistent_units(const ZeroConfig& zero, const std::vector<ParamUnit>& units) {
  std::vector<bool> out;
  int64_t persistent_total = 0;
  for (const ParamUnit& u : units) {
    const bool keep = u.numel <= zero.param_persistence_threshold &&
                      persistent_total + u.numel <= zero.model_persistence_threshold;
    if (keep) persistent_total += u.numel;
    out.push_back(keep);
  }
  return out;
}

// The decisions of ZeroOptimizer::fetch, keep_after_use and release, on unit sizes alone.
GatherElems simulate_gathers(const ZeroConfig& zero, const std::vector<ParamUnit>& units, const std::vector<int>& trace,
                             const GatherEvents* events) {
  const std::vector<bool> persistent = persistent_units(zero, units);
  std::map<int, bool> live;          // gathered unit -> still a pending prefetch
  std::multiset<int64_t> spares;     // sizes of freed buffers
  GatherElems out;
  int64_t live_elems = 0, prefetched = 0;
  const auto numel = [&](int u) { return units[static_cast<size_t>(u)].numel; };
  int step = 0;
  const auto gather = [&](int u, bool prefetch, size_t k) {
    if (step == 1) out.gathers.emplace_back(u, k);
    if (events) events->start(u, k);
    const auto spare = spares.find(numel(u));
    if (spare != spares.end()) spares.erase(spare);
    else out.allocated += numel(u);
    live[u] = prefetch;
    live_elems += numel(u);
    if (prefetch) prefetched += numel(u);
    out.prefetched = std::max(out.prefetched, prefetched);
  };
  const auto free = [&](int u) {
    if (events) events->free(u, live[u]);
    if (live[u]) prefetched -= numel(u);
    live.erase(u);
    live_elems -= numel(u);
    spares.insert(numel(u));
  };
  // The second step reuses the first one's buffers; `events` may ask for more.
  for (; events ? events->next_step(step) : step < 2; ++step) {
    for (size_t k = 0; k < trace.size(); ++k) {
      const int u = trace[k];
      if (!live.count(u)) {
        for (auto it = live.begin(); it != live.end() && live_elems + numel(u) > zero.max_live_parameters;) {
          const int v = (it++)->first;
          if (!persistent[static_cast<size_t>(v)] && !live[v]) free(v);
        }
        gather(u, false, k);
        if (events) events->use(u);  // fetch waits for it at once
      } else if (live[u]) {
        if (events) events->use(u);  // the prefetch's wait
        live[u] = false;
        prefetched -= numel(u);
      }
      int64_t budget = std::min(zero.max_live_parameters - live_elems, zero.prefetch_bucket_size);
      for (size_t j = k + 1; j < trace.size() && budget > 0; ++j) {
        const int next = trace[j];
        if (live.count(next)) continue;
        if (numel(next) > budget) break;
        gather(next, true, j);
        budget -= numel(next);
      }
      // release(u): kept when persistent, or used again within max_reuse_distance elements
      bool keep = persistent[static_cast<size_t>(u)];
      if (!keep && live_elems <= zero.max_live_parameters) {
        int64_t distance = 0;
        for (size_t j = k + 1; j < trace.size(); ++j) {
          if (trace[j] == u) {
            keep = true;
            break;
          }
          distance += numel(trace[j]);
          if (distance > zero.max_reuse_distance) break;
        }
      }
      if (!keep) free(u);
    }
    while (!live.empty()) free(live.begin()->first);  // drop_gathered_params at the end of the step
  }
  return out;
}

const void* ZeroOptimizer::own_slice(int u, Gathered& g, int64_t lo, int64_t hi) {
  if (!param_swap_) return params_.at(lo - part_.begin(rank_));
  const void* swapped = param_swap_->acquire(u);
  if (kernels::kHostIsDevice) return swapped;
  // Every gather form reads this rank's slice before anything writes the unit's buffer.
  void* slot = g.buffer.at(lo - units_[u].offset);
  kernels::copy_to_device(slot, swapped, static_cast<size_t>(hi - lo) * dtype_size(types_.param));
  return slot;
}

void ZeroOptimizer::start_gather(int u, size_t k) {
  const ParamUnit& unit = units_[u];
  Gathered g;
  // A freed buffer of the unit's size when there is one (blocks all have the same): a fresh
  // allocation of megabytes costs its page faults on every gather.
  const auto spare = std::find_if(spare_gathers_.begin(), spare_gathers_.end(), [&](const TypedBuffer& b) {
    return b.size() == unit.numel && b.type() == types_.param;
  });
  if (spare != spare_gathers_.end()) {
    g.buffer = std::move(*spare);
    spare_gathers_.erase(spare);
  } else {
    g.buffer = TypedBuffer("gathered_unit", types_.param, unit.numel, /*zero=*/false);
    gathered_bytes_ += unit.numel * static_cast<int64_t>(dtype_size(types_.param));
  }
  std::vector<int64_t> counts(world_), displs(world_);
  for (int r = 0; r < world_; ++r) {
    const auto [lo, hi] = part_.owned(r, unit.offset, unit.offset + unit.numel);
    counts[r] = hi - lo;
    displs[r] = lo - unit.offset;
  }
  const auto [lo, hi] = part_.owned(rank_, unit.offset, unit.offset + unit.numel);
  if (gathers_secondary(u, k)) {
    start_secondary_gather(u, g);
  } else if (quantized_frozen_) {
    start_frozen_gather(u, g);
  } else if (cfg_.quantized_weights) {
    start_quantized_gather(dp_, g, counts, displs, own_slice(u, g, lo, hi));
  } else if (shards_.gather_inter) {
    start_hierarchical_gather(u, g, own_slice(u, g, lo, hi));
  } else if (!gather_segments_.empty() && gather_mixed_[static_cast<size_t>(u)]) {
    const void* own = own_slice(u, g, lo, hi);
    // torch_autocast: the listed modules' tensors travel in the autocast dtype, the rest in the
    // parameters' (DeepSpeed gathers each parameter in its comm dtype): every rank packs its
    // slice segment by segment into bytes; fetch() widens the gathered bytes into the unit.
    std::vector<int64_t> bytes(world_), at(world_);
    int64_t total = 0;
    for (int r = 0; r < world_; ++r) {
      const auto [a, b] = part_.owned(r, unit.offset, unit.offset + unit.numel);
      at[r] = total;
      for (const CommSegment& sg : gather_segments_[static_cast<size_t>(u)])
        bytes[r] += std::max<int64_t>(0, std::min(b, sg.end) - std::max(a, sg.begin)) *
                    static_cast<int64_t>(dtype_size(sg.type));
      total += bytes[r];
    }
    g.packed = gather_staging_.take(total);
    char* out = g.packed.data() + at[rank_];
    for (const CommSegment& sg : gather_segments_[static_cast<size_t>(u)]) {
      const int64_t a = std::max(lo, sg.begin), b = std::min(hi, sg.end);
      if (a >= b) continue;
      convert_any(out, sg.type, static_cast<const float*>(own) + (a - lo), DType::F32, b - a);
      out += (b - a) * static_cast<int64_t>(dtype_size(sg.type));
    }
    g.pending = dp_.all_gather_v_async(g.packed.data(), bytes, at, DType::U8);
  } else {
    void* slot = g.buffer.at(lo - unit.offset);
    const void* own = own_slice(u, g, lo, hi);
    if (own != slot) convert_any(slot, types_.param, own, types_.param, hi - lo);
    g.pending = dp_.all_gather_v_async(g.buffer.data(), counts, displs, types_.param);
  }
  live_elems_ += unit.numel;
  live_peak_elems_ = std::max(live_peak_elems_, live_elems_);
  gathered_[u] = std::move(g);
}

// The bytes an autocast gather brought, widened into the unit: rank r's slice, segment by segment.
void ZeroOptimizer::unpack_gathered(int u, Gathered& g) {
  const ParamUnit& unit = units_[u];
  const char* in = g.packed.data();
  for (int r = 0; r < world_; ++r) {
    const auto [lo, hi] = part_.owned(r, unit.offset, unit.offset + unit.numel);
    for (const CommSegment& sg : gather_segments_[static_cast<size_t>(u)]) {
      const int64_t a = std::max(lo, sg.begin), b = std::min(hi, sg.end);
      if (a >= b) continue;
      convert_any(g.buffer.at(a - unit.offset), types_.param, in, sg.type, b - a);
      in += (b - a) * static_cast<int64_t>(dtype_size(sg.type));
    }
  }
  gather_staging_.give_back(std::move(g.packed));
}

// qwZ: 16-bit parameters are quantised from their values widened to fp32 (DeepSpeed's kernel reads
// the fp16 values into fp32 the same way) and dequantised in fp32, then rounded to their type.
void ZeroOptimizer::start_quantized_gather(Communicator& group, Gathered& g, std::vector<int64_t> counts,
                                           std::vector<int64_t> displs, const void* own) {
  g.quantized.emplace(std::move(counts));
  g.displs = std::move(displs);
  g.packed = gather_staging_.take(g.quantized->total);
  const int64_t n = g.quantized->counts[static_cast<size_t>(group.rank())];
  if (types_.param == DType::F32) {
    g.pending = start_quantized_all_gather(group, *g.quantized, static_cast<const float*>(own), g.packed.data());
    return;
  }
  kernels::StagingBuffer widened = gather_staging_.take(4 * n);
  convert_any(widened.data(), DType::F32, own, types_.param, n);
  g.pending = start_quantized_all_gather(group, *g.quantized, reinterpret_cast<const float*>(widened.data()),
                                         g.packed.data());
  gather_staging_.give_back(std::move(widened));
}

// Every rank's slice, this rank's own included, dequantised into the unit: all ranks compute with
// the same weights (DeepSpeed dequantises the whole gathered buffer).
void ZeroOptimizer::unpack_quantized(Gathered& g) {
  const QuantizedGatherPlan& plan = *g.quantized;
  kernels::StagingBuffer narrowed;
  if (types_.param != DType::F32)
    narrowed = gather_staging_.take(4 * *std::max_element(plan.counts.begin(), plan.counts.end()));
  for (size_t r = 0; r < plan.counts.size(); ++r) {
    void* out = g.buffer.at(g.displs[r]);
    if (types_.param == DType::F32) {
      dequantize_gathered_slice(plan, g.packed.data(), static_cast<int>(r), static_cast<float*>(out));
    } else {
      dequantize_gathered_slice(plan, g.packed.data(), static_cast<int>(r), reinterpret_cast<float*>(narrowed.data()));
      convert_any(out, types_.param, narrowed.data(), DType::F32, plan.counts[r]);
    }
  }
  gather_staging_.give_back(std::move(narrowed));
  gather_staging_.give_back(std::move(g.packed));
  g.quantized.reset();
}

void ZeroOptimizer::free_gathered(int u) {
  auto it = gathered_.find(u);
  if (it == gathered_.end()) return;
  if (it->second.pending) it->second.pending->wait();
  gather_staging_.give_back(std::move(it->second.packed));
  live_elems_ -= units_[u].numel;
  spare_gathers_.push_back(std::move(it->second.buffer));
  gathered_.erase(it);
}

const void* ZeroOptimizer::fetch(int u) {
  if (stage_ < 3) return params_.at(units_[u].offset);
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
    start_gather(u, k);
  }
  Gathered& g = gathered_[u];
  if (g.pending) {
    g.pending->wait();
    g.pending.reset();
    if (g.hierarchical) unpack_hierarchical(u, g);
    else if (g.quantized) unpack_quantized(g);
    else if (g.frozen >= 0) unpack_frozen(u, g);
    else if (!g.packed.empty()) unpack_gathered(u, g);
    if (g.primary && shards_.hpz) keep_secondary(u, g);
  }
  // NVMe parameters: the reads of the units the trace needs next run ahead of compute.
  if (param_swap_)
    for (size_t k = trace_pos_ + 1; k < trace_.size(); ++k)
      if (!gathered_.count(trace_[k]) && !param_swap_->prefetch(trace_[k])) break;
  // Prefetch what the trace needs next, within min(free live budget, prefetch_bucket_size).
  int64_t budget = std::min(cfg_.max_live_parameters - live_elems_, cfg_.prefetch_bucket_size);
  for (size_t k = trace_pos_ + 1; k < trace_.size() && budget > 0; ++k) {
    const int next = trace_[k];
    if (gathered_.count(next)) continue;
    if (units_[next].numel > budget) break;
    // (No wait for NVMe reads here: whether a read has landed differs from rank to rank, and the
    // gathers are collectives every rank must start in the same order; start_gather waits.)
    start_gather(next, k);
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

}  // namespace zero3d

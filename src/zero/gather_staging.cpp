// gather_staging.cpp — stage 3's gather staging, planned (zero.hpp simulate_gather_staging): what
// ZeroOptimizer's gathers take from its gather_staging_ pool (param_fetch.cpp start_gather,
// start_quantized_gather, unpack_quantized, unpack_gathered; shard_groups.cpp
// start_hierarchical_gather, unpack_hierarchical), in their order, from the same BasicPool, so
// the plan holds what the pool holds (spares kept for reuse included) byte for byte.
#include <algorithm>
#include <map>
#include <utility>

#include "parallel/quantized_gather.hpp"
#include "zero/zero.hpp"

namespace zero3d {

namespace {

// A pool buffer by its size alone: BasicPool keeps, reuses and drops these as it does bytes.
struct PlannedBuffer {
  size_t n = 0;
  PlannedBuffer() = default;
  explicit PlannedBuffer(size_t bytes) : n(bytes) {}
  size_t size() const { return n; }
  bool empty() const { return n == 0; }
};

// One gather's takes: `scratch` taken and given back as it starts, before `packed` is taken
// (MiCS's slices across nodes) or after (qwZ's slice widened to fp32); `packed` held until the
// fetch unpacks it (or the unit is freed unused); `narrowed` (qwZ, 16-bit parameters) taken and
// given back while unpacking, before `packed` goes back.
struct Takes {
  int64_t packed = 0, scratch = 0, narrowed = 0;
  bool scratch_first = false;
};

// start_quantized_gather and unpack_quantized for slices of `counts` values, this rank's `own`.
Takes quantized_takes(const std::vector<int64_t>& counts, int own, DType param) {
  Takes t;
  t.packed = QuantizedGatherPlan(counts).total;
  if (param != DType::F32) {
    t.scratch = 4 * counts[static_cast<size_t>(own)];
    t.narrowed = 4 * *std::max_element(counts.begin(), counts.end());
  }
  return t;
}

}  // namespace

int64_t simulate_gather_staging(const ZeroConfig& zero, const StateTypes& types, const ParamLayout& layout,
                                const std::vector<ParamUnit>& units, const Partition& part, const std::vector<int>& trace,
                                const std::vector<bool>& backward, int mics_nodes, int mics_per_node, int rank) {
  const int hpz = zero.hpz_partition_size;
  const auto es = static_cast<int64_t>(dtype_size(types.param));
  // torch_autocast: a unit with listed tensors gathers its bytes packed, each tensor in its dtype.
  std::vector<int64_t> autocast_bytes(units.size(), 0);
  if (types.autocast != DType::F32)
    for (size_t u = 0; u < units.size(); ++u) {
      bool low = false;
      int64_t bytes = 0;
      for (size_t i = 0; i < layout.tensors().size(); ++i) {
        const TensorSpec& t = layout.tensors()[i];
        const int64_t a = std::max(t.offset, units[u].offset),
                      b = std::min(t.offset + t.numel, units[u].offset + units[u].numel);
        if (a >= b) continue;
        bytes += (b - a) * static_cast<int64_t>(dtype_size(types.low(i) ? types.autocast : types.param));
        low = low || types.low(i);
      }
      autocast_bytes[u] = low ? bytes : 0;
    }
  // start_gather's choice of path, in its order.
  const auto takes = [&](int u, bool secondary) {
    const ParamUnit& unit = units[static_cast<size_t>(u)];
    const auto count = [&](int r) {
      const auto [a, b] = part.owned(r, unit.offset, unit.offset + unit.numel);
      return b - a;
    };
    if (secondary) {  // start_secondary_gather: the unit split over the hpZ group
      if (!zero.quantized_weights) return Takes{};
      const Partition split(unit.numel, hpz);
      std::vector<int64_t> counts(static_cast<size_t>(hpz));
      for (int r = 0; r < hpz; ++r) {
        const auto [a, b] = split.owned(r, 0, unit.numel);
        counts[static_cast<size_t>(r)] = b - a;
      }
      return quantized_takes(counts, rank % hpz, types.param);
    }
    if (zero.quantized_nontrainable_weights && types.any_frozen()) {
      // start_frozen_gather and unpack_frozen (quantized_frozen.cpp): the slices' bytes; with qwZ
      // this rank's trainable values widened to fp32; on arrival one slice's values in fp32
      // (16-bit parameters, or qwZ's trainable ones), the widest of any rank's pieces.
      const FrozenGatherPlan plan = frozen_gather_plan(layout, types, part, unit, zero.quantized_weights);
      Takes t;
      t.packed = plan.total;
      if (zero.quantized_weights) t.scratch = 4 * plan.trainable_count[static_cast<size_t>(rank)];
      if (types.param != DType::F32 || zero.quantized_weights) t.narrowed = 4 * plan.widest;
      return t;
    }
    if (zero.quantized_weights) {
      std::vector<int64_t> counts(static_cast<size_t>(part.world));
      for (int r = 0; r < part.world; ++r) counts[static_cast<size_t>(r)] = count(r);
      return quantized_takes(counts, rank, types.param);
    }
    Takes t;
    if (mics_nodes > 0) {  // shard rank j·k + p is position p on node j
      const int k = mics_per_node, p = rank % k;
      for (int j = 0; j < mics_nodes; ++j) t.scratch += count(j * k + p);
      for (int r = 0; r < mics_nodes * k; ++r) t.packed += count(r);
      t.scratch *= es;
      t.packed *= es;
      t.scratch_first = true;
    } else {
      t.packed = autocast_bytes[static_cast<size_t>(u)];
    }
    return t;
  };

  BasicPool<PlannedBuffer> pool;
  std::map<int, PlannedBuffer> packed;  // gathers not yet unpacked
  std::map<int, Takes> taken;
  std::map<int, bool> primary;
  std::vector<bool> secondary_valid(units.size(), false);  // hpZ: the step's first gather kept the slice
  int64_t held = -1, peak = -1;
  GatherEvents events;
  events.next_step = [&](int step) {
    secondary_valid.assign(units.size(), false);  // drop_gathered_params
    // Steady once a step (after the second) left the pool as it found it.
    const bool steady = step >= 2 && pool.held_bytes() == held && pool.peak_bytes() == peak;
    held = pool.held_bytes();
    peak = pool.peak_bytes();
    return step < 2 || (!steady && step < 32);
  };
  events.start = [&](int u, size_t k) {
    const bool secondary = hpz > 1 && secondary_valid[static_cast<size_t>(u)] && k < backward.size() && backward[k];
    const Takes t = takes(u, secondary);
    PlannedBuffer scratch;
    if (t.scratch_first) scratch = pool.take(t.scratch);
    packed[u] = pool.take(t.packed);
    if (!t.scratch_first) scratch = pool.take(t.scratch);
    pool.give_back(std::move(scratch));
    taken[u] = t;
    primary[u] = !secondary;
  };
  events.use = [&](int u) {
    PlannedBuffer narrowed = pool.take(taken[u].narrowed);
    pool.give_back(std::move(narrowed));
    pool.give_back(std::move(packed[u]));
    packed.erase(u);
    if (hpz > 1 && primary[u]) secondary_valid[static_cast<size_t>(u)] = true;  // keep_secondary
  };
  events.free = [&](int u, bool) {
    const auto it = packed.find(u);
    if (it == packed.end()) return;
    pool.give_back(std::move(it->second));
    packed.erase(it);
  };
  simulate_gathers(zero, units, trace, &events);
  return pool.peak_bytes();
}

}  // namespace zero3d

// shard_groups.cpp — the ZeRO optimizer's MiCS and hpZ paths (see shard_groups.hpp).
#include <vector>

#include "zero/zero.hpp"

namespace zero3d {

// DeepSpeed mics.py allreduce_mics_shard_grads: at the accumulation boundary the shard's
// accumulated gradient partition is summed over the replicas (already divided by them: the
// reducer's scaling counts every replica's ranks).
void ZeroOptimizer::reduce_over_replicas() {
  shards_.replicas->all_reduce(grads_.data(), grads_.size(), types_.grad, ReduceOp::Sum);
}

// DeepSpeed mics.py _hierarchical_all_gather_params: the shard group of n nodes × k ranks (shard
// rank j·k + p is position p on the shard's node j) gathers in two steps. Across nodes, the
// ranks at this position exchange their slices; inside the node, each rank's n slices go to
// all k ranks, laid out by position (unpack_hierarchical puts them where they belong). The
// first step is waited for here, so that every rank starts its collectives in the same order.
void ZeroOptimizer::start_hierarchical_gather(int u, Gathered& g, const void* own) {
  const ParamUnit& unit = units_[u];
  Communicator &inter = *shards_.gather_inter, &intra = *shards_.gather_intra;
  const int n = inter.size(), k = intra.size(), node = inter.rank(), p = intra.rank();
  const auto es = static_cast<int64_t>(dtype_size(types_.param));
  const auto count = [&](int r) {
    const auto [a, b] = part_.owned(r, unit.offset, unit.offset + unit.numel);
    return b - a;
  };
  std::vector<int64_t> across_counts(n), across_at(n), inside_counts(k, 0), inside_at(k);
  int64_t across_total = 0, total = 0;
  for (int j = 0; j < n; ++j) {
    across_counts[j] = count(j * k + p);
    across_at[j] = across_total;
    across_total += across_counts[j];
  }
  for (int q = 0; q < k; ++q) {
    for (int j = 0; j < n; ++j) inside_counts[q] += count(j * k + q);
    inside_at[q] = total;
    total += inside_counts[q];
  }
  kernels::StagingBuffer across = gather_staging_.take(across_total * es);
  convert_any(across.data() + across_at[node] * es, types_.param, own, types_.param, across_counts[node]);
  inter.all_gather_v_async(across.data(), across_counts, across_at, types_.param)->wait();
  g.packed = gather_staging_.take(total * es);
  convert_any(g.packed.data() + inside_at[p] * es, types_.param, across.data(), types_.param, across_total);
  gather_staging_.give_back(std::move(across));
  g.pending = intra.all_gather_v_async(g.packed.data(), inside_counts, inside_at, types_.param);
  g.hierarchical = true;
}

// The slices by position, then by node, into the unit: shard rank j·k + q's owned range.
void ZeroOptimizer::unpack_hierarchical(int u, Gathered& g) {
  const ParamUnit& unit = units_[u];
  const int n = shards_.gather_inter->size(), k = shards_.gather_intra->size();
  const auto es = static_cast<int64_t>(dtype_size(types_.param));
  const char* in = g.packed.data();
  for (int q = 0; q < k; ++q)
    for (int j = 0; j < n; ++j) {
      const auto [a, b] = part_.owned(j * k + q, unit.offset, unit.offset + unit.numel);
      convert_any(g.buffer.at(a - unit.offset), types_.param, in, types_.param, b - a);
      in += (b - a) * es;
    }
  gather_staging_.give_back(std::move(g.packed));
  g.hierarchical = false;
}

// DeepSpeed partition_parameters.py all_gather_coalesced: a backward fetch (forward=False) of a
// parameter with a secondary tensor gathers it in the hpZ group.
bool ZeroOptimizer::gathers_secondary(int u, size_t k) const {
  return shards_.hpz && secondary_valid_[static_cast<size_t>(u)] && k < backward_.size() && backward_[k];
}

void ZeroOptimizer::start_secondary_gather(int u, Gathered& g) {
  const ParamUnit& unit = units_[u];
  Communicator& group = *shards_.hpz;
  const Partition split(unit.numel, group.size());
  std::vector<int64_t> counts(group.size()), displs(group.size());
  for (int r = 0; r < group.size(); ++r) {
    const auto [a, b] = split.owned(r, 0, unit.numel);
    counts[r] = b - a;
    displs[r] = a;
  }
  g.primary = false;
  if (cfg_.quantized_weights) {  // qwZ quantises the secondary gathers too (DeepSpeed's use_secondary_tensor path)
    start_quantized_gather(group, g, counts, displs, secondary_[static_cast<size_t>(u)].data());
    return;
  }
  const auto [a, b] = split.owned(group.rank(), 0, unit.numel);
  convert_any(g.buffer.at(a), types_.param, secondary_[static_cast<size_t>(u)].data(), types_.param, b - a);
  g.pending = group.all_gather_v_async(g.buffer.data(), counts, displs, types_.param);
}

// hpZ's secondary partition: this rank's slice of the unit split over the hpZ group, kept from
// the step's first (data-group) gather until the update makes it stale.
void ZeroOptimizer::keep_secondary(int u, const Gathered& g) {
  const ParamUnit& unit = units_[u];
  const Partition split(unit.numel, shards_.hpz->size());
  const auto [a, b] = split.owned(shards_.hpz->rank(), 0, unit.numel);
  TypedBuffer& slice = secondary_[static_cast<size_t>(u)];
  if (slice.size() != b - a) slice = TypedBuffer("hpz_secondary", types_.param, b - a, /*zero=*/false);
  convert_any(slice.data(), types_.param, g.buffer.at(a), types_.param, b - a);
  secondary_valid_[static_cast<size_t>(u)] = true;
}

}  // namespace zero3d

// config/elasticity.cpp — the `elasticity` section: DeepSpeed's compatible batch-size and
// world-size computation (deepspeed/elasticity/elasticity.py compute_elastic_config, v0.1 and
// v0.2; DEEPSPEED-FACTS §1.6), which then fixes the batch triad as DeepSpeed's config does.
#include <algorithm>
#include <numeric>
#include <set>

#include "config/section.hpp"

namespace zero3d::config_detail {

namespace {

// elasticity.py HCN_LIST: highly composite numbers that scale a base batch size.
const int64_t kHcn[] = {1,     2,     4,      6,      12,     24,     36,     48,     60,     120,
                        180,   240,   360,    720,    840,    1260,   1680,   2520,   5040,   7560,
                        10080, 15120, 20160,  25200,  27720,  45360,  50400,  55440,  83160,  110880,
                        166320, 221760, 277200, 332640, 498960, 554400, 665280, 720720};

// get_candidate_batch_sizes: each base scaled by the largest HCN that keeps it within `max`
// (numpy's argmax finds no larger one -> index 0, and HCN[-1], the last, is taken).
std::set<int64_t> candidate_batch_sizes(const std::vector<int64_t>& bases, int64_t max) {
  std::set<int64_t> out;
  const size_t n = sizeof(kHcn) / sizeof(kHcn[0]);
  for (int64_t base : bases) {
    if (base >= max) {
      out.insert(base);
      continue;
    }
    const int64_t value = max / base;
    size_t index = 0;
    while (index < n && kHcn[index] <= value) ++index;
    out.insert((index == n || index == 0 ? kHcn[n - 1] : kHcn[index - 1]) * base);
  }
  return out;
}

// get_valid_gpus: GPU counts in [lo, hi] that some micro-batch divides the batch over.
std::vector<int64_t> valid_gpus(int64_t batch, const std::vector<int64_t>& micros, int64_t lo, int64_t hi) {
  std::set<int64_t> out;
  for (int64_t mb : micros) {
    if (batch % mb != 0) continue;
    const int64_t most = batch / mb;
    if (lo <= most && most <= hi) out.insert(most);
    for (int64_t i = 1; i <= most / 2; ++i) {
      if (i > hi) break;
      if (i < lo) continue;
      if (most % i == 0) out.insert(i);
    }
  }
  return {out.begin(), out.end()};
}

// _get_compatible_gpus_v01: the candidate with the most valid GPU counts (ties: larger or smaller
// batch as prefer_larger_batch says).
std::pair<int64_t, std::vector<int64_t>> compatible_v01(const std::vector<int64_t>& micros, int64_t max_batch,
                                                        int64_t min_gpus, int64_t max_gpus, bool prefer_larger) {
  if (min_gpus <= 0) min_gpus = 1;
  if (max_gpus <= 0) max_gpus = max_batch / *std::min_element(micros.begin(), micros.end());
  int64_t lcm = 1;
  for (int64_t mb : micros) lcm = std::lcm(lcm, mb);
  std::vector<int64_t> bases = micros;
  bases.push_back(lcm);
  size_t best_count = 0;
  std::vector<int64_t> best_valid;
  int64_t final_batch = *std::min_element(micros.begin(), micros.end());
  for (int64_t batch : candidate_batch_sizes(bases, max_batch)) {
    std::vector<int64_t> v = valid_gpus(batch, micros, min_gpus, max_gpus);
    if (v.size() > best_count ||
        (v.size() == best_count && ((prefer_larger && batch > final_batch) || (!prefer_larger && batch < final_batch)))) {
      best_count = v.size();
      best_valid = std::move(v);
      final_batch = batch;
    }
  }
  return {final_batch, best_valid};
}

std::string list_text(const std::vector<int64_t>& v) {
  std::string s;
  for (size_t k = 0; k < v.size(); ++k) {
    if (k == 24 && v.size() > 26) return s + ", … (" + std::to_string(v.size()) + " sizes)";
    s += (k ? ", " : "") + std::to_string(v[k]);
  }
  return s;
}

}  // namespace

std::optional<ElasticBatch> read_elasticity(Section& top, int64_t dp_world) {
  Section sec = top.child("elasticity");
  const bool enabled = sec.boolean("enabled", false);
  const int64_t max_batch = sec.integer("max_train_batch_size", 2000, 1, int64_t(1) << 31);
  std::vector<int64_t> micros = {2, 4, 6};
  if (const json* v = sec.raw("micro_batch_sizes")) {
    micros.clear();
    if (v->is_array() && !v->empty())
      for (const json& m : *v)
        if (m.is_number_integer() && m.get<int64_t>() > 0 && m.get<int64_t>() <= max_batch) micros.push_back(m.get<int64_t>());
    if (micros.size() != (v->is_array() ? v->size() : 0) || micros.empty()) {
      sec.report_key("micro_batch_sizes", "expected a list of micro-batch sizes, each from 1 to max_train_batch_size (" +
                                              std::to_string(max_batch) + "), got " + show(*v));
      micros = {2, 4, 6};
    }
  }
  sec.record("micro_batch_sizes", micros);
  const int64_t min_gpus = sec.integer("min_gpus", 1, 1, int64_t(1) << 31);
  const int64_t max_gpus = sec.integer("max_gpus", 10000, 1, int64_t(1) << 31);
  sec.number("min_time", 0.0, 0.0, 1e12);  // read by schedulers that place the job; not by the run
  const bool prefer_larger = sec.boolean("prefer_larger_batch", true);
  const bool ignore_batch_keys = sec.boolean("ignore_non_elastic_batch_info", false);
  const double version = sec.number("version", 0.2, 0.1, 0.2);
  const int64_t per_node = sec.integer("num_gpus_per_node", 1, 1, 1 << 20);
  const int64_t mp = sec.integer("model_parallel_size", 1, 1, 1 << 20);
  sec.finish();
  if (!enabled) return std::nullopt;
  if (version != 0.1 && version != 0.2) sec.fail_key("version", "must be 0.1 or 0.2");
  if (mp > 1 && version != 0.2) sec.fail_key("model_parallel_size", "model parallelism needs elasticity version 0.2");
  if (per_node % mp != 0)
    sec.fail_key("num_gpus_per_node", "value " + std::to_string(per_node) + " is not divisible by model_parallel_size (" +
                                          std::to_string(mp) + ")");
  // DeepSpeed: the elastic solver owns the batch; given batch keys are an error unless ignored.
  for (const char* key : {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"})
    if (top.has(key) && !ignore_batch_keys)
      top.fail(key, "elasticity is enabled and computes the batch; remove the key or set "
                    "elasticity.ignore_non_elastic_batch_info true");
  ElasticBatch e;
  if (version == 0.1) {
    std::tie(e.train_batch_size, e.valid_world_sizes) = compatible_v01(micros, max_batch, min_gpus, max_gpus, prefer_larger);
  } else {
    // v0.2 works per node: the v0.1 search on per-node quantities, scaled back by the node's
    // data-parallel ranks (_get_compatible_gpus_v02).
    const int64_t dp_per_node = per_node / mp;
    auto [batch, nodes] = compatible_v01(micros, max_batch / dp_per_node, min_gpus / per_node, max_gpus / per_node,
                                         prefer_larger);
    e.train_batch_size = batch * dp_per_node;
    for (int64_t n : nodes) e.valid_world_sizes.push_back(n * dp_per_node);
    if (std::find(e.valid_world_sizes.begin(), e.valid_world_sizes.end(), dp_world) == e.valid_world_sizes.end()) {
      // Not a compatible size: the largest multiple of micro x dp within the maximum.
      const int64_t dp = dp_world / per_node * dp_per_node;
      std::vector<int64_t> cands;
      for (int64_t mb : micros) cands.push_back(std::max<int64_t>(1, max_batch / std::max<int64_t>(1, mb * dp)) * mb * dp);
      e.train_batch_size = prefer_larger ? *std::max_element(cands.begin(), cands.end())
                                         : *std::min_element(cands.begin(), cands.end());
      e.valid_world_sizes = {dp};
    }
  }
  if (std::find(e.valid_world_sizes.begin(), e.valid_world_sizes.end(), dp_world) == e.valid_world_sizes.end())
    top.fail("elasticity", "world size (" + std::to_string(dp_world) + ") is not valid with the current list of valid "
                           "GPU counts: [" + list_text(e.valid_world_sizes) + "]");
  // The largest micro-batch that divides this world size's share (compute_elastic_config).
  std::vector<int64_t> desc(micros.begin(), micros.end());
  std::sort(desc.rbegin(), desc.rend());
  for (int64_t mb : desc)
    if (e.train_batch_size / dp_world % mb == 0) {
      e.micro_batch = mb;
      break;
    }
  if (e.micro_batch == 0)
    top.fail("elasticity", "no micro-batch in " + show(json(micros)) + " divides train_batch_size " +
                               std::to_string(e.train_batch_size) + " over " + std::to_string(dp_world) + " ranks");
  // The table `zero3d validate` prints: each compatible world size with its micro-batch and steps.
  top.note("elastic train_batch_size " + std::to_string(e.train_batch_size) + " (elasticity v" +
           (version == 0.1 ? "0.1" : "0.2") + ", max " + std::to_string(max_batch) + ", micro-batches " +
           show(json(micros)) + "); compatible data-parallel sizes: [" + list_text(e.valid_world_sizes) + "]");
  size_t shown = 0;
  for (int64_t w : e.valid_world_sizes) {
    if (++shown > 16) {
      top.note("elastic   … " + std::to_string(e.valid_world_sizes.size() - 16) + " more sizes");
      break;
    }
    int64_t mb_w = 0;
    for (int64_t mb : desc)
      if (e.train_batch_size / w % mb == 0) {
        mb_w = mb;
        break;
      }
    top.note("elastic   " + std::to_string(w) + " ranks: micro-batch " + std::to_string(mb_w) +
             " x gradient_accumulation_steps " + std::to_string(mb_w ? e.train_batch_size / (mb_w * w) : 0) +
             (w == dp_world ? "  <- this run" : ""));
  }
  return e;
}

}  // namespace zero3d::config_detail

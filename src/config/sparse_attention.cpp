// config/sparse_attention.cpp — the `sparse_attention` section: the keys DeepSpeed's
// runtime/config.py get_sparse_*_config reads for each mode, with its defaults
// (DEEPSPEED-FACTS-2 §8.1), and the errors its SparsityConfig classes raise (§8.2).
#include "config/section.hpp"
#include "model/sparse_attention.hpp"

namespace zero3d::config_detail {

namespace {

// A list of block indices (each in [lo, 2^20]); nullopt with a report when it is not one.
std::optional<std::vector<int64_t>> index_list(Section& sec, const std::string& key, std::vector<int64_t> def,
                                               int64_t lo) {
  const json* v = sec.raw(key);
  if (!v) {
    sec.record(key, def);
    return def;
  }
  std::vector<int64_t> out;
  bool ok = v->is_array() && !v->empty();
  for (const json& e : ok ? *v : json::array()) {
    ok = ok && e.is_number_integer() && e.get<int64_t>() >= lo && e.get<int64_t>() <= (int64_t(1) << 20);
    if (ok) out.push_back(e.get<int64_t>());
  }
  if (!ok) {
    sec.report_key(key, "value " + show(*v) + " is not a non-empty list of integers >= " + std::to_string(lo));
    return std::nullopt;
  }
  sec.record(key, out);
  return out;
}

}  // namespace

SparseAttention read_sparse_attention(Section& top, const Config& c) {
  SparseAttention s;
  if (!top.has("sparse_attention")) return s;
  Section sec = top.child("sparse_attention");
  const std::string mode = sec.choice("mode", "fixed", {"dense", "fixed", "variable", "bigbird", "bslongformer"});
  s.enabled = true;
  s.mode = mode == "dense"      ? SparsityMode::Dense
           : mode == "fixed"    ? SparsityMode::Fixed
           : mode == "variable" ? SparsityMode::Variable
           : mode == "bigbird"  ? SparsityMode::BigBird
                                : SparsityMode::BSLongformer;
  s.block = sec.integer("block", 16, 1, 1 << 16);
  s.seed = c.training.seed;
  const int64_t most = int64_t(1) << 20;
  if (s.mode != SparsityMode::Dense)
    s.different_layout_per_head = sec.boolean("different_layout_per_head", false);
  const auto attention = [&] {  // only fixed and variable read it; bigbird and bslongformer are bidirectional
    s.unidirectional = sec.choice("attention", "bidirectional", {"bidirectional", "unidirectional"}) == "unidirectional";
    s.horizontal_global_attention = sec.boolean("horizontal_global_attention", false);
  };
  switch (s.mode) {
    case SparsityMode::Dense: break;
    case SparsityMode::Fixed:
      s.num_local_blocks = sec.integer("num_local_blocks", 4, 1, most);
      s.num_global_blocks = sec.integer("num_global_blocks", 1, 1, most);
      attention();
      s.num_different_global_patterns = sec.integer("num_different_global_patterns", 1, 1, most);
      break;
    case SparsityMode::Variable: {
      s.num_random_blocks = sec.integer("num_random_blocks", 0, 0, most);
      if (auto v = index_list(sec, "local_window_blocks", {4}, 1)) s.local_window_blocks = *v;
      if (auto v = index_list(sec, "global_block_indices", {0}, 0)) s.global_block_indices = *v;
      if (sec.has("global_block_end_indices") && !sec.raw("global_block_end_indices")->is_null()) {
        if (auto v = index_list(sec, "global_block_end_indices", {}, 1)) s.global_block_end_indices = *v;
      } else {
        sec.record("global_block_end_indices", nullptr);
      }
      attention();
      break;
    }
    case SparsityMode::BigBird:
      // DeepSpeed's config default is 0 random blocks (its class default, 1, applies only in Python).
      s.num_random_blocks = sec.integer("num_random_blocks", 0, 0, most);
      s.num_sliding_window_blocks = sec.integer("num_sliding_window_blocks", 3, 1, most);
      s.num_global_blocks = sec.integer("num_global_blocks", 1, 1, most);
      break;
    case SparsityMode::BSLongformer:
      s.num_sliding_window_blocks = sec.integer("num_sliding_window_blocks", 3, 1, most);
      if (auto v = index_list(sec, "global_block_indices", {0}, 0)) s.global_block_indices = *v;
      if (sec.has("global_block_end_indices") && !sec.raw("global_block_end_indices")->is_null()) {
        if (auto v = index_list(sec, "global_block_end_indices", {}, 1)) s.global_block_end_indices = *v;
      } else {
        sec.record("global_block_end_indices", nullptr);
      }
      break;
  }
  sec.finish();
  for (const auto& [key, why] : sparse_attention_problems(s, c.model.n_head, c.model.n_positions))
    sec.report_key(key, why);
  return s;
}

}  // namespace zero3d::config_detail

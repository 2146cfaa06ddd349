// attention_sparse_table.hpp — a block-sparse layout as the kernels read it: the host layout
// (the CPU form walks it), and each (head, query block)'s key blocks as an index table in model
// memory for the device form (kernels/attention_sparse.hpp gpu::), built once per layout when the
// model is made, never per call (GPU-GAP C6: per-call host lists read by device code).
//
// The device form batches the products of equal panels (gemm_batched needs one shape per call),
// so the (head, query block) pairs are grouped by how many key blocks they compute: a group's
// members are its pairs in (head, query block) order. Its key and value gradients are sums over
// query blocks; a kernel adds them without atomics (the same bits every run) by reading, for each
// (head, key block) the group touches (a target), the panel blocks that hold it, in order.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "kernels/common.hpp"
#include "kernels/memory.hpp"

namespace zero3d::kernels {

class SparseBlockTable {
 public:
  // The pairs computing `blocks` key blocks: members [first, first + count) of members(), and the
  // (head, key block) targets [first_target, first_target + targets) of target_ids().
  struct Group {
    Index first = 0, count = 0, blocks = 0, first_target = 0, targets = 0;
  };

  SparseBlockTable() = default;
  // layout[heads, nb, nb] (0/1, model/sparse_attention.hpp's); block: tokens per block.
  SparseBlockTable(std::vector<uint8_t> layout, Index heads, Index nb, Index block)
      : layout_(std::move(layout)), heads_(heads), nb_(nb), block_(block) {
    const Tables h = tables_of(layout_, heads, nb);
    computed_ = static_cast<Index>(h.blocks.size());
    computing_ = h.computing;
    groups_ = h.groups;
    offsets_ = to_model_memory("sparse_table_offsets", h.offsets);
    blocks_ = to_model_memory("sparse_table_blocks", h.blocks);
    members_ = to_model_memory("sparse_table_members", h.members);
    target_ids_ = to_model_memory("sparse_table_target_ids", h.target_ids);
    target_offsets_ = to_model_memory("sparse_table_target_offsets", h.target_offsets);
    target_entries_ = to_model_memory("sparse_table_target_entries", h.target_entries);
  }

  // The index tables' bytes in model memory: what the table of `layout` allocates (model_bytes),
  // for the memory plan, without allocating them.
  static int64_t model_bytes_of(const std::vector<uint8_t>& layout, Index heads, Index nb) {
    return tables_of(layout, heads, nb).model_bytes();
  }
  int64_t model_bytes() const {
    int64_t n = 0;
    for (const Indices* v : {&offsets_, &blocks_, &members_, &target_ids_, &target_offsets_, &target_entries_})
      n += static_cast<int64_t>(v->extent(0));
    return n * static_cast<int64_t>(sizeof(Index));
  }
  // The groups of `layout`'s table (sized by the memory plan without building the table).
  static std::vector<Group> groups_of(const std::vector<uint8_t>& layout, Index heads, Index nb) {
    return tables_of(layout, heads, nb).groups;
  }

  // Host memory: the layout the CPU form reads.
  const uint8_t* layout() const { return layout_.data(); }
  Index heads() const { return heads_; }
  Index blocks_per_row() const { return nb_; }
  Index block() const { return block_; }
  // Blocks computed over all heads (on or below the diagonal and set).
  Index computed_blocks() const { return computed_; }
  const std::vector<Group>& groups() const { return groups_; }
  // Pairs with no key block: members [computing_pairs(), heads·nb).
  Index computing_pairs() const { return computing_; }
  Index empty_pairs() const { return heads_ * nb_ - computing_; }

  // Model memory, for kernels. offsets[heads·nb + 1] and blocks[computed]: pair p's key blocks
  // are blocks[offsets[p] .. offsets[p + 1]), ascending (the diagonal block last when computed).
  const Index* offsets() const { return offsets_.data(); }
  const Index* key_blocks() const { return blocks_.data(); }
  const Index* members() const { return members_.data(); }  // pair ids, group after group, then the empty ones
  // Target t of a group: pair id head·nb + key block, and its panel blocks (member·n + j) at
  // target_entries[target_offsets[t] .. target_offsets[t + 1]) (t counted over all groups).
  const Index* target_ids() const { return target_ids_.data(); }
  const Index* target_offsets() const { return target_offsets_.data(); }
  const Index* target_entries() const { return target_entries_.data(); }

 private:
  using Indices = Kokkos::View<Index*, DeviceSpace>;
  // The tables on the host, before they go to model memory.
  struct Tables {
    std::vector<Index> offsets, blocks, members, target_ids, target_offsets{0}, target_entries;
    std::vector<Group> groups;
    Index computing = 0;
    int64_t model_bytes() const {  // each table at least one element (to_model_memory)
      int64_t n = 0;
      for (const std::vector<Index>* v : {&offsets, &blocks, &members, &target_ids, &target_offsets, &target_entries})
        n += static_cast<int64_t>(std::max<size_t>(v->size(), 1));
      return n * static_cast<int64_t>(sizeof(Index));
    }
  };
  static Tables tables_of(const std::vector<uint8_t>& layout, Index heads, Index nb) {
    Tables h;
    const Index pairs = heads * nb;
    std::vector<Index>& offsets = h.offsets;
    std::vector<Index>& blocks = h.blocks;
    offsets.assign(static_cast<size_t>(pairs + 1), 0);
    for (Index p = 0; p < pairs; ++p) {  // p = head·nb + query block; causal: key blocks kb <= qb
      const Index hd = p / nb, qb = p % nb;
      for (Index kb = 0; kb <= qb; ++kb)
        if (layout[static_cast<size_t>((hd * nb + qb) * nb + kb)]) blocks.push_back(kb);
      offsets[static_cast<size_t>(p + 1)] = static_cast<Index>(blocks.size());
    }
    const auto keys = [&](Index p) { return offsets[static_cast<size_t>(p + 1)] - offsets[static_cast<size_t>(p)]; };
    std::vector<Index>&members = h.members, &target_ids = h.target_ids, &target_offsets = h.target_offsets,
                       &target_entries = h.target_entries;
    std::vector<std::vector<Index>> touching(static_cast<size_t>(pairs));  // per (head, key block): entries
    for (Index n = 1; n <= nb; ++n) {
      Group g;
      g.first = static_cast<Index>(members.size());
      g.blocks = n;
      g.first_target = static_cast<Index>(target_ids.size());
      for (Index p = 0; p < pairs; ++p)
        if (keys(p) == n) {
          const Index hd = p / nb, m = static_cast<Index>(members.size()) - g.first;
          for (Index j = 0; j < n; ++j)  // panel block m·n + j holds key block blocks[offsets[p] + j]
            touching[static_cast<size_t>(hd * nb + blocks[static_cast<size_t>(offsets[static_cast<size_t>(p)] + j)])]
                .push_back(m * n + j);
          members.push_back(p);
        }
      g.count = static_cast<Index>(members.size()) - g.first;
      if (g.count == 0) continue;
      for (Index t = 0; t < pairs; ++t) {
        std::vector<Index>& e = touching[static_cast<size_t>(t)];
        if (e.empty()) continue;
        target_ids.push_back(t);
        target_entries.insert(target_entries.end(), e.begin(), e.end());
        target_offsets.push_back(static_cast<Index>(target_entries.size()));
        e.clear();
      }
      g.targets = static_cast<Index>(target_ids.size()) - g.first_target;
      h.groups.push_back(g);
    }
    h.computing = static_cast<Index>(members.size());
    for (Index p = 0; p < pairs; ++p)  // pairs with no key block (none in DeepSpeed's patterns) last
      if (keys(p) == 0) members.push_back(p);
    return h;
  }
  // Host values into model memory, through the copy helper (host code never writes it directly).
  static Indices to_model_memory(const char* label, const std::vector<Index>& host) {
    Indices v(Kokkos::view_alloc(Kokkos::WithoutInitializing, std::string(label)), std::max<size_t>(host.size(), 1));
    copy_to_device(v.data(), host.data(), host.size() * sizeof(Index));
    return v;
  }

  std::vector<uint8_t> layout_;
  Index heads_ = 0, nb_ = 0, block_ = 0, computed_ = 0, computing_ = 0;
  std::vector<Group> groups_;
  Indices offsets_, blocks_, members_, target_ids_, target_offsets_, target_entries_;
};

}  // namespace zero3d::kernels

// quantized_reduce_scatter.cpp — qgZ's hierarchical all-to-all reduce-scatter (see the header)
// over the Communicator interface, so its bytes are counted and logged as every other
// collective's, intra-node or inter-node by the group that moves them.
#include "parallel/quantized_reduce_scatter.hpp"
#include "parallel/staging.hpp"

#include <algorithm>
#include <nlohmann/json.hpp>
#include <numeric>
#include <stdexcept>

#include "base/errors.hpp"
#include "kernels/elementwise.hpp"
#include "kernels/loco.hpp"
#include "kernels/quantize_int4.hpp"
#include "kernels/reduce.hpp"

namespace zero3d {

namespace {

uint8_t* bytes_of(kernels::StagingBuffer& b) { return reinterpret_cast<uint8_t*>(b.data()); }
float* floats_of(kernels::StagingBuffer& b) { return reinterpret_cast<float*>(b.data()); }
int8_t* codes_of(kernels::StagingBuffer& b) { return reinterpret_cast<int8_t*>(b.data()); }
int64_t size_of(const kernels::StagingBuffer& b) { return static_cast<int64_t>(b.size()); }

}  // namespace

std::vector<QgzBlock> qgz_blocks(const std::vector<int64_t>& counts, int64_t group) {
  std::vector<QgzBlock> out;
  int64_t at = 0;
  for (const int64_t n : counts) {
    const int64_t phase = at % group;
    out.push_back({n, phase, kernels::int4_packed_bytes(n), kernels::int4_groups(n, phase, group)});
    at += n;
  }
  return out;
}

QgzBytes qgz_sent_bytes(const std::vector<int64_t>& counts, int64_t group, int nodes, int per_node, int d) {
  const std::vector<QgzBlock> blocks = qgz_blocks(counts, group);
  const auto bytes = [&](int b) { return blocks[static_cast<size_t>(b)].values + 4 * blocks[static_cast<size_t>(b)].scales; };
  const int node = d / per_node, local = d % per_node;
  QgzBytes out;
  for (int m = 0; m < nodes; ++m)
    for (int l = 0; l < per_node; ++l)
      if (l != local) out.intra += bytes(m * per_node + l);  // every node's blocks for the other local peers
  for (int m = 0; m < nodes; ++m)
    if (m != node) out.inter += bytes(m * per_node + local);  // the node's sums for the other nodes
  return out;
}

void QgzStaging::grow(const QgzStaging& o) {
  send = std::max(send, o.send), send_scales = std::max(send_scales, o.send_scales);
  recv = std::max(recv, o.recv), recv_scales = std::max(recv_scales, o.recv_scales);
  sum = std::max(sum, o.sum), copy = std::max(copy, o.copy);
  err = std::max(err, o.err), comp = std::max(comp, o.comp);
}

QgzStaging qgz_staging(const std::vector<QgzBlock>& blocks, int nodes, int per_node, int d, bool loco) {
  const int k = per_node, node = d / k, local = d % k;
  const auto block = [&](int m, int l) -> const QgzBlock& { return blocks[static_cast<size_t>(m * k + l)]; };
  // Step 1 sends every block (the whole bucket quantised); each local peer sends this rank the
  // blocks (m, local) of every node m, and step 2 sends those sums on; step 3 receives its own
  // block from every node.
  int64_t values_total = 0, scales_total = 0, mine_values = 0, mine_scales = 0, sum_values = 0;
  for (const QgzBlock& b : blocks) values_total += b.values, scales_total += b.scales;
  for (int m = 0; m < nodes; ++m) {
    mine_values += block(m, local).values, mine_scales += block(m, local).scales;
    sum_values = std::max(sum_values, block(m, local).count);
  }
  const QgzBlock& own = block(node, local);
  QgzStaging s;
  s.send = std::max(values_total, mine_values);
  s.send_scales = 4 * std::max(scales_total, mine_scales);
  s.recv = std::max(k * mine_values, nodes * own.values);
  s.recv_scales = 4 * std::max(k * mine_scales, nodes * own.scales);
  s.sum = s.copy = 4 * std::max(sum_values, own.count);
  if (loco) {  // every block's error is widened, compensated and requantised in fp32
    int64_t largest = 0;
    for (const QgzBlock& b : blocks) largest = std::max(largest, b.count);
    s.copy = std::max(s.copy, 4 * largest);
    s.err = s.comp = 4 * largest;
  }
  return s;
}

int64_t loco_kept_bytes(const std::vector<int64_t>& counts, int64_t group, int nodes, int per_node, int d) {
  const std::vector<QgzBlock> blocks = qgz_blocks(counts, group);
  int64_t bytes = 0;
  for (const QgzBlock& b : blocks) bytes += b.count + 4 * b.scales;
  for (int m = 0; m < nodes; ++m) {
    const QgzBlock& b = blocks[static_cast<size_t>(m * per_node + d % per_node)];
    bytes += b.count + 4 * b.scales;
  }
  return bytes;
}

void QuantizedReduceScatter::add_copy(const uint8_t* packed, const float* scales, const QgzBlock& b, int64_t group,
                                      float* sum, bool first) {
  if (first) {  // 0 + the first copy
    kernels::dequantize_int4(packed, scales, b.count, b.phase, group, sum);
    return;
  }
  kernels::dequantize_int4(packed, scales, b.count, b.phase, group, floats_of(copy_));
  kernels::add_into(sum, floats_of(copy_), b.count, "qgz_add");
}

int64_t QuantizedReduceScatter::staging_bytes() const {
  return static_cast<int64_t>(send_.size() + recv_.size() + send_scales_.size() + recv_scales_.size() + sum_.size() +
                              copy_.size() + err_.size() + comp_.size());
}

void QuantizedReduceScatter::quantize_block(const float* x, const QgzBlock& b, int64_t group, uint8_t* packed,
                                            float* scales, int8_t* codes, float* code_scales) {
  if (!codes) {
    kernels::quantize_int4(x, b.count, b.phase, group, packed, scales);
    return;
  }
  float *err = floats_of(err_), *y = floats_of(comp_), *y_hat = floats_of(copy_);
  kernels::dequantize_int8_groups(codes, code_scales, b.count, b.phase, group, err);
  kernels::add(y, x, err, b.count, "loco_compensate");
  kernels::quantize_int4(y, b.count, b.phase, group, packed, scales);
  kernels::dequantize_int4(packed, scales, b.count, b.phase, group, y_hat);
  kernels::loco_update_error(y, y_hat, loco_.err_beta, b.count, err);
  kernels::quantize_int8_groups(err, b.count, b.phase, group, codes, code_scales);
}

QuantizedReduceScatter::LocoBucket& QuantizedReduceScatter::loco_bucket(int64_t begin,
                                                                        const std::vector<int64_t>& counts,
                                                                        int64_t group,
                                                                        const std::vector<int64_t>& tensors) {
  const int64_t total = std::accumulate(counts.begin(), counts.end(), int64_t(0));
  if (std::accumulate(tensors.begin(), tensors.end(), int64_t(0)) != total)
    throw std::logic_error("LoCo: a bucket's tensors do not fill it");
  const std::vector<QgzBlock> blocks = qgz_blocks(counts, group);
  const int k = per_node(), local = intra_.rank();
  auto it = loco_buckets_.find(begin);
  // Errors restored from a run whose buckets were cut otherwise start again from zero, as
  // DeepSpeed's always do after a load.
  if (it != loco_buckets_.end() && (it->second.end != begin + total || it->second.counts != counts ||
                                    it->second.tensors != tensors))
    loco_buckets_.erase(it), it = loco_buckets_.end();
  if (it == loco_buckets_.end()) {
    LocoBucket fresh;
    fresh.end = begin + total;
    fresh.counts = counts;
    fresh.tensors = tensors;
    fresh.live.assign(tensors.size(), 0);
    int64_t intra_scales = 0, inter = 0, inter_scales = 0;
    for (const QgzBlock& b : blocks) intra_scales += b.scales;
    for (int m = 0; m < nodes(); ++m) {
      inter += blocks[static_cast<size_t>(m * k + local)].count;
      inter_scales += blocks[static_cast<size_t>(m * k + local)].scales;
    }
    fit(fresh.intra, total);
    fit(fresh.intra_scales, 4 * intra_scales);
    fit(fresh.inter, inter);
    fit(fresh.inter_scales, 4 * inter_scales);
    // zero errors, as int8 groups of zeros are stored: every code 0, every scale 1
    kernels::clear_errors(codes_of(fresh.intra), total, floats_of(fresh.intra_scales), intra_scales);
    kernels::clear_errors(codes_of(fresh.inter), inter, floats_of(fresh.inter_scales), inter_scales);
    it = loco_buckets_.emplace(begin, std::move(fresh)).first;
  }
  LocoBucket& lb = it->second;
  // DeepSpeed's loco_idx, tensor by tensor from the bucket's last: a tensor without errors, or
  // reached past reset_T, restarts from zero (its codes cleared) and restarts the count.
  std::vector<int64_t> starts(counts.size(), 0);
  for (size_t d = 1; d < counts.size(); ++d) starts[d] = starts[d - 1] + counts[d - 1];
  int64_t end = total;
  for (size_t t = tensors.size(); t-- > 0;) {
    const int64_t tb = end - tensors[t], te = end;
    end = tb;
    if (lb.live[t] && loco_counter_ <= loco_.reset_T) {
      ++loco_counter_;
      continue;
    }
    loco_counter_ = 0;
    lb.live[t] = 1;
    kernels::clear_errors(codes_of(lb.intra) + tb, te - tb, nullptr, 0);
    int64_t at = 0;  // the tensor's values inside the blocks (m, local)
    for (int m = 0; m < nodes(); ++m) {
      const size_t d = static_cast<size_t>(m * k + local);
      const int64_t lo = std::max(tb, starts[d]), hi = std::min(te, starts[d] + counts[d]);
      if (lo < hi) kernels::clear_errors(codes_of(lb.inter) + at + (lo - starts[d]), hi - lo, nullptr, 0);
      at += counts[d];
    }
    ++loco_counter_;
  }
  return lb;
}

int64_t QuantizedReduceScatter::loco_bytes() const {
  int64_t n = 0;
  for (const auto& [begin, b] : loco_buckets_)
    n += size_of(b.intra) + size_of(b.intra_scales) + size_of(b.inter) + size_of(b.inter_scales);
  return n;
}

void QuantizedReduceScatter::loss_scale_changed(bool overflow, double ratio) {
  if (!overflow && ratio == 1.0) return;
  for (auto& [begin, b] : loco_buckets_) {
    if (overflow) {
      std::fill(b.live.begin(), b.live.end(), 0);
      continue;
    }
    kernels::scale_in_place(floats_of(b.intra_scales), size_of(b.intra_scales) / 4, static_cast<float>(ratio));
    kernels::scale_in_place(floats_of(b.inter_scales), size_of(b.inter_scales) / 4, static_cast<float>(ratio));
  }
}

LocoState QuantizedReduceScatter::loco_state() const {
  LocoState s;
  nlohmann::json meta = {{"counter", loco_counter_}, {"nodes", nodes()}, {"per_node", per_node()},
                         {"buckets", nlohmann::json::array()}};
  const auto append = [](auto& out, const kernels::StagingBuffer& b) {
    const size_t at = out.size();
    out.resize(at + b.size() / sizeof(out[0]));
    kernels::copy_to_host(out.data() + at, b.data(), b.size());
  };
  for (const auto& [begin, b] : loco_buckets_) {
    meta["buckets"].push_back({{"begin", begin}, {"end", b.end}, {"counts", b.counts}, {"tensors", b.tensors},
                               {"live", b.live}, {"intra_scales", size_of(b.intra_scales) / 4},
                               {"inter", size_of(b.inter)}, {"inter_scales", size_of(b.inter_scales) / 4}});
    append(s.codes, b.intra);
    append(s.codes, b.inter);
    append(s.scales, b.intra_scales);
    append(s.scales, b.inter_scales);
  }
  s.meta = meta.dump();
  return s;
}

void QuantizedReduceScatter::set_loco_state(const LocoState& s) {
  const nlohmann::json meta = nlohmann::json::parse(s.meta);
  loco_buckets_.clear();
  loco_counter_ = meta.at("counter").get<int64_t>();
  size_t code = 0, scale = 0;
  const auto take = [](kernels::StagingBuffer& b, const auto& from, size_t& at, int64_t n) {
    if (at + static_cast<size_t>(n) > from.size()) throw InputError("LoCo state: fewer errors saved than its buckets hold");
    fit(b, n * static_cast<int64_t>(sizeof(from[0])));
    kernels::copy_to_device(b.data(), from.data() + at, static_cast<size_t>(n) * sizeof(from[0]));
    at += static_cast<size_t>(n);
  };
  for (const nlohmann::json& j : meta.at("buckets")) {
    LocoBucket b;
    const int64_t begin = j.at("begin").get<int64_t>();
    b.end = j.at("end").get<int64_t>();
    b.counts = j.at("counts").get<std::vector<int64_t>>();
    b.tensors = j.at("tensors").get<std::vector<int64_t>>();
    b.live = j.at("live").get<std::vector<char>>();
    take(b.intra, s.codes, code, b.end - begin);
    take(b.inter, s.codes, code, j.at("inter").get<int64_t>());
    take(b.intra_scales, s.scales, scale, j.at("intra_scales").get<int64_t>());
    take(b.inter_scales, s.scales, scale, j.at("inter_scales").get<int64_t>());
    loco_buckets_.emplace(begin, std::move(b));
  }
}

void QuantizedReduceScatter::reduce(const float* src, const std::vector<int64_t>& counts, int64_t group, float* out,
                                    int64_t begin, const std::vector<int64_t>& tensors) {
  const int k = per_node(), nodes = this->nodes(), local = intra_.rank(), node = inter_.rank();
  const std::vector<QgzBlock> blocks = qgz_blocks(counts, group);
  LocoBucket* lb = loco_on_ ? &loco_bucket(begin, counts, group, tensors) : nullptr;
  const auto block = [&](int m, int l) -> const QgzBlock& { return blocks[static_cast<size_t>(m * k + l)]; };
  std::vector<int64_t> starts(counts.size(), 0);
  for (size_t d = 1; d < counts.size(); ++d) starts[d] = starts[d - 1] + counts[d - 1];

  // 1. Swizzled quantisation: peer l's chunk holds the blocks (m, l) for every node m, in node
  //    order (swizzled_quantize.cu's output_partition = (p mod k)·nodes + p / k).
  std::vector<int64_t> send_values(static_cast<size_t>(k)), send_scales(static_cast<size_t>(k));
  for (int l = 0; l < k; ++l)
    for (int m = 0; m < nodes; ++m) {
      send_values[static_cast<size_t>(l)] += block(m, l).values;
      send_scales[static_cast<size_t>(l)] += block(m, l).scales;
    }
  // What every local peer sends this rank: the blocks (m, local) of every node m.
  int64_t mine_values = 0, mine_scales = 0;
  for (int m = 0; m < nodes; ++m) mine_values += block(m, local).values, mine_scales += block(m, local).scales;
  const QgzStaging need = qgz_staging(blocks, nodes, k, data_rank(), lb != nullptr);
  fit(send_, need.send);
  fit(send_scales_, need.send_scales);
  fit(recv_, need.recv);
  fit(recv_scales_, need.recv_scales);
  fit(sum_, need.sum);
  fit(copy_, need.copy);
  if (lb) {
    fit(err_, need.err);
    fit(comp_, need.comp);
  }
  // LoCo: the kept errors' scales of each block, in data-rank order (step 1) and node order (step 2)
  std::vector<int64_t> intra_scale_at(counts.size(), 0);
  for (size_t d = 1; d < counts.size(); ++d) intra_scale_at[d] = intra_scale_at[d - 1] + blocks[d - 1].scales;
  {
    int64_t v = 0, s = 0;
    for (int l = 0; l < k; ++l)
      for (int m = 0; m < nodes; ++m) {
        const QgzBlock& b = block(m, l);
        const size_t d = static_cast<size_t>(m * k + l);
        quantize_block(src + starts[d], b, group, bytes_of(send_) + v, floats_of(send_scales_) + s,
                       lb ? codes_of(lb->intra) + starts[d] : nullptr, lb ? floats_of(lb->intra_scales) + intra_scale_at[d] : nullptr);
        v += b.values;
        s += b.scales;
      }
  }
  intra_.all_to_all_v(send_.data(), send_values, recv_.data(), std::vector<int64_t>(static_cast<size_t>(k), mine_values),
                      DType::U8);
  intra_.all_to_all_v(send_scales_.data(), send_scales, recv_scales_.data(),
                      std::vector<int64_t>(static_cast<size_t>(k), mine_scales), DType::F32);

  // 2. Each block (m, local): the k copies dequantised and added in peer order, requantised into
  //    node m's place of the inter-node send.
  std::vector<int64_t> inter_values(static_cast<size_t>(nodes)), inter_scales(static_cast<size_t>(nodes));
  {
    int64_t v = 0, s = 0, at = 0;  // at: the block's values in LoCo's step-2 errors
    for (int m = 0; m < nodes; ++m) {
      const QgzBlock& b = block(m, local);
      for (int j = 0; j < k; ++j)
        add_copy(bytes_of(recv_) + j * mine_values + v, floats_of(recv_scales_) + j * mine_scales + s, b, group,
                 floats_of(sum_), j == 0);
      quantize_block(floats_of(sum_), b, group, bytes_of(send_) + v, floats_of(send_scales_) + s,
                     lb ? codes_of(lb->inter) + at : nullptr, lb ? floats_of(lb->inter_scales) + s : nullptr);
      inter_values[static_cast<size_t>(m)] = b.values;
      inter_scales[static_cast<size_t>(m)] = b.scales;
      v += b.values;
      s += b.scales;
      at += b.count;
    }
  }
  const QgzBlock& own = block(node, local);
  inter_.all_to_all_v(send_.data(), inter_values, recv_.data(), std::vector<int64_t>(static_cast<size_t>(nodes), own.values),
                      DType::U8);
  inter_.all_to_all_v(send_scales_.data(), inter_scales, recv_scales_.data(),
                      std::vector<int64_t>(static_cast<size_t>(nodes), own.scales), DType::F32);

  // 3. This rank's block: every node's copy dequantised and added in node order.
  for (int m = 0; m < nodes; ++m)
    add_copy(bytes_of(recv_) + m * own.values, floats_of(recv_scales_) + m * own.scales, own, group, out, m == 0);
}

}  // namespace zero3d

// quantized_reduce_scatter.cpp — qgZ's hierarchical all-to-all reduce-scatter (see the header)
// over the Communicator interface, so its bytes are counted and logged as every other
// collective's, intra-node or inter-node by the group that moves them.
#include "parallel/quantized_reduce_scatter.hpp"
#include "parallel/staging.hpp"

#include <algorithm>

#include "kernels/elementwise.hpp"
#include "kernels/quantize_int4.hpp"

namespace zero3d {

namespace {

uint8_t* bytes_of(kernels::StagingBuffer& b) { return reinterpret_cast<uint8_t*>(b.data()); }
float* floats_of(kernels::StagingBuffer& b) { return reinterpret_cast<float*>(b.data()); }

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
}

QgzStaging qgz_staging(const std::vector<QgzBlock>& blocks, int nodes, int per_node, int d) {
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
  return s;
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
                              copy_.size());
}

void QuantizedReduceScatter::reduce(const float* src, const std::vector<int64_t>& counts, int64_t group, float* out) {
  const int k = per_node(), nodes = this->nodes(), local = intra_.rank(), node = inter_.rank();
  const std::vector<QgzBlock> blocks = qgz_blocks(counts, group);
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
  const QgzStaging need = qgz_staging(blocks, nodes, k, data_rank());
  fit(send_, need.send);
  fit(send_scales_, need.send_scales);
  fit(recv_, need.recv);
  fit(recv_scales_, need.recv_scales);
  fit(sum_, need.sum);
  fit(copy_, need.copy);
  {
    int64_t v = 0, s = 0;
    for (int l = 0; l < k; ++l)
      for (int m = 0; m < nodes; ++m) {
        const QgzBlock& b = block(m, l);
        kernels::quantize_int4(src + starts[static_cast<size_t>(m * k + l)], b.count, b.phase, group, bytes_of(send_) + v,
                               floats_of(send_scales_) + s);
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
    int64_t v = 0, s = 0;
    for (int m = 0; m < nodes; ++m) {
      const QgzBlock& b = block(m, local);
      for (int j = 0; j < k; ++j)
        add_copy(bytes_of(recv_) + j * mine_values + v, floats_of(recv_scales_) + j * mine_scales + s, b, group,
                 floats_of(sum_), j == 0);
      kernels::quantize_int4(floats_of(sum_), b.count, b.phase, group, bytes_of(send_) + v, floats_of(send_scales_) + s);
      inter_values[static_cast<size_t>(m)] = b.values;
      inter_scales[static_cast<size_t>(m)] = b.scales;
      v += b.values;
      s += b.scales;
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

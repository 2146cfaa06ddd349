// quantized_frozen.cpp — zero_quantized_nontrainable_weights (see quantized_frozen.hpp): the
// plans every rank computes alike, and the ZeRO optimizer's int8 store of its frozen pieces.
#include "zero/quantized_frozen.hpp"

#include <algorithm>
#include <cmath>

#include "base/errors.hpp"
#include "kernels/memory.hpp"
#include "kernels/quantize.hpp"
#include "zero/model_memory_io.hpp"
#include "zero/zero.hpp"

namespace zero3d {

using zero_io::in_model_memory;
using zero_io::packed_pieces;

namespace {
int64_t pad8(int64_t bytes) { return (bytes + 7) / 8 * 8; }
}  // namespace

int64_t FrozenPiece::span_end() const { return std::min(tensor_end, tensor_begin + (first_group + groups) * group); }

std::vector<FrozenPiece> frozen_pieces(const ParamLayout& layout, const StateTypes& types, int64_t lo, int64_t hi) {
  std::vector<FrozenPiece> out;
  const std::vector<TensorSpec>& tensors = layout.tensors();
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (!types.frozen(i)) continue;
    const TensorSpec& t = tensors[i];
    const int64_t a = std::max(lo, t.offset), b = std::min(hi, t.offset + t.numel);
    if (a >= b) continue;
    FrozenPiece p;
    p.begin = a;
    p.count = b - a;
    p.tensor_begin = t.offset;
    p.tensor_end = t.offset + t.numel;
    p.group = kernels::quant_padded(t.numel) / kernels::quant_groups(t.numel);
    p.first_group = (a - t.offset) / p.group;
    p.groups = (b - 1 - t.offset) / p.group - p.first_group + 1;
    out.push_back(p);
  }
  return out;
}

int64_t quantized_frozen_partition_bytes(const ParamLayout& layout, const StateTypes& types, const Partition& part,
                                         int r, int64_t param_size) {
  const int64_t lo = part.begin(r), hi = std::min(part.end(r), layout.total());
  int64_t bytes = 0;
  for (const auto& [a, b] : trainable_ranges(layout, types, lo, std::max(lo, hi))) bytes += param_size * (b - a);
  for (const FrozenPiece& p : frozen_pieces(layout, types, lo, hi)) bytes += p.bytes();
  return bytes;
}

FrozenGatherPlan frozen_gather_plan(const ParamLayout& layout, const StateTypes& types, const Partition& part,
                                    const ParamUnit& unit, bool quantize_trainable) {
  FrozenGatherPlan plan;
  const auto es = static_cast<int64_t>(dtype_size(types.param));
  for (int r = 0; r < part.world; ++r) {
    const auto [lo, hi] = part.owned(r, unit.offset, unit.offset + unit.numel);
    std::vector<std::pair<int64_t, int64_t>> ranges;
    int64_t n = 0;
    for (const auto& [a, b] : trainable_ranges(layout, types, lo, hi)) {
      ranges.emplace_back(lo + a, lo + b);
      n += b - a;
    }
    int64_t bytes = n == 0 ? 0 : pad8(quantize_trainable ? kernels::quantized_bytes(n) : n * es);
    std::vector<FrozenPiece> frozen = frozen_pieces(layout, types, lo, hi);
    plan.widest = std::max(plan.widest, n);
    for (const FrozenPiece& p : frozen) {
      bytes += p.bytes();
      plan.widest = std::max(plan.widest, p.count);
    }
    bytes = pad8(bytes);
    plan.at.push_back(plan.total);
    plan.bytes.push_back(bytes);
    plan.total += bytes;
    plan.trainable.push_back(std::move(ranges));
    plan.trainable_count.push_back(n);
    plan.frozen.push_back(std::move(frozen));
  }
  return plan;
}

// --- the ZeRO optimizer's store ------------------------------------------------------------

void ZeroOptimizer::setup_quantized_frozen() {
  const int64_t total = layout_.total();
  const auto [lo, hi] = part_.owned(rank_, 0, total);
  frozen_store_pieces_ = frozen_pieces(layout_, types_, lo, hi);
  int64_t bytes = 0;
  for (const FrozenPiece& p : frozen_store_pieces_) {
    // The gathers take a unit's pieces from here whole: a frozen tensor lies inside one unit.
    const bool inside = std::any_of(units_.begin(), units_.end(), [&](const ParamUnit& u) {
      return u.offset <= p.tensor_begin && p.tensor_end <= u.offset + u.numel;
    });
    if (!inside) throw std::logic_error("a frozen tensor crosses a stage-3 unit boundary");
    frozen_store_at_.push_back(bytes);
    bytes += p.bytes();
  }
  // bytes() is a multiple of 4: the store is held as 4-byte words (TypedBuffer's smallest type)
  frozen_store_ = TypedBuffer("frozen_int8_partition", DType::F32, bytes / 4);
  for (const ParamUnit& u : units_)
    frozen_plans_.push_back(frozen_gather_plan(layout_, types_, part_, u, cfg_.quantized_weights));
}

// Fills this rank's partition from global values: the trainable elements into the packed model-
// dtype parameters (and the fp32 master copy), each frozen piece quantised from its touched groups
// whole, rounded to the model dtype first (DeepSpeed quantises the ds_tensor, which holds the
// model dtype) and widened to fp32 as qwZ's kernel reads it.
void ZeroOptimizer::load_quantized_partition(const std::function<void(float*, int64_t, int64_t)>& values) {
  const int64_t pb = part_.begin(rank_);
  std::vector<float> chunk;
  packed_pieces(*trainable_, 0, part_.part, [&](int64_t x, int64_t packed, int64_t c) {
    for (int64_t a = 0; a < c; a += kInitFillElems) {
      const int64_t n = std::min(c - a, kInitFillElems);
      chunk.resize(static_cast<size_t>(n));
      values(chunk.data(), pb + x + a, pb + x + a + n);
      const float* v = in_model_memory(chunk.data(), n, staging_);
      convert_any(params_.at(packed + a), types_.param, v, DType::F32, n);
      if (mixed_) convert_any(master_.data() + packed + a, DType::F32, v, DType::F32, n);
    }
  });
  const auto es = static_cast<int64_t>(dtype_size(types_.param));
  for (size_t i = 0; i < frozen_store_pieces_.size(); ++i) {
    const FrozenPiece& p = frozen_store_pieces_[i];
    char* store = static_cast<char*>(frozen_store_.data()) + frozen_store_at_[i];
    // The touched groups a bounded run of whole groups at a time, in a transient buffer (not the
    // gathers' pool): values, rounded to the model dtype, widened, and their codes.
    const int64_t step = std::max<int64_t>(1, kInitFillElems / p.group) * p.group;
    const int64_t first = p.span_begin(), last = p.span_end();
    const int64_t most = std::min(step, last - first);
    kernels::StagingBuffer span(static_cast<size_t>(most * (4 + es + 1)));
    auto* widened = reinterpret_cast<float*>(span.data());
    void* rounded = span.data() + 4 * most;
    auto* codes = reinterpret_cast<int8_t*>(span.data() + (4 + es) * most);
    for (int64_t a = first; a < last; a += step) {
      const int64_t n = std::min(step, last - a);
      chunk.resize(static_cast<size_t>(n));
      values(chunk.data(), a, a + n);
      convert_any(rounded, types_.param, in_model_memory(chunk.data(), n, staging_), DType::F32, n);
      convert_any(widened, DType::F32, rounded, types_.param, n);
      // a run starts at a group's start: its scales go to their place among the piece's
      kernels::quantize_int8_groups(widened, n, 0, p.group, codes, reinterpret_cast<float*>(store) + (a - first) / p.group);
      const int64_t x = std::max(a, p.begin), y = std::min(a + n, p.begin + p.count);
      if (x < y) kernels::copy_on_device(store + 4 * p.groups + (x - p.begin), codes + (x - a), static_cast<size_t>(y - x));
    }
  }
}

// Rank r's frozen piece (scales then codes, as stored) dequantised into n fp32 values at out.
namespace {
void dequantize_piece(const FrozenPiece& p, const char* bytes, float* out) {
  kernels::dequantize_int8_groups(reinterpret_cast<const int8_t*>(bytes + 4 * p.groups),
                                  reinterpret_cast<const float*>(bytes), p.count, p.phase(), p.group, out);
}
}  // namespace

void ZeroOptimizer::start_frozen_gather(int u, Gathered& g) {
  const FrozenGatherPlan& plan = frozen_plans_[static_cast<size_t>(u)];
  const ParamUnit& unit = units_[static_cast<size_t>(u)];
  g.frozen = u;
  g.packed = gather_staging_.take(plan.total);
  char* out = g.packed.data() + plan.at[static_cast<size_t>(rank_)];
  const int64_t n = plan.trainable_count[static_cast<size_t>(rank_)];
  if (n > 0) {  // this rank's trainable elements of the unit lie back to back in the packed parameters
    const int64_t pb = part_.begin(rank_);
    const auto [lo, hi] = part_.owned(rank_, unit.offset, unit.offset + unit.numel);
    int64_t first = -1;
    packed_pieces(*trainable_, lo - pb, hi - lo, [&](int64_t, int64_t packed, int64_t) {
      if (first < 0) first = packed;
    });
    if (!cfg_.quantized_weights) {
      convert_any(out, types_.param, params_.at(first), types_.param, n);
      out += pad8(n * static_cast<int64_t>(dtype_size(types_.param)));
    } else {  // qwZ quantises the trainable values as it quantises a whole slice (quantized_gather.cpp)
      kernels::StagingBuffer widened = gather_staging_.take(4 * n);
      convert_any(widened.data(), DType::F32, params_.at(first), types_.param, n);
      kernels::quantize_int8(reinterpret_cast<const float*>(widened.data()), n, reinterpret_cast<int8_t*>(out),
                             reinterpret_cast<float*>(out + kernels::quant_padded(n)));
      gather_staging_.give_back(std::move(widened));
      out += pad8(kernels::quantized_bytes(n));
    }
  }
  for (const FrozenPiece& p : plan.frozen[static_cast<size_t>(rank_)]) {
    const auto it = std::find_if(frozen_store_pieces_.begin(), frozen_store_pieces_.end(),
                                 [&](const FrozenPiece& s) { return s.begin == p.begin; });
    const int64_t at = frozen_store_at_[static_cast<size_t>(it - frozen_store_pieces_.begin())];
    kernels::copy_on_device(out, static_cast<const char*>(frozen_store_.data()) + at, static_cast<size_t>(p.bytes()));
    out += p.bytes();
  }
  g.pending = dp_.all_gather_v_async(g.packed.data(), plan.bytes, plan.at, DType::U8);
}

// Every rank's slice, this rank's own included, into the unit: the frozen pieces dequantised in
// fp32 and rounded to the model dtype (as qwZ's unpack_quantized), so all ranks compute alike.
void ZeroOptimizer::unpack_frozen(int u, Gathered& g) {
  const FrozenGatherPlan& plan = frozen_plans_[static_cast<size_t>(u)];
  const ParamUnit& unit = units_[static_cast<size_t>(u)];
  const auto es = static_cast<int64_t>(dtype_size(types_.param));
  kernels::StagingBuffer wide;
  if (types_.param != DType::F32 || cfg_.quantized_weights) wide = gather_staging_.take(4 * plan.widest);
  float* fp32 = reinterpret_cast<float*>(wide.data());
  for (size_t r = 0; r < plan.bytes.size(); ++r) {
    const char* in = g.packed.data() + plan.at[r];
    const int64_t n = plan.trainable_count[r];
    if (n > 0) {
      const char* values = in;
      DType type = types_.param;
      if (cfg_.quantized_weights) {
        kernels::dequantize_int8(reinterpret_cast<const int8_t*>(in),
                                 reinterpret_cast<const float*>(in + kernels::quant_padded(n)), n, fp32);
        values = reinterpret_cast<const char*>(fp32);
        type = DType::F32;
        in += pad8(kernels::quantized_bytes(n));
      } else {
        in += pad8(n * es);
      }
      const auto vs = static_cast<int64_t>(dtype_size(type));
      for (const auto& [a, b] : plan.trainable[r]) {
        convert_any(g.buffer.at(a - unit.offset), types_.param, values, type, b - a);
        values += (b - a) * vs;
      }
    }
    for (const FrozenPiece& p : plan.frozen[r]) {
      void* dst = g.buffer.at(p.begin - unit.offset);
      if (types_.param == DType::F32) {
        dequantize_piece(p, in, static_cast<float*>(dst));
      } else {
        dequantize_piece(p, in, fp32);
        convert_any(dst, types_.param, fp32, DType::F32, p.count);
      }
      in += p.bytes();
    }
  }
  gather_staging_.give_back(std::move(wide));
  gather_staging_.give_back(std::move(g.packed));
  g.frozen = -1;
}

// A checkpoint's "params" over this rank's range: the trainable values (the fp32 master, or the
// parameters widened) and the frozen pieces dequantised in fp32 (what `zero3d convert` gives).
void ZeroOptimizer::quantized_partition_values(float* s) {
  const int64_t pb = part_.begin(rank_);
  const std::pair<int64_t, int64_t> range = part_.owned(rank_, 0, layout_.total());
  const int64_t lo = range.first, hi = range.second;  // plain names: the lambda captures lo (nvcc: bindings are C++20)
  zero_any(s, DType::F32, hi - lo);
  packed_pieces(*trainable_, lo - pb, hi - lo, [&](int64_t x, int64_t packed, int64_t c) {
    if (mixed_) convert_any(s + (x - (lo - pb)), DType::F32, master_.data() + packed, DType::F32, c);
    else convert_any(s + (x - (lo - pb)), DType::F32, params_.at(packed), types_.param, c);
  });
  for (size_t i = 0; i < frozen_store_pieces_.size(); ++i)
    dequantize_piece(frozen_store_pieces_[i], static_cast<const char*>(frozen_store_.data()) + frozen_store_at_[i],
                     s + (frozen_store_pieces_[i].begin - lo));
}

// The int8 store itself, for a checkpoint: the codes and scales this rank holds, and the pieces
// they belong to (a resume at the same pieces restores them bit for bit).
std::optional<RankState> ZeroOptimizer::quantized_frozen_state() const {
  if (!quantized_frozen_) return std::nullopt;
  RankState st;
  st.name = "quantized_frozen";
  std::vector<char> bytes(static_cast<size_t>(frozen_store_.bytes()));
  kernels::copy_to_host(bytes.data(), frozen_store_.data(), bytes.size());
  std::string pieces;
  for (size_t i = 0; i < frozen_store_pieces_.size(); ++i) {
    const FrozenPiece& p = frozen_store_pieces_[i];
    const char* at = bytes.data() + frozen_store_at_[i];
    const auto* scales = reinterpret_cast<const float*>(at);
    st.scales.insert(st.scales.end(), scales, scales + p.groups);
    const auto* codes = reinterpret_cast<const int8_t*>(at + 4 * p.groups);
    st.codes.insert(st.codes.end(), codes, codes + p.count);
    pieces += (pieces.empty() ? "" : ",") + std::string("[") + std::to_string(p.begin) + "," +
              std::to_string(p.count) + "," + std::to_string(p.group) + "," + std::to_string(p.groups) + "," +
              std::to_string(p.span_begin()) + "]";
  }
  st.meta = "{\"pieces\":[" + pieces + "]}";
  return st;
}

bool ZeroOptimizer::restore_quantized_frozen(const RankState& saved) {
  const std::optional<RankState> mine = quantized_frozen_state();
  if (!mine || mine->meta != saved.meta || mine->codes.size() != saved.codes.size() ||
      mine->scales.size() != saved.scales.size())
    return false;
  std::vector<char> bytes(static_cast<size_t>(frozen_store_.bytes()), 0);
  size_t code = 0, scale = 0;
  for (size_t i = 0; i < frozen_store_pieces_.size(); ++i) {
    const FrozenPiece& p = frozen_store_pieces_[i];
    char* at = bytes.data() + frozen_store_at_[i];
    std::copy_n(saved.scales.begin() + static_cast<std::ptrdiff_t>(scale), p.groups, reinterpret_cast<float*>(at));
    std::copy_n(saved.codes.begin() + static_cast<std::ptrdiff_t>(code), p.count, reinterpret_cast<int8_t*>(at + 4 * p.groups));
    scale += static_cast<size_t>(p.groups);
    code += static_cast<size_t>(p.count);
  }
  kernels::copy_to_device(frozen_store_.data(), bytes.data(), bytes.size());
  return true;
}

// Another world size: the groups are the tensors' (quantized_frozen.hpp), so the saved scales
// still apply, wherever they were saved (`scales`: by each group's first global element), and the
// codes are the saved dequantised values divided by their scale (q·scale / scale rounds back to q
// for |q| <= 128). False, leaving the store as it is, when a touched group has no saved scale.
bool ZeroOptimizer::restore_quantized_frozen_scales(const std::map<int64_t, float>& scales, const RangeReader& read) {
  std::vector<char> bytes(static_cast<size_t>(frozen_store_.bytes()), 0);
  std::vector<float> values;
  for (size_t i = 0; i < frozen_store_pieces_.size(); ++i) {
    const FrozenPiece& p = frozen_store_pieces_[i];
    char* at = bytes.data() + frozen_store_at_[i];
    auto* scale = reinterpret_cast<float*>(at);
    for (int64_t g = 0; g < p.groups; ++g) {
      const auto it = scales.find(p.span_begin() + g * p.group);
      if (it == scales.end()) return false;
      scale[g] = it->second;
    }
    values.resize(static_cast<size_t>(p.count));
    read("params", p.begin, p.begin + p.count, values.data());
    auto* codes = reinterpret_cast<int8_t*>(at + 4 * p.groups);
    for (int64_t k = 0; k < p.count; ++k) {
      const float q = std::nearbyint(values[static_cast<size_t>(k)] / scale[(p.phase() + k) / p.group]);
      codes[k] = static_cast<int8_t>(q > 127.0f ? 127.0f : q < -128.0f ? -128.0f : q);
    }
  }
  kernels::copy_to_device(frozen_store_.data(), bytes.data(), bytes.size());
  return true;
}

}  // namespace zero3d

// weights.cpp — HDF5 and safetensors readers for initial weights.
#include "weights.hpp"

#include <algorithm>
#include <cstring>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "base.hpp"
#include "h5.hpp"
#include "input_file.hpp"

namespace zero3d {

namespace {

std::string shape_str(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? "," : "") + std::to_string(s[i]);
  return out + "]";
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

float half_to_float(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: renormalise
      int e = -1;
      uint32_t m = mant;
      do {
        ++e;
        m <<= 1;
      } while ((m & 0x400u) == 0);
      bits = sign | ((127 - 15 - e) << 23) | ((m & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

using Tensors = std::vector<const TensorSpec*>;

// Weight files of any real model fit; the bound only stops a device or a runaway file.
constexpr int64_t kMaxWeightFileBytes = int64_t(1) << 42;
constexpr int64_t kMaxIndexBytes = int64_t(64) << 20;

// The non-negative integer list at `field` of a safetensors entry, or InputError naming it.
std::vector<int64_t> header_ints(const std::string& path, const std::string& tensor, const nlohmann::json& entry,
                                 const char* field) {
  auto it = entry.find(field);
  if (it == entry.end()) throw InputError(path + ": tensor `" + tensor + "`: field `" + field + "` is missing");
  const bool ok = it->is_array() && it->size() <= 8 &&
                  std::all_of(it->begin(), it->end(), [](const nlohmann::json& x) {
                    return x.is_number_unsigned() && x.get<uint64_t>() <= uint64_t(1) << 62;
                  });
  if (!ok)
    throw InputError(path + ": tensor `" + tensor + "`: field `" + field + "` must be a list of non-negative integers, got " +
                     echo(it->dump(-1, ' ', false, nlohmann::json::error_handler_t::replace), 60));
  return it->get<std::vector<int64_t>>();
}

void load_hdf5(const std::string& path, const Tensors& tensors, float* params) {
  regular_file_size(path, "weights file (model.init_from)", kMaxWeightFileBytes);
  h5::File f = h5::File::open_read(path);
  for (const TensorSpec* tp : tensors) {
    const TensorSpec& t = *tp;
    std::string name = t.name;
    if (!f.has(name) && f.has("transformer." + name)) name = "transformer." + name;
    if (!f.has(name)) throw InputError(path + ": tensor `" + t.name + "` is missing (model.init_from)");
    if (f.shape(name) != t.shape)
      throw InputError(path + ": tensor `" + t.name + "` has shape " + shape_str(f.shape(name)) + ", the model needs " +
                       shape_str(t.shape));
    std::vector<float> data = f.read_floats(name);
    std::memcpy(params + t.offset, data.data(), data.size() * sizeof(float));
  }
}

void load_safetensors(const std::string& path, const Tensors& tensors, float* params) {
  const int64_t file_size = regular_file_size(path, "weights file (model.init_from)", kMaxWeightFileBytes);
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InputError(path + ": file not found (model.init_from)");
  uint64_t header_len = 0;
  // Checked against the file before allocating the header.
  if (!in.read(reinterpret_cast<char*>(&header_len), 8) || header_len > (1ull << 30) ||
      header_len > uint64_t(file_size - 8))
    throw InputError(path + ": not a safetensors file (bad header length)");
  std::string header(header_len, '\0');
  if (!in.read(header.data(), static_cast<std::streamsize>(header_len)))
    throw InputError(path + ": truncated safetensors header");
  nlohmann::json meta;
  try {
    meta = nlohmann::json::parse(header);
  } catch (const nlohmann::json::exception&) {
    throw InputError(path + ": safetensors header is not valid JSON");
  }
  if (!meta.is_object()) throw InputError(path + ": safetensors header is not a JSON object");
  const std::streamoff data_start = 8 + static_cast<std::streamoff>(header_len);
  const int64_t data_bytes = file_size - static_cast<int64_t>(data_start);
  for (const TensorSpec* tp : tensors) {
    const TensorSpec& t = *tp;
    std::string name = t.name;
    if (!meta.contains(name) && meta.contains("transformer." + name)) name = "transformer." + name;
    if (!meta.contains(name)) throw InputError(path + ": tensor `" + t.name + "` is missing (model.init_from)");
    const auto& e = meta[name];
    if (!e.is_object())
      throw InputError(path + ": tensor `" + t.name + "`: header entry must be an object with dtype, shape and "
                       "data_offsets, got " + echo(e.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace), 60));
    auto dt = e.find("dtype");
    if (dt == e.end() || !dt->is_string())
      throw InputError(path + ": tensor `" + t.name + "`: field `dtype` must be a string such as \"F32\"");
    const std::string dtype = dt->get<std::string>();
    const std::vector<int64_t> shape = header_ints(path, t.name, e, "shape");
    if (shape != t.shape)
      throw InputError(path + ": tensor `" + t.name + "` has shape " + shape_str(shape) + ", the model needs " +
                       shape_str(t.shape));
    const std::vector<int64_t> offsets = header_ints(path, t.name, e, "data_offsets");
    const int64_t width = dtype == "F32" ? 4 : (dtype == "F16" || dtype == "BF16") ? 2 : 0;
    if (width == 0)
      throw InputError(path + ": tensor `" + t.name + "` has dtype " + echo(dtype, 20) + " (need F32, F16 or BF16)");
    if (offsets.size() != 2 || offsets[1] < offsets[0] || offsets[1] - offsets[0] != width * t.numel)
      throw InputError(path + ": tensor `" + t.name + "` has inconsistent data_offsets");
    if (offsets[1] > data_bytes)
      throw InputError(path + ": tensor `" + t.name + "` runs past the end of the file");
    std::vector<char> raw(static_cast<size_t>(width * t.numel));
    in.seekg(data_start + offsets[0]);
    if (!in.read(raw.data(), static_cast<std::streamsize>(raw.size())))
      throw InputError(path + ": tensor `" + t.name + "` runs past the end of the file");
    float* dst = params + t.offset;
    for (int64_t i = 0; i < t.numel; ++i) {
      if (width == 4) {
        std::memcpy(dst + i, raw.data() + 4 * i, 4);
      } else {
        uint16_t h;
        std::memcpy(&h, raw.data() + 2 * i, 2);
        if (dtype == "BF16") {
          uint32_t bits = static_cast<uint32_t>(h) << 16;
          std::memcpy(dst + i, &bits, 4);
        } else {
          dst[i] = half_to_float(h);
        }
      }
    }
  }
}

}  // namespace

namespace {

void load_file(const std::string& path, const Tensors& tensors, float* params) {
  if (ends_with(path, ".safetensors")) return load_safetensors(path, tensors, params);
  load_hdf5(path, tensors, params);
}

// Hugging Face's sharded layout: {"weight_map": {tensor name: file next to the index}}.
void load_sharded(const std::string& index, const ParamLayout& layout, float* params) {
  const std::string text = read_regular_file(index, "weights index (model.init_from)", kMaxIndexBytes);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception&) {
    throw InputError(index + ": not valid JSON");
  }
  if (!j.contains("weight_map") || !j["weight_map"].is_object()) throw InputError(index + ": no \"weight_map\"");
  const std::string dir = index.find('/') == std::string::npos ? "" : index.substr(0, index.find_last_of('/') + 1);
  std::map<std::string, Tensors> by_file;
  for (const TensorSpec& t : layout.tensors()) {
    auto it = j["weight_map"].find(t.name);
    if (it == j["weight_map"].end()) it = j["weight_map"].find("transformer." + t.name);
    if (it == j["weight_map"].end()) throw InputError(index + ": tensor `" + t.name + "` is missing from weight_map");
    if (!it->is_string()) throw InputError(index + ": weight_map entry `" + t.name + "` must be a file name (a string)");
    by_file[dir + it->get<std::string>()].push_back(&t);
  }
  for (const auto& [file, tensors] : by_file) load_file(file, tensors, params);
}

}  // namespace

void load_weights(const std::string& path, const ParamLayout& layout, float* params) {
  if (ends_with(path, ".index.json")) return load_sharded(path, layout, params);
  Tensors all;
  for (const TensorSpec& t : layout.tensors()) all.push_back(&t);
  load_file(path, all, params);
}


void save_weights_hdf5(const std::string& path, const ParamLayout& layout, const float* params) {
  h5::File f = h5::File::create(path);
  for (const TensorSpec& t : layout.tensors()) f.write_floats(t.name, params + t.offset, t.shape);
}

}  // namespace zero3d

// weights.cpp — HDF5 and safetensors readers for initial weights.
//
// Every load runs in three passes: open the file(s) and list their tensors; check each tensor
// the model takes (entry fields, dtype, shape) and that the names are exactly the model's; only
// then read the data. So a file that does not fit is reported whole, before anything is read.
#include "io/weights.hpp"

#include <algorithm>
#include <cctype>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <tuple>

#include "base/errors.hpp"
#include "base/input_file.hpp"
#include "io/h5.hpp"
#include "kernels/half.hpp"

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

// Weight files of any real model fit; the bound only stops a device or a runaway file.
constexpr int64_t kMaxWeightFileBytes = int64_t(1) << 42;
constexpr int64_t kMaxIndexBytes = int64_t(64) << 20;
// Names listed in a message about missing or extra tensors; the rest are counted.
constexpr size_t kNamesShown = 5;

// One tensor the model takes from a file: its place in the layout and its key in the file.
struct Wanted {
  const TensorSpec* spec;
  std::string key;
};

// The length of a block tensor's layer prefix: GPT-2's "h." or the Llama family's "model.layers.".
size_t layer_prefix(const std::string& name) {
  if (name.compare(0, 2, "h.") == 0) return 2;
  if (name.compare(0, 13, "model.layers.") == 0) return 13;
  return 0;
}

// The layer number of "h.<N>.…" (or "model.layers.<N>.…"), or -1.
int64_t layer_of(const std::string& name) {
  const size_t first = layer_prefix(name);
  if (first == 0) return -1;
  size_t end = first;
  while (end < name.size() && end < first + 10 && std::isdigit(static_cast<unsigned char>(name[end]))) ++end;
  if (end == first || end >= name.size() || name[end] != '.') return -1;
  return std::stoll(name.substr(first, end - first));
}

// A block tensor's name after its layer: "attn.c_attn.weight", "self_attn.q_proj.weight".
std::string within_layer(const std::string& name) { return name.substr(name.find('.', layer_prefix(name)) + 1); }

// Hugging Face GPT-2 files also hold the tied LM head and the causal-mask buffers, and older
// Llama files RoPE's inv_freq buffer (rotary_emb.inv_freq, persistent before transformers 4.31):
// none is a weight. An untied head's lm_head.weight is in the model's layout, so it is read.
bool is_ignored(const std::string& name, const ParamLayout& layout) {
  if (name == "lm_head.weight") return !layout.find(name);
  if (layer_of(name) < 0) return false;
  const std::string rest = within_layer(name);
  return rest == "attn.bias" || rest == "attn.masked_bias" || rest == "self_attn.rotary_emb.inv_freq";
}

// Extra names in the order a GPT-2 layout has them: by layer (h.2 before h.10), within a layer
// in the model's block order, then the rest by name.
void sort_like_the_layout(std::vector<std::string>& names, const ParamLayout& layout) {
  auto key = [&](const std::string& name) {
    const int64_t layer = layer_of(name);
    if (layer < 0) return std::make_tuple(int64_t(1), int64_t(0), int64_t(0), name);
    const std::string rest = within_layer(name);
    const TensorSpec* in_block = layout.find(name.substr(0, layer_prefix(name)) + "0." + rest);
    return std::make_tuple(int64_t(0), layer, in_block ? in_block->offset : layout.total(), rest);
  };
  std::sort(names.begin(), names.end(), [&](const std::string& a, const std::string& b) { return key(a) < key(b); });
}

std::string name_list(const std::vector<std::string>& names) {
  std::string out;
  for (size_t k = 0; k < names.size() && k < kNamesShown; ++k) out += (k ? ", " : "") + echo(names[k], 60);
  if (names.size() > kNamesShown) out += " and " + std::to_string(names.size() - kNamesShown) + " more";
  return out;
}

// The tensors of a file by Hugging Face name ("transformer." prefix stripped) -> key in the file.
class KeyMap {
 public:
  void add(const std::string& key, const std::string& where) {
    const std::string name = key.compare(0, 12, "transformer.") == 0 ? key.substr(12) : key;
    auto [it, fresh] = keys_.emplace(name, key);
    if (!fresh)
      throw InputError(where + ": holds tensor `" + echo(name, 60) + "` twice (as `" + echo(it->second, 60) +
                       "` and `" + echo(key, 60) + "`)");
  }
  const std::map<std::string, std::string>& keys() const { return keys_; }

 private:
  std::map<std::string, std::string> keys_;
};

// InputError unless the file's tensor names are exactly the model's (ignored names aside).
void check_names(const std::string& where, const ParamLayout& layout, const std::map<std::string, std::string>& keys) {
  std::vector<std::string> missing, extra;
  int64_t model_layers = 0, file_layers = 0;
  for (const TensorSpec& t : layout.tensors()) {
    model_layers = std::max(model_layers, layer_of(t.name) + 1);
    if (!keys.count(t.name)) missing.push_back(t.name);
  }
  for (const auto& [name, key] : keys) {
    if (is_ignored(name, layout)) continue;
    file_layers = std::max(file_layers, layer_of(name) + 1);
    if (!layout.find(name)) extra.push_back(name);
  }
  if (missing.empty() && extra.empty()) return;
  sort_like_the_layout(extra, layout);
  std::string what;
  if (!missing.empty())
    what = std::to_string(missing.size()) + " of the model's tensors " + (missing.size() == 1 ? "is" : "are") +
           " missing: " + name_list(missing);
  if (!extra.empty())
    what += (what.empty() ? "" : "; ") + std::to_string(extra.size()) + " tensor" + (extra.size() == 1 ? "" : "s") +
            " that the model does not have: " + name_list(extra);
  if (file_layers != model_layers)
    what += " (the file has " + std::to_string(file_layers) + " layers, the model n_layer " +
            std::to_string(model_layers) + ")";
  throw InputError(where + ": " + what + " (model.init_from)");
}

// One weights file: its tensors by name, a check of one wanted tensor, and the read.
class WeightsFile {
 public:
  virtual ~WeightsFile() = default;
  const std::map<std::string, std::string>& keys() const { return keys_.keys(); }
  // InputError naming the file and tensor unless `w` can be read as the model needs it.
  virtual void check(const Wanted& w) const = 0;
  virtual void read(const Wanted& w, float* params) const = 0;

 protected:
  KeyMap keys_;
};

class Hdf5Weights : public WeightsFile {
 public:
  explicit Hdf5Weights(const std::string& path) : path_(path), file_(h5::File::open_read(path)) {
    // Tensors are the datasets at the root (a checkpoint's index.h5 keeps optimizer moments in groups).
    std::vector<std::string> names;
    H5Literate(file_.id(), H5_INDEX_NAME, H5_ITER_INC, nullptr, collect_name, &names);
    for (const std::string& name : names) {
      h5::Handle obj(H5Oopen(file_.id(), name.c_str(), H5P_DEFAULT), H5Oclose);
      if (obj.valid() && H5Iget_type(obj.get()) == H5I_DATASET) keys_.add(name, path_);
    }
  }
  void check(const Wanted& w) const override {
    const std::vector<int64_t> shape = file_.shape(w.key);
    if (shape != w.spec->shape)
      throw InputError(path_ + ": tensor `" + w.spec->name + "` has shape " + shape_str(shape) + ", the model needs " +
                       shape_str(w.spec->shape));
  }
  void read(const Wanted& w, float* params) const override {
    const std::vector<float> data = file_.read_floats(w.key);
    std::memcpy(params + w.spec->offset, data.data(), data.size() * sizeof(float));
  }

 private:
  static herr_t collect_name(hid_t, const char* name, const H5L_info_t*, void* out) {
    static_cast<std::vector<std::string>*>(out)->push_back(name);
    return 0;
  }
  std::string path_;
  h5::File file_;
};

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

class SafetensorsWeights : public WeightsFile {
 public:
  explicit SafetensorsWeights(const std::string& path) : path_(path) {
    const int64_t file_size = regular_file_size(path, "weights file (model.init_from)", kMaxWeightFileBytes);
    in_.open(path, std::ios::binary);
    if (!in_) throw InputError(path + ": file not found (model.init_from)");
    uint64_t header_len = 0;
    // Checked against the file before allocating the header.
    if (!in_.read(reinterpret_cast<char*>(&header_len), 8) || header_len > (1ull << 30) ||
        header_len > uint64_t(file_size - 8))
      throw InputError(path + ": not a safetensors file (bad header length)");
    std::string header(header_len, '\0');
    if (!in_.read(header.data(), static_cast<std::streamsize>(header_len)))
      throw InputError(path + ": truncated safetensors header");
    try {
      header_ = nlohmann::json::parse(header);
    } catch (const nlohmann::json::exception&) {
      throw InputError(path + ": safetensors header is not valid JSON");
    }
    if (!header_.is_object()) throw InputError(path + ": safetensors header is not a JSON object");
    data_start_ = 8 + static_cast<int64_t>(header_len);
    data_bytes_ = file_size - data_start_;
    for (const auto& [key, entry] : header_.items())
      if (key != "__metadata__") keys_.add(key, path_);
  }

  void check(const Wanted& w) const override { (void)entry_of(w); }

  void read(const Wanted& w, float* params) const override {
    const Entry e = entry_of(w);
    const TensorSpec& t = *w.spec;
    std::vector<char> raw(static_cast<size_t>(e.width * t.numel));
    in_.seekg(data_start_ + e.begin);
    if (!in_.read(raw.data(), static_cast<std::streamsize>(raw.size())))
      throw InputError(path_ + ": tensor `" + t.name + "` runs past the end of the file");
    float* dst = params + t.offset;
    if (e.dtype == "F32") return (void)std::memcpy(dst, raw.data(), raw.size());
    for (int64_t i = 0; i < t.numel; ++i) {
      uint16_t h;
      std::memcpy(&h, raw.data() + 2 * i, 2);
      dst[i] = e.dtype == "BF16" ? kernels::to_float(kernels::bf16{h}) : kernels::to_float(kernels::fp16{h});
    }
  }

 private:
  struct Entry {
    std::string dtype;
    int64_t width, begin;
  };
  // The checked header entry of `w`: an object with a float dtype, the model's shape and
  // data_offsets spanning exactly its bytes inside the file.
  Entry entry_of(const Wanted& w) const {
    const TensorSpec& t = *w.spec;
    const nlohmann::json& e = header_.at(w.key);
    if (!e.is_object())
      throw InputError(path_ + ": tensor `" + t.name + "`: header entry must be an object with dtype, shape and "
                       "data_offsets, got " + echo(e.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace), 60));
    auto dt = e.find("dtype");
    if (dt == e.end() || !dt->is_string())
      throw InputError(path_ + ": tensor `" + t.name + "`: field `dtype` must be a string such as \"F32\"");
    const std::string dtype = dt->get<std::string>();
    const std::vector<int64_t> shape = header_ints(path_, t.name, e, "shape");
    if (shape != t.shape)
      throw InputError(path_ + ": tensor `" + t.name + "` has shape " + shape_str(shape) + ", the model needs " +
                       shape_str(t.shape));
    const std::vector<int64_t> offsets = header_ints(path_, t.name, e, "data_offsets");
    const int64_t width = dtype == "F32" ? 4 : (dtype == "F16" || dtype == "BF16") ? 2 : 0;
    if (width == 0)
      throw InputError(path_ + ": tensor `" + t.name + "` has dtype " + echo(dtype, 20) + " (need F32, F16 or BF16)");
    if (offsets.size() != 2 || offsets[1] < offsets[0] || offsets[1] - offsets[0] != width * t.numel)
      throw InputError(path_ + ": tensor `" + t.name + "` has inconsistent data_offsets");
    if (offsets[1] > data_bytes_) throw InputError(path_ + ": tensor `" + t.name + "` runs past the end of the file");
    return {dtype, width, offsets[0]};
  }

  std::string path_;
  mutable std::ifstream in_;
  nlohmann::json header_;
  int64_t data_start_ = 0, data_bytes_ = 0;
};

// The format by content, so that either format loads whatever its name (`zero3d convert
// --format` writes the name it is given): HDF5's signature, or a safetensors header (a length,
// then a JSON object); anything else by its extension, whose reader then says what is wrong.
std::unique_ptr<WeightsFile> open_file(const std::string& path) {
  const int64_t size = regular_file_size(path, "weights file (model.init_from)", kMaxWeightFileBytes);
  unsigned char head[9] = {};
  std::ifstream(path, std::ios::binary).read(reinterpret_cast<char*>(head), sizeof(head));
  if (std::memcmp(head, "\x89HDF\r\n\x1a\n", 8) == 0) return std::make_unique<Hdf5Weights>(path);
  uint64_t header_len = 0;
  std::memcpy(&header_len, head, 8);
  const bool safetensors = size >= 9 && header_len <= uint64_t(size - 8) && head[8] == '{';
  if (safetensors || ends_with(path, ".safetensors")) return std::make_unique<SafetensorsWeights>(path);
  return std::make_unique<Hdf5Weights>(path);
}

// The checked plan of a load: every file with the tensors the model takes from it.
struct Plan {
  std::vector<std::pair<std::unique_ptr<WeightsFile>, std::vector<Wanted>>> files;
};

Plan plan_single(const std::string& path, const ParamLayout& layout) {
  Plan plan;
  std::unique_ptr<WeightsFile> file = open_file(path);
  std::vector<Wanted> wanted;
  for (const TensorSpec& t : layout.tensors()) {
    auto it = file->keys().find(t.name);
    if (it == file->keys().end()) continue;
    wanted.push_back({&t, it->second});
    file->check(wanted.back());
  }
  check_names(path, layout, file->keys());
  plan.files.emplace_back(std::move(file), std::move(wanted));
  return plan;
}

// Hugging Face's sharded layout: {"weight_map": {tensor name: file next to the index}}.
Plan plan_sharded(const std::string& index, const ParamLayout& layout) {
  const std::string text = read_regular_file(index, "weights index (model.init_from)", kMaxIndexBytes);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception&) {
    throw InputError(index + ": not valid JSON");
  }
  if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object())
    throw InputError(index + ": no \"weight_map\"");
  const std::string dir = index.find('/') == std::string::npos ? "" : index.substr(0, index.find_last_of('/') + 1);
  KeyMap names;
  for (const auto& [key, file] : j["weight_map"].items()) {
    if (!file.is_string())
      throw InputError(index + ": weight_map entry `" + echo(key, 60) + "` must be a file name (a string)");
    names.add(key, index);
  }
  std::map<std::string, std::vector<const TensorSpec*>> by_file;
  for (const TensorSpec& t : layout.tensors()) {
    auto it = names.keys().find(t.name);
    if (it != names.keys().end()) by_file[dir + j["weight_map"][it->second].get<std::string>()].push_back(&t);
  }
  Plan plan;
  for (const auto& [path, tensors] : by_file) {
    std::unique_ptr<WeightsFile> file = open_file(path);
    std::vector<Wanted> wanted;
    for (const TensorSpec* t : tensors) {
      auto it = file->keys().find(t->name);
      if (it == file->keys().end())
        throw InputError(index + ": weight_map puts tensor `" + t->name + "` in " + path + ", which does not hold it");
      wanted.push_back({t, it->second});
      file->check(wanted.back());
    }
    plan.files.emplace_back(std::move(file), std::move(wanted));
  }
  check_names(index, layout, names.keys());
  return plan;
}

Plan plan_load(const std::string& path, const ParamLayout& layout) {
  return ends_with(path, ".index.json") ? plan_sharded(path, layout) : plan_single(path, layout);
}

}  // namespace

void check_weights(const std::string& path, const ParamLayout& layout) { plan_load(path, layout); }

void load_weights(const std::string& path, const ParamLayout& layout, float* params) {
  const Plan plan = plan_load(path, layout);
  for (const auto& [file, wanted] : plan.files)
    for (const Wanted& w : wanted) file->read(w, params);
}

void save_weights_hdf5(const std::string& path, const ParamLayout& layout, const float* params) {
  h5::File f = h5::File::create(path);
  for (const TensorSpec& t : layout.tensors()) f.write_floats(t.name, params + t.offset, t.shape);
}

}  // namespace zero3d

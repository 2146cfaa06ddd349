// buffer.hpp — one flat allocation per kind (params, grads, optimizer moments), with named
// tensors at fixed offsets into it (llm.c's ParameterTensors). The same ParamLayout applies
// to every buffer, so "h.0.attn.c_attn.weight" has the same offset in each of them.
//
// Worked example (V=4, T=2, C=2, L=1): wte [4,2] at 0, wpe [2,2] at 8, h.0.ln_1.weight [2]
// at 12, ... ; total() is the element count of the whole buffer.
#pragma once

#include <Kokkos_Core.hpp>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

namespace zero3d {

struct TensorSpec {
  std::string name;            // Hugging Face GPT-2 name, e.g. "h.0.mlp.c_fc.weight"
  std::vector<int64_t> shape;  // Conv1D layout: weights are [in, out]
  int64_t offset = 0;          // first element in the flat buffer
  int64_t numel = 0;
};

class ParamLayout {
 public:
  const TensorSpec& add(const std::string& name, std::vector<int64_t> shape) {
    TensorSpec t;
    t.name = name;
    t.numel = 1;
    for (int64_t d : shape) t.numel *= d;
    t.shape = std::move(shape);
    t.offset = total_;
    total_ += t.numel;
    index_[name] = tensors_.size();
    tensors_.push_back(t);
    return tensors_.back();
  }
  const std::vector<TensorSpec>& tensors() const { return tensors_; }
  int64_t total() const { return total_; }
  // nullptr when the name is not part of the model.
  const TensorSpec* find(const std::string& name) const {
    auto it = index_.find(name);
    return it == index_.end() ? nullptr : &tensors_[it->second];
  }

 private:
  std::vector<TensorSpec> tensors_;
  std::unordered_map<std::string, size_t> index_;
  int64_t total_ = 0;
};

using FlatBuffer = Kokkos::View<float*>;

// A zero-filled flat buffer for `layout`.
inline FlatBuffer make_flat_buffer(const std::string& label, int64_t n) { return FlatBuffer(label, n); }

// An uninitialised buffer, for activations that are always written before they are read.
inline FlatBuffer make_scratch_buffer(const std::string& label, int64_t n) {
  return FlatBuffer(Kokkos::view_alloc(Kokkos::WithoutInitializing, label), n);
}

}  // namespace zero3d

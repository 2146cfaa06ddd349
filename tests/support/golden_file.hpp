// golden_file.hpp — what the model tests read from a PyTorch golden file (tests/golden/*.h5):
// a dataset of doubles, and the AdamW the goldens step with (torch.optim.AdamW) from its
// hparams row: lr, beta1, beta2, eps, weight_decay (then the clip norm, read by the caller).
#pragma once

#include <hdf5.h>

#include <string>
#include <vector>

#include "io/h5.hpp"
#include "model/model.hpp"
#include "optim/optimizer.hpp"

namespace zero3d::test {

inline std::vector<double> read_doubles(const h5::File& f, const std::string& name) {
  h5::Handle ds(H5Dopen2(f.id(), name.c_str(), H5P_DEFAULT), H5Dclose);
  h5::Handle space(H5Dget_space(ds.get()), H5Sclose);
  std::vector<double> out(static_cast<size_t>(H5Sget_simple_extent_npoints(space.get())));
  H5Dread(ds.get(), H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, H5P_DEFAULT, out.data());
  return out;
}

// A GPT-2 golden's model (its attributes vocab_size, n_positions, n_layer, n_head, n_embd) and
// its batch.
inline GPTShape golden_gpt_shape(const h5::File& f, int64_t& batch) {
  int64_t V = 0, T = 0, L = 0, H = 0, C = 0;
  h5::read_attribute(f.id(), "vocab_size", V);
  h5::read_attribute(f.id(), "n_positions", T);
  h5::read_attribute(f.id(), "n_layer", L);
  h5::read_attribute(f.id(), "n_head", H);
  h5::read_attribute(f.id(), "n_embd", C);
  h5::read_attribute(f.id(), "batch", batch);
  return GPTShape{V, T, L, H, C};
}

// A double attribute of a group (or of the file, group "/").
inline double group_attribute(const h5::File& f, const std::string& group, const char* name) {
  double v = 0.0;
  h5::Handle a(H5Aopen_by_name(f.id(), group.c_str(), name, H5P_DEFAULT, H5P_DEFAULT), H5Aclose);
  H5Aread(a.get(), H5T_NATIVE_DOUBLE, &v);
  return v;
}

inline OptimizerConfig golden_adamw(const std::vector<double>& hp) {
  OptimizerConfig oc;
  oc.type = OptimizerType::Adam;
  oc.adam_w_mode = true;
  oc.lr = hp.at(0);
  oc.beta1 = hp.at(1);
  oc.beta2 = hp.at(2);
  oc.eps = hp.at(3);
  oc.weight_decay = hp.at(4);
  return oc;
}

}  // namespace zero3d::test

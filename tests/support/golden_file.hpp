// golden_file.hpp — what the model tests read from a PyTorch golden file (tests/golden/*.h5):
// a dataset of doubles, and the AdamW the goldens step with (torch.optim.AdamW) from its
// hparams row: lr, beta1, beta2, eps, weight_decay (then the clip norm, read by the caller).
#pragma once

#include <hdf5.h>

#include <string>
#include <vector>

#include "io/h5.hpp"
#include "optim/optimizer.hpp"

namespace zero3d::test {

inline std::vector<double> read_doubles(const h5::File& f, const std::string& name) {
  h5::Handle ds(H5Dopen2(f.id(), name.c_str(), H5P_DEFAULT), H5Dclose);
  h5::Handle space(H5Dget_space(ds.get()), H5Sclose);
  std::vector<double> out(static_cast<size_t>(H5Sget_simple_extent_npoints(space.get())));
  H5Dread(ds.get(), H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, H5P_DEFAULT, out.data());
  return out;
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

// dtype.hpp — element types of buffers and messages, shared by config, kernels and comm.
#pragma once

#include <cstddef>
#include <string>

namespace zero3d {

// BF16: bfloat16 (8-bit exponent, 7-bit mantissa); F16: IEEE binary16.
enum class DType { F32, F64, I32, I64, U8, BF16, F16 };

inline size_t dtype_size(DType t) {
  switch (t) {
    case DType::F32: return 4;
    case DType::F64: return 8;
    case DType::I32: return 4;
    case DType::I64: return 8;
    case DType::U8: return 1;
    case DType::BF16: return 2;
    case DType::F16: return 2;
  }
  return 0;
}

// DeepSpeed's spelling in configs and reports: "fp32", "bf16", "fp16".
inline std::string dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "fp32";
    case DType::BF16: return "bf16";
    case DType::F16: return "fp16";
    case DType::F64: return "fp64";
    case DType::I32: return "int32";
    case DType::I64: return "int64";
    case DType::U8: return "uint8";
  }
  return "?";
}

}  // namespace zero3d

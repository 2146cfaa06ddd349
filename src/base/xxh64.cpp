// xxh64.cpp — see xxh64.hpp.
#include "base/xxh64.hpp"

#include <cstdio>
#include <cstring>

namespace zero3d {

namespace {
constexpr uint64_t kP1 = 0x9E3779B185EBCA87ULL, kP2 = 0xC2B2AE3D27D4EB4FULL, kP3 = 0x165667B19E3779F9ULL,
                   kP4 = 0x85EBCA77C2B2AE63ULL, kP5 = 0x27D4EB2F165667C5ULL;
uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
uint64_t read64(const unsigned char* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);  // little-endian hosts only (x86-64, aarch64), as the rest of zero3d
  return v;
}
uint32_t read32(const unsigned char* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
uint64_t xx_round(uint64_t acc, uint64_t input) { return rotl(acc + input * kP2, 31) * kP1; }
uint64_t xx_merge(uint64_t acc, uint64_t v) { return (acc ^ xx_round(0, v)) * kP1 + kP4; }
}  // namespace

Xxh64::Xxh64(uint64_t seed) : seed_(seed), v_{seed + kP1 + kP2, seed + kP2, seed, seed - kP1} {}

void Xxh64::stripe(const unsigned char* p) {
  for (int i = 0; i < 4; ++i) v_[i] = xx_round(v_[i], read64(p + 8 * i));
}

void Xxh64::update(const void* data, size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
  total_ += n;
  if (buf_len_ + n < 32) {
    std::memcpy(buf_ + buf_len_, p, n);
    buf_len_ += n;
    return;
  }
  if (buf_len_ > 0) {
    const size_t take = 32 - buf_len_;
    std::memcpy(buf_ + buf_len_, p, take);
    stripe(buf_);
    p += take;
    n -= take;
    buf_len_ = 0;
  }
  for (; n >= 32; p += 32, n -= 32) stripe(p);
  std::memcpy(buf_, p, n);
  buf_len_ = n;
}

uint64_t Xxh64::digest() const {
  uint64_t h;
  if (total_ >= 32) {
    h = rotl(v_[0], 1) + rotl(v_[1], 7) + rotl(v_[2], 12) + rotl(v_[3], 18);
    for (uint64_t v : v_) h = xx_merge(h, v);
  } else {
    h = seed_ + kP5;
  }
  h += total_;
  const unsigned char* p = buf_;
  size_t n = buf_len_;
  for (; n >= 8; p += 8, n -= 8) h = rotl(h ^ xx_round(0, read64(p)), 27) * kP1 + kP4;
  if (n >= 4) {
    h = rotl(h ^ (uint64_t(read32(p)) * kP1), 23) * kP2 + kP3;
    p += 4;
    n -= 4;
  }
  for (; n > 0; ++p, --n) h = rotl(h ^ (uint64_t(*p) * kP5), 11) * kP1;
  h ^= h >> 33;
  h *= kP2;
  h ^= h >> 29;
  h *= kP3;
  h ^= h >> 32;
  return h;
}

uint64_t xxh64(const void* data, size_t n, uint64_t seed) {
  Xxh64 x(seed);
  x.update(data, n);
  return x.digest();
}

std::string hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

}  // namespace zero3d

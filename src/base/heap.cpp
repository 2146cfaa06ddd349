// heap.cpp — see heap.hpp.
#include "base/heap.hpp"

#include <malloc.h>

namespace zero3d {

void keep_mmap_threshold() {
  // Setting it at all turns glibc's dynamic adjustment (of this and of the trim threshold) off.
  mallopt(M_MMAP_THRESHOLD, 128 * 1024);
}

}  // namespace zero3d

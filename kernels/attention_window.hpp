// attention_window.hpp — which keys a query sees under a causal mask and a sliding window.
#pragma once

#include "kernels/common.hpp"

namespace zero3d::kernels {

// The first key query i sees: 0, or i − W + 1 with a sliding window W > 0 (key j visible when
// i − W < j <= i: transformers masking_utils, sliding_window_overlay).
KOKKOS_INLINE_FUNCTION Index gqa_first_key(Index i, Index window) {
  return window > 0 && i - window + 1 > 0 ? i - window + 1 : 0;
}

}  // namespace zero3d::kernels

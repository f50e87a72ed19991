// Two partial softmax attentions of one query merged by their log-sum-exps: FlashAttention's online
// softmax across blocks of keys, ring attention's merge of a block into the running result, and a sink
// merged as a block whose value is zero. One text for both backends.
//
//   total = log(e^lse + e^block_lse),  out = keep * out + add * block_out
#pragma once

#include <cmath>

#include "common/host_device.h"

namespace ranklab {

struct LseMerge {
  float total, keep, add;
};

// `lse` is -infinity where nothing was merged yet (keep 0).
RANKLAB_HD inline LseMerge merge_lse(float lse, float block_lse) {
  const float top = fmaxf(lse, block_lse);
  const float total = top + logf(expf(lse - top) + expf(block_lse - top));
  return {total, lse == -INFINITY ? 0.0f : expf(lse - total), expf(block_lse - total)};
}

}  // namespace ranklab

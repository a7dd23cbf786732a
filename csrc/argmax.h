// The greedy token of rows of logits, as jnp.argmax gives it: the first index of a row's maximum, or of
// its first NaN when it has one. XLA:CPU runs that as a max and an index reduction, two passes of ~3 GB/s
// over a 248k-token row (~4.5 ms for a verify pass of 8 rows here); this reads each row once, in chunks
// that threads take, and merges the chunks in order.
#pragma once

#include <cstdint>

namespace sharpi {

// A chunk's result: its maximum and the first index holding it (absolute), or the first NaN's index.
struct ArgmaxPart {
  float max;
  int64_t at;
  int64_t nan_at;  // -1: no NaN in the chunk
};

// Elements [i0, i1) of a row x (i0 < i1).
ArgmaxPart argmax_part(const float* x, int64_t i0, int64_t i1);

// The row's index from its chunks' parts, given in order: the first NaN if any chunk has one, else the
// first chunk holding the largest maximum (ties keep the earlier chunk; -0.0 == +0.0 as the comparison has it).
int64_t argmax_merge(const ArgmaxPart* parts, int64_t n);

}  // namespace sharpi

// Greedy tokens (see argmax.h): one pass per chunk for its maximum (and whether it holds a NaN), then a
// scan of the chunk, still in cache, for the first element equal to it. Exact comparisons only, so the
// index is the one jnp.argmax names whatever the instruction set.
#include "argmax.h"

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <limits>

namespace sharpi {
namespace {

#define SHARPI_ARGMAX __attribute__((target("avx2")))

int64_t first_nan(const float* x, int64_t i0, int64_t i1) {
  for (int64_t i = i0; i < i1; ++i)
    if (std::isnan(x[i])) return i;
  return -1;
}

ArgmaxPart part_scalar(const float* x, int64_t i0, int64_t i1) {
  float m = x[i0];
  for (int64_t i = i0; i < i1; ++i) {
    if (std::isnan(x[i])) return {x[i], i, i};
    if (x[i] > m) m = x[i];
  }
  for (int64_t i = i0; i < i1; ++i)
    if (x[i] == m) return {m, i, -1};
  return {m, i0, -1};  // unreachable: m is one of the elements
}

SHARPI_ARGMAX ArgmaxPart part_avx2(const float* x, int64_t i0, int64_t i1) {
  const float inf = std::numeric_limits<float>::infinity();
  __m256 m0 = _mm256_set1_ps(-inf), m1 = m0, m2 = m0, m3 = m0, bad = _mm256_setzero_ps();
  int64_t i = i0;
  for (; i + 32 <= i1; i += 32) {
    const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8), c = _mm256_loadu_ps(x + i + 16),
                 d = _mm256_loadu_ps(x + i + 24);
    m0 = _mm256_max_ps(m0, a);
    m1 = _mm256_max_ps(m1, b);
    m2 = _mm256_max_ps(m2, c);
    m3 = _mm256_max_ps(m3, d);
    bad = _mm256_or_ps(bad, _mm256_or_ps(_mm256_or_ps(_mm256_cmp_ps(a, a, _CMP_UNORD_Q), _mm256_cmp_ps(b, b, _CMP_UNORD_Q)),
                                         _mm256_or_ps(_mm256_cmp_ps(c, c, _CMP_UNORD_Q), _mm256_cmp_ps(d, d, _CMP_UNORD_Q))));
  }
  // A NaN anywhere: its first index (max_ps drops NaNs, so the maxima below are only used without one).
  if (_mm256_movemask_ps(bad)) return {std::numeric_limits<float>::quiet_NaN(), -1, first_nan(x, i0, i)};
  m0 = _mm256_max_ps(_mm256_max_ps(m0, m1), _mm256_max_ps(m2, m3));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m0);
  float m = -inf;
  for (float v : lanes) m = v > m ? v : m;
  for (int64_t j = i; j < i1; ++j) {
    if (std::isnan(x[j])) return {x[j], j, j};
    if (x[j] > m) m = x[j];
  }
  const __m256 mv = _mm256_set1_ps(m);
  int64_t j = i0;
  for (; j + 8 <= i1; j += 8) {
    const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + j), mv, _CMP_EQ_OQ));
    if (hit) return {m, j + __builtin_ctz(hit), -1};
  }
  for (; j < i1; ++j)
    if (x[j] == m) return {m, j, -1};
  return {m, i0, -1};  // unreachable: m is one of the elements
}

bool has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2");
}

}  // namespace

ArgmaxPart argmax_part(const float* x, int64_t i0, int64_t i1) {
  static const bool avx2 = has_avx2();
  return avx2 ? part_avx2(x, i0, i1) : part_scalar(x, i0, i1);
}

int64_t argmax_merge(const ArgmaxPart* parts, int64_t n) {
  for (int64_t c = 0; c < n; ++c)
    if (parts[c].nan_at >= 0) return parts[c].nan_at;
  int64_t best = 0;
  for (int64_t c = 1; c < n; ++c)
    if (parts[c].max > parts[best].max) best = c;
  return parts[best].at;
}

}  // namespace sharpi

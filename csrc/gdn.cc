// The gated delta rule for one token (see gdn.h). Float order, fixed: each dot product accumulates 8 lanes
// over the row's chunks of 8 with fused multiply-adds, then sums the lanes as hsum8; the decay and the
// update are elementwise (a multiply, then a fused multiply-add).
#include "gdn.h"

#include <immintrin.h>

#include <cmath>

namespace sharpi {
namespace {

#define SHARPI_GDN __attribute__((target("avx2,fma")))

SHARPI_GDN inline float hsum8(__m256 x) {
  __m128 r = _mm_add_ps(_mm256_extractf128_ps(x, 1), _mm256_castps256_ps128(x));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  r = _mm_add_ss(r, _mm_movehdup_ps(r));
  return _mm_cvtss_f32(r);
}

SHARPI_GDN void head(const float* src, float* dst, const float* q, const float* k, const float* v, float beta,
                     float e, float scale, int64_t dv, int64_t dk, float* o) {
  const __m256 ev = _mm256_set1_ps(e);
  for (int64_t i = 0; i < dv; ++i) {
    const float* s = src + i * dk;
    float* w = dst + i * dk;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t j = 0; j < dk; j += 8)
      acc = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(s + j), ev), _mm256_loadu_ps(k + j), acc);
    const __m256 d = _mm256_set1_ps(beta * (v[i] - hsum8(acc)));
    __m256 out = _mm256_setzero_ps();
    // Row i is read (above) before it is written: src == dst updates the state in place.
    for (int64_t j = 0; j < dk; j += 8) {
      const __m256 kj = _mm256_loadu_ps(k + j);
      const __m256 sn = _mm256_fmadd_ps(d, kj, _mm256_mul_ps(_mm256_loadu_ps(s + j), ev));
      _mm256_storeu_ps(w + j, sn);
      out = _mm256_fmadd_ps(sn, _mm256_loadu_ps(q + j), out);
    }
    o[i] = hsum8(out) * scale;
  }
}

}  // namespace

bool gdn_native_supported(int64_t dk) {
  __builtin_cpu_init();
  return dk > 0 && dk % 8 == 0 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

void gdn_step(const float* src, float* dst, const float* q, const float* k, const float* v, const float* beta,
              const float* g, float scale, int64_t dv, int64_t dk, int64_t h0, int64_t h1, float* o) {
  for (int64_t h = h0; h < h1; ++h) {
    const int64_t off = h * dv * dk;
    head(src + off, dst + off, q + h * dk, k + h * dk, v + h * dv, beta[h], std::exp(g[h]), scale, dv, dk, o + h * dv);
  }
}

}  // namespace sharpi

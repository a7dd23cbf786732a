// The gated delta rule for one token (see gdn.h). Float order, fixed: each dot product accumulates 8 lanes
// over the row's chunks of 8 with fused multiply-adds, then sums the lanes as hsum8; the decay and the
// update are elementwise (a multiply, then a fused multiply-add).
#include "gdn.h"

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace sharpi {
namespace {

#define SHARPI_GDN __attribute__((target("avx2,fma")))

SHARPI_GDN inline float hsum8(__m256 x) {
  __m128 r = _mm_add_ps(_mm256_extractf128_ps(x, 1), _mm256_castps256_ps128(x));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  r = _mm_add_ss(r, _mm_movehdup_ps(r));
  return _mm_cvtss_f32(r);
}

// State row s (dk values) of one head -> the new row, written to w (which may be s) and, when w2 is not null,
// also to w2 (a snapshot slot; kStream: with non-temporal stores, w2 32-byte aligned); returns o_i. Every
// path of the kernel runs this one sequence per row, so a row's bits do not depend on which path ran it.
template <bool kStream>
SHARPI_GDN inline float row_update(const float* s, float* w, float* w2, const float* q, const float* k, float vi,
                                   float beta, __m256 ev, float scale, int64_t dk) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t j = 0; j < dk; j += 8)
    acc = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(s + j), ev), _mm256_loadu_ps(k + j), acc);
  const __m256 d = _mm256_set1_ps(beta * (vi - hsum8(acc)));
  __m256 out = _mm256_setzero_ps();
  // Row s is read (above) before it is written: s == w updates the state in place.
  for (int64_t j = 0; j < dk; j += 8) {
    const __m256 kj = _mm256_loadu_ps(k + j);
    const __m256 sn = _mm256_fmadd_ps(d, kj, _mm256_mul_ps(_mm256_loadu_ps(s + j), ev));
    _mm256_storeu_ps(w + j, sn);
    if (w2 != nullptr) {
      if (kStream) _mm256_stream_ps(w2 + j, sn);
      else _mm256_storeu_ps(w2 + j, sn);
    }
    out = _mm256_fmadd_ps(sn, _mm256_loadu_ps(q + j), out);
  }
  return hsum8(out) * scale;
}

SHARPI_GDN void head(const float* src, float* dst, const float* q, const float* k, const float* v, float beta,
                     float e, float scale, int64_t dv, int64_t dk, float* o) {
  const __m256 ev = _mm256_set1_ps(e);
  for (int64_t i = 0; i < dv; ++i)
    o[i] = row_update<false>(src + i * dk, dst + i * dk, nullptr, q, k, v[i], beta, ev, scale, dk);
}

// Rows [0, n) of one head h, state row by state row: row i of the starting state is read once, every token's
// new row i is computed from its parent's (held in `rows`, n + 1 rows of dk values) and streamed to its slot.
template <bool kStream>
SHARPI_GDN void head_rows(const float* init, float* snaps, int64_t slot, const int32_t* parent, int64_t n,
                          const float* q, const float* k, const float* v, const float* beta, const float* g,
                          float scale, int64_t H, int64_t dv, int64_t dk, int64_t h, float* o, float* rows,
                          float* e) {
  for (int64_t t = 0; t < n; ++t) e[t] = std::exp(g[t * H + h]);
  const int64_t hoff = h * dv * dk;
  for (int64_t i = 0; i < dv; ++i) {
    std::memcpy(rows, init + hoff + i * dk, dk * sizeof(float));  // before any slot's row i is written
    for (int64_t t = 0; t < n; ++t) {
      const int64_t th = t * H + h;
      const float* s = rows + (parent[t] + 1) * dk;  // parent -1: the starting row
      o[th * dv + i] = row_update<kStream>(s, rows + (t + 1) * dk, snaps + t * slot + hoff + i * dk, q + th * dk,
                                           k + th * dk, v[th * dv + i], beta[th], _mm256_set1_ps(e[t]), scale, dk);
    }
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

void gdn_rows(const float* init, float* snaps, int64_t slot, const int32_t* parent, int64_t n, const float* q,
              const float* k, const float* v, const float* beta, const float* g, float scale, int64_t H, int64_t dv,
              int64_t dk, int64_t h0, int64_t h1, float* o) {
  thread_local std::vector<float> rows;
  thread_local std::vector<float> e;
  rows.resize(static_cast<size_t>((n + 1) * dk));
  e.resize(static_cast<size_t>(n));
  // Non-temporal stores where the buffer is 32-byte aligned (every row then is: dk is a multiple of 8): a slot
  // is written whole and read back (if at all) on the next pass, long after this layer's lines would have left
  // the cache, so reading its old contents first (a normal store's read-for-ownership) is a third of the
  // traffic for nothing. Same bits either way.
  const bool stream = reinterpret_cast<uintptr_t>(snaps) % 32 == 0;
  for (int64_t h = h0; h < h1; ++h) {
    if (stream)
      head_rows<true>(init, snaps, slot, parent, n, q, k, v, beta, g, scale, H, dv, dk, h, o, rows.data(), e.data());
    else
      head_rows<false>(init, snaps, slot, parent, n, q, k, v, beta, g, scale, H, dv, dk, h, o, rows.data(), e.data());
  }
  if (stream) _mm_sfence();  // the streamed rows are visible before the caller's threads read them
}

}  // namespace sharpi

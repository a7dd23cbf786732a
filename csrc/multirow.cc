// Multi-row kernels for Q4_K, Q5_K and Q6_K weights (AVX2 + FMA + F16C, picked at run time).
//
// Q8_0 has none: its blocks need no unpacking (bytes and one f16 scale), so ggml's vec_dot is already
// bound by the multiplies, and a multi-row form measured slower than it at every row count.
//
// Loop order: for each weight row of the tile and each super-block, each 32-value chunk is unpacked into
// registers (quants to bytes, its scale to an int16 vector) and multiplied at once with the same chunk of
// a group of up to 4 activation rows, as ggml's vec_dot does for one row: the rows share the unpacking and
// the weight loads, and nothing unpacked goes through memory. A product of m rows runs in balanced groups
// (5 -> 2 + 3, 9 -> 3 + 3 + 3). Per (weight row, activation row) the float work is ggml's, in ggml's order
// (see multirow.h). Compiled with -ffp-contract=off so that the compiler adds no fused multiply-add that
// ggml's build does not have; where ggml's C code is contracted by its compiler, the fused form is written
// out explicitly.
#include "multirow.h"

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "ggml.h"

namespace sharpi {
namespace {

#define SHARPI_AVX2 __attribute__((target("avx2,fma,f16c")))
// Helpers must inline into the kernels: a call would pass unpacked vectors through memory.
#define SHARPI_INLINE SHARPI_AVX2 inline __attribute__((always_inline))

constexpr int kGroup = 4;          // activation rows per pass over a weight row (their sums stay in registers)
constexpr int kQK = 256;           // values per K-quant super-block

// Block sizes in bytes (ggml-common.h): K-quant weights against Q8_K activations.
constexpr size_t kQ8K = 4 + 256 + 32;  // float d; int8 qs[256]; int16 bsums[16]
constexpr size_t kQ4K = 2 + 2 + 12 + 128;
constexpr size_t kQ5K = 2 + 2 + 12 + 32 + 128;
constexpr size_t kQ6K = 128 + 64 + 16 + 2;

SHARPI_INLINE float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

SHARPI_INLINE float q8k_d(const uint8_t* y) {
  float d;
  std::memcpy(&d, y, 4);
  return d;
}

// ggml's horizontal sum of 8 floats (x86 quants.c, hsum_float_8): the order matters for the bits.
SHARPI_INLINE float hsum8(__m256 x) {
  __m128 r = _mm256_extractf128_ps(x, 1);
  r = _mm_add_ps(r, _mm256_castps256_ps128(x));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  r = _mm_add_ss(r, _mm_movehdup_ps(r));
  return _mm_cvtss_f32(r);
}

// The 6-bit scales and mins of a Q4_K / Q5_K super-block (8 sub-blocks of 32 values, GGUF's
// get_scale_min_k4) as 16 bytes: scales 0..7, then mins 0..7; four 32-bit words, no byte stores.
SHARPI_INLINE __m128i scale_min_k4(const uint8_t* q) {
  uint32_t u[3];
  std::memcpy(u, q, 12);
  const uint32_t lo6 = 0x3f3f3f3f, lo4 = 0x0f0f0f0f, lo2 = 0x03030303;
  const uint32_t sc0 = u[0] & lo6;                                   // scales 0-3: low 6 bits of bytes 0-3
  const uint32_t sc1 = (u[2] & lo4) | (((u[0] >> 6) & lo2) << 4);    // scales 4-7: bytes 8-11 low, 0-3 top
  const uint32_t mn0 = u[1] & lo6;                                   // mins 0-3: low 6 bits of bytes 4-7
  const uint32_t mn1 = ((u[2] >> 4) & lo4) | (((u[1] >> 6) & lo2) << 4);  // mins 4-7
  return _mm_set_epi32(static_cast<int>(mn1), static_cast<int>(mn0), static_cast<int>(sc1), static_cast<int>(sc0));
}

// Byte shuffles that spread int16 lane c of a 128-bit half over all 16 int16 lanes (both halves).
SHARPI_INLINE __m256i spread16(__m256i v, int c) {
  return _mm256_shuffle_epi8(v, _mm256_set1_epi16(static_cast<int16_t>((2 * c) | ((2 * c + 1) << 8))));
}

// ---- Q4_K / Q5_K ---------------------------------------------------------------------------------
//
// R activation rows against weight rows [n0, n1). Lane i of a row's int32 sums holds, per 32-value chunk c,
// scale_c * (the products of bytes 4i..4i+3): the lanes of ggml's maddubs / madd pairs. The mins term
// (4 float lanes for Q4_K, one fused scalar for Q5_K), the per-block fused multiply-add into 8 float lanes
// and the final horizontal sums are ggml's operations in ggml's order.

template <bool kQ5, int R>
SHARPI_AVX2 void k4_group(int64_t k, const uint8_t* w, size_t w_row, int64_t n0, int64_t n1,
                          const uint8_t* const* q, float* const* out) {
  const int64_t nb = k / kQK;
  const size_t bsz = kQ5 ? kQ5K : kQ4K;
  const __m256i m4 = _mm256_set1_epi8(0xF), one = _mm256_set1_epi8(1);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = w + n * w_row;
    __m256 acc[R];
    __m128 accm[R];
    float summs[R];
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm256_setzero_ps();
      accm[r] = _mm_setzero_ps();
      summs[r] = 0.0f;
    }
    for (int64_t i = 0; i < nb; ++i) {
      const uint8_t* blk = wr + i * bsz;
      const __m256i sm = _mm256_cvtepu8_epi16(scale_min_k4(blk + 4));
      const __m256i scales = _mm256_permute2x128_si256(sm, sm, 0x00);
      const __m128i mins = _mm256_extracti128_si256(sm, 1);
      const float xd = f16(blk), xdmin = f16(blk + 2);
      const uint8_t* qs = blk + (kQ5 ? 48 : 16);
      __m256i hbits = _mm256_setzero_si256();
      if (kQ5) hbits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16));
      __m256i sumi[R];
      for (int r = 0; r < R; ++r) sumi[r] = _mm256_setzero_si256();
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * j));
        __m256i ql = _mm256_and_si256(bits, m4), qh = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4);
        if (kQ5) {
          ql = _mm256_or_si256(ql, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hbits, 2 * j), one), 4));
          qh = _mm256_or_si256(qh, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hbits, 2 * j + 1), one), 4));
        }
        const __m256i sl = spread16(scales, 2 * j), sh = spread16(scales, 2 * j + 1);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          const uint8_t* y = q[r] + i * kQ8K + 4 + 64 * j;
          const __m256i pl = _mm256_maddubs_epi16(ql, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y)));
          const __m256i ph = _mm256_maddubs_epi16(qh, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y + 32)));
          sumi[r] = _mm256_add_epi32(sumi[r], _mm256_add_epi32(_mm256_madd_epi16(sl, pl), _mm256_madd_epi16(sh, ph)));
        }
      }
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const uint8_t* y = q[r] + i * kQ8K;
        const float yd = q8k_d(y);
        const float d = yd * xd;
        const float dmin = -yd * xdmin;
        // The mins term's 4 int32 lanes: lane i = mn[2i] * s[2i] + mn[2i+1] * s[2i+1], s[j] the sum of
        // activation sub-block j (its two bsums, added in int16 as ggml's hadd does).
        const __m256i bs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y + 260));
        const __m128i prod = _mm_madd_epi16(mins, _mm_hadd_epi16(_mm256_castsi256_si128(bs), _mm256_extracti128_si256(bs, 1)));
        if (kQ5) {
          // ggml's `summs += dmin * int`: its build contracts this into one fused multiply-add.
          __m128i hs = _mm_hadd_epi32(_mm_hadd_epi32(prod, _mm_setzero_si128()), _mm_setzero_si128());
          summs[r] = std::fma(dmin, static_cast<float>(_mm_extract_epi32(hs, 0)), summs[r]);
        } else {
          accm[r] = _mm_fmadd_ps(_mm_set1_ps(dmin), _mm_cvtepi32_ps(prod), accm[r]);
        }
        acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi[r]), acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) {
      float tail;
      if (kQ5) {
        tail = summs[r];
      } else {
        __m128 am = _mm_add_ps(accm[r], _mm_movehl_ps(accm[r], accm[r]));
        am = _mm_add_ss(am, _mm_movehdup_ps(am));
        tail = _mm_cvtss_f32(am);
      }
      out[r][n] = hsum8(acc[r]) + tail;
    }
  }
}

// ---- Q6_K ----------------------------------------------------------------------------------------
//
// Value 128j + 32t + l takes its low 4 bits from ql and bits 2t, 2t+1 of qh[32j + l] as its top 2; chunk c
// (values 32c..32c+31): int16 lanes 0-7 use scale 2c, lanes 8-15 scale 2c + 1. The stored quants are
// value + 32: each block subtracts 32 * scale * (each 16 activations' sum, Q8_K's bsums).
template <int R>
SHARPI_AVX2 void q6_group(int64_t k, const uint8_t* w, size_t w_row, int64_t n0, int64_t n1,
                          const uint8_t* const* q, float* const* out) {
  const int64_t nb = k / kQK;
  const __m256i m15 = _mm256_set1_epi8(15), m3 = _mm256_set1_epi8(3), m12 = _mm256_set1_epi8(12),
                m48 = _mm256_set1_epi8(48), m192 = _mm256_set1_epi8(static_cast<char>(0xC0));
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = w + n * w_row;
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < nb; ++i) {
      const uint8_t* blk = wr + i * kQ6K;
      const uint8_t* ql = blk;
      const uint8_t* qh = blk + 128;
      const int8_t* scales = reinterpret_cast<const int8_t*>(blk + 192);
      const float xd = f16(blk + 208);
      __m256i sumi[R];
      for (int r = 0; r < R; ++r) sumi[r] = _mm256_setzero_si256();
#pragma GCC unroll 2
      for (int j = 0; j < 2; ++j) {
        const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 64 * j));
        const __m256i l2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 64 * j + 32));
        const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh + 32 * j));
        __m256i qv[4];
        qv[0] = _mm256_or_si256(_mm256_and_si256(l1, m15), _mm256_slli_epi16(_mm256_and_si256(h, m3), 4));
        qv[1] = _mm256_or_si256(_mm256_and_si256(l2, m15), _mm256_slli_epi16(_mm256_and_si256(h, m12), 2));
        qv[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m15), _mm256_and_si256(h, m48));
        qv[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l2, 4), m15), _mm256_srli_epi16(_mm256_and_si256(h, m192), 2));
#pragma GCC unroll 4
        for (int t = 0; t < 4; ++t) {
          const int c = 4 * j + t;
          const __m256i sc = _mm256_setr_m128i(_mm_set1_epi16(scales[2 * c]), _mm_set1_epi16(scales[2 * c + 1]));
#pragma GCC unroll 4
          for (int r = 0; r < R; ++r) {
            const __m256i p = _mm256_maddubs_epi16(qv[t], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q[r] + i * kQ8K + 4 + 32 * c)));
            sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(sc, p));
          }
        }
      }
      const __m256i scales16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales)));
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const uint8_t* y = q[r] + i * kQ8K;
        const float d = q8k_d(y) * xd;
        const __m256i bsums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y + 260));
        const __m256i sub = _mm256_slli_epi32(_mm256_madd_epi16(bsums, scales16), 5);
        acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_sub_epi32(sumi[r], sub)), acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) out[r][n] = hsum8(acc[r]);
  }
}

// ---- Any number of rows ----------------------------------------------------------------------------

// Every row of `rs` in balanced groups of at most kGroup rows (5 -> 2 + 3, 9 -> 3 + 3 + 3): a group of
// 1 would forgo the shared unpacking. F<R>::run computes one group.
template <template <int> class F>
SHARPI_AVX2 void group_rows(int64_t k, const uint8_t* w, size_t w_row, int64_t n0, int64_t n1, const RowSet& rs) {
  const int64_t groups = (rs.m + kGroup - 1) / kGroup;
  int64_t r = 0;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t size = (rs.m - r) / (groups - g);
    switch (size) {
      case 4: F<4>::run(k, w, w_row, n0, n1, rs.q + r, rs.out + r); break;
      case 3: F<3>::run(k, w, w_row, n0, n1, rs.q + r, rs.out + r); break;
      case 2: F<2>::run(k, w, w_row, n0, n1, rs.q + r, rs.out + r); break;
      default: F<1>::run(k, w, w_row, n0, n1, rs.q + r, rs.out + r); break;
    }
    r += size;
  }
}

template <int R>
struct Q4Group {
  static void run(int64_t k, const uint8_t* w, size_t w_row, int64_t n0, int64_t n1, const uint8_t* const* q,
                  float* const* out) {
    k4_group<false, R>(k, w, w_row, n0, n1, q, out);
  }
};
template <int R>
struct Q5Group {
  static void run(int64_t k, const uint8_t* w, size_t w_row, int64_t n0, int64_t n1, const uint8_t* const* q,
                  float* const* out) {
    k4_group<true, R>(k, w, w_row, n0, n1, q, out);
  }
};
template <int R>
struct Q6Group {
  static void run(int64_t k, const uint8_t* w, size_t w_row, int64_t n0, int64_t n1, const uint8_t* const* q,
                  float* const* out) {
    q6_group<R>(k, w, w_row, n0, n1, q, out);
  }
};

bool cpu_has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

bool env_enabled() {
  const char* v = std::getenv("SHARPI_GGML_MULTIROW");
  return v == nullptr || std::strcmp(v, "0") != 0;
}

std::atomic<bool> g_enabled{env_enabled()};

}  // namespace

int64_t multirow_min_rows(int) { return 2; }

void set_multirow_enabled(bool on) { g_enabled.store(on); }
bool multirow_enabled() { return g_enabled.load(); }

MultiRowFn multirow_kernel(int qtype) {
  static const bool avx2 = cpu_has_avx2();
  if (!avx2 || !g_enabled.load(std::memory_order_relaxed)) return nullptr;
  switch (qtype) {
    case GGML_TYPE_Q4_K: return group_rows<Q4Group>;
    case GGML_TYPE_Q5_K: return group_rows<Q5Group>;
    case GGML_TYPE_Q6_K: return group_rows<Q6Group>;
    default: return nullptr;
  }
}

}  // namespace sharpi

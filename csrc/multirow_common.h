// What the AVX2 and the AVX-512 multi-row kernels share: block layouts, ggml's float steps in ggml's order,
// and the split of a product's rows into groups. Internal to csrc/multirow*.cc.
//
// Every helper here is AVX2-targeted and always inlined; an AVX-512 kernel may inline them too (its target
// includes AVX2). The float steps live here once so that both instruction sets give ggml's bits by
// construction: a kernel only has to put the same exact integer sums in the same 8 int32 lanes.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "multirow.h"

namespace sharpi {
namespace mr {

#define SHARPI_AVX2 __attribute__((target("avx2,fma,f16c")))
// Helpers must inline into the kernels: a call would pass unpacked vectors through memory.
#define SHARPI_INLINE SHARPI_AVX2 inline __attribute__((always_inline))

constexpr int kQK = 256;  // values per K-quant super-block

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

// The end of ggml's vec_dot_f32 (GGML_F32x8_REDUCE) for x = (s0 + s2) + (s1 + s3) of its four 8-lane sums: the
// 128-bit halves added, then two horizontal adds (an order of its own, not hsum8's).
SHARPI_INLINE float f32_hsum(__m256 x) {
  const __m128 t0 = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  const __m128 t1 = _mm_hadd_ps(t0, t0);
  return _mm_cvtss_f32(_mm_hadd_ps(t1, t1));
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

// ---- ggml's float steps ----------------------------------------------------------------------------

// One activation row's running sums against one weight row: 8 float lanes, and the mins term (4 float
// lanes for Q4_K, one scalar for Q5_K; unused by Q6_K).
struct RowAcc {
  __m256 acc;
  __m128 accm;
  float summs;
};

SHARPI_INLINE RowAcc row_acc_zero() { return RowAcc{_mm256_setzero_ps(), _mm_setzero_ps(), 0.0f}; }

// A Q4_K / Q5_K weight block's f16 scales as the float factors every activation row multiplies: d and
// -dmin broadcast, so a row's d = yd * xd and dmin = -yd * xdmin (ggml's products, exact in any lane) are one
// vector multiply each instead of a scalar multiply and a broadcast.
struct K4Scales {
  __m256 xd;
  __m128 nxdmin;  // -xdmin: (-yd) * xdmin == yd * (-xdmin), both exact negations of one rounded product
  float xdmin;
};

SHARPI_INLINE K4Scales k4_scales(const uint8_t* blk) {
  const float xd = f16(blk), xdmin = f16(blk + 2);
  return K4Scales{_mm256_set1_ps(xd), _mm_set1_ps(-xdmin), xdmin};
}

// Each activation row's 16 bsums of every block summed in pairs, as ggml's hadd does (int16: one sum per
// 32-value sub-block), block-major ([i * R + r]: two rows of one block side by side). They depend on the
// activation only, so a kernel computes them once per call (a tile of weight rows) instead of once per weight
// row and block. The buffer is the calling thread's, reused by its next call.
struct alignas(16) BsumPairs {
  int16_t v[8];
};

template <int R>
SHARPI_INLINE const BsumPairs* bsum_pairs(int64_t nb, const uint8_t* const* q) {
  thread_local std::vector<BsumPairs> buf;
  buf.resize(static_cast<size_t>(R * nb));
  for (int r = 0; r < R; ++r)
    for (int64_t i = 0; i < nb; ++i) {
      const __m256i bs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q[r] + i * kQ8K + 260));
      _mm_store_si128(reinterpret_cast<__m128i*>(buf[i * R + r].v),
                      _mm_hadd_epi16(_mm256_castsi256_si128(bs), _mm256_extracti128_si256(bs, 1)));
    }
  return buf.data();
}

// Q4_K / Q5_K: adds super-block i's product to `a`, given the block's exact integer sums in ggml's 8 lanes
// (`sumi`), its scales (`s`), its 8 mins (int16, lanes 0-7 of `mins`) and the activation block's bsum pairs;
// `y` is the activation's Q8_K block.
template <bool kQ5>
SHARPI_INLINE void k4_block(RowAcc& a, __m256i sumi, const uint8_t* y, const K4Scales& s, __m128i mins,
                            const BsumPairs& pairs) {
  const float yd = q8k_d(y);
  // The mins term's 4 int32 lanes: lane i = mn[2i] * s[2i] + mn[2i+1] * s[2i+1], s[j] the sum of activation
  // sub-block j.
  const __m128i prod = _mm_madd_epi16(mins, _mm_load_si128(reinterpret_cast<const __m128i*>(pairs.v)));
  if (kQ5) {
    // ggml's `summs += dmin * int`: its build contracts this into one fused multiply-add.
    const float dmin = -yd * s.xdmin;
    __m128i hs = _mm_hadd_epi32(_mm_hadd_epi32(prod, _mm_setzero_si128()), _mm_setzero_si128());
    a.summs = std::fma(dmin, static_cast<float>(_mm_extract_epi32(hs, 0)), a.summs);
  } else {
    a.accm = _mm_fmadd_ps(_mm_mul_ps(_mm_set1_ps(yd), s.nxdmin), _mm_cvtepi32_ps(prod), a.accm);
  }
  a.acc = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(yd), s.xd), _mm256_cvtepi32_ps(sumi), a.acc);
}

template <bool kQ5>
SHARPI_INLINE float k4_result(const RowAcc& a) {
  float tail;
  if (kQ5) {
    tail = a.summs;
  } else {
    __m128 am = _mm_add_ps(a.accm, _mm_movehl_ps(a.accm, a.accm));
    am = _mm_add_ss(am, _mm_movehdup_ps(am));
    tail = _mm_cvtss_f32(am);
  }
  return hsum8(a.acc) + tail;
}

// Q6_K: adds super-block i's product to `a`, given the exact sums of scale * stored quant (value + 32) in
// ggml's 8 lanes and the block's 16 scales as int16; subtracts 32 * scale * each 16 activations' sum.
SHARPI_INLINE void q6_block(RowAcc& a, __m256i sumi, const uint8_t* y, float xd, __m256i scales16) {
  const float d = q8k_d(y) * xd;
  const __m256i bsums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y + 260));
  const __m256i sub = _mm256_slli_epi32(_mm256_madd_epi16(bsums, scales16), 5);
  a.acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_sub_epi32(sumi, sub)), a.acc);
}

// ---- Any number of rows ----------------------------------------------------------------------------

// Every row of `rs` in balanced groups of at most kMax rows (kMax 4: 5 -> 2 + 3, 9 -> 3 + 3 + 3): a group of
// 1 would forgo the shared unpacking. fn(std::integral_constant<int, R>{}, q, out) computes one group of R
// rows (R in 1..kMax: the kernel's row count is a template argument, so its sums stay in registers).
template <int kMax, class Fn, int R = kMax>
inline void run_group(int64_t size, const Fn& fn, const uint8_t* const* q, float* const* out) {
  if constexpr (R == 1) {
    fn(std::integral_constant<int, 1>{}, q, out);
  } else {
    if (size == R) fn(std::integral_constant<int, R>{}, q, out);
    else run_group<kMax, Fn, R - 1>(size, fn, q, out);
  }
}

template <int kMax, class Fn>
void group_rows(const RowSet& rs, const Fn& fn) {
  const int64_t groups = (rs.m + kMax - 1) / kMax;
  int64_t r = 0;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t size = (rs.m - r) / (groups - g);
    run_group<kMax>(size, fn, rs.q + r, rs.out + r);
    r += size;
  }
}

// A kernel set's MultiRowFn: `Kernels::group<R>(k, w, w_row, n0, n1, q, out)` computes R activation rows
// (q, out) against weight rows [n0, n1); rows_of runs any number of rows through it in groups of at most kMax.
template <int kMax, class Kernels>
void rows_of(int64_t k, const uint8_t* w, size_t w_row, int64_t n0, int64_t n1, const RowSet& rs) {
  group_rows<kMax>(rs, [&](auto rows, const uint8_t* const* q, float* const* out) {
    Kernels::template group<decltype(rows)::value>(k, w, w_row, n0, n1, q, out);
  });
}

}  // namespace mr
}  // namespace sharpi

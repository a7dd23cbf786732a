// Multi-row kernels for Q4_K, Q5_K and Q6_K weights (AVX2 + FMA + F16C, picked at run time).
//
// Q8_0 has none: its blocks need no unpacking (bytes and one f16 scale), so ggml's vec_dot is already
// bound by the multiply ports, and a multi-row form measured slower than it at every row count.
//
// Loop order: activation rows in blocks of kRowBlock; for each weight row of the tile and each block of
// that row, the block is unpacked once (quants to bytes, scales to int16 vectors) and then multiplied
// with the block of every activation row of the row block. Per (weight row, activation row) the float
// work is ggml's, in ggml's order (see multirow.h); only the unpacking is shared. Compiled with
// -ffp-contract=off so that the compiler adds no fused multiply-add that ggml's build does not have;
// where ggml's C code is contracted by its compiler, the fused form is written out explicitly.
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
// Helpers must inline into the kernels: a call would pass the unpacked block through memory per row.
#define SHARPI_INLINE SHARPI_AVX2 inline __attribute__((always_inline))
#define SHARPI_INLINE_LAMBDA __attribute__((always_inline, target("avx2,fma,f16c")))

constexpr int64_t kRowBlock = 16;  // activation rows whose accumulators stay in L1 at once
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

// Sum over the 8 chunks of 32 values: lane i of chunk c holds scale_c * (products of bytes 4i..4i+3),
// the same lanes as ggml's maddubs / madd pairs.
SHARPI_INLINE __m256i chunk_sums(const __m256i* q, const __m256i* sc, const uint8_t* a) {
  __m256i s = _mm256_setzero_si256();
#pragma GCC unroll 8
  for (int c = 0; c < 8; ++c) {
    __m256i p = _mm256_maddubs_epi16(q[c], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 32 * c)));
    s = _mm256_add_epi32(s, _mm256_madd_epi16(sc[c], p));
  }
  return s;
}

// chunk_sums for two activation rows at once: each quant and scale vector serves both.
SHARPI_INLINE void chunk_sums2(const __m256i* q, const __m256i* sc, const uint8_t* a0, const uint8_t* a1,
                               __m256i& s0, __m256i& s1) {
  s0 = _mm256_setzero_si256();
  s1 = _mm256_setzero_si256();
#pragma GCC unroll 8
  for (int c = 0; c < 8; ++c) {
    const __m256i p0 = _mm256_maddubs_epi16(q[c], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a0 + 32 * c)));
    const __m256i p1 = _mm256_maddubs_epi16(q[c], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a1 + 32 * c)));
    s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(sc[c], p0));
    s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(sc[c], p1));
  }
}

// ---- Q4_K / Q5_K ---------------------------------------------------------------------------------

// Unpacks one Q4_K or Q5_K super-block: quants (values 0..15 or 0..31) in value order, one int16 scale
// vector per chunk of 32 values, the mins as 8 int16 and the two f16 scales.
struct K4Block {
  __m256i q[8];
  __m256i sc[8];
  __m128i mins;
  float d, dmin;
};

SHARPI_INLINE void unpack_k4_scales(const uint8_t* blk, K4Block& b) {
  const __m256i sm = _mm256_cvtepu8_epi16(scale_min_k4(blk + 4));
  const __m256i scales = _mm256_permute2x128_si256(sm, sm, 0x00);  // the 8 scales in both halves
#pragma GCC unroll 8
  for (int c = 0; c < 8; ++c) b.sc[c] = spread16(scales, c);
  b.mins = _mm256_extracti128_si256(sm, 1);
  b.d = f16(blk);
  b.dmin = f16(blk + 2);
}

SHARPI_INLINE void unpack_q4_K(const uint8_t* blk, K4Block& b) {
  unpack_k4_scales(blk, b);
  const __m256i m4 = _mm256_set1_epi8(0xF);
  const uint8_t* qs = blk + 16;
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {
    __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * j));
    b.q[2 * j] = _mm256_and_si256(bits, m4);
    b.q[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4);
  }
}

SHARPI_INLINE void unpack_q5_K(const uint8_t* blk, K4Block& b) {
  unpack_k4_scales(blk, b);
  const __m256i m4 = _mm256_set1_epi8(0xF), one = _mm256_set1_epi8(1);
  const __m256i hbits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16));
  const uint8_t* qs = blk + 48;
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {
    __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * j));
    // Bit 2j (2j + 1) of each qh byte is the fifth bit of the low (high) nibble's value.
    __m256i h0 = _mm256_and_si256(_mm256_srli_epi16(hbits, 2 * j), one);
    __m256i h1 = _mm256_and_si256(_mm256_srli_epi16(hbits, 2 * j + 1), one);
    b.q[2 * j] = _mm256_or_si256(_mm256_and_si256(bits, m4), _mm256_slli_epi16(h0, 4));
    b.q[2 * j + 1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(bits, 4), m4), _mm256_slli_epi16(h1, 4));
  }
}

// The mins term's 4 int32 lanes: lane i = mn[2i] * s[2i] + mn[2i+1] * s[2i+1], s[j] the sum of
// activation sub-block j (its two bsums, added in int16 as ggml's hadd does).
SHARPI_INLINE __m128i mins_lanes(const K4Block& b, const uint8_t* y) {
  __m256i bs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y + 260));
  __m128i s = _mm_hadd_epi16(_mm256_castsi256_si128(bs), _mm256_extracti128_si256(bs, 1));
  return _mm_madd_epi16(b.mins, s);
}

template <bool kQ5>
SHARPI_AVX2 void k4_rows(int64_t k, const uint8_t* w, size_t w_row, int64_t n0, int64_t n1, const RowSet& rs) {
  const int64_t nb = k / kQK;
  const size_t bsz = kQ5 ? kQ5K : kQ4K;
  K4Block b;
  __m256 acc[kRowBlock];
  __m128 accm[kRowBlock];  // Q4_K: the mins term in 4 float lanes
  float summs[kRowBlock];  // Q5_K: the mins term as one float
  for (int64_t r0 = 0; r0 < rs.m; r0 += kRowBlock) {
    const int64_t nr = std::min<int64_t>(kRowBlock, rs.m - r0);
    const uint8_t* const* q = rs.q + r0;
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* wr = w + n * w_row;
      for (int64_t r = 0; r < kRowBlock; ++r) {
        acc[r] = _mm256_setzero_ps();
        accm[r] = _mm_setzero_ps();
        summs[r] = 0.0f;
      }
      for (int64_t i = 0; i < nb; ++i) {
        const uint8_t* blk = wr + i * bsz;
        if (kQ5) unpack_q5_K(blk, b);
        else unpack_q4_K(blk, b);
        // Row r's float work on its integer sums, in ggml's order.
        auto finish = [&](int64_t r, const uint8_t* y, __m256i sumi) SHARPI_INLINE_LAMBDA {
          const float yd = q8k_d(y);
          const float d = yd * b.d;
          const float dmin = -yd * b.dmin;
          const __m128i prod = mins_lanes(b, y);
          if (kQ5) {
            __m128i hs = _mm_hadd_epi32(_mm_hadd_epi32(prod, _mm_setzero_si128()), _mm_setzero_si128());
            // ggml's `summs += dmin * int`: its build contracts this into one fused multiply-add.
            summs[r] = std::fma(dmin, static_cast<float>(_mm_extract_epi32(hs, 0)), summs[r]);
          } else {
            accm[r] = _mm_fmadd_ps(_mm_set1_ps(dmin), _mm_cvtepi32_ps(prod), accm[r]);
          }
          acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc[r]);
        };
        int64_t r = 0;
        for (; r + 1 < nr; r += 2) {
          const uint8_t *y0 = q[r] + i * kQ8K, *y1 = q[r + 1] + i * kQ8K;
          __m256i s0, s1;
          chunk_sums2(b.q, b.sc, y0 + 4, y1 + 4, s0, s1);
          finish(r, y0, s0);
          finish(r + 1, y1, s1);
        }
        if (r < nr) {
          const uint8_t* y = q[r] + i * kQ8K;
          finish(r, y, chunk_sums(b.q, b.sc, y + 4));
        }
      }
      for (int64_t r = 0; r < nr; ++r) {
        float tail;
        if (kQ5) {
          tail = summs[r];
        } else {
          __m128 am = _mm_add_ps(accm[r], _mm_movehl_ps(accm[r], accm[r]));
          am = _mm_add_ss(am, _mm_movehdup_ps(am));
          tail = _mm_cvtss_f32(am);
        }
        rs.out[r0 + r][n] = hsum8(acc[r]) + tail;
      }
    }
  }
}

// ---- Q6_K ----------------------------------------------------------------------------------------

SHARPI_AVX2 void q6_K_rows(int64_t k, const uint8_t* w, size_t w_row, int64_t n0, int64_t n1, const RowSet& rs) {
  const int64_t nb = k / kQK;
  const __m256i m15 = _mm256_set1_epi8(15), m3 = _mm256_set1_epi8(3), m12 = _mm256_set1_epi8(12),
                m48 = _mm256_set1_epi8(48), m192 = _mm256_set1_epi8(static_cast<char>(0xC0));
  __m256i qv[8], sc[8];
  __m256 acc[kRowBlock];
  for (int64_t r0 = 0; r0 < rs.m; r0 += kRowBlock) {
    const int64_t nr = std::min<int64_t>(kRowBlock, rs.m - r0);
    const uint8_t* const* q = rs.q + r0;
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* wr = w + n * w_row;
      for (int64_t r = 0; r < kRowBlock; ++r) acc[r] = _mm256_setzero_ps();
      for (int64_t i = 0; i < nb; ++i) {
        const uint8_t* blk = wr + i * kQ6K;
        const uint8_t* ql = blk;
        const uint8_t* qh = blk + 128;
        const int8_t* scales = reinterpret_cast<const int8_t*>(blk + 192);
        const float xd = f16(blk + 208);
        // Value 128j + 32t + l takes its low 4 bits from ql and bits 2t, 2t+1 of qh[32j + l] as its top 2.
#pragma GCC unroll 2
        for (int j = 0; j < 2; ++j) {
          __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 64 * j));
          __m256i l2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 64 * j + 32));
          __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh + 32 * j));
          qv[4 * j + 0] = _mm256_or_si256(_mm256_and_si256(l1, m15), _mm256_slli_epi16(_mm256_and_si256(h, m3), 4));
          qv[4 * j + 1] = _mm256_or_si256(_mm256_and_si256(l2, m15), _mm256_slli_epi16(_mm256_and_si256(h, m12), 2));
          qv[4 * j + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m15), _mm256_and_si256(h, m48));
          qv[4 * j + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l2, 4), m15),
                                          _mm256_srli_epi16(_mm256_and_si256(h, m192), 2));
        }
        // Chunk c (values 32c..32c+31): int16 lanes 0-7 use scale 2c, lanes 8-15 scale 2c + 1.
#pragma GCC unroll 8
        for (int c = 0; c < 8; ++c)
          sc[c] = _mm256_setr_m128i(_mm_set1_epi16(scales[2 * c]), _mm_set1_epi16(scales[2 * c + 1]));
        const __m256i scales16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales)));
        auto finish = [&](int64_t r, const uint8_t* y, __m256i sums) SHARPI_INLINE_LAMBDA {
          const float d = q8k_d(y) * xd;
          // The stored quants are value + 32: subtract 32 * scale * (sum of each 16 activations).
          const __m256i bsums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y + 260));
          const __m256i sub = _mm256_slli_epi32(_mm256_madd_epi16(bsums, scales16), 5);
          const __m256i sumi = _mm256_sub_epi32(sums, sub);
          acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc[r]);
        };
        int64_t r = 0;
        for (; r + 1 < nr; r += 2) {
          const uint8_t *y0 = q[r] + i * kQ8K, *y1 = q[r + 1] + i * kQ8K;
          __m256i s0, s1;
          chunk_sums2(qv, sc, y0 + 4, y1 + 4, s0, s1);
          finish(r, y0, s0);
          finish(r + 1, y1, s1);
        }
        if (r < nr) {
          const uint8_t* y = q[r] + i * kQ8K;
          finish(r, y, chunk_sums(qv, sc, y + 4));
        }
      }
      for (int64_t r = 0; r < nr; ++r) rs.out[r0 + r][n] = hsum8(acc[r]);
    }
  }
}

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

int64_t multirow_min_rows(int qtype) { return qtype == GGML_TYPE_Q4_K ? 6 : 3; }

void set_multirow_enabled(bool on) { g_enabled.store(on); }
bool multirow_enabled() { return g_enabled.load(); }

MultiRowFn multirow_kernel(int qtype) {
  static const bool avx2 = cpu_has_avx2();
  if (!avx2 || !g_enabled.load(std::memory_order_relaxed)) return nullptr;
  switch (qtype) {
    case GGML_TYPE_Q4_K: return k4_rows<false>;
    case GGML_TYPE_Q5_K: return k4_rows<true>;
    case GGML_TYPE_Q6_K: return q6_K_rows;
    default: return nullptr;
  }
}

}  // namespace sharpi

// Multi-row kernels for Q4_K, Q5_K and Q6_K weights, AVX-512 (F, BW, VL) with VNNI, picked at run time
// where the CPU has them (csrc/multirow.cc chooses).
//
// Same products, same bits as the AVX2 kernels (ggml's AVX2 vec_dot): a 512-bit register holds two 32-value
// chunks of a weight row, side by side in the order the activation block stores them, so one 64-byte
// activation load, one `vpmaddubsw` and one `vpdpwssd` (multiply by the chunks' scales and add, fused)
// serve two chunks of one row. Each 256-bit half accumulates the int32 lanes ggml puts in its 8 lanes for
// its chunk; the halves are added at the end of each super-block. Integer sums are exact (no lane can
// saturate: a pair of products of a 6-bit quant and an int8 is at most 2 * 63 * 128 = 16128 in magnitude), so the folded
// lanes equal ggml's, and the float steps that follow are the shared ones in ggml's order
// (multirow_common.h). The 32 vector registers hold the sums of up to 8 activation rows, so a weight chunk
// is unpacked once for twice as many rows as on AVX2.
#include <immintrin.h>

#include "ggml.h"
#include "multirow_common.h"

namespace sharpi {
namespace {

using namespace mr;

#define SHARPI_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
#define SHARPI_INLINE512 SHARPI_AVX512 inline __attribute__((always_inline))

constexpr int kGroup = 8;  // activation rows per pass over a weight row

SHARPI_INLINE512 __m512i load512(const uint8_t* p) { return _mm512_loadu_si512(p); }
SHARPI_INLINE512 __m512i broadcast256(const uint8_t* p) {
  return _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
// 32 int16 shift counts: a in the low 256 bits, b in the high 256 bits.
SHARPI_INLINE512 __m512i counts(int a, int b) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16(static_cast<int16_t>(a))),
                            _mm256_set1_epi16(static_cast<int16_t>(b)), 1);
}
// The low and the high 256 bits of exact int32 sums added: ggml's 8 lanes for a pair of chunks.
SHARPI_INLINE512 __m256i fold(__m512i s) {
  return _mm256_add_epi32(_mm512_castsi512_si256(s), _mm512_extracti64x4_epi64(s, 1));
}

// ---- Q4_K / Q5_K ---------------------------------------------------------------------------------
//
// Chunk pair j (values 64j..64j+63): the low half holds the low nibbles of qs[32j..32j+31] (sub-block 2j),
// the high half their high nibbles (sub-block 2j+1); Q5_K's fifth bit is bit 2j / 2j+1 of each hbits byte.
template <bool kQ5, int R>
SHARPI_AVX512 void k4_group(int64_t k, const uint8_t* w, size_t w_row, int64_t n0, int64_t n1,
                            const uint8_t* const* q, float* const* out) {
  const int64_t nb = k / kQK;
  const size_t bsz = kQ5 ? kQ5K : kQ4K;
  const __m512i m4 = _mm512_set1_epi8(0xF), one = _mm512_set1_epi8(1), nibble = counts(0, 4);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = w + n * w_row;
    RowAcc a[R];
    for (int r = 0; r < R; ++r) a[r] = row_acc_zero();
    for (int64_t i = 0; i < nb; ++i) {
      const uint8_t* blk = wr + i * bsz;
      const __m128i sm = scale_min_k4(blk + 4);
      // The 8 scales as int16, repeated in every 128-bit lane (for the byte shuffles below).
      const __m512i scales = _mm512_broadcast_i32x4(_mm_cvtepu8_epi16(sm));
      const uint8_t* qs = blk + (kQ5 ? 48 : 16);
      __m512i hbits = _mm512_setzero_si512();
      if (kQ5) hbits = broadcast256(blk + 16);
      __m512i sumi[R];
      for (int r = 0; r < R; ++r) sumi[r] = _mm512_setzero_si512();
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        __m512i qv = _mm512_and_si512(_mm512_srlv_epi16(broadcast256(qs + 32 * j), nibble), m4);
        if (kQ5)
          qv = _mm512_or_si512(qv, _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(hbits, counts(2 * j, 2 * j + 1)), one), 4));
        // Scale 2j over the low half's int16 lanes, 2j + 1 over the high half's.
        const int16_t lo = static_cast<int16_t>((4 * j) | ((4 * j + 1) << 8));
        const int16_t hi = static_cast<int16_t>((4 * j + 2) | ((4 * j + 3) << 8));
        const __m512i sc = _mm512_shuffle_epi8(
            scales, _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16(lo)), _mm256_set1_epi16(hi), 1));
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const __m512i p = _mm512_maddubs_epi16(qv, load512(q[r] + i * kQ8K + 4 + 64 * j));
          sumi[r] = _mm512_dpwssd_epi32(sumi[r], sc, p);
        }
      }
      const __m128i mins = _mm_cvtepu8_epi16(_mm_srli_si128(sm, 8));
      const float xd = f16(blk), xdmin = f16(blk + 2);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) k4_block<kQ5>(a[r], fold(sumi[r]), q[r] + i * kQ8K, xd, xdmin, mins);
    }
    for (int r = 0; r < R; ++r) out[r][n] = k4_result<kQ5>(a[r]);
  }
}

// ---- Q6_K ----------------------------------------------------------------------------------------
//
// Half j of a super-block (values 128j..128j+127) is two chunk pairs: ql[64j..64j+63] holds the low
// nibbles of chunks 4j, 4j+1 (the first pair) and their high nibbles those of chunks 4j+2, 4j+3; qh[32j + l]
// gives bits (2t, 2t+1) to value 128j + 32t + l. In chunk c, int16 lanes 0-7 use scale 2c, lanes 8-15 2c+1:
// in a register of chunks (c, c+1) the four 128-bit lanes use scales 2c .. 2c+3.
template <int R>
SHARPI_AVX512 void q6_group(int64_t k, const uint8_t* w, size_t w_row, int64_t n0, int64_t n1,
                            const uint8_t* const* q, float* const* out) {
  const int64_t nb = k / kQK;
  const __m512i m15 = _mm512_set1_epi8(15), m3 = _mm512_set1_epi8(3);
  alignas(64) static const int16_t kLaneOf[32] = {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                  2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3};
  const __m512i lanes = _mm512_load_si512(kLaneOf);  // each int16 lane's 128-bit lane
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = w + n * w_row;
    RowAcc a[R];
    for (int r = 0; r < R; ++r) a[r] = row_acc_zero();
    for (int64_t i = 0; i < nb; ++i) {
      const uint8_t* blk = wr + i * kQ6K;
      const uint8_t* ql = blk;
      const uint8_t* qh = blk + 128;
      const __m256i scales16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192)));
      const __m512i scales = _mm512_castsi256_si512(scales16);
      __m512i sumi[R];
      for (int r = 0; r < R; ++r) sumi[r] = _mm512_setzero_si512();
#pragma GCC unroll 2
      for (int j = 0; j < 2; ++j) {
        const __m512i l = load512(ql + 64 * j);
        const __m512i h = broadcast256(qh + 32 * j);
        __m512i qv[2];
        qv[0] = _mm512_or_si512(_mm512_and_si512(l, m15),
                                _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(h, counts(0, 2)), m3), 4));
        qv[1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), m15),
                                _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(h, counts(4, 6)), m3), 4));
#pragma GCC unroll 2
        for (int t = 0; t < 2; ++t) {
          const int c = 4 * j + 2 * t;  // the pair's first chunk
          // int16 lane e takes scale 2c + (its 128-bit lane): vpermw with index 2c + lane.
          const __m512i idx = _mm512_add_epi16(_mm512_set1_epi16(static_cast<int16_t>(2 * c)), lanes);
          const __m512i sc = _mm512_permutexvar_epi16(idx, scales);
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) {
            const __m512i p = _mm512_maddubs_epi16(qv[t], load512(q[r] + i * kQ8K + 4 + 32 * c));
            sumi[r] = _mm512_dpwssd_epi32(sumi[r], sc, p);
          }
        }
      }
      const float xd = f16(blk + 208);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) q6_block(a[r], fold(sumi[r]), q[r] + i * kQ8K, xd, scales16);
    }
    for (int r = 0; r < R; ++r) out[r][n] = hsum8(a[r].acc);
  }
}

// A product's rows through the kernels, in groups of at most kGroup.
template <bool kQ5>
void k4_rows(int64_t k, const uint8_t* w, size_t w_row, int64_t n0, int64_t n1, const RowSet& rs) {
  group_rows<kGroup>(rs, [&](auto rows, const uint8_t* const* q, float* const* out) {
    k4_group<kQ5, decltype(rows)::value>(k, w, w_row, n0, n1, q, out);
  });
}
void q6_rows(int64_t k, const uint8_t* w, size_t w_row, int64_t n0, int64_t n1, const RowSet& rs) {
  group_rows<kGroup>(rs, [&](auto rows, const uint8_t* const* q, float* const* out) {
    q6_group<decltype(rows)::value>(k, w, w_row, n0, n1, q, out);
  });
}

}  // namespace

bool cpu_has_avx512_kernels() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
         __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

// Q5_K's fifth bit costs the 512-bit form more shared work per chunk than it saves per row: below 5 rows
// (one group) the AVX2 kernel measured faster (same bits either way).
void q5_rows(int64_t k, const uint8_t* w, size_t w_row, int64_t n0, int64_t n1, const RowSet& rs) {
  if (rs.m <= 4) avx2_kernel(GGML_TYPE_Q5_K)(k, w, w_row, n0, n1, rs);
  else k4_rows<true>(k, w, w_row, n0, n1, rs);
}

MultiRowFn avx512_kernel(int qtype) {
  switch (qtype) {
    case GGML_TYPE_Q4_K: return k4_rows<false>;
    case GGML_TYPE_Q5_K: return q5_rows;
    case GGML_TYPE_Q6_K: return q6_rows;
    default: return nullptr;
  }
}

}  // namespace sharpi

// Multi-row kernels for Q4_K, Q5_K, Q6_K and Q8_0 weights, AVX-512 (F, BW, VL) with VNNI, picked at run time
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
// is unpacked once for twice as many rows as on AVX2. From 4 rows the K-quant kernels take "packed dots"
// instead (below): the same lanes from three multiplies a 128 values instead of four.
#include <immintrin.h>

#include <vector>

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

// ---- Two rows' float steps in one register ----------------------------------------------------------
//
// Rows 2p and 2p + 1 side by side: the low 256 bits hold row 2p's 8 lanes of ggml's float steps, the high
// 256 bits row 2p + 1's (Q4_K's 4 mins lanes likewise in a 256-bit register). Each lane runs the same
// operations in the same order as the one-row steps of multirow_common.h, so each row keeps its bits, and
// a pair costs about the float work of one row.
struct PairAcc {
  __m512 acc;
  __m256 accm;
};

SHARPI_INLINE512 PairAcc pair_acc_zero() { return PairAcc{_mm512_setzero_ps(), _mm256_setzero_ps()}; }

// fold() of two rows at once: [lo(a) + hi(a) | lo(b) + hi(b)].
SHARPI_INLINE512 __m512i fold2(__m512i a, __m512i b) {
  return _mm512_add_epi32(_mm512_shuffle_i64x2(a, b, 0x44), _mm512_shuffle_i64x2(a, b, 0xEE));
}

// [x x8 | y x8] and [x x4 | y x4]: two activation rows' block scales.
SHARPI_INLINE512 __m512 two8(float x, float y) {
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(_mm256_set1_ps(x))),
                                             _mm256_castps_pd(_mm256_set1_ps(y)), 1));
}
SHARPI_INLINE512 __m256 two4(float x, float y) {
  return _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_set1_ps(x)), _mm_set1_ps(y), 1);
}

// A pair's row (half 0: row 2p, half 1: row 2p + 1) as a one-row accumulator, for k4_result / hsum8.
SHARPI_INLINE512 RowAcc pair_row(const PairAcc& a, int half) {
  if (half == 0) return RowAcc{_mm512_castps512_ps256(a.acc), _mm256_castps256_ps128(a.accm), 0.0f};
  return RowAcc{_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a.acc), 1)),
                _mm256_extractf128_ps(a.accm, 1), 0.0f};
}

// Each pair's activation block scales, [yd0 x8 | yd1 x8] and [yd0 x4 | yd1 x4], for every block: they depend
// on the activation only, so a kernel builds them once per call (a tile of weight rows) instead of once per
// weight block (two loads, two broadcasts and an insert each; 4-5% of a 2-4 row Q4_K product in cache).
// The buffer is the calling thread's, reused by its next call.
struct alignas(64) PairScales {
  __m512 d8;
  __m256 d4;
};

template <int R>
SHARPI_INLINE512 const PairScales* pair_scales(int64_t nb, const uint8_t* const* q) {
  constexpr int P = R / 2;
  thread_local std::vector<PairScales> buf;
  buf.resize(static_cast<size_t>(P * nb));
  for (int64_t i = 0; i < nb; ++i)
    for (int p = 0; p < P; ++p) {
      const float yd0 = q8k_d(q[2 * p] + i * kQ8K), yd1 = q8k_d(q[2 * p + 1] + i * kQ8K);
      buf[i * P + p] = PairScales{two8(yd0, yd1), two4(yd0, yd1)};
    }
  return buf.data();
}

// ---- Packed dots: one vpdpbusd per 64 values, then the chunk scales on int16 --------------------------
//
// ggml's int32 lane i of a 32-value chunk is its scale times S, the sum of the products of bytes 4i..4i+3;
// |S| <= 4 * 63 * 128 = 32256 fits an int16 for every K-quant here (quants 0..63, Q8_K values -128..127). So
// instead of vpmaddubsw + vpdpwssd per chunk pair and row (four multiplies a 128 values), a row takes S of two
// chunk pairs X and Y with one vpdpbusd each, packs the two results to int16 (vpackssdw, no saturation
// possible) and multiplies them by the chunks' scales with one vpdpwssd: three multiplies and a shuffle a 128
// values, the lanes' integer sums unchanged (exact). For the packed int16 pairs to be (X's S, Y's S) of the same ggml lane, the dwords
// of X and Y are interleaved first, per 128-bit lane (vpunpckl/hdq): once per weight block for the weights,
// once per call for the activations (`interleaved_rows`). Then int32 lane k of 128-bit lane L of a row's
// sums holds X's and Y's dword k of lane L, the same place as in the unpacked form, and fold() applies.

// Each activation row's quants with the dwords of bytes [128h, 128h + 64) and [128h + 64, 128h + 128) of each
// block interleaved (unpacklo, unpackhi), [block][row][h][2]: built once per call, the calling thread's buffer.
struct alignas(64) Zmm {
  __m512i v;
};

template <int R>
SHARPI_INLINE512 const Zmm* interleaved_rows(int64_t nb, const uint8_t* const* q) {
  thread_local std::vector<Zmm> buf;
  buf.resize(static_cast<size_t>(nb * R * 4));
  for (int64_t i = 0; i < nb; ++i)
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < 2; ++h) {
        const uint8_t* y = q[r] + i * kQ8K + 4 + 128 * h;
        const __m512i x = load512(y), z = load512(y + 64);
        buf[((i * R + r) * 2 + h) * 2].v = _mm512_unpacklo_epi32(x, z);
        buf[((i * R + r) * 2 + h) * 2 + 1].v = _mm512_unpackhi_epi32(x, z);
      }
  return buf.data();
}

// sums += the scaled S of the interleaved weight chunks (u = unpacklo, v = unpackhi of X and Y) against a
// row's interleaved activations y[0], y[1]; sc holds X's chunk scale in the even int16 lanes, Y's in the odd.
SHARPI_INLINE512 __m512i packed_dot(__m512i sums, __m512i u, __m512i v, const Zmm* y, __m512i sc) {
  const __m512i zero = _mm512_setzero_si512();
  const __m512i s = _mm512_packs_epi32(_mm512_dpbusd_epi32(zero, u, y[0].v), _mm512_dpbusd_epi32(zero, v, y[1].v));
  return _mm512_dpwssd_epi32(sums, sc, s);
}

// From how many activation rows the kernels use the packed dots: with fewer, the interleaving of the weights
// (two shuffles a 128 values) and of the activations (per call) is shared by too few rows (Intel Xeon, 2
// threads: 0.92-1.0x the unpacked form at 2 rows; 1.04-1.11x from 4 rows for Q4_K and Q6_K at K = 2048).
constexpr int kPackedFrom = 4;

// k4_block (Q4_K) for two rows: yd their block scales, pr their bsum pairs (side by side); xd2 / nxdmin2 the
// weight block's d and -dmin broadcast, mins2 its mins in both 128-bit halves.
SHARPI_INLINE512 void k4_pair(PairAcc& a, __m512i s0, __m512i s1, const PairScales& yd, __m512 xd2, __m256 nxdmin2,
                              __m256i mins2, const BsumPairs* pr) {
  const __m256i prod = _mm256_madd_epi16(mins2, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pr)));
  a.accm = _mm256_fmadd_ps(_mm256_mul_ps(yd.d4, nxdmin2), _mm256_cvtepi32_ps(prod), a.accm);
  a.acc = _mm512_fmadd_ps(_mm512_mul_ps(yd.d8, xd2), _mm512_cvtepi32_ps(fold2(s0, s1)), a.acc);
}

// Each pair's 16 bsums of every block side by side, [row 2p | row 2p + 1] ([block][pair]): built once per call.
template <int R>
SHARPI_INLINE512 const Zmm* pair_bsums(int64_t nb, const uint8_t* const* q) {
  constexpr int P = R / 2;
  thread_local std::vector<Zmm> buf;
  buf.resize(static_cast<size_t>(P * nb));
  for (int64_t i = 0; i < nb; ++i)
    for (int p = 0; p < P; ++p)
      buf[i * P + p].v = _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q[2 * p] + i * kQ8K + 260))),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q[2 * p + 1] + i * kQ8K + 260)), 1);
  return buf.data();
}

// q6_block for two rows: bs their bsums (pair_bsums), nscales2 the block's 16 scales times -32 (int16, exact:
// |32 * -128| = 4096) in both 256-bit halves, xd2 its d broadcast. q6_block's `sumi - (madd(bsums, scales) << 5)`
// as one vpdpwssd: the same exact integers (no lane can wrap: 2 * 2048 * 4096 < 2^31).
SHARPI_INLINE512 void q6_pair(PairAcc& a, __m512i s0, __m512i s1, const Zmm& bs, const PairScales& yd, __m512 xd2,
                              __m512i nscales2) {
  const __m512i sumi = _mm512_dpwssd_epi32(fold2(s0, s1), bs.v, nscales2);
  a.acc = _mm512_fmadd_ps(_mm512_mul_ps(yd.d8, xd2), _mm512_cvtepi32_ps(sumi), a.acc);
}

// ---- Q4_K / Q5_K ---------------------------------------------------------------------------------
//
// Chunk pair j (values 64j..64j+63): the low half holds the low nibbles of qs[32j..32j+31] (sub-block 2j),
// the high half their high nibbles (sub-block 2j+1); Q5_K's fifth bit is bit 2j / 2j+1 of each hbits byte.
template <bool kQ5>
struct K4 {
  // Chunk pair j's quants: sub-block 2j in the low half, 2j + 1 in the high half.
  SHARPI_INLINE512 static __m512i chunk_pair(const uint8_t* qs, __m512i hbits, int j) {
    const __m512i m4 = _mm512_set1_epi8(0xF), one = _mm512_set1_epi8(1);
    __m512i qv = _mm512_and_si512(_mm512_srlv_epi16(broadcast256(qs + 32 * j), counts(0, 4)), m4);
    if (kQ5)
      qv = _mm512_or_si512(qv, _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(hbits, counts(2 * j, 2 * j + 1)), one), 4));
    return qv;
  }

  template <int R>
  SHARPI_AVX512 static void group(int64_t k, const uint8_t* w, size_t w_row, int64_t n0, int64_t n1,
                                  const uint8_t* const* q, float* const* out) {
    constexpr bool kPacked = R >= kPackedFrom;
    const int64_t nb = k / kQK;
    const Zmm* yi = kPacked ? interleaved_rows<R>(nb, q) : nullptr;
    const size_t bsz = kQ5 ? kQ5K : kQ4K;
    const BsumPairs* pairs = bsum_pairs<R>(nb, q);
    // Q4_K runs its rows' float steps in pairs (an odd last row alone); Q5_K's mins term is a scalar per row.
    constexpr int P = kQ5 ? 0 : R / 2;
    const PairScales* yds = pair_scales<P * 2>(nb, q);
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* wr = w + n * w_row;
      RowAcc a[R];
      PairAcc pa[P > 0 ? P : 1];
      for (int r = 0; r < R; ++r) a[r] = row_acc_zero();
      for (int p = 0; p < P; ++p) pa[p] = pair_acc_zero();
      for (int64_t i = 0; i < nb; ++i) {
        const uint8_t* blk = wr + i * bsz;
        prefetch_rows<R>(blk, bsz);
        const __m128i sm = scale_min_k4(blk + 4);
        // The 8 scales as int16, repeated in every 128-bit lane (for the byte shuffles below).
        const __m512i scales = _mm512_broadcast_i32x4(_mm_cvtepu8_epi16(sm));
        const uint8_t* qs = blk + (kQ5 ? 48 : 16);
        __m512i hbits = _mm512_setzero_si512();
        if (kQ5) hbits = broadcast256(blk + 16);
        __m512i sumi[R];
        for (int r = 0; r < R; ++r) sumi[r] = _mm512_setzero_si512();
        if constexpr (kPacked) {
#pragma GCC unroll 2
          for (int h = 0; h < 2; ++h) {  // chunk pairs X = 2h, Y = 2h + 1
            const __m512i x = chunk_pair(qs, hbits, 2 * h), y = chunk_pair(qs, hbits, 2 * h + 1);
            const __m512i u = _mm512_unpacklo_epi32(x, y), v = _mm512_unpackhi_epi32(x, y);
            // Low half: X's scale 4h in the even int16 lanes, Y's 4h + 2 in the odd; high half 4h + 1, 4h + 3.
            const int lo = (8 * h) | ((8 * h + 1) << 8) | ((8 * h + 4) << 16) | ((8 * h + 5) << 24);
            const int hi = lo + 0x02020202;
            const __m512i sc = _mm512_shuffle_epi8(
                scales, _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi32(lo)), _mm256_set1_epi32(hi), 1));
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r) sumi[r] = packed_dot(sumi[r], u, v, yi + ((i * R + r) * 2 + h) * 2, sc);
          }
        } else {
#pragma GCC unroll 4
          for (int j = 0; j < 4; ++j) {
            const __m512i qv = chunk_pair(qs, hbits, j);
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
        }
        const __m128i mins = _mm_cvtepu8_epi16(_mm_srli_si128(sm, 8));
        const K4Scales fs = k4_scales(blk);
        if constexpr (P > 0) {
          const __m512 xd2 = _mm512_castpd_ps(
              _mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(fs.xd)), _mm256_castps_pd(fs.xd), 1));
          const __m256 nxdmin2 = _mm256_insertf128_ps(_mm256_castps128_ps256(fs.nxdmin), fs.nxdmin, 1);
          const __m256i mins2 = _mm256_broadcastsi128_si256(mins);
#pragma GCC unroll 4
          for (int p = 0; p < P; ++p)
            k4_pair(pa[p], sumi[2 * p], sumi[2 * p + 1], yds[i * P + p], xd2, nxdmin2, mins2, pairs + i * R + 2 * p);
        }
#pragma GCC unroll 8
        for (int r = 2 * P; r < R; ++r) k4_block<kQ5>(a[r], fold(sumi[r]), q[r] + i * kQ8K,
                                                       fs, mins, pairs[i * R + r]);
      }
      for (int p = 0; p < P; ++p) {
        out[2 * p][n] = k4_result<kQ5>(pair_row(pa[p], 0));
        out[2 * p + 1][n] = k4_result<kQ5>(pair_row(pa[p], 1));
      }
      for (int r = 2 * P; r < R; ++r) out[r][n] = k4_result<kQ5>(a[r]);
    }
  }
};

// ---- Q6_K ----------------------------------------------------------------------------------------
//
// Half j of a super-block (values 128j..128j+127) is two chunk pairs: ql[64j..64j+63] holds the low
// nibbles of chunks 4j, 4j+1 (the first pair) and their high nibbles those of chunks 4j+2, 4j+3; qh[32j + l]
// gives bits (2t, 2t+1) to value 128j + 32t + l. In chunk c, int16 lanes 0-7 use scale 2c, lanes 8-15 2c+1:
// in a register of chunks (c, c+1) the four 128-bit lanes use scales 2c .. 2c+3.
struct Q6 {
  template <int R>
  SHARPI_AVX512 static void group(int64_t k, const uint8_t* w, size_t w_row, int64_t n0, int64_t n1,
                                  const uint8_t* const* q, float* const* out) {
    constexpr bool kPacked = R >= kPackedFrom;
    const int64_t nb = k / kQK;
    const Zmm* yi = kPacked ? interleaved_rows<R>(nb, q) : nullptr;
    // Packed dots, half j: X = chunks (4j, 4j + 1), Y = (4j + 2, 4j + 3); 128-bit lane L of X uses scale 8j + L,
    // of Y 8j + 4 + L: int16 lane e takes scale 8j + (its 128-bit lane) + (4 if e is odd).
    alignas(64) static const int16_t kPackedScale[32] = {0, 4, 0, 4, 0, 4, 0, 4, 1, 5, 1, 5, 1, 5, 1, 5,
                                                         2, 6, 2, 6, 2, 6, 2, 6, 3, 7, 3, 7, 3, 7, 3, 7};
    const __m512i m15 = _mm512_set1_epi8(15), m3 = _mm512_set1_epi8(3);
    alignas(64) static const int16_t kLaneOf[32] = {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                    2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3};
    const __m512i lanes = _mm512_load_si512(kLaneOf);  // each int16 lane's 128-bit lane
    // Rows whose float steps run in pairs (an odd last row alone): from 4 rows, where pairs measured faster
    // (one Zen 4 thread: 55 -> 55 and 60 -> 62 GMAC/s at 4 and 8 rows; 44 -> 42 at 2).
    constexpr int P = R >= 4 ? R / 2 : 0;
    const PairScales* yds = pair_scales<P * 2>(nb, q);
    const Zmm* bss = pair_bsums<P * 2>(nb, q);
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* wr = w + n * w_row;
      RowAcc a[R];
      PairAcc pa[P > 0 ? P : 1];
      for (int r = 0; r < R; ++r) a[r] = row_acc_zero();
      for (int p = 0; p < P; ++p) pa[p] = pair_acc_zero();
      for (int64_t i = 0; i < nb; ++i) {
        const uint8_t* blk = wr + i * kQ6K;
        prefetch_rows<R>(blk, kQ6K);
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
          if constexpr (kPacked) {
            const __m512i u = _mm512_unpacklo_epi32(qv[0], qv[1]), v = _mm512_unpackhi_epi32(qv[0], qv[1]);
            const __m512i sc = _mm512_permutexvar_epi16(
                _mm512_add_epi16(_mm512_set1_epi16(static_cast<int16_t>(8 * j)), _mm512_load_si512(kPackedScale)), scales);
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r) sumi[r] = packed_dot(sumi[r], u, v, yi + ((i * R + r) * 2 + j) * 2, sc);
            continue;
          }
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
        if constexpr (P > 0) {
          const __m512 xd2 = _mm512_set1_ps(xd);
          const __m512i nscales2 =
              _mm512_sub_epi16(_mm512_setzero_si512(), _mm512_slli_epi16(_mm512_inserti64x4(scales, scales16, 1), 5));
#pragma GCC unroll 4
          for (int p = 0; p < P; ++p)
            q6_pair(pa[p], sumi[2 * p], sumi[2 * p + 1], bss[i * P + p], yds[i * P + p], xd2, nscales2);
        }
#pragma GCC unroll 8
        for (int r = 2 * P; r < R; ++r) q6_block(a[r], fold(sumi[r]), q[r] + i * kQ8K, xd, scales16);
      }
      for (int p = 0; p < P; ++p) {
        out[2 * p][n] = hsum8(pair_row(pa[p], 0).acc);
        out[2 * p + 1][n] = hsum8(pair_row(pa[p], 1).acc);
      }
      for (int r = 2 * P; r < R; ++r) out[r][n] = hsum8(a[r].acc);
    }
  }
};

// ---- Q8_0 ------------------------------------------------------------------------------------------
//
// ggml's AVX2 vec_dot for Q8_0 x Q8_0, per 32-value block: ax = sign(x, x), sy = sign(y, x), int32 lane i =
// the products of bytes 4i..4i+3 (vpmaddubsw, vpmaddwd by ones), converted to float and added with one fused
// multiply-add by d = f16(x.d) * f16(y.d) into 8 float lanes, block after block; then its horizontal sum.
// Here a 512-bit register holds two blocks' quants: |x| and the sign mask are shared by the group, each row
// pays one masked negation (where x is 0, |x| is 0, so y need not be zeroed) and one vpdpbusd. The lane sums
// are exact and equal to ggml's (|x| <= 128, so no int16 pair of vpmaddubsw can saturate: |2 * 128 * 128|
// = 32768 only as -32768), and each 256-bit half is fused into the row's 8 lanes in block order.
struct Q80 {
  static constexpr size_t kBlock = 34;  // f16 d; int8 qs[32]

  // The quants of blocks p (low 256 bits) and p + 1 (high), weight or activation.
  SHARPI_INLINE512 static __m512i pair(const uint8_t* p) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2))),
                              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + kBlock + 2)), 1);
  }

  template <int R>
  SHARPI_AVX512 static void group(int64_t k, const uint8_t* w, size_t w_row, int64_t n0, int64_t n1,
                                  const uint8_t* const* q, float* const* out) {
    const int64_t nb = k / 32;
    const __m512i zero = _mm512_setzero_si512();
    // The rows' block scales as floats, [block][8 rows] (converted once per tile, not once per weight row):
    // f16(x.d) * these in one vector multiply is each row's d, ggml's scalar product.
    thread_local std::vector<float> yd_buf;
    yd_buf.assign(static_cast<size_t>(nb) * 8, 0.0f);
    float* yd = yd_buf.data();
    for (int64_t i = 0; i < nb; ++i)
      for (int r = 0; r < R; ++r) yd[i * 8 + r] = f16(q[r] + i * kBlock);
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* wr = w + n * w_row;
      __m256 acc[R];
      for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
      int64_t i = 0;
      for (; i + 2 <= nb; i += 2) {
        const uint8_t* b = wr + i * kBlock;
        prefetch_rows<R>(b, 2 * kBlock);
        const __m512i x = pair(b);
        const __mmask64 neg = _mm512_movepi8_mask(x);
        const __m512i ax = _mm512_abs_epi8(x);
        const __m256 d0 = _mm256_mul_ps(_mm256_set1_ps(f16(b)), _mm256_loadu_ps(yd + i * 8));
        const __m256 d1 = _mm256_mul_ps(_mm256_set1_ps(f16(b + kBlock)), _mm256_loadu_ps(yd + i * 8 + 8));
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const uint8_t* a = q[r] + i * kBlock;
          const __m512i y = pair(a);
          const __m512 f = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(zero, ax, _mm512_mask_sub_epi8(y, neg, zero, y)));
          const __m256i lane = _mm256_set1_epi32(r);
          acc[r] = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(d0, lane), _mm512_castps512_ps256(f), acc[r]);
          acc[r] = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(d1, lane),
                                   _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(f), 1)), acc[r]);
        }
      }
      if (i < nb) {  // an odd last block: ggml's own steps
        const uint8_t* b = wr + i * kBlock;
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
        const __m256i ax = _mm256_sign_epi8(x, x), ones = _mm256_set1_epi16(1);
        const float xd = f16(b);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const uint8_t* a = q[r] + i * kBlock;
          const __m256i sy = _mm256_sign_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 2)), x);
          const __m256 f = _mm256_cvtepi32_ps(_mm256_madd_epi16(ones, _mm256_maddubs_epi16(ax, sy)));
          acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(xd * f16(a)), f, acc[r]);
        }
      }
      for (int r = 0; r < R; ++r) out[r][n] = hsum8(acc[r]);
    }
  }
};

// ---- F32 ------------------------------------------------------------------------------------------
//
// multirow.cc's F32 (ggml's vec_dot_f32 order) with a 512-bit register holding two of its 8-lane sums, (s0 | s1)
// and (s2 | s3): their sum is (s0 + s2 | s1 + s3), and its halves added are ggml's (s0 + s2) + (s1 + s3). 16 sums
// of 8 rows and 2 weight vectors fit the 32 registers.
struct F32 {
  template <int R>
  SHARPI_AVX512 static void group(int64_t k, const uint8_t* w, size_t w_row, int64_t n0, int64_t n1,
                                  const uint8_t* const* q, float* const* out) {
    const float* y[R];
    for (int r = 0; r < R; ++r) y[r] = reinterpret_cast<const float*>(q[r]);
    for (int64_t n = n0; n < n1; ++n) {
      const float* x = reinterpret_cast<const float*>(w + n * w_row);
      __m512 s[R][2];
      for (int r = 0; r < R; ++r) s[r][0] = s[r][1] = _mm512_setzero_ps();
      for (int64_t i = 0; i < k; i += 32) {
        prefetch_ahead(reinterpret_cast<const uint8_t*>(x + i), 128);
        const __m512 a = _mm512_loadu_ps(x + i), b = _mm512_loadu_ps(x + i + 16);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          s[r][0] = _mm512_fmadd_ps(a, _mm512_loadu_ps(y[r] + i), s[r][0]);
          s[r][1] = _mm512_fmadd_ps(b, _mm512_loadu_ps(y[r] + i + 16), s[r][1]);
        }
      }
      for (int r = 0; r < R; ++r) {
        const __m512 t = _mm512_add_ps(s[r][0], s[r][1]);
        out[r][n] = f32_hsum(_mm256_add_ps(_mm512_castps512_ps256(t),
                                           _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(t), 1))));
      }
    }
  }
};

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
  else rows_of<kGroup, K4<true>>(k, w, w_row, n0, n1, rs);
}

int64_t avx512_group_rows() { return kGroup; }

MultiRowFn avx512_kernel(int qtype) {
  switch (qtype) {
    case GGML_TYPE_Q4_K: return rows_of<kGroup, K4<false>>;
    case GGML_TYPE_Q5_K: return q5_rows;
    case GGML_TYPE_Q6_K: return rows_of<kGroup, Q6>;
    case GGML_TYPE_Q8_0: return rows_of<kGroup, Q80>;
    case GGML_TYPE_F32: return rows_of<kGroup, F32>;
    default: return nullptr;
  }
}

}  // namespace sharpi

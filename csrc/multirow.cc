// Multi-row kernels for Q4_K, Q5_K and Q6_K weights, AVX2 + FMA + F16C, and the choice between them and the
// AVX-512 ones (csrc/multirow_avx512.cc) at run time.
//
// Q8_0 has no AVX2 kernel: its blocks need no unpacking (bytes and one f16 scale), and a 256-bit multi-row
// form measured 0.93-1.0x ggml's vec_dot at every row count (Zen 3). The AVX-512 set has one
// (multirow_avx512.cc: two blocks a register, vpdpbusd), from two rows.
//
// Loop order: for each weight row of the tile and each super-block, each 32-value chunk is unpacked into
// registers (quants to bytes, its scale to an int16 vector) and multiplied at once with the same chunk of
// a group of up to 4 activation rows, as ggml's vec_dot does for one row: the rows share the unpacking and
// the weight loads, and nothing unpacked goes through memory. A product of m rows runs in balanced groups
// (5 -> 2 + 3, 9 -> 3 + 3 + 3). Per (weight row, activation row) the float work is ggml's, in ggml's order
// (multirow_common.h). Compiled with -ffp-contract=off so that the compiler adds no fused multiply-add that
// ggml's build does not have; where ggml's C code is contracted by its compiler, the fused form is written
// out explicitly.
#include "multirow.h"

#include <immintrin.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>

#include "ggml.h"
#include "multirow_common.h"

namespace sharpi {
namespace {

using namespace mr;

constexpr int kGroup = 4;  // activation rows per pass over a weight row (their sums stay in the 16 registers)

// Byte shuffles that spread int16 lane c of a 128-bit half over all 16 int16 lanes (both halves).
SHARPI_INLINE __m256i spread16(__m256i v, int c) {
  return _mm256_shuffle_epi8(v, _mm256_set1_epi16(static_cast<int16_t>((2 * c) | ((2 * c + 1) << 8))));
}

// ---- Q4_K / Q5_K ---------------------------------------------------------------------------------
//
// R activation rows against weight rows [n0, n1). Lane i of a row's int32 sums holds, per 32-value chunk c,
// scale_c * (the products of bytes 4i..4i+3): the lanes of ggml's maddubs / madd pairs.

template <bool kQ5>
struct K4 {
  template <int R>
  SHARPI_AVX2 static void group(int64_t k, const uint8_t* w, size_t w_row, int64_t n0, int64_t n1,
                                const uint8_t* const* q, float* const* out) {
    const int64_t nb = k / kQK;
    const size_t bsz = kQ5 ? kQ5K : kQ4K;
    const __m256i m4 = _mm256_set1_epi8(0xF), one = _mm256_set1_epi8(1);
    const BsumPairs* pairs = bsum_pairs<R>(nb, q);
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* wr = w + n * w_row;
      RowAcc a[R];
      for (int r = 0; r < R; ++r) a[r] = row_acc_zero();
      for (int64_t i = 0; i < nb; ++i) {
        const uint8_t* blk = wr + i * bsz;
        prefetch_ahead(blk, bsz);
        const __m256i sm = _mm256_cvtepu8_epi16(scale_min_k4(blk + 4));
        const __m256i scales = _mm256_permute2x128_si256(sm, sm, 0x00);
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
        const __m128i mins = _mm256_extracti128_si256(sm, 1);
        const K4Scales fs = k4_scales(blk);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) k4_block<kQ5>(a[r], sumi[r], q[r] + i * kQ8K,
                                                   fs, mins, pairs[i * R + r]);
      }
      for (int r = 0; r < R; ++r) out[r][n] = k4_result<kQ5>(a[r]);
    }
  }
};

// ---- Q6_K ----------------------------------------------------------------------------------------
//
// Value 128j + 32t + l takes its low 4 bits from ql and bits 2t, 2t+1 of qh[32j + l] as its top 2; chunk c
// (values 32c..32c+31): int16 lanes 0-7 use scale 2c, lanes 8-15 scale 2c + 1.
struct Q6 {
  template <int R>
  SHARPI_AVX2 static void group(int64_t k, const uint8_t* w, size_t w_row, int64_t n0, int64_t n1,
                                const uint8_t* const* q, float* const* out) {
    const int64_t nb = k / kQK;
    const __m256i m15 = _mm256_set1_epi8(15), m3 = _mm256_set1_epi8(3), m12 = _mm256_set1_epi8(12),
                  m48 = _mm256_set1_epi8(48), m192 = _mm256_set1_epi8(static_cast<char>(0xC0));
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* wr = w + n * w_row;
      RowAcc a[R];
      for (int r = 0; r < R; ++r) a[r] = row_acc_zero();
      for (int64_t i = 0; i < nb; ++i) {
        const uint8_t* blk = wr + i * kQ6K;
        prefetch_ahead(blk, kQ6K);
        const uint8_t* ql = blk;
        const uint8_t* qh = blk + 128;
        const int8_t* scales = reinterpret_cast<const int8_t*>(blk + 192);
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
        const float xd = f16(blk + 208);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) q6_block(a[r], sumi[r], q[r] + i * kQ8K, xd, scales16);
      }
      for (int r = 0; r < R; ++r) out[r][n] = hsum8(a[r].acc);
    }
  }
};

// ---- F32 ------------------------------------------------------------------------------------------
//
// ggml's vec_dot_f32 (its AVX2 + FMA build) for K a multiple of 32: four 8-lane sums, sum j += x[i + 8j] *
// y[i + 8j] fused, over steps of 32 values; then (s0 + s2) + (s1 + s3) and f32_hsum. No unpacking to share, but
// a step's 4 weight vectors are loaded once for up to 3 rows (12 sums and a weight vector fill the 16
// registers), where vec_dot loads them once a row.
struct F32 {
  template <int R>
  SHARPI_AVX2 static void group(int64_t k, const uint8_t* w, size_t w_row, int64_t n0, int64_t n1,
                                const uint8_t* const* q, float* const* out) {
    const float* y[R];
    for (int r = 0; r < R; ++r) y[r] = reinterpret_cast<const float*>(q[r]);
    for (int64_t n = n0; n < n1; ++n) {
      const float* x = reinterpret_cast<const float*>(w + n * w_row);
      __m256 s[R][4];
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < 4; ++j) s[r][j] = _mm256_setzero_ps();
      for (int64_t i = 0; i < k; i += 32) {
        prefetch_ahead(reinterpret_cast<const uint8_t*>(x + i), 128);
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) {
          const __m256 a = _mm256_loadu_ps(x + i + 8 * j);
#pragma GCC unroll 3
          for (int r = 0; r < R; ++r) s[r][j] = _mm256_fmadd_ps(a, _mm256_loadu_ps(y[r] + i + 8 * j), s[r][j]);
        }
      }
      for (int r = 0; r < R; ++r)
        out[r][n] = f32_hsum(_mm256_add_ps(_mm256_add_ps(s[r][0], s[r][2]), _mm256_add_ps(s[r][1], s[r][3])));
    }
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

// The best kernel set this CPU runs, unless SHARPI_GGML_ISA names a lesser one (avx2) to measure or test it.
Isa env_isa() {
  const Isa best = cpu_has_avx512_kernels() ? Isa::kAvx512 : cpu_has_avx2() ? Isa::kAvx2 : Isa::kNone;
  const char* v = std::getenv("SHARPI_GGML_ISA");
  if (v != nullptr && std::strcmp(v, "avx2") == 0 && best != Isa::kNone) return Isa::kAvx2;
  return best;
}

std::atomic<bool> g_enabled{env_enabled()};
std::atomic<Isa> g_isa{env_isa()};

}  // namespace

MultiRowFn avx2_kernel(int qtype) {
  switch (qtype) {
    case GGML_TYPE_Q4_K: return rows_of<kGroup, K4<false>>;
    case GGML_TYPE_Q5_K: return rows_of<kGroup, K4<true>>;
    case GGML_TYPE_Q6_K: return rows_of<kGroup, Q6>;
    case GGML_TYPE_F32: return rows_of<3, F32>;
    default: return nullptr;
  }
}

int64_t multirow_min_rows(int qtype, int64_t k) {
  switch (qtype) {
    case GGML_TYPE_Q8_0: return 2;
    // One F32 row streams as fast through vec_dot; rows of other lengths keep vec_dot (its scalar tail).
    case GGML_TYPE_F32: return k % 32 == 0 ? 2 : INT64_MAX;
    default: return 1;
  }
}

void set_multirow_enabled(bool on) { g_enabled.store(on); }
bool multirow_enabled() { return g_enabled.load(); }

bool set_multirow_isa(const std::string& name) {
  const bool avx512 = cpu_has_avx512_kernels(), avx2 = cpu_has_avx2();
  if (name == "avx512" && avx512) g_isa.store(Isa::kAvx512);
  else if (name == "avx2" && avx2) g_isa.store(Isa::kAvx2);
  else if (name == "best") g_isa.store(avx512 ? Isa::kAvx512 : avx2 ? Isa::kAvx2 : Isa::kNone);
  else return false;
  return true;
}

int64_t multirow_group_rows() { return g_isa.load(std::memory_order_relaxed) == Isa::kAvx512 ? avx512_group_rows() : kGroup; }

std::string multirow_isa() {
  switch (g_isa.load()) {
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    default: return "";
  }
}

MultiRowFn multirow_kernel(int qtype) {
  if (!g_enabled.load(std::memory_order_relaxed)) return nullptr;
  switch (g_isa.load(std::memory_order_relaxed)) {
    case Isa::kAvx512: return avx512_kernel(qtype);
    case Isa::kAvx2: return avx2_kernel(qtype);
    default: return nullptr;
  }
}

}  // namespace sharpi

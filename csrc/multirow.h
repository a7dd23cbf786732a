// Multi-row products: each weight chunk is unpacked once and used for a group of activation rows (up to 4
// with AVX2, up to 8 with AVX-512). Q4_K, Q5_K and Q6_K on both sets; Q8_0 on AVX-512.
//
// A kernel here computes out[m][n] for a tile of weight rows n and any number of activation rows m,
// bit for bit equal to ggml's `vec_dot(K, weight row n, activation row m)` (its AVX2 build, the one the
// libggml-python wheel ships): the integer part of a block product is exact, so it may be computed in
// any order as long as each of the 8 int32 lanes holds the same products as in ggml; the float part
// (the per-block scale, the lane accumulators, the final horizontal sum) repeats ggml's operations in
// ggml's order. So a row's bits depend only on its own activation row (row-stable), and a product
// equals ggml's own mul_mat graph.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace sharpi {

// The activation rows of one product: q[m] is row m quantized to the weight type's vec_dot_type;
// element (m, n) is written to out[m][n].
struct RowSet {
  const uint8_t* const* q;
  float* const* out;
  int64_t m;
};

// Computes out[m][n] for n in [n0, n1) and every row of `rows`; `w` points at weight row 0, rows are
// `w_row` bytes apart and hold `k` values.
using MultiRowFn = void (*)(int64_t k, const uint8_t* w, size_t w_row, int64_t n0, int64_t n1,
                            const RowSet& rows);

// The kernel for a ggml type id, or nullptr when none serves it on this CPU (then the caller computes
// each element with ggml's vec_dot).
MultiRowFn multirow_kernel(int qtype);

// Software prefetch distance of a weight stream (multirow_common.h, and ggml_ops.cc's vec_dot path): a
// product starting a weight block (or row) asks for the bytes this far past it. The hardware prefetcher alone
// let a 2-4 row product stall on memory in turns with computing (Zen 4, 2 threads, streamed 12352 x 2048
// Q4_K: the AVX-512 kernels 4-8% faster with it, the AVX2 ones within noise); on an Intel Xeon (Sapphire
// Rapids class) one row streams 1.25-2.1x faster with it than ggml's vec_dot without it, and 2 KB measured
// best of 1, 2, 4 and 8 KB there. A prefetch never faults, so reading past the matrix's end is harmless; it
// changes no bit.
constexpr size_t kPrefetchAhead = 2048;

// Asks for the `bytes` of weight stream that start kPrefetchAhead past p (a block's or a row's lines): the
// kernels' prefetch per block (prefetch_rows, below, adds a farther one from 4 rows) and the one of
// ggml_ops.cc's vec_dot path (per weight row).
inline __attribute__((always_inline)) void prefetch_ahead(const uint8_t* p, size_t bytes) {
  for (size_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + kPrefetchAhead + o, 0, 3);
}

// A second, farther prefetch for kernels of 4 rows or more, into L2 (`prefetcht2`, kFarAhead past the block):
// from 4 rows a kernel's arithmetic is as long as its bytes take to arrive or longer, and the 2 KB request
// alone then left the stream waiting on memory in turns with computing. Intel Xeon (Sapphire Rapids class),
// 2 threads, the AVX-512 kernels, the slice's LM heads in jit, 3 rounds alternated: Q6_K (417 MB) 18.2-18.9 ->
// 16.8-17.9 ms at 4 rows, 26.8-27.2 -> 22.4-23.2 at 8; Q8_0 (540 MB) 35.2-37.6 -> 31.6-32.0 at 4, 52.3-53.5 ->
// 50.5-51.8 at 8; Q4_K within noise; 8 and 16 KB ahead alike. From 2 rows a 2-row pass measured no faster, so
// fewer rows keep the one prefetch. The AVX2 kernels, arithmetic-bound from 4 rows, moved 2-3%: left without.
constexpr int kFarFromRows = 4;
constexpr size_t kFarAhead = 4 * kPrefetchAhead;

// prefetch_ahead, and from kFarFromRows rows the far request too: the kernels' per-block prefetch.
template <int R>
inline __attribute__((always_inline)) void prefetch_rows(const uint8_t* p, size_t bytes) {
  prefetch_ahead(p, bytes);
  if constexpr (R >= kFarFromRows)
    for (size_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + kFarAhead + o, 0, 1);
}

// From how many activation rows a product of the type's rows of k values runs its kernel rather than one
// vec_dot per element: 1 for the K-quants, 2 for Q8_0. The K-quant kernels' one-row form reads the weight
// stream with the software prefetch that ggml's vec_dot lacks: on an Intel Xeon (Sapphire Rapids class, 2
// threads) one row of the slice's streamed Q4_K expert slabs ran 2.1x and of its Q6_K LM head 1.25x faster
// than vec_dot, and a decode step 1.45x; on Zen 4 the two were within noise (0.89-1.09x at K = 2048,
// 1.1-1.3x at K = 512). The AVX-512 Q8_0 kernel is 1.14-1.6x vec_dot from 2 rows but 0.83-0.97x at one row
// (where vec_dot is prefetched too, ggml_ops.cc). Never changes a bit: both paths give vec_dot's bits.
int64_t multirow_min_rows(int qtype, int64_t k);

// The most activation rows the kernels multirow_kernel returns take in one group (one pass over each weight
// row): 8 with AVX-512, 4 with AVX2.
int64_t multirow_group_rows();

// Whether multirow_kernel may return kernels (on by default; off only to measure the vec_dot path).
void set_multirow_enabled(bool on);
bool multirow_enabled();

// The instruction set of the kernels multirow_kernel returns: the best this CPU runs (AVX-512 with VNNI
// where the CPU has AVX-512 F / BW / VL / VNNI, else AVX2), unless the environment variable
// SHARPI_GGML_ISA=avx2 or set_multirow_isa picks AVX2. Both sets give the same bits (ggml's).
enum class Isa { kNone, kAvx2, kAvx512 };
// "avx512", "avx2" or "" (no kernels on this CPU).
std::string multirow_isa();
// Picks "avx512", "avx2" or "best"; false (nothing changed) when this CPU cannot run the set named.
bool set_multirow_isa(const std::string& name);

// The AVX2 kernels (csrc/multirow.cc), the AVX-512 ones (csrc/multirow_avx512.cc) and whether this CPU
// runs the latter; nullptr for a type neither serves.
MultiRowFn avx2_kernel(int qtype);
bool cpu_has_avx512_kernels();
MultiRowFn avx512_kernel(int qtype);
int64_t avx512_group_rows();

}  // namespace sharpi

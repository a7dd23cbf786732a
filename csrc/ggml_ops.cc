// sharpi_jax._ggml: GGUF blocks multiplied by ggml's own CPU kernels, for jit (XLA FFI) and for the host.
//
// Every product is ggml's: an activation row is quantized once with `from_float` of the weight type's
// `vec_dot_type` (Q8_K for K-quants, Q8_0 for Q4_0/Q8_0, ...) and each output element has the bits of one
// `vec_dot(K, w_row, q_row)` (ggml_get_type_traits_cpu), exactly as ggml's mul_mat computes a product by
// vec_dot; for several rows a multi-row kernel (csrc/multirow.h) unpacks each weight block once for all of
// them, with the same bits. Output element [m, n] depends only on activation row m and weight row n, so a
// row's bits are the same for any batch size, any tiling and any thread count (row-stable by
// construction). Work is tiled so a tile of weight rows is read once for all activation rows, and
// tiles are shared between threads (inside jit: the calling thread and helper threads that stay awake between
// products, csrc/spin_pool.h, as many as XLA's intra-op pool has past the caller; std::thread on the host).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#include "argmax.h"
#include "ggml-cpu.h"
#include "gdn.h"
#include "ggml.h"
#include "multirow.h"
#include "spin_pool.h"
#include "xla/ffi/api/ffi.h"

namespace nb = nanobind;
namespace ffi = xla::ffi;

namespace {

constexpr int64_t kTileRows = 16;  // weight rows per work unit (ggml's mul_mat uses 16 x 16 blocks)

// ---------------------------------------------------------------------------------------------
// Parallel loops: fn(i) for i in [0, n), spread over `threads` workers that take units in turn.
// ---------------------------------------------------------------------------------------------

using Body = std::function<void(int64_t)>;
using RangeBody = std::function<void(int64_t, int64_t)>;  // units [i0, i1), consecutive
using Spawn = std::function<void(std::function<void()>)>;  // runs a task on another thread

struct Shared {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> active{0};
  std::mutex mu;
  std::condition_variable cv;
};

// The caller works too; it returns once every unit is done. Helpers that start after the last unit
// was taken find nothing to do and only touch `Shared` (kept alive by the shared_ptr they hold).
// fn(i0, i1) over runs of consecutive units covering [0, n) once.
void parallel_ranges(int64_t n, int threads, const Spawn& spawn, const RangeBody& fn) {
  if (n <= 0) return;
  if (threads <= 1 || n == 1) {
    fn(0, n);
    return;
  }
  auto st = std::make_shared<Shared>();
  const RangeBody* body = &fn;
  // Workers take runs of consecutive units (about 8 runs per thread): neighbouring units write
  // neighbouring outputs, so runs keep threads off each other's cache lines and still balance load.
  const int64_t chunk = std::max<int64_t>(1, n / (8 * static_cast<int64_t>(threads)));
  auto take = [st, body, n, chunk]() {
    for (int64_t i0; (i0 = st->next.fetch_add(chunk)) < n;) (*body)(i0, std::min(n, i0 + chunk));
  };
  auto work = [st, take]() {
    st->active.fetch_add(1);
    take();
    if (st->active.fetch_sub(1) == 1) {
      std::lock_guard<std::mutex> lock(st->mu);
      st->cv.notify_all();
    }
  };
  int helpers = static_cast<int>(std::min<int64_t>(threads, n)) - 1;
  for (int t = 0; t < helpers; ++t) spawn(work);
  st->active.fetch_add(1);
  take();
  st->active.fetch_sub(1);
  // A helper still on its last units finishes within microseconds: spin for it rather than sleep (a wake-up
  // costs tens of microseconds), up to the helpers' spin time.
  sharpi::spin_until([st] { return st->active.load() == 0; });
  std::unique_lock<std::mutex> lock(st->mu);
  st->cv.wait(lock, [&] { return st->active.load() == 0; });
}

void parallel_for(int64_t n, int threads, const Spawn& spawn, const Body& fn) {
  parallel_ranges(n, threads, spawn, [&fn](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) fn(i);
  });
}

// Below this many multiply-adds a loop runs on the calling thread: handing units to another thread
// (a task, a wake-up, a condition variable) costs tens of microseconds, more than a tiny model's
// products. Results do not depend on it (row-stable kernels give the same bits on any thread count).
constexpr int64_t kMinParallelWork = int64_t{1} << 20;

struct Pool {
  int threads;
  Spawn spawn;
  int64_t min_work = kMinParallelWork;  // 0: always spread (the host path: its caller picks `threads`)
  // `work`: about how many multiply-adds the n units take together.
  void run(int64_t n, int64_t work, const Body& fn) const {
    parallel_for(n, work < min_work ? 1 : threads, spawn, fn);
  }
  // The same split, each run of consecutive units in one call.
  void run_ranges(int64_t n, int64_t work, const RangeBody& fn) const {
    parallel_ranges(n, work < min_work ? 1 : threads, spawn, fn);
  }
};

// Host pool: threads spawned per call (the host path computes a few cold experts at a time), spread
// whatever the size, so the tests' threads=2 runs exercise the parallel loops on small shapes too.
Pool host_pool(int threads) {
  if (threads <= 0) threads = std::max(1u, std::thread::hardware_concurrency());
  return Pool{threads, [](std::function<void()> task) { std::thread(std::move(task)).detach(); }, 0};
}

// ---------------------------------------------------------------------------------------------
// Row kernels
// ---------------------------------------------------------------------------------------------

std::string check_type(int qtype) {
  if (qtype < 0 || qtype >= GGML_TYPE_COUNT) return "unknown ggml type id " + std::to_string(qtype);
  auto type = static_cast<ggml_type>(qtype);
  const auto* tr = ggml_get_type_traits_cpu(type);
  if (ggml_get_type_traits(type)->blck_size == 0 || tr->vec_dot == nullptr)
    return std::string("ggml's CPU backend has no vec_dot for ") + ggml_type_name(type);
  if (tr->vec_dot_type != GGML_TYPE_F32 && ggml_get_type_traits_cpu(tr->vec_dot_type)->from_float == nullptr)
    return std::string("ggml's CPU backend has no from_float for ") + ggml_type_name(tr->vec_dot_type);
  return "";
}

// One weight type's kernels for rows of K values.
struct Kernel {
  ggml_vec_dot_t vec_dot;
  ggml_from_float_t from_float;  // nullptr: activations stay f32
  sharpi::MultiRowFn multirow;   // nullptr: one vec_dot per element
  int64_t multirow_min;          // fewer rows than this: vec_dot per element (same bits, faster there)
  size_t w_row;                  // bytes of one weight row
  size_t q_row;                  // bytes of one quantized activation row
  int64_t k;

  Kernel(int qtype, int64_t k_) : k(k_) {
    auto type = static_cast<ggml_type>(qtype);
    const auto* tr = ggml_get_type_traits_cpu(type);
    vec_dot = tr->vec_dot;
    multirow = sharpi::multirow_kernel(qtype);
    multirow_min = sharpi::multirow_min_rows(qtype, k_);
    from_float = tr->vec_dot_type == GGML_TYPE_F32 ? nullptr : ggml_get_type_traits_cpu(tr->vec_dot_type)->from_float;
    w_row = ggml_row_size(type, k);
    q_row = ggml_row_size(tr->vec_dot_type, k);
  }

  void quantize(const float* x, uint8_t* q) const {
    if (from_float) from_float(x, q, k);
    else std::memcpy(q, x, sizeof(float) * k);
  }

  float dot(const uint8_t* w, const uint8_t* q) const {
    float s;
    vec_dot(static_cast<int>(k), &s, 0, w, 0, q, 0, 1);
    return s;
  }
};

// Checks that weight rows of `row_bytes` hold K values of `qtype`; "" when they do.
std::string check_rows(int qtype, int64_t k, int64_t row_bytes) {
  std::string err = check_type(qtype);
  if (!err.empty()) return err;
  auto type = static_cast<ggml_type>(qtype);
  int64_t blck = ggml_blck_size(type);
  if (k % blck != 0)
    return std::string(ggml_type_name(type)) + " rows need a multiple of " + std::to_string(blck) + " values, got " +
           std::to_string(k);
  if (static_cast<int64_t>(ggml_row_size(type, k)) != row_bytes)
    return std::string(ggml_type_name(type)) + " row of " + std::to_string(k) + " values is " +
           std::to_string(ggml_row_size(type, k)) + " bytes, got " + std::to_string(row_bytes);
  return "";
}

// out[m][n] = vec_dot(w[n], q[m]) for n in [n0, n1) and every row of `rs`: the multi-row kernel (each
// weight block unpacked once for all rows, same bits) where one serves the type, else one vec_dot per
// element with the tile's weight rows kept in cache while every activation row passes over them.
void rows_product(const Kernel& kr, const uint8_t* w, int64_t n0, int64_t n1, const sharpi::RowSet& rs) {
  if (kr.multirow != nullptr && rs.m >= kr.multirow_min) {
    kr.multirow(kr.k, w, kr.w_row, n0, n1, rs);
    return;
  }
  for (int64_t m = 0; m < rs.m; ++m)
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* wr = w + n * kr.w_row;
      // The first row's pass streams the tile from memory: prefetch as the kernels do per block (ggml's
      // vec_dot has none). A hint: no bit changes.
      if (m == 0) sharpi::prefetch_ahead(wr, kr.w_row);
      rs.out[m][n] = kr.dot(wr, rs.q[m]);
    }
}

// rows_product over tiles [t0, t1) of a matrix of n_rows weight rows. Rows that a kernel takes in one group
// see each weight row once whatever the range: one call for the whole run, so its per-call set-up (the
// activations' bsums, scales, interleaved quants) is paid once per run, not per tile. More rows, or vec_dot,
// go tile by tile, each tile's weights kept in cache for every group of rows.
void tiles_product(const Kernel& kr, const uint8_t* w, int64_t n_rows, int64_t t0, int64_t t1,
                   const sharpi::RowSet& rs) {
  if (kr.multirow != nullptr && rs.m >= kr.multirow_min && rs.m <= sharpi::multirow_group_rows()) {
    rows_product(kr, w, t0 * kTileRows, std::min(n_rows, t1 * kTileRows), rs);
    return;
  }
  for (int64_t t = t0; t < t1; ++t) rows_product(kr, w, t * kTileRows, std::min(n_rows, (t + 1) * kTileRows), rs);
}

// y[M, N] = x[M, K] @ W[N, K].T with W in ggml blocks. idx (may be null: the identity): the m-th
// computed row is x row idx[m], its output y row idx[m] (a batch's valid rows, wherever they sit).
void matmul(const Pool& pool, const float* x, int64_t m_rows, int64_t k, const uint8_t* w, int64_t n_rows, int qtype,
            float* y, const int32_t* idx = nullptr) {
  if (m_rows <= 0 || n_rows == 0) return;
  Kernel kr(qtype, k);
  auto row = [idx](int64_t m) { return idx == nullptr ? m : static_cast<int64_t>(idx[m]); };
  std::vector<uint8_t> q(kr.q_row * m_rows);
  pool.run(m_rows, m_rows * k * 8, [&](int64_t m) { kr.quantize(x + row(m) * k, q.data() + m * kr.q_row); });
  std::vector<const uint8_t*> qp(m_rows);
  std::vector<float*> op(m_rows);
  for (int64_t m = 0; m < m_rows; ++m) {
    qp[m] = q.data() + m * kr.q_row;
    op[m] = y + row(m) * n_rows;
  }
  const sharpi::RowSet rs{qp.data(), op.data(), m_rows};
  int64_t tiles = (n_rows + kTileRows - 1) / kTileRows;
  // An F32 weight streams 4 bytes a multiply-add (a Q4_K one 0.56): counted 4x, so a one-row router product
  // (257 x 2048, 2 MB) spreads over the threads (0.11 -> 0.07 ms here) instead of running on the caller.
  const int64_t work = m_rows * n_rows * k * (qtype == GGML_TYPE_F32 ? 4 : 1);
  pool.run_ranges(tiles, work, [&](int64_t t0, int64_t t1) { tiles_product(kr, w, n_rows, t0, t1, rs); });
}

// ---------------------------------------------------------------------------------------------
// Routed experts: Y[i, j] = down_e(silu(gate_e(x_i)) * up_e(x_i)), e = ids[i, j]
// ---------------------------------------------------------------------------------------------

inline float silu(float g) { return g / (1.0f + std::exp(-g)); }

void silu_mul(const float* g, const float* u, float* h, int64_t n) {
  for (int64_t i = 0; i < n; ++i) h[i] = silu(g[i]) * u[i];
}

struct ExpertWeights {
  const uint8_t* gate;
  const uint8_t* up;
  const uint8_t* down;
  int64_t n_experts, d, f;
  int gate_type, up_type, down_type;
};

std::string check_experts(const ExpertWeights& ew, int64_t rb_gate, int64_t rb_up, int64_t rb_down) {
  std::string err = check_rows(ew.gate_type, ew.d, rb_gate);
  if (err.empty()) err = check_rows(ew.up_type, ew.d, rb_up);
  if (err.empty()) err = check_rows(ew.down_type, ew.f, rb_down);
  return err;
}

// A group: the (token, rank) pairs one expert computes together.
struct Group {
  int64_t expert;
  std::vector<int64_t> pairs;  // flat pair index i * k + j
};

// A run of work units [u0, u1), `per` consecutive units (tiles) a matrix, split at the matrices' ends:
// fn(matrix, t0, t1) for each matrix the run touches, t0 / t1 its first and past-the-last tile in the run.
template <class Fn>
void matrix_runs(int64_t u0, int64_t u1, int64_t per, const Fn& fn) {
  for (int64_t u = u0; u < u1;) {
    const int64_t mat = u / per, end = std::min(u1, (mat + 1) * per);
    fn(mat, u - mat * per, end - mat * per);
    u = end;
  }
}

// Computes the groups' outputs in y[N * k, D]. `xq_*`: each token's activation quantized for gate / up.
void run_groups(const Pool& pool, const ExpertWeights& ew, const std::vector<Group>& groups, int64_t k_top,
                const Kernel& kg, const Kernel& ku, const Kernel& kd, const uint8_t* xq_g, const uint8_t* xq_u,
                float* y) {
  const int64_t F = ew.f, D = ew.d;
  // Work units per group: F-tiles for gate/up, D-tiles for down; pairs are numbered across groups.
  std::vector<int64_t> pair_base(groups.size() + 1, 0);
  for (size_t g = 0; g < groups.size(); ++g) pair_base[g + 1] = pair_base[g] + groups[g].pairs.size();
  const int64_t n_pairs = pair_base.back();
  std::vector<float> gate(n_pairs * F), up(n_pairs * F);
  std::vector<uint8_t> hq(n_pairs * kd.q_row);
  const int64_t f_tiles = (F + kTileRows - 1) / kTileRows, d_tiles = (D + kTileRows - 1) / kTileRows;
  const size_t gate_expert = ew.f * kg.w_row, up_expert = ew.f * ku.w_row, down_expert = ew.d * kd.w_row;
  // Row pointers by pair position (groups' pairs are contiguous): each group's rows are one RowSet slice.
  std::vector<const uint8_t*> xg(n_pairs), xu(n_pairs), hp(n_pairs);
  std::vector<float*> go(n_pairs), uo(n_pairs), yo(n_pairs);
  for (size_t g = 0; g < groups.size(); ++g)
    for (size_t p = 0; p < groups[g].pairs.size(); ++p) {
      const int64_t at = pair_base[g] + p, pair = groups[g].pairs[p];
      xg[at] = xq_g + (pair / k_top) * kg.q_row;
      xu[at] = xq_u + (pair / k_top) * ku.q_row;
      hp[at] = hq.data() + at * kd.q_row;
      go[at] = gate.data() + at * F;
      uo[at] = up.data() + at * F;
      yo[at] = y + pair * D;
    }

  // Phase A units: (group, gate or up, F-tile), a matrix's tiles consecutive: a run of them is one product
  // call (tiles_product), each thread streaming one matrix at a time.
  pool.run_ranges(static_cast<int64_t>(groups.size()) * 2 * f_tiles, 2 * n_pairs * F * D, [&](int64_t u0, int64_t u1) {
    matrix_runs(u0, u1, f_tiles, [&](int64_t mat, int64_t t0, int64_t t1) {
      const int64_t g = mat >> 1, base = pair_base[g];
      const bool is_up = mat & 1;
      const sharpi::RowSet rs{(is_up ? xu : xg).data() + base, (is_up ? uo : go).data() + base,
                              pair_base[g + 1] - base};
      const uint8_t* wm = is_up ? ew.up + groups[g].expert * up_expert : ew.gate + groups[g].expert * gate_expert;
      tiles_product(is_up ? ku : kg, wm, F, t0, t1, rs);
    });
  });
  pool.run(n_pairs, n_pairs * F * 8, [&](int64_t p) {
    std::vector<float> h(F);
    silu_mul(gate.data() + p * F, up.data() + p * F, h.data(), F);
    kd.quantize(h.data(), hq.data() + p * kd.q_row);
  });
  pool.run_ranges(static_cast<int64_t>(groups.size()) * d_tiles, n_pairs * F * D, [&](int64_t u0, int64_t u1) {
    matrix_runs(u0, u1, d_tiles, [&](int64_t g, int64_t t0, int64_t t1) {
      const int64_t base = pair_base[g];
      const sharpi::RowSet rs{hp.data() + base, yo.data() + base, pair_base[g + 1] - base};
      tiles_product(kd, ew.down + groups[g].expert * down_expert, D, t0, t1, rs);
    });
  });
}

// mode 0 = grouped (each used expert once, for all its pairs), 1 = per token (pairs in (i, j) order).
// Returns "" or the problem (an expert id out of range).
std::string expert_rows(const Pool& pool, const float* x, const int32_t* ids, int64_t n_tok, int64_t k_top,
                        const ExpertWeights& ew, int mode, float* y) {
  // id -1 marks a pair this call does not compute (another device's expert under expert parallelism):
  // its output row is +0.0, so an integer sum of bit patterns over devices leaves the owner's bits.
  for (int64_t p = 0; p < n_tok * k_top; ++p) {
    if (ids[p] < -1 || ids[p] >= ew.n_experts)
      return "expert id " + std::to_string(ids[p]) + " out of range [0, " + std::to_string(ew.n_experts) + ")";
    if (ids[p] == -1) std::fill(y + p * ew.d, y + (p + 1) * ew.d, 0.0f);
  }
  if (n_tok == 0 || k_top == 0) return "";
  Kernel kg(ew.gate_type, ew.d), ku(ew.up_type, ew.d), kd(ew.down_type, ew.f);
  std::vector<uint8_t> xq_g(n_tok * kg.q_row), xq_u;
  pool.run(n_tok, n_tok * ew.d * 8, [&](int64_t i) { kg.quantize(x + i * ew.d, xq_g.data() + i * kg.q_row); });
  const uint8_t* xq_up = xq_g.data();
  if (ku.from_float != kg.from_float) {  // gate and up differ in vec_dot_type: quantize once for each
    xq_u.resize(n_tok * ku.q_row);
    pool.run(n_tok, n_tok * ew.d * 8, [&](int64_t i) { ku.quantize(x + i * ew.d, xq_u.data() + i * ku.q_row); });
    xq_up = xq_u.data();
  }
  if (mode == 0) {
    std::vector<int64_t> slot(ew.n_experts, -1);
    std::vector<Group> groups;
    for (int64_t p = 0; p < n_tok * k_top; ++p) {
      int64_t e = ids[p];
      if (e < 0) continue;
      if (slot[e] < 0) {
        slot[e] = static_cast<int64_t>(groups.size());
        groups.push_back(Group{e, {}});
      }
      groups[slot[e]].pairs.push_back(p);
    }
    run_groups(pool, ew, groups, k_top, kg, ku, kd, xq_g.data(), xq_up, y);
  } else {
    for (int64_t p = 0; p < n_tok * k_top; ++p)
      if (ids[p] >= 0) run_groups(pool, ew, {Group{ids[p], {p}}}, k_top, kg, ku, kd, xq_g.data(), xq_up, y);
  }
  return "";
}

// ---------------------------------------------------------------------------------------------
// XLA FFI handlers
// ---------------------------------------------------------------------------------------------

Pool xla_pool(ffi::ThreadPool tp) {
  int threads = static_cast<int>(std::max<int64_t>(1, tp.num_threads()));
  // XLA's pool sets the thread count; the work goes to our spinning helpers (csrc/spin_pool.h) unless
  // their spin time is 0.
  if (sharpi::spin_us() > 0)
    return Pool{threads, [threads](std::function<void()> task) { sharpi::spin_post(std::move(task), threads - 1); }};
  // ThreadPool is a thin handle valid for this call; parallel_for returns before the call does.
  auto holder = std::make_shared<ffi::ThreadPool>(tp);
  return Pool{threads, [holder](std::function<void()> task) { holder->Schedule(std::move(task)); }};
}

// `rows` (int32 scalar): only x rows [0, rows) are multiplied; the output rows after them are +0.0 (bucket
// padding: decode's second row, a verify bucket's unused rows). Computed rows keep their bits.
ffi::Error MatmulImpl(ffi::ThreadPool tp, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                      ffi::Buffer<ffi::S32> rows, int32_t qtype, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2) return ffi::Error::InvalidArgument("ggml matmul: x and w must be 2-D");
  if (rows.element_count() != 1) return ffi::Error::InvalidArgument("ggml matmul: rows must be a scalar");
  std::string err = check_rows(qtype, xd[1], wd[1]);
  if (!err.empty()) return ffi::Error::InvalidArgument("ggml matmul: " + err);
  const int64_t m = std::clamp<int64_t>(rows.typed_data()[0], 0, xd[0]);
  matmul(xla_pool(tp), x.typed_data(), m, xd[1], w.typed_data(), wd[0], qtype, y->typed_data());
  std::fill(y->typed_data() + m * wd[0], y->typed_data() + xd[0] * wd[0], 0.0f);
  return ffi::Error::Success();
}

// The rows of a batch of sequences (`ggml.matmul` under jax.vmap): idx [M] int32 lists the valid rows
// of x first, n (int32 scalar) of them; row idx[i], i < n, is multiplied in place (no gather or scatter
// of x or y outside the call), every other output row is +0.0. A row's bits are those it has alone
// (the kernels are row-stable).
ffi::Error MatmulRowsImpl(ffi::ThreadPool tp, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                          ffi::Buffer<ffi::S32> idx, ffi::Buffer<ffi::S32> n, int32_t qtype,
                          ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2) return ffi::Error::InvalidArgument("ggml matmul: x and w must be 2-D");
  if (n.element_count() != 1) return ffi::Error::InvalidArgument("ggml matmul: n must be a scalar");
  if (static_cast<int64_t>(idx.element_count()) != xd[0])
    return ffi::Error::InvalidArgument("ggml matmul: idx must hold one row index per x row");
  std::string err = check_rows(qtype, xd[1], wd[1]);
  if (!err.empty()) return ffi::Error::InvalidArgument("ggml matmul: " + err);
  const int64_t m = std::clamp<int64_t>(n.typed_data()[0], 0, xd[0]);
  const int32_t* rows = idx.typed_data();
  std::vector<char> computed(xd[0], 0);
  for (int64_t i = 0; i < m; ++i) {
    if (rows[i] < 0 || rows[i] >= xd[0] || computed[rows[i]])
      return ffi::Error::InvalidArgument("ggml matmul: idx must list distinct rows of x");
    computed[rows[i]] = 1;
  }
  float* out = y->typed_data();
  for (int64_t r = 0; r < xd[0]; ++r)
    if (!computed[r]) std::fill(out + r * wd[0], out + (r + 1) * wd[0], 0.0f);
  matmul(xla_pool(tp), x.typed_data(), m, xd[1], w.typed_data(), wd[0], qtype, out, rows);
  return ffi::Error::Success();
}

ffi::Error ExpertRowsImpl(ffi::ThreadPool tp, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> ids,
                          ffi::Buffer<ffi::U8> gate, ffi::Buffer<ffi::U8> up, ffi::Buffer<ffi::U8> down,
                          int32_t gate_type, int32_t up_type, int32_t down_type, int32_t mode,
                          ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), idd = ids.dimensions(), gd = gate.dimensions(), ud = up.dimensions(),
       dd = down.dimensions();
  if (xd.size() != 2 || idd.size() != 2 || gd.size() != 3 || ud.size() != 3 || dd.size() != 3)
    return ffi::Error::InvalidArgument("ggml expert_rows: x [N, D], ids [N, k], gate/up/down [E, rows, bytes]");
  ExpertWeights ew{gate.typed_data(), up.typed_data(), down.typed_data(), gd[0], xd[1], gd[1],
                   gate_type, up_type, down_type};
  std::string err = check_experts(ew, gd[2], ud[2], dd[2]);
  if (err.empty()) err = expert_rows(xla_pool(tp), x.typed_data(), ids.typed_data(), xd[0], idd[1], ew, mode,
                                     y->typed_data());
  if (!err.empty()) return ffi::Error::InvalidArgument("ggml expert_rows: " + err);
  return ffi::Error::Success();
}

// ---- The gated delta rule of one token (csrc/gdn.h), for GatedDeltaNet's recurrent rows ----

// The shapes of a GDN step's per-token inputs against a state [H, dv, dk]; "" when they agree.
std::string check_gdn(ffi::Span<const int64_t> sd, ffi::Buffer<ffi::F32>& q, ffi::Buffer<ffi::F32>& k,
                      ffi::Buffer<ffi::F32>& v, ffi::Buffer<ffi::F32>& beta, ffi::Buffer<ffi::F32>& g) {
  if (sd.size() != 3) return "the state must be [H, dv, dk]";
  const int64_t H = sd[0], dv = sd[1], dk = sd[2];
  if (static_cast<int64_t>(q.element_count()) != H * dk || static_cast<int64_t>(k.element_count()) != H * dk ||
      static_cast<int64_t>(v.element_count()) != H * dv || static_cast<int64_t>(beta.element_count()) != H ||
      static_cast<int64_t>(g.element_count()) != H)
    return "q, k [H, dk], v [H, dv], beta, g [H] disagree with the state";
  if (!sharpi::gdn_native_supported(dk)) return "needs AVX2 / FMA and dk a multiple of 8";
  return "";
}

void run_gdn(const Pool& pool, const float* src, float* dst, ffi::Buffer<ffi::F32>& q, ffi::Buffer<ffi::F32>& k,
             ffi::Buffer<ffi::F32>& v, ffi::Buffer<ffi::F32>& beta, ffi::Buffer<ffi::F32>& g, float scale, int64_t H,
             int64_t dv, int64_t dk, float* o) {
  pool.run(H, 2 * H * dv * dk, [&](int64_t h) {
    sharpi::gdn_step(src, dst, q.typed_data(), k.typed_data(), v.typed_data(), beta.typed_data(), g.typed_data(),
                     scale, dv, dk, h, h + 1, o);
  });
}

// A decode step: the state S [H, dv, dk] updated in place (the result aliases the argument), o [H, dv].
ffi::Error GdnStepImpl(ffi::ThreadPool tp, ffi::Buffer<ffi::F32> S, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                       ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::F32> beta, ffi::Buffer<ffi::F32> g, float scale,
                       ffi::ResultBuffer<ffi::F32> S_out, ffi::ResultBuffer<ffi::F32> o) {
  auto sd = S.dimensions();
  std::string err = check_gdn(sd, q, k, v, beta, g);
  if (!err.empty()) return ffi::Error::InvalidArgument("gdn step: " + err);
  float* out = S_out->typed_data();
  if (out != S.typed_data()) std::memcpy(out, S.typed_data(), S.element_count() * sizeof(float));
  run_gdn(xla_pool(tp), out, out, q, k, v, beta, g, scale, sd[0], sd[1], sd[2], o->typed_data());
  return ffi::Error::Success();
}

// A verify pass's rows [0, n) in one call (csrc/gdn.h, gdn_rows): snapshot slot t of buf [T, H, dv, dk] (the
// result aliases buf) gets the state after row t, which starts from row parent[t]'s (-1: from slot
// `init_slot` of buf, or from `state` [H, dv, dk] when init_slot is -1). q, k [T, H, dk], v [T, H, dv],
// beta, g [T, H]; o [T, H, dv], rows >= n zero.
ffi::Error GdnRowsImpl(ffi::ThreadPool tp, ffi::Buffer<ffi::F32> state, ffi::Buffer<ffi::F32> buf,
                       ffi::Buffer<ffi::S32> parent, ffi::Buffer<ffi::S32> init_slot, ffi::Buffer<ffi::S32> rows,
                       ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                       ffi::Buffer<ffi::F32> beta, ffi::Buffer<ffi::F32> g, float scale,
                       ffi::ResultBuffer<ffi::F32> buf_out, ffi::ResultBuffer<ffi::F32> o) {
  auto sd = state.dimensions(), bd = buf.dimensions();
  if (sd.size() != 3 || bd.size() != 4 || bd[1] != sd[0] || bd[2] != sd[1] || bd[3] != sd[2])
    return ffi::Error::InvalidArgument("gdn rows: state [H, dv, dk] and snapshots [T, H, dv, dk] disagree");
  const int64_t T = bd[0], H = sd[0], dv = sd[1], dk = sd[2], slot = H * dv * dk;
  if (static_cast<int64_t>(q.element_count()) != T * H * dk || static_cast<int64_t>(k.element_count()) != T * H * dk ||
      static_cast<int64_t>(v.element_count()) != T * H * dv || static_cast<int64_t>(beta.element_count()) != T * H ||
      static_cast<int64_t>(g.element_count()) != T * H || static_cast<int64_t>(parent.element_count()) != T)
    return ffi::Error::InvalidArgument("gdn rows: q, k [T, H, dk], v [T, H, dv], beta, g [T, H], parent [T] "
                                       "disagree with the snapshots");
  if (!sharpi::gdn_native_supported(dk))
    return ffi::Error::InvalidArgument("gdn rows: needs AVX2 / FMA and dk a multiple of 8");
  if (init_slot.element_count() != 1 || rows.element_count() != 1)
    return ffi::Error::InvalidArgument("gdn rows: init_slot and rows must be scalars");
  const int64_t from = init_slot.typed_data()[0], n = rows.typed_data()[0];
  if (from < -1 || from >= T || n < 0 || n > T)
    return ffi::Error::InvalidArgument("gdn rows: init_slot must be in [-1, T) and rows in [0, T]");
  const int32_t* par = parent.typed_data();
  for (int64_t t = 0; t < n; ++t)
    if (par[t] < -1 || par[t] >= t) return ffi::Error::InvalidArgument("gdn rows: parent[t] must be in [-1, t)");
  float* out = buf_out->typed_data();
  if (out != buf.typed_data()) std::memcpy(out, buf.typed_data(), buf.element_count() * sizeof(float));
  float* od = o->typed_data();
  std::memset(od + n * H * dv, 0, (T - n) * H * dv * sizeof(float));
  const float* init = from < 0 ? state.typed_data() : out + from * slot;
  xla_pool(tp).run(H, 2 * n * slot, [&](int64_t h) {
    sharpi::gdn_rows(init, out, slot, par, n, q.typed_data(), k.typed_data(), v.typed_data(), beta.typed_data(),
                     g.typed_data(), scale, H, dv, dk, h, h + 1, od);
  });
  return ffi::Error::Success();
}

// Greedy tokens of logits [..., V] (csrc/argmax.h): out [...] int32, each row's first index of its maximum
// or of its first NaN. Rows are cut into chunks that the threads take; a row's chunks merge in order.
ffi::Error ArgmaxImpl(ffi::ThreadPool tp, ffi::Buffer<ffi::F32> logits, ffi::ResultBuffer<ffi::S32> out) {
  auto d = logits.dimensions();
  if (d.size() < 1 || d.back() < 1) return ffi::Error::InvalidArgument("argmax: logits need a last axis of >= 1");
  const int64_t V = d.back(), M = static_cast<int64_t>(logits.element_count()) / V;
  if (static_cast<int64_t>(out->element_count()) != M)
    return ffi::Error::InvalidArgument("argmax: the result must hold one index per row");
  constexpr int64_t kChunk = 16384;  // floats: 64 KB, in L2 for the second look
  const int64_t C = (V + kChunk - 1) / kChunk;
  std::vector<sharpi::ArgmaxPart> parts(M * C);
  const float* x = logits.typed_data();
  // ~8 "multiply-adds" an element for the pool's threshold: a 248k-token row is worth spreading.
  xla_pool(tp).run(M * C, 8 * M * V, [&](int64_t u) {
    const int64_t r = u / C, c = u % C;
    parts[u] = sharpi::argmax_part(x + r * V, c * kChunk, std::min(V, (c + 1) * kChunk));
  });
  int32_t* o = out->typed_data();
  for (int64_t r = 0; r < M; ++r) o[r] = static_cast<int32_t>(sharpi::argmax_merge(parts.data() + r * C, C));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SharpiArgmax, ArgmaxImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SharpiGgmlMatmul, MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<int32_t>("qtype")
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SharpiGgmlMatmulRows, MatmulRowsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<int32_t>("qtype")
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SharpiGgmlExpertRows, ExpertRowsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Attr<int32_t>("gate_type")
                                  .Attr<int32_t>("up_type")
                                  .Attr<int32_t>("down_type")
                                  .Attr<int32_t>("mode")
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SharpiGdnStep, GdnStepImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SharpiGdnRows, GdnRowsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// ---------------------------------------------------------------------------------------------
// Python module: FFI capsules and the same computations on host arrays (no JAX)
// ---------------------------------------------------------------------------------------------

namespace {

using F32In = nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using U8In2 = nb::ndarray<const uint8_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using U8In3 = nb::ndarray<const uint8_t, nb::ndim<3>, nb::c_contig, nb::device::cpu>;
using I32In = nb::ndarray<const int32_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using F32Out = nb::ndarray<float, nb::c_contig, nb::device::cpu>;

void fail_if(const std::string& err, const char* what) {
  if (!err.empty()) throw nb::value_error((std::string(what) + ": " + err).c_str());
}

void host_matmul(F32In x, U8In2 w, int qtype, F32Out y, int threads) {
  fail_if(check_rows(qtype, x.shape(1), w.shape(1)), "ggml matmul");
  if (y.size() != x.shape(0) * w.shape(0)) throw nb::value_error("ggml matmul: y must hold M * N floats");
  nb::gil_scoped_release release;
  matmul(host_pool(threads), x.data(), x.shape(0), x.shape(1), w.data(), w.shape(0), qtype, y.data());
}

void host_expert_rows(F32In x, I32In ids, U8In3 gate, U8In3 up, U8In3 down, int gate_type, int up_type,
                      int down_type, int mode, F32Out y, int threads) {
  if (ids.shape(0) != x.shape(0) || gate.shape(0) != up.shape(0) || gate.shape(0) != down.shape(0) ||
      gate.shape(1) != up.shape(1) || down.shape(1) != x.shape(1))
    throw nb::value_error("ggml expert_rows: x [N, D], ids [N, k], gate/up [E, F, *], down [E, D, *] disagree");
  if (y.size() != x.shape(0) * ids.shape(1) * x.shape(1))
    throw nb::value_error("ggml expert_rows: y must hold N * k * D floats");
  ExpertWeights ew{gate.data(), up.data(), down.data(), static_cast<int64_t>(gate.shape(0)),
                   static_cast<int64_t>(x.shape(1)), static_cast<int64_t>(gate.shape(1)), gate_type, up_type,
                   down_type};
  fail_if(check_experts(ew, gate.shape(2), up.shape(2), down.shape(2)), "ggml expert_rows");
  std::string err;
  {
    nb::gil_scoped_release release;
    err = expert_rows(host_pool(threads), x.data(), ids.data(), x.shape(0), ids.shape(1), ew, mode, y.data());
  }
  fail_if(err, "ggml expert_rows");
}

void host_silu_mul(nb::ndarray<const float, nb::c_contig, nb::device::cpu> g,
                   nb::ndarray<const float, nb::c_contig, nb::device::cpu> u, F32Out h) {
  if (g.size() != u.size() || g.size() != h.size()) throw nb::value_error("silu_mul: g, u, h differ in size");
  silu_mul(g.data(), u.data(), h.data(), static_cast<int64_t>(g.size()));
}

}  // namespace

NB_MODULE(_ggml, m) {
  ggml_cpu_init();
  m.doc() = "ggml CPU kernels (from_float + vec_dot) for GGUF blocks: XLA FFI handlers and host functions.";
  m.def("ffi_targets", []() {
    nb::dict d;
    d["sharpi_ggml_matmul"] = nb::capsule(reinterpret_cast<void*>(SharpiGgmlMatmul));
    d["sharpi_ggml_matmul_rows"] = nb::capsule(reinterpret_cast<void*>(SharpiGgmlMatmulRows));
    d["sharpi_ggml_expert_rows"] = nb::capsule(reinterpret_cast<void*>(SharpiGgmlExpertRows));
    d["sharpi_gdn_step"] = nb::capsule(reinterpret_cast<void*>(SharpiGdnStep));
    d["sharpi_gdn_rows"] = nb::capsule(reinterpret_cast<void*>(SharpiGdnRows));
    d["sharpi_argmax"] = nb::capsule(reinterpret_cast<void*>(SharpiArgmax));
    return d;
  });
  m.def("set_multirow", &sharpi::set_multirow_enabled,
        "Turns the multi-row kernels on (default) or off (every element by vec_dot; same bits, for timing).");
  m.def("multirow", [](int qtype) { return sharpi::multirow_kernel(qtype) != nullptr; },
        "Whether products of this type run a multi-row kernel now (AVX2 CPU, enabled, type served).");
  m.def("multirow_isa", &sharpi::multirow_isa,
        "The instruction set of the multi-row kernels: \"avx512\", \"avx2\" or \"\" (none on this CPU).");
  m.def("set_multirow_isa", &sharpi::set_multirow_isa,
        "Picks \"avx512\", \"avx2\" or \"best\"; False when this CPU cannot run the set named (same bits).");
  m.def("spin_us", &sharpi::spin_us, "How long the products' idle helper threads spin before they sleep (us).");
  m.def("spin_tasks_run", &sharpi::spin_tasks_run, "Tasks the products' helper threads have run so far.");
  m.def("set_spin_us", &sharpi::set_spin_us, nb::arg("us"),
        "Sets the helpers' spin time (us); 0: products hand their work to XLA's pool (same bits either way).");
  m.def("multirow_min_rows", &sharpi::multirow_min_rows, nb::arg("qtype"), nb::arg("k"),
        "Rows from which products of this type's rows of k values use its kernel (fewer: vec_dot per element).");
  m.def("check_type", &check_type, "\"\" if ggml's CPU backend multiplies this type, else why not.");
  m.def("check_rows", &check_rows, "\"\" if weight rows of row_bytes hold K values of qtype, else why not.");
  m.def("vec_dot_type", [](int qtype) { return static_cast<int>(ggml_get_type_traits_cpu(static_cast<ggml_type>(qtype))->vec_dot_type); });
  m.def("matmul", &host_matmul, nb::arg("x"), nb::arg("w"), nb::arg("qtype"), nb::arg("y"), nb::arg("threads") = 1,
        "y[M, N] = x[M, K] @ W[N, K].T, W as GGUF blocks (same bits as the FFI op).");
  m.def("expert_rows", &host_expert_rows, nb::arg("x"), nb::arg("ids"), nb::arg("gate"), nb::arg("up"),
        nb::arg("down"), nb::arg("gate_type"), nb::arg("up_type"), nb::arg("down_type"), nb::arg("mode"), nb::arg("y"),
        nb::arg("threads") = 1, "y[N, k, D]: unreduced routed-expert outputs (same bits as the FFI op).");
  m.def("gdn_supported", &sharpi::gdn_native_supported, nb::arg("dk"),
        "Whether this CPU runs the native gated delta rule step for heads of dk values.");
  m.def("silu_mul", &host_silu_mul, "h = silu(g) * u with the expert op's own SiLU.");
}

// The gated delta rule of a Gated DeltaNet layer for one token, in one pass over the state (AVX2 / FMA).
//
// XLA runs the step as a decay, two batched mat-vecs and an outer-product update, materializing the
// decayed and the new state in between, and a verify pass then copies each row's new state into its
// snapshot slot: ~6 state-sized reads and writes a row. This kernel reads each state row once and writes
// the new one where it belongs: in place for a decode step; for a verify pass, all rows in one call that
// reads the starting state once and streams each row's state into its snapshot slot. Its bits are its own
// (not XLA's): every recurrent path of a model uses it alike, so a row's outputs and snapshots still do not
// depend on how many rows share the pass.
#pragma once

#include <cstdint>

namespace sharpi {

// Whether this CPU runs the kernel (AVX2 and FMA) for a head of dk values (a multiple of 8).
bool gdn_native_supported(int64_t dk);

// Heads [h0, h1) of one token: the state S [H, dv, dk] read from `src` and the new state written to `dst`
// (which may be `src`), out o [H, dv]. q, k [H, dk] (L2-normed), v [H, dv], beta, g [H]: per head,
// S' = e^g S, d = beta (v - S' k), S_new = S' + d k^T (row i: + d_i k), o = scale * S_new q.
void gdn_step(const float* src, float* dst, const float* q, const float* k, const float* v, const float* beta,
              const float* g, float scale, int64_t dv, int64_t dk, int64_t h0, int64_t h1, float* o);

// Rows [0, n) of a verify pass for heads [h0, h1), each row's new state written to its snapshot slot t of
// `snaps` [T, H, dv, dk] (`slot` = H dv dk floats apart). Row t starts from row parent[t]'s state (parent[t] < t;
// -1: from `init`, [H, dv, dk], which may be one of the slots: each of its rows is read before any slot's row
// is written). q, k [T, H, dk], v [T, H, dv], beta, g [T, H]; o [T, H, dv] (rows < n written). Each row's
// arithmetic is gdn_step's, in its order, so a row's bits equal a step's from the same state; but the starting
// state is read once for all the rows instead of once a row.
void gdn_rows(const float* init, float* snaps, int64_t slot, const int32_t* parent, int64_t n, const float* q,
              const float* k, const float* v, const float* beta, const float* g, float scale, int64_t H, int64_t dv,
              int64_t dk, int64_t h0, int64_t h1, float* o);

}  // namespace sharpi

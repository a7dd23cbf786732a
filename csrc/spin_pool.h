// Helper threads for the products' parallel loops that stay awake between products.
//
// A product handed to XLA's intra-op pool waits for the pool to start its task: 40-130 us on this 2-core
// machine (median, mean), against a 0.5 ms product, on every call of a decode step. These helpers spin (with
// `pause`) for a short while after their last task, so a decode step's next product starts its helper within
// a microsecond; past the spin time they sleep until a task comes.
#pragma once

#include <immintrin.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <thread>

namespace sharpi {

// Runs `task` on one of the process's helper threads: created on first use, up to `max_helpers` of them,
// never destroyed (they outlive static destruction, holding nothing).
void spin_post(std::function<void()> task, int max_helpers);

// How long an idle helper spins before it sleeps, in microseconds. 0: products use XLA's pool, as before
// these helpers. Set with SHARPI_GGML_SPIN_US (default kDefaultSpinUs) or set_spin_us; never changes a bit.
constexpr int kDefaultSpinUs = 200;
int spin_us();
void set_spin_us(int us);

// Spins until done() or the spin time has passed. Every 64 pauses: the clock, and a yield,
// so that a thread of XLA's own waiting for this core runs. Used by idle helpers (waiting for a task) and by
// a product's caller (waiting for helpers on their last units: a wake-up costs tens of microseconds).
template <class Done>
void spin_until(Done done) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us());
  for (int i = 1; !done(); ++i) {
    _mm_pause();
    if ((i & 63) == 0) {
      if (std::chrono::steady_clock::now() >= until) return;
      std::this_thread::yield();
    }
  }
}

// Tasks the helpers have run since the process started (a diagnostic: whether products reach them).
int64_t spin_tasks_run();

}  // namespace sharpi

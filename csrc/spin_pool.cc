// Helper threads that spin between tasks (see spin_pool.h).
#include "spin_pool.h"

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <mutex>
#include <thread>

namespace sharpi {
namespace {

int env_spin_us() {
  const char* v = std::getenv("SHARPI_GGML_SPIN_US");
  return v == nullptr ? kDefaultSpinUs : std::max(0, std::atoi(v));
}

std::atomic<int> g_spin_us{env_spin_us()};
std::atomic<int64_t> g_tasks_run{0};

struct Helpers {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::function<void()>> tasks;  // under mu
  std::atomic<int64_t> queued{0};           // tasks.size(), read by spinning helpers without the lock
  int started = 0;                          // under mu
  int sleeping = 0;                         // under mu
};

// Never destroyed: detached helpers may still wait on it at exit. A forked child has none of the parent's
// helper threads (and perhaps a lock its parent held): it starts a fresh set.
std::atomic<Helpers*> g_helpers{nullptr};

void fresh_helpers() { g_helpers.store(new Helpers); }

Helpers& helpers() {
  static const bool once = [] {
    fresh_helpers();
    pthread_atfork(nullptr, nullptr, fresh_helpers);
    return true;
  }();
  (void)once;
  return *g_helpers.load();
}

void helper_main(Helpers* h) {
  for (;;) {
    spin_until([h] { return h->queued.load(std::memory_order_acquire) != 0; });
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(h->mu);
      if (h->tasks.empty()) {
        ++h->sleeping;
        h->cv.wait(lock, [h] { return !h->tasks.empty(); });
        --h->sleeping;
      }
      task = std::move(h->tasks.front());
      h->tasks.pop_front();
      h->queued.fetch_sub(1, std::memory_order_relaxed);
    }
    task();
    g_tasks_run.fetch_add(1, std::memory_order_relaxed);
  }
}

}  // namespace

void spin_post(std::function<void()> task, int max_helpers) {
  Helpers& h = helpers();
  std::lock_guard<std::mutex> lock(h.mu);
  h.tasks.push_back(std::move(task));
  h.queued.fetch_add(1, std::memory_order_release);
  if (h.started < max_helpers && h.sleeping == 0) {
    ++h.started;
    std::thread(helper_main, &h).detach();
  } else if (h.sleeping > 0) {
    h.cv.notify_one();
  }
}

int spin_us() { return g_spin_us.load(std::memory_order_relaxed); }
void set_spin_us(int us) { g_spin_us.store(std::max(0, us), std::memory_order_relaxed); }
int64_t spin_tasks_run() { return g_tasks_run.load(std::memory_order_relaxed); }

}  // namespace sharpi

// The thread pool of the draft step and the target runtime's ops (common/cpu_pool.h, run_parallel).
//
// The calling thread and `threads - 1` helpers claim work items of a job from one atomic word; the
// caller then waits only for the items helpers have claimed. A helper the OS has descheduled (a
// busy neighbour process on its core) therefore costs nothing: it finds the job done when it runs.
// A fork-join team instead waits at every join for its slowest thread (docs/target-runtime.md: the
// draft step's former OpenMP team went from 2.0 to 8.0 ms with one busy core). Idle helpers spin for
// kHelperSpin (about the gap between two products of a decoder layer), then sleep on a futex.

#include <immintrin.h>
#include <sched.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <thread>

#include "common/cpu_pool.h"

namespace elsi_fast {
namespace {

class Pool {
 public:
  using Fn = void (*)(void* ctx, int64_t chunk);

  // Never destroyed: the helpers are detached and may still be waiting at exit.
  static Pool& get() {
    static Pool* pool = new Pool();
    return *pool;
  }

  // fn(ctx, i) for every i in [0, n).
  void run(int threads, int64_t n, Fn fn, void* ctx) {
    std::unique_lock<std::mutex> lock(mutex_, std::try_to_lock);
    // A concurrent caller runs alone; the job word holds fewer than 2^kCountBits items.
    if (threads <= 1 || n <= 1 || n > static_cast<int64_t>(kCountMask) || !lock.owns_lock()) {
      for (int64_t i = 0; i < n; ++i) fn(ctx, i);
      return;
    }
    for (; started_ < threads - 1; ++started_)
      std::thread([this, index = started_, seen = wake_.load()] { helper(index, seen); }).detach();
    fn_ = fn;
    ctx_ = ctx;
    done_.store(0, std::memory_order_relaxed);
    wanted_.store(threads - 1, std::memory_order_relaxed);
    generation_ = (generation_ + 1) & kGenerationMask;
    const uint64_t job = (static_cast<uint64_t>(generation_) << (2 * kCountBits)) |
                         (static_cast<uint64_t>(n) << kCountBits);
    state_.store(job, std::memory_order_release);
    wake_.store(generation_, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) wake_.notify_all();
    const int64_t mine = work(job);
    for (int spin = 0; done_.load(std::memory_order_acquire) + mine < n; ++spin)
      spin < kCallerSpins ? _mm_pause() : static_cast<void>(sched_yield());
  }


 private:
  static constexpr int kCountBits = 20;
  static constexpr uint64_t kCountMask = (uint64_t{1} << kCountBits) - 1;
  static constexpr uint32_t kGenerationMask = (uint32_t{1} << (64 - 2 * kCountBits)) - 1;
  static constexpr auto kHelperSpin = std::chrono::microseconds(100);
  static constexpr int kCallerSpins = 1 << 14;

  // Runs chunks of `job` (its state word with the next-chunk count zero) while any are left;
  // returns how many. The word packs generation, chunk count and next chunk, so a helper holding
  // a finished job's word can never claim a chunk of the next job.
  int64_t work(uint64_t job) {
    const uint64_t n = (job >> kCountBits) & kCountMask;
    int64_t count = 0;
    uint64_t s = state_.load(std::memory_order_acquire);
    while ((s & ~kCountMask) == job && (s & kCountMask) < n) {
      if (state_.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel, std::memory_order_acquire)) {
        fn_(ctx_, static_cast<int64_t>(s & kCountMask));  // the job cannot change before done_ counts this
        ++count;
        s = state_.load(std::memory_order_acquire);
      }
    }
    return count;
  }

  void helper(int index, uint32_t seen) {
    for (;;) {
      seen = wait_for_job(seen);
      if (index >= wanted_.load(std::memory_order_relaxed)) continue;
      const uint64_t job = state_.load(std::memory_order_acquire) & ~kCountMask;
      if (const int64_t count = work(job)) done_.fetch_add(count, std::memory_order_release);
    }
  }

  uint32_t wait_for_job(uint32_t seen) {
    const auto start = std::chrono::steady_clock::now();
    for (int i = 1;; ++i) {
      const uint32_t now = wake_.load(std::memory_order_acquire);
      if (now != seen) return now;
      _mm_pause();
      if (i % 256 == 0 && std::chrono::steady_clock::now() - start > kHelperSpin) break;
    }
    sleepers_.fetch_add(1, std::memory_order_seq_cst);
    uint32_t now;
    while ((now = wake_.load(std::memory_order_seq_cst)) == seen) wake_.wait(seen, std::memory_order_seq_cst);
    sleepers_.fetch_sub(1, std::memory_order_seq_cst);
    return now;
  }

  std::mutex mutex_;  // one job at a time
  int started_ = 0;
  uint32_t generation_ = 0;
  Fn fn_ = nullptr;
  void* ctx_ = nullptr;
  std::atomic<uint64_t> state_{0};
  std::atomic<uint32_t> wake_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<int> wanted_{0};
  std::atomic<int64_t> done_{0};
};

}  // namespace

void run_parallel(int num_threads, int64_t n, void (*fn)(void* ctx, int64_t i), void* ctx) {
  Pool::get().run(num_threads, n, fn, ctx);
}

}  // namespace elsi_fast

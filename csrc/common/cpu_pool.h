// The one CPU thread team of the extension (cpu_pool.cpp): the draft step (draft_decode_cpu.cpp)
// and the target runtime's ops (small_linear, decode_attention, quant_linear, the native GGUF
// forward) all run their parallel loops on it, so a speculative decoding step never switches
// between two teams that each spin or sleep while the other works (docs/target-runtime.md).
#pragma once

#include <cstdint>

namespace elsi_fast {

// fn(ctx, i) for every i in [0, n) on the calling thread and num_threads - 1 pool helpers. Helpers
// claim work items from one atomic word and the caller waits only for items a helper has claimed,
// so a helper the OS has descheduled (a busy neighbour process on its core) never holds a call up.
// Returns once every item is done, with their writes visible to the caller.
void run_parallel(int num_threads, int64_t n, void (*fn)(void* ctx, int64_t i), void* ctx);

// body(i) for every i in [0, n) on run_parallel's team.
template <typename Body>
void parallel_for(int num_threads, int64_t n, Body& body) {
  run_parallel(num_threads, n, [](void* ctx, int64_t i) { (*static_cast<Body*>(ctx))(i); }, &body);
}

}  // namespace elsi_fast

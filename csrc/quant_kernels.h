// What quant_linear_cpu.cpp (Q4_0, Q4_1, Q8_0 and the dispatch) and quant_kquants_cpu.cpp (Q5_0,
// Q4_K, Q6_K) share: the block-product kernel signature and its row and prefetch constants.
#pragma once

#include <cstdint>

#include "quant_linear.h"

namespace elsi_fast::quant {

// Most input rows one kernel call handles (QuantInput::s8 groups rows by it).
constexpr int kMaxRows = 8;
// Software prefetch distance along the weight stream (a chunk's rows lie back to back): on a 2-core
// Zen 3, 4 KB took a 1-row product from 10.8 to 8.8 ms CPU time over SmolLM2's Q4_1 layers. On the
// Sapphire Rapids VM, 8 KB took Gemma 3's 8-row Q8_0 head from 13.2 to 10.3 ms on one thread and
// its 1-row head at two threads from 4.5 to 3.6 ms (docs/native-target.md); 3-4 KB was the worst
// distance there, 8-16 KB about equal.
constexpr int64_t kPrefetchBytes = 8192;

// One weight row of `blocks` 32-column blocks (a super-block type: 8 per super-block) times the B
// input rows m0 .. m0 + B - 1 of x: out[m]. Tables index by B (entry 0 unused).
using DotsFn = void (*)(const uint8_t* w, int64_t blocks, const QuantInput& x, int64_t m0, float* out);

// The kernel table of Q5_0, Q4_K or Q6_K for the instruction set "avx512", "avx2" or "scalar" (the
// scalar table has B = 1 only); null for another type.
const DotsFn* more_dots(GgmlType type, const char* isa);

// Row `row` of a Q5_0, Q4_K or Q6_K matrix as fp32; false for another type.
bool dequantize_more_row(const QuantMatrix& m, int64_t row, float* out);

}  // namespace elsi_fast::quant

// Products with GGUF-quantized weights (quant_linear.h): one kernel per (instruction set, block
// type, input rows), picked at run time by cpu_isa() like the other CPU kernels.
//
// Decode at batch 1 is memory-bound: a weight row is read once for all input rows (up to
// kMaxRows at a time; more rows take further passes over the row, from L1). Work items are runs
// of consecutive weight rows of about kChunkBytes, so each thread streams memory sequentially.
// Read row by row (the file layout), per input row and block the kernel costs about as much as
// reading the block (a load, two multiply-adds, a conversion, the scale and an FMA), so a 5-row
// product cost about 2.3x a 1-row one; the forward's matrices (each type, rows a multiple of 8) are
// therefore packed by 8 rows (pack_rows8, quant_dots_rows8.inc; docs/native-target.md), and with AVX-512 two
// groups share each 512-bit vector, which halves the work of every further input row again.

// GCC 12's own AVX-512 intrinsic headers trip -Wmaybe-uninitialized (their "undefined" vectors).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

#include "quant_linear.h"
#include "quant_kernels.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

#include "common/simd.h"
#include "target_runtime.h"

namespace elsi_fast {
namespace {

using quant::DotsFn;
using quant::kMaxRows;
using quant::kPrefetchBytes;

// ---------------------------------------------------------------- scalar fallback
inline float half_bits(const uint8_t* p) { return simd::fp16_to_fp32(static_cast<uint16_t>(p[0] | (p[1] << 8))); }

// Weight q of column c of a block (integer part; Q4_1's minimum is added separately).
template <GgmlType T>
inline int32_t weight_at(const uint8_t* block, int64_t c) {
  if constexpr (T == GgmlType::kQ8_0) return static_cast<int8_t>(block[2 + c]);
  const uint8_t byte = block[(T == GgmlType::kQ4_1 ? 4 : 2) + c % 16];
  const int32_t q = c < 16 ? byte & 0x0F : byte >> 4;
  return T == GgmlType::kQ4_0 ? q - 8 : q;
}

// Bytes of one file block of T (Q5_0: the packed layout's; its row-by-row kernel is in
// quant_kquants_cpu.cpp).
template <GgmlType T>
constexpr int64_t kBlockBytes = T == GgmlType::kQ8_0 ? 34 : T == GgmlType::kQ5_0 ? 22 : T == GgmlType::kQ4_1 ? 20 : 18;

template <GgmlType T>
void dots_scalar(const uint8_t* w, int64_t blocks, const QuantInput& x, int64_t m0, float* out) {
  constexpr int64_t kBytes = kBlockBytes<T>;
  const int64_t nb = x.cols / kQuantBlock;
  float acc = 0.f, mins = 0.f;
  for (int64_t b = 0; b < blocks; ++b, w += kBytes) {
    const int8_t* xq = x.q.data() + m0 * x.cols + b * kQuantBlock;
    int32_t sum = 0;
    for (int64_t c = 0; c < kQuantBlock; ++c) sum += weight_at<T>(w, c) * xq[c];
    acc += half_bits(w) * x.d[m0 * nb + b] * static_cast<float>(sum);
    if constexpr (T == GgmlType::kQ4_1) mins += half_bits(w + 2) * x.s[m0 * nb + b];
  }
  out[0] = acc + mins;
}

template <GgmlType T>
constexpr DotsFn kScalarDots[kMaxRows + 1] = {nullptr, dots_scalar<T>};

// Bytes of a packed group's block (8 file blocks), and of its head before the quants (8 fp16
// scales, then Q4_1's 8 fp16 minimums or Q5_0's 8 uint32 fifth bits).
template <GgmlType T>
constexpr int64_t kRows8Bytes = 8 * kBlockBytes<T>;
template <GgmlType T>
constexpr int64_t kRows8Head = T == GgmlType::kQ5_0 ? 48 : T == GgmlType::kQ4_1 ? 32 : 16;

// Weight q of row i, column c of a packed group's block (the integer value the file encodes).
template <GgmlType T>
inline int32_t weight8_at(const uint8_t* block, int i, int64_t c) {
  const uint8_t* q = block + kRows8Head<T>;
  if constexpr (T == GgmlType::kQ8_0) return static_cast<int8_t>(q[32 * (c / 4) + 4 * i + c % 4]);
  const int64_t j = c % 16;  // the nibble byte
  const uint8_t byte = q[32 * (j / 4) + 4 * i + j % 4];
  const int32_t code = c < 16 ? byte & 0x0F : byte >> 4;
  if constexpr (T == GgmlType::kQ5_0) {
    uint32_t qh;
    std::memcpy(&qh, block + 16 + 4 * i, 4);
    return (code | static_cast<int32_t>((qh >> c) & 1) << 4) - 16;
  }
  return T == GgmlType::kQ4_0 ? code - 8 : code;
}

// The packed kernels' arithmetic, one row at a time: exact integer block sums, then per weight row
// acc = fma(d * xd, sum, acc) and Q4_1's mins = fma(m, xs, mins) in block order; out = acc + mins.
template <GgmlType T>
void dots8_scalar(const uint8_t* w, int64_t blocks, const QuantInput& x, int64_t m0, float* out) {
  const int64_t nb = x.cols / kQuantBlock;
  float acc[8] = {}, mins[8] = {};
  for (int64_t b = 0; b < blocks; ++b, w += kRows8Bytes<T>) {
    const int8_t* xq = x.q.data() + m0 * x.cols + b * kQuantBlock;
    const float xd = x.d[m0 * nb + b];
    for (int i = 0; i < 8; ++i) {
      int32_t sum = 0;
      for (int64_t c = 0; c < kQuantBlock; ++c) sum += weight8_at<T>(w, i, c) * xq[c];
      acc[i] = std::fma(half_bits(w + 2 * i) * xd, static_cast<float>(sum), acc[i]);
      if constexpr (T == GgmlType::kQ4_1) mins[i] = std::fma(half_bits(w + 16 + 2 * i), x.s[m0 * nb + b], mins[i]);
    }
  }
  for (int i = 0; i < 8; ++i) out[i] = acc[i] + mins[i];
}

template <GgmlType T>
constexpr DotsFn kScalarDots8[kMaxRows + 1] = {nullptr, dots8_scalar<T>};

// Q4_K packed by 8 rows (pack_rows8): bytes of a group's super-block (8 file blocks of 144), and of
// its head before the quants (8 d, 8 dmin, then the three scale words of the 8 rows as 3 x 32 bytes).
constexpr int64_t kQ4KGroupBytes = 8 * 144;
constexpr int64_t kQ4KGroupHead = 128;

// The packed Q4_K kernels' arithmetic, one row at a time (q4k_scales' bit layout of the scale words):
// per sub-block j the exact integer sum, acc = fma(d sc_j * xd, sum, acc), mins = fma(-(dmin m_j),
// xs, mins) in block order; out = acc + mins.
void dots8_q4k_scalar(const uint8_t* w, int64_t blocks, const QuantInput& x, int64_t m0, float* out) {
  const int64_t nb = x.cols / kQuantBlock;
  float acc[8] = {}, mins[8] = {};
  for (int64_t s = 0; s < blocks / 8; ++s, w += kQ4KGroupBytes)
    for (int i = 0; i < 8; ++i) {
      uint32_t word[3];
      for (int k = 0; k < 3; ++k) std::memcpy(&word[k], w + 32 + 32 * k + 4 * i, 4);
      const uint32_t sc[2] = {word[0] & 0x3f3f3f3fu, (word[2] & 0x0f0f0f0fu) | (((word[0] >> 6) & 0x03030303u) << 4)};
      const uint32_t mn[2] = {word[1] & 0x3f3f3f3fu,
                              ((word[2] >> 4) & 0x0f0f0f0fu) | (((word[1] >> 6) & 0x03030303u) << 4)};
      for (int sub = 0; sub < 8; ++sub) {
        const int shift = 8 * (sub % 4);
        const float scale = half_bits(w + 2 * i) * static_cast<float>((sc[sub / 4] >> shift) & 0xFF);
        const float neg_min = -(half_bits(w + 16 + 2 * i) * static_cast<float>((mn[sub / 4] >> shift) & 0xFF));
        const int64_t b = 8 * s + sub;
        const int8_t* xq = x.q.data() + m0 * x.cols + b * kQuantBlock;
        int32_t sum = 0;
        for (int64_t c = 0; c < kQuantBlock; ++c) {
          const uint8_t byte = w[kQ4KGroupHead + 256 * (sub / 2) + 32 * (c / 4) + 4 * i + c % 4];
          sum += (sub % 2 ? byte >> 4 : byte & 0x0F) * xq[c];
        }
        acc[i] = std::fma(scale * x.d[m0 * nb + b], static_cast<float>(sum), acc[i]);
        mins[i] = std::fma(neg_min, x.s[m0 * nb + b], mins[i]);
      }
    }
  for (int i = 0; i < 8; ++i) out[i] = acc[i] + mins[i];
}

constexpr DotsFn kScalarDots8Q4K[kMaxRows + 1] = {nullptr, dots8_q4k_scalar};

// Q6_K packed by 8 rows (pack_rows8): bytes of a group's super-block (8 file blocks of 210), and of
// its head before the quants (the 8 rows' fp16 d, then their int8 scales as [16 scales][8 rows]).
// The quants follow as vectors [4 columns][8 rows][4 bytes]: ql's four 32-byte runs (256 bytes
// each), then qh's two (quant_kquants_cpu.cpp has the file layout).
constexpr int64_t kQ6KGroupBytes = 8 * 210;
constexpr int64_t kQ6KGroupHead = 144;

// The packed Q6_K kernels' arithmetic, one row at a time: per sub-block the exact integer sum
// sc_a * sum_{c < 16} (q - 32) x + sc_b * sum_{c >= 16} (q - 32) x, then acc = fma(d * xd, sum, acc)
// in block order.
void dots8_q6k_scalar(const uint8_t* w, int64_t blocks, const QuantInput& x, int64_t m0, float* out) {
  const int64_t nb = x.cols / kQuantBlock;
  float acc[8] = {};
  for (int64_t s = 0; s < blocks / 8; ++s, w += kQ6KGroupBytes)
    for (int i = 0; i < 8; ++i)
      for (int sub = 0; sub < 8; ++sub) {
        const int n = sub / 4, k = sub % 4;
        const int64_t b = 8 * s + sub;
        const int8_t* xq = x.q.data() + m0 * x.cols + b * kQuantBlock;
        int32_t halves[2] = {0, 0};
        for (int64_t c = 0; c < kQuantBlock; ++c) {
          const int64_t lane = 32 * (c / 4) + 4 * i + c % 4;
          const int32_t low = (w[kQ6KGroupHead + 256 * (2 * n + k % 2) + lane] >> (4 * (k / 2))) & 0x0F;
          const int32_t high = (w[kQ6KGroupHead + 1024 + 256 * n + lane] >> (2 * k)) & 3;
          halves[c / 16] += ((low | high << 4) - 32) * xq[c];
        }
        const int8_t* sc = reinterpret_cast<const int8_t*>(w + 16);
        const int32_t sum = halves[0] * sc[8 * (2 * sub) + i] + halves[1] * sc[8 * (2 * sub + 1) + i];
        acc[i] = std::fma(half_bits(w + 2 * i) * x.d[m0 * nb + b], static_cast<float>(sum), acc[i]);
      }
  for (int i = 0; i < 8; ++i) out[i] = acc[i];
}

constexpr DotsFn kScalarDots8Q6K[kMaxRows + 1] = {nullptr, dots8_q6k_scalar};

// One 32-column input block as QuantInput defines it (quant_dots.inc's quantize_block per
// instruction set gives the same bytes): q[32], the sums of q over columns 0-15 and 16-31; returns d.
using QuantizeFn = float (*)(const float* x, int8_t* q, int32_t* half_sums);
float quantize_block_scalar(const float* x, int8_t* q, int32_t* half_sums) {
  float amax = 0.f;
  for (int64_t c = 0; c < kQuantBlock; ++c) amax = std::max(amax, std::fabs(x[c]));
  const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
  half_sums[0] = half_sums[1] = 0;
  for (int64_t c = 0; c < kQuantBlock; ++c) {
    const int32_t v = static_cast<int32_t>(std::nearbyint(x[c] * inv));
    q[c] = static_cast<int8_t>(v);
    half_sums[c / 16] += v;
  }
  return d;
}

#define ELSI_ISA_KERNELS "quant_dots.inc"
#include "isa_variants.inc"
#undef ELSI_ISA_KERNELS
#define ELSI_ISA_KERNELS "quant_dots_rows8.inc"
#include "isa_variants.inc"
#undef ELSI_ISA_KERNELS

// ---------------------------------------------------------------- dispatch
struct Kernels {
  const char* isa;  // quant_kquants_cpu.cpp's tables of the other types (quant::more_dots)
  int block;  // most input rows per call
  const DotsFn* dots[3];  // [Q4_0, Q4_1, Q8_0][input rows]
  const DotsFn* dots8[6];  // [Q4_0, Q4_1, Q8_0, Q5_0, Q4_K, Q6_K] over packed groups of 8 weight rows
  const DotsFn* dots16[6];  // the same over two adjacent groups at once (null: dots8 only)
  QuantizeFn quantize;  // one input block
};
const Kernels kScalar{"scalar", 1,
                      {kScalarDots<GgmlType::kQ4_0>, kScalarDots<GgmlType::kQ4_1>, kScalarDots<GgmlType::kQ8_0>},
                      {kScalarDots8<GgmlType::kQ4_0>, kScalarDots8<GgmlType::kQ4_1>, kScalarDots8<GgmlType::kQ8_0>,
                       kScalarDots8<GgmlType::kQ5_0>, kScalarDots8Q4K, kScalarDots8Q6K},
                      {},
                      quantize_block_scalar};
const Kernels kAvx2{"avx2", kMaxRows,
                    {avx2::kDots<GgmlType::kQ4_0>, avx2::kDots<GgmlType::kQ4_1>, avx2::kDots<GgmlType::kQ8_0>},
                    {avx2::kDots8<GgmlType::kQ4_0>, avx2::kDots8<GgmlType::kQ4_1>, avx2::kDots8<GgmlType::kQ8_0>,
                     avx2::kDots8<GgmlType::kQ5_0>, avx2::kDots8Q4K, avx2::kDots8Q6K},
                    {},
                    avx2::quantize_block};
const Kernels kAvx512{"avx512", kMaxRows,
                      {avx512::kDots<GgmlType::kQ4_0>, avx512::kDots<GgmlType::kQ4_1>, avx512::kDots<GgmlType::kQ8_0>},
                      {avx512::kDots8<GgmlType::kQ4_0>, avx512::kDots8<GgmlType::kQ4_1>,
                       avx512::kDots8<GgmlType::kQ8_0>, avx512::kDots8<GgmlType::kQ5_0>, avx512::kDots8Q4K,
                       avx512::kDots8Q6K},
                      {avx512::kDots16<GgmlType::kQ4_0>, avx512::kDots16<GgmlType::kQ4_1>,
                       avx512::kDots16<GgmlType::kQ8_0>, avx512::kDots16<GgmlType::kQ5_0>, avx512::kDots16Q4K,
                       avx512::kDots16Q6K},
                      avx512::quantize_block};

const Kernels& active_kernels() {
  const char* isa = cpu_isa();
  if (std::strcmp(isa, "avx512") == 0) return kAvx512;
  if (std::strcmp(isa, "avx2") == 0) return kAvx2;
  return kScalar;
}

int rows8_index(GgmlType t) {
  switch (t) {
    case GgmlType::kQ4_0: return 0;
    case GgmlType::kQ4_1: return 1;
    case GgmlType::kQ8_0: return 2;
    case GgmlType::kQ5_0: return 3;
    case GgmlType::kQ4_K: return 4;
    default: return 5;  // Q6_K
  }
}

// The kernel table of a matrix for the active instruction set.
const DotsFn* dots_for(const Kernels& k, const QuantMatrix& m) {
  const GgmlType t = m.type;
  if (m.rows8)  // packs_rows8 types
    return k.dots8[rows8_index(t)];
  switch (t) {
    case GgmlType::kQ4_0: return k.dots[0];
    case GgmlType::kQ4_1: return k.dots[1];
    case GgmlType::kQ8_0: return k.dots[2];
    default:
      if (const DotsFn* more = quant::more_dots(t, k.isa)) return more;
      throw std::invalid_argument("quant_linear: weight type " + std::to_string(static_cast<int>(t)) +
                                  " is not Q4_0, Q4_1, Q5_0, Q8_0, Q4_K or Q6_K");
  }
}

// Chunks of about this many weight bytes: small enough that a preempted helper holds back little,
// large enough that claiming one is cheap next to reading it.
constexpr int64_t kChunkBytes = 32 << 10;

struct Chunk {
  int mat;
  int64_t row0, row1;
};

struct Call {
  const QuantMatrix* mats;
  float* const* ys;
  const QuantInput* x;
  const Kernels* k;
  std::vector<const DotsFn*> dots;  // per matrix
  std::vector<const DotsFn*> dots16;  // per matrix: its pairs-of-groups kernel, or null
  std::vector<Chunk> chunks;
};

void run_chunk(void* ctx, int64_t i) {
  const Call& c = *static_cast<const Call*>(ctx);
  const Chunk& ch = c.chunks[i];
  const QuantMatrix& w = c.mats[ch.mat];
  const DotsFn* dots = c.dots[ch.mat];
  const int64_t row_bytes = w.row_bytes(), blocks = w.cols / kQuantBlock, rows = c.x->rows;
  float* y = c.ys[ch.mat];
  if (w.rows8) {  // chunks start and end on groups of 8 rows; pairs of groups where a kernel takes them
    float out[kMaxRows * 16];
    const DotsFn* pairs = c.dots16[ch.mat];
    for (int64_t r = ch.row0; r < ch.row1;) {
      const int64_t group = pairs != nullptr && r + 16 <= ch.row1 ? 16 : 8;
      for (int64_t m0 = 0; m0 < rows; m0 += c.k->block) {
        const int b = static_cast<int>(std::min<int64_t>(c.k->block, rows - m0));
        (group == 16 ? pairs : dots)[b](w.data + r * row_bytes, blocks, *c.x, m0, out);
        for (int m = 0; m < b; ++m) std::copy(out + group * m, out + group * (m + 1), y + (m0 + m) * w.rows + r);
      }
      r += group;
    }
    return;
  }
  float out[kMaxRows];
  for (int64_t r = ch.row0; r < ch.row1; ++r)
    for (int64_t m0 = 0; m0 < rows; m0 += c.k->block) {
      const int b = static_cast<int>(std::min<int64_t>(c.k->block, rows - m0));
      dots[b](w.data + r * row_bytes, blocks, *c.x, m0, out);
      for (int m = 0; m < b; ++m) y[(m0 + m) * w.rows + r] = out[m];
    }
}

}  // namespace

int64_t ggml_block_cols(int32_t type) {
  const GgmlType t = static_cast<GgmlType>(type);
  if (t == GgmlType::kQ4_K || t == GgmlType::kQ6_K) return 256;
  return ggml_block_bytes(type) == 0 ? 0 : kQuantBlock;
}

int64_t ggml_block_bytes(int32_t type) {
  switch (static_cast<GgmlType>(type)) {
    case GgmlType::kF32: return 4 * kQuantBlock;
    case GgmlType::kF16: return 2 * kQuantBlock;
    case GgmlType::kQ4_0: return 18;
    case GgmlType::kQ4_1: return 20;
    case GgmlType::kQ5_0: return 22;
    case GgmlType::kQ8_0: return 34;
    case GgmlType::kQ4_K: return 144;
    case GgmlType::kQ6_K: return 210;
  }
  return 0;
}

void quantize_input(const float* x, int64_t rows, int64_t cols, QuantInput& out) {
  const int64_t nb = cols / kQuantBlock;
  out.rows = rows, out.cols = cols;
  out.q.resize(rows * cols), out.d.resize(rows * nb), out.s.resize(rows * nb);
  out.s8.assign((rows + kMaxRows - 1) / kMaxRows * nb * kMaxRows, 0.f);
  out.qsum.resize(rows * nb), out.qsum16.resize(2 * rows * nb);
  const QuantizeFn quantize = active_kernels().quantize;
  for (int64_t i = 0; i < rows * nb; ++i) {
    int32_t* halves = out.qsum16.data() + 2 * i;
    const float d = quantize(x + i * kQuantBlock, out.q.data() + i * kQuantBlock, halves);
    const int32_t sum = halves[0] + halves[1];
    out.d[i] = d;
    out.qsum[i] = sum;
    out.s[i] = d * static_cast<float>(sum);
    const int64_t row = i / nb, b = i % nb;
    out.s8[(row / kMaxRows * nb + b) * kMaxRows + row % kMaxRows] = out.s[i];
  }
}

void quant_linear_cpu(const QuantMatrix* mats, float* const* ys, int n, const QuantInput& x, int num_threads) {
  Call call{mats, ys, &x, &active_kernels(), {}, {}, {}};
  for (int i = 0; i < n; ++i) {
    call.dots.push_back(dots_for(*call.k, mats[i]));
    call.dots16.push_back(mats[i].rows8 ? call.k->dots16[rows8_index(mats[i].type)] : nullptr);
    if (mats[i].cols != x.cols)
      throw std::invalid_argument("quant_linear: weight has " + std::to_string(mats[i].cols) + " columns, input " +
                                  std::to_string(x.cols));
    const int64_t group = mats[i].rows8 ? 16 : 1;  // whole pairs of packed groups but for the last
    const int64_t step = std::max<int64_t>(1, kChunkBytes / mats[i].row_bytes() / group) * group;
    for (int64_t r = 0; r < mats[i].rows; r += step) call.chunks.push_back({i, r, std::min(mats[i].rows, r + step)});
  }
  run_parallel(num_threads, static_cast<int64_t>(call.chunks.size()), run_chunk, &call);
}

bool packs_rows8(int32_t type, int64_t rows) {
  const GgmlType t = static_cast<GgmlType>(type);
  return (t == GgmlType::kQ4_0 || t == GgmlType::kQ4_1 || t == GgmlType::kQ5_0 || t == GgmlType::kQ8_0 ||
          t == GgmlType::kQ4_K || t == GgmlType::kQ6_K) &&
         rows % 8 == 0;
}

namespace {
// Calls pack(dst, src, i) for row i of every group of 8 rows and every 256-column super-block: src
// the row's file block of `block_bytes`, dst the group's packed super-block (8 blocks' bytes).
template <typename Pack>
void pack_super_blocks(const QuantMatrix& m, int64_t block_bytes, uint8_t* out, Pack pack) {
  const int64_t supers = m.cols / 256;
  for (int64_t g = 0; g < m.rows / 8; ++g)
    for (int64_t s = 0; s < supers; ++s)
      for (int i = 0; i < 8; ++i)
        pack(out + (g * supers + s) * 8 * block_bytes, m.data + (g * 8 + i) * m.row_bytes() + s * block_bytes, i);
}

// Row i's `runs` 32-byte runs at src as vectors [4 bytes][8 rows]: bytes 4v .. 4v + 3 of run r go to
// dst + 256 r + 32 v + 4 i.
void scatter_runs(uint8_t* dst, const uint8_t* src, int runs, int i) {
  for (int r = 0; r < runs; ++r)
    for (int v = 0; v < 8; ++v) std::memcpy(dst + 256 * r + 32 * v + 4 * i, src + 32 * r + 4 * v, 4);
}

// Q4_K's group layout (quant_dots_rows8.inc, dots8_q4k): per super-block the 8 rows' d, dmin, scale
// words 0, 1 and 2 (each as 8 x 4 bytes), then per pair of sub-blocks the 32 quant bytes as 8
// vectors [4 bytes][8 rows].
void pack_rows8_q4k(const QuantMatrix& m, uint8_t* out) {
  pack_super_blocks(m, 144, out, [](uint8_t* dst, const uint8_t* src, int i) {
    std::memcpy(dst + 2 * i, src, 2);           // d
    std::memcpy(dst + 16 + 2 * i, src + 2, 2);  // dmin
    for (int k = 0; k < 3; ++k) std::memcpy(dst + 32 + 32 * k + 4 * i, src + 4 + 4 * k, 4);
    scatter_runs(dst + kQ4KGroupHead, src + 16, 4, i);
  });
}

// Q6_K's group layout (dots8_q6k): per super-block the 8 rows' d and 16 int8 scales, then ql's four
// 32-byte runs (bytes 0-127 of the file block) and qh's two (128-191), as scatter_runs lays them.
void pack_rows8_q6k(const QuantMatrix& m, uint8_t* out) {
  pack_super_blocks(m, 210, out, [](uint8_t* dst, const uint8_t* src, int i) {
    std::memcpy(dst + 2 * i, src + 208, 2);  // d
    for (int j = 0; j < 16; ++j) dst[16 + 8 * j + i] = src[192 + j];
    scatter_runs(dst + kQ6KGroupHead, src, 6, i);
  });
}
}  // namespace

void pack_rows8(const QuantMatrix& m, uint8_t* out) {
  if (m.rows8 || !packs_rows8(static_cast<int32_t>(m.type), m.rows))
    throw std::invalid_argument("pack_rows8: expected a Q4_0, Q4_1, Q5_0, Q8_0, Q4_K or Q6_K matrix in file layout with "
                                "rows a multiple of 8");
  if (m.type == GgmlType::kQ4_K) return pack_rows8_q4k(m, out);
  if (m.type == GgmlType::kQ6_K) return pack_rows8_q6k(m, out);
  const int64_t bytes = ggml_block_bytes(static_cast<int32_t>(m.type)), blocks = m.cols / kQuantBlock;
  // bytes before a file block's quants: d, then Q4_1's fp16 minimum or Q5_0's uint32 fifth bits
  const int64_t extra = m.type == GgmlType::kQ4_1 ? 2 : m.type == GgmlType::kQ5_0 ? 4 : 0, head = 2 + extra;
  const int64_t quants = bytes - head;  // 32 (Q8_0) or 16 nibble bytes
  for (int64_t g = 0; g < m.rows / 8; ++g)
    for (int64_t b = 0; b < blocks; ++b) {
      uint8_t* dst = out + (g * blocks + b) * 8 * bytes;
      for (int i = 0; i < 8; ++i) {
        const uint8_t* src = m.data + (g * 8 + i) * m.row_bytes() + b * bytes;
        std::memcpy(dst + 2 * i, src, 2);                                   // d
        if (extra) std::memcpy(dst + 16 + extra * i, src + 2, extra);       // minimum or fifth bits
        for (int64_t j = 0; j < quants / 4; ++j) std::memcpy(dst + 8 * head + 32 * j + 4 * i, src + head + 4 * j, 4);
      }
    }
}

void dequantize_row(const QuantMatrix& m, int64_t row, float* out) {
  if (m.rows8) throw std::invalid_argument("dequantize_row: a packed matrix (look rows up in the file layout)");
  if (quant::dequantize_more_row(m, row, out)) return;
  const uint8_t* p = m.data + row * m.row_bytes();
  const int64_t bytes = ggml_block_bytes(static_cast<int32_t>(m.type));
  for (int64_t b = 0; b < m.cols / kQuantBlock; ++b, p += bytes, out += kQuantBlock)
    for (int64_t c = 0; c < kQuantBlock; ++c) switch (m.type) {
        case GgmlType::kF32: std::memcpy(out + c, p + 4 * c, 4); break;
        case GgmlType::kF16: out[c] = half_bits(p + 2 * c); break;
        case GgmlType::kQ4_0: out[c] = half_bits(p) * static_cast<float>(weight_at<GgmlType::kQ4_0>(p, c)); break;
        case GgmlType::kQ4_1:
          out[c] = half_bits(p) * static_cast<float>(weight_at<GgmlType::kQ4_1>(p, c)) + half_bits(p + 2);
          break;
        case GgmlType::kQ8_0: out[c] = half_bits(p) * static_cast<float>(weight_at<GgmlType::kQ8_0>(p, c)); break;
        default: throw std::invalid_argument("dequantize_row: unsupported ggml type");
      }
}

}  // namespace elsi_fast

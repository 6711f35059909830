// Products with the block types Gemma 3's package file adds to quant_linear_cpu.cpp's: Q5_0 and the
// super-block types Q4_K and Q6_K (quant_linear.h, docs/native-target.md). One kernel per
// (instruction set, type, input rows); quant_linear_cpu.cpp's dispatch picks them (quant_kernels.h).
//
// Layouts (one row of blocks per output feature, columns in order):
//   Q5_0 (22 bytes / 32 columns): fp16 d, uint32 qh, 16 bytes qs; column c is
//        (nibble c of qs | bit c of qh << 4) - 16, times d (nibble c: low of byte c for c < 16,
//        else high of byte c - 16).
//   Q4_K (144 bytes / 256): fp16 d, fp16 dmin, 12 bytes of 6-bit scales sc_j and minimums m_j of
//        8 sub-blocks of 32, 128 bytes qs; sub-block j holds the low (j even) or high nibbles of
//        bytes 32 (j / 2) .. + 31; value d sc_j q - dmin m_j.
//   Q6_K (210 bytes / 256): 128 bytes ql (low 4 bits), 64 bytes qh (high 2 bits), 16 int8 scales of
//        16 columns each, fp16 d; column 128 n + 32 k + l (n < 2, k < 4, l < 32) has low bits from
//        ql[64 n + 32 (k % 2) + l] (low nibble for k < 2, else high) and high bits 2k, 2k+1 of
//        qh[32 n + l]; value d sc[column / 16] (q - 32).
// Every 32 columns meet one int8 input block (QuantInput): the block product is an exact integer
// sum (Q6_K's two 16-column halves each times its int8 scale), then times the fp32 scale product.

// GCC 12's own AVX-512 intrinsic headers trip -Wmaybe-uninitialized (their "undefined" vectors).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "common/simd.h"
#include "quant_kernels.h"

namespace elsi_fast::quant {
namespace {

inline float half_at(const uint8_t* p) { return simd::fp16_to_fp32(static_cast<uint16_t>(p[0] | (p[1] << 8))); }

// Q4_K's 12 bytes of scales: sub-blocks 0-3 have the low 6 bits of bytes 0-3 (scale) and 4-7
// (minimum); sub-blocks 4-7 the nibbles of bytes 8-11 (scale low, minimum high) as bits 0-3 and
// the top 2 bits of bytes 0-3 (scale) and 4-7 (minimum) as bits 4-5. Returns d sc_j and -dmin m_j.
inline void q4k_scales(const uint8_t* block, float* scales, float* mins) {
  const float d = half_at(block), dmin = half_at(block + 2);
  const uint8_t* s = block + 4;
  for (int j = 0; j < 8; ++j) {
    const int sc = j < 4 ? s[j] & 63 : (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    const int mn = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    scales[j] = d * static_cast<float>(sc);
    mins[j] = -(dmin * static_cast<float>(mn));
  }
}

// ---------------------------------------------------------------- scalar fallback
// Integer weight of column c (< 32) of sub-block j, with Q4_K's q unsigned and the others signed.
template <GgmlType T>
inline int32_t weight_at(const uint8_t* block, int j, int c) {
  if constexpr (T == GgmlType::kQ5_0) {
    const uint32_t qh = block[2] | (block[3] << 8) | (block[4] << 16) | (static_cast<uint32_t>(block[5]) << 24);
    const int32_t nibble = c < 16 ? block[6 + c] & 0x0F : block[6 + c - 16] >> 4;
    return (nibble | static_cast<int32_t>((qh >> c) & 1) << 4) - 16;
  } else if constexpr (T == GgmlType::kQ4_K) {
    return (block[16 + 32 * (j / 2) + c] >> (4 * (j % 2))) & 0x0F;
  } else {
    const int n = j / 4, k = j % 4;
    const int32_t low = (block[64 * n + 32 * (k % 2) + c] >> (4 * (k / 2))) & 0x0F;
    const int32_t high = (block[128 + 32 * n + c] >> (2 * k)) & 3;
    return (low | high << 4) - 32;
  }
}

template <GgmlType T>
void dots_scalar(const uint8_t* w, int64_t blocks, const QuantInput& x, int64_t m0, float* out) {
  constexpr int64_t kBytes = T == GgmlType::kQ5_0 ? 22 : T == GgmlType::kQ4_K ? 144 : 210;
  constexpr int kSub = T == GgmlType::kQ5_0 ? 1 : 8;
  const int64_t nb = x.cols / kQuantBlock;
  float acc = 0.f, mins = 0.f, scales[8], neg_mins[8];
  for (int64_t s = 0; s < blocks / kSub; ++s, w += kBytes) {
    if constexpr (T == GgmlType::kQ4_K) q4k_scales(w, scales, neg_mins);
    for (int j = 0; j < kSub; ++j) {
      const int64_t b = s * kSub + j;
      const int8_t* xq = x.q.data() + m0 * x.cols + b * kQuantBlock;
      int32_t sum = 0;
      if constexpr (T == GgmlType::kQ6_K) {
        const int8_t* sc = reinterpret_cast<const int8_t*>(w + 192);
        int32_t halves[2] = {0, 0};
        for (int c = 0; c < 32; ++c) halves[c / 16] += weight_at<T>(w, j, c) * xq[c];
        sum = halves[0] * sc[2 * j] + halves[1] * sc[2 * j + 1];
      } else {
        for (int c = 0; c < 32; ++c) sum += weight_at<T>(w, j, c) * xq[c];
      }
      const float dw = T == GgmlType::kQ4_K ? scales[j] : half_at(T == GgmlType::kQ6_K ? w + 208 : w);
      acc += dw * x.d[m0 * nb + b] * static_cast<float>(sum);
      if constexpr (T == GgmlType::kQ4_K) mins += neg_mins[j] * x.s[m0 * nb + b];
    }
  }
  out[0] = acc + mins;
}

template <GgmlType T>
constexpr DotsFn kScalarDots[kMaxRows + 1] = {nullptr, dots_scalar<T>};

#define ELSI_ISA_KERNELS "quant_dots_more.inc"
#include "isa_variants.inc"
#undef ELSI_ISA_KERNELS

template <GgmlType T>
const DotsFn* table(const char* isa) {
  if (std::strcmp(isa, "avx512") == 0) return avx512::kDots<T>;
  if (std::strcmp(isa, "avx2") == 0) return avx2::kDots<T>;
  return kScalarDots<T>;
}

template <GgmlType T>
void dequantize(const uint8_t* p, int64_t cols, float* out) {
  constexpr int64_t kBytes = T == GgmlType::kQ5_0 ? 22 : T == GgmlType::kQ4_K ? 144 : 210;
  constexpr int kSub = T == GgmlType::kQ5_0 ? 1 : 8;
  float scales[8], neg_mins[8];
  for (int64_t s = 0; s < cols / (32 * kSub); ++s, p += kBytes) {
    if constexpr (T == GgmlType::kQ4_K) q4k_scales(p, scales, neg_mins);
    for (int j = 0; j < kSub; ++j)
      for (int c = 0; c < 32; ++c, ++out) {
        const float q = static_cast<float>(weight_at<T>(p, j, c));
        if constexpr (T == GgmlType::kQ5_0) *out = half_at(p) * q;
        if constexpr (T == GgmlType::kQ4_K) *out = scales[j] * q + neg_mins[j];
        if constexpr (T == GgmlType::kQ6_K)
          *out = half_at(p + 208) * static_cast<float>(reinterpret_cast<const int8_t*>(p + 192)[2 * j + c / 16]) * q;
      }
  }
}

}  // namespace

const DotsFn* more_dots(GgmlType type, const char* isa) {
  switch (type) {
    case GgmlType::kQ5_0: return table<GgmlType::kQ5_0>(isa);
    case GgmlType::kQ4_K: return table<GgmlType::kQ4_K>(isa);
    case GgmlType::kQ6_K: return table<GgmlType::kQ6_K>(isa);
    default: return nullptr;
  }
}

bool dequantize_more_row(const QuantMatrix& m, int64_t row, float* out) {
  const uint8_t* p = m.data + row * m.row_bytes();
  switch (m.type) {
    case GgmlType::kQ5_0: dequantize<GgmlType::kQ5_0>(p, m.cols, out); return true;
    case GgmlType::kQ4_K: dequantize<GgmlType::kQ4_K>(p, m.cols, out); return true;
    case GgmlType::kQ6_K: dequantize<GgmlType::kQ6_K>(p, m.cols, out); return true;
    default: return false;
  }
}

}  // namespace elsi_fast::quant

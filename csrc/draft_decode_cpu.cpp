// Fused CPU decode step of the EAGLE3 draft head (batch 1, one token, fp32 or bf16 KV cache).
//
// The step is memory-bound: every weight is read once. All matrix-vector products go through one
// kernel per (instruction set, weight type, layout), compiled with per-function target attributes
// and picked at run time, so the binary runs on any x86-64. The products (with the attention, SwiGLU
// and top-k fused into their loops) run on the extension's one thread team (common/cpu_pool.h), the
// one the target runtime's ops use, so a speculative step never hands over between two teams; the
// O(width) pieces between them (norms, input rounding) run on the calling thread.
//
// Layout decides the speed: NativeDraftDecoder packs every matrix in groups of kPackRows rows stored
// tile by tile, one cache line of each row per tile (draft_decode.h), so each product is one
// sequential stream that the hardware prefetchers follow. Multiplying four row-major rows at once
// instead reads four short streams that restart every row group: in a single-core microbenchmark
// on Zen 4 that read int8 weights at ~0.5x, bf16 at ~0.65x and fp32 at ~0.8-0.9x of a plain
// AVX-512 sum's bandwidth, packed all three at ~0.9x. The module's own fp32 / bf16 weights
// (Eagle3Draft.decode_step, no copies) keep the row-major kernels.
//
// Int8 weights multiply activations quantized to int16 with one fp32 scale per kActBlock columns
// (elsi_fast/draft/quant.py models it): widening int8 -> fp32 costs two instructions per 16
// weights and made the int8 step compute-bound, while int8 x int16 products summed in int32
// (vpdpwssd / vpmaddwd) keep up with memory on one core (~60 GB/s of weights on Zen 4, measured
// from L2). The int16 rounding error (<= 2^-16 of the block's largest magnitude) is far below the
// weights' int8 rounding, so int8 costs no more accuracy than its weights' rounding.
// Bf16 weights multiply inputs rounded to bf16 (as torch's bf16 matmuls do), accumulated in fp32,
// so AVX-512 can use vdpbf16ps: one instruction per 32 weights.

// GCC 12's own AVX-512 intrinsic headers trip -Wmaybe-uninitialized (their "undefined" vectors).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "common/cpu_pool.h"
#include "common/simd.h"
#include "draft_decode.h"

namespace elsi_fast {
namespace {

// Columns sharing one activation scale in int8 products. 256 * 32767 * 128 < 2^31: a block's
// int32 sum cannot overflow.
constexpr int64_t kActBlock = 256;
constexpr float kActLevels = 32767.0f;

// The input vector of a matrix-vector product, in the form the weight type multiplies:
//   fp32 weights: `f`;
//   bf16 weights: `f` rounded to bf16 (as torch's bf16 products round their inputs), and `b` the
//                 same values as bf16 bits (AVX-512 multiplies bf16 pairs with vdpbf16ps);
//   int8 weights: `q` = round(f / q_scale[c / kActBlock]) as int16.
struct GemvInput {
  const float* f;
  const uint16_t* b;
  const int16_t* q;
  const float* q_scale;
};

// out[j] = dot(row row0 + j of w, x) for j < nrows (<= 4); w is [rows, cols] row-major.
using RowDotsFn = void (*)(const void* w, int64_t row0, int nrows, int64_t cols, const GemvInput& x,
                           float* out);

inline float bf16_bits_to_float(uint16_t bits) {
  const uint32_t widened = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &widened, sizeof(value));
  return value;
}

// Round to nearest even, as torch converts fp32 to bf16.
inline uint16_t float_to_bf16_bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);  // NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

inline float to_float(float v) { return v; }
inline float to_float(uint16_t v) { return bf16_bits_to_float(v); }

// ---------------------------------------------------------------- scalar fallback
template <typename T, int NR>
void row_dots_scalar_n(const T* w, int64_t cols, const float* x, float* out) {
  float acc[NR] = {};
  for (int64_t c = 0; c < cols; ++c) {
    const float xc = x[c];
    for (int j = 0; j < NR; ++j) acc[j] += to_float(w[j * cols + c]) * xc;
  }
  for (int j = 0; j < NR; ++j) out[j] = acc[j];
}

template <typename T>
void row_dots_scalar(const void* w, int64_t row0, int nrows, int64_t cols, const GemvInput& x, float* out) {
  const T* rows = static_cast<const T*>(w) + row0 * cols;
  if (nrows == 4) return row_dots_scalar_n<T, 4>(rows, cols, x.f, out);
  for (int j = 0; j < nrows; ++j) row_dots_scalar_n<T, 1>(rows + j * cols, cols, x.f, out + j);
}


// ---------------------------------------------------------------- packed layout (WeightLayout::kPacked)
// One row group: tiles of kPackRows rows x C = pack_cols(sizeof(T)) columns, row j of a tile at
// element offset j * C; x is zero padded to tiles * C. out[j] = dot(row j of the group, x).
using GroupDotsFn = void (*)(const void* w, int64_t tiles, const GemvInput& x, float* out);

static_assert(kPackRows == 4, "the kernels keep one named accumulator per packed row");
constexpr int64_t kInt8Cols = pack_cols(1);
static_assert(kActBlock % kInt8Cols == 0, "an activation block is a whole number of int8 tiles");
constexpr int64_t kTilesPerActBlock = kActBlock / kInt8Cols;

template <typename T>
void group_dots_scalar(const void* w, int64_t tiles, const GemvInput& x, float* out) {
  constexpr int64_t C = pack_cols(sizeof(T));
  const T* p = static_cast<const T*>(w);
  float acc[kPackRows] = {};
  for (int64_t t = 0; t < tiles; ++t, p += kPackRows * C)
    for (int j = 0; j < kPackRows; ++j)
      for (int64_t c = 0; c < C; ++c) acc[j] += to_float(p[j * C + c]) * x.f[t * C + c];
  std::copy(acc, acc + kPackRows, out);
}

// Int8 weights times int16 inputs: exact int32 sums per activation block, then its scale.
void group_dots_i8_scalar(const void* w, int64_t tiles, const GemvInput& x, float* out) {
  const int8_t* p = static_cast<const int8_t*>(w);
  float acc[kPackRows] = {};
  for (int64_t t0 = 0; t0 < tiles; t0 += kTilesPerActBlock) {
    int32_t sums[kPackRows] = {};
    for (int64_t t = t0; t < std::min(tiles, t0 + kTilesPerActBlock); ++t, p += kPackRows * kInt8Cols)
      for (int j = 0; j < kPackRows; ++j)
        for (int64_t c = 0; c < kInt8Cols; ++c)
          sums[j] += static_cast<int32_t>(p[j * kInt8Cols + c]) * x.q[t * kInt8Cols + c];
    for (int j = 0; j < kPackRows; ++j) acc[j] += static_cast<float>(sums[j]) * x.q_scale[t0 / kTilesPerActBlock];
  }
  std::copy(acc, acc + kPackRows, out);
}

// ---------------------------------------------------------------- AVX2 + FMA
ELSI_AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
ELSI_AVX2 inline __m256 load8(const uint16_t* p) {
  // bf16 -> fp32 is a 16-bit left shift of the zero-extended bits.
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
// NR (1 or 4) rows at once with named accumulators: an accumulator array would live on the stack.
template <typename T, int NR>
ELSI_AVX2 void row_dots_avx2_n(const T* w, int64_t cols, const float* x, float* out) {
  static_assert(NR == 1 || NR == 4);
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t c = 0;
  for (; c + 8 <= cols; c += 8) {
    const __m256 xv = _mm256_loadu_ps(x + c);
    a0 = _mm256_fmadd_ps(load8(w + c), xv, a0);
    if constexpr (NR == 4) {
      a1 = _mm256_fmadd_ps(load8(w + cols + c), xv, a1);
      a2 = _mm256_fmadd_ps(load8(w + 2 * cols + c), xv, a2);
      a3 = _mm256_fmadd_ps(load8(w + 3 * cols + c), xv, a3);
    }
  }
  const __m256 acc[4] = {a0, a1, a2, a3};
  for (int j = 0; j < NR; ++j) {
    float sum = simd::hsum8(acc[j]);
    for (int64_t t = c; t < cols; ++t) sum += to_float(w[j * cols + t]) * x[t];
    out[j] = sum;
  }
}

template <typename T>
ELSI_AVX2 void row_dots_avx2(const void* w, int64_t row0, int nrows, int64_t cols, const GemvInput& x,
                             float* out) {
  const T* rows = static_cast<const T*>(w) + row0 * cols;
  if (nrows == 4) return row_dots_avx2_n<T, 4>(rows, cols, x.f, out);
  for (int j = 0; j < nrows; ++j) row_dots_avx2_n<T, 1>(rows + j * cols, cols, x.f, out + j);
}

template <typename T>
ELSI_AVX2 void group_dots_avx2(const void* w, int64_t tiles, const GemvInput& x, float* out) {
  constexpr int64_t C = pack_cols(sizeof(T));
  const T* p = static_cast<const T*>(w);
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t t = 0; t < tiles; ++t, p += kPackRows * C) {
    const float* xt = x.f + t * C;
    for (int64_t c = 0; c < C; c += 8) {
      const __m256 xv = _mm256_loadu_ps(xt + c);
      a0 = _mm256_fmadd_ps(load8(p + c), xv, a0);
      a1 = _mm256_fmadd_ps(load8(p + C + c), xv, a1);
      a2 = _mm256_fmadd_ps(load8(p + 2 * C + c), xv, a2);
      a3 = _mm256_fmadd_ps(load8(p + 3 * C + c), xv, a3);
    }
  }
  out[0] = simd::hsum8(a0), out[1] = simd::hsum8(a1), out[2] = simd::hsum8(a2), out[3] = simd::hsum8(a3);
}

// 16 int8 weights widened to int16 times 16 int16 inputs, pairwise summed into 8 int32 lanes.
ELSI_AVX2 inline __m256i madd16(const int8_t* w, __m256i q16) {
  const __m256i w16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
  return _mm256_madd_epi16(w16, q16);
}

ELSI_AVX2 void group_dots_i8_avx2(const void* w, int64_t tiles, const GemvInput& x, float* out) {
  const int8_t* p = static_cast<const int8_t*>(w);
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t t0 = 0; t0 < tiles; t0 += kTilesPerActBlock) {
    __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0;
    for (int64_t t = t0; t < std::min(tiles, t0 + kTilesPerActBlock); ++t, p += kPackRows * kInt8Cols) {
      for (int64_t c = 0; c < kInt8Cols; c += 16) {
        const __m256i q16 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + t * kInt8Cols + c));
        s0 = _mm256_add_epi32(s0, madd16(p + c, q16));
        s1 = _mm256_add_epi32(s1, madd16(p + kInt8Cols + c, q16));
        s2 = _mm256_add_epi32(s2, madd16(p + 2 * kInt8Cols + c, q16));
        s3 = _mm256_add_epi32(s3, madd16(p + 3 * kInt8Cols + c, q16));
      }
    }
    const __m256 scale = _mm256_set1_ps(x.q_scale[t0 / kTilesPerActBlock]);
    a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), scale, a0);
    a1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), scale, a1);
    a2 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s2), scale, a2);
    a3 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s3), scale, a3);
  }
  out[0] = simd::hsum8(a0), out[1] = simd::hsum8(a1), out[2] = simd::hsum8(a2), out[3] = simd::hsum8(a3);
}

// ---------------------------------------------------------------- AVX-512
ELSI_AVX512 inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }

template <typename T, int NR>
ELSI_AVX512 void row_dots_avx512_n(const T* w, int64_t cols, const float* x, float* out) {
  static_assert(NR == 1 || NR == 4);
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  const __mmask16 all = 0xFFFF;
  int64_t c = 0;
  for (; c + 16 <= cols; c += 16) {
    const __m512 xv = _mm512_loadu_ps(x + c);
    a0 = _mm512_fmadd_ps(load16(w + c, all), xv, a0);
    if constexpr (NR == 4) {
      a1 = _mm512_fmadd_ps(load16(w + cols + c, all), xv, a1);
      a2 = _mm512_fmadd_ps(load16(w + 2 * cols + c, all), xv, a2);
      a3 = _mm512_fmadd_ps(load16(w + 3 * cols + c, all), xv, a3);
    }
  }
  if (c < cols) {  // masked tail: widths that are not a multiple of 16
    const __mmask16 tail = static_cast<__mmask16>((1u << (cols - c)) - 1u);
    const __m512 xv = _mm512_maskz_loadu_ps(tail, x + c);
    a0 = _mm512_fmadd_ps(load16(w + c, tail), xv, a0);
    if constexpr (NR == 4) {
      a1 = _mm512_fmadd_ps(load16(w + cols + c, tail), xv, a1);
      a2 = _mm512_fmadd_ps(load16(w + 2 * cols + c, tail), xv, a2);
      a3 = _mm512_fmadd_ps(load16(w + 3 * cols + c, tail), xv, a3);
    }
  }
  out[0] = _mm512_reduce_add_ps(a0);
  if constexpr (NR == 4) {
    out[1] = _mm512_reduce_add_ps(a1);
    out[2] = _mm512_reduce_add_ps(a2);
    out[3] = _mm512_reduce_add_ps(a3);
  }
}

template <typename T>
ELSI_AVX512 void row_dots_avx512(const void* w, int64_t row0, int nrows, int64_t cols, const GemvInput& x,
                                 float* out) {
  const T* rows = static_cast<const T*>(w) + row0 * cols;
  if (nrows == 4) return row_dots_avx512_n<T, 4>(rows, cols, x.f, out);
  for (int j = 0; j < nrows; ++j) row_dots_avx512_n<T, 1>(rows + j * cols, cols, x.f, out + j);
}

// bf16 weights times bf16 inputs, 32 at a time: vdpbf16ps sums products of bf16 pairs in fp32,
// one instruction where widening each weight to fp32 took three.
template <int NR>
ELSI_AVX512 void row_dots_bf16_avx512_n(const uint16_t* w, int64_t cols, const GemvInput& x, float* out) {
  static_assert(NR == 1 || NR == 4);
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t c = 0; c < cols; c += 32) {
    // masked tail: widths that are not a multiple of 32
    const __mmask32 m = c + 32 <= cols ? ~__mmask32{0} : static_cast<__mmask32>((1u << (cols - c)) - 1u);
    const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(m, x.b + c);
    a0 = _mm512_dpbf16_ps(a0, xv, (__m512bh)_mm512_maskz_loadu_epi16(m, w + c));
    if constexpr (NR == 4) {
      a1 = _mm512_dpbf16_ps(a1, xv, (__m512bh)_mm512_maskz_loadu_epi16(m, w + cols + c));
      a2 = _mm512_dpbf16_ps(a2, xv, (__m512bh)_mm512_maskz_loadu_epi16(m, w + 2 * cols + c));
      a3 = _mm512_dpbf16_ps(a3, xv, (__m512bh)_mm512_maskz_loadu_epi16(m, w + 3 * cols + c));
    }
  }
  out[0] = _mm512_reduce_add_ps(a0);
  if constexpr (NR == 4) {
    out[1] = _mm512_reduce_add_ps(a1);
    out[2] = _mm512_reduce_add_ps(a2);
    out[3] = _mm512_reduce_add_ps(a3);
  }
}

ELSI_AVX512 void row_dots_bf16_avx512(const void* w, int64_t row0, int nrows, int64_t cols, const GemvInput& x,
                                      float* out) {
  const uint16_t* rows = static_cast<const uint16_t*>(w) + row0 * cols;
  if (nrows == 4) return row_dots_bf16_avx512_n<4>(rows, cols, x, out);
  for (int j = 0; j < nrows; ++j) row_dots_bf16_avx512_n<1>(rows + j * cols, cols, x, out + j);
}

ELSI_AVX512 void group_dots_f32_avx512(const void* w, int64_t tiles, const GemvInput& x, float* out) {
  constexpr int64_t C = pack_cols(sizeof(float));
  static_assert(C == 16);
  const float* p = static_cast<const float*>(w);
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t t = 0; t < tiles; ++t, p += kPackRows * C) {
    const __m512 xv = _mm512_loadu_ps(x.f + t * C);
    a0 = _mm512_fmadd_ps(_mm512_loadu_ps(p), xv, a0);
    a1 = _mm512_fmadd_ps(_mm512_loadu_ps(p + C), xv, a1);
    a2 = _mm512_fmadd_ps(_mm512_loadu_ps(p + 2 * C), xv, a2);
    a3 = _mm512_fmadd_ps(_mm512_loadu_ps(p + 3 * C), xv, a3);
  }
  out[0] = _mm512_reduce_add_ps(a0), out[1] = _mm512_reduce_add_ps(a1);
  out[2] = _mm512_reduce_add_ps(a2), out[3] = _mm512_reduce_add_ps(a3);
}

ELSI_AVX512 inline __m512 dpbf16(__m512 acc, __m512bh x, const uint16_t* w) {
  return _mm512_dpbf16_ps(acc, x, (__m512bh)_mm512_loadu_si512(w));
}

ELSI_AVX512 void group_dots_bf16_avx512(const void* w, int64_t tiles, const GemvInput& x, float* out) {
  constexpr int64_t C = pack_cols(sizeof(uint16_t));
  static_assert(C == 32);
  const uint16_t* p = static_cast<const uint16_t*>(w);
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t t = 0; t < tiles; ++t, p += kPackRows * C) {
    const __m512bh xv = (__m512bh)_mm512_loadu_si512(x.b + t * C);
    a0 = dpbf16(a0, xv, p);
    a1 = dpbf16(a1, xv, p + C);
    a2 = dpbf16(a2, xv, p + 2 * C);
    a3 = dpbf16(a3, xv, p + 3 * C);
  }
  out[0] = _mm512_reduce_add_ps(a0), out[1] = _mm512_reduce_add_ps(a1);
  out[2] = _mm512_reduce_add_ps(a2), out[3] = _mm512_reduce_add_ps(a3);
}

// 32 int8 weights widened to int16 times 32 int16 inputs, pairwise summed into 16 int32 lanes.
ELSI_AVX512 inline __m512i dpw32(__m512i acc, const int8_t* w, __m512i q16) {
  return _mm512_dpwssd_epi32(acc, q16, _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w))));
}

ELSI_AVX512 void group_dots_i8_avx512(const void* w, int64_t tiles, const GemvInput& x, float* out) {
  const int8_t* p = static_cast<const int8_t*>(w);
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t t0 = 0; t0 < tiles; t0 += kTilesPerActBlock) {
    __m512i s0 = _mm512_setzero_si512(), s1 = s0, s2 = s0, s3 = s0;
    for (int64_t t = t0; t < std::min(tiles, t0 + kTilesPerActBlock); ++t, p += kPackRows * kInt8Cols) {
      for (int64_t c = 0; c < kInt8Cols; c += 32) {
        const __m512i q16 = _mm512_loadu_si512(x.q + t * kInt8Cols + c);
        s0 = dpw32(s0, p + c, q16);
        s1 = dpw32(s1, p + kInt8Cols + c, q16);
        s2 = dpw32(s2, p + 2 * kInt8Cols + c, q16);
        s3 = dpw32(s3, p + 3 * kInt8Cols + c, q16);
      }
    }
    const __m512 scale = _mm512_set1_ps(x.q_scale[t0 / kTilesPerActBlock]);
    a0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0), scale, a0);
    a1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1), scale, a1);
    a2 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s2), scale, a2);
    a3 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s3), scale, a3);
  }
  out[0] = _mm512_reduce_add_ps(a0), out[1] = _mm512_reduce_add_ps(a1);
  out[2] = _mm512_reduce_add_ps(a2), out[3] = _mm512_reduce_add_ps(a3);
}

// ---------------------------------------------------------------- dispatch
// Row-major kernels (fp32, bf16: the module's own weights) and packed ones (fp32, bf16, int8).
struct IsaKernels {
  const char* name;
  RowDotsFn f32, bf16;
  GroupDotsFn packed_f32, packed_bf16, packed_i8;
};

const IsaKernels kScalar{"scalar", row_dots_scalar<float>, row_dots_scalar<uint16_t>, group_dots_scalar<float>,
                         group_dots_scalar<uint16_t>, group_dots_i8_scalar};
const IsaKernels kAvx2{"avx2", row_dots_avx2<float>, row_dots_avx2<uint16_t>, group_dots_avx2<float>,
                       group_dots_avx2<uint16_t>, group_dots_i8_avx2};
const IsaKernels kAvx512{"avx512", row_dots_avx512<float>, row_dots_bf16_avx512, group_dots_f32_avx512,
                         group_dots_bf16_avx512, group_dots_i8_avx512};

// "avx512" includes VNNI (vpdpwssd, int8 products) and BF16 (vdpbf16ps): Sapphire Rapids, Cooper
// Lake, Zen 4 and later; older AVX-512 CPUs take the AVX2 kernels.
bool cpu_has(const char* isa) {
  __builtin_cpu_init();
  if (std::strcmp(isa, "avx512") == 0)
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bf16") &&
           __builtin_cpu_supports("fma");
  if (std::strcmp(isa, "avx2") == 0)
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  return std::strcmp(isa, "scalar") == 0;
}

const IsaKernels* best_kernels() {
  if (cpu_has("avx512")) return &kAvx512;
  if (cpu_has("avx2")) return &kAvx2;
  return &kScalar;
}

const IsaKernels*& active_kernels() {
  static const IsaKernels* active = best_kernels();
  return active;
}

// The kernel of every product of a step: weight layout, element size and function.
struct Products {
  WeightLayout layout;
  int64_t elem_bytes;
  RowDotsFn rows;      // row-major
  GroupDotsFn groups;  // packed
};

Products products_for(const DraftWeights& w) {
  const IsaKernels* k = active_kernels();
  switch (w.weight_type) {
    case WeightType::kBFloat16: return {w.layout, 2, k->bf16, k->packed_bf16};
    case WeightType::kInt8: return {w.layout, 1, nullptr, k->packed_i8};
    default: return {w.layout, 4, k->f32, k->packed_f32};
  }
}

// ---------------------------------------------------------------- fused pieces
constexpr int64_t kRowBlock = 4;
// Weight-streaming loops hand out chunks of this many rows on demand rather than one static slice
// per thread: on a shared or oversubscribed CPU a preempted thread then delays its team by one chunk
// (~0.1-0.3 MB of weights), not by its whole slice.
constexpr int64_t kChunkRows = 64;

// The vectors a step multiplies, in the form its weight type multiplies (bf16 rounding, int16
// quantization, see GemvInput): the calling thread converts each before the product's loop, and
// every work item reads the shared buffers. They are zero beyond the vector, up to the packed
// tiles' padded width.
class ProductInput {
 public:
  ProductInput(WeightType type, int64_t max_width)
      : type_(type),
        f_(padded(max_width)),
        bits_(type == WeightType::kBFloat16 ? f_.size() : 0),
        q_(type == WeightType::kInt8 ? f_.size() : 0),
        scale_(type == WeightType::kInt8 ? (max_width + kActBlock - 1) / kActBlock : 0) {}

  GemvInput of(const float* x, int64_t n) {
    const int64_t end = padded(n);
    if (type_ == WeightType::kInt8) {
      quantize(x, n);
      std::fill(q_.begin() + n, q_.begin() + end, int16_t{0});
      return {x, nullptr, q_.data(), scale_.data()};
    }
    if (type_ == WeightType::kBFloat16) {
      for (int64_t i = 0; i < n; ++i) {
        bits_[i] = float_to_bf16_bits(x[i]);
        f_[i] = bf16_bits_to_float(bits_[i]);
      }
      std::fill(bits_.begin() + n, bits_.begin() + end, uint16_t{0});
    } else {
      std::copy(x, x + n, f_.begin());
    }
    std::fill(f_.begin() + n, f_.begin() + end, 0.f);
    return {f_.data(), bits_.data(), nullptr, nullptr};
  }

 private:
  // The widest tile row (int8) bounds every type's padding.
  static int64_t padded(int64_t n) { return (n + kInt8Cols - 1) / kInt8Cols * kInt8Cols; }

  // q = round_half_even(x * 32767 / amax) per block, scale = amax / 32767, as quant.py models it.
  void quantize(const float* x, int64_t n) {
    for (int64_t c0 = 0; c0 < n; c0 += kActBlock) {
      const int64_t c1 = std::min(n, c0 + kActBlock);
      float amax = 0.f;
      bool finite = true;
      for (int64_t c = c0; c < c1; ++c) {
        const float a = std::fabs(x[c]);
        finite = finite && a <= std::numeric_limits<float>::max();
        amax = std::max(amax, a);
      }
      float& scale = scale_[c0 / kActBlock];
      if (!finite) {  // a NaN or infinite input makes the block's products NaN, as in the fp32 path
        scale = std::numeric_limits<float>::quiet_NaN();
        std::fill(q_.begin() + c0, q_.begin() + c1, int16_t{0});
        continue;
      }
      scale = amax / kActLevels;
      const float inv = amax > 0.f ? kActLevels / amax : 0.f;
      for (int64_t c = c0; c < c1; ++c) q_[c] = static_cast<int16_t>(std::nearbyint(x[c] * inv));
    }
  }

  const WeightType type_;
  std::vector<float> f_;
  std::vector<uint16_t> bits_;
  std::vector<int16_t> q_;
  std::vector<float> scale_;
};

// out[r - begin] = scale[r] * dot(row r of w, x) for rows [begin, end) (scale null: no scaling).
void dot_rows(const Products& p, const void* w, const float* scale, int64_t begin, int64_t end, int64_t cols,
              const GemvInput& x, float* out) {
  if (p.layout == WeightLayout::kRowMajor) {
    for (int64_t r0 = begin; r0 < end; r0 += kRowBlock) {
      const int nr = static_cast<int>(std::min(kRowBlock, end - r0));
      p.rows(w, r0, nr, cols, x, out + (r0 - begin));
    }
  } else {
    // Whole row groups; a range that starts or ends inside one (q/k/v rows of a KV group whose
    // width is not a multiple of kPackRows) computes that group and keeps its rows in range.
    const int64_t tile_cols = pack_cols(p.elem_bytes);
    const int64_t tiles = (cols + tile_cols - 1) / tile_cols;
    const int64_t group_bytes = tiles * kPackRows * kPackRowBytes;
    for (int64_t g = begin / kPackRows; g * kPackRows < end; ++g) {
      float sums[kPackRows];
      p.groups(static_cast<const char*>(w) + g * group_bytes, tiles, x, sums);
      const int64_t r0 = std::max(begin, g * kPackRows), r1 = std::min(end, (g + 1) * kPackRows);
      for (int64_t r = r0; r < r1; ++r) out[r - begin] = sums[r - g * kPackRows];
    }
  }
  if (scale)
    for (int64_t r = begin; r < end; ++r) out[r - begin] *= scale[r];
}

// out[r] = scale[r] * dot(W[r], x) + residual[r] (residual optional), one work item per chunk of rows.
struct GemvPart {
  const void* w;
  const float* scale;
  int64_t rows;
  const float* residual;
  float* out;
};

void gemv(int threads, const Products& dots, const GemvPart& part, int64_t cols, const GemvInput& x) {
  auto chunk_rows = [&](int64_t chunk) {
    const int64_t r0 = chunk * kChunkRows, r1 = std::min(part.rows, r0 + kChunkRows);
    dot_rows(dots, part.w, part.scale, r0, r1, cols, x, part.out + r0);
    if (part.residual)
      for (int64_t r = r0; r < r1; ++r) part.out[r] += part.residual[r];
  };
  parallel_for(threads, (part.rows + kChunkRows - 1) / kChunkRows, chunk_rows);
}

// act[i] = silu(gate_i . x) * (up_i . x), both products of a chunk in the same iteration.
void swiglu(int threads, const Products& dots, const DraftWeights& w, int64_t inter, int64_t cols, const GemvInput& x,
            float* act) {
  auto chunk_rows = [&](int64_t chunk) {
    const int64_t i0 = chunk * kChunkRows, i1 = std::min(inter, i0 + kChunkRows);
    float gate[kChunkRows], up[kChunkRows];
    dot_rows(dots, w.matrix[kGate], w.scale[kGate], i0, i1, cols, x, gate);
    dot_rows(dots, w.matrix[kUp], w.scale[kUp], i0, i1, cols, x, up);
    for (int64_t i = 0; i < i1 - i0; ++i) act[i0 + i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
  };
  parallel_for(threads, (inter + kChunkRows - 1) / kChunkRows, chunk_rows);
}

inline void store(float* dst, float v) { *dst = v; }
inline void store(uint16_t* dst, float v) { *dst = float_to_bf16_bits(v); }

template <typename T>
void rms_norm(const T* x, const float* weight, int64_t n, float eps, float* out) {
  double sum_sq = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const double v = to_float(x[i]);
    sum_sq += v * v;
  }
  const float inv = 1.0f / std::sqrt(static_cast<float>(sum_sq / n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = weight[i] * (to_float(x[i]) * inv);
}

void rms_norm_act(ActType type, const void* x, const float* weight, int64_t n, float eps, float* out) {
  if (type == ActType::kBFloat16)
    rms_norm(static_cast<const uint16_t*>(x), weight, n, eps, out);
  else
    rms_norm(static_cast<const float*>(x), weight, n, eps, out);
}

// Rotate-half RoPE of one head: pairs (i, i + half) turn by angle i.
void apply_rope(float* v, const float* cos, const float* sin, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = v[i], x2 = v[i + half];
    v[i] = x1 * cos[i] - x2 * sin[i];
    v[i + half] = x2 * cos[i] + x1 * sin[i];
  }
}

// Softmax attention of query head `head` over cache slots [0, ctx) of its KV head; writes out[hd].
template <typename C>
void attend_head(const float* q, const C* keys, const C* values, int64_t ctx, int64_t hd, float scale,
                 float* scores, float* out) {
  float max_s = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < ctx; ++t) {
    const C* key = keys + t * hd;
    float dot = 0.f;
#pragma omp simd reduction(+ : dot)
    for (int64_t i = 0; i < hd; ++i) dot += q[i] * to_float(key[i]);
    scores[t] = dot * scale;
    max_s = std::max(max_s, scores[t]);
  }
  float denom = 0.f;
  for (int64_t t = 0; t < ctx; ++t) {
    scores[t] = std::exp(scores[t] - max_s);
    denom += scores[t];
  }
  std::fill(out, out + hd, 0.f);
  for (int64_t t = 0; t < ctx; ++t) {
    const C* value = values + t * hd;
    const float p = scores[t] / denom;
#pragma omp simd
    for (int64_t i = 0; i < hd; ++i) out[i] += p * to_float(value[i]);
  }
}

// RoPE of KV head `kv`'s new key (qkv: q heads, then k heads, then v heads) and its key and value
// into cache slot step.position.
template <typename C>
void append_kv(const DraftDims& dims, const DraftStep& step, const float* rope, int64_t kv, float* qkv) {
  const int64_t hd = dims.head_dim, nh = dims.num_heads, nkv = dims.num_kv_heads;
  float* new_k = qkv + (nh + kv) * hd;
  const float* new_v = qkv + (nh + nkv + kv) * hd;
  apply_rope(new_k, rope, rope + hd / 2, hd / 2);
  C* keys = static_cast<C*>(step.k_cache) + (kv * dims.max_len + step.position) * hd;
  C* values = static_cast<C*>(step.v_cache) + (kv * dims.max_len + step.position) * hd;
  for (int64_t i = 0; i < hd; ++i) {
    store(keys + i, new_k[i]);
    store(values + i, new_v[i]);
  }
}

// RoPE, cache append and attention of KV head `kv` and its group of query heads.
template <typename C>
void attend_group(const DraftDims& dims, const DraftStep& step, const float* rope, int64_t kv, float* qkv,
                  float* scores, float* attn) {
  const int64_t hd = dims.head_dim, half = hd / 2, nh = dims.num_heads, nkv = dims.num_kv_heads;
  const int64_t ctx = step.position + 1, group = nh / nkv;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  append_kv<C>(dims, step, rope, kv, qkv);
  const C* keys = static_cast<const C*>(step.k_cache) + kv * dims.max_len * hd;
  const C* values = static_cast<const C*>(step.v_cache) + kv * dims.max_len * hd;
  for (int64_t head = kv * group; head < (kv + 1) * group; ++head) {
    apply_rope(qkv + head * hd, rope, rope + half, half);
    attend_head(qkv + head * hd, keys, values, ctx, hd, scale, scores + head * ctx, attn + head * hd);
  }
}

// Rows of q/k/v one KV group needs: its `group` query heads, its key head, its value head.
int64_t group_rows(const DraftDims& dims) {
  return (dims.num_heads / dims.num_kv_heads + 2) * dims.head_dim;
}

int64_t group_chunks(const DraftDims& dims) { return (group_rows(dims) + kChunkRows - 1) / kChunkRows; }

// q/k/v products and attention in one job: the work items are chunks of one KV group's rows, and
// whoever finishes a group's last chunk (chunks_left[kv] reaching zero) attends for that group.
// qkv holds q heads, then k heads, then v heads.
template <typename C>
void qkv_attention(int threads, const Products& dots, const DraftWeights& w, const DraftDims& dims, const DraftStep& step,
                   const float* rope, const GemvInput& x, std::atomic<int64_t>* chunks_left, float* qkv,
                   float* scores, float* attn) {
  const int64_t hd = dims.head_dim, nh = dims.num_heads, nkv = dims.num_kv_heads, group = nh / nkv;
  const int64_t rows = group_rows(dims), chunks = group_chunks(dims);
  // a group's local rows: [0, group hd) of q, then hd of k, then hd of v
  const int64_t bounds[4] = {0, group * hd, (group + 1) * hd, rows};
  const Matrix matrices[3] = {kQ, kK, kV};
  auto chunk_rows = [&](int64_t item) {
    const int64_t kv = item / chunks, r0 = (item % chunks) * kChunkRows, r1 = std::min(rows, r0 + kChunkRows);
    const int64_t first_row[3] = {kv * group * hd, kv * hd, kv * hd};
    float* const out[3] = {qkv + first_row[0], qkv + nh * hd + first_row[1], qkv + (nh + nkv) * hd + first_row[2]};
    for (int m = 0; m < 3; ++m) {
      const int64_t lo = std::max(r0, bounds[m]) - bounds[m], hi = std::min(r1, bounds[m + 1]) - bounds[m];
      if (lo < hi)
        dot_rows(dots, w.matrix[matrices[m]], w.scale[matrices[m]], first_row[m] + lo, first_row[m] + hi,
                 2 * dims.hidden, x, out[m] + lo);
    }
    if (chunks_left[kv].fetch_sub(1, std::memory_order_acq_rel) == 1)
      attend_group<C>(dims, step, rope, kv, qkv, scores, attn);
  };
  parallel_for(threads, nkv * chunks, chunk_rows);
}

struct Candidate {
  float logit;
  int64_t id;
};

// Higher logit first; equal logits resolve to the lower id so the result is deterministic.
inline bool better(const Candidate& a, const Candidate& b) {
  return a.logit > b.logit || (a.logit == b.logit && a.id < b.id);
}

// Keeps the k best candidates seen so far in top[0..count), sorted best first.
void push_top_k(Candidate* top, int64_t& count, int64_t k, Candidate c) {
  if (count == k && !better(c, top[k - 1])) return;
  int64_t pos = count < k ? count++ : k - 1;
  while (pos > 0 && better(c, top[pos - 1])) {
    top[pos] = top[pos - 1];
    --pos;
  }
  top[pos] = c;
}

}  // namespace

const char* cpu_isa() { return active_kernels()->name; }

bool set_cpu_isa(const char* name) {
  if (!cpu_has(name)) return false;
  active_kernels() = std::strcmp(name, "avx512") == 0 ? &kAvx512
                     : std::strcmp(name, "avx2") == 0 ? &kAvx2
                                                        : &kScalar;
  return true;
}

void draft_decode_step_cpu(const DraftDims& dims, const DraftWeights& w, const DraftStep& step,
                           int num_threads) {
  const int64_t d = dims.hidden, hd = dims.head_dim, half = hd / 2;
  const int64_t nh = dims.num_heads, nkv = dims.num_kv_heads;
  const int64_t q_width = nh * hd, kv_width = nkv * hd, k = step.top_k;
  const Products dots = products_for(w);
  const int64_t input_width = step.from_target ? dims.fc_in : d;
  const int64_t widest_input = std::max({input_width, 2 * d, q_width, dims.intermediate});

  const int threads = std::max(1, num_threads);
  std::vector<float> input(input_width), h(d), x2(2 * d), normed(d), qkv(q_width + 2 * kv_width), attn(q_width),
      h1(d), h2(d), act(dims.intermediate), scores(nh * (step.position + 1)), rope(hd);
  ProductInput in(w.weight_type, widest_input);
  // lm_head keeps the best min(k, kChunkRows) candidates of each chunk, merged below: the draft-vocab
  // logits never leave its loop, and the merged top-k does not depend on which thread ran a chunk.
  const int64_t lm_chunks = (dims.draft_vocab + kChunkRows - 1) / kChunkRows, chunk_k = std::min(k, kChunkRows);
  std::vector<Candidate> candidates(static_cast<size_t>(lm_chunks * chunk_k));
  std::vector<int64_t> candidate_counts(lm_chunks, 0);
  std::unique_ptr<std::atomic<int64_t>[]> chunks_left(new std::atomic<int64_t>[nkv]);
  for (int64_t kv = 0; kv < nkv; ++kv) chunks_left[kv].store(group_chunks(dims), std::memory_order_relaxed);
  // Same fp32 product as the torch reference: angle = float(position) * inv_freq.
  for (int64_t i = 0; i < half; ++i) {
    const float angle = static_cast<float>(step.position) * w.inv_freq[i];
    rope[i] = std::cos(angle);
    rope[half + i] = std::sin(angle);
  }
  for (int64_t i = 0; i < input_width; ++i)
    input[i] = step.input_type == ActType::kBFloat16
                   ? bf16_bits_to_float(static_cast<const uint16_t*>(step.input)[i])
                   : static_cast<const float*>(step.input)[i];

  if (step.from_target)
    gemv(threads, dots, {w.matrix[kFc], w.scale[kFc], d, nullptr, h.data()}, dims.fc_in,
         in.of(input.data(), dims.fc_in));
  const float* hidden_in = step.from_target ? h.data() : input.data();

  // x = [input_layernorm(embed(token)), hidden_norm(h)]: embedding first
  const size_t row = static_cast<size_t>(step.token * d) * (w.embed_type == ActType::kBFloat16 ? 2 : 4);
  rms_norm_act(w.embed_type, static_cast<const char*>(w.embed) + row, w.norms + d, d, dims.eps, x2.data());
  rms_norm(hidden_in, w.norms, d, dims.eps, x2.data() + d);
  const GemvInput x2_in = in.of(x2.data(), 2 * d);
  if (k == 0) {  // cache only (DraftStep::top_k): the position's key and value, nothing that reads them
    gemv(threads, dots, {w.matrix[kK], w.scale[kK], kv_width, nullptr, qkv.data() + q_width}, 2 * d, x2_in);
    gemv(threads, dots, {w.matrix[kV], w.scale[kV], kv_width, nullptr, qkv.data() + q_width + kv_width}, 2 * d, x2_in);
    for (int64_t kv = 0; kv < nkv; ++kv)
      step.cache_type == ActType::kBFloat16 ? append_kv<uint16_t>(dims, step, rope.data(), kv, qkv.data())
                                            : append_kv<float>(dims, step, rope.data(), kv, qkv.data());
    return;
  }
  if (step.cache_type == ActType::kBFloat16)
    qkv_attention<uint16_t>(threads, dots, w, dims, step, rope.data(), x2_in, chunks_left.get(), qkv.data(),
                            scores.data(), attn.data());
  else
    qkv_attention<float>(threads, dots, w, dims, step, rope.data(), x2_in, chunks_left.get(), qkv.data(),
                         scores.data(), attn.data());

  gemv(threads, dots, {w.matrix[kO], w.scale[kO], d, hidden_in, h1.data()}, q_width, in.of(attn.data(), q_width));
  rms_norm(h1.data(), w.norms + 2 * d, d, dims.eps, normed.data());
  swiglu(threads, dots, w, dims.intermediate, d, in.of(normed.data(), d), act.data());
  gemv(threads, dots, {w.matrix[kDown], w.scale[kDown], d, h1.data(), h2.data()}, dims.intermediate,
       in.of(act.data(), dims.intermediate));
  rms_norm(h2.data(), w.norms + 3 * d, d, dims.eps, normed.data());

  const GemvInput lm_in = in.of(normed.data(), d);
  auto lm_head_chunk = [&](int64_t chunk) {
    const int64_t r0 = chunk * kChunkRows, r1 = std::min(dims.draft_vocab, r0 + kChunkRows);
    float logits[kChunkRows];
    dot_rows(dots, w.matrix[kLmHead], w.scale[kLmHead], r0, r1, d, lm_in, logits);
    Candidate* best = candidates.data() + chunk * chunk_k;
    for (int64_t r = r0; r < r1; ++r)
      push_top_k(best, candidate_counts[chunk], chunk_k, Candidate{logits[r - r0], r});
  };
  parallel_for(threads, lm_chunks, lm_head_chunk);

  std::vector<Candidate> merged(k);
  int64_t merged_count = 0;
  for (int64_t c = 0; c < lm_chunks; ++c)
    for (int64_t i = 0; i < candidate_counts[c]; ++i)
      push_top_k(merged.data(), merged_count, k, candidates[c * chunk_k + i]);
  for (int64_t i = 0; i < k; ++i) step.out_ids[i] = merged[i].id + w.d2t[merged[i].id];
  for (int64_t i = 0; i < d; ++i) {
    if (step.input_type == ActType::kBFloat16)
      store(static_cast<uint16_t*>(step.out_hidden) + i, h2[i]);
    else
      store(static_cast<float*>(step.out_hidden) + i, h2[i]);
  }
}

}  // namespace elsi_fast

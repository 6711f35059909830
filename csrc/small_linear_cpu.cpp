// CPU kernels of the small-batch linear op (target_runtime.h).
//
// A decode or verify forward at batch 1 multiplies 1..8 rows by every weight matrix once: it is
// memory-bound, so the kernel reads each packed row group once from memory for all rows. Rows are
// taken `block` at a time (as many as the registers hold accumulators for: 4 weight rows x block
// x-rows), segment by segment, so with more rows than a block a segment's later passes read it
// again from L1, not from memory. Every accumulator sees the same sequence of FMAs whatever the
// block size, which is why a row's result does not depend on how many rows share the call.
//
// bf16 weights are widened in registers (a 32-bit lane holds two, a shift and a mask make them
// fp32) and multiply the fp32 input: half the bytes of fp32 weights, the input not rounded. int8
// weights (per-row scales) are widened to fp32 too. The products then cost the same FMAs per weight
// in every type, about 2 per ns on one Zen 3 core with AVX2 (the loads bound them): at 5 rows that
// is as long as reading fp32 weights from memory, and twice as long as reading bf16 ones, so bf16
// and int8 stop being memory-bound from about 3 rows on one core.

// GCC 12's own AVX-512 intrinsic headers trip -Wmaybe-uninitialized (their "undefined" vectors).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "target_runtime.h"

namespace elsi_fast {
namespace {

constexpr int kRows = static_cast<int>(kPackRows);
static_assert(kRows == 4, "the kernels keep kRows accumulators per x row");
constexpr int kMaxBlock = 4;
constexpr int64_t kTileBytes = kRows * kPackRowBytes;  // one line per row
// A row group is multiplied segment by segment, every block of x rows in turn over each segment, so
// the weights stream in without pause: whole-group passes (9-25 kB here) left the memory idle during
// the later passes, and a 5-row product cost the 1-row time plus its compute. 16 tiles = 4 kB.
constexpr int64_t kSegmentTiles = 16;
// Software prefetch distance along the packed stream, issued by each segment's first pass.
constexpr int64_t kPrefetchBytes = 8 << 10;

enum PassFlags : int { kFirst = 1, kLast = 2, kPrefetch = 4 };

// One pass: x rows m < block (`stride` floats apart, in the layout the ISA's PrepFn wrote) times the
// kRows weight rows of one segment of `tiles` tiles. The block x kRows accumulators start at zero
// (kFirst) or from `state`, and go back to `state`, or with kLast are reduced to
// out[m * kRows + j]. kPrefetch: prefetch the stream kPrefetchBytes ahead.
using PassFn = void (*)(const void* w, int64_t tiles, const float* x, int64_t stride, int flags, float* state,
                        float* out);
// One x row into the layout an ISA's kernels read, zero padded from `cols` to `padded` columns.
using PrepFn = void (*)(const float* x, int64_t cols, int64_t padded, float* out);

inline float widen(float v) { return v; }
inline float widen(int8_t v) { return static_cast<float>(v); }
inline float widen(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float v;
  std::memcpy(&v, &wide, sizeof(v));
  return v;
}

// Column (within its tile) of the q-th element of a packed tile row: bf16 pairs columns i, i + 8
// of every 16-column block (target_runtime.h).
template <typename T>
constexpr int64_t tile_column(int64_t q) {
  if constexpr (std::is_same_v<T, uint16_t>) return q / 16 * 16 + q % 16 / 2 + 8 * (q % 2);
  return q;
}

void prep_natural(const float* x, int64_t cols, int64_t padded, float* out) {
  std::copy(x, x + cols, out);
  std::fill(out + cols, out + padded, 0.f);
}

inline void prefetch_ahead(const void* tile) {
  const char* ahead = static_cast<const char*>(tile) + kPrefetchBytes;
  for (int64_t line = 0; line < kTileBytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_NTA);
}

// Keeps v in a register: otherwise GCC folds a load into every FMA that uses it and loads one weight
// vector once per x row; loads (about one 32-byte load a cycle here), not FMAs, bound these loops.
template <typename V>
inline void in_register(V& v) {
  __asm__("" : "+x"(v));
}

// ---------------------------------------------------------------- scalar fallback (block 1)
template <typename T>
void pass_scalar(const void* w, int64_t tiles, const float* x, int64_t, int flags, float* state, float* out) {
  constexpr int64_t C = pack_cols(sizeof(T));
  const T* p = static_cast<const T*>(w);
  float acc[kRows];
  for (int j = 0; j < kRows; ++j) acc[j] = flags & kFirst ? 0.f : state[j];
  for (int64_t t = 0; t < tiles; ++t, p += kRows * C)
    for (int j = 0; j < kRows; ++j)
      for (int64_t q = 0; q < C; ++q) acc[j] += widen(p[j * C + q]) * x[t * C + tile_column<T>(q)];
  std::copy(acc, acc + kRows, flags & kLast ? out : state);
}

// ---------------------------------------------------------------- AVX2 + FMA
// Accumulator arrays are indexed by loop counters that full unrolling turns into constants, so they
// live in registers.
template <int B>
ELSI_AVX2 inline void begin8(__m256 (&acc)[B][kRows], int flags, const float* state) {
#pragma GCC unroll 16
  for (int m = 0; m < B; ++m)
#pragma GCC unroll 4
    for (int j = 0; j < kRows; ++j)
      acc[m][j] = flags & kFirst ? _mm256_setzero_ps() : _mm256_load_ps(state + (m * kRows + j) * 8);
}

template <int B>
ELSI_AVX2 inline void end8(__m256 (&acc)[B][kRows], int flags, float* state, float* out) {
#pragma GCC unroll 16
  for (int m = 0; m < B; ++m)
#pragma GCC unroll 4
    for (int j = 0; j < kRows; ++j) {
      if (flags & kLast)
        out[m * kRows + j] = simd::hsum8(acc[m][j]);
      else
        _mm256_store_ps(state + (m * kRows + j) * 8, acc[m][j]);
    }
}

template <int B>
ELSI_AVX2 void pass_f32_avx2(const void* w, int64_t tiles, const float* x, int64_t stride, int flags, float* state,
                             float* out) {
  const float* p = static_cast<const float*>(w);
  __m256 acc[B][kRows];
  begin8<B>(acc, flags, state);
  for (int64_t t = 0; t < tiles; ++t, p += kRows * 16) {
    if (flags & kPrefetch) prefetch_ahead(p);
#pragma GCC unroll 2
    for (int h = 0; h < 16; h += 8) {
      __m256 xv[B];
#pragma GCC unroll 4
      for (int m = 0; m < B; ++m) {
        xv[m] = _mm256_loadu_ps(x + m * stride + t * 16 + h);
        in_register(xv[m]);
      }
#pragma GCC unroll 4
      for (int j = 0; j < kRows; ++j) {
        __m256 wj = _mm256_loadu_ps(p + j * 16 + h);
        in_register(wj);
#pragma GCC unroll 4
        for (int m = 0; m < B; ++m) acc[m][j] = _mm256_fmadd_ps(wj, xv[m], acc[m][j]);
      }
    }
  }
  end8<B>(acc, flags, state, out);
}

template <int B>
ELSI_AVX2 void pass_bf16_avx2(const void* w, int64_t tiles, const float* x, int64_t stride, int flags, float* state,
                              float* out) {
  const uint16_t* p = static_cast<const uint16_t*>(w);
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m256 acc[B][kRows];
  begin8<B>(acc, flags, state);
  for (int64_t t = 0; t < tiles; ++t, p += kRows * 32) {
    if (flags & kPrefetch) prefetch_ahead(p);
#pragma GCC unroll 2
    for (int64_t b = 0; b < 32; b += 16) {
      __m256 xlo[B], xhi[B];
#pragma GCC unroll 4
      for (int m = 0; m < B; ++m) {
        xlo[m] = _mm256_loadu_ps(x + m * stride + t * 32 + b);
        xhi[m] = _mm256_loadu_ps(x + m * stride + t * 32 + b + 8);
        in_register(xlo[m]);
        in_register(xhi[m]);
      }
#pragma GCC unroll 4
      for (int j = 0; j < kRows; ++j) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + j * 32 + b));
        const __m256 lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));  // columns b .. b+7
        const __m256 hi = _mm256_castsi256_ps(_mm256_and_si256(v, high));  // columns b+8 .. b+15
#pragma GCC unroll 4
        for (int m = 0; m < B; ++m) {
          acc[m][j] = _mm256_fmadd_ps(lo, xlo[m], acc[m][j]);
          acc[m][j] = _mm256_fmadd_ps(hi, xhi[m], acc[m][j]);
        }
      }
    }
  }
  end8<B>(acc, flags, state, out);
}

template <int B>
ELSI_AVX2 void pass_i8_avx2(const void* w, int64_t tiles, const float* x, int64_t stride, int flags, float* state,
                            float* out) {
  const int8_t* p = static_cast<const int8_t*>(w);
  __m256 acc[B][kRows];
  begin8<B>(acc, flags, state);
  for (int64_t t = 0; t < tiles; ++t, p += kRows * 64) {
    if (flags & kPrefetch) prefetch_ahead(p);
#pragma GCC unroll 8
    for (int64_t c = 0; c < 64; c += 8) {
      __m256 xv[B];
#pragma GCC unroll 4
      for (int m = 0; m < B; ++m) {
        xv[m] = _mm256_loadu_ps(x + m * stride + t * 64 + c);
        in_register(xv[m]);
      }
#pragma GCC unroll 4
      for (int j = 0; j < kRows; ++j) {
        const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + j * 64 + c));
        const __m256 wj = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
#pragma GCC unroll 4
        for (int m = 0; m < B; ++m) acc[m][j] = _mm256_fmadd_ps(wj, xv[m], acc[m][j]);
      }
    }
  }
  end8<B>(acc, flags, state, out);
}

// ---------------------------------------------------------------- AVX-512
template <int B>
ELSI_AVX512 inline void begin16(__m512 (&acc)[B][kRows], int flags, const float* state) {
#pragma GCC unroll 16
  for (int m = 0; m < B; ++m)
#pragma GCC unroll 4
    for (int j = 0; j < kRows; ++j)
      acc[m][j] = flags & kFirst ? _mm512_setzero_ps() : _mm512_load_ps(state + (m * kRows + j) * 16);
}

template <int B>
ELSI_AVX512 inline void end16(__m512 (&acc)[B][kRows], int flags, float* state, float* out) {
#pragma GCC unroll 16
  for (int m = 0; m < B; ++m)
#pragma GCC unroll 4
    for (int j = 0; j < kRows; ++j) {
      if (flags & kLast)
        out[m * kRows + j] = _mm512_reduce_add_ps(acc[m][j]);
      else
        _mm512_store_ps(state + (m * kRows + j) * 16, acc[m][j]);
    }
}

template <int B>
ELSI_AVX512 void pass_f32_avx512(const void* w, int64_t tiles, const float* x, int64_t stride, int flags,
                                 float* state, float* out) {
  const float* p = static_cast<const float*>(w);
  __m512 acc[B][kRows];
  begin16<B>(acc, flags, state);
  for (int64_t t = 0; t < tiles; ++t, p += kRows * 16) {
    if (flags & kPrefetch) prefetch_ahead(p);
    __m512 xv[B];
#pragma GCC unroll 4
    for (int m = 0; m < B; ++m) {
      xv[m] = _mm512_loadu_ps(x + m * stride + t * 16);
      in_register(xv[m]);
    }
#pragma GCC unroll 4
    for (int j = 0; j < kRows; ++j) {
      __m512 wj = _mm512_loadu_ps(p + j * 16);
      in_register(wj);
#pragma GCC unroll 4
      for (int m = 0; m < B; ++m) acc[m][j] = _mm512_fmadd_ps(wj, xv[m], acc[m][j]);
    }
  }
  end16<B>(acc, flags, state, out);
}

// A 32-column bf16 tile row loads as one vector whose low halves are columns 0-7 and 16-23 and
// high halves 8-15 and 24-31: the input is laid out to match, [0-7, 16-23, 8-15, 24-31] per tile.
void prep_bf16_avx512(const float* x, int64_t cols, int64_t padded, float* out) {
  for (int64_t t = 0; t < padded; t += 32)
    for (int64_t q = 0; q < 32; ++q) {
      const int64_t c = t + q % 8 + q % 16 / 8 * 16 + q / 16 * 8;
      out[t + q] = c < cols ? x[c] : 0.f;
    }
}

template <int B>
ELSI_AVX512 void pass_bf16_avx512(const void* w, int64_t tiles, const float* x, int64_t stride, int flags,
                                  float* state, float* out) {
  const uint16_t* p = static_cast<const uint16_t*>(w);
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m512 acc[B][kRows];
  begin16<B>(acc, flags, state);
  for (int64_t t = 0; t < tiles; ++t, p += kRows * 32) {
    if (flags & kPrefetch) prefetch_ahead(p);
    __m512 xlo[B], xhi[B];
#pragma GCC unroll 4
    for (int m = 0; m < B; ++m) {
      xlo[m] = _mm512_loadu_ps(x + m * stride + t * 32);
      xhi[m] = _mm512_loadu_ps(x + m * stride + t * 32 + 16);
      in_register(xlo[m]);
      in_register(xhi[m]);
    }
#pragma GCC unroll 4
    for (int j = 0; j < kRows; ++j) {
      const __m512i v = _mm512_loadu_si512(p + j * 32);
      const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
      const __m512 hi = _mm512_castsi512_ps(_mm512_and_si512(v, high));
#pragma GCC unroll 4
      for (int m = 0; m < B; ++m) {
        acc[m][j] = _mm512_fmadd_ps(lo, xlo[m], acc[m][j]);
        acc[m][j] = _mm512_fmadd_ps(hi, xhi[m], acc[m][j]);
      }
    }
  }
  end16<B>(acc, flags, state, out);
}

template <int B>
ELSI_AVX512 void pass_i8_avx512(const void* w, int64_t tiles, const float* x, int64_t stride, int flags,
                                float* state, float* out) {
  const int8_t* p = static_cast<const int8_t*>(w);
  __m512 acc[B][kRows];
  begin16<B>(acc, flags, state);
  for (int64_t t = 0; t < tiles; ++t, p += kRows * 64) {
    if (flags & kPrefetch) prefetch_ahead(p);
#pragma GCC unroll 4
    for (int64_t c = 0; c < 64; c += 16) {
      __m512 xv[B];
#pragma GCC unroll 4
      for (int m = 0; m < B; ++m) {
        xv[m] = _mm512_loadu_ps(x + m * stride + t * 64 + c);
        in_register(xv[m]);
      }
#pragma GCC unroll 4
      for (int j = 0; j < kRows; ++j) {
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + j * 64 + c));
        const __m512 wj = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v));
#pragma GCC unroll 4
        for (int m = 0; m < B; ++m) acc[m][j] = _mm512_fmadd_ps(wj, xv[m], acc[m][j]);
      }
    }
  }
  end16<B>(acc, flags, state, out);
}

// ---------------------------------------------------------------- dispatch
struct Kernels {
  int block[3];                   // [WeightType]: most x rows per pass
  int lanes;                      // floats per accumulator
  PassFn pass[3][kMaxBlock + 1];  // [WeightType][rows in the pass]
  PrepFn prep[3];                 // [WeightType]
};

// Blocks: AVX2 has 16 vector registers: 3 x 4 accumulators, 3 inputs and a weight vector for fp32
// and int8; bf16 needs two inputs per row (3 spilled). AVX-512 has 32.
const Kernels kScalar{{1, 1, 1}, 1,
                      {{nullptr, pass_scalar<float>},
                       {nullptr, pass_scalar<uint16_t>},
                       {nullptr, pass_scalar<int8_t>}},
                      {prep_natural, prep_natural, prep_natural}};
const Kernels kAvx2{{3, 2, 3}, 8,
                    {{nullptr, pass_f32_avx2<1>, pass_f32_avx2<2>, pass_f32_avx2<3>},
                     {nullptr, pass_bf16_avx2<1>, pass_bf16_avx2<2>},
                     {nullptr, pass_i8_avx2<1>, pass_i8_avx2<2>, pass_i8_avx2<3>}},
                    {prep_natural, prep_natural, prep_natural}};
const Kernels kAvx512{{4, 4, 4}, 16,
                      {{nullptr, pass_f32_avx512<1>, pass_f32_avx512<2>, pass_f32_avx512<3>, pass_f32_avx512<4>},
                       {nullptr, pass_bf16_avx512<1>, pass_bf16_avx512<2>, pass_bf16_avx512<3>, pass_bf16_avx512<4>},
                       {nullptr, pass_i8_avx512<1>, pass_i8_avx512<2>, pass_i8_avx512<3>, pass_i8_avx512<4>}},
                      {prep_natural, prep_bf16_avx512, prep_natural}};

// The instruction set the draft kernels use (cpu_isa / set_cpu_isa in draft_decode.h) decides.
const Kernels& active_kernels() {
  const char* isa = cpu_isa();
  if (std::strcmp(isa, "avx512") == 0) return kAvx512;
  if (std::strcmp(isa, "avx2") == 0) return kAvx2;
  return kScalar;
}

// ---------------------------------------------------------------- the op
// Chunks of about this many weight bytes: small enough that a preempted helper holds back little,
// large enough that claiming one is cheap next to reading it.
constexpr int64_t kChunkBytes = 64 << 10;
constexpr int64_t kMaxChunks = 1 << 12;

struct Call {
  const LinearWeights* w;
  const Kernels* k;
  const float* x;  // prepared rows, `stride` floats apart
  int64_t stride;
  int64_t rows;
  float* y;
  int64_t tiles;
  int64_t group_bytes;
  int64_t groups;
  int64_t chunk_groups;
};

void run_chunk(void* ctx, int64_t chunk) {
  const Call& c = *static_cast<const Call*>(ctx);
  const LinearWeights& w = *c.w;
  const int type = static_cast<int>(w.type);
  const int64_t n_out = w.out_features, cols = c.stride / c.tiles;
  alignas(64) float state[kLinearMaxRows * kRows * 16];
  float sums[kLinearMaxRows * kRows];
  for (int64_t g = chunk * c.chunk_groups; g < std::min(c.groups, (chunk + 1) * c.chunk_groups); ++g) {
    const char* group = static_cast<const char*>(w.packed) + g * c.group_bytes;
    for (int64_t s0 = 0; s0 < c.tiles; s0 += kSegmentTiles) {
      const int64_t tiles = std::min(kSegmentTiles, c.tiles - s0);
      const int ends = (s0 == 0 ? kFirst : 0) | (s0 + tiles == c.tiles ? kLast : 0);
      for (int64_t m0 = 0; m0 < c.rows; m0 += c.k->block[type]) {
        const int b = static_cast<int>(std::min<int64_t>(c.k->block[type], c.rows - m0));
        c.k->pass[type][b](group + s0 * kTileBytes, tiles, c.x + m0 * c.stride + s0 * cols, c.stride,
                           ends | (m0 == 0 ? kPrefetch : 0), state + m0 * kRows * c.k->lanes, sums + m0 * kRows);
      }
    }
    const int64_t r0 = g * kRows, nr = std::min<int64_t>(kRows, n_out - r0);
    for (int64_t m = 0; m < c.rows; ++m)
      for (int64_t j = 0; j < nr; ++j) {
        float v = sums[m * kRows + j];
        if (w.scale) v *= w.scale[r0 + j];
        if (w.bias) v += w.bias[r0 + j];
        c.y[m * n_out + r0 + j] = v;
      }
  }
}

}  // namespace

void small_linear_cpu(const LinearWeights& w, const float* x, int64_t rows, float* y, int num_threads) {
  const Kernels& k = active_kernels();
  const int64_t elem = w.type == WeightType::kFloat32 ? 4 : w.type == WeightType::kBFloat16 ? 2 : 1;
  const int64_t cols = pack_cols(elem), tiles = (w.in_features + cols - 1) / cols, padded = tiles * cols;
  std::vector<float> prepared(rows * padded);
  for (int64_t m = 0; m < rows; ++m)
    k.prep[static_cast<int>(w.type)](x + m * w.in_features, w.in_features, padded, prepared.data() + m * padded);
  Call call{&w, &k, prepared.data(), padded, rows, y, tiles, tiles * kTileBytes,
            (w.out_features + kRows - 1) / kRows, 1};
  call.chunk_groups = std::max({int64_t{1}, kChunkBytes / call.group_bytes, (call.groups + kMaxChunks - 1) / kMaxChunks});
  const int64_t chunks = (call.groups + call.chunk_groups - 1) / call.chunk_groups;
  run_parallel(num_threads, chunks, run_chunk, &call);
}

}  // namespace elsi_fast

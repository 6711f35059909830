// Fused CPU decode step of the EAGLE3 draft head (batch 1, one token, fp32 or bf16 KV cache).
//
// The step is memory-bound: every weight is read once. All matrix-vector products go through
// one row-dot kernel per (instruction set, weight type), compiled with per-function target
// attributes and picked at run time, so the binary runs on any x86-64. Everything between the
// products (norms, RoPE, attention, SwiGLU, top-k) runs inside the same OpenMP parallel region.

// GCC 12's own AVX-512 intrinsic headers trip -Wmaybe-uninitialized (their "undefined" vectors).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "draft_decode.h"

namespace elsi_fast {
namespace {

#define ELSI_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
#define ELSI_AVX2 __attribute__((target("avx2,fma")))

// out[j] = dot(row row0 + j of w, x) for j < nrows (<= 4); w is [rows, cols] row-major.
using RowDotsFn = void (*)(const void* w, int64_t row0, int nrows, int64_t cols, const float* x,
                           float* out);

inline float bf16_bits_to_float(uint16_t bits) {
  const uint32_t widened = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &widened, sizeof(value));
  return value;
}

inline float to_float(float v) { return v; }
inline float to_float(uint16_t v) { return bf16_bits_to_float(v); }
inline float to_float(int8_t v) { return static_cast<float>(v); }

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
void row_dots_scalar(const void* w, int64_t row0, int nrows, int64_t cols, const float* x, float* out) {
  const T* rows = static_cast<const T*>(w) + row0 * cols;
  if (nrows == 4) return row_dots_scalar_n<T, 4>(rows, cols, x, out);
  for (int j = 0; j < nrows; ++j) row_dots_scalar_n<T, 1>(rows + j * cols, cols, x, out + j);
}

// ---------------------------------------------------------------- AVX2 + FMA
ELSI_AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
ELSI_AVX2 inline __m256 load8(const uint16_t* p) {
  // bf16 -> fp32 is a 16-bit left shift of the zero-extended bits.
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
ELSI_AVX2 inline __m256 load8(const int8_t* p) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
}
ELSI_AVX2 inline float hsum8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 s2 = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
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
    float sum = hsum8(acc[j]);
    for (int64_t t = c; t < cols; ++t) sum += to_float(w[j * cols + t]) * x[t];
    out[j] = sum;
  }
}

template <typename T>
ELSI_AVX2 void row_dots_avx2(const void* w, int64_t row0, int nrows, int64_t cols, const float* x,
                             float* out) {
  const T* rows = static_cast<const T*>(w) + row0 * cols;
  if (nrows == 4) return row_dots_avx2_n<T, 4>(rows, cols, x, out);
  for (int j = 0; j < nrows; ++j) row_dots_avx2_n<T, 1>(rows + j * cols, cols, x, out + j);
}

// ---------------------------------------------------------------- AVX-512
ELSI_AVX512 inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
ELSI_AVX512 inline __m512 load16(const uint16_t* p, __mmask16 m) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
ELSI_AVX512 inline __m512 load16(const int8_t* p, __mmask16 m) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, p)));
}

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
ELSI_AVX512 void row_dots_avx512(const void* w, int64_t row0, int nrows, int64_t cols, const float* x,
                                 float* out) {
  const T* rows = static_cast<const T*>(w) + row0 * cols;
  if (nrows == 4) return row_dots_avx512_n<T, 4>(rows, cols, x, out);
  for (int j = 0; j < nrows; ++j) row_dots_avx512_n<T, 1>(rows + j * cols, cols, x, out + j);
}

// ---------------------------------------------------------------- dispatch
struct IsaKernels {
  const char* name;
  RowDotsFn f32, bf16, i8;
};

const IsaKernels kScalar{"scalar", row_dots_scalar<float>, row_dots_scalar<uint16_t>,
                         row_dots_scalar<int8_t>};
const IsaKernels kAvx2{"avx2", row_dots_avx2<float>, row_dots_avx2<uint16_t>, row_dots_avx2<int8_t>};
const IsaKernels kAvx512{"avx512", row_dots_avx512<float>, row_dots_avx512<uint16_t>,
                         row_dots_avx512<int8_t>};

bool cpu_has(const char* isa) {
  __builtin_cpu_init();
  if (std::strcmp(isa, "avx512") == 0)
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("fma");
  if (std::strcmp(isa, "avx2") == 0)
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
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

RowDotsFn row_dots_for(WeightType type) {
  const IsaKernels* k = active_kernels();
  switch (type) {
    case WeightType::kBFloat16: return k->bf16;
    case WeightType::kInt8: return k->i8;
    default: return k->f32;
  }
}

// ---------------------------------------------------------------- fused pieces
constexpr int64_t kRowBlock = 4;
// Weight-streaming loops hand out chunks of this many row blocks on demand rather than one static
// slice per thread: on a shared or oversubscribed CPU a preempted thread then delays its team by
// one chunk (~0.1-0.3 MB of weights), not by its whole slice.
constexpr int kChunkBlocks = 16;

// Rows of one matrix written to out[r] = scale[r] * dot(W[r], x) + residual[r].
struct GemvPart {
  const void* w;
  const float* scale;
  int64_t rows;
  const float* residual;
  float* out;
};

// Matrix-vector products of several matrices sharing the input x, split by row blocks among the
// team's threads (one worksharing loop, one barrier).
template <int N>
void gemv(RowDotsFn dots, const GemvPart (&parts)[N], int64_t cols, const float* x) {
  int64_t first_block[N + 1] = {0};
  for (int p = 0; p < N; ++p) first_block[p + 1] = first_block[p] + (parts[p].rows + kRowBlock - 1) / kRowBlock;
#pragma omp for schedule(dynamic, kChunkBlocks)
  for (int64_t b = 0; b < first_block[N]; ++b) {
    int p = 0;
    while (b >= first_block[p + 1]) ++p;
    const GemvPart& part = parts[p];
    const int64_t r0 = (b - first_block[p]) * kRowBlock;
    const int nr = static_cast<int>(std::min(kRowBlock, part.rows - r0));
    float dot[kRowBlock];
    dots(part.w, r0, nr, cols, x, dot);
    for (int j = 0; j < nr; ++j) {
      const float v = part.scale ? dot[j] * part.scale[r0 + j] : dot[j];
      part.out[r0 + j] = part.residual ? v + part.residual[r0 + j] : v;
    }
  }
}

// act[i] = silu(gate_i . x) * (up_i . x), both products of a row block in the same iteration.
void swiglu(RowDotsFn dots, const DraftWeights& w, int64_t inter, int64_t cols, const float* x, float* act) {
  const int64_t blocks = (inter + kRowBlock - 1) / kRowBlock;
#pragma omp for schedule(dynamic, kChunkBlocks)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t i0 = b * kRowBlock;
    const int nr = static_cast<int>(std::min(kRowBlock, inter - i0));
    float gate[kRowBlock], up[kRowBlock];
    dots(w.matrix[kGate], i0, nr, cols, x, gate);
    dots(w.matrix[kUp], i0, nr, cols, x, up);
    for (int j = 0; j < nr; ++j) {
      float g = gate[j], u = up[j];
      if (w.scale[kGate]) {
        g *= w.scale[kGate][i0 + j];
        u *= w.scale[kUp][i0 + j];
      }
      act[i0 + j] = g / (1.0f + std::exp(-g)) * u;
    }
  }
}

// Round to nearest even, as torch converts fp32 to bf16.
inline uint16_t float_to_bf16_bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);  // NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
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

// RoPE, cache append and attention, one KV head (and its group of query heads) per iteration, so
// the whole block needs a single barrier. qkv holds q heads, then k heads, then v heads.
template <typename C>
void attention(const DraftDims& dims, const DraftStep& step, const float* rope, float* qkv, float* scores,
               float* attn) {
  const int64_t hd = dims.head_dim, half = hd / 2, nh = dims.num_heads, nkv = dims.num_kv_heads;
  const int64_t ctx = step.position + 1, group = nh / nkv;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
#pragma omp for schedule(static)
  for (int64_t kv = 0; kv < nkv; ++kv) {
    float* new_k = qkv + (nh + kv) * hd;
    const float* new_v = qkv + (nh + nkv + kv) * hd;
    apply_rope(new_k, rope, rope + half, half);
    C* keys = static_cast<C*>(step.k_cache) + kv * dims.max_len * hd;
    C* values = static_cast<C*>(step.v_cache) + kv * dims.max_len * hd;
    for (int64_t i = 0; i < hd; ++i) {
      store(keys + step.position * hd + i, new_k[i]);
      store(values + step.position * hd + i, new_v[i]);
    }
    for (int64_t head = kv * group; head < (kv + 1) * group; ++head) {
      apply_rope(qkv + head * hd, rope, rope + half, half);
      attend_head(qkv + head * hd, keys, values, ctx, hd, scale, scores + head * ctx, attn + head * hd);
    }
  }
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
  const RowDotsFn dots = row_dots_for(w.weight_type);
  const int64_t input_width = step.from_target ? dims.fc_in : d;

  num_threads = std::max(1, num_threads);
  std::vector<float> input(input_width), h(d), qkv(q_width + 2 * kv_width), attn(q_width), h1(d), h2(d),
      act(dims.intermediate), scores(nh * (step.position + 1)), rope(hd);
  std::vector<Candidate> candidates(static_cast<size_t>(num_threads) * k);
  std::vector<int64_t> candidate_counts(num_threads, 0);
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

  // Barriers only where a product needs all of the previous one; the norms between products are
  // recomputed by every thread (O(d)) instead of costing a barrier each.
#pragma omp parallel num_threads(num_threads)
  {
    std::vector<float> x2(2 * d), normed(d);
    if (step.from_target)
      gemv<1>(dots, {{w.matrix[kFc], w.scale[kFc], d, nullptr, h.data()}}, dims.fc_in, input.data());
    const float* hidden_in = step.from_target ? h.data() : input.data();

    // x = [input_layernorm(embed(token)), hidden_norm(h)]: embedding first
    const size_t row = static_cast<size_t>(step.token * d) * (w.embed_type == ActType::kBFloat16 ? 2 : 4);
    rms_norm_act(w.embed_type, static_cast<const char*>(w.embed) + row, w.norms + d, d, dims.eps, x2.data());
    rms_norm(hidden_in, w.norms, d, dims.eps, x2.data() + d);
    gemv<3>(dots,
            {{w.matrix[kQ], w.scale[kQ], q_width, nullptr, qkv.data()},
             {w.matrix[kK], w.scale[kK], kv_width, nullptr, qkv.data() + q_width},
             {w.matrix[kV], w.scale[kV], kv_width, nullptr, qkv.data() + q_width + kv_width}},
            2 * d, x2.data());

    if (step.cache_type == ActType::kBFloat16)
      attention<uint16_t>(dims, step, rope.data(), qkv.data(), scores.data(), attn.data());
    else
      attention<float>(dims, step, rope.data(), qkv.data(), scores.data(), attn.data());

    gemv<1>(dots, {{w.matrix[kO], w.scale[kO], d, hidden_in, h1.data()}}, q_width, attn.data());
    rms_norm(h1.data(), w.norms + 2 * d, d, dims.eps, normed.data());
    swiglu(dots, w, dims.intermediate, d, normed.data(), act.data());
    gemv<1>(dots, {{w.matrix[kDown], w.scale[kDown], d, h1.data(), h2.data()}}, dims.intermediate, act.data());
    rms_norm(h2.data(), w.norms + 3 * d, d, dims.eps, normed.data());

    // lm_head with a per-thread top-k: the draft-vocab logits never leave this loop.
    const int tid = omp_get_thread_num();
    Candidate* mine = candidates.data() + static_cast<size_t>(tid) * k;
    int64_t count = 0;
    const float* lm_scale = w.scale[kLmHead];
    const int64_t blocks = (dims.draft_vocab + kRowBlock - 1) / kRowBlock;
#pragma omp for schedule(dynamic, kChunkBlocks)
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t r0 = b * kRowBlock;
      const int nr = static_cast<int>(std::min(kRowBlock, dims.draft_vocab - r0));
      float dot[kRowBlock];
      dots(w.matrix[kLmHead], r0, nr, d, normed.data(), dot);
      for (int j = 0; j < nr; ++j)
        push_top_k(mine, count, k, Candidate{lm_scale ? dot[j] * lm_scale[r0 + j] : dot[j], r0 + j});
    }
    candidate_counts[tid] = count;
  }

  std::vector<Candidate> merged(k);
  int64_t merged_count = 0;
  for (int t = 0; t < num_threads; ++t)
    for (int64_t i = 0; i < candidate_counts[t]; ++i)
      push_top_k(merged.data(), merged_count, k, candidates[static_cast<size_t>(t) * k + i]);
  for (int64_t i = 0; i < k; ++i) step.out_ids[i] = merged[i].id + w.d2t[merged[i].id];
  for (int64_t i = 0; i < d; ++i) {
    if (step.input_type == ActType::kBFloat16)
      store(static_cast<uint16_t*>(step.out_hidden) + i, h2[i]);
    else
      store(static_cast<float*>(step.out_hidden) + i, h2[i]);
  }
}

}  // namespace elsi_fast

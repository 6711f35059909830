// Decode attention of the target runtime (target_runtime.h): one work item per (head, query row).
//
// Why not torch's: SDPA's CPU kernels split the keys into blocks whose online-softmax order depends
// on the query length (and GQA with a mask copies K/V to every head first), so a 5-token verify
// forward differed from five 1-token forwards in the last bits, and cost 3.5x the 1-token attention.
// Here a row visits its visible keys in order, whatever the other rows: scores, max, exp-sum, then
// the weighted sum of values, each in a fixed order.

// GCC 12's own AVX-512 intrinsic headers trip -Wmaybe-uninitialized (their "undefined" vectors).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "target_runtime.h"

namespace elsi_fast {
namespace {

#define ELSI_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
#define ELSI_AVX2 __attribute__((target("avx2,fma")))

using DotFn = float (*)(const float* a, const float* b, int64_t n);
using AxpyFn = void (*)(float p, const float* v, float* out, int64_t n);  // out += p * v

float dot_scalar(const float* a, const float* b, int64_t n) {
  float s = 0.f;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

void axpy_scalar(float p, const float* v, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] += p * v[i];
}

// Two accumulators (alternate 8-column chunks) halve the FMA latency chain of a 64-wide head.
ELSI_AVX2 float dot_avx2(const float* a, const float* b, int64_t n) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  const __m256 acc = _mm256_add_ps(acc0, acc1);
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  float s = _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

ELSI_AVX2 void axpy_avx2(float p, const float* v, float* out, int64_t n) {
  const __m256 pv = _mm256_set1_ps(p);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + i), _mm256_loadu_ps(out + i)));
  for (; i < n; ++i) out[i] += p * v[i];
}

ELSI_AVX512 float dot_avx512(const float* a, const float* b, int64_t n) {
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc0);
    acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), acc1);
  }
  if (i + 16 <= n) {
    acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc0);
    i += 16;
  }
  float s = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

ELSI_AVX512 void axpy_avx512(float p, const float* v, float* out, int64_t n) {
  const __m512 pv = _mm512_set1_ps(p);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(out + i, _mm512_fmadd_ps(pv, _mm512_loadu_ps(v + i), _mm512_loadu_ps(out + i)));
  for (; i < n; ++i) out[i] += p * v[i];
}

struct Call {
  const DecodeAttention* a;
  DotFn dot;
  AxpyFn axpy;
};

void attend(void* ctx, int64_t item) {
  const Call& c = *static_cast<const Call*>(ctx);
  const DecodeAttention& a = *c.a;
  const int64_t h = item / a.rows, t = item % a.rows, hd = a.head_dim;
  const int64_t kv = h / (a.heads / a.kv_heads);
  const float* q = a.q + h * a.q_head_stride + t * a.q_row_stride;
  const float* keys = a.k + kv * a.keys * hd;
  const float* values = a.v + kv * a.keys * hd;
  const bool* mask = a.mask ? a.mask + t * a.keys : nullptr;
  const int64_t end = !mask && a.causal ? a.keys - a.rows + t + 1 : a.keys;  // keys [0, end) may be seen
  thread_local std::vector<float> scores, acc;
  scores.resize(std::max<int64_t>(end, 1));
  acc.assign(hd, 0.f);

  float top = -std::numeric_limits<float>::infinity();
  int64_t seen = 0;
  for (int64_t j = 0; j < end; ++j) {
    if (mask && !mask[j]) continue;
    scores[j] = c.dot(q, keys + j * hd, hd) * a.scale;
    top = std::max(top, scores[j]);
    ++seen;
  }
  float denom = 0.f;
  for (int64_t j = 0; j < end; ++j) {
    if (mask && !mask[j]) continue;
    scores[j] = std::exp(scores[j] - top);
    denom += scores[j];
  }
  for (int64_t j = 0; j < end; ++j) {
    if (mask && !mask[j]) continue;
    c.axpy(scores[j], values + j * hd, acc.data(), hd);
  }
  float* out = a.out + (t * a.heads + h) * hd;
  const float inv = seen ? 1.0f / denom : 0.f;
  for (int64_t i = 0; i < hd; ++i) out[i] = acc[i] * inv;
}

}  // namespace

void decode_attention_cpu(const DecodeAttention& a, int num_threads) {
  const char* isa = cpu_isa();
  Call call{&a, dot_scalar, axpy_scalar};
  if (std::strcmp(isa, "avx512") == 0)
    call = {&a, dot_avx512, axpy_avx512};
  else if (std::strcmp(isa, "avx2") == 0)
    call = {&a, dot_avx2, axpy_avx2};
  run_parallel(num_threads, a.heads * a.rows, attend, &call);
}

}  // namespace elsi_fast

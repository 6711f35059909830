// RMSNorm of the target runtime (target_runtime.h), the fp32 formula of transformers' Llama, Mistral
// and Qwen RMSNorm: y = weight * (x * (1 / sqrt(mean(x^2) + eps))), in one pass per row instead of
// six torch ops (about 100 us a call on a 2-core Zen 3, 61 calls a SmolLM2 forward). A row's sum
// of squares has one fixed order, whatever the number of rows.

#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "target_runtime.h"

namespace elsi_fast {
namespace {

float sum_squares_scalar(const float* x, int64_t d) {
  float s = 0.f;
  for (int64_t i = 0; i < d; ++i) s += x[i] * x[i];
  return s;
}

void scale_scalar(const float* x, const float* weight, float inv, int64_t d, float* y) {
  for (int64_t i = 0; i < d; ++i) y[i] = weight[i] * (x[i] * inv);
}

ELSI_AVX2 float sum_squares_avx2(const float* x, int64_t d) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) {
    const __m256 v0 = _mm256_loadu_ps(x + i), v1 = _mm256_loadu_ps(x + i + 8);
    a0 = _mm256_fmadd_ps(v0, v0, a0);
    a1 = _mm256_fmadd_ps(v1, v1, a1);
  }
  float s = simd::hsum8(_mm256_add_ps(a0, a1));
  for (; i < d; ++i) s += x[i] * x[i];
  return s;
}

// Two roundings, as torch's two multiplications: no FMA here.
ELSI_AVX2 void scale_avx2(const float* x, const float* weight, float inv, int64_t d, float* y) {
  const __m256 iv = _mm256_set1_ps(inv);
  int64_t i = 0;
  for (; i + 8 <= d; i += 8)
    _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_loadu_ps(weight + i), _mm256_mul_ps(_mm256_loadu_ps(x + i), iv)));
  for (; i < d; ++i) y[i] = weight[i] * (x[i] * inv);
}

}  // namespace

void rms_norm_cpu(const float* x, const float* weight, int64_t rows, int64_t d, float eps, float* y) {
  // AVX2 serves the "avx512" setting too: a row is a few hundred floats.
  const bool simd = std::strcmp(cpu_isa(), "scalar") != 0;
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * d;
    const float mean = (simd ? sum_squares_avx2(xr, d) : sum_squares_scalar(xr, d)) / static_cast<float>(d);
    const float inv = 1.0f / std::sqrt(mean + eps);
    (simd ? scale_avx2 : scale_scalar)(xr, weight, inv, d, y + r * d);
  }
}

}  // namespace elsi_fast

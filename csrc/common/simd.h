// The CPU kernels' shared instruction-set pieces: the function attributes of each runtime-dispatched
// path (cpu_isa() in draft_decode.h picks one) and the vector helpers several kernels use. One
// definition here keeps every kernel's reductions in the same order.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

// "avx512" is only selected where VNNI and BF16 are present too (draft_decode_cpu.cpp, cpu_has), so
// every AVX-512 path may use them. "avx2" requires FMA and F16C (fp16 scales of GGUF blocks).
#define ELSI_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512bf16,fma,f16c")))
#define ELSI_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace elsi_fast::simd {

// Sum of 8 lanes in one fixed order: (lo + hi) pairwise, then the two halves, then the last two.
ELSI_AVX2 inline float hsum8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 s2 = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

// Sum of 16 lanes in one fixed order (the tree of GCC's _mm512_reduce_add_ps): lane i + lane i + 8,
// then j + j + 4 of those, then (0 + 2) + (1 + 3).
ELSI_AVX512 inline float hsum16(__m512 v) {
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  const __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  const __m128 p = _mm_add_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_add_ss(p, _mm_shuffle_ps(p, p, 1)));
}

// Lane k = hsum16(v[k]) bit for bit for 16 vectors: the same additions, done on 16 vectors at once
// with shuffles across them (about 3 instructions a vector instead of 9).
ELSI_AVX512 inline __m512 hsum16x16(const __m512* v) {
  __m512 u[8], w[4], z[2];
#pragma GCC unroll 8
  for (int p = 0; p < 8; ++p)  // u[p] = [v[2p] lanes i + i+8 (8) | v[2p+1]'s (8)]
    u[p] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], 0xEE));
#pragma GCC unroll 4
  for (int p = 0; p < 4; ++p)  // 128-bit lane g of w[p]: vector 4p + g's lanes j + j+4 (4)
    w[p] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * p], u[2 * p + 1], 0x88),
                         _mm512_shuffle_f32x4(u[2 * p], u[2 * p + 1], 0xDD));
#pragma GCC unroll 2
  for (int p = 0; p < 2; ++p)  // lane g of z[p]: (0 + 2, 1 + 3) of vector 8p + g, then of 8p + 4 + g
    z[p] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * p], w[2 * p + 1], 0x44),
                         _mm512_shuffle_ps(w[2 * p], w[2 * p + 1], 0xEE));
  // element 4g + m of f is the sum of vector 4m + g
  const __m512 f = _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], 0x88), _mm512_shuffle_ps(z[0], z[1], 0xDD));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), f);
}

// exp(x) for x <= 0 (Cephes' single-precision polynomial, ~1 ulp); below -87.3 it returns ~1e-38,
// not 0, which next to a softmax row maximum's exp(0) = 1 is nothing.
ELSI_AVX2 inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3365448f));
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(scale));
}

ELSI_AVX512 inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3365448f));
  const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.f)));
  const __m512i scale = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(scale));
}

// Sum of the products of 32 unsigned bytes (u) and 32 signed bytes (s) in pairs of 4 neighbours:
// 8 exact int32 lanes. AVX2: u8 x s8 pairs to int16 (no saturation while u * s stays below 2^14
// per pair, which GGUF's 4-bit weights and |s| <= 127 keep; 8-bit weights go through abs/sign so
// that u <= 128), then pairs to int32. AVX-512 VNNI does it in one instruction.
ELSI_AVX2 inline __m256i dot_u8s8_avx2(__m256i u, __m256i s) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}
ELSI_AVX512 inline __m256i dot_u8s8_vnni(__m256i u, __m256i s) {
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
}

// IEEE fp16 bits to fp32 without F16C (the scalar path): exact for every value.
inline float fp16_to_fp32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu, bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (mant << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal: normalize
    exp = 113;
    while (!(mant & 0x400u)) mant <<= 1, --exp;
    bits = sign | (exp << 23) | ((mant & 0x3FFu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

}  // namespace elsi_fast::simd

// Decode attention of the target runtime (target_runtime.h): one work item per (head, query row).
//
// Why not torch's: SDPA's CPU kernels split the keys into blocks whose online-softmax order depends
// on the query length (and GQA with a mask copies K/V to every head first), so a 5-token verify
// forward differed from five 1-token forwards in the last bits, and cost 3.5x the 1-token attention.
// Here a row visits its visible keys in order, whatever the other rows: scores, max, exp-sum, then
// the weighted sum of values, each in an order fixed by the visible keys alone. The exponentials
// are a vectorized polynomial (~1 ulp). SmolLM2 (9 heads, 3 KV heads, head_dim 64) at 300 keys:
// ~4 us per head and query row on one Zen 3 core.
//
// Without a mask the (head, row) pairs that share a KV head also share its keys and values: one
// work item takes several pairs and walks the keys in tiles that stay in L1, each pair doing on a
// tile exactly the steps it does alone (the same dots per key, the values' multiply-adds per column
// in key order, the sums kept in memory between tiles), so the results are the one-pair results bit
// for bit. A verify of k+1 rows then reads the cache once per item instead of once per pair: each
// further row of SmolLM2's forward at 1000 keys cost 2.9 ms on one core before (docs/native-target.md).

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

// The three passes of one query row over its n visible keys (their indices in idx, ascending):
//   dots:     s[i] = scale * dot(q, key idx[i]), each in one fixed order;
//   exp_sum:  s[i] = exp(s[i] - top) for i < n, returns their sum in a fixed order (s holds
//             a multiple of 16 floats; the ones past n become 0);
//   weighted: out = inv * sum_i s[i] * value idx[i], each column summed over i in order;
// idx null: the keys 0 .. n-1 (a causal row).
struct Kernels {
  void (*dots)(const float* q, const float* keys, const int64_t* idx, int64_t n, int64_t hd, float scale, float* s);
  float (*exp_sum)(float* s, int64_t n, float top);
  void (*weighted)(const float* s, const float* values, const int64_t* idx, int64_t n, int64_t hd, float inv,
                   float* out);
  // acc[c] += s[i] * value i [c] for the n contiguous keys, in weighted's order per column (null: the
  // pairs run one by one); `width` divides the head_dim it takes.
  void (*weighted_acc)(const float* s, const float* values, int64_t n, int64_t hd, float* acc);
  // the same for two pairs at once (sa, acc_a and sb, acc_b), each with its one-pair bits (null: one
  // pair at a time)
  void (*weighted_acc2)(const float* sa, const float* sb, const float* values, int64_t n, int64_t hd, float* acc_a,
                        float* acc_b);
  int64_t width;
};

// ---------------------------------------------------------------- scalar fallback
void dots_scalar(const float* q, const float* keys, const int64_t* idx, int64_t n, int64_t hd, float scale, float* s) {
  for (int64_t i = 0; i < n; ++i) {
    const float* key = keys + (idx ? idx[i] : i) * hd;
    float dot = 0.f;
    for (int64_t c = 0; c < hd; ++c) dot += q[c] * key[c];
    s[i] = dot * scale;
  }
}

float exp_sum_scalar(float* s, int64_t n, float top) {
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) sum += s[i] = std::exp(s[i] - top);
  return sum;
}

void weighted_scalar(const float* s, const float* values, const int64_t* idx, int64_t n, int64_t hd, float inv,
                     float* out) {
  std::fill(out, out + hd, 0.f);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t c = 0; c < hd; ++c) out[c] += s[i] * values[(idx ? idx[i] : i) * hd + c];
  for (int64_t c = 0; c < hd; ++c) out[c] *= inv;
}

// ---------------------------------------------------------------- AVX2 + FMA
// One key's dot as every key gets it: two accumulators over alternate 8-column chunks (half the FMA
// latency chain), their sum reduced, then the columns past the last 16 one by one.
ELSI_AVX2 inline float finish_dot8(__m256 acc0, __m256 acc1, const float* q, const float* key, int64_t c, int64_t hd) {
  float dot = simd::hsum8(_mm256_add_ps(acc0, acc1));
  for (; c < hd; ++c) dot += q[c] * key[c];
  return dot;
}

// Four keys at a time share each load of q; the rest one by one, with the same arithmetic per key.
ELSI_AVX2 void dots_avx2(const float* q, const float* keys, const int64_t* idx, int64_t n, int64_t hd, float scale,
                         float* s) {
  const int64_t body = hd / 16 * 16;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const float* key[4];
    __m256 acc0[4], acc1[4];
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r) {
      key[r] = keys + (idx ? idx[i + r] : i + r) * hd;
      acc0[r] = acc1[r] = _mm256_setzero_ps();
    }
    for (int64_t c = 0; c < body; c += 16) {
      const __m256 q0 = _mm256_loadu_ps(q + c), q1 = _mm256_loadu_ps(q + c + 8);
#pragma GCC unroll 4
      for (int r = 0; r < 4; ++r) {
        acc0[r] = _mm256_fmadd_ps(q0, _mm256_loadu_ps(key[r] + c), acc0[r]);
        acc1[r] = _mm256_fmadd_ps(q1, _mm256_loadu_ps(key[r] + c + 8), acc1[r]);
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r) s[i + r] = finish_dot8(acc0[r], acc1[r], q, key[r], body, hd) * scale;
  }
  for (; i < n; ++i) {
    const float* key = keys + (idx ? idx[i] : i) * hd;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (int64_t c = 0; c < body; c += 16) {
      acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + c), _mm256_loadu_ps(key + c), acc0);
      acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + c + 8), _mm256_loadu_ps(key + c + 8), acc1);
    }
    s[i] = finish_dot8(acc0, acc1, q, key, body, hd) * scale;
  }
}

ELSI_AVX2 float exp_sum_avx2(float* s, int64_t n, float top) {
  const __m256 shift = _mm256_set1_ps(top), lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 live = _mm256_cmp_ps(lane, _mm256_set1_ps(static_cast<float>(n - i)), _CMP_LT_OQ);
    const __m256 e = _mm256_and_ps(simd::exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), shift)), live);
    _mm256_storeu_ps(s + i, e);
    sum = _mm256_add_ps(sum, e);
  }
  return simd::hsum8(sum);
}

// Columns in blocks of up to 64 (8 accumulators in registers across all keys), then 8, then 1.
ELSI_AVX2 void weighted_avx2(const float* s, const float* values, const int64_t* idx, int64_t n, int64_t hd, float inv,
                             float* out) {
  int64_t c0 = 0;
  for (; c0 + 64 <= hd; c0 += 64) {
    __m256 acc[8];
#pragma GCC unroll 8
    for (int k = 0; k < 8; ++k) acc[k] = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; ++i) {
      const __m256 p = _mm256_set1_ps(s[i]);
      const float* v = values + (idx ? idx[i] : i) * hd + c0;
#pragma GCC unroll 8
      for (int k = 0; k < 8; ++k) acc[k] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8 * k), acc[k]);
    }
#pragma GCC unroll 8
    for (int k = 0; k < 8; ++k) _mm256_storeu_ps(out + c0 + 8 * k, _mm256_mul_ps(acc[k], _mm256_set1_ps(inv)));
  }
  for (; c0 + 8 <= hd; c0 += 8) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; ++i)
      acc = _mm256_fmadd_ps(_mm256_set1_ps(s[i]), _mm256_loadu_ps(values + (idx ? idx[i] : i) * hd + c0), acc);
    _mm256_storeu_ps(out + c0, _mm256_mul_ps(acc, _mm256_set1_ps(inv)));
  }
  for (; c0 < hd; ++c0) {
    float acc = 0.f;
    for (int64_t i = 0; i < n; ++i) acc += s[i] * values[(idx ? idx[i] : i) * hd + c0];
    out[c0] = acc * inv;
  }
}

// weighted_avx2's column blocks (64, then 8) over a tile of keys, its sums carried in acc.
ELSI_AVX2 void weighted_acc_avx2(const float* s, const float* values, int64_t n, int64_t hd, float* acc_out) {
  int64_t c0 = 0;
  for (; c0 + 64 <= hd; c0 += 64) {
    __m256 acc[8];
#pragma GCC unroll 8
    for (int k = 0; k < 8; ++k) acc[k] = _mm256_loadu_ps(acc_out + c0 + 8 * k);
    for (int64_t i = 0; i < n; ++i) {
      const __m256 p = _mm256_set1_ps(s[i]);
      const float* v = values + i * hd + c0;
#pragma GCC unroll 8
      for (int k = 0; k < 8; ++k) acc[k] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8 * k), acc[k]);
    }
#pragma GCC unroll 8
    for (int k = 0; k < 8; ++k) _mm256_storeu_ps(acc_out + c0 + 8 * k, acc[k]);
  }
  for (; c0 + 8 <= hd; c0 += 8) {
    __m256 acc = _mm256_loadu_ps(acc_out + c0);
    for (int64_t i = 0; i < n; ++i)
      acc = _mm256_fmadd_ps(_mm256_set1_ps(s[i]), _mm256_loadu_ps(values + i * hd + c0), acc);
    _mm256_storeu_ps(acc_out + c0, acc);
  }
}

// ---------------------------------------------------------------- AVX-512
// One key's dot as every key gets it on AVX-512 (before its horizontal sum): acc0 over the even
// 16-column halves, acc1 over the odd ones, at head_dim 32 * C with the query in registers.
template <int C>
ELSI_AVX512 inline __m512 key_dot_fixed(const __m512* qa, const __m512* qb, const float* key) {
  __m512 a = _mm512_setzero_ps(), b = _mm512_setzero_ps();
#pragma GCC unroll 8
  for (int j = 0; j < C; ++j) {
    a = _mm512_fmadd_ps(qa[j], _mm512_loadu_ps(key + 32 * j), a);
    b = _mm512_fmadd_ps(qb[j], _mm512_loadu_ps(key + 32 * j + 16), b);
  }
  return _mm512_add_ps(a, b);
}

// dots_avx512 at head_dim 32 * C (64: SmolLM2, 256: Gemma 3): the query held in 2C registers, so a
// key's multiply-adds load only the key, and the horizontal sums of 16 keys at once
// (simd::hsum16x16; at head_dim 64 one key's sum alone cost twice its 4 multiply-adds). Each key
// takes the general loop's steps, so the scores are its bits.
template <int C>
ELSI_AVX512 void dots_avx512_fixed(const float* q, const float* keys, const int64_t* idx, int64_t n, float scale,
                                   float* s) {
  constexpr int64_t hd = 32 * C;
  __m512 qa[C], qb[C];
#pragma GCC unroll 8
  for (int j = 0; j < C; ++j) qa[j] = _mm512_loadu_ps(q + 32 * j), qb[j] = _mm512_loadu_ps(q + 32 * j + 16);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 sums[16];
#pragma GCC unroll 16
    for (int r = 0; r < 16; ++r) sums[r] = key_dot_fixed<C>(qa, qb, keys + (idx ? idx[i + r] : i + r) * hd);
    _mm512_storeu_ps(s + i, _mm512_mul_ps(simd::hsum16x16(sums), _mm512_set1_ps(scale)));
  }
  for (; i < n; ++i) s[i] = simd::hsum16(key_dot_fixed<C>(qa, qb, keys + (idx ? idx[i] : i) * hd)) * scale;
}

ELSI_AVX512 void dots_avx512(const float* q, const float* keys, const int64_t* idx, int64_t n, int64_t hd, float scale,
                             float* s) {
  if (hd == 64) return dots_avx512_fixed<2>(q, keys, idx, n, scale, s);
  if (hd == 128) return dots_avx512_fixed<4>(q, keys, idx, n, scale, s);
  if (hd == 256) return dots_avx512_fixed<8>(q, keys, idx, n, scale, s);
  for (int64_t i = 0; i < n; ++i) {
    const float* key = keys + (idx ? idx[i] : i) * hd;
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    int64_t c = 0;
    for (; c + 32 <= hd; c += 32) {
      acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(q + c), _mm512_loadu_ps(key + c), acc0);
      acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(q + c + 16), _mm512_loadu_ps(key + c + 16), acc1);
    }
    if (c + 16 <= hd) {
      acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(q + c), _mm512_loadu_ps(key + c), acc0);
      c += 16;
    }
    float dot = simd::hsum16(_mm512_add_ps(acc0, acc1));
    for (; c < hd; ++c) dot += q[c] * key[c];
    s[i] = dot * scale;
  }
}

ELSI_AVX512 float exp_sum_avx512(float* s, int64_t n, float top) {
  const __m512 shift = _mm512_set1_ps(top);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 live = n - i >= 16 ? __mmask16{0xFFFF} : static_cast<__mmask16>((1u << (n - i)) - 1u);
    const __m512 e = _mm512_maskz_mov_ps(live, simd::exp16(_mm512_sub_ps(_mm512_loadu_ps(s + i), shift)));
    _mm512_storeu_ps(s + i, e);
    sum = _mm512_add_ps(sum, e);
  }
  return simd::hsum16(sum);
}

ELSI_AVX512 void weighted_avx512(const float* s, const float* values, const int64_t* idx, int64_t n, int64_t hd,
                                 float inv, float* out) {
  int64_t c0 = 0;
  for (; c0 + 64 <= hd; c0 += 64) {
    __m512 acc[4];
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) acc[k] = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; ++i) {
      const __m512 p = _mm512_set1_ps(s[i]);
      const float* v = values + (idx ? idx[i] : i) * hd + c0;
#pragma GCC unroll 4
      for (int k = 0; k < 4; ++k) acc[k] = _mm512_fmadd_ps(p, _mm512_loadu_ps(v + 16 * k), acc[k]);
    }
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) _mm512_storeu_ps(out + c0 + 16 * k, _mm512_mul_ps(acc[k], _mm512_set1_ps(inv)));
  }
  for (; c0 + 16 <= hd; c0 += 16) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; ++i)
      acc = _mm512_fmadd_ps(_mm512_set1_ps(s[i]), _mm512_loadu_ps(values + (idx ? idx[i] : i) * hd + c0), acc);
    _mm512_storeu_ps(out + c0, _mm512_mul_ps(acc, _mm512_set1_ps(inv)));
  }
  for (; c0 < hd; ++c0) {
    float acc = 0.f;
    for (int64_t i = 0; i < n; ++i) acc += s[i] * values[(idx ? idx[i] : i) * hd + c0];
    out[c0] = acc * inv;
  }
}

// weighted_avx512's column blocks (64, then 16) over a tile of keys, its sums carried in acc.
ELSI_AVX512 void weighted_acc_avx512(const float* s, const float* values, int64_t n, int64_t hd, float* acc_out) {
  int64_t c0 = 0;
  for (; c0 + 64 <= hd; c0 += 64) {
    __m512 acc[4];
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) acc[k] = _mm512_loadu_ps(acc_out + c0 + 16 * k);
    for (int64_t i = 0; i < n; ++i) {
      const __m512 p = _mm512_set1_ps(s[i]);
      const float* v = values + i * hd + c0;
#pragma GCC unroll 4
      for (int k = 0; k < 4; ++k) acc[k] = _mm512_fmadd_ps(p, _mm512_loadu_ps(v + 16 * k), acc[k]);
    }
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) _mm512_storeu_ps(acc_out + c0 + 16 * k, acc[k]);
  }
  for (; c0 + 16 <= hd; c0 += 16) {
    __m512 acc = _mm512_loadu_ps(acc_out + c0);
    for (int64_t i = 0; i < n; ++i)
      acc = _mm512_fmadd_ps(_mm512_set1_ps(s[i]), _mm512_loadu_ps(values + i * hd + c0), acc);
    _mm512_storeu_ps(acc_out + c0, acc);
  }
}

// weighted_acc_avx512 for two pairs over the same keys: each value vector is loaded once for both
// (the loads, not the multiply-adds, bounded it), and each pair's sums take the steps they take
// alone, in the same order.
ELSI_AVX512 void weighted_acc2_avx512(const float* sa, const float* sb, const float* values, int64_t n, int64_t hd,
                                      float* acc_a, float* acc_b) {
  int64_t c0 = 0;
  for (; c0 + 64 <= hd; c0 += 64) {
    __m512 a[4], b[4];
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) a[k] = _mm512_loadu_ps(acc_a + c0 + 16 * k), b[k] = _mm512_loadu_ps(acc_b + c0 + 16 * k);
    for (int64_t i = 0; i < n; ++i) {
      const __m512 pa = _mm512_set1_ps(sa[i]), pb = _mm512_set1_ps(sb[i]);
      const float* v = values + i * hd + c0;
#pragma GCC unroll 4
      for (int k = 0; k < 4; ++k) {
        const __m512 x = _mm512_loadu_ps(v + 16 * k);
        a[k] = _mm512_fmadd_ps(pa, x, a[k]);
        b[k] = _mm512_fmadd_ps(pb, x, b[k]);
      }
    }
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) _mm512_storeu_ps(acc_a + c0 + 16 * k, a[k]), _mm512_storeu_ps(acc_b + c0 + 16 * k, b[k]);
  }
  for (; c0 + 16 <= hd; c0 += 16) {
    __m512 a = _mm512_loadu_ps(acc_a + c0), b = _mm512_loadu_ps(acc_b + c0);
    for (int64_t i = 0; i < n; ++i) {
      const __m512 x = _mm512_loadu_ps(values + i * hd + c0);
      a = _mm512_fmadd_ps(_mm512_set1_ps(sa[i]), x, a);
      b = _mm512_fmadd_ps(_mm512_set1_ps(sb[i]), x, b);
    }
    _mm512_storeu_ps(acc_a + c0, a), _mm512_storeu_ps(acc_b + c0, b);
  }
}

// out = acc * inv, as weighted's last step.
ELSI_AVX2 void scale_out_avx2(const float* acc, int64_t hd, float inv, float* out) {
  for (int64_t c = 0; c < hd; c += 8) _mm256_storeu_ps(out + c, _mm256_mul_ps(_mm256_loadu_ps(acc + c), _mm256_set1_ps(inv)));
}

const Kernels kScalar{dots_scalar, exp_sum_scalar, weighted_scalar, nullptr, nullptr, 1};
const Kernels kAvx2{dots_avx2, exp_sum_avx2, weighted_avx2, weighted_acc_avx2, nullptr, 8};
const Kernels kAvx512{dots_avx512, exp_sum_avx512, weighted_avx512, weighted_acc_avx512, weighted_acc2_avx512, 16};

struct Call {
  const DecodeAttention* a;
  const Kernels* k;
  int64_t pairs_per_item;  // of one KV head's (head, row) pairs; 0: one pair per item, one by one
  int64_t items_per_kv;
};

// The keys [first, end) row t may see without a mask.
void row_range(const DecodeAttention& a, int64_t t, int64_t& first, int64_t& end) {
  end = a.causal ? a.keys - a.rows + t + 1 : a.keys;
  first = a.window > 0 ? std::max<int64_t>(0, end - a.window) : 0;
}

void attend(void* ctx, int64_t item) {
  const Call& c = *static_cast<const Call*>(ctx);
  const DecodeAttention& a = *c.a;
  const int64_t h = item / a.rows, t = item % a.rows, hd = a.head_dim;
  const int64_t kv = h / (a.heads / a.kv_heads);
  const int64_t kv_offset = kv * (a.kv_head_stride ? a.kv_head_stride : a.keys * hd);
  const bool* mask = a.mask ? a.mask + t * a.keys : nullptr;
  int64_t first = 0, end = a.keys;  // keys [first, end) may be seen
  if (!mask) row_range(a, t, first, end);
  thread_local std::vector<int64_t> idx;
  thread_local std::vector<float> s;
  s.resize((end - first + 15) / 16 * 16);
  int64_t n = end - first;
  if (mask) {  // the visible keys' indices
    idx.resize(end);
    n = 0;
    for (int64_t j = 0; j < end; ++j)
      if (mask[j]) idx[n++] = j;
  }
  const int64_t* visible = mask ? idx.data() : nullptr;
  float* out = a.out + (t * a.heads + h) * hd;
  if (n <= 0) {
    std::fill(out, out + hd, 0.f);
    return;
  }
  c.k->dots(a.q + h * a.q_head_stride + t * a.q_row_stride, a.k + kv_offset + first * hd, visible, n, hd, a.scale,
            s.data());
  const float top = *std::max_element(s.begin(), s.begin() + n);
  const float denom = c.k->exp_sum(s.data(), n, top);
  c.k->weighted(s.data(), a.v + kv_offset + first * hd, visible, n, hd, 1.0f / denom, out);
}

// Keys per tile: about 32 KB of one KV head's keys (or values), so a tile stays in L1 while every
// pair of the item passes over it.
int64_t tile_keys(int64_t hd) { return std::max<int64_t>(8, (32 << 10) / (4 * hd)); }

// Item: pairs [p0, p1) of KV head kv's (head, row) pairs, pair p = (head kv * group + p / rows, row
// p % rows); each as `attend` computes it, over shared tiles (see the top of the file).
void attend_pairs(void* ctx, int64_t item) {
  const Call& c = *static_cast<const Call*>(ctx);
  const DecodeAttention& a = *c.a;
  const int64_t hd = a.head_dim, group = a.heads / a.kv_heads, pairs = group * a.rows;
  const int64_t kv = item / c.items_per_kv, p0 = item % c.items_per_kv * c.pairs_per_item;
  const int64_t p1 = std::min(pairs, p0 + c.pairs_per_item);
  if (p0 >= p1) return;
  const int64_t kv_offset = kv * (a.kv_head_stride ? a.kv_head_stride : a.keys * hd);
  const float* keys = a.k + kv_offset;
  const float* values = a.v + kv_offset;
  const int64_t count = p1 - p0;
  thread_local std::vector<int64_t> first, end, offset;
  thread_local std::vector<float> s, acc, inv;
  first.resize(count), end.resize(count), offset.resize(count + 1), inv.resize(count);
  offset[0] = 0;
  int64_t lo = a.keys, hi = 0;
  for (int64_t i = 0; i < count; ++i) {
    row_range(a, (p0 + i) % a.rows, first[i], end[i]);
    offset[i + 1] = offset[i] + (std::max<int64_t>(0, end[i] - first[i]) + 15) / 16 * 16;
    lo = std::min(lo, first[i]), hi = std::max(hi, end[i]);
  }
  s.resize(offset[count]);
  acc.assign(count * hd, 0.f);
  const int64_t tile = tile_keys(hd);
  for (int64_t k0 = lo; k0 < hi; k0 += tile)  // scores
    for (int64_t i = 0; i < count; ++i) {
      const int64_t from = std::max(k0, first[i]), to = std::min(k0 + tile, end[i]);
      if (from >= to) continue;
      const int64_t p = p0 + i, h = kv * group + p / a.rows, t = p % a.rows;
      c.k->dots(a.q + h * a.q_head_stride + t * a.q_row_stride, keys + from * hd, nullptr, to - from, hd, a.scale,
                s.data() + offset[i] + (from - first[i]));
    }
  for (int64_t i = 0; i < count; ++i) {  // softmax weights
    const int64_t n = end[i] - first[i];
    if (n <= 0) continue;
    float* si = s.data() + offset[i];
    inv[i] = 1.0f / c.k->exp_sum(si, n, *std::max_element(si, si + n));
  }
  // weighted values: pair i's keys [from, to) of the tile, in order; two pairs at a time over the keys
  // both see (they differ at most at the edges: a causal row sees one key more than the row before)
  auto weigh = [&](int64_t i, int64_t from, int64_t to) {
    if (from < to)
      c.k->weighted_acc(s.data() + offset[i] + (from - first[i]), values + from * hd, to - from, hd, acc.data() + i * hd);
  };
  for (int64_t k0 = lo; k0 < hi; k0 += tile)
    for (int64_t i = 0; i < count; i += 2) {
      const int64_t fa = std::max(k0, first[i]), ta = std::min(k0 + tile, end[i]);
      if (i + 1 == count) {
        weigh(i, fa, ta);
        continue;
      }
      const int64_t fb = std::max(k0, first[i + 1]), tb = std::min(k0 + tile, end[i + 1]);
      const int64_t from = std::max(fa, fb), to = std::min(ta, tb);
      if (c.k->weighted_acc2 == nullptr || from >= to) {
        weigh(i, fa, ta), weigh(i + 1, fb, tb);
        continue;
      }
      weigh(i, fa, from), weigh(i + 1, fb, from);
      c.k->weighted_acc2(s.data() + offset[i] + (from - first[i]), s.data() + offset[i + 1] + (from - first[i + 1]),
                         values + from * hd, to - from, hd, acc.data() + i * hd, acc.data() + (i + 1) * hd);
      weigh(i, to, ta), weigh(i + 1, to, tb);
    }
  for (int64_t i = 0; i < count; ++i) {
    const int64_t p = p0 + i, h = kv * group + p / a.rows, t = p % a.rows;
    float* out = a.out + (t * a.heads + h) * hd;
    if (end[i] - first[i] <= 0)
      std::fill(out, out + hd, 0.f);
    else
      scale_out_avx2(acc.data() + i * hd, hd, inv[i], out);
  }
}

}  // namespace

void decode_attention_cpu(const DecodeAttention& a, int num_threads) {
  const char* isa = cpu_isa();
  Call call{&a, std::strcmp(isa, "avx512") == 0 ? &kAvx512 : std::strcmp(isa, "avx2") == 0 ? &kAvx2 : &kScalar, 0, 0};
  const int64_t pairs = a.heads / a.kv_heads * a.rows;
  if (a.mask || call.k->weighted_acc == nullptr || a.head_dim % call.k->width || pairs == 1) {
    run_parallel(num_threads, a.heads * a.rows, attend, &call);
    return;
  }
  // Items per KV head: enough for every thread (two per thread where the KV heads are few), each
  // reading the head's cache once.
  const int64_t threads = std::max(1, num_threads);
  call.items_per_kv = std::min(pairs, threads == 1 ? 1 : (2 * threads + a.kv_heads - 1) / a.kv_heads);
  call.pairs_per_item = (pairs + call.items_per_kv - 1) / call.items_per_kv;
  run_parallel(num_threads, a.kv_heads * call.items_per_kv, attend_pairs, &call);
}

}  // namespace elsi_fast

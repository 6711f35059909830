// The target runtime's CPU pieces (elsi_fast/targets/target_runtime.py): a small-batch linear layer and a
// decode attention for forwards of 1..kLinearMaxRows tokens at batch 1, a fused RMSNorm, and the
// thread pool the first two run on (common/cpu_pool.h). No torch headers.
//
// All compute every output row in an order that does not depend on how many rows share the call,
// so a verify forward of k+1 tokens equals k+1 one-token forwards bit for bit.
#pragma once

#include <cstdint>

#include "common/cpu_pool.h"
#include "common/simd.h"
#include "draft_decode.h"


namespace elsi_fast {

// More rows (tokens) than this and the caller keeps torch (prefill).
constexpr int64_t kLinearMaxRows = 8;

// ------------------------------------------------------------------------------------- linear
// W [out, in] packed as the draft kernels pack it ([ceil(out / kPackRows), ceil(in / C), kPackRows,
// C], C = pack_cols(element size), zero padded; draft_decode.h), with one difference for bf16: in
// every 16-column block of a tile row the element pairs are (column i, column i + 8), i < 8, so
// one 32-bit lane holds two weights that a shift and a mask widen to fp32 in natural column order
// (elsi_fast.targets.target_runtime.pack_weight writes it).
struct LinearWeights {
  WeightType type;
  const void* packed;
  const float* scale;  // [out] per-row scales of int8 weights, else null
  const float* bias;   // [out] or null
  int64_t out_features;
  int64_t in_features;
};

// y [rows, out] = x [rows, in] W^T (+ bias), fp32, both row-major, rows <= kLinearMaxRows; shapes
// are validated by the caller. `num_threads` threads share the output rows.
void small_linear_cpu(const LinearWeights& w, const float* x, int64_t rows, float* y, int num_threads);

// ------------------------------------------------------------------------------------- attention
// Softmax attention of `rows` new query tokens over a KV cache of `keys` positions (the new ones
// last), GQA, fp32. Query row t sees key j when mask[t * keys + j] (mask given), else when
// j <= keys - rows + t (causal, bottom-right aligned as a decode step is), else always; without a
// mask, `window` > 0 also hides the keys more than window - 1 before that last one (a sliding
// window). Keys are visited in order and masked ones skipped, so a row's result does not depend on
// `rows`.
struct DecodeAttention {
  const float* q;          // q[h, t, :] at q + h * q_head_stride + t * q_row_stride
  int64_t q_head_stride;
  int64_t q_row_stride;
  const float* k;          // [kv_heads, keys, head_dim], rows contiguous
  const float* v;          // [kv_heads, keys, head_dim], rows contiguous
  int64_t kv_head_stride;  // floats between two KV heads of k and v (a cache's capacity); 0: keys * head_dim
  const bool* mask;        // [rows, keys] or null
  bool causal;
  int64_t window;          // without a mask: a row sees its last `window` keys (0: all it may see)
  int64_t heads;
  int64_t kv_heads;        // heads % kv_heads == 0
  int64_t rows;
  int64_t keys;
  int64_t head_dim;
  float scale;
  float* out;              // [rows, heads, head_dim]; a row that sees no key gets zeros
};

void decode_attention_cpu(const DecodeAttention& a, int num_threads);

// ------------------------------------------------------------------------------------- argmax
// out[r] = the index of the largest of x[r, 0..cols) (row-major), numpy.argmax's answer: the first
// of equal maxima, or the first NaN where the row has one. Slices of the rows run on `num_threads`
// threads (argmax_cpu.cpp).
void argmax_rows_cpu(const float* x, int64_t rows, int64_t cols, int64_t* out, int num_threads);

// ------------------------------------------------------------------------------------- RMSNorm
// y [rows, d] = weight * (x * (1 / sqrt(mean(x^2) + eps))) row by row, fp32.
void rms_norm_cpu(const float* x, const float* weight, int64_t rows, int64_t d, float eps, float* y);

}  // namespace elsi_fast

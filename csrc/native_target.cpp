// The fused forward of native_target.h (Gemma 3's blocks: native_gemma3.cpp): transformers' Llama
// decoder (RMSNorm, attention with RoPE and GQA, SiLU-gated MLP, final norm, head) on GGUF blocks,
// with the target runtime's kernels (RMSNorm, decode attention, the thread pool) and quant_linear's
// products.

// GCC 12's own AVX-512 intrinsic headers trip -Wmaybe-uninitialized (their "undefined" vectors).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

#include "native_target.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

#include "common/simd.h"
#include "draft_decode.h"
#include "target_runtime.h"

namespace elsi_fast {
namespace {

// ------------------------------------------------------------------ gated activations
// x / (1 + exp(-s x)): SiLU at s = 1; the tanh-GELU at s = 2 sqrt(2/pi) (1 + 0.044715 x^2).
inline float gated_scalar(GatedActivation kind, float x) {
  if (kind == GatedActivation::kSilu) return x / (1.0f + std::exp(-x));
  constexpr float kSqrt2OverPi = 0.7978845608028654f;
  return 0.5f * x * (1.0f + std::tanh(kSqrt2OverPi * (x + 0.044715f * x * x * x)));
}

// exp's argument -s x, kept below 88 (exp16 / exp8 overflow past it; x / (1 + e^88) is 0 to fp32).
constexpr float kExpMax = 88.0f;

ELSI_AVX512 void gated_rows_avx512(GatedActivation kind, float* gate, const float* up, int64_t rows, int64_t width) {
  const __m512 one = _mm512_set1_ps(1.f), top = _mm512_set1_ps(kExpMax);
  for (int64_t r = 0; r < rows; ++r) {
    float* g = gate + r * width;
    const float* u = up + r * width;
    int64_t i = 0;
    for (; i + 16 <= width; i += 16) {
      const __m512 x = _mm512_loadu_ps(g + i);
      __m512 arg = _mm512_sub_ps(_mm512_setzero_ps(), x);
      if (kind == GatedActivation::kGeluTanh)  // -2 sqrt(2/pi) (x + 0.044715 x^3)
        arg = _mm512_mul_ps(_mm512_set1_ps(-1.5957691216057308f),
                            _mm512_fmadd_ps(_mm512_mul_ps(_mm512_mul_ps(x, x), x), _mm512_set1_ps(0.044715f), x));
      const __m512 e = simd::exp16(_mm512_min_ps(arg, top));
      _mm512_storeu_ps(g + i, _mm512_mul_ps(_mm512_div_ps(x, _mm512_add_ps(one, e)), _mm512_loadu_ps(u + i)));
    }
    for (; i < width; ++i) g[i] = gated_scalar(kind, g[i]) * u[i];
  }
}

ELSI_AVX2 void gated_rows_avx2(GatedActivation kind, float* gate, const float* up, int64_t rows, int64_t width) {
  const __m256 one = _mm256_set1_ps(1.f), top = _mm256_set1_ps(kExpMax);
  for (int64_t r = 0; r < rows; ++r) {
    float* g = gate + r * width;
    const float* u = up + r * width;
    int64_t i = 0;
    for (; i + 8 <= width; i += 8) {
      const __m256 x = _mm256_loadu_ps(g + i);
      __m256 arg = _mm256_sub_ps(_mm256_setzero_ps(), x);
      if (kind == GatedActivation::kGeluTanh)
        arg = _mm256_mul_ps(_mm256_set1_ps(-1.5957691216057308f),
                            _mm256_fmadd_ps(_mm256_mul_ps(_mm256_mul_ps(x, x), x), _mm256_set1_ps(0.044715f), x));
      const __m256 e = simd::exp8(_mm256_min_ps(arg, top));
      _mm256_storeu_ps(g + i, _mm256_mul_ps(_mm256_div_ps(x, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
    }
    for (; i < width; ++i) g[i] = gated_scalar(kind, g[i]) * u[i];
  }
}

void require(bool ok, const std::string& message) {
  if (!ok) throw std::invalid_argument("NativeTarget: " + message);
}

void check_matrix(const QuantMatrix& m, int64_t rows, int64_t cols, const char* name) {
  require(m.data != nullptr && m.rows == rows && m.cols == cols,
          std::string(name) + " must be [" + std::to_string(rows) + ", " + std::to_string(cols) + "], got [" +
              std::to_string(m.rows) + ", " + std::to_string(m.cols) + "]");
}

// Rotates pairs (2i, 2i+1) of every head of the n rows of x [n, heads * hd], row t at positions[t].
void rope(float* x, int64_t n, int64_t heads, int64_t hd, const int64_t* positions, const std::vector<float>& inv_freq) {
  std::vector<float> cos_t(hd / 2), sin_t(hd / 2);
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t i = 0; i < hd / 2; ++i) {
      const float angle = static_cast<float>(positions[t]) * inv_freq[i];
      cos_t[i] = std::cos(angle), sin_t[i] = std::sin(angle);
    }
    for (int64_t h = 0; h < heads; ++h) {
      float* v = x + (t * heads + h) * hd;
      for (int64_t i = 0; i < hd / 2; ++i) {
        const float a = v[2 * i], b = v[2 * i + 1];
        v[2 * i] = a * cos_t[i] - b * sin_t[i];
        v[2 * i + 1] = b * cos_t[i] + a * sin_t[i];
      }
    }
  }
}

}  // namespace

NativeTarget::NativeTarget(const NativeTargetConfig& c, NativeTargetWeights weights)
    : config_(c), w_(std::move(weights)) {
  require(c.layers > 0 && c.hidden > 0 && c.heads > 0 && c.kv_heads > 0 && c.ffn > 0 && c.vocab > 0,
          "every dimension must be positive");
  require(c.heads % c.kv_heads == 0, "heads must be a multiple of kv_heads");
  require(c.head_dim > 0 && c.head_dim % 2 == 0, "head_dim must be even");
  require(c.capacity > 0, "capacity must be positive");
  require(c.sequences > 0, "sequences must be positive");
  require(static_cast<int64_t>(w_.layers.size()) == c.layers, "one weight set per layer");
  require(static_cast<int64_t>(w_.inv_freq.size()) == c.head_dim / 2, "inv_freq must hold head_dim / 2 values");
  if (c.gemma3) {
    require(static_cast<int64_t>(w_.inv_freq_local.size()) == c.head_dim / 2,
            "inv_freq_local must hold head_dim / 2 values");
    require(c.sliding_window > 0 && c.query_scale > 0.f, "Gemma 3 needs a sliding window and a query scale");
    for (const NativeLayer& l : w_.layers)
      require(l.q_norm && l.k_norm && l.post_attn_norm && l.post_ffn_norm, "every Gemma 3 layer needs its six norms");
  }
  const int64_t d = c.hidden, qd = c.heads * c.head_dim, kvd = c.kv_heads * c.head_dim;
  check_matrix(w_.embed, c.vocab, d, "embed");
  check_matrix(w_.head, c.vocab, d, "head");
  for (const NativeLayer& l : w_.layers) {
    check_matrix(l.q, qd, d, "attn_q"), check_matrix(l.k, kvd, d, "attn_k"), check_matrix(l.v, kvd, d, "attn_v");
    check_matrix(l.o, d, qd, "attn_output");
    check_matrix(l.gate, c.ffn, d, "ffn_gate"), check_matrix(l.up, c.ffn, d, "ffn_up");
    check_matrix(l.down, d, c.ffn, "ffn_down");
    require(l.attn_norm && l.ffn_norm, "every layer needs its two norms");
  }
  require(w_.final_norm != nullptr, "the final norm is missing");
  k_cache_.assign(c.sequences * c.layers * c.kv_heads * c.capacity * c.head_dim, 0.f);
  v_cache_.assign(k_cache_.size(), 0.f);
  lengths_.assign(c.sequences, 0);
  const int64_t rows = kLinearMaxRows;
  row_seq_.resize(rows), row_pos_.resize(rows);
  h_.resize(rows * d), xn_.resize(rows * std::max(d, qd)), q_.resize(rows * qd), k_.resize(rows * kvd);
  v_.resize(rows * kvd), att_.resize(rows * qd), proj_.resize(rows * d), gate_.resize(rows * c.ffn);
  up_.resize(rows * c.ffn);
}

int64_t NativeTarget::length(int64_t seq) const {
  require(seq >= 0 && seq < config_.sequences, "sequence " + std::to_string(seq) + " outside [0, " +
                                                   std::to_string(config_.sequences) + ")");
  return lengths_[seq];
}

void NativeTarget::rollback(int64_t position, int64_t seq) {
  const int64_t held = length(seq);
  require(position >= 0 && position <= held,
          "rollback to " + std::to_string(position) + " outside [0, " + std::to_string(held) + "]");
  lengths_[seq] = position;
}

int64_t NativeTarget::cache_offset(int64_t seq, int64_t layer) const {
  return (seq * config_.layers + layer) * config_.kv_heads * config_.capacity * config_.head_dim;
}

void NativeTarget::normed_products(const float* norm, const QuantMatrix* mats, float* const* outs, int count,
                                   int64_t n, int num_threads) {
  rms_norm_cpu(h_.data(), norm, n, config_.hidden, config_.eps, xn_.data());
  quantize_input(xn_.data(), n, config_.hidden, xq_);
  quant_linear_cpu(mats, outs, count, xq_, num_threads);
}

void NativeTarget::project(const float* x, int64_t cols, const QuantMatrix& m, int64_t n, int num_threads) {
  quantize_input(x, n, cols, xq_);
  float* const proj[1] = {proj_.data()};
  quant_linear_cpu(&m, proj, 1, xq_, num_threads);
}

void NativeTarget::attention_block(const NativeLayer& w, int64_t layer, int64_t n, int num_threads) {
  const NativeTargetConfig& c = config_;
  const int64_t d = c.hidden, hd = c.head_dim;
  const QuantMatrix qkv[3] = {w.q, w.k, w.v};
  float* const outs[3] = {q_.data(), k_.data(), v_.data()};
  normed_products(w.attn_norm, qkv, outs, 3, n, num_threads);
  rope(q_.data(), n, c.heads, hd, row_pos_.data(), w_.inv_freq);
  rope(k_.data(), n, c.kv_heads, hd, row_pos_.data(), w_.inv_freq);
  append_kv(layer, n);
  attend(layer, n, 1.0f / std::sqrt(static_cast<float>(hd)), 0, num_threads);
  project(att_.data(), c.heads * hd, w.o, n, num_threads);
  for (int64_t i = 0; i < n * d; ++i) h_[i] += proj_[i];
}

void NativeTarget::append_kv(int64_t layer, int64_t n) {
  const NativeTargetConfig& c = config_;
  const int64_t hd = c.head_dim, kvd = c.kv_heads * hd;
  for (int64_t t = 0; t < n; ++t)
    for (int64_t g = 0; g < c.kv_heads; ++g) {
      const int64_t slot = cache_offset(row_seq_[t], layer) + (g * c.capacity + row_pos_[t]) * hd;
      std::copy_n(k_.data() + t * kvd + g * hd, hd, k_cache_.data() + slot);
      std::copy_n(v_.data() + t * kvd + g * hd, hd, v_cache_.data() + slot);
    }
}

void NativeTarget::attend(int64_t layer, int64_t n, float scale, int64_t window, int num_threads) {
  const NativeTargetConfig& c = config_;
  const int64_t hd = c.head_dim;
  DecodeAttention a{};
  a.q = q_.data();
  a.q_head_stride = hd;
  a.q_row_stride = c.heads * hd;
  a.k = k_cache_.data() + cache_offset(row_seq_[0], layer);
  a.v = v_cache_.data() + cache_offset(row_seq_[0], layer);
  a.kv_head_stride = c.capacity * hd;
  a.causal = true;
  a.heads = c.heads;
  a.kv_heads = c.kv_heads;
  a.rows = n;
  a.keys = row_pos_[n - 1] + 1;
  a.head_dim = hd;
  a.scale = scale;
  a.out = att_.data();
  a.window = std::max<int64_t>(0, window);
  if (one_sequence_) return decode_attention_cpu(a, num_threads);
  // Rows of other sequences see other caches, so rows run one by one (a row's result is the same
  // as in a one-token forward).
  for (int64_t t = 0; t < n; ++t) {
    const int64_t position = row_pos_[t], offset = cache_offset(row_seq_[t], layer);
    const int64_t first = window > 0 ? std::max<int64_t>(0, position - window + 1) : 0;
    DecodeAttention r = a;
    r.window = 0;
    r.q = q_.data() + t * c.heads * hd;
    r.k = k_cache_.data() + offset + first * hd;
    r.v = v_cache_.data() + offset + first * hd;
    r.rows = 1;
    r.keys = position + 1 - first;
    r.out = att_.data() + t * c.heads * hd;
    decode_attention_cpu(r, num_threads);
  }
}

void NativeTarget::mlp_block(const NativeLayer& w, int64_t n, int num_threads) {
  const NativeTargetConfig& c = config_;
  const QuantMatrix gate_up[2] = {w.gate, w.up};
  float* const outs[2] = {gate_.data(), up_.data()};
  normed_products(w.ffn_norm, gate_up, outs, 2, n, num_threads);
  gated_activation_rows(GatedActivation::kSilu, gate_.data(), up_.data(), n, c.ffn);
  project(gate_.data(), c.ffn, w.down, n, num_threads);
  for (int64_t i = 0; i < n * c.hidden; ++i) h_[i] += proj_[i];
}

void NativeTarget::forward(const int64_t* tokens, int64_t n, const int64_t* seqs, const int64_t* logit_rows,
                           int64_t n_logits, float* logits, const int64_t* aux_layers, int64_t n_aux, float* aux,
                           int num_threads, int64_t* greedy) {
  const NativeTargetConfig& c = config_;
  const int64_t d = c.hidden;
  require(n >= 1 && n <= kLinearMaxRows,
          "a forward takes 1.." + std::to_string(kLinearMaxRows) + " tokens, got " + std::to_string(n));
  // Each row's sequence and position: its sequence's length plus the rows of it before this one.
  std::vector<int64_t> added(c.sequences, 0);
  for (int64_t t = 0; t < n; ++t) {
    const int64_t seq = seqs ? seqs[t] : 0;
    require(seq >= 0 && seq < c.sequences, "sequence " + std::to_string(seq) + " outside [0, " +
                                               std::to_string(c.sequences) + ")");
    row_seq_[t] = seq, row_pos_[t] = lengths_[seq] + added[seq]++;
    require(row_pos_[t] < c.capacity, "context of " + std::to_string(row_pos_[t] + 1) +
                                          " tokens is past the KV cache capacity of " + std::to_string(c.capacity));
  }
  one_sequence_ = std::all_of(row_seq_.begin(), row_seq_.begin() + n, [&](int64_t s) { return s == row_seq_[0]; });
  for (int64_t t = 0; t < n; ++t)
    require(tokens[t] >= 0 && tokens[t] < c.vocab,
            "token " + std::to_string(tokens[t]) + " outside the vocabulary of " + std::to_string(c.vocab));
  for (int64_t i = 0; i < n_logits; ++i)
    require(logit_rows[i] >= 0 && logit_rows[i] < n, "logit row " + std::to_string(logit_rows[i]) + " outside [0, " +
                                                         std::to_string(n) + ")");
  for (int64_t i = 0; i < n_aux; ++i)
    require(aux_layers[i] >= 0 && aux_layers[i] <= c.layers, "aux layer " + std::to_string(aux_layers[i]) +
                                                                 " outside [0, " + std::to_string(c.layers) + "]");
  auto capture = [&](int64_t l) {
    for (int64_t i = 0; i < n_aux; ++i)
      if (aux_layers[i] == l)
        for (int64_t t = 0; t < n; ++t) std::copy_n(h_.data() + t * d, d, aux + (t * n_aux + i) * d);
  };
  for (int64_t t = 0; t < n; ++t) dequantize_row(w_.embed, tokens[t], h_.data() + t * d);
  if (c.gemma3)
    for (int64_t i = 0; i < n * d; ++i) h_[i] *= c.embed_scale;
  for (int64_t l = 0; l < c.layers; ++l) {
    capture(l);
    if (c.gemma3) {
      gemma3_attention_block(w_.layers[l], l, n, num_threads);
      gemma3_mlp_block(w_.layers[l], n, num_threads);
    } else {
      attention_block(w_.layers[l], l, n, num_threads);
      mlp_block(w_.layers[l], n, num_threads);
    }
  }
  capture(c.layers);
  for (int64_t seq = 0; seq < c.sequences; ++seq) lengths_[seq] += added[seq];
  if (n_logits == 0) return;
  for (int64_t i = 0; i < n_logits; ++i)
    rms_norm_cpu(h_.data() + logit_rows[i] * d, w_.final_norm, 1, d, c.eps, xn_.data() + i * d);
  quantize_input(xn_.data(), n_logits, d, xq_);
  if (logits == nullptr) {
    logits_.resize(n_logits * c.vocab);
    logits = logits_.data();
  }
  float* const out[1] = {logits};
  quant_linear_cpu(&w_.head, out, 1, xq_, num_threads);
  if (greedy) argmax_rows_cpu(logits, n_logits, c.vocab, greedy, num_threads);
}

void gated_activation_rows(GatedActivation kind, float* gate, const float* up, int64_t rows, int64_t width) {
  const char* isa = cpu_isa();
  if (std::strcmp(isa, "avx512") == 0) return gated_rows_avx512(kind, gate, up, rows, width);
  if (std::strcmp(isa, "avx2") == 0) return gated_rows_avx2(kind, gate, up, rows, width);
  for (int64_t i = 0; i < rows * width; ++i) gate[i] = gated_scalar(kind, gate[i]) * up[i];
}

}  // namespace elsi_fast

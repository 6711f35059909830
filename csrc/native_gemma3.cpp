// Gemma 3's decoder blocks in the fused forward (native_target.h, docs/native-target.md), after
// transformers' Gemma3DecoderLayer: the input norm, Q/K/V, per-head RMSNorm of q and k, RoPE
// (rotate_half pairs (i, i + hd/2); the local base on sliding-window layers), attention over the
// sliding window or the whole context with the query scale query_pre_attn_scalar^-1/2, the output
// projection, its post-attention norm and the residual; then the pre-feedforward norm, the
// tanh-GELU-gated MLP, its post-feedforward norm and the residual. The embedding scale, the final
// norm and the tied head are native_target.cpp's. Every norm weight is the file's (1 + w).

#include <cmath>
#include <vector>

#include "native_target.h"
#include "target_runtime.h"

namespace elsi_fast {
namespace {

// Rotates pairs (i, i + hd/2) of every head of the n rows of x [n, heads * hd], row t at positions[t].
void rope_half(float* x, int64_t n, int64_t heads, int64_t hd, const int64_t* positions,
               const std::vector<float>& inv_freq) {
  const int64_t half = hd / 2;
  std::vector<float> cos_t(half), sin_t(half);
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t i = 0; i < half; ++i) {
      const float angle = static_cast<float>(positions[t]) * inv_freq[i];
      cos_t[i] = std::cos(angle), sin_t[i] = std::sin(angle);
    }
    for (int64_t h = 0; h < heads; ++h) {
      float* v = x + (t * heads + h) * hd;
      for (int64_t i = 0; i < half; ++i) {
        const float a = v[i], b = v[i + half];
        v[i] = a * cos_t[i] - b * sin_t[i];
        v[i + half] = b * cos_t[i] + a * sin_t[i];
      }
    }
  }
}

}  // namespace

void NativeTarget::gemma3_attention_block(const NativeLayer& w, int64_t layer, int64_t n, int num_threads) {
  const NativeTargetConfig& c = config_;
  const int64_t d = c.hidden, hd = c.head_dim;
  const QuantMatrix qkv[3] = {w.q, w.k, w.v};
  float* const outs[3] = {q_.data(), k_.data(), v_.data()};
  normed_products(w.attn_norm, qkv, outs, 3, n, num_threads);
  // Per-head norms in place (rms_norm_cpu reads a value before it writes it).
  rms_norm_cpu(q_.data(), w.q_norm, n * c.heads, hd, c.eps, q_.data());
  rms_norm_cpu(k_.data(), w.k_norm, n * c.kv_heads, hd, c.eps, k_.data());
  const std::vector<float>& inv_freq = w.sliding ? w_.inv_freq_local : w_.inv_freq;
  rope_half(q_.data(), n, c.heads, hd, row_pos_.data(), inv_freq);
  rope_half(k_.data(), n, c.kv_heads, hd, row_pos_.data(), inv_freq);
  append_kv(layer, n);
  attend(layer, n, c.query_scale, w.sliding ? c.sliding_window : 0, num_threads);
  project(att_.data(), c.heads * hd, w.o, n, num_threads);
  rms_norm_cpu(proj_.data(), w.post_attn_norm, n, d, c.eps, xn_.data());
  for (int64_t i = 0; i < n * d; ++i) h_[i] += xn_[i];
}

void NativeTarget::gemma3_mlp_block(const NativeLayer& w, int64_t n, int num_threads) {
  const NativeTargetConfig& c = config_;
  const int64_t d = c.hidden;
  const QuantMatrix gate_up[2] = {w.gate, w.up};
  float* const outs[2] = {gate_.data(), up_.data()};
  normed_products(w.ffn_norm, gate_up, outs, 2, n, num_threads);
  gated_activation_rows(GatedActivation::kGeluTanh, gate_.data(), up_.data(), n, c.ffn);  // transformers' gelu_pytorch_tanh
  project(gate_.data(), c.ffn, w.down, n, num_threads);
  rms_norm_cpu(proj_.data(), w.post_ffn_norm, n, d, c.eps, xn_.data());
  for (int64_t i = 0; i < n * d; ++i) h_[i] += xn_[i];
}

}  // namespace elsi_fast

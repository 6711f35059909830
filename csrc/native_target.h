// The fused native forward of a Llama-family or Gemma 3 target (docs/native-target.md): one call runs the
// whole decoder stack for 1..kLinearMaxRows new tokens on GGUF-quantized weights (quant_linear.h)
// and a KV cache this object owns. No torch headers.
//
// Every step computes a token row in an order that does not depend on the other rows, so a verify
// forward of k+1 tokens gives exactly the logits of k+1 one-token forwards. The KV cache holds
// `sequences` independent sequences: one forward may carry rows of several (batched generation,
// one product over all rows; attention per row over its own sequence), and each row's logits are
// those of the same row forwarded alone.
#pragma once

#include <cstdint>
#include <vector>

#include "quant_linear.h"

namespace elsi_fast {

struct NativeTargetConfig {
  int64_t layers;
  int64_t hidden;     // d
  int64_t heads;      // H
  int64_t kv_heads;   // H_kv, H % H_kv == 0
  int64_t head_dim;   // even
  int64_t ffn;        // MLP width
  int64_t vocab;
  int64_t capacity;   // KV cache positions per sequence
  float eps;          // RMSNorm epsilon
  // Gemma 3 (native_gemma3.cpp): false for a Llama, which ignores the rest.
  bool gemma3 = false;
  float embed_scale = 1.f;     // the embedding row times sqrt(hidden)
  float query_scale = 0.f;     // query_pre_attn_scalar^-1/2 (a Llama: 1 / sqrt(head_dim))
  int64_t sliding_window = 0;  // keys a sliding layer's query sees, its own included
  int64_t sequences = 1;       // independent sequences the KV cache holds
};

// Weights as the GGUF file holds them. A Llama's q and k rows are in the file's RoPE layout:
// llama.cpp's converter permutes each head's rows so that rotating pairs (2i, 2i+1) equals
// transformers' rotate_half on the original rows; attention scores do not see the permutation.
// Gemma 3's rows are transformers' own (rotate_half: pairs (i, i + hd/2)), and its norm weights are
// stored as 1 + w, the factor Gemma's RMSNorm applies, so every norm here is weight * x / rms(x).
struct NativeLayer {
  const float* attn_norm;  // [d]
  QuantMatrix q, k, v, o;  // [H hd, d], [H_kv hd, d], [H_kv hd, d], [d, H hd]
  const float* ffn_norm;   // [d]
  QuantMatrix gate, up, down;  // [ffn, d], [ffn, d], [d, ffn]
  // Gemma 3 only (null for a Llama).
  const float* q_norm = nullptr;          // [hd], per head
  const float* k_norm = nullptr;          // [hd]
  const float* post_attn_norm = nullptr;  // [d]
  const float* post_ffn_norm = nullptr;   // [d]
  bool sliding = false;                   // sliding-window layer (local RoPE base)
};

struct NativeTargetWeights {
  QuantMatrix embed;  // [vocab, d]
  std::vector<NativeLayer> layers;
  const float* final_norm;  // [d]
  QuantMatrix head;         // [vocab, d] (the embedding when tied)
  std::vector<float> inv_freq;  // [head_dim / 2]: angle of pair i at position p = float(p) * inv_freq[i]
  std::vector<float> inv_freq_local;  // Gemma 3's sliding layers (their own RoPE base); else empty
};

class NativeTarget {
 public:
  NativeTarget(const NativeTargetConfig& config, NativeTargetWeights weights);

  // Positions held in the KV cache of sequence `seq`.
  int64_t length(int64_t seq = 0) const;
  const NativeTargetConfig& config() const { return config_; }
  // Forgets positions [position, length(seq)) of sequence `seq` (draft tokens the verify rejected).
  void rollback(int64_t position, int64_t seq = 0);

  // Appends n (1..kLinearMaxRows) tokens: row t to sequence seqs[t] (seqs null: all to sequence 0)
  // at that sequence's next position, rows of one sequence in row order.
  //   logits [n_logits, vocab] for the token rows logit_rows[0..n_logits) (after the final norm);
  //   aux    [n, n_aux, d]: hidden state h_l for l = aux_layers[i] (h_0 the embeddings, h_l the
  //          input of block l, h_layers the last block's output before the final norm).
  //   greedy [n_logits] (if not null): each logits row's argmax (argmax_rows_cpu); `logits` may then
  //          be null, the forward's own buffer holding them.
  // Throws std::invalid_argument on a token outside the vocabulary, a row or layer out of range or
  // a context past the capacity (nothing is appended then).
  void forward(const int64_t* tokens, int64_t n, const int64_t* seqs, const int64_t* logit_rows, int64_t n_logits,
               float* logits, const int64_t* aux_layers, int64_t n_aux, float* aux, int num_threads,
               int64_t* greedy = nullptr);

 private:
  void attention_block(const NativeLayer& w, int64_t layer, int64_t n, int num_threads);
  void mlp_block(const NativeLayer& w, int64_t n, int num_threads);
  // Gemma 3's blocks (native_gemma3.cpp).
  void gemma3_attention_block(const NativeLayer& w, int64_t layer, int64_t n, int num_threads);
  void gemma3_mlp_block(const NativeLayer& w, int64_t n, int num_threads);
  // The norm of h_'s n rows (weights `norm`) into xn_, int8-quantized, times each of the `count`
  // matrices into outs[i]: the products that open an attention or MLP block.
  void normed_products(const float* norm, const QuantMatrix* mats, float* const* outs, int count, int64_t n,
                       int num_threads);
  // x [n, cols] int8-quantized, times m into proj_: the products that close a block.
  void project(const float* x, int64_t cols, const QuantMatrix& m, int64_t n, int num_threads);
  // k_ and v_ of the n new rows into their sequences' caches of `layer`.
  void append_kv(int64_t layer, int64_t n);
  // att_ = attention of the n rows of q_ over their sequences' caches of `layer` (causal); window > 0:
  // a row at position p sees keys (p - window, p] only. Rows of one sequence starting at its length
  // go in one call, other forwards one row at a time (the same result per row).
  void attend(int64_t layer, int64_t n, float scale, int64_t window, int num_threads);
  // Offset of (sequence, layer) in k_cache_ / v_cache_.
  int64_t cache_offset(int64_t seq, int64_t layer) const;

  NativeTargetConfig config_;
  NativeTargetWeights w_;
  std::vector<int64_t> lengths_;          // [sequences]
  std::vector<float> k_cache_, v_cache_;  // [sequences, layers, H_kv, capacity, hd]
  // The rows of the forward under way: their sequences and positions; whether all are one sequence.
  std::vector<int64_t> row_seq_, row_pos_;
  bool one_sequence_ = true;
  // Scratch of one forward, sized for kLinearMaxRows rows.
  std::vector<float> h_, xn_, q_, k_, v_, att_, proj_, gate_, up_;
  std::vector<float> logits_;  // a greedy forward's logits, when the caller wants only their argmax
  QuantInput xq_;
};

// gate [rows, width] = act(gate) * up, row by row (each row the same steps whatever `rows` is): SiLU
// (x / (1 + exp(-x))) or Gemma's tanh-GELU (0.5 x (1 + tanh(u)) = x / (1 + exp(-2u)), u = sqrt(2/pi)
// (x + 0.044715 x^3)), with the vector exponential of simd.h on AVX2 / AVX-512 and the rows' last
// width % 8 (16) columns in scalar fp32. Row by row in glibc, a Gemma 3 row took 36,864 tanh calls per
// forward, about 0.45 ms on the Intel Xeon.
enum class GatedActivation { kSilu, kGeluTanh };
void gated_activation_rows(GatedActivation kind, float* gate, const float* up, int64_t rows, int64_t width);

}  // namespace elsi_fast

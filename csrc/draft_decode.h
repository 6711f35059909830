// Plain-C++ description of one EAGLE3 draft decode step, shared by the CPU kernel, the CUDA kernels
// and the torch op wrappers. No torch headers here: the kernel translation units stay cheap to
// compile and the .cu file builds with a bare nvcc.
#pragma once

#include <cstdint>

namespace elsi_fast {

enum class WeightType : int32_t { kFloat32 = 0, kBFloat16 = 1, kInt8 = 2 };
// How a weight matrix is stored. Row-major is nn.Linear's own [out, in] (the module's weights, no
// copies). Packed (NativeDraftDecoder) is [ceil(out / kPackRows), ceil(in / C), kPackRows, C] with
// C = pack_cols(element size) columns, one cache line, per tile row; zero padded. A kernel
// multiplies kPackRows rows at once, and packed they lie in one contiguous run read line after line,
// so every product is one sequential stream. Row-major, the kPackRows interleaved streams restart
// every row group and the prefetchers fall behind (Zen 4: int8 products read at ~0.5x of a plain
// sum's bandwidth row-major). Tiles wider than a line (tried: 64 fp32 columns, 4 lines a row) read
// each tile out of order and were slower than row-major for fp32.
enum class WeightLayout : int32_t { kRowMajor = 0, kPacked = 1 };
constexpr int64_t kPackRows = 4;
constexpr int64_t kPackRowBytes = 64;
// Columns of a tile row: 16 fp32, 32 bf16, 64 int8.
constexpr int64_t pack_cols(int64_t element_bytes) { return kPackRowBytes / element_bytes; }

// Element type of activations the caller hands in or gets back (input, hidden out, embedding, cache).
enum class ActType : int32_t { kFloat32 = 0, kBFloat16 = 1 };

// Shapes of the draft head.
struct DraftDims {
  int64_t hidden;          // d
  int64_t fc_in;           // m * d_target (fc input width)
  int64_t num_heads;       // H
  int64_t num_kv_heads;    // H_kv (H % H_kv == 0)
  int64_t head_dim;        // even
  int64_t intermediate;    // I
  int64_t draft_vocab;     // V_d
  int64_t max_len;         // KV cache slots
  float eps;               // RMSNorm epsilon
};

// Weights row-major as the torch module holds them (nn.Linear layout: [out, in]), so a module in the
// kernel's weight type is used without copies, or packed (WeightLayout; int8 weights are always
// packed). `scale_*` are per-output-row fp32 scales for int8 weights, null otherwise.
//   fc [d, fc_in]; q [H hd, 2d]; k, v [H_kv hd, 2d]; o [d, H hd]; gate, up [I, d]; down [d, I];
//   lm_head [V_d, d]
//   norms    [4, d] fp32: hidden_norm, input_layernorm, post_attention_layernorm, norm
//   inv_freq [head_dim / 2] fp32 RoPE inverse frequencies (angle = float(position) * inv_freq)
//   d2t      [V_d] int64 offsets (target id = draft id + d2t[draft id])
//   embed    [target vocab, d] (the target's token embedding)
enum Matrix : int { kFc = 0, kQ, kK, kV, kO, kGate, kUp, kDown, kLmHead, kNumMatrices };

struct DraftWeights {
  WeightType weight_type;
  WeightLayout layout;  // of every matrix; the CUDA kernels take row-major only
  const void* matrix[kNumMatrices];
  const float* scale[kNumMatrices];
  const float* norms;
  const float* inv_freq;
  const int64_t* d2t;
  ActType embed_type;
  const void* embed;
  int64_t embed_rows;  // target vocabulary size
};

// One step's inputs and outputs. Caches are [H_kv, max_len, head_dim] (one batch row of the torch
// module's DraftKVCache); slot `position` is written, slots [0, position] are attended.
struct DraftStep {
  const void* input;    // [fc_in] when from_target, else [d]; element type input_type
  ActType input_type;   // also the type of out_hidden
  bool from_target;
  int64_t token;        // CPU only: row of embed (the CUDA path reads token_ptr)
  int64_t position;     // CPU only (the CUDA path reads position_ptr)
  ActType cache_type;
  void* k_cache;
  void* v_cache;
  int64_t top_k;        // CPU: 0 writes the position's key and value only (an accepted run's positions
                        // before its last need nothing else), out_ids and out_hidden untouched
  int64_t* out_ids;     // [top_k] target-vocabulary ids, best first
  void* out_hidden;     // [d] pre-norm hidden state fed back to the next step
};

// Which CPU instruction set the kernel dispatches to on this machine: "avx512", "avx2" or "scalar".
const char* cpu_isa();

// Switches the CPU kernels to `name` ("avx512", "avx2", "scalar") if this CPU supports it; returns
// false (and changes nothing) otherwise. Lets tests exercise every code path on one machine.
bool set_cpu_isa(const char* name);

// Runs one decode step on the CPU with `num_threads` threads of the extension's pool
// (common/cpu_pool.h). Shapes and bounds are validated by the caller.
void draft_decode_step_cpu(const DraftDims& dims, const DraftWeights& weights, const DraftStep& step,
                           int num_threads);

// Largest top_k the CUDA kernel supports (per-block candidates live in shared memory).
constexpr int64_t kMaxCudaTopK = 32;

#ifdef ELSI_FAST_WITH_CUDA
// CUDA: bf16 weights; token and position are device scalars so the step can be captured in a CUDA
// graph. `workspace` must hold draft_decode_cuda_workspace_floats(dims, top_k) floats.
int64_t draft_decode_cuda_workspace_floats(const DraftDims& dims, int64_t top_k);
void draft_decode_step_cuda(const DraftDims& dims, const DraftWeights& weights, const DraftStep& step,
                            const int64_t* token_ptr, const int64_t* position_ptr, float* workspace,
                            void* stream);
#endif

}  // namespace elsi_fast

// Fused CUDA decode step of the EAGLE3 draft head: bf16 weights, fp32 accumulation, 8 launches.
//
//   1. fc GEMV (target features) or input -> fp32 copy (fed-back hidden)
//   2. both RMSNorms + embedding-first concat + q/k/v + RoPE + KV-cache append
//   3. GQA attention over the cache, one block per query head
//   4. o_proj GEMV + residual
//   5. post-attention RMSNorm + gate/up + SwiGLU
//   6. down GEMV + residual (the hidden state fed back)
//   7. final RMSNorm + lm_head + per-block top-k (draft logits stay in shared memory)
//   8. merge of the per-block candidates + d2t remap
//
// Token and position are read from device memory and no launch depends on host-side values that
// change between steps, so the whole step can be captured once in a CUDA graph and replayed.
// Plain CUDA (no ATen) so that `nvcc -c` builds it without torch's CUDA headers.

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <cmath>
#include <cstdint>

#include "draft_decode.h"

namespace elsi_fast {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kLmRowsPerBlock = 64;   // lm_head rows whose logits one block keeps in shared memory
static_assert(kLmRowsPerBlock == 64, "the per-block top-k gives each lane of one warp two rows");
constexpr int kMergeThreads = 1024;
constexpr size_t kDefaultSmem = 48 * 1024;

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ void store(float* p, float v) { *p = v; }
__device__ __forceinline__ void store(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Sum over the block; `scratch` holds kWarps floats. Every thread gets the result.
__device__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float total = 0.f;
  for (int i = 0; i < (int)(blockDim.x >> 5); ++i) total += scratch[i];
  return total;
}

// Eight bf16 packed in a uint4 times eight x values.
template <typename XT>
__device__ __forceinline__ float dot8(uint4 w, const XT* x) {
  const uint32_t words[4] = {w.x, w.y, w.z, w.w};
  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    acc += __uint_as_float(words[i] << 16) * to_float(x[2 * i]);
    acc += __uint_as_float(words[i] & 0xffff0000u) * to_float(x[2 * i + 1]);
  }
  return acc;
}

// dot(w row, x) reduced over the warp (every lane gets it). 16-byte aligned rows whose width is a
// multiple of 8 stream with 16-byte loads, several in flight per lane.
template <typename XT>
__device__ float warp_dot(const __nv_bfloat16* w, const XT* x, int64_t cols) {
  const int lane = threadIdx.x & 31;
  float acc = 0.f;
  if ((cols & 7) == 0 && (reinterpret_cast<uintptr_t>(w) & 15) == 0) {
    const uint4* w8 = reinterpret_cast<const uint4*>(w);
    const int64_t n8 = cols >> 3;
#pragma unroll 4
    for (int64_t c = lane; c < n8; c += 32) acc += dot8(__ldg(w8 + c), x + 8 * c);
  } else {
    for (int64_t c = lane; c < cols; c += 32) acc += __bfloat162float(w[c]) * to_float(x[c]);
  }
  return warp_sum(acc);
}

// RMSNorm of n values of type T (weights fp32) into shared memory `out`; ends with a barrier.
template <typename T>
__device__ void block_rms_norm(const T* x, const float* weight, int64_t n, float eps, float* out,
                               float* scratch) {
  float sum_sq = 0.f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const float v = to_float(x[i]);
    sum_sq += v * v;
  }
  const float inv = rsqrtf(block_sum(sum_sq, scratch) / (float)n + eps);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) out[i] = weight[i] * (to_float(x[i]) * inv);
  __syncthreads();
}

__device__ __forceinline__ int64_t global_warp() { return ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5; }
__device__ __forceinline__ int64_t total_warps() { return ((int64_t)gridDim.x * blockDim.x) >> 5; }

// ---------------------------------------------------------------- 1, 4, 6: plain GEMVs
// out[r] = dot(W[r], x) + residual[r]; `out_act` optionally gets a copy in the caller's dtype.
template <typename XT, typename OT>
__global__ void gemv_kernel(const __nv_bfloat16* __restrict__ w, int64_t rows, int64_t cols,
                            const XT* __restrict__ x, const float* __restrict__ residual,
                            float* __restrict__ out, OT* __restrict__ out_act) {
  for (int64_t r = global_warp(); r < rows; r += total_warps()) {
    float v = warp_dot(w + r * cols, x, cols);
    if ((threadIdx.x & 31) == 0) {
      if (residual) v += residual[r];
      out[r] = v;
      if (out_act) store(out_act + r, v);
    }
  }
}

template <typename XT>
__global__ void to_float_kernel(const XT* __restrict__ x, int64_t n, float* __restrict__ out) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    out[i] = to_float(x[i]);
}

// ---------------------------------------------------------------- 2: norms + concat + QKV + RoPE
// One warp computes a pair of rows (i, i + head_dim/2) of a q, k or v head, so RoPE's rotate-half
// partner is at hand; k and v go straight into cache slot `position`.
template <typename CacheT>
__global__ void qkv_rope_kernel(DraftDims dims, DraftWeights w, const int64_t* __restrict__ token_ptr,
                                const int64_t* __restrict__ position_ptr, const float* __restrict__ hidden,
                                float* __restrict__ q_out, CacheT* __restrict__ k_cache,
                                CacheT* __restrict__ v_cache) {
  extern __shared__ float smem[];
  const int64_t d = dims.hidden, hd = dims.head_dim, half = hd / 2;
  float* x = smem;              // [2d]: input_layernorm(embed), hidden_norm(h)
  float* scratch = smem + 2 * d;
  const int64_t token = *token_ptr, pos = *position_ptr;
  // The host checks both bounds; a bad value on the device must still never touch foreign memory.
  if (pos < 0 || pos >= dims.max_len || token < 0 || token >= w.embed_rows) return;
  if (w.embed_type == ActType::kBFloat16)
    block_rms_norm(static_cast<const __nv_bfloat16*>(w.embed) + token * d, w.norms + d, d, dims.eps, x, scratch);
  else
    block_rms_norm(static_cast<const float*>(w.embed) + token * d, w.norms + d, d, dims.eps, x, scratch);
  block_rms_norm(hidden, w.norms, d, dims.eps, x + d, scratch);

  const int64_t nh = dims.num_heads, nkv = dims.num_kv_heads;
  const int64_t pairs = (nh + 2 * nkv) * half;
  for (int64_t p = global_warp(); p < pairs; p += total_warps()) {
    const int64_t head = p / half, i = p % half;  // heads: q 0..nh-1, k nh..nh+nkv-1, v after
    const __nv_bfloat16* mat;
    int64_t row;
    if (head < nh) {
      mat = static_cast<const __nv_bfloat16*>(w.matrix[kQ]);
      row = head * hd + i;
    } else if (head < nh + nkv) {
      mat = static_cast<const __nv_bfloat16*>(w.matrix[kK]);
      row = (head - nh) * hd + i;
    } else {
      mat = static_cast<const __nv_bfloat16*>(w.matrix[kV]);
      row = (head - nh - nkv) * hd + i;
    }
    const float x1 = warp_dot(mat + row * 2 * d, x, 2 * d);
    const float x2 = warp_dot(mat + (row + half) * 2 * d, x, 2 * d);
    if ((threadIdx.x & 31) != 0) continue;
    if (head >= nh + nkv) {
      const int64_t slot = ((head - nh - nkv) * dims.max_len + pos) * hd;
      store(v_cache + slot + i, x1);
      store(v_cache + slot + i + half, x2);
      continue;
    }
    float sin_a, cos_a;
    sincosf((float)pos * w.inv_freq[i], &sin_a, &cos_a);
    const float r1 = x1 * cos_a - x2 * sin_a, r2 = x2 * cos_a + x1 * sin_a;
    if (head < nh) {
      q_out[head * hd + i] = r1;
      q_out[head * hd + i + half] = r2;
    } else {
      const int64_t slot = ((head - nh) * dims.max_len + pos) * hd;
      store(k_cache + slot + i, r1);
      store(k_cache + slot + i + half, r2);
    }
  }
}

// ---------------------------------------------------------------- 3: attention
// Four consecutive cache elements as floats (16-byte fp32 or 8-byte bf16 loads).
__device__ __forceinline__ float4 load4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ float4 load4(const __nv_bfloat16* p) {
  const uint2 bits = *reinterpret_cast<const uint2*>(p);
  return make_float4(__uint_as_float(bits.x << 16), __uint_as_float(bits.x & 0xffff0000u),
                     __uint_as_float(bits.y << 16), __uint_as_float(bits.y & 0xffff0000u));
}

// One block per query head. Scores: one thread per cache position (each streams its own key, so
// many loads are in flight). Values: the block splits into groups of threads, each group sums a
// strided subset of positions over all of head_dim, then the groups' partial sums are added.
template <typename CacheT>
__global__ void attention_kernel(DraftDims dims, const int64_t* __restrict__ position_ptr,
                                 const float* __restrict__ q, const CacheT* __restrict__ k_cache,
                                 const CacheT* __restrict__ v_cache, float* __restrict__ scores_ws,
                                 float* __restrict__ out) {
  extern __shared__ float smem[];  // q [hd], group partial sums [groups * hd]
  __shared__ float scratch[kWarps];
  const int64_t pos = *position_ptr;
  if (pos < 0 || pos >= dims.max_len) return;
  const int64_t head = blockIdx.x, hd = dims.head_dim, ctx = pos + 1;
  const int64_t kv = head / (dims.num_heads / dims.num_kv_heads);
  const CacheT* keys = k_cache + kv * dims.max_len * hd;
  const CacheT* values = v_cache + kv * dims.max_len * hd;
  float* scores = scores_ws + head * dims.max_len;
  float* qs = smem;
  float* partial = smem + hd;
  const float scale = rsqrtf((float)hd);
  const bool vec = (hd & 3) == 0;
  for (int64_t i = threadIdx.x; i < hd; i += blockDim.x) qs[i] = q[head * hd + i];
  __syncthreads();

  float local_max = -FLT_MAX;
  for (int64_t t = threadIdx.x; t < ctx; t += blockDim.x) {
    const CacheT* key = keys + t * hd;
    float s = 0.f;
    if (vec) {
      for (int64_t i = 0; i < hd; i += 4) {
        const float4 k4 = load4(key + i);
        s += qs[i] * k4.x + qs[i + 1] * k4.y + qs[i + 2] * k4.z + qs[i + 3] * k4.w;
      }
    } else {
      for (int64_t i = 0; i < hd; ++i) s += qs[i] * to_float(key[i]);
    }
    s *= scale;
    scores[t] = s;
    local_max = fmaxf(local_max, s);
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) local_max = fmaxf(local_max, __shfl_xor_sync(0xffffffffu, local_max, offset));
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = local_max;
  __syncthreads();
  float max_s = -FLT_MAX;
  for (int i = 0; i < kWarps; ++i) max_s = fmaxf(max_s, scratch[i]);
  float denom = 0.f;
  for (int64_t t = threadIdx.x; t < ctx; t += blockDim.x) {  // the same positions this thread scored
    const float e = __expf(scores[t] - max_s);
    scores[t] = e;
    denom += e;
  }
  denom = block_sum(denom, scratch);  // its barriers also publish scores[] to the whole block

  const int per = vec ? 4 : 1;
  const int lanes = (int)min((int64_t)blockDim.x, hd / per);
  const int groups = blockDim.x / lanes, group = threadIdx.x / lanes, lane = threadIdx.x % lanes;
  if (group < groups) {
    for (int64_t i0 = (int64_t)lane * per; i0 < hd; i0 += (int64_t)lanes * per) {
      float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
      for (int64_t t = group; t < ctx; t += groups) {
        const float p = scores[t];
        if (vec) {
          const float4 v4 = load4(values + t * hd + i0);
          acc.x += p * v4.x;
          acc.y += p * v4.y;
          acc.z += p * v4.z;
          acc.w += p * v4.w;
        } else {
          acc.x += p * to_float(values[t * hd + i0]);
        }
      }
      partial[group * hd + i0] = acc.x;
      if (vec) {
        partial[group * hd + i0 + 1] = acc.y;
        partial[group * hd + i0 + 2] = acc.z;
        partial[group * hd + i0 + 3] = acc.w;
      }
    }
  }
  __syncthreads();
  for (int64_t i = threadIdx.x; i < hd; i += blockDim.x) {
    float sum = 0.f;
    for (int g = 0; g < groups; ++g) sum += partial[g * hd + i];
    out[head * hd + i] = sum / denom;
  }
}

size_t attention_smem(const DraftDims& dims) {
  // partial sums: groups * hd <= max(kThreads * 4, hd) floats (see the kernel's lane split)
  const int64_t hd = dims.head_dim;
  return (hd + (hd > 4 * kThreads ? hd : 4 * kThreads)) * sizeof(float);
}

// ---------------------------------------------------------------- 5: post-norm + SwiGLU
__global__ void swiglu_kernel(DraftDims dims, DraftWeights w, const float* __restrict__ h1,
                              float* __restrict__ act) {
  extern __shared__ float smem[];
  const int64_t d = dims.hidden;
  float* x = smem;
  block_rms_norm(h1, w.norms + 2 * d, d, dims.eps, x, smem + d);
  const __nv_bfloat16* gate = static_cast<const __nv_bfloat16*>(w.matrix[kGate]);
  const __nv_bfloat16* up = static_cast<const __nv_bfloat16*>(w.matrix[kUp]);
  for (int64_t r = global_warp(); r < dims.intermediate; r += total_warps()) {
    const float g = warp_dot(gate + r * d, x, d);
    const float u = warp_dot(up + r * d, x, d);
    if ((threadIdx.x & 31) == 0) act[r] = g / (1.f + __expf(-g)) * u;
  }
}

// ---------------------------------------------------------------- 7, 8: lm_head + top-k
// (logit, id) order: higher logit first, equal logits to the lower id (as the CPU kernel).
__device__ __forceinline__ bool better(float a, int ia, float b, int ib) {
  return a > b || (a == b && ia < ib);
}

// Warp-wide best of one (value, id) per lane.
__device__ __forceinline__ void warp_best(float& v, int& id) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, offset);
    const int oid = __shfl_xor_sync(0xffffffffu, id, offset);
    if (better(ov, oid, v, id)) {
      v = ov;
      id = oid;
    }
  }
}

__global__ void lm_head_topk_kernel(DraftDims dims, DraftWeights w, const float* __restrict__ h2, int top_k,
                                    float* __restrict__ cand_logit, int* __restrict__ cand_id) {
  extern __shared__ float smem[];
  const int64_t d = dims.hidden;
  float* x = smem;
  float* logits = smem + d;  // [kLmRowsPerBlock]
  block_rms_norm(h2, w.norms + 3 * d, d, dims.eps, x, logits + kLmRowsPerBlock);
  const __nv_bfloat16* lm = static_cast<const __nv_bfloat16*>(w.matrix[kLmHead]);
  const int64_t row0 = (int64_t)blockIdx.x * kLmRowsPerBlock;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int j = warp; j < kLmRowsPerBlock; j += kWarps) {
    const int64_t r = row0 + j;
    const float v = r < dims.draft_vocab ? warp_dot(lm + r * d, x, d) : -FLT_MAX;
    if (lane == 0) logits[j] = r < dims.draft_vocab ? v : -INFINITY;
  }
  __syncthreads();
  if (warp != 0) return;
  // k rounds of a warp argmax over the block's 64 logits (two per lane), removing each winner.
  float* out_logit = cand_logit + (int64_t)blockIdx.x * top_k;
  int* out_id = cand_id + (int64_t)blockIdx.x * top_k;
  for (int k = 0; k < top_k; ++k) {
    float v = logits[lane];
    int id = lane;
    if (better(logits[lane + 32], lane + 32, v, id)) {
      v = logits[lane + 32];
      id = lane + 32;
    }
    warp_best(v, id);
    if (lane == 0) {  // -inf marks rows past the vocabulary and winners already taken
      const int64_t r = row0 + id;
      const bool valid = r < dims.draft_vocab && v != -INFINITY;
      out_logit[k] = valid ? v : -INFINITY;
      out_id[k] = valid ? (int)r : -1;
      logits[id] = -INFINITY;
    }
    __syncwarp();
  }
}

__global__ void topk_merge_kernel(const float* __restrict__ cand_logit, int* __restrict__ cand_id, int64_t n,
                                  int top_k, const int64_t* __restrict__ d2t, int64_t* __restrict__ out_ids) {
  __shared__ float best_v[kMergeThreads / 32];
  __shared__ int best_i[kMergeThreads / 32];
  __shared__ int best_slot[kMergeThreads / 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int k = 0; k < top_k; ++k) {
    float v = -INFINITY;
    int id = INT32_MAX, slot = -1;
    for (int64_t s = threadIdx.x; s < n; s += blockDim.x) {
      const int cid = cand_id[s];
      if (cid >= 0 && better(cand_logit[s], cid, v, id)) {
        v = cand_logit[s];
        id = cid;
        slot = (int)s;
      }
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, v, offset);
      const int oid = __shfl_xor_sync(0xffffffffu, id, offset);
      const int oslot = __shfl_xor_sync(0xffffffffu, slot, offset);
      if (oslot >= 0 && (slot < 0 || better(ov, oid, v, id))) {
        v = ov;
        id = oid;
        slot = oslot;
      }
    }
    if (lane == 0) {
      best_v[warp] = v;
      best_i[warp] = id;
      best_slot[warp] = slot;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      int winner = -1;
      for (int i = 0; i < (int)(blockDim.x >> 5); ++i)
        if (best_slot[i] >= 0 && (winner < 0 || better(best_v[i], best_i[i], best_v[winner], best_i[winner])))
          winner = i;
      if (winner < 0) {  // fewer finite logits than top_k: only with non-finite weights or inputs
        out_ids[k] = -1;
      } else {
        const int draft_id = best_i[winner];
        out_ids[k] = draft_id + d2t[draft_id];
        cand_id[best_slot[winner]] = -1;  // taken
      }
    }
    __syncthreads();
  }
}

int sm_count() {
  static int count = [] {
    int device = 0, n = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device);
    return n > 0 ? n : 1;
  }();
  return count;
}

template <typename Kernel>
void allow_smem(Kernel kernel, size_t bytes) {
  if (bytes > kDefaultSmem) cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes);
}

int64_t lm_blocks(const DraftDims& dims) { return (dims.draft_vocab + kLmRowsPerBlock - 1) / kLmRowsPerBlock; }

template <typename CacheT, typename ActT>
void launch_all(const DraftDims& dims, const DraftWeights& w, const DraftStep& step, const int64_t* token_ptr,
                const int64_t* position_ptr, float* ws, cudaStream_t stream) {
  const int64_t d = dims.hidden, nh = dims.num_heads, hd = dims.head_dim;
  float* h = ws;
  float* q = h + d;
  float* scores = q + nh * hd;
  float* attn = scores + nh * dims.max_len;
  float* h1 = attn + nh * hd;
  float* act = h1 + d;
  float* h2 = act + dims.intermediate;
  float* cand_logit = h2 + d;
  int* cand_id = reinterpret_cast<int*>(cand_logit + lm_blocks(dims) * step.top_k);
  const int wide_grid = 4 * sm_count();  // grid-stride kernels: enough warps to keep HBM busy
  auto rows_grid = [&](int64_t rows) { return (int)((rows + kWarps - 1) / kWarps); };
  CacheT* k_cache = static_cast<CacheT*>(step.k_cache);
  CacheT* v_cache = static_cast<CacheT*>(step.v_cache);
  const ActT* input = static_cast<const ActT*>(step.input);
  auto mat = [&](int i) { return static_cast<const __nv_bfloat16*>(w.matrix[i]); };

  if (step.from_target)
    gemv_kernel<ActT, float><<<rows_grid(d), kThreads, 0, stream>>>(mat(kFc), d, dims.fc_in, input, nullptr, h, nullptr);
  else
    to_float_kernel<ActT><<<(int)((d + kThreads - 1) / kThreads), kThreads, 0, stream>>>(input, d, h);

  const size_t qkv_smem = (2 * d + kWarps) * sizeof(float);
  allow_smem(qkv_rope_kernel<CacheT>, qkv_smem);
  qkv_rope_kernel<CacheT><<<wide_grid, kThreads, qkv_smem, stream>>>(dims, w, token_ptr, position_ptr, h, q,
                                                                     k_cache, v_cache);
  const size_t attn_smem = attention_smem(dims);
  allow_smem(attention_kernel<CacheT>, attn_smem);
  attention_kernel<CacheT><<<(int)nh, kThreads, attn_smem, stream>>>(dims, position_ptr, q, k_cache, v_cache,
                                                                      scores, attn);
  gemv_kernel<float, float><<<rows_grid(d), kThreads, 0, stream>>>(mat(kO), d, nh * hd, attn, h, h1, nullptr);

  const size_t mlp_smem = (d + kWarps) * sizeof(float);
  allow_smem(swiglu_kernel, mlp_smem);
  swiglu_kernel<<<wide_grid, kThreads, mlp_smem, stream>>>(dims, w, h1, act);
  gemv_kernel<float, ActT><<<rows_grid(d), kThreads, 0, stream>>>(mat(kDown), d, dims.intermediate, act, h1, h2,
                                                                   static_cast<ActT*>(step.out_hidden));

  const size_t lm_smem = (d + kLmRowsPerBlock + kWarps) * sizeof(float);
  allow_smem(lm_head_topk_kernel, lm_smem);
  lm_head_topk_kernel<<<(int)lm_blocks(dims), kThreads, lm_smem, stream>>>(dims, w, h2, (int)step.top_k,
                                                                          cand_logit, cand_id);
  topk_merge_kernel<<<1, kMergeThreads, 0, stream>>>(cand_logit, cand_id, lm_blocks(dims) * step.top_k,
                                                     (int)step.top_k, w.d2t, step.out_ids);
}

}  // namespace

int64_t draft_decode_cuda_workspace_floats(const DraftDims& dims, int64_t top_k) {
  const int64_t nh = dims.num_heads, hd = dims.head_dim;
  return dims.hidden * 3 + nh * hd * 2 + nh * dims.max_len + dims.intermediate + 2 * lm_blocks(dims) * top_k;
}

void draft_decode_step_cuda(const DraftDims& dims, const DraftWeights& weights, const DraftStep& step,
                            const int64_t* token_ptr, const int64_t* position_ptr, float* workspace,
                            void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const bool bf16_cache = step.cache_type == ActType::kBFloat16;
  const bool bf16_act = step.input_type == ActType::kBFloat16;
  if (bf16_cache && bf16_act)
    launch_all<__nv_bfloat16, __nv_bfloat16>(dims, weights, step, token_ptr, position_ptr, workspace, s);
  else if (bf16_cache)
    launch_all<__nv_bfloat16, float>(dims, weights, step, token_ptr, position_ptr, workspace, s);
  else if (bf16_act)
    launch_all<float, __nv_bfloat16>(dims, weights, step, token_ptr, position_ptr, workspace, s);
  else
    launch_all<float, float>(dims, weights, step, token_ptr, position_ptr, workspace, s);
}

}  // namespace elsi_fast

// torch.library registration of the fused draft decode step (CPU, and CUDA in CUDA builds), of the
// target runtime's small-batch linear, decode attention and RMSNorm ops (CPU) and the pybind11 module
// `elsi_fast._C`. This is the only translation unit that includes torch headers.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <pybind11/pybind11.h>
#include <torch/library.h>

#ifdef ELSI_FAST_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#endif

#include "draft_decode.h"
#include "target_runtime.h"

namespace elsi_fast {

void bind_native_target(pybind11::module_& m);  // native_target_bind.cpp

namespace {

constexpr const char* kOp = "draft_decode_step";
constexpr const char* kMatrixNames[kNumMatrices] = {"fc",   "q_proj", "k_proj",    "v_proj", "o_proj",
                                                    "gate_proj", "up_proj", "down_proj", "lm_head"};

void check_tensor(const at::Tensor& t, const std::string& name, const at::Device& device,
                  at::IntArrayRef shape, const char* op = kOp) {
  TORCH_CHECK_VALUE(t.device() == device, op, ": ", name, " is on ", t.device(),
                    " but input is on ", device);
  TORCH_CHECK_VALUE(t.sizes() == shape, op, ": ", name, " must have shape ", shape, ", got ",
                    t.sizes());
  TORCH_CHECK_VALUE(t.is_contiguous(), op, ": ", name, " must be contiguous");
}

void check_dtype(const at::Tensor& t, const std::string& name,
                 std::initializer_list<at::ScalarType> allowed, const char* op = kOp) {
  bool ok = false;
  for (at::ScalarType dtype : allowed) ok = ok || t.scalar_type() == dtype;
  TORCH_CHECK_TYPE(ok, op, ": ", name, " must be ", c10::ArrayRef<at::ScalarType>(allowed),
                   ", got ", t.scalar_type());
}

ActType act_type(const at::Tensor& t) {
  return t.scalar_type() == at::kBFloat16 ? ActType::kBFloat16 : ActType::kFloat32;
}

struct Prepared {
  DraftDims dims;
  DraftWeights weights;
};

// Validates every argument against the shapes implied by norms [4, d], the caches
// [H_kv, max_len, head_dim], fc_in, intermediate (I) and d2t [V_d]; collects pointers.
Prepared prepare(const at::Tensor& input, const at::Tensor& token, const at::Tensor& position,
                 const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& embed,
                 at::TensorList weights, at::TensorList scales, const at::Tensor& norms,
                 const at::Tensor& inv_freq, const at::Tensor& d2t, bool from_target,
                 int64_t num_heads, int64_t fc_in, int64_t intermediate, double eps, int64_t top_k) {
  const at::Device device = input.device();
  TORCH_CHECK_VALUE(weights.size() == kNumMatrices, kOp, ": weights must hold ", kNumMatrices,
                    " matrices (fc, q, k, v, o, gate, up, down, lm_head), got ", weights.size());
  // 2-D: row-major [out, in]; 4-D: packed [ceil(out / kPackRows), ceil(in / C), kPackRows, C] with
  // C = pack_cols(element size) (draft_decode.h), which carries padded sizes only: hence fc_in and
  // intermediate.
  const bool packed = weights[0].dim() == 4;
  for (int i = 0; i < kNumMatrices; ++i)
    TORCH_CHECK_VALUE(weights[i].dim() == (packed ? 4 : 2), kOp, ": ", kMatrixNames[i], " must be ",
                      packed ? "4-D (packed, like fc)" : "2-D [out, in] (or every weight 4-D packed)", ", got ",
                      weights[i].sizes());
  TORCH_CHECK_VALUE(norms.dim() == 2 && norms.size(0) == 4 && norms.size(1) > 0, kOp,
                    ": norms must have shape [4, hidden], got ", norms.sizes());
  TORCH_CHECK_VALUE(k_cache.dim() == 3 && k_cache.size(0) > 0 && k_cache.size(1) > 0 &&
                        k_cache.size(2) > 0 && k_cache.size(2) % 2 == 0,
                    kOp, ": k_cache must be [num_kv_heads, max_len, head_dim] with an even head_dim, got ",
                    k_cache.sizes());
  TORCH_CHECK_VALUE(num_heads > 0 && num_heads % k_cache.size(0) == 0, kOp, ": num_heads (",
                    num_heads, ") must be a positive multiple of num_kv_heads (", k_cache.size(0), ")");
  TORCH_CHECK_VALUE(eps > 0, kOp, ": eps must be positive, got ", eps);
  TORCH_CHECK_VALUE(fc_in > 0 && intermediate > 0, kOp, ": fc_in (", fc_in, ") and intermediate (",
                    intermediate, ") must be positive");
  TORCH_CHECK_VALUE(d2t.dim() == 1 && d2t.size(0) > 0, kOp, ": d2t must be [draft_vocab], got ", d2t.sizes());

  DraftDims dims;
  dims.hidden = norms.size(1);
  dims.fc_in = fc_in;
  dims.num_heads = num_heads;
  dims.num_kv_heads = k_cache.size(0);
  dims.head_dim = k_cache.size(2);
  dims.intermediate = intermediate;
  dims.draft_vocab = d2t.size(0);
  dims.max_len = k_cache.size(1);
  dims.eps = static_cast<float>(eps);
  const int64_t d = dims.hidden, hd = dims.head_dim, nkv = dims.num_kv_heads;

  check_dtype(input, "input", {at::kFloat, at::kBFloat16});
  const int64_t input_width = from_target ? dims.fc_in : d;
  TORCH_CHECK_VALUE(input.dim() == 1 && input.size(0) == input_width, kOp, ": input must be [",
                    input_width, "] (", from_target ? "fc input width = m * target hidden" : "hidden",
                    "), got ", input.sizes());
  TORCH_CHECK_VALUE(input.is_contiguous(), kOp, ": input must be contiguous");
  check_dtype(token, "token", {at::kLong});
  check_tensor(token, "token", device, {1});
  check_dtype(position, "position", {at::kLong});
  check_tensor(position, "position", device, {1});

  const at::ScalarType wt = weights[0].scalar_type();
  check_dtype(weights[0], kMatrixNames[0], {at::kFloat, at::kBFloat16, at::kChar});
  const int64_t shapes[kNumMatrices][2] = {
      {d, dims.fc_in}, {num_heads * hd, 2 * d}, {nkv * hd, 2 * d}, {nkv * hd, 2 * d},
      {d, num_heads * hd}, {dims.intermediate, d}, {dims.intermediate, d}, {d, dims.intermediate},
      {dims.draft_vocab, d}};
  TORCH_CHECK_TYPE(wt != at::kChar || packed, kOp, ": int8 weights must be packed (4-D)");
  const int64_t tile_cols = pack_cols(weights[0].element_size());
  for (int i = 0; i < kNumMatrices; ++i) {
    check_dtype(weights[i], kMatrixNames[i], {wt});
    const int64_t rows = shapes[i][0], cols = shapes[i][1];
    if (packed)
      check_tensor(weights[i], std::string(kMatrixNames[i]) + " (packed)", device,
                   {(rows + kPackRows - 1) / kPackRows, (cols + tile_cols - 1) / tile_cols, kPackRows, tile_cols});
    else
      check_tensor(weights[i], kMatrixNames[i], device, shapes[i]);
  }
  if (wt == at::kChar) {
    TORCH_CHECK_VALUE(scales.size() == kNumMatrices, kOp,
                      ": int8 weights need one per-row scale vector per matrix, got ", scales.size());
    for (int i = 0; i < kNumMatrices; ++i) {
      const std::string name = std::string("scale of ") + kMatrixNames[i];
      check_dtype(scales[i], name, {at::kFloat});
      check_tensor(scales[i], name, device, {shapes[i][0]});
    }
  } else {
    TORCH_CHECK_VALUE(scales.empty(), kOp, ": scales are only for int8 weights, got ", scales.size(),
                      " with ", wt, " weights");
  }
  check_dtype(norms, "norms", {at::kFloat});
  check_tensor(norms, "norms", device, {4, d});
  check_dtype(inv_freq, "inv_freq", {at::kFloat});
  check_tensor(inv_freq, "inv_freq", device, {hd / 2});
  check_dtype(k_cache, "k_cache", {at::kFloat, at::kBFloat16});
  check_tensor(k_cache, "k_cache", device, {nkv, dims.max_len, hd});
  check_dtype(v_cache, "v_cache", {k_cache.scalar_type()});
  check_tensor(v_cache, "v_cache", device, {nkv, dims.max_len, hd});
  check_dtype(embed, "embed", {at::kFloat, at::kBFloat16});
  TORCH_CHECK_VALUE(embed.dim() == 2 && embed.size(0) > 0, kOp,
                    ": embed must be [vocab, hidden], got ", embed.sizes());
  check_tensor(embed, "embed", device, {embed.size(0), d});
  check_dtype(d2t, "d2t", {at::kLong});
  check_tensor(d2t, "d2t", device, {dims.draft_vocab});
  TORCH_CHECK_VALUE(top_k >= 0 && top_k <= dims.draft_vocab, kOp, ": top_k must be in [0, ",
                    dims.draft_vocab, "], got ", top_k);

  DraftWeights w{};
  w.weight_type = wt == at::kFloat      ? WeightType::kFloat32
                  : wt == at::kBFloat16 ? WeightType::kBFloat16
                                        : WeightType::kInt8;
  w.layout = packed ? WeightLayout::kPacked : WeightLayout::kRowMajor;
  for (int i = 0; i < kNumMatrices; ++i) {
    w.matrix[i] = weights[i].data_ptr();
    w.scale[i] = scales.empty() ? nullptr : scales[i].data_ptr<float>();
  }
  w.norms = norms.data_ptr<float>();
  w.inv_freq = inv_freq.data_ptr<float>();
  w.d2t = d2t.data_ptr<int64_t>();
  w.embed_type = act_type(embed);
  w.embed = embed.data_ptr();
  w.embed_rows = embed.size(0);
  return {dims, w};
}

DraftStep make_step(const at::Tensor& input, bool from_target, at::Tensor& k_cache, at::Tensor& v_cache,
                    int64_t top_k, at::Tensor& ids, at::Tensor& hidden) {
  DraftStep step{};
  step.input = input.data_ptr();
  step.input_type = act_type(input);
  step.from_target = from_target;
  step.cache_type = act_type(k_cache);
  step.k_cache = k_cache.data_ptr();
  step.v_cache = v_cache.data_ptr();
  step.top_k = top_k;
  step.out_ids = ids.data_ptr<int64_t>();
  step.out_hidden = hidden.data_ptr();
  return step;
}

std::tuple<at::Tensor, at::Tensor> draft_decode_step_cpu_op(
    const at::Tensor& input, const at::Tensor& token, const at::Tensor& position,
    at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& embed, at::TensorList weights,
    at::TensorList scales, const at::Tensor& norms, const at::Tensor& inv_freq,
    const at::Tensor& d2t, bool from_target, int64_t num_heads, int64_t fc_in, int64_t intermediate,
    double eps, int64_t top_k) {
  const Prepared p = prepare(input, token, position, k_cache, v_cache, embed, weights, scales, norms,
                             inv_freq, d2t, from_target, num_heads, fc_in, intermediate, eps, top_k);
  const int64_t tok = token.data_ptr<int64_t>()[0];
  const int64_t pos = position.data_ptr<int64_t>()[0];
  TORCH_CHECK_VALUE(tok >= 0 && tok < embed.size(0), kOp, ": token ", tok,
                    " is outside the embedding's vocabulary [0, ", embed.size(0), ")");
  TORCH_CHECK_VALUE(pos >= 0 && pos < p.dims.max_len, kOp, ": KV cache overflow: position ", pos,
                    " but the cache holds ", p.dims.max_len, " slots");

  at::Tensor ids = at::empty({top_k}, input.options().dtype(at::kLong));
  // top_k 0: the cache-only step (draft_decode.h), which returns no hidden state
  at::Tensor hidden = at::empty({top_k == 0 ? 0 : p.dims.hidden}, input.options());
  DraftStep step = make_step(input, from_target, k_cache, v_cache, top_k, ids, hidden);
  step.token = tok;
  step.position = pos;
  draft_decode_step_cpu(p.dims, p.weights, step, at::get_num_threads());
  return {ids, hidden};
}

constexpr const char* kLinearOp = "small_linear";

// y [rows, out] = x [rows, in] W^T (+ bias) with W packed (target_runtime.h) and 1..8 rows; the result
// has x's dtype (fp32 or bf16; bf16 inputs are widened, the products are fp32 either way).
at::Tensor small_linear_cpu_op(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& scale,
                               const std::optional<at::Tensor>& bias, int64_t out_features, int64_t in_features,
                               int64_t num_threads) {
  TORCH_CHECK_VALUE(out_features > 0 && in_features > 0, kLinearOp, ": out_features (", out_features,
                    ") and in_features (", in_features, ") must be positive");
  TORCH_CHECK_TYPE(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, kLinearOp,
                   ": x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK_VALUE(x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= kLinearMaxRows && x.size(1) == in_features,
                    kLinearOp, ": x must be [rows, ", in_features, "] with 1 <= rows <= ", kLinearMaxRows, ", got ",
                    x.sizes());
  TORCH_CHECK_VALUE(x.device().is_cpu(), kLinearOp, ": x must be on the CPU, got ", x.device());
  const at::ScalarType wt = weight.scalar_type();
  TORCH_CHECK_TYPE(wt == at::kFloat || wt == at::kBFloat16 || wt == at::kChar, kLinearOp,
                   ": weight must be float32, bfloat16 or int8, got ", wt);
  const int64_t tile_cols = pack_cols(weight.element_size());
  const int64_t packed_shape[4] = {(out_features + kPackRows - 1) / kPackRows, (in_features + tile_cols - 1) / tile_cols,
                                   kPackRows, tile_cols};
  check_tensor(weight, "weight (packed)", x.device(), packed_shape, kLinearOp);
  TORCH_CHECK_VALUE(scale.has_value() == (wt == at::kChar), kLinearOp,
                    ": per-row scales go with int8 weights and only with them (weight is ", wt, ")");
  if (scale.has_value()) {
    check_dtype(*scale, "scale", {at::kFloat}, kLinearOp);
    check_tensor(*scale, "scale", x.device(), {out_features}, kLinearOp);
  }
  if (bias.has_value()) {
    check_dtype(*bias, "bias", {at::kFloat}, kLinearOp);
    check_tensor(*bias, "bias", x.device(), {out_features}, kLinearOp);
  }
  TORCH_CHECK_VALUE(num_threads >= 0, kLinearOp, ": num_threads must be >= 0 (0: torch's), got ", num_threads);

  const at::Tensor x32 = x.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({x.size(0), out_features}, x32.options());
  LinearWeights w{};
  w.type = wt == at::kFloat ? WeightType::kFloat32 : wt == at::kBFloat16 ? WeightType::kBFloat16 : WeightType::kInt8;
  w.packed = weight.data_ptr();
  w.scale = scale.has_value() ? scale->data_ptr<float>() : nullptr;
  w.bias = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  w.out_features = out_features;
  w.in_features = in_features;
  small_linear_cpu(w, x32.data_ptr<float>(), x.size(0), y.data_ptr<float>(),
                   num_threads > 0 ? static_cast<int>(num_threads) : at::get_num_threads());
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

constexpr const char* kAttentionOp = "decode_attention";

// Attention of q [1, heads, rows, head_dim] (head_dim contiguous; rows <= 8) over k, v [1, kv_heads,
// keys, head_dim] (contiguous, the new tokens last), fp32; mask: bool [rows, keys] or none (then
// `causal` decides). Returns [1, rows, heads, head_dim] fp32, the layout the attention modules of
// transformers take from their attention functions.
at::Tensor decode_attention_cpu_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const std::optional<at::Tensor>& mask, double scale, bool causal,
                                   int64_t num_threads) {
  check_dtype(q, "q", {at::kFloat}, kAttentionOp);
  TORCH_CHECK_VALUE(q.dim() == 4 && q.size(0) == 1 && q.size(2) >= 1 && q.size(2) <= kLinearMaxRows &&
                        q.size(3) > 0 && q.stride(3) == 1,
                    kAttentionOp, ": q must be [1, heads, rows <= ", kLinearMaxRows,
                    ", head_dim] with a contiguous last dim, got ", q.sizes(), " strides ", q.strides());
  TORCH_CHECK_VALUE(q.device().is_cpu(), kAttentionOp, ": q must be on the CPU, got ", q.device());
  TORCH_CHECK_VALUE(k.dim() == 4 && k.size(0) == 1 && k.size(1) > 0 && q.size(1) % k.size(1) == 0 &&
                        k.size(2) >= q.size(2) && k.size(3) == q.size(3),
                    kAttentionOp, ": k must be [1, kv_heads, keys >= rows, head_dim] with kv_heads dividing ",
                    q.size(1), " heads, got ", k.sizes());
  for (const auto& [t, name] : {std::pair{&k, "k"}, std::pair{&v, "v"}}) {
    check_dtype(*t, name, {at::kFloat}, kAttentionOp);
    check_tensor(*t, name, q.device(), k.sizes(), kAttentionOp);
  }
  const int64_t rows = q.size(2), keys = k.size(2);
  if (mask.has_value()) {
    check_dtype(*mask, "mask", {at::kBool}, kAttentionOp);
    check_tensor(*mask, "mask", q.device(), {rows, keys}, kAttentionOp);
  }
  TORCH_CHECK_VALUE(num_threads >= 0, kAttentionOp, ": num_threads must be >= 0 (0: torch's), got ", num_threads);
  at::Tensor out = at::empty({1, rows, q.size(1), q.size(3)}, q.options());
  DecodeAttention a{};
  a.q = q.data_ptr<float>();
  a.q_head_stride = q.stride(1);
  a.q_row_stride = q.stride(2);
  a.k = k.data_ptr<float>();
  a.v = v.data_ptr<float>();
  a.mask = mask.has_value() ? mask->data_ptr<bool>() : nullptr;
  a.causal = causal;
  a.heads = q.size(1);
  a.kv_heads = k.size(1);
  a.rows = rows;
  a.keys = keys;
  a.head_dim = q.size(3);
  a.scale = static_cast<float>(scale);
  a.out = out.data_ptr<float>();
  decode_attention_cpu(a, num_threads > 0 ? static_cast<int>(num_threads) : at::get_num_threads());
  return out;
}

constexpr const char* kNormOp = "rms_norm";

// transformers' Llama / Qwen / Mistral RMSNorm in fp32: x [..., d] contiguous, weight [d].
at::Tensor rms_norm_cpu_op(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_dtype(x, "x", {at::kFloat}, kNormOp);
  TORCH_CHECK_VALUE(x.dim() >= 1 && x.size(-1) > 0 && x.is_contiguous() && x.device().is_cpu(), kNormOp,
                    ": x must be a contiguous CPU tensor [..., d], got ", x.sizes(), " on ", x.device());
  check_dtype(weight, "weight", {at::kFloat}, kNormOp);
  check_tensor(weight, "weight", x.device(), {x.size(-1)}, kNormOp);
  at::Tensor y = at::empty_like(x);
  rms_norm_cpu(x.data_ptr<float>(), weight.data_ptr<float>(), x.numel() / x.size(-1), x.size(-1),
               static_cast<float>(eps), y.data_ptr<float>());
  return y;
}

#ifdef ELSI_FAST_WITH_CUDA
std::tuple<at::Tensor, at::Tensor> draft_decode_step_cuda_op(
    const at::Tensor& input, const at::Tensor& token, const at::Tensor& position,
    at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& embed, at::TensorList weights,
    at::TensorList scales, const at::Tensor& norms, const at::Tensor& inv_freq,
    const at::Tensor& d2t, bool from_target, int64_t num_heads, int64_t fc_in, int64_t intermediate,
    double eps, int64_t top_k) {
  const Prepared p = prepare(input, token, position, k_cache, v_cache, embed, weights, scales, norms,
                             inv_freq, d2t, from_target, num_heads, fc_in, intermediate, eps, top_k);
  TORCH_CHECK_TYPE(p.weights.weight_type == WeightType::kBFloat16, kOp,
                   ": the CUDA kernel takes bfloat16 weights, got ", weights[0].scalar_type());
  TORCH_CHECK_VALUE(p.weights.layout == WeightLayout::kRowMajor, kOp,
                    ": the CUDA kernel takes row-major (2-D) weights, got packed ones");
  TORCH_CHECK_VALUE(top_k >= 1, kOp, ": the CUDA kernel has no cache-only step (top_k 0)");
  TORCH_CHECK_VALUE(top_k <= kMaxCudaTopK, kOp, ": the CUDA kernel supports top_k <= ",
                    kMaxCudaTopK, ", got ", top_k);
  // Token and position stay on the device (no host sync) so the step can be graph-captured; the
  // callers check the cache bound on their host-side length, the kernel skips out-of-range slots.
  const c10::cuda::CUDAGuard guard(input.device());
  at::Tensor ids = at::empty({top_k}, input.options().dtype(at::kLong));
  at::Tensor hidden = at::empty({p.dims.hidden}, input.options());
  at::Tensor workspace =
      at::empty({draft_decode_cuda_workspace_floats(p.dims, top_k)}, input.options().dtype(at::kFloat));
  const DraftStep step = make_step(input, from_target, k_cache, v_cache, top_k, ids, hidden);
  draft_decode_step_cuda(p.dims, p.weights, step, token.data_ptr<int64_t>(),
                         position.data_ptr<int64_t>(), workspace.data_ptr<float>(),
                         at::cuda::getCurrentCUDAStream().stream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {ids, hidden};
}
#endif

}  // namespace
}  // namespace elsi_fast

TORCH_LIBRARY(elsi_fast, m) {
  m.def(
      "draft_decode_step(Tensor input, Tensor token, Tensor position, Tensor(a!) k_cache, "
      "Tensor(b!) v_cache, Tensor embed, Tensor[] weights, Tensor[] scales, Tensor norms, "
      "Tensor inv_freq, Tensor d2t, bool from_target, int num_heads, int fc_in, int intermediate, "
      "float eps, int top_k) "
      "-> (Tensor, Tensor)");
  m.def(
      "small_linear(Tensor x, Tensor weight, Tensor? scale, Tensor? bias, int out_features, int in_features, "
      "int num_threads) -> Tensor");
  m.def(
      "decode_attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale, bool causal, int num_threads) "
      "-> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(elsi_fast, CPU, m) {
  m.impl("draft_decode_step", &elsi_fast::draft_decode_step_cpu_op);
  m.impl("small_linear", &elsi_fast::small_linear_cpu_op);
  m.impl("decode_attention", &elsi_fast::decode_attention_cpu_op);
  m.impl("rms_norm", &elsi_fast::rms_norm_cpu_op);
}

#ifdef ELSI_FAST_WITH_CUDA
TORCH_LIBRARY_IMPL(elsi_fast, CUDA, m) {
  m.impl("draft_decode_step", &elsi_fast::draft_decode_step_cuda_op);
}
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "elsi-fast native kernels; the ops live under torch.ops.elsi_fast";
  m.def("cpu_isa", &elsi_fast::cpu_isa, "Instruction set the CPU kernels use: avx512, avx2 or scalar");
  m.def("set_cpu_isa", [](const std::string& name) { return elsi_fast::set_cpu_isa(name.c_str()); },
        "Switch the CPU kernels to an instruction set this CPU supports; returns False otherwise");
  m.def("cuda_built", []() {
#ifdef ELSI_FAST_WITH_CUDA
    return true;
#else
    return false;
#endif
  }, "Whether this build contains the CUDA kernels");
  m.attr("max_cuda_top_k") = elsi_fast::kMaxCudaTopK;
  m.attr("pack_rows") = elsi_fast::kPackRows;
  m.attr("pack_row_bytes") = elsi_fast::kPackRowBytes;
  m.attr("linear_max_rows") = elsi_fast::kLinearMaxRows;
  elsi_fast::bind_native_target(m);
}

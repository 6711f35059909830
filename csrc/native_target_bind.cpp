// Python bindings of the GGUF products (quant_linear.h) and the fused forward (native_target.h) on
// numpy arrays: the weights stay the file's memory map, held alive by the bound object. The GIL is
// released while the kernels run. elsi_fast/targets/native_forward.py is the public wrapper.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <stdexcept>
#include <string>

#include "native_target.h"
#include "target_runtime.h"

namespace py = pybind11;

namespace elsi_fast {
namespace {

using Bytes = py::array_t<uint8_t, py::array::c_style>;
using Floats = py::array_t<float, py::array::c_style | py::array::forcecast>;
using Ids = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

// (ggml type id, uint8 array [rows, row bytes], rows, cols) as a QuantMatrix over the array; given
// `packed`, over a copy packed by 8 rows where the type and rows allow (pack_rows8: the products'
// layout), which `packed` then holds.
QuantMatrix to_matrix(const py::tuple& t, py::list& keep, py::list* packed = nullptr) {
  if (t.size() != 4) throw std::invalid_argument("a matrix is (ggml type, uint8 blocks, rows, cols)");
  const int32_t type = t[0].cast<int32_t>();
  Bytes data = t[1].cast<Bytes>();
  const int64_t rows = t[2].cast<int64_t>(), cols = t[3].cast<int64_t>();
  const int64_t block = ggml_block_bytes(type), block_cols = ggml_block_cols(type);
  if (block == 0) throw std::invalid_argument("ggml type " + std::to_string(type) + " is not supported");
  if (cols % block_cols != 0 || static_cast<int64_t>(data.size()) != rows * (cols / block_cols) * block)
    throw std::invalid_argument("blocks of " + std::to_string(data.size()) + " bytes do not hold a [" +
                                std::to_string(rows) + ", " + std::to_string(cols) + "] matrix of ggml type " +
                                std::to_string(type));
  QuantMatrix m{static_cast<GgmlType>(type), data.data(), rows, cols};
  if (packed == nullptr || !packs_rows8(type, rows)) {
    keep.append(data);
    return m;
  }
  Bytes copy(static_cast<py::ssize_t>(data.size()));
  pack_rows8(m, copy.mutable_data());
  packed->append(copy);
  return {m.type, copy.data(), rows, cols, true};
}

const float* to_floats(const py::object& o, int64_t size, const char* name, py::list& keep) {
  Floats a = o.cast<Floats>();
  if (static_cast<int64_t>(a.size()) != size)
    throw std::invalid_argument(std::string(name) + " must hold " + std::to_string(size) + " floats");
  keep.append(a);
  return a.data();
}

struct BoundTarget {
  py::list keep;  // the arrays the weights point into (the file's map)
  py::list packed;  // the products' weights packed by 8 rows (a tied head apart from the embedding)
  std::unique_ptr<NativeTarget> target;
  int64_t packed_bytes() const {
    int64_t total = 0;
    for (const py::handle& a : packed) total += a.cast<Bytes>().nbytes();
    return total;
  }
};

// dims and each layer dict hold Gemma 3's extra keys (gemma3, embed_scale, query_scale,
// sliding_window; attn_q_norm, attn_k_norm, post_attention_norm, post_ffw_norm, sliding) for a
// Gemma 3 model only, with inv_freq_local (its sliding layers' RoPE).
std::unique_ptr<BoundTarget> make_target(const py::dict& dims, const py::tuple& embed, const py::tuple& head,
                                         const py::object& final_norm, const py::object& inv_freq,
                                         const py::list& layers, const py::object& inv_freq_local) {
  auto bound = std::make_unique<BoundTarget>();
  NativeTargetConfig c{dims["layers"].cast<int64_t>(),   dims["hidden"].cast<int64_t>(),
                       dims["heads"].cast<int64_t>(),    dims["kv_heads"].cast<int64_t>(),
                       dims["head_dim"].cast<int64_t>(), dims["ffn"].cast<int64_t>(),
                       dims["vocab"].cast<int64_t>(),    dims["capacity"].cast<int64_t>(),
                       dims["eps"].cast<float>()};
  c.gemma3 = dims.contains("gemma3") && dims["gemma3"].cast<bool>();
  if (dims.contains("sequences")) c.sequences = dims["sequences"].cast<int64_t>();
  if (c.gemma3) {
    c.embed_scale = dims["embed_scale"].cast<float>();
    c.query_scale = dims["query_scale"].cast<float>();
    c.sliding_window = dims["sliding_window"].cast<int64_t>();
  }
  NativeTargetWeights w;
  w.embed = to_matrix(embed, bound->keep);
  w.head = to_matrix(head, bound->keep, &bound->packed);
  w.final_norm = to_floats(final_norm, c.hidden, "final_norm", bound->keep);
  Floats freq = inv_freq.cast<Floats>();
  w.inv_freq.assign(freq.data(), freq.data() + freq.size());
  if (!inv_freq_local.is_none()) {
    Floats local = inv_freq_local.cast<Floats>();
    w.inv_freq_local.assign(local.data(), local.data() + local.size());
  }
  for (const py::handle& item : layers) {
    const py::dict l = item.cast<py::dict>();
    NativeLayer nl{};
    nl.attn_norm = to_floats(l["attn_norm"], c.hidden, "attn_norm", bound->keep);
    nl.ffn_norm = to_floats(l["ffn_norm"], c.hidden, "ffn_norm", bound->keep);
    py::list* packed = &bound->packed;
    nl.q = to_matrix(l["attn_q"], bound->keep, packed), nl.k = to_matrix(l["attn_k"], bound->keep, packed);
    nl.v = to_matrix(l["attn_v"], bound->keep, packed), nl.o = to_matrix(l["attn_output"], bound->keep, packed);
    nl.gate = to_matrix(l["ffn_gate"], bound->keep, packed), nl.up = to_matrix(l["ffn_up"], bound->keep, packed);
    nl.down = to_matrix(l["ffn_down"], bound->keep, packed);
    if (c.gemma3) {
      nl.q_norm = to_floats(l["attn_q_norm"], c.head_dim, "attn_q_norm", bound->keep);
      nl.k_norm = to_floats(l["attn_k_norm"], c.head_dim, "attn_k_norm", bound->keep);
      nl.post_attn_norm = to_floats(l["post_attention_norm"], c.hidden, "post_attention_norm", bound->keep);
      nl.post_ffn_norm = to_floats(l["post_ffw_norm"], c.hidden, "post_ffw_norm", bound->keep);
      nl.sliding = l["sliding"].cast<bool>();
    }
    w.layers.push_back(nl);
  }
  bound->target = std::make_unique<NativeTarget>(c, std::move(w));
  return bound;
}

// seqs: each token row's sequence, or empty for all rows in sequence 0. Returns (logits [n_logits,
// vocab], aux), or with `greedy` (each logits row's argmax [n_logits], aux): the logits stay in C++.
py::tuple forward(BoundTarget& b, const Ids& tokens, const Ids& seqs, const Ids& logit_rows, const Ids& aux_layers,
                  int num_threads, bool greedy) {
  const NativeTargetConfig& c = b.target->config();
  const int64_t n = tokens.size(), n_logits = logit_rows.size(), n_aux = aux_layers.size();
  if (seqs.size() != 0 && static_cast<int64_t>(seqs.size()) != n)
    throw std::invalid_argument("NativeTarget: seqs must name one sequence per token row");
  const int64_t* sp = seqs.size() ? seqs.data() : nullptr;
  py::array_t<float> logits(std::vector<int64_t>{greedy ? 0 : n_logits, c.vocab}), aux({n, n_aux, c.hidden});
  py::array_t<int64_t> ids(greedy ? n_logits : 0);
  float* lp = greedy ? nullptr : logits.mutable_data();
  int64_t* ip = greedy ? ids.mutable_data() : nullptr;
  float* ap = aux.mutable_data();
  {
    py::gil_scoped_release release;
    b.target->forward(tokens.data(), n, sp, logit_rows.data(), n_logits, lp, aux_layers.data(), n_aux, ap,
                      num_threads, ip);
  }
  return py::make_tuple(greedy ? py::object(ids) : py::object(logits), aux);
}

// argmax_rows_cpu of x [rows, cols] (tests).
py::array_t<int64_t> argmax_rows(const Floats& x, int num_threads) {
  if (x.ndim() != 2) throw std::invalid_argument("x must be 2-D [rows, cols]");
  py::array_t<int64_t> out(x.shape(0));
  int64_t* op = out.mutable_data();
  {
    py::gil_scoped_release release;
    argmax_rows_cpu(x.data(), x.shape(0), x.shape(1), op, num_threads);
  }
  return out;
}

// x [rows, cols] times each matrix: a list of [rows, matrix rows] arrays (tests and benchmarks);
// `packed`: in the forward's layout (packed by 8 rows where it can be).
py::list quant_linear(const py::list& mats, const Floats& x, int num_threads, bool packed) {
  if (x.ndim() != 2) throw std::invalid_argument("x must be 2-D [rows, cols]");
  py::list keep, copies, result;
  std::vector<QuantMatrix> ms;
  std::vector<float*> ys;
  for (const py::handle& m : mats) ms.push_back(to_matrix(m.cast<py::tuple>(), keep, packed ? &copies : nullptr));
  for (const QuantMatrix& m : ms) {
    py::array_t<float> y({static_cast<int64_t>(x.shape(0)), m.rows});
    ys.push_back(y.mutable_data());
    result.append(y);
  }
  QuantInput q;
  {
    py::gil_scoped_release release;
    quantize_input(x.data(), x.shape(0), x.shape(1), q);
    quant_linear_cpu(ms.data(), ys.data(), static_cast<int>(ms.size()), q, num_threads);
  }
  return result;
}

// The int8 blocks, scales and scaled sums quantize_input gives x [rows, cols].
py::tuple quantize(const Floats& x) {
  if (x.ndim() != 2 || x.shape(1) % kQuantBlock != 0)
    throw std::invalid_argument("x must be [rows, cols] with cols a multiple of 32");
  QuantInput q;
  quantize_input(x.data(), x.shape(0), x.shape(1), q);
  const int64_t rows = x.shape(0), nb = x.shape(1) / kQuantBlock;
  py::array_t<int8_t> qa({rows, static_cast<int64_t>(x.shape(1))});
  py::array_t<float> da({rows, nb}), sa({rows, nb});
  std::copy(q.q.begin(), q.q.end(), qa.mutable_data());
  std::copy(q.d.begin(), q.d.end(), da.mutable_data());
  std::copy(q.s.begin(), q.s.end(), sa.mutable_data());
  return py::make_tuple(qa, da, sa);
}

}  // namespace

void bind_native_target(py::module_& m) {
  py::class_<BoundTarget>(m, "NativeTarget")
      .def(py::init(&make_target), py::arg("dims"), py::arg("embed"), py::arg("head"), py::arg("final_norm"),
           py::arg("inv_freq"), py::arg("layers"), py::arg("inv_freq_local") = py::none())
      .def("forward", &forward, py::arg("tokens"), py::arg("seqs"), py::arg("logit_rows"), py::arg("aux_layers"),
           py::arg("num_threads"), py::arg("greedy") = false)
      .def("rollback", [](BoundTarget& b, int64_t position, int64_t seq) { b.target->rollback(position, seq); },
           py::arg("position"), py::arg("seq") = 0)
      .def("length", [](const BoundTarget& b, int64_t seq) { return b.target->length(seq); }, py::arg("seq") = 0)
      .def("packed_bytes", &BoundTarget::packed_bytes);
  m.def("quant_linear", &quant_linear, py::arg("mats"), py::arg("x"), py::arg("num_threads"),
        py::arg("packed") = false);
  m.def("quantize_input", &quantize, py::arg("x"));
  m.def("argmax_rows", &argmax_rows, py::arg("x"), py::arg("num_threads") = 1);
}

}  // namespace elsi_fast

// Small-batch products with weights in GGUF's own quantized blocks (docs/native-target.md).
//
// A weight row is a run of 32-column blocks exactly as the GGUF file stores it (no repacking, no
// dequantization): Q8_0 (fp16 scale d, 32 int8), Q4_0 (d, 16 bytes of nibbles, value (q - 8) d),
// Q4_1 (d, fp16 minimum m, 16 bytes of nibbles, value q d + m). In a block's 16 nibble bytes, byte
// j holds column j in its low nibble and column j + 16 in its high one. The input is quantized per
// 32-column block to int8 with one fp32 scale (QuantInput), each block product is an exact integer
// sum, and the block results accumulate in fp32 in block order. A token row's result never depends
// on how many rows share the call, so a verify of k+1 tokens equals k+1 one-token products.
//
// Gemma 3's package file adds Q5_0 (d, 32 fifth bits, 16 bytes of nibbles, value (q - 16) d) and
// two super-block types of 256 columns (quant_kquants_cpu.cpp): Q4_K (8 sub-blocks of 32 with
// 6-bit scales and minimums) and Q6_K (16 sub-blocks of 16 with int8 scales). Their products run on
// the same 32-column input blocks.
#pragma once

#include <cstdint>
#include <vector>

namespace elsi_fast {

// ggml's type ids, as the GGUF file names them.
enum class GgmlType : int32_t {
  kF32 = 0, kF16 = 1, kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ8_0 = 8, kQ4_K = 12, kQ6_K = 14
};
constexpr int64_t kQuantBlock = 32;

// Columns (32, or 256 for a super-block type) and bytes of one block of `type`; 0 for a type this
// file does not know.
int64_t ggml_block_cols(int32_t type);
int64_t ggml_block_bytes(int32_t type);

// W [rows, cols] (cols a multiple of its type's block columns), each row's blocks back to back, or
// with `rows8` packed by pack_rows8.
struct QuantMatrix {
  GgmlType type;
  const uint8_t* data;
  int64_t rows;
  int64_t cols;
  bool rows8 = false;
  int64_t row_bytes() const {
    return cols / ggml_block_cols(static_cast<int32_t>(type)) * ggml_block_bytes(static_cast<int32_t>(type));
  }
};

// `rows` input rows quantized per 32-column block: q = round-half-even(x * (1 / d)), d = max|x| / 127
// (fp32; every instruction set's quantize_input gives the same bytes).
struct QuantInput {
  int64_t rows = 0;
  int64_t cols = 0;
  std::vector<int8_t> q;  // [rows, cols]
  std::vector<float> d;   // [rows, cols / 32] scales
  std::vector<float> s;   // [rows, cols / 32] d * sum(q) (Q4_1's minimum multiplies it)
  std::vector<float> s8;  // s by groups of 8 rows, [ceil(rows / 8), cols / 32, 8], zero padded
  std::vector<int32_t> qsum;  // [rows, cols / 32] sum(q)
  std::vector<int32_t> qsum16;  // [rows, cols / 16] sum(q) over each 16 columns (Q6_K's scale halves)
};

void quantize_input(const float* x, int64_t rows, int64_t cols, QuantInput& out);

// Weights packed by 8 rows, for the products of a whole forward (the file layout stays for
// lookups). Read row by row, a multi-token forward is bound by the work per input row, not by
// memory: every block of every input row takes a multiply-add, a conversion, the scales and a
// horizontal sum per weight row, so a 5-token verify cost 2.3x one token. Packed, lane i of a vector is weight row
// i: 8 rows' products of 4 columns are one multiply-add against 4 broadcast input bytes, and the
// scales apply to 8 rows at once. Same bytes per row as the file: a group of 8 rows is, per
// 32-column block, the 8 fp16 scales d, Q4_1's 8 fp16 minimums or Q5_0's 8 uint32 fifth bits, then
// the quants as 32-byte vectors [4 columns][8 rows][4 bytes]: Q8_0 columns 4j .. 4j + 3 in vector
// j < 8; Q4_0 / Q4_1 / Q5_0 nibble bytes 4j .. 4j + 3 in vector j < 4 (low nibbles columns 4j..,
// high ones 16 + 4j..). Packable: Q4_0, Q4_1, Q5_0, Q8_0, and the super-block types Q4_K and Q6_K
// (their own group layouts, quant_linear_cpu.cpp), with rows a multiple of 8 (every matrix
// of Gemma 3's package file).
bool packs_rows8(int32_t type, int64_t rows);
// m (file layout, packable) into out (m.row_bytes() * m.rows bytes); the packed matrix is
// {m.type, out, m.rows, m.cols, true}.
void pack_rows8(const QuantMatrix& m, uint8_t* out);

// ys[i] [x.rows, mats[i].rows] = x mats[i]^T for i < n, one job on the thread pool (products that
// share an input, as Q, K and V do, share a job). Quantized matrices only; cols must match x.cols.
void quant_linear_cpu(const QuantMatrix* mats, float* const* ys, int n, const QuantInput& x, int num_threads);

// One row of W as fp32 (an embedding lookup); F32 and F16 rows too; file layout only.
void dequantize_row(const QuantMatrix& m, int64_t row, float* out);

}  // namespace elsi_fast

// What the kernel files share: the argument checks of more than one op, the kernels one file
// runs for another (the decode stack calls every family's), and the ops bindings.cpp binds.
// Layouts: as each declaration states; every tensor on the CPU. Reference: the torch code in
// ember/models (each file's opening comment names its part of it).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Half.h>
#include <c10/util/Optional.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>

#include "vec.h"

namespace ember {

constexpr int64_t kMaxHeadDim = 256;

inline bool has_bf16_dot() {  // whether the AVX-512 BF16 kernels are built
#ifdef EMBER_BF16_DOT
  return true;
#else
  return false;
#endif
}

inline bool has_int8_dot() {  // whether the AVX-512 VNNI kernels are built too (int8_linear_a8)
#ifdef EMBER_INT8_DOT
  return true;
#else
  return false;
#endif
}

inline void check_float(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
              " must be float32 or bfloat16");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

// An int8 cache's scales: kv int8 [2, kv_heads, blocks, block_size, d] (d 64 or 128) and
// kv_scale float16 [2, kv_heads, blocks, block_size], both contiguous; only with AVX-512 BF16.
inline void check_int8_cache(const at::Tensor& kv, const at::Tensor& kv_scale) {
  TORCH_CHECK(has_bf16_dot(), "an int8 KV cache needs the AVX-512 BF16 kernels");
  TORCH_CHECK(kv.scalar_type() == at::kChar && kv.dim() == 5 && kv.is_contiguous() &&
                  (kv.size(4) == 64 || kv.size(4) == 128),
              "an int8 cache must be contiguous [2, kv_heads, blocks, block_size, d] int8 "
              "with d 64 or 128");
  TORCH_CHECK(kv_scale.scalar_type() == at::kHalf && kv_scale.is_contiguous() &&
                  kv_scale.dim() == 4 && kv_scale.sizes() == kv.sizes().slice(0, 4),
              "kv_scale must be contiguous [2, kv_heads, blocks, block_size] float16");
}

// The blocks a request's first seq_len tokens use, ids from its block table: all inside
// the cache's num_blocks.
inline void check_block_ids(const int64_t* table, int64_t seq_len, int64_t block_size,
                            int64_t num_blocks) {
  for (int64_t b = 0; b < (seq_len + block_size - 1) / block_size; ++b) {
    TORCH_CHECK(table[b] >= 0 && table[b] < num_blocks, "a block id is outside the cache");
  }
}

inline void check_bf16_rows(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1 &&
                  x.scalar_type() == at::kBFloat16,
              "x must be [m, k] bfloat16 on the CPU with contiguous rows");
}

// q [n / 16, k / 32, 8, 32] uint8 and scale_min [n / 16, k / 32, 2, 16] float16, from
// pack_int4_panels (int4w's layout)
inline void check_int4_panels(const at::Tensor& q, const at::Tensor& scale_min) {
  TORCH_CHECK(q.scalar_type() == at::kByte && q.dim() == 4 && q.size(2) == 8 &&
                  q.size(3) == 32 && q.is_contiguous(),
              "q must be contiguous [n / 16, k / 32, 8, 32] uint8");
  TORCH_CHECK(scale_min.scalar_type() == at::kHalf && scale_min.is_contiguous() &&
                  scale_min.numel() == q.size(0) * q.size(1) * 32,
              "scale_min must be contiguous [n / 16, k / 32, 2, 16] float16");
}

// norm_rope.cpp (instantiated for c10::BFloat16, the decode stack's type)

// out = rms_norm(x) * weight per row of n; with `residual`, residual += x first (rounded to T)
// and the sum is normalised
template <typename T>
void rms_norm_rows(const T* x, T* residual, const T* weight, T* out, int64_t rows,
                   int64_t n, float eps);

// qkv [tokens, (heads + 2 kv_heads) * d] -> q_out [tokens, heads, d] rotated; k (rotated)
// and v into kv [2, kv_heads, num_slots, d] at slots[t]
template <typename T>
void rope_write_impl(const T* qkv, const T* cos, const T* sin, T* kv, const int64_t* slots,
                     T* q_out, int64_t tokens, int64_t heads, int64_t kv_heads, int64_t d,
                     int64_t num_slots);

// out [rows, n] = silu(x[:, :n]) * x[:, n:] for x [rows, 2n]
template <typename T>
void silu_and_mul_impl(const T* x, T* out, int64_t rows, int64_t n);

#ifdef EMBER_BF16_DOT
// rope_write_impl into an int8 cache (kv int8, kv_scale [2, kv_heads, num_slots] float16).
// With k_out ([tokens, kv_heads, d]), the rotated k is kept there too, before its rounding.
void rope_write_i8(const c10::BFloat16* qkv, const c10::BFloat16* cos, const c10::BFloat16* sin,
                   int8_t* kv, at::Half* kv_scale, const int64_t* slots, c10::BFloat16* q_out,
                   int64_t tokens, int64_t heads, int64_t kv_heads, int64_t d,
                   int64_t num_slots, c10::BFloat16* k_out = nullptr);

// In `rows` rows of attention output from `out`, `row_bytes` apart, each of `heads` query
// heads `head_bytes` wide in KV-head order: zeros for the query heads of every KV head whose
// bit is set in `skip` (the heads a tensor-parallel rank leaves to another:
// ember/models/parallel.py HeadShare).
inline void zero_skipped_heads(void* out, int64_t row_bytes, int64_t rows, int64_t skip,
                               int64_t heads, int64_t kv_heads, int64_t head_bytes) {
  const int64_t group_bytes = heads / kv_heads * head_bytes;
  for (int64_t h = 0; h < kv_heads; ++h) {
    if (!(skip >> h & 1)) continue;
    for (int64_t r = 0; r < rows; ++r) {
      std::memset(static_cast<char*>(out) + r * row_bytes + h * group_bytes, 0, group_bytes);
    }
  }
}

// decode_attention.cpp (D = 64, 128)
namespace decode {

// q [members, heads, D] (strided), kv [2, kv_heads, blocks, block_size, D]: bfloat16, or int8
// with kv_scale [2, kv_heads, blocks, block_size] float16 -> out [members, heads, D], by the
// threads of the enclosing parallel region, each calling `after`, if given, once out of
// tasks. A task is member m's KV head h (its query heads), and `before`, if given, is called
// with m and h first (DecodeStack: that head's RoPE and cache write). With `skip` [members]
// (a bit per KV head), a member whose bit h is set does not attend over KV head h: its query
// heads' outputs are zeros (another tensor-parallel rank attends them; `before` still runs).
// No barrier at the end: the caller's.
template <int D>
void decode_attention_team(const uint16_t* q, int64_t q_stride_m, int64_t q_stride_h,
                           const void* kv, const at::Half* kv_scale,
                           const int64_t* block_tables, const int64_t* seq_lens, uint16_t* out,
                           int64_t members, int64_t heads, int64_t kv_heads,
                           int64_t num_blocks, int64_t block_size, int64_t max_blocks,
                           float scale, const std::function<void()>* after = nullptr,
                           const std::function<void(int64_t, int64_t)>* before = nullptr,
                           const int64_t* skip = nullptr);

// decode_attention_team in a parallel region of its own
template <int D>
void decode_attention_bf16(const uint16_t* q, int64_t q_stride_m, int64_t q_stride_h,
                           const void* kv, const at::Half* kv_scale,
                           const int64_t* block_tables, const int64_t* seq_lens, uint16_t* out,
                           int64_t members, int64_t heads, int64_t kv_heads,
                           int64_t num_blocks, int64_t block_size, int64_t max_blocks,
                           float scale, const std::function<void()>* after = nullptr,
                           const int64_t* skip = nullptr);

}  // namespace decode

// prefill_attention.cpp (D = 64, 128)
namespace prefill {

// One prompt chunk: its n new tokens, the last n of the request's seq_len (written into the
// cache first), attend causally over its context. q [n, heads, D] (row stride q_stride), out
// [n, heads, D] contiguous, kv [2, kv_heads, num_blocks, block_size, D] bfloat16, or int8
// with kv_scale [2, kv_heads, num_blocks, block_size] float16, table its blocks.
struct ChunkRef {
  const uint16_t* q;
  int64_t q_stride;
  uint16_t* out;
  int64_t n, seq_len;
  const void* kv;
  const at::Half* kv_scale;
  const int64_t* table;
  int64_t num_blocks, block_size;
  // a bit per KV head this chunk does not attend (decode_attention_team's `skip`): its
  // query heads' outputs are zeros
  int64_t skip = 0;
};

// Every chunk of `chunks` [count] attended, in one call (threads over all of them); each
// chunk's output is what it gets alone, bit for bit.
template <int D>
void prefill_chunks_impl(const ChunkRef* chunks, int64_t count, int64_t heads,
                         int64_t kv_heads, float scale);

}  // namespace prefill

// int4_matmul.cpp: int4 weights in 16-row panels, groups of 32 inputs (pack_int4_panels)
namespace int4w {

constexpr int kPanel = 16, kGroupK = 32;

// Panels are prefetched this far ahead of the ones being multiplied (23-61 KB at k = 576-1536).
// The decode stack at one row, paired against 8: 3-5 0.96-0.97x the time, 16 1.11x, none
// 1.09x (against 3); at 4 rows 0.98x (docs/benchmarks.md).
constexpr int64_t kAhead = 4;

// The weight a caller multiplies next (DecodeStack: the next projection), or none.
struct Next {
  const uint8_t* q = nullptr;
  const uint16_t* sm = nullptr;
  int64_t n = 0, k = 0;
};

// Ask for panels [from, upto) of the share of `next` that thread `thread` of `threads` will
// take (-1: this one, of at::parallel_for's threads) into L2, so that they arrive during the
// work between two matmuls (norms, RoPE, SwiGLU's activation, attention) instead of at the
// start of the next one. By default its first kAhead panels (24 at the end of a matmul
// measured slower).
void prefetch_next_share(const Next& next, int64_t from = 0, int64_t upto = kAhead,
                         int thread = -1, int threads = -1);

// out [m, n] bfloat16 = x w^T for x [m, k] bfloat16 (row stride x_stride), w as q and sm
// (scale_min) hold it; the first panels of `next` are fetched at the end
void matmul(const uint16_t* x, int64_t m, int64_t x_stride, const uint8_t* q,
            const uint16_t* sm, int64_t n, int64_t k, uint16_t* out, const Next& next = {});

// matmul's work for thread `thread` of the enclosing parallel region's `threads` (its share
// of the panels, then the first panels of its share of `next`); the caller's barrier ends it.
void matmul_share(const uint16_t* x, int64_t m, int64_t x_stride, const uint8_t* q,
                  const uint16_t* sm, int64_t n, int64_t k, uint16_t* out, const Next& next,
                  int thread, int threads);

}  // namespace int4w

#ifdef EMBER_INT8_DOT
// int8_matmul.cpp: int8 activations times int8 weights in quads (pack_int8_quads)
namespace int8a8 {

// What a tile writes: float32 products, bfloat16 ones, or silu(gate) * up in bfloat16 (the
// tile's first P / 2 panels gate, the others the matching up panels).
enum class Out { kFloat, kBfloat16, kSwiglu };

// x as quantize_rows leaves it: q [k / group, m, group] int8, its scales [m, k / group] and
// the sums of each row's groups [m, k / group]. With one group, a window [from, to) of
// inputs (multiples of 4; to 0: every input) limits matmul's products to those inputs: exact
// where the rows are zero outside it (their int8 values there are 0, and the sums count
// them as 0), and cheaper.
struct Rows {
  const int8_t* q;
  const float* scale;
  const int32_t* sum;
  int64_t m, group, groups;
  int64_t from = 0, to = 0;
};

// x [m, k] (row stride `stride`) rounded to int8 for int8a8 into q [m * k], scale and sum
// [m * k / group] (the caller's buffers) -> the rows as its tiles read them
Rows quantize(const c10::BFloat16* x, int64_t m, int64_t k, int64_t stride,
              const float* smooth, int64_t group, int8_t* q, float* scale, int32_t* sum);

// Rows rows[0 .. count - 1] of x, copied into q [count * k], scale and sum [count * groups]
// (the caller's buffers): a row's products do not depend on the others', so matmul of the
// picked rows gives their rows of matmul of x, bit for bit.
Rows pick(const Rows& x, const int64_t* rows, int64_t count, int8_t* q, float* scale,
          int32_t* sum);

// out = x w^T for w in quads [n / 16, k / 4, 16, 4] uint8 with scales [n]: [m, n] (kFloat,
// kBfloat16), or [m, n / 2] silu(gate) * up where w is [gate | up] (kSwiglu; n / 2 % 16 == 0).
// out's rows are out_stride elements apart (0: the output's width). A slice of w's output
// rows (quads + first / 16 panels, scales + first) gives that slice of the columns.
template <Out O>
void matmul(const Rows& x, const uint8_t* quads, const float* scales, int64_t n, int64_t k,
            void* out, int64_t out_stride = 0);

}  // namespace int8a8
#endif  // EMBER_INT8_DOT

#ifdef EMBER_INT8_DOT
// lora.cpp: y[rows_g] += (x[rows_g] A[g]^T) B[g] for each adapter g (layout as lora.cpp
// states; raw bfloat16 bits, row strides in elements), in a parallel region of its own
void lora_add_impl(uint16_t* y, int64_t y_stride, const uint16_t* x, int64_t x_stride,
                   const int64_t* rows, const int64_t* starts, int64_t groups,
                   const int8_t* a, const float* a_scales, const int8_t* b,
                   const float* b_scales, const int32_t* ranges, int64_t ranks, int64_t in,
                   int64_t out);
void check_lora_factors(const at::Tensor& rows, const at::Tensor& starts, const at::Tensor& a,
                        const at::Tensor& a_scales, const at::Tensor& b,
                        const at::Tensor& b_scales, const at::Tensor& ranges, int64_t out);
#endif  // EMBER_INT8_DOT
#endif  // EMBER_BF16_DOT

// The ops, as bindings.cpp binds them (each file states its own)
at::Tensor rms_norm(at::Tensor x, c10::optional<at::Tensor> residual, at::Tensor weight,
                    double eps);
at::Tensor rope_write(at::Tensor qkv, at::Tensor cos, at::Tensor sin, at::Tensor kv,
                      at::Tensor slots, int64_t heads, int64_t kv_heads,
                      c10::optional<at::Tensor> kv_scale, c10::optional<at::Tensor> k_out);
at::Tensor silu_and_mul(at::Tensor x);
at::Tensor argmax_rows(at::Tensor x);
at::Tensor decode_attention(at::Tensor q, at::Tensor kv, at::Tensor block_tables,
                            at::Tensor seq_lens, double scale,
                            c10::optional<at::Tensor> kv_scale,
                            c10::optional<at::Tensor> skip);
at::Tensor prefill_attention(at::Tensor q, at::Tensor kv, at::Tensor block_table,
                             int64_t seq_len, double scale, c10::optional<at::Tensor> kv_scale);
void prefill_attention_chunks(at::Tensor q, at::Tensor kv, at::Tensor chunk_info,
                              std::vector<at::Tensor> block_tables, double scale,
                              c10::optional<at::Tensor> kv_scale, at::Tensor out);
at::Tensor int4_linear(at::Tensor x, at::Tensor q, at::Tensor scale_min);
at::Tensor int8_linear(at::Tensor x, at::Tensor packed, at::Tensor scales);
at::Tensor int8_linear_a8(at::Tensor x, at::Tensor packed, at::Tensor scales, int64_t group);
at::Tensor w8a8_linear(at::Tensor x, at::Tensor w, at::Tensor w_scale, at::Tensor smooth,
                       bool swiglu, int64_t group);
at::Tensor int8_rows(at::Tensor ids, at::Tensor packed, at::Tensor scales);
bool brgemm_bf16_vnni();
at::Tensor brgemm_bf16_pack(at::Tensor w, bool vnni);
at::Tensor brgemm_bf16_linear(at::Tensor x, at::Tensor packed, bool vnni);
std::vector<double> thread_sync_ns(int64_t rounds);
void lora_add(at::Tensor& y, const at::Tensor& x, const at::Tensor& rows,
              const at::Tensor& starts, const at::Tensor& a, const at::Tensor& a_scales,
              const at::Tensor& b, const at::Tensor& b_scales, const at::Tensor& ranges);

}  // namespace ember

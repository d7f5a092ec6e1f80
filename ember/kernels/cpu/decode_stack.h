// The decode stack's interface: every decoder layer of a step in one call (decode_stack.cpp),
// bound by bindings.cpp as DecodeStack.
// Layout and reference: as decode_stack.cpp states.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Half.h>
#include <c10/util/Optional.h>

#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

#include "common.h"
#include "shm_allreduce.h"

namespace ember {

#ifdef EMBER_BF16_DOT
// A decode step through every decoder layer in one call (the model's weights all int4, its
// activations and KV cache bfloat16, one new token per request, any number of requests):
// the same kernels, in the same order, as the layer-by-layer path in ember/models takes up
// to 8 rows, with no Python and no allocation between them. Per layer:
//   h = rms_norm(residual += x)      (the first layer: residual = x, h = rms_norm(x))
//   q = rope_write(h Wqkv)           k, v into the cache
//   x = attention(q) Wo;  h = rms_norm(residual += x)
//   x = silu_and_mul(h Wgate_up) Wdown
// and at the end rms_norm(residual += x) with the final norm: the hidden states the output
// projection reads. forward_mixed runs a step with prompt chunks the same way (the attention
// of each chunk on the prefill kernel, of the decodes on the decode kernel, as the layers
// call them), so that a prompt step pays no Python or torch glue between kernels either.
class DecodeStack {
 public:
  // weights: per layer, in order, input norm, qkv (q, scale_min), o (q, scale_min),
  // post-attention norm, gate_up (q, scale_min), down (q, scale_min): 10 tensors each.
  DecodeStack(std::vector<at::Tensor> weights, at::Tensor final_norm, int64_t heads,
              int64_t kv_heads, int64_t head_dim, double eps, double scale);

  // From now on, steps of more than `max_packed_rows` rows run every projection on int8 dot
  // products (w8a8_linear's arithmetic: x rounded to int8 per row or group, times smooth):
  // per layer, for qkv, o, gate_up and down in turn, the weight in quads (pack_int8_quads),
  // its scales [n] and smooth [k] float32 (12 tensors), and `groups` their activation groups
  // (4 per layer; 0: a whole row). Only with AVX-512 VNNI. With `by_kind`, a step of prompt
  // chunks alone runs on the int8 weights whatever its size (so that a prompt row's
  // numerics never depend on its chunk; the runner keeps prompt and decode rows apart).
  void use_int8(std::vector<at::Tensor> tensors, std::vector<int64_t> groups,
                int64_t max_packed_rows, bool by_kind);

  // x [T, hidden] (the embeddings), cos, sin [T, 1, d], kv: each layer's cache [2, kv_heads,
  // blocks, block_size, d], slots [T], block_tables [T, max_blocks], seq_lens [T] (int64; the
  // new token included) -> the final norm's output [T, hidden]. All bfloat16.
  // With kv_scales (one per layer, [2, kv_heads, blocks, block_size] float16), the caches are
  // int8 (ember/models/attention.py PagedKV); empty: bfloat16.
  // With positions [T] (int64), cos and sin are tables [P, 1, d] (every position below P) and
  // row t takes row positions[t] of each, instead of two torch index ops before the call (in a
  // batch-1 decode step, where the caches are cold: model.forward's glue 69-104 -> 44-67 us).
  // With lora (ember/lora/batch.py LoraStep.stack_tensors: the rows grouped per adapter
  // [N] int64 and where each adapter's begin [G + 1], then per layer A, A's scales, B, B's
  // scales and ranges (lora.cpp's layout) for qkv, o, gate_up and down; empty tensors where there is
  // none), each projection's output gets its rows' adapters added by lora_add (lora.cpp), as
  // the layers add them, and the step runs in run() (not run_decodes).
  // A tensor-parallel rank's stack (its heads, its MLP columns): from now on the o and down
  // projections' outputs [T, hidden], this rank's partial sums, become the sums over the
  // ranks through `all_reduce` (rank order, float32, rounded to bfloat16 once), in place,
  // as the layers' all-reduce after each makes them. The handle must outlive the stack.
  void use_all_reduce(ShmAllReduce* all_reduce, double timeout_s, double spin_us);

  at::Tensor forward(at::Tensor x, at::Tensor cos, at::Tensor sin,
                     const std::vector<at::Tensor>& kv,
                     const std::vector<at::Tensor>& kv_scales, at::Tensor slots,
                     at::Tensor block_tables, at::Tensor seq_lens,
                     c10::optional<at::Tensor> positions,
                     const std::vector<at::Tensor>& lora,
                     c10::optional<at::Tensor> skip) const;

  // A step with prompt chunks: the same arguments as forward, but the decodes are rows
  // decode_first .. decode_first + D - 1 (block_tables [D, max_blocks], seq_lens [D]; D may be
  // 0), and chunk_info [C, 4] int64 gives each prompt chunk's first row, new tokens, seq_len
  // (its context after this step, the new tokens included) and whether it is fresh (the
  // prompt's first chunk: with an int8 cache it attends over its own k and v as computed,
  // not as rounded into the cache, as the layers do), chunk_tables[c] its block table [>=
  // ceil(seq_len / block_size)]. Every row is a decode or in one chunk. positions: as forward.
  // skip [T] int64 (both): per row, a bit per KV head whose query heads this rank leaves to
  // another (Plan::skip).
  at::Tensor forward_mixed(at::Tensor x, at::Tensor cos, at::Tensor sin,
                           const std::vector<at::Tensor>& kv,
                           const std::vector<at::Tensor>& kv_scales, at::Tensor slots,
                           int64_t decode_first, at::Tensor block_tables,
                           at::Tensor seq_lens, at::Tensor chunk_info,
                           const std::vector<at::Tensor>& chunk_tables,
                           c10::optional<at::Tensor> positions,
                           const std::vector<at::Tensor>& lora,
                           c10::optional<at::Tensor> skip) const;

 private:
  // A prompt chunk: rows first .. first + n - 1 of the step
  struct Chunk {
    int64_t first, n, seq_len;
    bool fresh;
    const int64_t* table;
  };
  // The step's attention: decodes at rows decode_first .. + decodes - 1, and the chunks
  struct Plan {
    int64_t decode_first, decodes;
    const int64_t* tables;
    int64_t max_blocks;
    const int64_t* seq_lens;
    std::vector<Chunk> chunks;
    const std::vector<at::Tensor>* lora = nullptr;   // empty: no adapters this step
    // some decode row reads a slot another row of the step writes (a request verifying
    // drafts, one row per position): the step must write every row's key and value before
    // any row attends, so it cannot run in run_decodes' one region
    bool rows_read_each_other = false;
    // per row of the step, a bit per KV head this rank does not attend for it (another
    // tensor-parallel rank holding the same KV head does): its query heads' outputs are
    // zeros. nullptr: every head.
    const int64_t* skip = nullptr;
  };

  static bool rows_read_each_other(const Plan& plan, const at::Tensor& slots,
                                   int64_t block_size);
  static const int64_t* skip_rows(const c10::optional<at::Tensor>& skip, int64_t t);
  // lora_add (lora.cpp) of projection p (0 qkv, 1 o, 2 gate_up, 3 down) of layer l: the
  // plan's lora is [rows, starts, then A, B, B's scales, ranges per projection per layer]
  static void add_lora(const Plan& plan, size_t l, int p, const at::Tensor& in, at::Tensor& y);
  static bool has_lora(const Plan& plan, size_t l, int p);
  // outs: the output widths of qkv, o, gate_up and down
  static void check_lora(const std::vector<at::Tensor>& lora, size_t layers, int64_t t,
                         const std::vector<int64_t>& outs, const std::vector<int64_t>& ins);

  at::Tensor run(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                 const std::vector<at::Tensor>& kv,
                 const std::vector<at::Tensor>& kv_scales, const at::Tensor& slots,
                 const Plan& plan) const;

  void rope_write_head(const at::BFloat16* qkv, const at::BFloat16* cos, const at::BFloat16* sin,
                       const at::Tensor& cache, at::Half* kv_scale, const int64_t* slots,
                       at::BFloat16* q, int64_t row, int64_t kvh) const;

  // Steps of up to this many decodes (on the int4 weights) run in one parallel region
  static constexpr int64_t kOneRegionRows = 8;

  at::Tensor run_decodes(const at::Tensor& x, const at::Tensor& cos,
                         const at::Tensor& sin, const std::vector<at::Tensor>& kv,
                         const std::vector<at::Tensor>& kv_scales,
                         const at::Tensor& slots, const Plan& plan) const;

  struct Int4 {
    at::Tensor q, scale_min;
    int64_t n, k;
  };
  struct Int8 {
    at::Tensor quads, scale, smooth;
    int64_t n = 0, k = 0, group = 0;
  };
  struct Layer {
    at::Tensor in_norm, post_norm;
    Int4 qkv, o, gate_up, down;
    Int8 qkv8, o8, gate_up8, down8;   // set by use_int8
  };
  // Scratch for x rounded to int8 (int8a8's operand), sized for a step's widest input
  struct Int8Rows {
    std::vector<int8_t> q;
    std::vector<float> scale;
    std::vector<int32_t> sum;
  };

  void attend(const Plan& plan, const at::Tensor& q, const at::Tensor& qkv,
              const at::Tensor& k_out, std::vector<uint16_t>& own_kv,
              const at::Tensor& cache, const at::Half* kv_scale, at::Tensor& att,
              const std::function<void()>* after = nullptr) const;

  static void linear8(const Int8& w, const at::Tensor& x, at::Tensor& out,
                      Int8Rows& scratch, bool swiglu = false);

  // A step's rows as a rank sharing KV heads with another sees them (Plan::skip): the query
  // heads of a KV head that some row leaves to another rank are projected, and read by o,
  // only for the rows attending them here (the others' attention there is zeros)
  struct Shared {
    std::vector<int64_t> heads;                  // local KV heads some row leaves, ascending
    std::vector<std::vector<int64_t>> attend;    // per such head, the rows attending it here
    // o's input window [from, to) of each row, as (window, its rows), rows by window
    std::vector<std::pair<std::pair<int64_t, int64_t>, std::vector<int64_t>>> windows;
    // scratch: picked rows rounded to int8, and their outputs before they are scattered
    Int8Rows picked;
    std::vector<at::BFloat16> out;
  };
  Shared shared_rows(const Plan& plan, int64_t t) const;
#ifdef EMBER_INT8_DOT
  // x rounded to int8 as w takes its inputs (w's smooth and activation groups), in scratch
  static int8a8::Rows quantize8(const Int8& w, const at::Tensor& x, Int8Rows& scratch);
  // dst (rows `stride` apart) = x times w's output rows [first, first + width): columns
  // [first, first + width) of x w^T, inputs limited to x's window if it has one
  static void columns8(const int8a8::Rows& x, const Int8& w, int64_t first, int64_t width,
                       at::BFloat16* dst, int64_t stride);
  // columns8 for x's rows `which` alone (picked through shared's scratch unless they are
  // every row): dst's other rows are left as they are
  static void columns8(const int8a8::Rows& x, const std::vector<int64_t>& which,
                       const Int8& w, int64_t first, int64_t width, at::BFloat16* dst,
                       int64_t stride, Shared& shared);
#endif
  void linear8_qkv(const Int8& w, const at::Tensor& x, at::Tensor& out, Int8Rows& scratch,
                   Shared& shared) const;
  void linear8_o(const Int8& w, const at::Tensor& x, at::Tensor& out, Int8Rows& scratch,
                 Shared& shared) const;

  static Int4 int4(at::Tensor q, at::Tensor scale_min);

  static const uint16_t* bits(const at::Tensor& t);
  static uint16_t* bits(at::Tensor& t);

  static int4w::Next next_of(const Int4& w);

  static void linear(const Int4& w, const at::Tensor& x, at::Tensor& out,
                     const Int4* next);

  std::pair<at::Tensor, at::Tensor> rope_rows(
      const at::Tensor& cos, const at::Tensor& sin,
      const c10::optional<at::Tensor>& positions, int64_t t) const;

  void check_inputs(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                    const std::vector<at::Tensor>& kv,
                    const std::vector<at::Tensor>& kv_scales,
                    const at::Tensor& slots) const;

  static void check_decodes(const at::Tensor& block_tables, const at::Tensor& seq_lens,
                            int64_t count, int64_t block_size);

  // out [T, hidden] summed over the ranks, where there are several (use_all_reduce)
  void sum_over_ranks(at::Tensor& out) const;

  std::vector<Layer> layers_;
  ShmAllReduce* all_reduce_ = nullptr;   // one rank of several: its partial sums' all-reduce
  double all_reduce_timeout_s_ = 0, all_reduce_spin_us_ = 0;
  bool int8_ = false;           // use_int8 was called
  bool by_kind_ = false;        // int8 for steps of prompt chunks alone, else int4
  int64_t max_packed_rows_ = 0;
  at::Tensor final_norm_;
  int64_t heads_, kv_heads_, d_, hidden_;
  float eps_, scale_;
};
#endif  // EMBER_BF16_DOT

}  // namespace ember

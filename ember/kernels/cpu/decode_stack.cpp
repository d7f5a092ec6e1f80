// A decode step through every decoder layer of a model with int4 weights (and, above a few
// rows, the same layers on int8 quads), in one call: the kernels of the other files in the
// order the layer-by-layer path in ember/models runs them, with no Python or allocation
// between them; and the probe of what the threads' synchronisation costs.
// Layout: activations [T, hidden] bfloat16, one row per token; the caches as kv_cache.h
// states; the weights as pack_int4_panels and pack_int8_quads make them (decode_stack.h).
// Reference: ember/models/llama.py's layers run one by one with these kernels (the same
// output, bit for bit) and, through them, the torch path
// (tests/reference/test_cpu_kernels.py, tests/reference/test_smollm_gguf.py).
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/bmm.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>

#include "common.h"
#include "decode_stack.h"
#include "kv_cache.h"
#include "vec.h"

namespace ember {

#ifdef EMBER_BF16_DOT
DecodeStack::DecodeStack(std::vector<at::Tensor> weights, at::Tensor final_norm, int64_t heads,
                         int64_t kv_heads, int64_t head_dim, double eps, double scale)
    : final_norm_(std::move(final_norm)), heads_(heads), kv_heads_(kv_heads), d_(head_dim),
      eps_(static_cast<float>(eps)), scale_(static_cast<float>(scale)) {
  TORCH_CHECK(weights.size() % 10 == 0 && !weights.empty(), "weights: 10 tensors per layer");
  TORCH_CHECK(head_dim == 64 || head_dim == 128, "head_dim must be 64 or 128");
  TORCH_CHECK(heads % kv_heads == 0, "heads must be a multiple of kv_heads");
  hidden_ = final_norm_.numel();
  for (size_t i = 0; i < weights.size(); i += 10) {
    Layer layer{weights[i], weights[i + 5], int4(weights[i + 1], weights[i + 2]),
                int4(weights[i + 3], weights[i + 4]), int4(weights[i + 6], weights[i + 7]),
                int4(weights[i + 8], weights[i + 9])};
    TORCH_CHECK(layer.qkv.k == hidden_ && layer.qkv.n == (heads + 2 * kv_heads) * head_dim &&
                    layer.o.k == heads * head_dim && layer.o.n == hidden_ &&
                    layer.gate_up.k == hidden_ && layer.down.k * 2 == layer.gate_up.n &&
                    layer.down.n == hidden_,
                "layer ", i / 10, ": the weights' shapes do not fit together");
    for (const auto* norm : {&layer.in_norm, &layer.post_norm, &final_norm_}) {
      TORCH_CHECK(norm->scalar_type() == at::kBFloat16 && norm->is_contiguous() &&
                      norm->numel() == hidden_,
                  "norm weights must be [hidden] contiguous bfloat16");
    }
    layers_.push_back(std::move(layer));
  }
}

void DecodeStack::use_int8(std::vector<at::Tensor> tensors, std::vector<int64_t> groups,
                           int64_t max_packed_rows, bool by_kind) {
  TORCH_CHECK(has_int8_dot(), "int8 decode steps need a CPU with AVX-512 VNNI");
  TORCH_CHECK(tensors.size() == 12 * layers_.size() && groups.size() == 4 * layers_.size(),
              "use_int8: 12 tensors and 4 groups per layer");
  TORCH_CHECK(max_packed_rows >= 0, "max_packed_rows must be >= 0");
  for (size_t l = 0; l < layers_.size(); ++l) {
    Layer& layer = layers_[l];
    Int8* linears[4] = {&layer.qkv8, &layer.o8, &layer.gate_up8, &layer.down8};
    const Int4* int4s[4] = {&layer.qkv, &layer.o, &layer.gate_up, &layer.down};
    for (int i = 0; i < 4; ++i) {
      const auto& quads = tensors[12 * l + 3 * i];
      const auto& scale = tensors[12 * l + 3 * i + 1];
      const auto& smooth = tensors[12 * l + 3 * i + 2];
      const int64_t n = int4s[i]->n, k = int4s[i]->k;
      int64_t group = groups[4 * l + i];
      if (group == 0) group = k;
      TORCH_CHECK(quads.scalar_type() == at::kByte && quads.is_contiguous() &&
                      quads.dim() == 4 && quads.size(0) * 16 == n && quads.size(1) * 4 == k &&
                      quads.size(2) == 16 && quads.size(3) == 4,
                  "layer ", l, ": int8 weights must be quads [n / 16, k / 4, 16, 4] uint8 "
                  "of the int4 ones' shape");
      TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() &&
                      scale.numel() == n && smooth.scalar_type() == at::kFloat &&
                      smooth.is_contiguous() && smooth.numel() == k,
                  "layer ", l, ": scales [n] and smooth [k] must be contiguous float32");
      TORCH_CHECK(group > 0 && group % 4 == 0 && k % group == 0 && (i != 2 || n % 32 == 0),
                  "layer ", l, ": an activation group must be a multiple of 4 dividing k");
      *linears[i] = Int8{quads, scale, smooth, n, k, group};
    }
  }
  max_packed_rows_ = max_packed_rows;
  by_kind_ = by_kind;
  int8_ = true;
}

void DecodeStack::use_all_reduce(ShmAllReduce* all_reduce, double timeout_s, double spin_us) {
  TORCH_CHECK(all_reduce != nullptr && timeout_s > 0 && spin_us >= 0,
              "use_all_reduce: an all-reduce, timeout_s > 0 and spin_us >= 0");
  all_reduce_ = all_reduce;
  all_reduce_timeout_s_ = timeout_s;
  all_reduce_spin_us_ = spin_us;
}

void DecodeStack::sum_over_ranks(at::Tensor& out) const {
  if (all_reduce_ != nullptr) {
    all_reduce_->all_reduce(out, all_reduce_timeout_s_, all_reduce_spin_us_);
  }
}

at::Tensor DecodeStack::forward(at::Tensor x, at::Tensor cos, at::Tensor sin,
                                const std::vector<at::Tensor>& kv,
                                const std::vector<at::Tensor>& kv_scales, at::Tensor slots,
                                at::Tensor block_tables, at::Tensor seq_lens,
                                c10::optional<at::Tensor> positions,
                                const std::vector<at::Tensor>& lora,
                                c10::optional<at::Tensor> skip) const {
  std::tie(cos, sin) = rope_rows(cos, sin, positions, x.size(0));
  check_inputs(x, cos, sin, kv, kv_scales, slots);
  check_decodes(block_tables, seq_lens, x.size(0), kv[0].size(3));
  check_lora(lora, layers_.size(), x.size(0),
             {layers_[0].qkv.n, hidden_, 2 * layers_[0].down.k, hidden_},
             {hidden_, heads_ * d_, hidden_, layers_[0].down.k});
  Plan plan{0, x.size(0), block_tables.data_ptr<int64_t>(), block_tables.size(1),
            seq_lens.data_ptr<int64_t>(), {}, &lora};
  plan.rows_read_each_other = rows_read_each_other(plan, slots, kv[0].size(3));
  plan.skip = skip_rows(skip, x.size(0));
  return run(x, cos, sin, kv, kv_scales, slots, plan);
}

// skip's rows (Plan::skip), checked: [t] contiguous int64; nullptr where none
const int64_t* DecodeStack::skip_rows(const c10::optional<at::Tensor>& skip, int64_t t) {
  if (!skip.has_value()) return nullptr;
  TORCH_CHECK(skip->scalar_type() == at::kLong && skip->is_contiguous() && skip->numel() == t,
              "skip must be [T] contiguous int64, a bit per KV head");
  return skip->data_ptr<int64_t>();
}

// Whether a row's slot lies in another row's context. A row writes the newest position of its
// sequence, in that sequence's last block, which no other sequence holds (a cache hit shares
// only blocks no one writes), so only the last two context blocks of each row are compared:
// rows of one request verifying drafts are a position apart.
bool DecodeStack::rows_read_each_other(const Plan& plan, const at::Tensor& slots,
                                       int64_t block_size) {
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < plan.decodes; ++i) {
    const int64_t block = slot[plan.decode_first + i] / block_size;
    for (int64_t j = 0; j < plan.decodes; ++j) {
      if (j == i) continue;
      const int64_t* table = plan.tables + j * plan.max_blocks;
      const int64_t last = (plan.seq_lens[j] - 1) / block_size;
      if (table[last] == block || (last > 0 && table[last - 1] == block)) return true;
    }
  }
  return false;
}

at::Tensor DecodeStack::forward_mixed(at::Tensor x, at::Tensor cos, at::Tensor sin,
                                      const std::vector<at::Tensor>& kv,
                                      const std::vector<at::Tensor>& kv_scales, at::Tensor slots,
                                      int64_t decode_first, at::Tensor block_tables,
                                      at::Tensor seq_lens, at::Tensor chunk_info,
                                      const std::vector<at::Tensor>& chunk_tables,
                                      c10::optional<at::Tensor> positions,
                                      const std::vector<at::Tensor>& lora,
                                      c10::optional<at::Tensor> skip) const {
  std::tie(cos, sin) = rope_rows(cos, sin, positions, x.size(0));
  check_inputs(x, cos, sin, kv, kv_scales, slots);
  check_lora(lora, layers_.size(), x.size(0),
             {layers_[0].qkv.n, hidden_, 2 * layers_[0].down.k, hidden_},
             {hidden_, heads_ * d_, hidden_, layers_[0].down.k});
  const int64_t t = x.size(0), decodes = seq_lens.numel(), block_size = kv[0].size(3);
  check_decodes(block_tables, seq_lens, decodes, block_size);
  TORCH_CHECK(chunk_info.scalar_type() == at::kLong && chunk_info.is_contiguous() &&
                  chunk_info.dim() == 2 && chunk_info.size(1) == 4 &&
                  chunk_info.size(0) == static_cast<int64_t>(chunk_tables.size()),
              "chunk_info must be [C, 4] contiguous int64, one row per chunk table");
  std::vector<int> covered(t, 0);
  TORCH_CHECK(decode_first >= 0 && decode_first + decodes <= t,
              "the decode rows must lie in the step");
  for (int64_t i = decode_first; i < decode_first + decodes; ++i) covered[i] += 1;
  Plan plan{decode_first, decodes, block_tables.data_ptr<int64_t>(), block_tables.size(1),
            seq_lens.data_ptr<int64_t>(), {}, &lora};
  plan.skip = skip_rows(skip, t);
  const int64_t* info = chunk_info.data_ptr<int64_t>();
  const int64_t num_blocks = kv[0].size(2);
  for (size_t c = 0; c < chunk_tables.size(); ++c) {
    const int64_t first = info[4 * c], n = info[4 * c + 1], seq_len = info[4 * c + 2];
    const bool fresh = info[4 * c + 3] != 0;
    const auto& table = chunk_tables[c];
    TORCH_CHECK(n >= 1 && first >= 0 && first + n <= t && seq_len >= n &&
                    (!fresh || seq_len == n),
                "chunk ", c, ": its rows must lie in the step, its seq_len cover them (a "
                "fresh chunk's equal them)");
    TORCH_CHECK(table.scalar_type() == at::kLong && table.is_contiguous() &&
                    table.dim() == 1 && seq_len <= table.size(0) * block_size,
                "chunk ", c, ": its block table must be [blocks] contiguous int64 covering "
                "its seq_len");
    const int64_t* ids = table.data_ptr<int64_t>();
    check_block_ids(ids, seq_len, block_size, num_blocks);
    for (int64_t i = first; i < first + n; ++i) covered[i] += 1;
    plan.chunks.push_back(Chunk{first, n, seq_len, fresh, ids});
  }
  for (int64_t i = 0; i < t; ++i) {
    TORCH_CHECK(covered[i] == 1, "row ", i, " must be a decode or in one chunk, once");
  }
  return run(x, cos, sin, kv, kv_scales, slots, plan);
}

at::Tensor DecodeStack::run(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                            const std::vector<at::Tensor>& kv,
                            const std::vector<at::Tensor>& kv_scales, const at::Tensor& slots,
                            const Plan& plan) const {
  const bool int8 = !kv_scales.empty();
  const int64_t t = x.size(0), qkv_n = layers_[0].qkv.n, inter = layers_[0].down.k;
  const bool lora = plan.lora != nullptr && !plan.lora->empty();
  const bool prompt_only = plan.decodes == 0 && !plan.chunks.empty();
  const bool a8 = int8_ && ((by_kind_ && prompt_only) || t > max_packed_rows_);
  if (plan.chunks.empty() && t <= kOneRegionRows && !a8 && !lora &&
      !plan.rows_read_each_other) {
    return run_decodes(x, cos, sin, kv, kv_scales, slots, plan);
  }
  const auto opts = x.options();
  auto residual = x.clone();
  auto h = at::empty({t, hidden_}, opts), out = at::empty({t, hidden_}, opts);
  auto qkv = at::empty({t, qkv_n}, opts), q = at::empty({t, heads_, d_}, opts);
  auto att = at::empty({t, heads_, d_}, opts), act = at::empty({t, inter}, opts);
  // int8 steps write silu(gate) * up straight into act: no [gate | up] buffer
  auto gate_up = a8 ? at::Tensor() : at::empty({t, 2 * inter}, opts);
  Int8Rows scratch;
  if (a8) {   // sized for the widest input: down's, o's (more heads than MLP columns) or qkv's
    const int64_t widest = std::max({inter, heads_ * d_, hidden_});
    scratch.q.resize(t * widest);
    scratch.scale.resize(t * widest / 4);
    scratch.sum.resize(t * widest / 4);
  }
  // a rank sharing KV heads: their query heads projected only where they are attended
  Shared shared = a8 ? shared_rows(plan, t) : Shared{};
  const bool sharing = !shared.heads.empty();
  // a fresh chunk over an int8 cache attends over its own k (rotated, before its rounding)
  // and v, copied per chunk into a one-block bfloat16 cache [2, kv_heads, 1, n, d]
  const bool own = int8 && std::any_of(plan.chunks.begin(), plan.chunks.end(),
                                       [](const Chunk& c) { return c.fresh; });
  auto k_out = own ? at::empty({t, kv_heads_, d_}, opts) : at::Tensor();
  std::vector<uint16_t> own_kv;
  auto* r = residual.data_ptr<at::BFloat16>();
  auto* hp = h.data_ptr<at::BFloat16>();
  auto* op = out.data_ptr<at::BFloat16>();
  rms_norm_rows(r, static_cast<at::BFloat16*>(nullptr),
                layers_[0].in_norm.data_ptr<at::BFloat16>(), hp, t, hidden_, eps_);
  for (size_t l = 0; l < layers_.size(); ++l) {
    const Layer& layer = layers_[l];
    if (l > 0) rms_norm_rows(op, r, layer.in_norm.data_ptr<at::BFloat16>(), hp, t, hidden_, eps_);
    if (sharing) {
      linear8_qkv(layer.qkv8, h, qkv, scratch, shared);
    } else if (a8) {
      linear8(layer.qkv8, h, qkv, scratch);
    } else {
      linear(layer.qkv, h, qkv, &layer.o);
    }
    if (lora) add_lora(plan, l, 0, h, qkv);
    const auto& cache = kv[l];
    const int64_t blocks = cache.size(2), block_size = cache.size(3);
    at::Half* kv_scale = int8 ? kv_scales[l].data_ptr<at::Half>() : nullptr;
    if (int8) {
      rope_write_i8(qkv.data_ptr<at::BFloat16>(), cos.data_ptr<at::BFloat16>(),
                    sin.data_ptr<at::BFloat16>(), cache.data_ptr<int8_t>(), kv_scale,
                    slots.data_ptr<int64_t>(), q.data_ptr<at::BFloat16>(), t, heads_,
                    kv_heads_, d_, blocks * block_size,
                    own ? k_out.data_ptr<at::BFloat16>() : nullptr);
    } else {
      rope_write_impl(qkv.data_ptr<at::BFloat16>(), cos.data_ptr<at::BFloat16>(),
                      sin.data_ptr<at::BFloat16>(), cache.data_ptr<at::BFloat16>(),
                      slots.data_ptr<int64_t>(), q.data_ptr<at::BFloat16>(), t, heads_,
                      kv_heads_, d_, blocks * block_size);
    }
    // the o projection's panels past the first kAhead (fetched at the end of qkv's matmul)
    // are fetched by each thread once out of attention work (the decode stack at one row
    // 0.99x the time without, paired)
    const int4w::Next o_next = next_of(layer.o);
    const std::function<void()> fetch_o = [&o_next] {
      int4w::prefetch_next_share(o_next, int4w::kAhead, o_next.n / int4w::kPanel,
                                 omp_get_thread_num());
    };
    attend(plan, q, qkv, k_out, own_kv, cache, kv_scale, att, a8 ? nullptr : &fetch_o);
    const auto attended = att.view({t, heads_ * d_});
    if (a8) {
      if (sharing) {
        linear8_o(layer.o8, attended, out, scratch, shared);
      } else {
        linear8(layer.o8, attended, out, scratch);
      }
      if (lora) add_lora(plan, l, 1, attended, out);
      sum_over_ranks(out);
      rms_norm_rows(op, r, layer.post_norm.data_ptr<at::BFloat16>(), hp, t, hidden_, eps_);
      if (has_lora(plan, l, 2)) {   // the adapter adds to gate | up before the activation
        if (!gate_up.defined()) gate_up = at::empty({t, 2 * inter}, opts);
        linear8(layer.gate_up8, h, gate_up, scratch);
        add_lora(plan, l, 2, h, gate_up);
        silu_and_mul_impl(gate_up.data_ptr<at::BFloat16>(), act.data_ptr<at::BFloat16>(), t,
                          inter);
      } else {
        linear8(layer.gate_up8, h, act, scratch, true);
      }
      linear8(layer.down8, act, out, scratch);
      if (lora) add_lora(plan, l, 3, act, out);
      sum_over_ranks(out);
      continue;
    }
    linear(layer.o, attended, out, &layer.gate_up);
    if (lora) add_lora(plan, l, 1, attended, out);
    sum_over_ranks(out);
    rms_norm_rows(op, r, layer.post_norm.data_ptr<at::BFloat16>(), hp, t, hidden_, eps_);
    linear(layer.gate_up, h, gate_up, &layer.down);
    if (lora) add_lora(plan, l, 2, h, gate_up);
    silu_and_mul_impl(gate_up.data_ptr<at::BFloat16>(), act.data_ptr<at::BFloat16>(), t, inter);
    linear(layer.down, act, out, l + 1 < layers_.size() ? &layers_[l + 1].qkv : nullptr);
    if (lora) add_lora(plan, l, 3, act, out);
    sum_over_ranks(out);
  }
  rms_norm_rows(op, r, final_norm_.data_ptr<at::BFloat16>(), hp, t, hidden_, eps_);
  return h;
}

// Row `row`'s RoPE and cache write for KV head `kvh` (its query heads into q, its key and
// value into the cache at slots[row]): what rope_write_impl / rope_write_i8 do per head.
void DecodeStack::rope_write_head(const at::BFloat16* qkv, const at::BFloat16* cos,
                                  const at::BFloat16* sin, const at::Tensor& cache,
                                  at::Half* kv_scale, const int64_t* slots, at::BFloat16* q,
                                  int64_t row, int64_t kvh) const {
  const int64_t d = d_, num_slots = cache.size(2) * cache.size(3);
  const at::BFloat16* x = qkv + row * (heads_ + 2 * kv_heads_) * d;
  if (kv_scale == nullptr) {
    rope_write_kv_head(x, cos + row * d, sin + row * d, cache.data_ptr<at::BFloat16>(),
                       slots[row], q + row * heads_ * d, kvh, heads_, kv_heads_, d, num_slots);
  } else {
    rope_write_kv_head_i8(x, cos + row * d, sin + row * d, cache.data_ptr<int8_t>(), kv_scale,
                          slots[row], q + row * heads_ * d, kvh, heads_, kv_heads_, d,
                          num_slots);
  }
}

// run() for a step of decodes only, on the int4 weights: every op in one parallel region,
// a barrier after each whose output the threads share out (a matmul: each thread its panels,
// split as matmul's parallel_for splits them; attention: a task per request and KV head as
// threads come free, each doing its heads' RoPE and cache write first). A region per op
// cost its fork and join, ~2.5 us a matmul at a 320 ns round trip between the vCPUs
// (one region for the whole step: the stack at one row 0.94x the time, paired). The norms
// and SwiGLU's activation (a few rows) run in every thread, on its own copy of the residual
// stream and of their outputs, so that no barrier precedes a matmul. The same arithmetic as
// run(): the same output, bit for bit.
at::Tensor DecodeStack::run_decodes(const at::Tensor& x, const at::Tensor& cos,
                                    const at::Tensor& sin, const std::vector<at::Tensor>& kv,
                                    const std::vector<at::Tensor>& kv_scales,
                                    const at::Tensor& slots, const Plan& plan) const {
  const bool int8 = !kv_scales.empty();
  const int64_t t = x.size(0), qkv_n = layers_[0].qkv.n, inter = layers_[0].down.k;
  const int threads = at::get_num_threads();
  const auto opts = x.options();
  auto qkv = at::empty({t, qkv_n}, opts), q = at::empty({t, heads_, d_}, opts);
  auto att = at::empty({t, heads_, d_}, opts), out = at::empty({t, hidden_}, opts);
  auto gate_up = at::empty({t, 2 * inter}, opts), final = at::empty({t, hidden_}, opts);
  // per thread: the residual stream, the norms' output, SwiGLU's activation
  auto residual = x.unsqueeze(0).repeat({threads, 1, 1});
  auto h = at::empty({threads, t, hidden_}, opts);
  auto act = at::empty({threads, t, inter}, opts);
  using BF = at::BFloat16;
  BF* const op = out.data_ptr<BF>();
  BF* const gp = gate_up.data_ptr<BF>();
  const int64_t row = heads_ * d_;
  auto attend_decodes = d_ == 64 ? decode::decode_attention_team<64>
                                 : decode::decode_attention_team<128>;
  // an all-reduce that raises (a rank gone) must not throw out of the parallel region: thread
  // 0 keeps the error, every thread leaves the layers after the barrier, and it is thrown here
  std::exception_ptr error;
  bool failed = false;
#pragma omp parallel num_threads(threads)
  {
    const int tid = omp_get_thread_num(), team = omp_get_num_threads();
    BF* const r = residual.data_ptr<BF>() + tid * t * hidden_;
    BF* const hp = h.data_ptr<BF>() + tid * t * hidden_;
    BF* const ap = act.data_ptr<BF>() + tid * t * inter;
    auto linear = [&](const Int4& w, const BF* in, int64_t k, BF* dst, const Int4* next) {
      int4w::matmul_share(reinterpret_cast<const uint16_t*>(in), t, k, w.q.data_ptr<uint8_t>(),
                          bits(w.scale_min), w.n, w.k, reinterpret_cast<uint16_t*>(dst),
                          next != nullptr ? next_of(*next) : int4w::Next{}, tid, team);
#pragma omp barrier
    };
    // out summed over the ranks by thread 0 (the others wait at the barrier); false where
    // that failed
    auto summed = [&]() {
      if (all_reduce_ == nullptr) return true;
      if (tid == 0) {
        try {
          sum_over_ranks(out);
        } catch (...) {
          error = std::current_exception();
          failed = true;
        }
      }
#pragma omp barrier
      return !failed;
    };
    rms_norm_rows(r, static_cast<BF*>(nullptr), layers_[0].in_norm.data_ptr<BF>(), hp, t,
                  hidden_, eps_);
    for (size_t l = 0; l < layers_.size(); ++l) {
      const Layer& layer = layers_[l];
      if (l > 0) rms_norm_rows(op, r, layer.in_norm.data_ptr<BF>(), hp, t, hidden_, eps_);
      linear(layer.qkv, hp, hidden_, qkv.data_ptr<BF>(), &layer.o);
      const auto& cache = kv[l];
      const int64_t blocks = cache.size(2), block_size = cache.size(3);
      at::Half* kv_scale = int8 ? kv_scales[l].data_ptr<at::Half>() : nullptr;
      // each attention task first rotates its query heads and its key, and writes its key
      // and value into the cache (what rope_write does for the whole step, the same bits)
      const std::function<void(int64_t, int64_t)> rope_write = [&](int64_t m, int64_t kvh) {
        rope_write_head(qkv.data_ptr<BF>(), cos.data_ptr<BF>(), sin.data_ptr<BF>(), cache,
                        kv_scale, slots.data_ptr<int64_t>(), q.data_ptr<BF>(),
                        plan.decode_first + m, kvh);
      };
      // o's panels past the first kAhead are fetched by each thread once out of tasks
      const int4w::Next o_next = next_of(layer.o);
      const std::function<void()> fetch_o = [&o_next, tid, team] {
        int4w::prefetch_next_share(o_next, int4w::kAhead, o_next.n / int4w::kPanel, tid,
                                   team);
      };
      attend_decodes(bits(q) + plan.decode_first * row, row, d_, cache.data_ptr(), kv_scale,
                     plan.tables, plan.seq_lens, bits(att) + plan.decode_first * row,
                     plan.decodes, heads_, kv_heads_, blocks, block_size, plan.max_blocks,
                     scale_, &fetch_o, &rope_write,
                     plan.skip != nullptr ? plan.skip + plan.decode_first : nullptr);
#pragma omp barrier
      linear(layer.o, att.data_ptr<BF>(), row, op, &layer.gate_up);
      if (!summed()) break;
      rms_norm_rows(op, r, layer.post_norm.data_ptr<BF>(), hp, t, hidden_, eps_);
      linear(layer.gate_up, hp, hidden_, gp, &layer.down);
      silu_and_mul_impl(static_cast<const BF*>(gp), ap, t, inter);
      linear(layer.down, ap, inter, op, l + 1 < layers_.size() ? &layers_[l + 1].qkv : nullptr);
      if (!summed()) break;
    }
    if (tid == 0 && !failed) {
      rms_norm_rows(op, r, final_norm_.data_ptr<BF>(), final.data_ptr<BF>(), t, hidden_, eps_);
    }
  }
  if (error) std::rethrow_exception(error);
  return final;
}

// att = attention of q over the cache, as the plan splits the rows: the decodes on the decode
// kernel (each of its threads calling `after` once out of work), each chunk on the prefill
// kernel (a fresh one over an int8 cache: over its own k from k_out and v from qkv)
void DecodeStack::attend(const Plan& plan, const at::Tensor& q, const at::Tensor& qkv,
                         const at::Tensor& k_out, std::vector<uint16_t>& own_kv,
                         const at::Tensor& cache, const at::Half* kv_scale, at::Tensor& att,
                         const std::function<void()>* after) const {
  const int64_t blocks = cache.size(2), block_size = cache.size(3), row = heads_ * d_;
  if (plan.decodes > 0) {
    auto decode = d_ == 64 ? decode::decode_attention_bf16<64>
                           : decode::decode_attention_bf16<128>;
    decode(bits(q) + plan.decode_first * row, row, d_, cache.data_ptr(), kv_scale,
           plan.tables, plan.seq_lens, bits(att) + plan.decode_first * row, plan.decodes,
           heads_, kv_heads_, blocks, block_size, plan.max_blocks, scale_, after,
           plan.skip != nullptr ? plan.skip + plan.decode_first : nullptr);
  }
  if (plan.chunks.empty()) return;
  // every chunk in one call, so that chunks holding the same cached prefix read it from one
  // packed copy; a fresh chunk over an int8 cache reads its own k and v, copied into a
  // one-block bfloat16 cache [2, kv_heads, 1, n, d] of its own in own_kv
  int64_t own_rows = 0;
  for (const Chunk& c : plan.chunks) own_rows += kv_scale != nullptr && c.fresh ? c.n : 0;
  own_kv.resize(2 * kv_heads_ * own_rows * d_);
  static const int64_t kOneBlock[1] = {0};
  std::vector<prefill::ChunkRef> chunks;
  uint16_t* own = own_kv.data();
  for (const Chunk& c : plan.chunks) {
    const uint16_t* qc = bits(q) + c.first * row;
    uint16_t* oc = bits(att) + c.first * row;
    if (kv_scale == nullptr || !c.fresh) {
      chunks.push_back({qc, row, oc, c.n, c.seq_len, cache.data_ptr(), kv_scale, c.table,
                        blocks, block_size});
      continue;
    }
    const uint16_t* k = bits(k_out) + c.first * kv_heads_ * d_;
    const uint16_t* v = bits(qkv) + c.first * qkv.size(1) + (heads_ + kv_heads_) * d_;
    for (int64_t h = 0; h < kv_heads_; ++h) {
      for (int64_t j = 0; j < c.n; ++j) {
        std::memcpy(own + (h * c.n + j) * d_, k + (j * kv_heads_ + h) * d_,
                    d_ * sizeof(uint16_t));
        std::memcpy(own + ((kv_heads_ + h) * c.n + j) * d_, v + j * qkv.size(1) + h * d_,
                    d_ * sizeof(uint16_t));
      }
    }
    chunks.push_back({qc, row, oc, c.n, c.n, own, nullptr, kOneBlock, 1, c.n});
    own += 2 * kv_heads_ * c.n * d_;
  }
  if (plan.skip != nullptr) {   // a chunk's rows are one request's: its first row's bits
    for (size_t i = 0; i < chunks.size(); ++i) chunks[i].skip = plan.skip[plan.chunks[i].first];
  }
  const auto prefill = d_ == 64 ? prefill::prefill_chunks_impl<64>
                                : prefill::prefill_chunks_impl<128>;
  prefill(chunks.data(), static_cast<int64_t>(chunks.size()), heads_, kv_heads_, scale_);
}

void DecodeStack::check_lora(const std::vector<at::Tensor>& lora, size_t layers, int64_t t,
                             const std::vector<int64_t>& outs,
                             const std::vector<int64_t>& ins) {
  if (lora.empty()) return;
#ifdef EMBER_INT8_DOT
  TORCH_CHECK(lora.size() == 2 + 20 * layers,
              "lora: rows, starts and (A, A's scales, B, B's scales, ranges) per projection of "
              "every layer");
  const auto& rows = lora[0];
  for (size_t i = 2; i < lora.size(); i += 5) {
    if (lora[i].numel() > 0) {
      check_lora_factors(rows, lora[1], lora[i], lora[i + 1], lora[i + 2], lora[i + 3],
                         lora[i + 4], outs[(i - 2) / 5 % 4]);
      TORCH_CHECK(lora[i].size(1) == (ins[(i - 2) / 5 % 4] + 3) / 4,
                  "lora: A's quads of inputs must cover the projection's input");
    }
  }
  const int64_t* r = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows.numel(); ++i) {
    TORCH_CHECK(r[i] >= 0 && r[i] < t, "lora: a row is outside the step");
  }
#else
  TORCH_CHECK(false, "LoRA adapters in the decode stack need the AVX-512 VNNI kernels");
#endif
}

bool DecodeStack::has_lora(const Plan& plan, size_t l, int p) {
  return plan.lora != nullptr && !plan.lora->empty() &&
         (*plan.lora)[2 + 20 * l + 5 * p].numel() > 0;
}

// What LoraLayer.add_ computes (ember/lora/batch.py): the same kernel
void DecodeStack::add_lora(const Plan& plan, size_t l, int p, const at::Tensor& in,
                           at::Tensor& y) {
  if (!has_lora(plan, l, p)) return;
#ifdef EMBER_INT8_DOT
  const auto& lora = *plan.lora;
  const size_t first = 2 + 20 * l + 5 * p;
  const auto& a = lora[first];
  lora_add_impl(reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()), y.stride(0),
                reinterpret_cast<const uint16_t*>(in.data_ptr<at::BFloat16>()), in.stride(0),
                lora[0].data_ptr<int64_t>(), lora[1].data_ptr<int64_t>(), lora[1].numel() - 1,
                a.data_ptr<int8_t>(), lora[first + 1].data_ptr<float>(),
                lora[first + 2].data_ptr<int8_t>(), lora[first + 3].data_ptr<float>(),
                lora[first + 4].data_ptr<int32_t>(), a.size(2), in.size(1), y.size(1));
#endif
}

// out = x w^T on int8 dot products (bfloat16), or with `swiglu` silu(gate) * up of it
void DecodeStack::linear8(const Int8& w, const at::Tensor& x, at::Tensor& out,
                          Int8Rows& scratch, bool swiglu) {
#ifdef EMBER_INT8_DOT
  const auto rows = quantize8(w, x, scratch);
  const auto* quads = w.quads.data_ptr<uint8_t>();
  if (swiglu) {
    int8a8::matmul<int8a8::Out::kSwiglu>(rows, quads, w.scale.data_ptr<float>(), w.n, w.k,
                                         out.data_ptr());
  } else {
    int8a8::matmul<int8a8::Out::kBfloat16>(rows, quads, w.scale.data_ptr<float>(), w.n, w.k,
                                           out.data_ptr());
  }
#endif
}

DecodeStack::Shared DecodeStack::shared_rows(const Plan& plan, int64_t t) const {
  Shared shared;
  if (plan.skip == nullptr) return shared;
  int64_t left = 0;   // a bit per local KV head some row leaves to another rank
  for (int64_t i = 0; i < t; ++i) left |= plan.skip[i];
  if (left == 0) return shared;
  const int64_t span = heads_ / kv_heads_ * d_;   // a KV head's query columns
  TORCH_CHECK(span % 16 == 0, "a KV head's query columns must be whole 16-column panels");
  for (int64_t kvh = 0; kvh < kv_heads_; ++kvh) {
    if ((left >> kvh & 1) == 0) continue;
    shared.heads.push_back(kvh);
    auto& rows = shared.attend.emplace_back();
    for (int64_t i = 0; i < t; ++i) {
      if ((plan.skip[i] >> kvh & 1) == 0) rows.push_back(i);
    }
  }
  for (int64_t i = 0; i < t; ++i) {   // from the first head a row attends to its last
    int64_t lo = 0, hi = kv_heads_;
    while (lo < hi && (plan.skip[i] >> lo & 1)) ++lo;
    while (hi > lo && (plan.skip[i] >> (hi - 1) & 1)) --hi;
    const std::pair<int64_t, int64_t> window{lo * span, hi * span};
    auto same = std::find_if(shared.windows.begin(), shared.windows.end(),
                             [&](const auto& w) { return w.first == window; });
    if (same == shared.windows.end()) {
      shared.windows.push_back({window, {}});
      same = shared.windows.end() - 1;
    }
    same->second.push_back(i);
  }
  const int64_t widest = std::max(heads_ * d_, hidden_);
  shared.picked.q.resize(t * widest);
  shared.picked.scale.resize(t * widest / 4);
  shared.picked.sum.resize(t * widest / 4);
  shared.out.resize(t * std::max(span, hidden_));
  return shared;
}

#ifdef EMBER_INT8_DOT
int8a8::Rows DecodeStack::quantize8(const Int8& w, const at::Tensor& x, Int8Rows& scratch) {
  return int8a8::quantize(x.data_ptr<at::BFloat16>(), x.size(0), w.k, x.stride(0),
                          w.smooth.data_ptr<float>(), w.group, scratch.q.data(),
                          scratch.scale.data(), scratch.sum.data());
}

void DecodeStack::columns8(const int8a8::Rows& x, const Int8& w, int64_t first, int64_t width,
                           at::BFloat16* dst, int64_t stride) {
  if (width <= 0) return;
  const uint8_t* panels = w.quads.data_ptr<uint8_t>() + first / 16 * (w.k / 4 * 64);
  int8a8::matmul<int8a8::Out::kBfloat16>(x, panels, w.scale.data_ptr<float>() + first, width,
                                         w.k, dst, stride);
}

void DecodeStack::columns8(const int8a8::Rows& x, const std::vector<int64_t>& which,
                           const Int8& w, int64_t first, int64_t width, at::BFloat16* dst,
                           int64_t stride, Shared& shared) {
  const int64_t count = static_cast<int64_t>(which.size());
  if (count == x.m) return columns8(x, w, first, width, dst, stride);
  if (count == 0) return;
  const auto picked = int8a8::pick(x, which.data(), count, shared.picked.q.data(),
                                   shared.picked.scale.data(), shared.picked.sum.data());
  columns8(picked, w, first, width, shared.out.data(), width);
  for (int64_t j = 0; j < count; ++j) {
    std::memcpy(dst + which[j] * stride, shared.out.data() + j * width,
                width * sizeof(at::BFloat16));
  }
}
#endif

// qkv's columns: every row's, but for each shared KV head its query heads' only for the
// rows attending it here (zeros for the others); the same bits where computed as linear8
void DecodeStack::linear8_qkv(const Int8& w, const at::Tensor& x, at::Tensor& out,
                              Int8Rows& scratch, Shared& shared) const {
#ifdef EMBER_INT8_DOT
  using BF = at::BFloat16;
  const auto rows = quantize8(w, x, scratch);
  const int64_t t = x.size(0), n = w.n, span = heads_ / kv_heads_ * d_;
  BF* const o = out.data_ptr<BF>();
  int64_t begin = 0;   // the columns between the shared heads' queries, for every row
  for (const int64_t kvh : shared.heads) {
    columns8(rows, w, begin, kvh * span - begin, o + begin, n);
    begin = (kvh + 1) * span;
  }
  columns8(rows, w, begin, n - begin, o + begin, n);
  for (size_t i = 0; i < shared.heads.size(); ++i) {
    const int64_t first = shared.heads[i] * span;
    if (static_cast<int64_t>(shared.attend[i].size()) < t) {
      for (int64_t r = 0; r < t; ++r) std::memset(o + r * n + first, 0, span * sizeof(BF));
    }
    columns8(rows, shared.attend[i], w, first, span, o + first, n, shared);
  }
#endif
}

// o = x w^T where x's rows are zeros outside their windows (the heads each attends here):
// each row's products over its window only, the same bits as over the whole row (linear8)
void DecodeStack::linear8_o(const Int8& w, const at::Tensor& x, at::Tensor& out,
                            Int8Rows& scratch, Shared& shared) const {
#ifdef EMBER_INT8_DOT
  using BF = at::BFloat16;
  auto rows = quantize8(w, x, scratch);
  const int64_t n = w.n;
  BF* const o = out.data_ptr<BF>();
  if (rows.groups != 1) {   // windows lie in one group: every input then
    columns8(rows, w, 0, n, o, n);
    return;
  }
  for (const auto& [window, which] : shared.windows) {
    if (window.first >= window.second) {   // a row attending no head here: no products
      for (const int64_t r : which) std::memset(o + r * n, 0, n * sizeof(BF));
      continue;
    }
    rows.from = window.first;
    rows.to = window.second;
    columns8(rows, which, w, 0, n, o, n, shared);
  }
#endif
}

DecodeStack::Int4 DecodeStack::int4(at::Tensor q, at::Tensor scale_min) {
  check_int4_panels(q, scale_min);
  return Int4{q, scale_min, q.size(0) * 16, q.size(1) * 32};
}

// a bfloat16 or float16 tensor's 16-bit words (the int4 weights' scales are float16)
const uint16_t* DecodeStack::bits(const at::Tensor& t) {
  return static_cast<const uint16_t*>(t.const_data_ptr());
}

uint16_t* DecodeStack::bits(at::Tensor& t) {
  return static_cast<uint16_t*>(t.data_ptr());
}

// w as the int4 kernels take a weight to fetch ahead of its matmul
int4w::Next DecodeStack::next_of(const Int4& w) {
  return int4w::Next{w.q.data_ptr<uint8_t>(), bits(w.scale_min), w.n, w.k};
}

// out = x w^T; the first panels of `next` (what runs after it) are fetched meanwhile
void DecodeStack::linear(const Int4& w, const at::Tensor& x, at::Tensor& out,
                         const Int4* next) {
  int4w::matmul(bits(x), x.size(0), x.stride(0), w.q.data_ptr<uint8_t>(), bits(w.scale_min),
                w.n, w.k, bits(out), next != nullptr ? next_of(*next) : int4w::Next{});
}

// cos and sin as given, or with positions [t] their rows at those positions (tables [P, 1,
// d] contiguous bfloat16, every position in [0, P))
std::pair<at::Tensor, at::Tensor> DecodeStack::rope_rows(
    const at::Tensor& cos, const at::Tensor& sin,
    const c10::optional<at::Tensor>& positions, int64_t t) const {
  if (!positions.has_value()) return {cos, sin};
  const auto& pos = *positions;
  TORCH_CHECK(pos.scalar_type() == at::kLong && pos.is_contiguous() && pos.dim() == 1 &&
                  pos.numel() == t,
              "positions must be [T] contiguous int64, one per row of x");
  for (const auto* table : {&cos, &sin}) {
    TORCH_CHECK(table->scalar_type() == at::kBFloat16 && table->is_contiguous() &&
                    table->dim() == 3 && table->size(1) == 1 && table->size(2) == d_ &&
                    table->sizes() == cos.sizes(),
                "with positions, cos and sin must be tables [P, 1, head_dim] of contiguous "
                "bfloat16");
  }
  const int64_t* p = pos.data_ptr<int64_t>();
  for (int64_t i = 0; i < t; ++i) {
    TORCH_CHECK(p[i] >= 0 && p[i] < cos.size(0), "position ", p[i], " is outside the RoPE "
                "tables (", cos.size(0), " positions): make them for max_model_len");
  }
  auto rows = [&](const at::Tensor& table) {
    auto out = at::empty({t, 1, d_}, table.options());
    const auto* src = table.data_ptr<at::BFloat16>();
    auto* dst = out.data_ptr<at::BFloat16>();
    for (int64_t i = 0; i < t; ++i) {
      std::memcpy(dst + i * d_, src + p[i] * d_, d_ * sizeof(at::BFloat16));
    }
    return out;
  };
  return {rows(cos), rows(sin)};
}

void DecodeStack::check_inputs(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                               const std::vector<at::Tensor>& kv,
                               const std::vector<at::Tensor>& kv_scales,
                               const at::Tensor& slots) const {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 2 &&
                  x.size(1) == hidden_ && x.is_contiguous() && x.size(0) >= 1,
              "x must be [T, hidden] contiguous bfloat16, T >= 1");
  const int64_t t = x.size(0);
  for (const auto* c : {&cos, &sin}) {
    TORCH_CHECK(c->scalar_type() == at::kBFloat16 && c->is_contiguous() &&
                    c->numel() == t * d_,
                "cos and sin must be [T, 1, head_dim] contiguous bfloat16");
  }
  TORCH_CHECK(kv.size() == layers_.size(), "one KV cache per layer");
  TORCH_CHECK(kv_scales.empty() || kv_scales.size() == kv.size(),
              "kv_scales: none (bfloat16 caches) or one per layer (int8 caches)");
  const auto dtype = kv_scales.empty() ? at::kBFloat16 : at::kChar;
  for (size_t l = 0; l < kv.size(); ++l) {
    const auto& cache = kv[l];
    TORCH_CHECK(cache.scalar_type() == dtype && cache.is_contiguous() &&
                    cache.dim() == 5 && cache.size(0) == 2 && cache.size(1) == kv_heads_ &&
                    cache.size(4) == d_ && cache.sizes() == kv[0].sizes(),
                "each KV cache must be a contiguous bfloat16 (int8, with kv_scales) [2, "
                "kv_heads, blocks, block_size, head_dim]");
    if (!kv_scales.empty()) check_int8_cache(cache, kv_scales[l]);
  }
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() &&
                  slots.numel() == t,
              "slots must be [T] contiguous int64");
  const int64_t blocks = kv[0].size(2), block_size = kv[0].size(3);
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < t; ++i) {
    TORCH_CHECK(slot[i] >= 0 && slot[i] < blocks * block_size, "a slot is outside the cache");
  }
}

// `count` decodes' block_tables [count, max_blocks] and seq_lens [count]
void DecodeStack::check_decodes(const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                int64_t count, int64_t block_size) {
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.is_contiguous() &&
                  block_tables.dim() == 2 && block_tables.size(0) == count &&
                  seq_lens.scalar_type() == at::kLong && seq_lens.is_contiguous() &&
                  seq_lens.numel() == count,
              "block_tables [T, max_blocks] and seq_lens [T] (T: the decodes) must be "
              "contiguous int64");
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i) {
    TORCH_CHECK(lens[i] >= 1 && lens[i] <= block_tables.size(1) * block_size,
                "seq_lens must be in [1, max_blocks * block_size]");
  }
}
#endif  // EMBER_BF16_DOT

// What the threads' synchronisation costs, in nanoseconds (best of `rounds` tries each):
// {a cache line bounced between threads 0 and 1, per round trip (NaN with one thread); an
// empty parallel region over every thread, fork and join}. A batch-1 decode step pays ~5
// parallel regions a layer (one per matmul and per attention), and each moves its results
// between the cores: the figures change when a VM's vCPUs move (ember roofline).
std::vector<double> thread_sync_ns(int64_t rounds) {
  TORCH_CHECK(rounds >= 1, "rounds must be >= 1");
  constexpr int64_t kBounces = 20000, kRegions = 5000;
  alignas(64) std::atomic<int64_t> flag{0};
  double round_trip = std::numeric_limits<double>::quiet_NaN();
  if (at::get_num_threads() >= 2) {
    for (int64_t r = 0; r < rounds; ++r) {
      double seconds = -1;
#pragma omp parallel num_threads(2)
      {
        const int64_t me = omp_get_thread_num(), both = omp_get_num_threads();
        if (both == 2) {   // a second thread was given (else nothing to bounce against)
#pragma omp barrier
          const auto start = std::chrono::steady_clock::now();
          for (int64_t i = 0; i < kBounces; ++i) {
            const int64_t mine = 2 * i + me;   // thread 0 waits for 2i, thread 1 for 2i + 1
            while (flag.load(std::memory_order_acquire) != mine) {}
            flag.store(mine + 1, std::memory_order_release);
          }
          if (me == 0) {
            seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() -
                                                    start).count();
          }
#pragma omp barrier
        }
      }
      flag = 0;
      if (seconds >= 0) round_trip = std::fmin(round_trip, seconds / kBounces * 1e9);
    }
  }
  double region = std::numeric_limits<double>::infinity();
  for (int64_t r = 0; r < rounds; ++r) {
    std::atomic<int64_t> sink{0};
    const auto start = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < kRegions; ++i) {
#pragma omp parallel num_threads(at::get_num_threads())
      sink.fetch_add(1, std::memory_order_relaxed);
    }
    region = std::fmin(region, std::chrono::duration<double>(std::chrono::steady_clock::now() -
                                                             start).count() / kRegions * 1e9);
  }
  return {round_trip, region};
}

}  // namespace ember

// CPU kernels for the decode-heavy parts of a step that eager PyTorch runs as many small ops:
// RMSNorm (with the residual add fused in), RoPE fused with the KV-cache write, SwiGLU's
// activation, and attention of one new token per request over the paged KV cache, read in
// place through the block table (no gathered copy).
// Float32 and bfloat16; math in float32. The torch code in ember/models is the reference.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

inline float load(float x) { return x; }
inline float load(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
template <typename T> inline T store(float x) { return static_cast<T>(x); }

// exp(x) for x <= 0 (softmax after subtracting the max), in a form the compiler vectorizes:
// x = n ln2 + r with |r| <= ln2 / 2, e^r by its Taylor series to r^6 (relative error
// ~1e-7), times 2^n built in the exponent bits. Below -87 it returns ~0 (2^-126 scale).
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693145751953125f - n * 1.428606765330187045e-06f;
  const float p =
      1.f + r * (1.f + r * (0.5f + r * (1.f / 6 + r * (1.f / 24 + r * (1.f / 120 + r / 720)))));
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

template <typename T>
void rms_norm_rows(const T* x, T* residual, const T* weight, T* out, int64_t rows,
                   int64_t n, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * n;
      T* outr = out + r * n;
      const T* src = xr;
      if (residual != nullptr) {  // residual += x, rounded to T, then normalised
        T* res = residual + r * n;
        for (int64_t i = 0; i < n; ++i) res[i] = store<T>(load(xr[i]) + load(res[i]));
        src = res;
      }
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < n; ++i) {
        float v = load(src[i]);
        ss += v * v;
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
      for (int64_t i = 0; i < n; ++i) outr[i] = store<T>(load(src[i]) * inv * load(weight[i]));
    }
  });
}

constexpr int64_t kMaxHeadDim = 256;

// fn(t, row) for each of a request's first `len` cached tokens, walking its block table block
// by block (no division per token); `row` holds the token's d values in float32.
template <typename T, typename Fn>
inline void for_each_cached_row(const T* base, const int64_t* table, int64_t len,
                                int64_t block_size, int64_t d, float* row, Fn&& fn) {
  const int64_t block_stride = block_size * d;
  for (int64_t t0 = 0; t0 < len; t0 += block_size) {
    const T* block = base + table[t0 / block_size] * block_stride;
    const int64_t n = std::min(block_size, len - t0);
    for (int64_t j = 0; j < n; ++j) {
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) row[i] = load(block[j * d + i]);
      fn(t0 + j, row);
    }
  }
}

// D > 0: the head size known at compile time (64, 128: the loops unroll); 0: any, from `dim`.
template <typename T, int64_t D>
void decode_attention_impl(const T* q, int64_t q_stride_m, int64_t q_stride_h, const T* kv,
                           const int64_t* block_tables,
                           const int64_t* seq_lens, T* out, int64_t members, int64_t heads,
                           int64_t kv_heads, int64_t num_blocks, int64_t block_size, int64_t dim,
                           int64_t max_blocks, float scale) {
  const int64_t d = D > 0 ? D : dim;
  const int64_t per_kv = heads / kv_heads;
  const int64_t block_stride = block_size * d;
  const int64_t v_offset = kv_heads * num_blocks * block_stride;  // K then V
  at::parallel_for(0, members * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(per_kv * d), acc(per_kv * d), scores;
    float row[kMaxHeadDim];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t m = task / kv_heads, h = task % kv_heads;
      const int64_t len = seq_lens[m];
      const int64_t* table = block_tables + m * max_blocks;
      const T* kbase = kv + h * num_blocks * block_stride;
      const T* vbase = kbase + v_offset;
      for (int64_t p = 0; p < per_kv; ++p) {
        const T* qr = q + m * q_stride_m + (h * per_kv + p) * q_stride_h;
        for (int64_t i = 0; i < d; ++i) qf[p * d + i] = load(qr[i]) * scale;
      }
      scores.resize(per_kv * len);
      // scores[p, t] = q_p . k_t
      for_each_cached_row(kbase, table, len, block_size, d, row, [&](int64_t t, const float* k) {
        for (int64_t p = 0; p < per_kv; ++p) {
          const float* qp = qf.data() + p * d;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t i = 0; i < d; ++i) s += qp[i] * k[i];
          scores[p * len + t] = s;
        }
      });
      for (int64_t p = 0; p < per_kv; ++p) {  // softmax in place
        float* sp = scores.data() + p * len;
        float mx = -INFINITY;
        for (int64_t t = 0; t < len; ++t) mx = std::max(mx, sp[t]);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < len; ++t) {
          sp[t] = exp_nonpositive(sp[t] - mx);
          sum += sp[t];
        }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < len; ++t) sp[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for_each_cached_row(vbase, table, len, block_size, d, row, [&](int64_t t, const float* v) {
        for (int64_t p = 0; p < per_kv; ++p) {
          const float w = scores[p * len + t];
          float* ap = acc.data() + p * d;
#pragma omp simd
          for (int64_t i = 0; i < d; ++i) ap[i] += w * v[i];
        }
      });
      for (int64_t p = 0; p < per_kv; ++p) {
        T* o = out + (m * heads + h * per_kv + p) * d;
        for (int64_t i = 0; i < d; ++i) o[i] = store<T>(acc[p * d + i]);
      }
    }
  });
}

// Rotate one head in place of `out`: out = x * cos + roll(x, d / 2) * sin, with sin's first
// half negated by the caller (ember/models/layers.py rope_cos_sin).
template <typename T>
inline void rope_head(const T* x, const T* cos, const T* sin, T* out, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; ++i) {
    out[i] = store<T>(load(x[i]) * load(cos[i]) + load(x[i + half]) * load(sin[i]));
    out[i + half] = store<T>(load(x[i + half]) * load(cos[i + half]) +
                             load(x[i]) * load(sin[i + half]));
  }
}

template <typename T>
void rope_write_impl(const T* qkv, const T* cos, const T* sin, T* kv, const int64_t* slots,
                     T* q_out, int64_t tokens, int64_t heads, int64_t kv_heads, int64_t d,
                     int64_t num_slots) {
  const int64_t row = (heads + 2 * kv_heads) * d;
  const int64_t v_offset = kv_heads * num_slots * d;  // K then V, heads first
  at::parallel_for(0, tokens, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* x = qkv + t * row;
      const T* c = cos + t * d;
      const T* s = sin + t * d;
      for (int64_t h = 0; h < heads; ++h) {
        rope_head(x + h * d, c, s, q_out + (t * heads + h) * d, d);
      }
      const int64_t slot = slots[t];
      for (int64_t h = 0; h < kv_heads; ++h) {
        T* k_dst = kv + (h * num_slots + slot) * d;
        rope_head(x + (heads + h) * d, c, s, k_dst, d);
        std::memcpy(k_dst + v_offset, x + (heads + kv_heads + h) * d, d * sizeof(T));
      }
    }
  });
}

template <typename T>
void silu_and_mul_impl(const T* x, T* out, int64_t rows, int64_t n) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = x + r * 2 * n;
      const T* up = gate + n;
      T* o = out + r * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) {  // silu(g) = g * sigmoid(g), e = exp(-|g|) <= 1
        const float g = load(gate[i]);
        const float e = exp_nonpositive(-std::fabs(g));
        const float sigmoid = (g >= 0.f ? 1.f : e) / (1.f + e);
        o[i] = store<T>(g * sigmoid * load(up[i]));
      }
    }
  });
}

void check_float(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
              " must be float32 or bfloat16");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

}  // namespace

// rms_norm(x [rows, n], weight [n], eps) -> out; with `residual`, residual += x first (in
// place) and the sum is normalised.
torch::Tensor rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual,
                       torch::Tensor weight, double eps) {
  check_float(x, "x");
  check_float(weight, "weight");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "weight must have x's dtype");
  const int64_t n = x.size(-1);
  auto out = torch::empty_like(x);
  if (residual.has_value()) {
    check_float(*residual, "residual");
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(),
                "residual must match x");
  }
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(),
                            residual.has_value() ? residual->data_ptr<scalar_t>() : nullptr,
                            weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                            x.numel() / n, n, static_cast<float>(eps));
  });
  return out;
}

// decode_attention(q [B, heads, d] (rows and heads may be strided),
// kv [2, kv_heads, blocks, block_size, d], block_tables [B, max_blocks] int64,
// seq_lens [B] int64, scale) -> [B, heads, d]: each request's one new token attends over its
// first seq_lens[b] cached tokens (its own included: write it first).
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor kv, torch::Tensor block_tables,
                               torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.device().is_cpu() && q.stride(-1) == 1, "q must be on the CPU, its last "
              "dimension contiguous");
  check_float(kv, "kv");
  TORCH_CHECK(kv.scalar_type() == q.scalar_type(), "kv must have q's dtype");
  TORCH_CHECK(q.dim() == 3 && kv.dim() == 5, "q must be [B, heads, d], kv 5-D");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong &&
              block_tables.is_contiguous() && seq_lens.is_contiguous(),
              "block_tables and seq_lens must be contiguous int64");
  const int64_t members = q.size(0), heads = q.size(1), d = q.size(2);
  const int64_t kv_heads = kv.size(1), num_blocks = kv.size(2), block_size = kv.size(3);
  TORCH_CHECK(kv.size(4) == d && heads % kv_heads == 0 && d <= kMaxHeadDim,
              "head sizes do not match (or head_dim > 256)");
  TORCH_CHECK(block_tables.size(0) == members && seq_lens.size(0) == members,
              "one block table and one length per request");
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  for (int64_t m = 0; m < members; ++m) {  // a loop, not min()/max(): two ops cost more
    TORCH_CHECK(lens[m] >= 1 && lens[m] <= block_tables.size(1) * block_size,
                "seq_lens must be in [1, max_blocks * block_size]");
  }
  auto out = torch::empty({members, heads, d}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "decode_attention", [&] {
    auto run = [&](auto kernel) {
      kernel(q.data_ptr<scalar_t>(), q.stride(0), q.stride(1), kv.data_ptr<scalar_t>(),
             block_tables.data_ptr<int64_t>(),
             seq_lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), members, heads, kv_heads,
             num_blocks, block_size, d, block_tables.size(1), static_cast<float>(scale));
    };
    if (d == 64) {
      run(decode_attention_impl<scalar_t, 64>);
    } else if (d == 128) {
      run(decode_attention_impl<scalar_t, 128>);
    } else {
      run(decode_attention_impl<scalar_t, 0>);
    }
  });
  return out;
}

// rope_write(qkv [T, (heads + 2 kv_heads) * d], cos, sin [T, 1, d], kv [2, kv_heads, blocks,
// block_size, d], slots [T] int64, heads, kv_heads) -> q [T, heads, d]: rotates q and k, writes
// k and v into the cache at `slots`, returns the rotated q.
torch::Tensor rope_write(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin,
                         torch::Tensor kv, torch::Tensor slots, int64_t heads,
                         int64_t kv_heads) {
  for (auto* t : {&qkv, &cos, &sin, &kv}) check_float(*t, "rope_write inputs");
  const int64_t tokens = qkv.size(0), d = kv.size(4);
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (heads + 2 * kv_heads) * d && kv.dim() == 5 &&
                  kv.size(1) == kv_heads && d % 2 == 0,
              "qkv must be [T, (heads + 2 kv_heads) * head_dim] for this cache");
  TORCH_CHECK(cos.numel() == tokens * d && sin.numel() == tokens * d, "cos/sin: [T, 1, d]");
  TORCH_CHECK(cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type() &&
                  kv.scalar_type() == qkv.scalar_type(),
              "qkv, cos, sin and kv must share a dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() &&
                  slots.numel() == tokens,
              "slots must be [T] contiguous int64");
  const int64_t num_slots = kv.size(2) * kv.size(3);
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, "a slot is outside the cache");
  }
  auto q = torch::empty({tokens, heads, d}, qkv.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, qkv.scalar_type(), "rope_write", [&] {
    rope_write_impl<scalar_t>(qkv.data_ptr<scalar_t>(), cos.data_ptr<scalar_t>(),
                              sin.data_ptr<scalar_t>(), kv.data_ptr<scalar_t>(),
                              slots.data_ptr<int64_t>(), q.data_ptr<scalar_t>(), tokens, heads,
                              kv_heads, d, num_slots);
  });
  return q;
}

// silu_and_mul(x [T, 2n]) -> silu(x[:, :n]) * x[:, n:]
torch::Tensor silu_and_mul(torch::Tensor x) {
  check_float(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "x must be [T, 2n]");
  const int64_t n = x.size(1) / 2;
  auto out = torch::empty({x.size(0), n}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "silu_and_mul", [&] {
    silu_and_mul_impl<scalar_t>(x.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), x.size(0), n);
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rope_write", &rope_write, "RoPE on q and k, k and v written into the paged cache");
  m.def("silu_and_mul", &silu_and_mul, "SwiGLU's activation: silu(gate) * up");
  m.def("rms_norm", &rms_norm, "RMSNorm, optionally after a fused residual add");
  m.def("decode_attention", &decode_attention, "one query per request over the paged cache");
}

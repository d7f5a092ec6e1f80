// The row-wise ops of a layer: RMSNorm (with the residual add fused in), RoPE fused with the
// KV-cache write (bfloat16 or float32 caches, and int8 ones quantized as they are written),
// SwiGLU's activation, and a vector argmax over logits rows.
// Layout: rows contiguous, [T, hidden] activations; the cache as kv_cache.h states.
// Float32 and bfloat16 (double too, through the scalar loops); math in float32.
// Reference: F.rms_norm, ember/models/layers.py apply_rope + ember/models/attention.py
// PagedKV.write, F.silu(gate) * up, and x.argmax(-1) (tests/reference/test_cpu_kernels.py).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "common.h"
#include "kv_cache.h"
#include "vec.h"

namespace ember {
namespace {

#ifdef EMBER_BF16_DOT
// One bfloat16 row of rms_norm_rows on 16 lanes (n % 16 == 0), the same arithmetic: the
// residual sum rounded to bfloat16 first, (x * inv) * weight rounded once.
void rms_norm_row16(const c10::BFloat16* x, c10::BFloat16* residual,
                    const c10::BFloat16* weight, c10::BFloat16* out, int64_t n, float eps) {
  using simd::load16;
  using simd::store16;
  const c10::BFloat16* src = x;
  if (residual != nullptr) {
    for (int64_t i = 0; i < n; i += 16) {
      store16(residual + i, _mm512_add_ps(load16(x + i), load16(residual + i)));
    }
    src = residual;
  }
  __m512 ss = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 v = load16(src + i);
    ss = _mm512_fmadd_ps(v, v, ss);
  }
  const float inv = 1.f / std::sqrt(_mm512_reduce_add_ps(ss) / static_cast<float>(n) + eps);
  const __m512 inv16 = _mm512_set1_ps(inv);
  for (int64_t i = 0; i < n; i += 16) {
    store16(out + i, _mm512_mul_ps(_mm512_mul_ps(load16(src + i), inv16), load16(weight + i)));
  }
}
#endif  // EMBER_BF16_DOT

// The first index of row x[0, n)'s largest value, as torch's argmax takes it (a NaN counts as
// the largest: the first NaN's index). With AVX-512, 16 lanes each keep their largest value and
// its first index (strictly greater replaces), and the lanes holding the largest value give the
// smallest of their indices; NaNs, seen on the way, send the row to the scalar scan.
int64_t argmax_row(const float* x, int64_t n) {
  int64_t i = 0, best = 0;
  float top = x[0];
#ifdef __AVX512F__
  if (n >= 16) {
    __m512 vmax = _mm512_loadu_ps(x);
    __m512i vidx = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    __m512i cur = vidx;
    const __m512i step = _mm512_set1_epi32(16);
    __mmask16 nan = _mm512_cmp_ps_mask(vmax, vmax, _CMP_UNORD_Q);
    for (i = 16; i + 16 <= n; i += 16) {
      const __m512 v = _mm512_loadu_ps(x + i);
      cur = _mm512_add_epi32(cur, step);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      const __mmask16 gt = _mm512_cmp_ps_mask(v, vmax, _CMP_GT_OQ);
      vmax = _mm512_mask_mov_ps(vmax, gt, v);
      vidx = _mm512_mask_mov_epi32(vidx, gt, cur);
    }
    if (nan == 0) {
      top = _mm512_reduce_max_ps(vmax);
      const __mmask16 at = _mm512_cmp_ps_mask(vmax, _mm512_set1_ps(top), _CMP_EQ_OQ);
      best = _mm512_mask_reduce_min_epi32(at, vidx);
    } else {
      i = 0;  // a NaN: the scalar scan below finds the first one
    }
  }
#endif
  for (; i < n; ++i) {
    if (std::isnan(x[i])) return i;
    if (x[i] > top) top = x[i], best = i;
  }
  return best;
}

}  // namespace

template <typename T>
void rms_norm_rows(const T* x, T* residual, const T* weight, T* out, int64_t rows,
                   int64_t n, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * n;
      T* outr = out + r * n;
#ifdef EMBER_BF16_DOT
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        if (n % 16 == 0) {
          rms_norm_row16(xr, residual != nullptr ? residual + r * n : nullptr, weight, outr, n,
                         eps);
          continue;
        }
      }
#endif
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

template <typename T>
void rope_write_impl(const T* qkv, const T* cos, const T* sin, T* kv, const int64_t* slots,
                     T* q_out, int64_t tokens, int64_t heads, int64_t kv_heads, int64_t d,
                     int64_t num_slots) {
  const int64_t row = (heads + 2 * kv_heads) * d;
  at::parallel_for(0, tokens, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t h = 0; h < kv_heads; ++h) {
        rope_write_kv_head(qkv + t * row, cos + t * d, sin + t * d, kv, slots[t],
                           q_out + t * heads * d, h, heads, kv_heads, d, num_slots);
      }
    }
  });
}

#ifdef EMBER_BF16_DOT
// rope_write_impl into an int8 cache (rope_write_kv_head_i8 for each token and KV head).
// With k_out ([tokens, kv_heads, d]), the rotated k is kept there too, before its rounding.
void rope_write_i8(const c10::BFloat16* qkv, const c10::BFloat16* cos, const c10::BFloat16* sin,
                   int8_t* kv, at::Half* kv_scale, const int64_t* slots, c10::BFloat16* q_out,
                   int64_t tokens, int64_t heads, int64_t kv_heads, int64_t d,
                   int64_t num_slots, c10::BFloat16* k_out) {
  const int64_t row = (heads + 2 * kv_heads) * d;
  at::parallel_for(0, tokens, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t h = 0; h < kv_heads; ++h) {
        rope_write_kv_head_i8(qkv + t * row, cos + t * d, sin + t * d, kv, kv_scale, slots[t],
                              q_out + t * heads * d, h, heads, kv_heads, d, num_slots,
                              k_out != nullptr ? k_out + (t * kv_heads + h) * d : nullptr);
      }
    }
  });
}
#endif

template <typename T>
void silu_and_mul_impl(const T* x, T* out, int64_t rows, int64_t n) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = x + r * 2 * n;
      const T* up = gate + n;
      T* o = out + r * n;
      int64_t i0 = 0;
#ifdef EMBER_BF16_DOT  // 16 lanes at a time (the compiler leaves the loop below scalar)
      if constexpr (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>) {
        using simd::load16, simd::store16;
        for (; i0 + 16 <= n; i0 += 16) {
          store16(o + i0, _mm512_mul_ps(silu16(load16(gate + i0)), load16(up + i0)));
        }
      }
#endif
#pragma omp simd
      for (int64_t i = i0; i < n; ++i) {  // silu(g) = g * sigmoid(g), e = exp(-|g|) <= 1
        const float g = load(gate[i]);
        const float e = exp_nonpositive(-std::fabs(g));
        const float sigmoid = (g >= 0.f ? 1.f : e) / (1.f + e);
        o[i] = store<T>(g * sigmoid * load(up[i]));
      }
    }
  });
}

// rms_norm(x [rows, n], weight [n], eps) -> out; with `residual`, residual += x first (in
// place) and the sum is normalised.
at::Tensor rms_norm(at::Tensor x, c10::optional<at::Tensor> residual,
                    at::Tensor weight, double eps) {
  check_float(x, "x");
  check_float(weight, "weight");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "weight must have x's dtype");
  const int64_t n = x.size(-1);
  auto out = at::empty_like(x);
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

// rope_write(qkv [T, (heads + 2 kv_heads) * d], cos, sin [T, 1, d], kv [2, kv_heads, blocks,
// block_size, d], slots [T] int64, heads, kv_heads) -> q [T, heads, d]: rotates q and k, writes
// k and v into the cache at `slots`, returns the rotated q. With an int8 cache, k_out [T,
// kv_heads, d] bfloat16 receives the rotated k as well, before it is rounded to int8.
at::Tensor rope_write(at::Tensor qkv, at::Tensor cos, at::Tensor sin,
                      at::Tensor kv, at::Tensor slots, int64_t heads,
                      int64_t kv_heads, c10::optional<at::Tensor> kv_scale,
                      c10::optional<at::Tensor> k_out) {
  for (auto* t : {&qkv, &cos, &sin}) check_float(*t, "rope_write inputs");
  if (kv_scale.has_value()) {
    check_int8_cache(kv, *kv_scale);
    TORCH_CHECK(qkv.scalar_type() == at::kBFloat16, "with an int8 cache, qkv must be bfloat16");
  } else {
    check_float(kv, "kv");
    TORCH_CHECK(!k_out.has_value(), "k_out is for an int8 cache (a bfloat16 one holds k as is)");
  }
  const int64_t tokens = qkv.size(0), d = kv.size(4);
  if (k_out.has_value()) {
    TORCH_CHECK(k_out->scalar_type() == at::kBFloat16 && k_out->is_contiguous() &&
                    k_out->numel() == tokens * kv_heads * d,
                "k_out must be [T, kv_heads, head_dim] contiguous bfloat16");
  }
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (heads + 2 * kv_heads) * d && kv.dim() == 5 &&
                  kv.size(1) == kv_heads && d % 2 == 0,
              "qkv must be [T, (heads + 2 kv_heads) * head_dim] for this cache");
  TORCH_CHECK(cos.numel() == tokens * d && sin.numel() == tokens * d, "cos/sin: [T, 1, d]");
  TORCH_CHECK(cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type() &&
                  (kv_scale.has_value() || kv.scalar_type() == qkv.scalar_type()),
              "qkv, cos, sin and kv must share a dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() &&
                  slots.numel() == tokens,
              "slots must be [T] contiguous int64");
  const int64_t num_slots = kv.size(2) * kv.size(3);
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, "a slot is outside the cache");
  }
  auto q = at::empty({tokens, heads, d}, qkv.options());
#ifdef EMBER_BF16_DOT
  if (kv_scale.has_value()) {
    rope_write_i8(qkv.data_ptr<at::BFloat16>(), cos.data_ptr<at::BFloat16>(),
                  sin.data_ptr<at::BFloat16>(), kv.data_ptr<int8_t>(),
                  kv_scale->data_ptr<at::Half>(), slot, q.data_ptr<at::BFloat16>(), tokens,
                  heads, kv_heads, d, num_slots,
                  k_out.has_value() ? k_out->data_ptr<at::BFloat16>() : nullptr);
    return q;
  }
#endif
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, qkv.scalar_type(), "rope_write", [&] {
    rope_write_impl<scalar_t>(qkv.data_ptr<scalar_t>(), cos.data_ptr<scalar_t>(),
                              sin.data_ptr<scalar_t>(), kv.data_ptr<scalar_t>(),
                              slots.data_ptr<int64_t>(), q.data_ptr<scalar_t>(), tokens, heads,
                              kv_heads, d, num_slots);
  });
  return q;
}

// silu_and_mul(x [T, 2n]) -> silu(x[:, :n]) * x[:, n:]
at::Tensor silu_and_mul(at::Tensor x) {
  check_float(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "x must be [T, 2n]");
  const int64_t n = x.size(1) / 2;
  auto out = at::empty({x.size(0), n}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "silu_and_mul", [&] {
    silu_and_mul_impl<scalar_t>(x.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), x.size(0), n);
  });
  return out;
}

// argmax_rows(x [B, V] float32, rows contiguous) -> [B] int64: each row's argmax, as
// x.argmax(-1) gives it (torch's CPU argmax walks a long row in a scalar loop: 47-85 us for
// one row of 49152 here, this ~7)
at::Tensor argmax_rows(at::Tensor x) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 &&
                  x.size(1) >= 1 && x.stride(1) == 1,
              "x must be [B, V] float32 on the CPU with contiguous rows, V >= 1");
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  auto out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* base = x.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) o[r] = argmax_row(base + r * stride, n);
  });
  return out;
}

template void rms_norm_rows(const c10::BFloat16* x, c10::BFloat16* residual,
                            const c10::BFloat16* weight, c10::BFloat16* out, int64_t rows,
                            int64_t n, float eps);
template void rope_write_impl(const c10::BFloat16* qkv, const c10::BFloat16* cos,
                              const c10::BFloat16* sin, c10::BFloat16* kv,
                              const int64_t* slots, c10::BFloat16* q_out, int64_t tokens,
                              int64_t heads, int64_t kv_heads, int64_t d, int64_t num_slots);
template void silu_and_mul_impl(const c10::BFloat16* x, c10::BFloat16* out, int64_t rows,
                                int64_t n);

}  // namespace ember

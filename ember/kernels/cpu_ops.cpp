// CPU kernels for the parts of a step that eager PyTorch runs as many small ops or slowly:
// RMSNorm (with the residual add fused in), RoPE fused with the KV-cache write, SwiGLU's
// activation, attention of one new token per request over the paged KV cache, read in place
// through the block table (no gathered copy), and, with AVX-512 BF16, flash attention of a
// prompt chunk over its paged context and the int8 output projection (and its rows, for a
// tied embedding).
// Float32 and bfloat16; math in float32. The torch code in ember/models is the reference.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512VNNI__)  // every CPU with AVX-512 BF16 has VNNI (int8 decode attention)
#include <immintrin.h>
#define EMBER_BF16_DOT 1  // attention on bfloat16 dot products (vdpbf16ps), 16-lane loops
#endif

namespace {

// Calls f(std::integral_constant<int, R>{}) with R = min(n, N), n >= 1: a kernel's register
// tile is a template on its row count, and a runtime count (the rows left over) picks one.
template <int N, class F>
inline void with_rows(int64_t n, F&& f) {
  if constexpr (N > 1) {
    if (n < N) return with_rows<N - 1>(n, std::forward<F>(f));
  }
  f(std::integral_constant<int, N>{});
}

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

#ifdef EMBER_BF16_DOT
void rms_norm_row16(const c10::BFloat16* x, c10::BFloat16* residual,
                    const c10::BFloat16* weight, c10::BFloat16* out, int64_t n, float eps);
#endif

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

#ifdef EMBER_BF16_DOT
// AVX-512 helpers: 16 float32 lanes; bfloat16 pairs for the dot-product instruction.
namespace simd {

inline __m512bh as_bh(__m512i x) { return reinterpret_cast<__m512bh>(x); }
inline __m512bh pair_of(const uint16_t* p) {  // broadcast two bfloat16 values to all lanes
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return as_bh(_mm512_set1_epi32(v));
}

// exp_nonpositive on 16 lanes (same series; scalef builds 2^n)
inline __m512 exp_nonpositive16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  for (float c : {1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) {
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  }
  return _mm512_scalef_ps(p, n);
}

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline void store16(float* p, __m512 x) { _mm512_storeu_ps(p, x); }
inline void store16(c10::BFloat16* p, __m512 x) {  // round to nearest even, as c10 does
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x)));
}

}  // namespace simd

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

namespace simd {

// Lane i of the result is the sum of v[i]'s 16 lanes.
inline __m512 sum16(__m512 v[16]) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i) {
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {
    b[i] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  for (int i = 0; i < 2; ++i) {
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  }
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88),
                       _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}

// The first n of 16 lanes.
inline __mmask16 first_lanes(int64_t n) {
  return n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
}

// Ask for the cache lines of p[0, bytes) ahead of their use (into L1, or where Hint says).
template <int Hint = _MM_HINT_T0>
inline void prefetch_bytes(const void* p, int64_t bytes) {
  for (int64_t i = 0; i < bytes; i += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(p) + i, static_cast<_mm_hint>(Hint));
  }
}

// A request's cache slot for its j-th token, through its block table: by shift and mask
// where the block size is a power of two (the default 16), as a 64-bit division costs more
// than the rest of a key's work; by division otherwise.
struct Slots {
  const int64_t* table;
  int64_t block_size;
  int shift;  // log2(block_size), or -1
  Slots(const int64_t* t, int64_t bs)
      : table(t), block_size(bs),
        shift((bs & (bs - 1)) == 0 ? __builtin_ctzll(static_cast<uint64_t>(bs)) : -1) {}
  int64_t operator()(int64_t j) const {
    if (shift >= 0) return (table[j >> shift] << shift) | (j & (block_size - 1));
    return table[j / block_size] * block_size + j % block_size;
  }
};

// Pointers to a request's cached rows (K or V of one head), in order, walking its blocks.
struct RowWalk {
  const uint16_t* base;
  Slots slot;
  int64_t d;
  RowWalk(const uint16_t* b, const int64_t* table, int64_t block_size, int64_t dim)
      : base(b), slot(table, block_size), d(dim) {}
  const uint16_t* row(int64_t j) const { return base + slot(j) * d; }
  const uint16_t* bf16_row(int64_t j, uint16_t*) const { return row(j); }
};

// The same over an int8 cache (ember/models/attention.py PagedKV): row j's int8 values and
// its float16 scale, x = value * scale.
struct ScaledWalk {
  const int8_t* base;
  const at::Half* scale;
  Slots slot;
  int64_t d;
  ScaledWalk(const int8_t* b, const at::Half* s, const int64_t* table, int64_t block_size,
             int64_t dim)
      : base(b), scale(s), slot(table, block_size), d(dim) {}
  const int8_t* row(int64_t j) const { return base + slot(j) * d; }
  float scale_of(int64_t j) const { return static_cast<float>(scale[slot(j)]); }
  // whether rows j0 .. j0 + 15 (j0 % 16 == 0) always lie in one block, one after another
  bool runs16() const { return slot.block_size % 16 == 0; }
  // the scales of rows j0 .. j0 + 15 (j0 % 16 == 0, j0 < len) in float32, 0 past len
  __m512 scales16(int64_t j0, int64_t len) const {
    if (runs16()) {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(scale + slot(j0)));
      return _mm512_maskz_mov_ps(first_lanes(len - j0), _mm512_cvtph_ps(h));
    }
    alignas(64) float s[16];
    for (int jj = 0; jj < 16; ++jj) s[jj] = j0 + jj < len ? scale_of(j0 + jj) : 0.f;
    return _mm512_load_ps(s);
  }
  // row j in bfloat16 (value * scale, rounded once), written to buf [d] (d % 16 == 0)
  const uint16_t* bf16_row(int64_t j, uint16_t* buf) const {
    const int8_t* v = row(j);
    const __m512 s = _mm512_set1_ps(scale_of(j));
    for (int64_t i = 0; i < d; i += 16) {
      const __m512i wide = _mm512_cvtepi8_epi32(_mm_loadu_si128(
          reinterpret_cast<const __m128i*>(v + i)));
      store16(reinterpret_cast<c10::BFloat16*>(buf + i),
              _mm512_mul_ps(_mm512_cvtepi32_ps(wide), s));
    }
    return buf;
  }
};

}  // namespace simd

// Prefill attention: the new tokens of one request (a prompt chunk) attend causally over its
// context in the paged cache, flash-attention style: for a tile of query rows, key blocks of
// 64 are scored, soft-maxed online (running max and sum in float32) and applied to V, so no
// score matrix is ever stored. The two products run on AVX-512 BF16 dot products, each
// instruction summing pairs of bfloat16 products into 16 float32 lanes; for that the context's
// K and V are first copied out of their blocks into pair-interleaved ("VNNI") layouts:
//   K: per 16 keys, per pair of dims t: [key 0 dims 2t, 2t+1 | key 1 ... | key 15 ...]
//   V: per pair of keys u: [dim 0 of keys 2u, 2u+1 | dim 1 ... | dim D-1 ...]
// The query heads that share a KV head are the rows of one tile (row = token * G + member),
// so each packed K and V block serves G heads at once.
namespace prefill {

using namespace simd;

constexpr int64_t kKeyBlock = 64;  // keys scored per step: 4 vectors of 16 lanes

// Copy one KV head's first `len` keys (K or V, as `rows` walks) out of their blocks,
// zero-padded to `len_pad` (a multiple of kKeyBlock), into the layouts above.
// (An int8 cache's rows are made bfloat16 on the way: `Walk` is RowWalk or ScaledWalk.)
template <class Walk>
void pack_keys(Walk rows, int64_t len, int64_t len_pad, uint16_t* dst) {
  const int64_t d = rows.d, pairs = d / 2;
  alignas(64) uint16_t buf[kMaxHeadDim];
  for (int64_t j = 0; j < len_pad; ++j) {
    uint32_t* col = reinterpret_cast<uint32_t*>(dst + (j / 16) * d * 16) + j % 16;
    if (j < len) {
      const uint16_t* k = rows.bf16_row(j, buf);
      for (int64_t t = 0; t < pairs; ++t) std::memcpy(col + t * 16, k + 2 * t, 4);
    } else {
      for (int64_t t = 0; t < pairs; ++t) col[t * 16] = 0;
    }
  }
}

template <class Walk>
void pack_values(Walk rows, int64_t len, int64_t len_pad, uint16_t* dst) {
  const int64_t d = rows.d;
  alignas(64) uint16_t buf[kMaxHeadDim];
  for (int64_t j = 0; j < len_pad; ++j) {
    uint16_t* out = dst + (j / 2) * 2 * d + j % 2;
    if (j < len) {
      const uint16_t* v = rows.bf16_row(j, buf);
      for (int64_t i = 0; i < d; ++i) out[2 * i] = v[i];
    } else {
      for (int64_t i = 0; i < d; ++i) out[2 * i] = 0;
    }
  }
}

// s[r][c] = q_r . key (16 c + lane) for 64 packed keys. Its own function, with the sums in
// locals: GCC otherwise keeps the caller's array in memory and stores it on every pass.
template <int R, int D>
__attribute__((always_inline)) inline void score_block(const uint16_t* q, const uint16_t* kb,
                                                       __m512 (&s)[R][4]) {
  __m512 a[R][4];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) a[r][c] = _mm512_setzero_ps();
  for (int t = 0; t < D / 2; ++t) {
    __m512bh k[4];
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) k[c] = as_bh(_mm512_loadu_si512(kb + c * D * 16 + t * 32));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512bh qr = pair_of(q + r * D + 2 * t);
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) a[r][c] = _mm512_dpbf16_ps(a[r][c], qr, k[c]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) s[r][c] = a[r][c];
}

// R query rows (q: [R][D] bfloat16) over packed K/V; row r sees keys [0, visible[r]).
// Writes the normalised outputs, float32, to o [R][D].
template <int R, int D>
void attend_rows(const uint16_t* q, const int64_t* visible, const uint16_t* kp,
                 const uint16_t* vp, float scale, float* o) {
  constexpr int DV = D / 16;
  float m[R], l[R], corr[R];
  alignas(64) uint16_t probs[R][kKeyBlock];
  int64_t kmax = 0, kmin = visible[0];
  for (int r = 0; r < R; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.f;
    kmax = std::max(kmax, visible[r]);
    kmin = std::min(kmin, visible[r]);
  }
  std::fill(o, o + R * D, 0.f);
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  for (int64_t k0 = 0; k0 < kmax; k0 += kKeyBlock) {
    __m512 s[R][4];
    score_block<R, D>(q, kp + (k0 / 16) * D * 16, s);
    const bool masked = k0 + kKeyBlock > kmin;
    for (int r = 0; r < R; ++r) {
      __m512 mx = _mm512_set1_ps(-INFINITY);
      for (int c = 0; c < 4; ++c) {
        s[r][c] = _mm512_mul_ps(s[r][c], _mm512_set1_ps(scale));
        if (masked) {  // keys at or past visible[r] are hidden
          const __m512i key = _mm512_add_epi32(lane, _mm512_set1_epi32(k0 + 16 * c));
          const __mmask16 hide =
              _mm512_cmpge_epi32_mask(key, _mm512_set1_epi32(static_cast<int>(visible[r])));
          s[r][c] = _mm512_mask_mov_ps(s[r][c], hide, _mm512_set1_ps(-INFINITY));
        }
        mx = _mm512_max_ps(mx, s[r][c]);
      }
      const float m_new = std::max(m[r], _mm512_reduce_max_ps(mx));
      corr[r] = std::exp(m[r] - m_new);
      m[r] = m_new;
      __m512 sum = _mm512_setzero_ps();
      for (int c = 0; c < 4; ++c) {
        s[r][c] = exp_nonpositive16(_mm512_sub_ps(s[r][c], _mm512_set1_ps(m_new)));
        sum = _mm512_add_ps(sum, s[r][c]);
      }
      l[r] = l[r] * corr[r] + _mm512_reduce_add_ps(sum);
      _mm512_store_si512(probs[r],
                         reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(s[r][1], s[r][0])));
      _mm512_store_si512(probs[r] + 32,
                         reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(s[r][3], s[r][2])));
    }
    __m512 acc[R][DV];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < DV; ++i)
        acc[r][i] = _mm512_mul_ps(_mm512_loadu_ps(o + r * D + 16 * i), _mm512_set1_ps(corr[r]));
    const uint16_t* vb = vp + k0 * D;  // k0 / 2 pairs of 2 * D values
    const int pairs = static_cast<int>(std::min<int64_t>(kKeyBlock, kmax - k0) + 1) / 2;
    for (int u = 0; u < pairs; ++u) {
      __m512bh v[DV];
      for (int i = 0; i < DV; ++i) v[i] = as_bh(_mm512_loadu_si512(vb + u * 2 * D + 32 * i));
      for (int r = 0; r < R; ++r) {
        const __m512bh p = pair_of(probs[r] + 2 * u);
        for (int i = 0; i < DV; ++i) acc[r][i] = _mm512_dpbf16_ps(acc[r][i], p, v[i]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < DV; ++i) _mm512_storeu_ps(o + r * D + 16 * i, acc[r][i]);
  }
  for (int r = 0; r < R; ++r) {
    const float inv = 1.f / l[r];
    for (int i = 0; i < D; ++i) o[r * D + i] *= inv;
  }
}

template <int D>
constexpr int kTileRows = D == 64 ? 6 : 3;  // S and O accumulators: 24 of the 32 registers

// q [n, heads, D] (row stride q_stride), kv [2, kv_heads, blocks, block_size, D] bfloat16, or
// int8 with kv_scale [2, kv_heads, blocks, block_size] float16; the n new tokens are the last
// n of the request's seq_len.
template <int D>
void prefill_attention_impl(const uint16_t* q, int64_t q_stride, const void* kv,
                            const at::Half* kv_scale, const int64_t* table, int64_t seq_len,
                            uint16_t* out, int64_t n, int64_t heads, int64_t kv_heads,
                            int64_t num_blocks, int64_t block_size, float scale) {
  constexpr int R = kTileRows<D>;
  const int64_t per_kv = heads / kv_heads;
  const int64_t len_pad = (seq_len + kKeyBlock - 1) / kKeyBlock * kKeyBlock;
  const int64_t head_stride = num_blocks * block_size * D;
  std::vector<uint16_t> kp(kv_heads * len_pad * D), vp(kv_heads * len_pad * D);
  at::parallel_for(0, 2 * kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / 2, offset = (task % 2) * kv_heads * head_stride + h * head_stride;
      auto pack = [&](auto rows) {
        if (task % 2 == 0) {
          pack_keys(rows, seq_len, len_pad, kp.data() + h * len_pad * D);
        } else {
          pack_values(rows, seq_len, len_pad, vp.data() + h * len_pad * D);
        }
      };
      if (kv_scale) {
        pack(ScaledWalk{static_cast<const int8_t*>(kv) + offset,
                        kv_scale + ((task % 2) * kv_heads + h) * num_blocks * block_size, table,
                        block_size, D});
      } else {
        pack(RowWalk{static_cast<const uint16_t*>(kv) + offset, table, block_size, D});
      }
    }
  });
  const int64_t rows = n * per_kv;  // per KV head: row = token * per_kv + member
  constexpr int64_t kTilesPerTask = 4;
  const int64_t tiles = (rows + R - 1) / R;
  const int64_t tasks_per_head = (tiles + kTilesPerTask - 1) / kTilesPerTask;
  const int64_t tasks = kv_heads * tasks_per_head;
  // the last tiles see the most keys: hand tasks out from the end, as threads come free
#pragma omp parallel for schedule(dynamic, 1) num_threads(at::get_num_threads())
  for (int64_t task = tasks - 1; task >= 0; --task) {
    const int64_t h = task % kv_heads, first = (task / kv_heads) * kTilesPerTask;
    alignas(64) uint16_t qt[R * D];
    alignas(64) float ot[R * D];
    int64_t visible[R];
    for (int64_t tile = first; tile < std::min(tiles, first + kTilesPerTask); ++tile) {
      const int64_t r0 = tile * R;
      const int count = static_cast<int>(std::min<int64_t>(R, rows - r0));
      for (int r = 0; r < count; ++r) {
        const int64_t token = (r0 + r) / per_kv, head = h * per_kv + (r0 + r) % per_kv;
        std::memcpy(qt + r * D, q + token * q_stride + head * D, D * sizeof(uint16_t));
        visible[r] = seq_len - n + token + 1;
      }
      with_rows<R>(count, [&](auto rows) {
        attend_rows<decltype(rows)::value, D>(qt, visible, kp.data() + h * len_pad * D,
                                              vp.data() + h * len_pad * D, scale, ot);
      });
      for (int r = 0; r < count; ++r) {
        const int64_t token = (r0 + r) / per_kv, head = h * per_kv + (r0 + r) % per_kv;
        auto* dst = reinterpret_cast<c10::BFloat16*>(out + (token * heads + head) * D);
        for (int i = 0; i < D; i += 16) store16(dst + i, _mm512_loadu_ps(ot + r * D + i));
      }
    }
  }
}

}  // namespace prefill

// Decode attention on bfloat16 dot products: one new token per request, its G query heads per
// KV head over the request's cached keys, read in place from their blocks. Each score is two
// (D = 64) dot-product instructions on a key row as stored, whose 16 partial sums per key are
// then folded, 16 keys at once, into one vector of 16 scores (sum16). Softmax in float32; the
// weighted sum of V rows in float32 FMAs.
namespace decode {

using namespace simd;

// keys prefetched ahead of the 16 being scored (16-96 measured alike)
constexpr int64_t kKeysAhead = 16;
// int8 rows (one cache line each at D = 64) asked for into L2 this far ahead as well: over
// scattered blocks 12.5-15.3 -> 11.1-11.5 ms for 30 layers of 32 x ~300 (32 and 64 alike)
constexpr int64_t kFarAhead = 32;

template <int D, class Walk>
void softmax_and_values(int G, Walk values, int64_t len, float* scores, float* out);

// out[r] (float32, [G][D]) = softmax(scale * q_r . K) V over the first len cached tokens.
template <int D>
void decode_head(const uint16_t* const* q, int G, RowWalk keys, RowWalk values, int64_t len,
                 float scale, float* scores, float* out) {
  constexpr int P = D / 32;  // 32 bfloat16 (16 pairs) per instruction
  const int64_t len16 = (len + 15) / 16 * 16;
  // the cache is cold in a step (the weights streamed through since this layer last ran):
  // while 16 keys are scored, the next 16 keys and these 16 values are prefetched
  auto prefetch_row = [](const uint16_t* row) { prefetch_bytes(row, D * 2); };
  for (int64_t j = 0; j < std::min<int64_t>(kKeysAhead, len); ++j) prefetch_row(keys.row(j));
  for (int64_t j0 = 0; j0 < len16; j0 += 16) {
    for (int64_t j = j0 + kKeysAhead; j < std::min(j0 + kKeysAhead + 16, len); ++j) {
      prefetch_row(keys.row(j));
    }
    for (int64_t j = j0; j < std::min(j0 + 16, len); ++j) prefetch_row(values.row(j));
    const uint16_t* rows[16];
    for (int jj = 0; jj < 16; ++jj) rows[jj] = keys.row(std::min(j0 + jj, len - 1));
    for (int r = 0; r < G; ++r) {
      __m512bh qv[P];
      for (int i = 0; i < P; ++i) qv[i] = as_bh(_mm512_loadu_si512(q[r] + 32 * i));
      __m512 dots[16];
#pragma GCC unroll 16
      for (int jj = 0; jj < 16; ++jj) {
        __m512 acc = _mm512_setzero_ps();
#pragma GCC unroll 4
        for (int i = 0; i < P; ++i) {
          acc = _mm512_dpbf16_ps(acc, qv[i], as_bh(_mm512_loadu_si512(rows[jj] + 32 * i)));
        }
        dots[jj] = acc;
      }
      _mm512_storeu_ps(scores + r * len16 + j0,
                       _mm512_mul_ps(sum16(dots), _mm512_set1_ps(scale)));
    }
  }
  softmax_and_values<D>(G, values, len, scores, out);
}

// 32 dims summed on products of two rows interleaved 16 bits at a time (unpacklo / unpackhi
// work within 128-bit lanes: lane l of `lo` holds dim 8 (l / 4) + l % 4 of the 32, `hi` the
// same + 4), put back in order and times s into o[0, 32).
inline void store_pairs_in_order(float* o, __m512 lo, __m512 hi, __m512 s) {
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22,
                                          23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28,
                                           29, 30, 31);
  _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_permutex2var_ps(lo, first, hi), s));
  _mm512_storeu_ps(o + 16, _mm512_mul_ps(_mm512_permutex2var_ps(lo, second, hi), s));
}

// out[r] (float32, [G][D]) = sum_j p[r][j] V_j for bfloat16 V rows on bfloat16 dot products,
// two keys per instruction: p (scores [G][len16], float32, normalised, zero past len) rounded
// to bfloat16 in place, the rows of keys j and j + 1 interleaved 16 bits at a time (unpacklo /
// unpackhi work within 128-bit lanes, so lane l of a product holds dim 8 (l / 4) + l % 4 of
// its 32, + 4 for unpackhi), put back in order once at the end. 23 instructions per two keys
// of three heads at D = 64, where float32 FMAs on widened rows took ~56.
template <int D>
void values_in_pairs(int G, const RowWalk& values, int64_t len, float* scores, float* out) {
  const int64_t len16 = (len + 15) / 16 * 16;
  for (int r = 0; r < G; ++r) {  // row r's bfloat16 p over the first half of its floats
    float* sr = scores + r * len16;
    for (int64_t j = 0; j < len16; j += 16) {
      const __m256bh b = _mm512_cvtneps_pbh(_mm512_loadu_ps(sr + j));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(reinterpret_cast<uint16_t*>(sr) + j),
                          reinterpret_cast<__m256i>(b));
    }
  }
  alignas(64) static const uint16_t kZeroRow[kMaxHeadDim] = {};  // an odd last key's partner
  constexpr int DV = D / 16, R = D == 64 ? 4 : 2;  // R x DV accumulators: 16
  for (int r0 = 0; r0 < G; r0 += R) {
    const int rows = std::min(R, G - r0);
    __m512 acc[R][DV];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < DV; ++i) acc[r][i] = _mm512_setzero_ps();
    for (int64_t j = 0; j < len; j += 2) {
      const uint16_t* a = values.row(j);
      const uint16_t* b = j + 1 < len ? values.row(j + 1) : kZeroRow;
      __m512bh lo[DV / 2], hi[DV / 2];
      for (int i = 0; i < DV / 2; ++i) {
        const __m512i va = _mm512_loadu_si512(a + 32 * i), vb = _mm512_loadu_si512(b + 32 * i);
        lo[i] = as_bh(_mm512_unpacklo_epi16(va, vb));
        hi[i] = as_bh(_mm512_unpackhi_epi16(va, vb));
      }
      for (int r = 0; r < R; ++r) {
        if (r < rows) {
          const uint16_t* pr = reinterpret_cast<const uint16_t*>(scores + (r0 + r) * len16);
          const __m512bh p = pair_of(pr + j);
          for (int i = 0; i < DV / 2; ++i) {
            acc[r][2 * i] = _mm512_dpbf16_ps(acc[r][2 * i], p, lo[i]);
            acc[r][2 * i + 1] = _mm512_dpbf16_ps(acc[r][2 * i + 1], p, hi[i]);
          }
        }
      }
    }
    for (int r = 0; r < rows; ++r) {
      for (int i = 0; i < DV / 2; ++i) {
        store_pairs_in_order(out + (r0 + r) * D + 32 * i, acc[r][2 * i], acc[r][2 * i + 1],
                             _mm512_set1_ps(1.f));
      }
    }
  }
}

// out[r] (float32, [G][D]) = sum_j p[r][j] V_j for int8 V rows on int16 dot products, two
// keys per instruction (vpdpwssd), as values_in_pairs does in bfloat16: each row r's weights
// (already times the value scales) rounded to int16 against their largest (pq, in place over
// the floats), the rows widened to int16 and interleaved 16 bits at a time. A lane's int32 sum
// grows by at most 2 * 32767 * 128 a pair, so every 128 pairs it is added to `out` in float32
// and restarted; pscale[r] turns the sums back into weights.
template <int D>
void values_in_int16_pairs(int G, const ScaledWalk& values, int64_t len, float* scores,
                           float* out) {
  const int64_t len16 = (len + 15) / 16 * 16;
  alignas(64) static const int8_t kZeroRow[kMaxHeadDim] = {};  // an odd last key's partner
  constexpr int DV = D / 16, R = D == 64 ? 4 : 2;  // R x DV int32 accumulators: 16
  constexpr int64_t kFlushPairs = 128;
  for (int r0 = 0; r0 < G; r0 += R) {
    const int rows = std::min(R, G - r0);
    float pscale[R];
    for (int r = 0; r < rows; ++r) {  // row r's weights to int16 over the first half of it
      float* sr = scores + (r0 + r) * len16;
      __m512 mx = _mm512_setzero_ps();
      for (int64_t j = 0; j < len16; j += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sr + j));
      const float top = _mm512_reduce_max_ps(mx);
      pscale[r] = top / 32767.f;
      const __m512 inv = _mm512_set1_ps(top > 0.f ? 32767.f / top : 0.f);
      int16_t* pq = reinterpret_cast<int16_t*>(sr);
      for (int64_t j = 0; j < len16; j += 16) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pq + j),
                            _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(
                                _mm512_mul_ps(_mm512_loadu_ps(sr + j), inv))));
      }
      for (int i = 0; i < D; ++i) out[(r0 + r) * D + i] = 0.f;
    }
    __m512i acc[R][DV];
    auto flush = [&] {  // the int32 sums into out (float32), restarted
      for (int r = 0; r < rows; ++r) {
        for (int i = 0; i < DV; ++i) {
          float* o = out + (r0 + r) * D + 16 * i;
          _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), _mm512_cvtepi32_ps(acc[r][i])));
        }
      }
      for (int r = 0; r < R; ++r)
        for (int i = 0; i < DV; ++i) acc[r][i] = _mm512_setzero_si512();
    };
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < DV; ++i) acc[r][i] = _mm512_setzero_si512();
    // Where each 16 rows from a multiple of 16 lie one after another in a block (runs16), a
    // block table lookup per 16 rows instead of one per row (cold 3%, hot ~10% of the call)
    const bool runs = values.runs16();
    const int8_t* run = nullptr;
    for (int64_t j = 0; j < len; j += 2) {
      if (j > 0 && j % (2 * kFlushPairs) == 0) flush();
      if (runs && j % 16 == 0) run = values.row(j);
      const int8_t* a = runs ? run + (j % 16) * D : values.row(j);
      const int8_t* b = j + 1 >= len ? kZeroRow : runs ? a + D : values.row(j + 1);
      __m512i lo[DV / 2], hi[DV / 2];
      for (int i = 0; i < DV / 2; ++i) {
        const __m512i va = _mm512_cvtepi8_epi16(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 32 * i)));
        const __m512i vb = _mm512_cvtepi8_epi16(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32 * i)));
        lo[i] = _mm512_unpacklo_epi16(va, vb);
        hi[i] = _mm512_unpackhi_epi16(va, vb);
      }
      for (int r = 0; r < R; ++r) {
        if (r < rows) {
          int32_t pair;  // weights j and j + 1 (the pad past len is 0)
          std::memcpy(&pair, reinterpret_cast<const int16_t*>(scores + (r0 + r) * len16) + j,
                      sizeof(pair));
          const __m512i p = _mm512_set1_epi32(pair);
          for (int i = 0; i < DV / 2; ++i) {
            acc[r][2 * i] = _mm512_dpwssd_epi32(acc[r][2 * i], p, lo[i]);
            acc[r][2 * i + 1] = _mm512_dpwssd_epi32(acc[r][2 * i + 1], p, hi[i]);
          }
        }
      }
    }
    flush();
    for (int r = 0; r < rows; ++r) {  // lanes back in order, times the weights' scale
      for (int i = 0; i < DV / 2; ++i) {
        float* o = out + (r0 + r) * D + 32 * i;
        store_pairs_in_order(o, _mm512_loadu_ps(o), _mm512_loadu_ps(o + 16),
                             _mm512_set1_ps(pscale[r]));
      }
    }
  }
}

// Softmax of each of the G rows of scores [G][len16] (the padded tail, repeats of the last
// key, is zeroed), then out[r] = sum_j p[r][j] * V_j: bfloat16 V in values_in_pairs, int8 V
// in values_in_int16_pairs, its scale folded into the weight here.
template <int D, class Walk>
void softmax_and_values(int G, Walk values, int64_t len, float* scores, float* out) {
  constexpr bool kInt8 = std::is_same_v<Walk, ScaledWalk>;
  const int64_t len16 = (len + 15) / 16 * 16;
  for (int r = 0; r < G; ++r) {
    float* sr = scores + r * len16;
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < len16; j += 16) {
      mx = _mm512_mask_max_ps(mx, first_lanes(len - j), mx, _mm512_loadu_ps(sr + j));
    }
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < len16; j += 16) {
      const __m512 e = _mm512_maskz_mov_ps(
          first_lanes(len - j), exp_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(sr + j), m)));
      _mm512_storeu_ps(sr + j, e);
      sum = _mm512_add_ps(sum, e);
    }
    const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(sum));
    for (int64_t j = 0; j < len16; j += 16) {
      __m512 p = _mm512_mul_ps(_mm512_loadu_ps(sr + j), inv);
      if constexpr (kInt8) p = _mm512_mul_ps(p, values.scales16(j, len));
      _mm512_storeu_ps(sr + j, p);
    }
  }
  if constexpr (kInt8) {
    values_in_int16_pairs<D>(G, values, len, scores, out);
  } else {
    values_in_pairs<D>(G, values, len, scores, out);
  }
}

// Four keys' rows (D int8 each) as D / 16 registers: register c holds dims 16c .. 16c + 15
// of key b in its 128-bit lane b (a 4 x 4 transposition of 16-byte chunks per 64 bytes).
template <int D>
inline void quad_of_keys(const int8_t* const* rows, __m512i* t) {
  for (int h = 0; h < D / 64; ++h) {
    const __m512i r0 = _mm512_loadu_si512(rows[0] + 64 * h);
    const __m512i r1 = _mm512_loadu_si512(rows[1] + 64 * h);
    const __m512i r2 = _mm512_loadu_si512(rows[2] + 64 * h);
    const __m512i r3 = _mm512_loadu_si512(rows[3] + 64 * h);
    const __m512i a = _mm512_shuffle_i64x2(r0, r1, 0x44), b = _mm512_shuffle_i64x2(r0, r1, 0xEE);
    const __m512i c = _mm512_shuffle_i64x2(r2, r3, 0x44), d = _mm512_shuffle_i64x2(r2, r3, 0xEE);
    t[4 * h] = _mm512_shuffle_i64x2(a, c, 0x88);
    t[4 * h + 1] = _mm512_shuffle_i64x2(a, c, 0xDD);
    t[4 * h + 2] = _mm512_shuffle_i64x2(b, d, 0x88);
    t[4 * h + 3] = _mm512_shuffle_i64x2(b, d, 0xDD);
  }
}

// The same over an int8 cache, on int8 dot products (vpdpbusd: four unsigned x signed byte
// products summed per int32 lane). Each query head is rounded to int16 with its own scale (15
// bits, as before: the int8 keys are exact) and split into bytes, q = 256 hi + lo with hi
// signed and lo unsigned; a key's score is 256 (sum (k + 128) hi - 128 sum hi) + sum lo k,
// times the two scales: two instructions a key and head at D = 64, no widening. Four keys
// share a register, one per 128-bit lane (quad_of_keys), so their 16 partial sums fold in
// three adds where sum16 transposes sixteen registers. The values on int16 dot products
// (values_in_int16_pairs). Half the bytes of bfloat16 K and V read per step.
template <int D>
void decode_head_i8(const uint16_t* const* q, int G, ScaledWalk keys, ScaledWalk values,
                    int64_t len, float scale, float* scores, float* out, int8_t* qbytes,
                    float* qscale, int32_t* qbias) {
  constexpr int C = D / 16;  // 16-byte chunks of a row
  const int64_t len16 = (len + 15) / 16 * 16;
  for (int r = 0; r < G; ++r) {  // q_r ~ qscale[r] (256 hi + lo); qbytes [G][hi D, lo D]
    const c10::BFloat16* qr = reinterpret_cast<const c10::BFloat16*>(q[r]);
    __m512 amax = _mm512_setzero_ps();
    for (int i = 0; i < D; i += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(load16(qr + i)));
    const float a = _mm512_reduce_max_ps(amax);
    qscale[r] = a / 32767.f * scale;
    const __m512 inv = _mm512_set1_ps(a > 0.f ? 32767.f / a : 0.f);
    int8_t* hi = qbytes + r * 2 * D;
    __m512i hsum = _mm512_setzero_si512();
    for (int i = 0; i < D; i += 16) {
      const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(load16(qr + i), inv));
      const __m512i h = _mm512_srai_epi32(v, 8);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(hi + i), _mm512_cvtepi32_epi8(h));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(hi + D + i),
                       _mm512_cvtepi32_epi8(_mm512_and_si512(v, _mm512_set1_epi32(255))));
      hsum = _mm512_add_epi32(hsum, h);
    }
    qbias[r] = 32768 * _mm512_reduce_add_epi32(hsum);
  }
  // lane 4b + a of a folded sum is key 4a + b: back in order
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
  auto prefetch_row = [](const int8_t* row) { prefetch_bytes(row, D); };
  for (int64_t j = 0; j < std::min<int64_t>(kKeysAhead, len); ++j) prefetch_row(keys.row(j));
  __m512i kt[4][C], ku[4][C];  // 16 keys by quads; ku = kt + 128 (unsigned)
  for (int64_t j0 = 0; j0 < len16; j0 += 16) {
    for (int64_t j = j0 + kKeysAhead; j < std::min(j0 + kKeysAhead + 16, len); ++j) {
      prefetch_row(keys.row(j));
    }
    for (int64_t j = j0; j < std::min(j0 + 16, len); ++j) prefetch_row(values.row(j));
    for (int64_t j = j0 + kFarAhead; j < std::min(j0 + kFarAhead + 16, len); ++j) {
      _mm_prefetch(reinterpret_cast<const char*>(keys.row(j)), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(values.row(j)), _MM_HINT_T1);
    }
    const int8_t* rows[16];
    if (keys.runs16()) {  // one block: rows past len are in it (their scores are zeroed)
      const int8_t* first = keys.row(j0);
      for (int jj = 0; jj < 16; ++jj) rows[jj] = first + jj * D;
    } else {
      for (int jj = 0; jj < 16; ++jj) rows[jj] = keys.row(std::min(j0 + jj, len - 1));
    }
    for (int a = 0; a < 4; ++a) {
      quad_of_keys<D>(rows + 4 * a, kt[a]);
      for (int c = 0; c < C; ++c) ku[a][c] = _mm512_xor_si512(kt[a][c], bias);
    }
    const __m512 ks = keys.scales16(j0, len);  // 0 past len
    for (int r = 0; r < G; ++r) {
      const int8_t* hi = qbytes + r * 2 * D;
      __m512i qh[C], ql[C];
      for (int c = 0; c < C; ++c) {
        qh[c] = _mm512_broadcast_i32x4(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(hi + 16 * c)));
        ql[c] = _mm512_broadcast_i32x4(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(hi + D + 16 * c)));
      }
      __m512i part[4];
      for (int a = 0; a < 4; ++a) {
        __m512i sh = _mm512_setzero_si512(), sl = _mm512_setzero_si512();
        for (int c = 0; c < C; ++c) {
          sh = _mm512_dpbusd_epi32(sh, ku[a][c], qh[c]);
          sl = _mm512_dpbusd_epi32(sl, ql[c], kt[a][c]);
        }
        part[a] = _mm512_add_epi32(_mm512_slli_epi32(sh, 8), sl);
      }
      const __m512i x = _mm512_add_epi32(_mm512_unpacklo_epi32(part[0], part[1]),
                                         _mm512_unpackhi_epi32(part[0], part[1]));
      const __m512i y = _mm512_add_epi32(_mm512_unpacklo_epi32(part[2], part[3]),
                                         _mm512_unpackhi_epi32(part[2], part[3]));
      const __m512i z = _mm512_sub_epi32(_mm512_add_epi32(_mm512_unpacklo_epi64(x, y),
                                                          _mm512_unpackhi_epi64(x, y)),
                                         _mm512_set1_epi32(qbias[r]));
      const __m512 dots = _mm512_permutexvar_ps(order, _mm512_cvtepi32_ps(z));
      _mm512_storeu_ps(scores + r * len16 + j0,
                       _mm512_mul_ps(dots, _mm512_mul_ps(ks, _mm512_set1_ps(qscale[r]))));
    }
  }
  softmax_and_values<D>(G, values, len, scores, out);
}

// q [members, heads, D] (strided), kv [2, kv_heads, blocks, block_size, D]: bfloat16, or int8
// with kv_scale [2, kv_heads, blocks, block_size] float16 -> out [members, heads, D], by the
// threads of the enclosing parallel region, each calling `after`, if given, once out of
// tasks. A task is member m's KV head h (its query heads), and `before`, if given, is called
// with m and h first (DecodeStack: that head's RoPE and cache write). No barrier at the end:
// the caller's.
template <int D>
void decode_attention_team(const uint16_t* q, int64_t q_stride_m, int64_t q_stride_h,
                           const void* kv, const at::Half* kv_scale,
                           const int64_t* block_tables, const int64_t* seq_lens, uint16_t* out,
                           int64_t members, int64_t heads, int64_t kv_heads,
                           int64_t num_blocks, int64_t block_size, int64_t max_blocks,
                           float scale, const std::function<void()>* after = nullptr,
                           const std::function<void(int64_t, int64_t)>* before = nullptr) {
  const int64_t per_kv = heads / kv_heads;
  const int64_t num_slots = num_blocks * block_size, head_stride = num_slots * D;
  const int64_t v_offset = kv_heads * head_stride;  // K then V
  // requests' contexts differ in length: tasks are handed out as threads come free
  // (a static split into equal counts left one thread waiting at the end)
  {
    std::vector<float> scores, acc(per_kv * D);
    std::vector<const uint16_t*> qrows(per_kv);
    std::vector<int8_t> qbytes(kv_scale ? per_kv * 2 * D : 0);
    std::vector<float> qscale(kv_scale ? per_kv : 0);
    std::vector<int32_t> qbias(kv_scale ? per_kv : 0);
#pragma omp for schedule(dynamic, 1) nowait
    for (int64_t task = 0; task < members * kv_heads; ++task) {
      const int64_t m = task / kv_heads, h = task % kv_heads;
      if (before != nullptr) (*before)(m, h);
      const int64_t len = seq_lens[m];
      const int64_t* table = block_tables + m * max_blocks;
      for (int64_t p = 0; p < per_kv; ++p) {
        qrows[p] = q + m * q_stride_m + (h * per_kv + p) * q_stride_h;
      }
      scores.resize(per_kv * ((len + 15) / 16 * 16));
      if (kv_scale) {
        const int8_t* kbase = static_cast<const int8_t*>(kv) + h * head_stride;
        const at::Half* sbase = kv_scale + h * num_slots;
        decode_head_i8<D>(qrows.data(), static_cast<int>(per_kv),
                          ScaledWalk{kbase, sbase, table, block_size, D},
                          ScaledWalk{kbase + v_offset, sbase + kv_heads * num_slots, table,
                                     block_size, D},
                          len, scale, scores.data(), acc.data(), qbytes.data(), qscale.data(),
                          qbias.data());
      } else {
        const uint16_t* kbase = static_cast<const uint16_t*>(kv) + h * head_stride;
        decode_head<D>(qrows.data(), static_cast<int>(per_kv),
                       RowWalk{kbase, table, block_size, D},
                       RowWalk{kbase + v_offset, table, block_size, D}, len, scale,
                       scores.data(), acc.data());
      }
      for (int64_t p = 0; p < per_kv; ++p) {
        uint16_t* o = out + (m * heads + h * per_kv + p) * D;
        for (int i = 0; i < D; i += 16) {
          store16(reinterpret_cast<c10::BFloat16*>(o + i),
                  _mm512_loadu_ps(acc.data() + p * D + i));
        }
      }
    }
    // a thread out of tasks (3 KV heads on 2 threads leave one waiting) does `after` meanwhile
    if (after != nullptr) (*after)();
  }
}

// decode_attention_team in a parallel region of its own
template <int D>
void decode_attention_bf16(const uint16_t* q, int64_t q_stride_m, int64_t q_stride_h,
                           const void* kv, const at::Half* kv_scale,
                           const int64_t* block_tables, const int64_t* seq_lens, uint16_t* out,
                           int64_t members, int64_t heads, int64_t kv_heads,
                           int64_t num_blocks, int64_t block_size, int64_t max_blocks,
                           float scale, const std::function<void()>* after = nullptr) {
#pragma omp parallel num_threads(at::get_num_threads())
  decode_attention_team<D>(q, q_stride_m, q_stride_h, kv, kv_scale, block_tables, seq_lens, out,
                           members, heads, kv_heads, num_blocks, block_size, max_blocks, scale,
                           after);
}

}  // namespace decode

// int8 weights, one float32 scale per output row (w[n, k] = q[n, k] * scale[n]), stored in
// panels of 16 rows pair-interleaved for the dot-product instruction ("VNNI"):
//   packed[p, t, i, j] = q[16 p + i, 2 t + j]   ([N / 16, K / 2, 16, 2] int8)
// int8 values are exact in bfloat16, so converting 32 of them (two pairs of 8 rows, widened to
// float32, packed to bfloat16) yields the dot-product operand for 16 rows x 2 inputs as is.
// The output projection runs on it at every batch size (bfloat16 weights would be twice the
// bytes, and the tied embedding's rows are read from it too, so no bfloat16 copy is kept).
namespace int8w {

constexpr int kPanel = 16;   // output rows per panel
constexpr int kDirectRows = 8;  // rows per tile when operands are widened as they are used,
constexpr int kDirectMax = 16;  // up to this many rows (measured faster than buffering them)
constexpr int kGroup = 4;       // beyond: panels widened together (64 outputs)
constexpr int kTileRows = 6;    // input rows per register tile (6 x 4 accumulators)

// Operand t of a panel (its 16 rows x inputs 2t, 2t + 1) as bfloat16.
inline __m512bh widen(const int8_t* panel, int64_t t) {
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(panel + t * 32))));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(panel + t * 32 + 16))));
  return _mm512_cvtne2ps_pbh(hi, lo);
}

// A panel's K / 2 operands as bfloat16, into `dst` (reused by every tile of input rows).
inline void widen_panel(const int8_t* panel, int64_t pairs, __m512i* dst) {
  for (int64_t t = 0; t < pairs; ++t) dst[t] = reinterpret_cast<__m512i>(widen(panel, t));
}

// Few input rows (decode): widen each operand as it is used, no buffer between.
template <int R>
void panel_rows_direct(const uint16_t* x, int64_t x_stride, const int8_t* panel, int64_t pairs,
                       __m512 scale, float* out, int64_t out_stride) {
  __m512 acc[2][R];
  for (int r = 0; r < R; ++r) acc[0][r] = acc[1][r] = _mm512_setzero_ps();
  for (int64_t t = 0; t < pairs; t += 2) {  // two chains in flight (pairs is even: k % 4)
    const __m512bh b0 = widen(panel, t), b1 = widen(panel, t + 1);
    for (int r = 0; r < R; ++r) {
      acc[0][r] = _mm512_dpbf16_ps(acc[0][r], simd::pair_of(x + r * x_stride + 2 * t), b0);
      acc[1][r] = _mm512_dpbf16_ps(acc[1][r], simd::pair_of(x + r * x_stride + 2 * t + 2), b1);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(out + r * out_stride,
                     _mm512_mul_ps(_mm512_add_ps(acc[0][r], acc[1][r]), scale));
  }
}

// out[r, 0:16 P] = scale * x[r] . w for R input rows against P widened panels (the register
// tile: R x P accumulators; per operand pair, P operand loads and R broadcasts feed R x P
// dot products).
template <int R, int P>
void tile(const uint16_t* x, int64_t x_stride, const __m512i* w, int64_t pairs,
          const float* scales, float* out, int64_t out_stride) {
  __m512 acc[R][P];
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < P; ++j) acc[r][j] = _mm512_setzero_ps();
  }
  for (int64_t t = 0; t < pairs; ++t) {
    __m512bh b[P];
    for (int j = 0; j < P; ++j) b[j] = simd::as_bh(w[j * pairs + t]);
    for (int r = 0; r < R; ++r) {
      const __m512bh a = simd::pair_of(x + r * x_stride + 2 * t);
      for (int j = 0; j < P; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], a, b[j]);
    }
  }
  for (int j = 0; j < P; ++j) {
    const __m512 scale = _mm512_loadu_ps(scales + j * kPanel);
    for (int r = 0; r < R; ++r) {
      _mm512_storeu_ps(out + r * out_stride + j * kPanel, _mm512_mul_ps(acc[r][j], scale));
    }
  }
}

// All m input rows against P widened panels: tiles of kTileRows rows, then the rest.
template <int P>
void rows_against(const uint16_t* x, int64_t m, int64_t x_stride, const __m512i* w,
                  int64_t pairs, const float* scales, float* out, int64_t n) {
  for (int64_t r = 0; r < m; r += kTileRows) {
    with_rows<kTileRows>(m - r, [&](auto rows) {
      tile<decltype(rows)::value, P>(x + r * x_stride, x_stride, w, pairs, scales, out + r * n,
                                     n);
    });
  }
}

void matmul(const uint16_t* x, int64_t m, int64_t x_stride, const int8_t* packed,
            const float* scales, int64_t n, int64_t k, float* out) {
  const int64_t pairs = k / 2, panels = n / kPanel;
  if (m <= kDirectMax) {
    at::parallel_for(0, panels, 16, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        for (int64_t r = 0; r < m; r += kDirectRows) {
          with_rows<kDirectRows>(m - r, [&](auto rows) {
            panel_rows_direct<decltype(rows)::value>(
                x + r * x_stride, x_stride, packed + p * pairs * 32, pairs,
                _mm512_loadu_ps(scales + p * kPanel), out + r * n + p * kPanel, n);
          });
        }
      }
    });
    return;
  }
  // more rows: widen kGroup panels at a time into a buffer (72 KB at k = 576, in L2) and run
  // every row against it, so each weight is widened once per call
  const int64_t groups = (panels + kGroup - 1) / kGroup;
  at::parallel_for(0, groups, 4, [&](int64_t begin, int64_t end) {
    std::vector<__m512i> w(kGroup * pairs);
    for (int64_t g = begin; g < end; ++g) {
      const int64_t p0 = g * kGroup, count = std::min<int64_t>(kGroup, panels - p0);
      for (int64_t j = 0; j < count; ++j) {
        widen_panel(packed + (p0 + j) * pairs * 32, pairs, w.data() + j * pairs);
      }
      if (count == kGroup) {
        rows_against<kGroup>(x, m, x_stride, w.data(), pairs, scales + p0 * kPanel,
                             out + p0 * kPanel, n);
      } else {
        for (int64_t j = 0; j < count; ++j) {
          rows_against<1>(x, m, x_stride, w.data() + j * pairs, pairs,
                          scales + (p0 + j) * kPanel, out + (p0 + j) * kPanel, n);
        }
      }
    }
  });
}

}  // namespace int8w

// int4 weights in groups of 32 inputs, w[n, k] = q[n, k] * scale[n, g] + min[n, g] with
// q in 0..15 and g = k / 32 (GGUF's Q4_1), for decode-sized batches (a few input rows: the
// step is bound by reading the weights, 4.5 bits each here). Per panel of 16 rows and group:
//   q: 8 x 32 bytes; byte i of chunk c holds operand 2c's lane i (low nibble) and operand
//      2c + 1's (high nibble), operand t being rows x inputs 2t, 2t + 1 pair-interleaved;
//   scale, min: 16 bfloat16 each.
// A nibble q becomes the bfloat16 operand 128 + q by two bitwise ops (exact), the group's sum
// of x . (128 + q) is taken on bfloat16 dot products, and scale and min are applied once per
// group:
//   y[n] = sum_g scale[n, g] * (x_g . (128 + q[n, g])) + (min[n, g] - 128 scale[n, g]) sum(x_g).
namespace int4w {

constexpr int kPanel = 16, kGroupK = 32;

// R input rows against P panels (P x 2 x S chains of dot products per row, S = 2 where
// P = 1 and R <= 2, so that the instruction's latency is hidden even at one row).
// While they run, `ahead` panels at pf_q / pf_sm are prefetched, a group's share per group:
// the weights stream from DRAM (they do not fit in cache), and the hardware prefetcher alone
// leaves a step's weight reads at ~30 GB/s where a plain read reaches ~50-70. Into L2 (T1),
// not L1 (32 KB here; the decode stack at one row 0.97x the time, paired, docs/benchmarks.md).
template <int R, int P>
void panels_rows(const uint16_t* x, int64_t x_stride, const float* xsum, int64_t groups,
                 const uint8_t* q, const uint16_t* sm, int64_t panel_q, int64_t panel_sm,
                 uint16_t* out, int64_t out_stride, const char* pf_q, const char* pf_sm,
                 int64_t ahead) {
  // bfloat16 0x4300 | q is exactly 128 + q (7 mantissa bits, exponent 7): two bitwise ops
  // make an operand, and the group's 128 * sum(x) comes off with the minimum below
  const __m512i low = _mm512_set1_epi16(0x0F), bias = _mm512_set1_epi16(0x4300);
  __m512 acc[R][P];
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < P; ++j) acc[r][j] = _mm512_setzero_ps();
  }
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t i = 0; i < ahead * 4; ++i) {
      _mm_prefetch(pf_q + (g * ahead * 4 + i) * 64, _MM_HINT_T1);
    }
    for (int64_t i = 0; i < ahead; ++i) _mm_prefetch(pf_sm + (g * ahead + i) * 64, _MM_HINT_T1);
    constexpr int S = P == 1 && R <= 2 ? 2 : 1;   // chains per operand half
    __m512 even[S][R][P], odd[S][R][P];
    for (int s = 0; s < S; ++s) {
      for (int r = 0; r < R; ++r) {
        for (int j = 0; j < P; ++j) even[s][r][j] = odd[s][r][j] = _mm512_setzero_ps();
      }
    }
    for (int c = 0; c < 8; ++c) {
      for (int j = 0; j < P; ++j) {
        const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(q + j * panel_q + (g * 8 + c) * 32)));
        // (w & low) | bias, and (w >> 4) | bias
        const __m512bh b0 = simd::as_bh(_mm512_ternarylogic_epi32(w, low, bias, 0xEA));
        const __m512bh b1 = simd::as_bh(_mm512_or_si512(_mm512_srli_epi16(w, 4), bias));
        for (int r = 0; r < R; ++r) {
          const uint16_t* xr = x + r * x_stride + g * kGroupK + 4 * c;
          even[c % S][r][j] = _mm512_dpbf16_ps(even[c % S][r][j], simd::pair_of(xr), b0);
          odd[c % S][r][j] = _mm512_dpbf16_ps(odd[c % S][r][j], simd::pair_of(xr + 2), b1);
        }
      }
    }
    for (int s = 1; s < S; ++s) {
      for (int r = 0; r < R; ++r) {
        for (int j = 0; j < P; ++j) {
          even[0][r][j] = _mm512_add_ps(even[0][r][j], even[s][r][j]);
          odd[0][r][j] = _mm512_add_ps(odd[0][r][j], odd[s][r][j]);
        }
      }
    }
    for (int j = 0; j < P; ++j) {
      const c10::BFloat16* group_sm = reinterpret_cast<const c10::BFloat16*>(
          sm + j * panel_sm + g * 2 * kPanel);
      const __m512 scale = simd::load16(group_sm);
      const __m512 min = _mm512_fnmadd_ps(_mm512_set1_ps(128.f), scale,  // min - 128 scale
                                          simd::load16(group_sm + kPanel));
      for (int r = 0; r < R; ++r) {
        acc[r][j] = _mm512_fmadd_ps(_mm512_add_ps(even[0][r][j], odd[0][r][j]), scale, acc[r][j]);
        acc[r][j] = _mm512_fmadd_ps(min, _mm512_set1_ps(xsum[r * groups + g]), acc[r][j]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < P; ++j) {
      simd::store16(reinterpret_cast<c10::BFloat16*>(out + r * out_stride + j * kPanel),
                    acc[r][j]);
    }
  }
}

// Panels are prefetched this far ahead of the ones being multiplied (23-61 KB at k = 576-1536).
// The decode stack at one row, paired against 8: 3-5 0.96-0.97x the time, 16 1.11x, none
// 1.09x (against 3); at 4 rows 0.98x (docs/benchmarks.md).
constexpr int64_t kAhead = 4;

// Rows r0 .. r0 + rows of the output for panels [begin, end).
template <int R, int P>
void run_panels(const uint16_t* x, int64_t x_stride, const float* xsum, int64_t groups,
                const uint8_t* q, const uint16_t* sm, int64_t begin, int64_t end,
                uint16_t* out, int64_t n) {
  const int64_t panel_q = groups * 8 * 32, panel_sm = groups * 2 * kPanel;
  const int64_t first = std::min(kAhead, end - begin);  // nothing before them fetched these
  simd::prefetch_bytes(q + begin * panel_q, first * panel_q);
  simd::prefetch_bytes(sm + begin * panel_sm, first * panel_sm * 2);
  auto run = [&](auto panels, int64_t p) {
    constexpr int J = decltype(panels)::value;
    const int64_t ahead = std::clamp<int64_t>(end - p - kAhead, 0, J);
    panels_rows<R, J>(x, x_stride, xsum, groups, q + p * panel_q, sm + p * panel_sm, panel_q,
                      panel_sm, out + p * kPanel, n,
                      reinterpret_cast<const char*>(q + (p + kAhead) * panel_q),
                      reinterpret_cast<const char*>(sm + (p + kAhead) * panel_sm), ahead);
  };
  int64_t p = begin;
  for (; p + P <= end; p += P) run(std::integral_constant<int, P>{}, p);
  for (; p < end; ++p) run(std::integral_constant<int, 1>{}, p);
}

// Panels multiplied at once. At one or two rows (the weights' bytes bound the step) one: a
// thread then reads its panels as one stream, where four panels side by side made four
// short streams that DRAM served at ~0.8x the rate (a batch-1 decode step 0.83x the time
// with one; docs/benchmarks.md); the latency of the dot products is hidden by two chains per
// operand half instead (S in panels_rows). At 3-4 rows the products bound it and two panels
// at once keep the registers busy (R x P x (1 + 2 S) accumulators in panels_rows).
template <int R>
constexpr int kPanelsAtOnce = R <= 2 ? 1 : R <= 4 ? 2 : 1;

// The weight a caller multiplies next (DecodeStack: the next projection), or none.
struct Next {
  const uint8_t* q = nullptr;
  const uint16_t* sm = nullptr;
  int64_t n = 0, k = 0;
};

// Grain of matmul's parallel_for: at least 8 panels (128 outputs) per task.
constexpr int64_t kGrain = 8;

// Thread `thread`'s panels [begin, end) of `panels` among `threads`: the split matmul's
// parallel_for makes (with OpenMP: equal chunks of ceil(panels / tasks), at least kGrain
// panels a task), which matmul_share makes too.
inline std::pair<int64_t, int64_t> share_of(int64_t panels, int64_t threads, int64_t thread) {
  const int64_t tasks = std::min<int64_t>(threads, (panels + kGrain - 1) / kGrain);
  const int64_t chunk = (panels + tasks - 1) / tasks;
  return {std::min(panels, thread * chunk), std::min(panels, (thread + 1) * chunk)};
}

// Ask for panels [from, upto) of the share of `next` that thread `thread` of `threads` will
// take (-1: this one, of at::parallel_for's threads) into L2, so that they arrive during the
// work between two matmuls (norms, RoPE, SwiGLU's activation, attention) instead of at the
// start of the next one. By default its first kAhead panels (24 at the end of a matmul
// measured slower).
void prefetch_next_share(const Next& next, int64_t from = 0, int64_t upto = kAhead,
                         int thread = -1, int threads = -1) {
  const int64_t panels = next.n / kPanel, groups = next.k / kGroupK;
  const auto [first, end] = share_of(panels, threads >= 0 ? threads : at::get_num_threads(),
                                     thread >= 0 ? thread : at::get_thread_num());
  const int64_t begin = first + from;
  if (begin >= std::min(end, first + upto)) return;
  const int64_t count = std::min(end, first + upto) - begin;
  const int64_t panel_q = groups * 8 * 32, panel_sm = groups * 2 * kPanel;
  simd::prefetch_bytes<_MM_HINT_T1>(next.q + begin * panel_q, count * panel_q);
  simd::prefetch_bytes<_MM_HINT_T1>(next.sm + begin * panel_sm, count * panel_sm * 2);
}

// Per row of x and group of kGroupK inputs: the sum of x (for the minima)
inline std::vector<float> group_sums(const uint16_t* x, int64_t m, int64_t x_stride,
                                     int64_t groups) {
  std::vector<float> xsum(m * groups);
  for (int64_t r = 0; r < m; ++r) {
    const c10::BFloat16* xr = reinterpret_cast<const c10::BFloat16*>(x + r * x_stride);
    for (int64_t g = 0; g < groups; ++g) {
      xsum[r * groups + g] = _mm512_reduce_add_ps(
          _mm512_add_ps(simd::load16(xr + g * kGroupK), simd::load16(xr + g * kGroupK + 16)));
    }
  }
  return xsum;
}

// Output panels [begin, end) of every row of x
inline void panels_of_rows(const uint16_t* x, int64_t m, int64_t x_stride, const float* xsum,
                           const uint8_t* q, const uint16_t* sm, int64_t n, int64_t k,
                           int64_t begin, int64_t end, uint16_t* out) {
  const int64_t groups = k / kGroupK;
  for (int64_t r = 0; r < m; r += 8) {
    with_rows<8>(m - r, [&](auto rows) {
      constexpr int R = decltype(rows)::value;
      run_panels<R, kPanelsAtOnce<R>>(x + r * x_stride, x_stride, xsum + r * groups, groups, q,
                                      sm, begin, end, out + r * n, n);
    });
  }
}

void matmul(const uint16_t* x, int64_t m, int64_t x_stride, const uint8_t* q,
            const uint16_t* sm, int64_t n, int64_t k, uint16_t* out, const Next& next = {}) {
  const auto xsum = group_sums(x, m, x_stride, k / kGroupK);
  at::parallel_for(0, n / kPanel, kGrain, [&](int64_t begin, int64_t end) {
    panels_of_rows(x, m, x_stride, xsum.data(), q, sm, n, k, begin, end, out);
    if (next.q != nullptr) prefetch_next_share(next);
  });
}

// matmul's work for thread `thread` of the enclosing parallel region's `threads` (its share
// of the panels, then the first panels of its share of `next`); the caller's barrier ends it.
void matmul_share(const uint16_t* x, int64_t m, int64_t x_stride, const uint8_t* q,
                  const uint16_t* sm, int64_t n, int64_t k, uint16_t* out, const Next& next,
                  int thread, int threads) {
  const auto [begin, end] = share_of(n / kPanel, threads, thread);
  if (begin < end) {
    const auto xsum = group_sums(x, m, x_stride, k / kGroupK);
    panels_of_rows(x, m, x_stride, xsum.data(), q, sm, n, k, begin, end, out);
  }
  if (next.q != nullptr) prefetch_next_share(next, 0, kAhead, thread, threads);
}

}  // namespace int4w

// silu(g) = g * sigmoid(g) on 16 lanes, from e = exp(-|g|) <= 1 (no overflow either side)
inline __m512 silu16(__m512 g) {
  const __m512 e = simd::exp_nonpositive16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
  const __m512 num = _mm512_mask_blend_ps(
      _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_GE_OQ), e, _mm512_set1_ps(1.f));
  return _mm512_mul_ps(g, _mm512_div_ps(num, _mm512_add_ps(_mm512_set1_ps(1.f), e)));
}

// Dynamic int8 activations ("W8A8") for prompt-sized matmuls: each row of x becomes int8 with
// its own scale (x ~ q * s, s = max|x| / 127), the int8 rows times an int8 weight (one scale
// per output) run on oneDNN's int8 GEMM (VNNI: four products per lane per instruction, twice
// bfloat16's two), and each int32 sum comes back as sum * s_row * s_output. The rows are
// multiplied by a per-column `smooth` (SmoothQuant's 1 / s_j) as they are rounded; the weight
// was made with its columns times s_j (ember/quant/packed.py).
namespace w8a8 {

using namespace simd;

// x [m, k] bfloat16 (row stride `stride`), times smooth [k] per column (nullptr: 1), in groups
// of `group` inputs (k % group == 0) -> q [k / group, m, group] int8 (each group's rows
// together, the operand of one GEMM) and scale [m, k / group]: x * smooth ~ q * scale per row
// and group; with `sums` [m, k / group], each group's sum of q too (int8a8 needs them)
void quantize_rows(const c10::BFloat16* x, int64_t m, int64_t k, int64_t stride,
                   const float* smooth, int64_t group, int8_t* q, float* scale,
                   int32_t* sums = nullptr) {
  const int64_t groups = k / group;
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t gi = 0; gi < groups; ++gi) {
        const int64_t first = gi * group;
        const c10::BFloat16* row = x + r * stride + first;
        const float* sm = smooth == nullptr ? nullptr : smooth + first;
        int8_t* out = q + (gi * m + r) * group;
        auto value = [&](int64_t i) {  // 16 inputs, smoothed
          return sm == nullptr ? load16(row + i) : _mm512_mul_ps(load16(row + i), load16(sm + i));
        };
        auto one = [&](int64_t j) { return sm == nullptr ? load(row[j]) : load(row[j]) * sm[j]; };
        __m512 amax = _mm512_setzero_ps();
        int64_t i = 0;
        for (; i + 16 <= group; i += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(value(i)));
        float a = _mm512_reduce_max_ps(amax);
        for (int64_t j = i; j < group; ++j) a = std::max(a, std::fabs(one(j)));
        scale[r * groups + gi] = a > 0.f ? a / 127.f : 1.f;
        const float inv = a > 0.f ? 127.f / a : 0.f;
        const __m512 inv16 = _mm512_set1_ps(inv);
        __m512i total = _mm512_setzero_si512();
        for (i = 0; i + 16 <= group; i += 16) {  // round to nearest even, saturate to int8
          const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(value(i), inv16));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm512_cvtsepi32_epi8(v));
          total = _mm512_add_epi32(total, v);   // |v| <= 127: the int8 values themselves
        }
        int32_t sum = _mm512_reduce_add_epi32(total);
        for (; i < group; ++i) {
          const float v = std::nearbyint(one(i) * inv);
          out[i] = static_cast<int8_t>(std::clamp(v, -127.f, 127.f));
          sum += out[i];
        }
        if (sums != nullptr) sums[r * groups + gi] = sum;
      }
    }
  });
}

// acc [groups, m, n] int32 -> out [m, n] bfloat16 = sum over groups of acc * row_scale[r, g],
// times col_scale[c]; with `swiglu`, acc holds [gate | up] (n = 2 * half) and out [m, half] =
// silu(gate) * up, both scaled first.
void dequantize(const int32_t* acc, int64_t groups, int64_t m, int64_t n,
                const float* row_scale, const float* col_scale, bool swiglu,
                c10::BFloat16* out) {
  const int64_t width = swiglu ? n / 2 : n;
  at::parallel_for(0, m, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* rs = row_scale + r * groups;
      c10::BFloat16* o = out + r * width;
      auto sum = [&](int64_t c) {  // one output, in float32
        if (groups == 1) return static_cast<float>(acc[r * n + c]) * (rs[0] * col_scale[c]);
        float v = 0.f;
        for (int64_t g = 0; g < groups; ++g) {
          v = std::fma(static_cast<float>(acc[(g * m + r) * n + c]), rs[g], v);
        }
        return v * col_scale[c];
      };
      auto value = [&](int64_t c) {  // 16 outputs from column c
        const __m512 cs = _mm512_loadu_ps(col_scale + c);
        if (groups == 1) {
          const __m512 v = _mm512_cvtepi32_ps(_mm512_loadu_si512(acc + r * n + c));
          return _mm512_mul_ps(v, _mm512_mul_ps(_mm512_set1_ps(rs[0]), cs));
        }
        __m512 v = _mm512_setzero_ps();
        for (int64_t g = 0; g < groups; ++g) {
          const __m512 part = _mm512_cvtepi32_ps(_mm512_loadu_si512(acc + (g * m + r) * n + c));
          v = _mm512_fmadd_ps(part, _mm512_set1_ps(rs[g]), v);
        }
        return _mm512_mul_ps(v, cs);
      };
      int64_t c = 0;
      for (; c + 16 <= width; c += 16) {
        store16(o + c, swiglu ? _mm512_mul_ps(silu16(value(c)), value(width + c)) : value(c));
      }
      for (; c < width; ++c) {
        const float v = sum(c);
        if (!swiglu) {
          o[c] = c10::BFloat16(v);
          continue;
        }
        const float u = sum(width + c);
        const float e = exp_nonpositive(-std::fabs(v));
        o[c] = c10::BFloat16(v * (v >= 0.f ? 1.f : e) / (1.f + e) * u);
      }
    }
  });
}

}  // namespace w8a8

// int8 dot products on the VNNI instruction (vpdpbusd: four int8 products per lane, where
// bfloat16 does two), for rows of x rounded to int8 (w8a8::quantize_rows), one scale per
// `group` inputs. The weight's operand is unsigned: "quads", 16 output rows x 4 inputs per 64
// bytes, each value q + 128 ([n / 16, k / 4, 16, 4] uint8, pack_int8_quads); the 128 * sum(x)
// that adds is taken off per row and group. The int4 formats' dense weights are kept so
// (w8a8_linear: prompt chunks and decode steps above 8 rows); the output projection's int8
// panels (pairs, for bfloat16 dot products) become quads by a 16-bit permute, kTilePanels
// panels at a time, once per call (int8_linear_a8).
#if defined(__AVX512VNNI__)
#define EMBER_INT8_DOT 1
namespace int8a8 {

using int8w::kPanel;
using simd::store16;

constexpr int kTileRows = 3, kTilePanels = 4;  // 12 int32 + 12 float32 accumulators

// A panel of int8w's pairs (k / 2 pairs of its 16 rows' inputs) -> k / 4 quads: 64 bytes
// hold pairs 2s (rows 0-15) then 2s + 1; row i takes 16-bit words i and 16 + i.
inline void quads_of_panel(const int8_t* panel, int64_t quads, __m512i* dst) {
  static const __m512i order = [] {
    alignas(64) int16_t idx[32];
    for (int i = 0; i < 16; ++i) {
      idx[2 * i] = static_cast<int16_t>(i);
      idx[2 * i + 1] = static_cast<int16_t>(16 + i);
    }
    return _mm512_load_si512(idx);
  }();
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t s = 0; s < quads; ++s) {
    const __m512i v = _mm512_loadu_si512(panel + s * 64);
    dst[s] = _mm512_xor_si512(_mm512_permutexvar_epi16(order, v), flip);
  }
}

// What a tile writes: float32 products, bfloat16 ones, or silu(gate) * up in bfloat16 (the
// tile's first P / 2 panels gate, the others the matching up panels).
enum class Out { kFloat, kBfloat16, kSwiglu };

// x as quantize_rows leaves it: q [k / group, m, group] int8, its scales [m, k / group] and
// the sums of each row's groups [m, k / group]
struct Rows {
  const int8_t* q;
  const float* scale;
  const int32_t* sum;
  int64_t m, group, groups;
};

// R rows from `first` x P panels (w[j]: panel j's quads, ws[j]: its 16 rows' scales) -> out,
// row stride `stride`, column j * 16 (kSwiglu: j < P / 2). One group: (sum - 128 xsum) *
// (xscale * wscale); more: per group (sum - 128 xsum) * xscale summed in float32 (fma), times
// wscale (w8a8::dequantize's arithmetic, bit for bit).
// acc += u8 . s8 in fours (vpdpbusd), written out: through the intrinsic, GCC copies every
// accumulator to another register and back on each use (twice the instructions per step)
inline void dpbusd(__m512i& acc, __m512i u8, __m512i s8) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u8), "v"(s8));
}

// acc[r][j] = the int32 dot products of R rows (row stride `stride`, `per` quads each) with
// P panels' quads from offset `at`. Not inlined, so that the caller's float32 sums do not
// take the registers this loop needs.
template <int R, int P>
__attribute__((noinline)) void dot_quads(const int8_t* rows, int64_t stride,
                                         const __m512i* const* w, int64_t at, int64_t per,
                                         __m512i* acc) {
  __m512i sum[R][P];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 16
    for (int j = 0; j < P; ++j) sum[r][j] = _mm512_setzero_si512();
  }
  const __m512i* wj[P];
  for (int j = 0; j < P; ++j) wj[j] = w[j] + at;
  for (int64_t s = 0; s < per; ++s) {
    __m512i b[P];
#pragma GCC unroll 16
    for (int j = 0; j < P; ++j) {   // loaded once per step (GCC would load them per row)
      b[j] = _mm512_loadu_si512(wj[j] + s);
      asm("" : "+v"(b[j]));
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      int32_t four;
      std::memcpy(&four, rows + r * stride + 4 * s, 4);
      const __m512i a = _mm512_set1_epi32(four);
#pragma GCC unroll 16
      for (int j = 0; j < P; ++j) dpbusd(sum[r][j], b[j], a);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 16
    for (int j = 0; j < P; ++j) _mm512_storeu_si512(acc + r * P + j, sum[r][j]);
  }
}

template <int R, int P, Out O>
void tile(const Rows& x, int64_t first, const __m512i* const* w, const float* const* ws,
          void* out, int64_t stride) {
  __m512 f[R][P];
  const int64_t per = x.group / 4;
  for (int64_t g = 0; g < x.groups; ++g) {
    __m512i acc[R][P];
    dot_quads<R, P>(x.q + (g * x.m + first) * x.group, x.group, w, g * per, per, &acc[0][0]);
    for (int r = 0; r < R; ++r) {
      const int64_t at = (first + r) * x.groups + g;
      const __m512i shift = _mm512_set1_epi32(128 * x.sum[at]);
      for (int j = 0; j < P; ++j) {
        const __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][j], shift));
        if (x.groups == 1) {
          f[r][j] = _mm512_mul_ps(v, _mm512_mul_ps(_mm512_set1_ps(x.scale[at]),
                                                   _mm512_loadu_ps(ws[j])));
        } else {
          f[r][j] = g == 0 ? _mm512_mul_ps(v, _mm512_set1_ps(x.scale[at]))
                           : _mm512_fmadd_ps(v, _mm512_set1_ps(x.scale[at]), f[r][j]);
        }
      }
    }
  }
  if (x.groups > 1) {
    for (int j = 0; j < P; ++j) {
      const __m512 wsc = _mm512_loadu_ps(ws[j]);
      for (int r = 0; r < R; ++r) f[r][j] = _mm512_mul_ps(f[r][j], wsc);
    }
  }
  for (int r = 0; r < R; ++r) {
    if constexpr (O == Out::kFloat) {
      float* o = static_cast<float*>(out) + r * stride;
      for (int j = 0; j < P; ++j) store16(o + j * kPanel, f[r][j]);
    } else if constexpr (O == Out::kBfloat16) {
      c10::BFloat16* o = static_cast<c10::BFloat16*>(out) + r * stride;
      for (int j = 0; j < P; ++j) store16(o + j * kPanel, f[r][j]);
    } else {
      c10::BFloat16* o = static_cast<c10::BFloat16*>(out) + r * stride;
      for (int j = 0; j < P / 2; ++j) {
        store16(o + j * kPanel, _mm512_mul_ps(silu16(f[r][j]), f[r][j + P / 2]));
      }
    }
  }
}

// The work of a matmul: blocks of up to kTilePanels panels (kSwiglu: half gate, half up),
// times row parts when there are too few blocks to keep every thread busy.
struct Plan {
  int64_t blocks, parts, tiles_per_part;
};

inline Plan plan(int64_t block_count, int64_t m) {
  const int64_t tiles = (m + kTileRows - 1) / kTileRows;
  const int64_t want = 8 * at::get_num_threads();   // units, for an even split
  const int64_t parts = std::clamp<int64_t>((want + block_count - 1) / block_count, 1, tiles);
  return Plan{block_count, parts, (tiles + parts - 1) / parts};
}

// Runs tile over rows [r0, r1) for `count` panels (w, ws: each panel's quads and scales).
template <Out O>
void tiles(const Rows& x, int64_t r0, int64_t r1, int count, const __m512i* const* w,
           const float* const* ws, void* out, int64_t stride, int64_t column) {
  const size_t esize = O == Out::kFloat ? sizeof(float) : sizeof(c10::BFloat16);
  for (int64_t r = r0; r < r1; r += kTileRows) {
    char* o = static_cast<char*>(out) + (r * stride + column) * esize;
    with_rows<kTileRows>(r1 - r, [&](auto rows) {
      constexpr int R = decltype(rows)::value;
      if constexpr (O == Out::kSwiglu) {
        if (count == kTilePanels) return tile<R, kTilePanels, O>(x, r, w, ws, o, stride);
        return tile<R, 2, O>(x, r, w, ws, o, stride);   // one gate panel and its up panel
      } else {
        if (count == kTilePanels) return tile<R, kTilePanels, O>(x, r, w, ws, o, stride);
        for (int j = 0; j < count; ++j) {
          tile<R, 1, O>(x, r, w + j, ws + j, o + j * kPanel * esize, stride);
        }
      }
    });
  }
}

// out = x w^T for w in quads [n / 16, k / 4, 16, 4] uint8 with scales [n]: [m, n] (kFloat,
// kBfloat16), or [m, n / 2] silu(gate) * up where w is [gate | up] (kSwiglu; n / 2 % 16 == 0).
template <Out O>
void matmul(const Rows& x, const uint8_t* quads, const float* scales, int64_t n, int64_t k,
            void* out) {
  const int64_t per_panel = k / 4;
  [[maybe_unused]] const int64_t panels = n / kPanel;   // kSwiglu: up starts at panels / 2
  const __m512i* base = reinterpret_cast<const __m512i*>(quads);
  const int64_t width = O == Out::kSwiglu ? n / 2 : n;
  const int64_t step = O == Out::kSwiglu ? kTilePanels / 2 : kTilePanels;  // output panels
  const int64_t out_panels = width / kPanel;
  const Plan p = plan((out_panels + step - 1) / step, x.m);
  at::parallel_for(0, p.blocks * p.parts, 1, [&](int64_t begin, int64_t end) {
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t block = unit / p.parts, part = unit % p.parts;
      const int64_t r0 = part * p.tiles_per_part * kTileRows;
      const int64_t r1 = std::min(x.m, r0 + p.tiles_per_part * kTileRows);
      if (r0 >= r1) continue;
      const int64_t first = block * step;   // output panel
      const int count = static_cast<int>(std::min<int64_t>(step, out_panels - first));
      const __m512i* w[kTilePanels];
      const float* ws[kTilePanels];
      for (int j = 0; j < count; ++j) {
        w[j] = base + (first + j) * per_panel;
        ws[j] = scales + (first + j) * kPanel;
        if constexpr (O == Out::kSwiglu) {   // the up panel matching gate panel first + j
          w[count + j] = base + (panels / 2 + first + j) * per_panel;
          ws[count + j] = scales + (panels / 2 + first + j) * kPanel;
        }
      }
      tiles<O>(x, r0, r1, O == Out::kSwiglu ? 2 * count : count, w, ws, out, width,
               first * kPanel);
    }
  });
}

// Up to kStreamRows rows (decode steps): each thread's panels one after another, one panel
// at a time, so that a thread reads its share of the weight as one stream (matmul's tiles of
// four panels side by side read four streams, and at one row took 1.06-1.28x the time of
// int8w's bfloat16 kernel on the output projection). At one row it issues about a fifth of
// that kernel's vector instructions per weight byte (3 against 14 per 64 bytes: no widening,
// the weight is vpdpbusd's operand as stored). C chains of int32 sums per row hide vpdpbusd's
// latency (R x C >= 4); their total is exact in any order, and the float32 arithmetic after
// it is tile's: the same bits as matmul, so a row's output does not depend on its batch.
constexpr int kStreamRows = 8;

// Each operand also asks for the one a panel ahead (k / 4 operands, 9 KB at k = 576) into
// L2. In a decode step the output projection's weight follows the layers' through the caches,
// and with it a whole batch-1 step took 0.955-0.974x the time with the vCPUs close, 0.93x far
// apart (docs/benchmarks.md, session 24), although the call alone after a flush was 6-10%
// faster without such a prefetch (session 23): the step is what counts.
template <int R>
void panel_stream(const Rows& x, int64_t first, const __m512i* w, const float* ws, float* out,
                  int64_t stride) {
  constexpr int C = R >= 4 ? 1 : 4 / R;
  const int64_t per = x.group / 4, ahead = x.groups * per;
  __m512 f[R];
  for (int64_t g = 0; g < x.groups; ++g) {
    __m512i sum[R][4];
    for (int r = 0; r < R; ++r) {
      for (int c = 0; c < 4; ++c) sum[r][c] = _mm512_setzero_si512();
    }
    const __m512i* wg = w + g * per;
    const int8_t* xg = x.q + (g * x.m + first) * x.group;
    for (int64_t s = 0; s < per; ++s) {
      _mm_prefetch(reinterpret_cast<const char*>(wg + s + ahead), _MM_HINT_T1);
      const __m512i b = _mm512_loadu_si512(wg + s);
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, xg + r * x.group + 4 * s, 4);
        dpbusd(sum[r][s % C], b, _mm512_set1_epi32(four));
      }
    }
    for (int r = 0; r < R; ++r) {
      const int64_t at = (first + r) * x.groups + g;
      const __m512i total = _mm512_add_epi32(_mm512_add_epi32(sum[r][0], sum[r][1]),
                                             _mm512_add_epi32(sum[r][2], sum[r][3]));
      const __m512 v = _mm512_cvtepi32_ps(
          _mm512_sub_epi32(total, _mm512_set1_epi32(128 * x.sum[at])));
      if (x.groups == 1) {
        f[r] = _mm512_mul_ps(v, _mm512_mul_ps(_mm512_set1_ps(x.scale[at]), _mm512_loadu_ps(ws)));
      } else {
        f[r] = g == 0 ? _mm512_mul_ps(v, _mm512_set1_ps(x.scale[at]))
                      : _mm512_fmadd_ps(v, _mm512_set1_ps(x.scale[at]), f[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    if (x.groups > 1) f[r] = _mm512_mul_ps(f[r], _mm512_loadu_ps(ws));
    store16(out + r * stride, f[r]);
  }
}

// out [m, n] float32 = x w^T for m <= kStreamRows, w in quads with scales [n] (matmul's
// kFloat, the same bits)
void matmul_stream(const Rows& x, const uint8_t* quads, const float* scales, int64_t n,
                   int64_t k, float* out) {
  const int64_t per_panel = k / 4, panels = n / kPanel;
  const __m512i* base = reinterpret_cast<const __m512i*>(quads);
  at::parallel_for(0, panels, 16, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      with_rows<kStreamRows>(x.m, [&](auto rows) {
        panel_stream<decltype(rows)::value>(x, 0, base + p * per_panel, scales + p * kPanel,
                                            out + p * kPanel, n);
      });
    }
  });
}

// The output projection: out [m, n] float32 = x w^T with w as int8w's panels (pairs), made
// quads kTilePanels panels at a time into a buffer (~36 KB at k = 576: in L1/L2 for every row).
void matmul_pairs(const Rows& x, const int8_t* packed, const float* scales, int64_t n,
                  int64_t k, float* out) {
  const int64_t per_panel = k / 4, panels = n / kPanel;
  const int64_t blocks = (panels + kTilePanels - 1) / kTilePanels;
  at::parallel_for(0, blocks, 4, [&](int64_t begin, int64_t end) {
    std::vector<__m512i> buffer(kTilePanels * per_panel);
    for (int64_t block = begin; block < end; ++block) {
      const int64_t p0 = block * kTilePanels;
      const int count = static_cast<int>(std::min<int64_t>(kTilePanels, panels - p0));
      const __m512i* w[kTilePanels];
      const float* ws[kTilePanels];
      for (int j = 0; j < count; ++j) {
        quads_of_panel(packed + (p0 + j) * per_panel * 64, per_panel,
                       buffer.data() + j * per_panel);
        w[j] = buffer.data() + j * per_panel;
        ws[j] = scales + (p0 + j) * kPanel;
      }
      tiles<Out::kFloat>(x, 0, x.m, count, w, ws, out, n, p0 * kPanel);
    }
  });
}

// x [m, k] (row stride `stride`) rounded to int8 for int8a8 into q [m * k], scale and sum
// [m * k / group] (the caller's buffers) -> the rows as its tiles read them
inline Rows quantize(const c10::BFloat16* x, int64_t m, int64_t k, int64_t stride,
                     const float* smooth, int64_t group, int8_t* q, float* scale, int32_t* sum) {
  w8a8::quantize_rows(x, m, k, stride, smooth, group, q, scale, sum);
  return Rows{q, scale, sum, m, group, k / group};
}

}  // namespace int8a8
#endif  // __AVX512VNNI__

#endif  // EMBER_BF16_DOT

// Rotate one head in place of `out`: out = x * cos + roll(x, d / 2) * sin, with sin's first
// half negated by the caller (ember/models/layers.py rope_cos_sin).
template <typename T>
inline void rope_head(const T* x, const T* cos, const T* sin, T* out, int64_t d) {
  const int64_t half = d / 2;
  int64_t i0 = 0;
#ifdef EMBER_BF16_DOT
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>) {
    using simd::load16, simd::store16;
    for (; i0 + 16 <= half; i0 += 16) {
      const __m512 lo = load16(x + i0), hi = load16(x + i0 + half);
      store16(out + i0,
              _mm512_fmadd_ps(hi, load16(sin + i0), _mm512_mul_ps(lo, load16(cos + i0))));
      store16(out + i0 + half, _mm512_fmadd_ps(lo, load16(sin + i0 + half),
                                               _mm512_mul_ps(hi, load16(cos + i0 + half))));
    }
  }
#endif
  for (int64_t i = i0; i < half; ++i) {
    out[i] = store<T>(load(x[i]) * load(cos[i]) + load(x[i + half]) * load(sin[i]));
    out[i + half] = store<T>(load(x[i + half]) * load(cos[i + half]) +
                             load(x[i]) * load(sin[i + half]));
  }
}

// One token's query heads of KV head h (x: its q, k, v row; q_out: its [heads, d]) rotated,
// and its key (rotated) and value written into the cache kv [2, kv_heads, num_slots, d] at
// `slot`.
template <typename T>
inline void rope_write_kv_head(const T* x, const T* c, const T* s, T* kv, int64_t slot,
                               T* q_out, int64_t h, int64_t heads, int64_t kv_heads, int64_t d,
                               int64_t num_slots) {
  const int64_t per_kv = heads / kv_heads;
  for (int64_t head = h * per_kv; head < (h + 1) * per_kv; ++head) {
    rope_head(x + head * d, c, s, q_out + head * d, d);
  }
  T* k_dst = kv + (h * num_slots + slot) * d;
  rope_head(x + (heads + h) * d, c, s, k_dst, d);
  std::memcpy(k_dst + kv_heads * num_slots * d, x + (heads + kv_heads + h) * d, d * sizeof(T));
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
// One head of d values rounded to int8 with its own float16 scale, as ember/models/attention.py
// quantize_int8 does it (bit for bit): scale = fp16(max(max|x| / 127, 2^-14)), q = round(x /
// scale) to nearest even, within +-127.
inline void quantize_head(const c10::BFloat16* x, int64_t d, int8_t* q, at::Half* scale) {
  __m512 amax = _mm512_setzero_ps();
  for (int64_t i = 0; i < d; i += 16) {
    amax = _mm512_max_ps(amax, _mm512_abs_ps(simd::load16(x + i)));
  }
  const at::Half s(std::max(_mm512_reduce_max_ps(amax) / 127.f, 6.103515625e-05f));
  *scale = s;
  const __m512 sv = _mm512_set1_ps(static_cast<float>(s));
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
  for (int64_t i = 0; i < d; i += 16) {
    const __m512i v = _mm512_cvtps_epi32(_mm512_div_ps(simd::load16(x + i), sv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i),
                     _mm512_cvtsepi32_epi8(_mm512_min_epi32(_mm512_max_epi32(v, lo), hi)));
  }
}

// rope_write_kv_head into an int8 cache (kv int8, kv_scale [2, kv_heads, num_slots] float16):
// the rotated k, rounded to bfloat16 first (as the torch path holds it), and v, quantized.
// With k_out ([d]), the rotated k is kept there too, before its rounding.
inline void rope_write_kv_head_i8(const c10::BFloat16* x, const c10::BFloat16* c,
                                  const c10::BFloat16* s, int8_t* kv, at::Half* kv_scale,
                                  int64_t slot, c10::BFloat16* q_out, int64_t h, int64_t heads,
                                  int64_t kv_heads, int64_t d, int64_t num_slots,
                                  c10::BFloat16* k_out = nullptr) {
  const int64_t per_kv = heads / kv_heads, v_heads = kv_heads * num_slots;
  for (int64_t head = h * per_kv; head < (h + 1) * per_kv; ++head) {
    rope_head(x + head * d, c, s, q_out + head * d, d);
  }
  alignas(64) c10::BFloat16 buffer[kMaxHeadDim];
  const int64_t at = h * num_slots + slot;
  c10::BFloat16* k = k_out != nullptr ? k_out : buffer;
  rope_head(x + (heads + h) * d, c, s, k, d);
  quantize_head(k, d, kv + at * d, kv_scale + at);
  quantize_head(x + (heads + kv_heads + h) * d, d, kv + (v_heads + at) * d,
                kv_scale + v_heads + at);
}

// rope_write_impl into an int8 cache (rope_write_kv_head_i8 for each token and KV head).
// With k_out ([tokens, kv_heads, d]), the rotated k is kept there too, before its rounding.
void rope_write_i8(const c10::BFloat16* qkv, const c10::BFloat16* cos, const c10::BFloat16* sin,
                   int8_t* kv, at::Half* kv_scale, const int64_t* slots, c10::BFloat16* q_out,
                   int64_t tokens, int64_t heads, int64_t kv_heads, int64_t d,
                   int64_t num_slots, c10::BFloat16* k_out = nullptr) {
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

void check_float(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
              " must be float32 or bfloat16");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

}  // namespace

bool has_bf16_dot();

// An int8 cache's scales: kv int8 [2, kv_heads, blocks, block_size, d] (d 64 or 128) and
// kv_scale float16 [2, kv_heads, blocks, block_size], both contiguous; only with AVX-512 BF16.
static void check_int8_cache(const torch::Tensor& kv, const torch::Tensor& kv_scale) {
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
static void check_block_ids(const int64_t* table, int64_t seq_len, int64_t block_size,
                            int64_t num_blocks) {
  for (int64_t b = 0; b < (seq_len + block_size - 1) / block_size; ++b) {
    TORCH_CHECK(table[b] >= 0 && table[b] < num_blocks, "a block id is outside the cache");
  }
}

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
                               torch::Tensor seq_lens, double scale,
                               c10::optional<torch::Tensor> kv_scale) {
  TORCH_CHECK(q.device().is_cpu() && q.stride(-1) == 1, "q must be on the CPU, its last "
              "dimension contiguous");
  if (kv_scale.has_value()) {
    check_int8_cache(kv, *kv_scale);
    TORCH_CHECK(q.scalar_type() == at::kBFloat16 && q.dim() == 3 && q.stride(1) == q.size(2),
                "with an int8 cache, q must be bfloat16 [B, heads, d], each row's heads "
                "contiguous");
  } else {
    check_float(kv, "kv");
    TORCH_CHECK(kv.scalar_type() == q.scalar_type(), "kv must have q's dtype");
  }
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
#ifdef EMBER_BF16_DOT
  if (q.scalar_type() == at::kBFloat16 && (d == 64 || d == 128) && q.stride(1) == d) {
    auto run = [&](auto impl) {
      impl(reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>()), q.stride(0),
           q.stride(1), kv.data_ptr(),
           kv_scale.has_value() ? kv_scale->data_ptr<at::Half>() : nullptr,
           block_tables.data_ptr<int64_t>(), lens,
           reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), members, heads,
           kv_heads, num_blocks, block_size, block_tables.size(1), static_cast<float>(scale),
           nullptr);
    };
    if (d == 64) {
      run(decode::decode_attention_bf16<64>);
    } else {
      run(decode::decode_attention_bf16<128>);
    }
    return out;
  }
#endif
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
// k and v into the cache at `slots`, returns the rotated q. With an int8 cache, k_out [T,
// kv_heads, d] bfloat16 receives the rotated k as well, before it is rounded to int8.
torch::Tensor rope_write(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin,
                         torch::Tensor kv, torch::Tensor slots, int64_t heads,
                         int64_t kv_heads, c10::optional<torch::Tensor> kv_scale,
                         c10::optional<torch::Tensor> k_out) {
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
  auto q = torch::empty({tokens, heads, d}, qkv.options());
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

// argmax_rows(x [B, V] float32, rows contiguous) -> [B] int64: each row's argmax, as
// x.argmax(-1) gives it (torch's CPU argmax walks a long row in a scalar loop: 47-85 us for
// one row of 49152 here, this ~7)
torch::Tensor argmax_rows(torch::Tensor x) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 &&
                  x.size(1) >= 1 && x.stride(1) == 1,
              "x must be [B, V] float32 on the CPU with contiguous rows, V >= 1");
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  auto out = torch::empty({rows}, x.options().dtype(at::kLong));
  const float* base = x.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) o[r] = argmax_row(base + r * stride, n);
  });
  return out;
}

bool has_bf16_dot() {  // whether the AVX-512 BF16 kernels are built
#ifdef EMBER_BF16_DOT
  return true;
#else
  return false;
#endif
}

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

bool has_int8_dot() {  // whether the AVX-512 VNNI kernels are built too (int8_linear_a8)
#ifdef EMBER_INT8_DOT
  return true;
#else
  return false;
#endif
}

// prefill_attention(q [n, heads, d] bfloat16 (rows may be strided), kv [2, kv_heads, blocks,
// block_size, d] bfloat16, block_table [>= ceil(seq_len / block_size)] int64, seq_len, scale)
// -> [n, heads, d]: the request's n new tokens, the last n of its seq_len cached tokens (write
// them first), attend causally over its context. d is 64 or 128; only with AVX-512 BF16.
torch::Tensor prefill_attention(torch::Tensor q, torch::Tensor kv, torch::Tensor block_table,
                                int64_t seq_len, double scale,
                                c10::optional<torch::Tensor> kv_scale) {
  TORCH_CHECK(has_bf16_dot(), "prefill_attention needs a CPU with AVX-512 BF16");
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 3 && q.stride(2) == 1 &&
                  q.stride(1) == q.size(2),
              "q must be [n, heads, d] on the CPU, each row's heads contiguous");
  if (kv_scale.has_value()) check_int8_cache(kv, *kv_scale);
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 &&
                  (kv_scale.has_value() || kv.scalar_type() == at::kBFloat16),
              "prefill_attention runs on bfloat16 q and a bfloat16 (or int8) kv");
  TORCH_CHECK(kv.dim() == 5 && kv.is_contiguous(), "kv must be a contiguous 5-D cache");
  const int64_t n = q.size(0), heads = q.size(1), d = q.size(2);
  const int64_t kv_heads = kv.size(1), num_blocks = kv.size(2), block_size = kv.size(3);
  TORCH_CHECK(kv.size(4) == d && heads % kv_heads == 0 && (d == 64 || d == 128),
              "head sizes do not match (or head_dim is not 64 or 128)");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && block_table.is_contiguous() &&
                  block_table.dim() == 1,
              "block_table must be [blocks] contiguous int64");
  TORCH_CHECK(seq_len >= n && n >= 1 && seq_len <= block_table.size(0) * block_size,
              "seq_len must cover the new tokens and fit the block table");
  const int64_t* table = block_table.data_ptr<int64_t>();
  check_block_ids(table, seq_len, block_size, num_blocks);
  auto out = torch::empty({n, heads, d}, q.options());
#ifdef EMBER_BF16_DOT
  auto run = [&](auto impl) {
    impl(reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>()), q.stride(0),
         kv.data_ptr(), kv_scale.has_value() ? kv_scale->data_ptr<at::Half>() : nullptr,
         table, seq_len,
         reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), n, heads, kv_heads,
         num_blocks, block_size, static_cast<float>(scale));
  };
  if (d == 64) {
    run(prefill::prefill_attention_impl<64>);
  } else {
    run(prefill::prefill_attention_impl<128>);
  }
#endif
  return out;
}

static void check_bf16_rows(const torch::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1 &&
                  x.scalar_type() == at::kBFloat16,
              "x must be [m, k] bfloat16 on the CPU with contiguous rows");
}

// q [n / 16, k / 32, 8, 32] uint8 and scale_min [n / 16, k / 32, 2, 16] bfloat16, from
// pack_int4_panels (int4w's layout)
static void check_int4_panels(const torch::Tensor& q, const torch::Tensor& scale_min) {
  TORCH_CHECK(q.scalar_type() == at::kByte && q.dim() == 4 && q.size(2) == 8 &&
                  q.size(3) == 32 && q.is_contiguous(),
              "q must be contiguous [n / 16, k / 32, 8, 32] uint8");
  TORCH_CHECK(scale_min.scalar_type() == at::kBFloat16 && scale_min.is_contiguous() &&
                  scale_min.numel() == q.size(0) * q.size(1) * 32,
              "scale_min must be contiguous [n / 16, k / 32, 2, 16] bfloat16");
}

// int8 weights in quads [n / 16, k / 4, 16, 4] uint8 (pack_int8_quads); `name` as the caller
// calls the argument
static void check_int8_quads(const torch::Tensor& w, const char* name) {
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 4 && w.size(2) == 16 &&
                  w.size(3) == 4 && w.is_contiguous(),
              name, " in quads must be contiguous [n / 16, k / 4, 16, 4] uint8");
}

static void check_int8_panels(const torch::Tensor& packed) {
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.dim() == 4 && packed.size(2) == 16 &&
                  packed.size(3) == 2 && packed.is_contiguous(),
              "packed must be contiguous [n / 16, k / 2, 16, 2] int8");
}

// x, packed and scales as int8_linear takes them (below), or with the weight in quads
// (int8_linear_a8 takes either); returns n, the outputs.
static int64_t check_int8_linear(const torch::Tensor& x, const torch::Tensor& packed,
                                 const torch::Tensor& scales, bool quads = false) {
  check_bf16_rows(x);
  if (quads) {
    check_int8_quads(packed, "packed");
  } else {
    check_int8_panels(packed);
  }
  const int64_t k = x.size(1), n = packed.size(0) * 16, per = quads ? 4 : 2;
  TORCH_CHECK(packed.size(1) * per == k, "x has ", k, " inputs, the weight ",
              packed.size(1) * per);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.numel() == n,
              "scales must be [n] contiguous float32");
  return n;
}

// int8_linear(x [m, k] bfloat16 (rows may be strided), packed [n / 16, k / 2, 16, 2] int8,
// scales [n] float32) -> [m, n] float32 = x w^T with w[r, c] = q[r, c] * scales[r] (the
// layout is int8w's above). Only with AVX-512 BF16.
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scales) {
  TORCH_CHECK(has_bf16_dot(), "int8_linear needs a CPU with AVX-512 BF16");
  const int64_t n = check_int8_linear(x, packed, scales), m = x.size(0), k = x.size(1);
  auto out = torch::empty({m, n}, x.options().dtype(at::kFloat));
#ifdef EMBER_BF16_DOT
  if (m > 0) {
    int8w::matmul(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), m, x.stride(0),
                   packed.data_ptr<int8_t>(), scales.data_ptr<float>(), n, k,
                   out.data_ptr<float>());
  }
#endif
  return out;
}

#ifdef EMBER_INT8_DOT
// x [m, k] bfloat16 rounded to int8 (times smooth, nullptr: 1), one scale per `group` inputs,
// in buffers of its own (three fewer tensor allocations a call): an op's int8a8 operand
struct Quantized {
  std::vector<int8_t> q;      // [k / group, m, group]
  std::vector<float> scale;   // [m, k / group]
  std::vector<int32_t> sum;   // [m, k / group]
  int8a8::Rows rows;   // points into the buffers above
  Quantized(const Quantized&) = delete;
  Quantized(const torch::Tensor& x, const float* smooth, int64_t group)
      : q(x.size(0) * x.size(1)), scale(x.size(0) * (x.size(1) / group)),
        sum(x.size(0) * (x.size(1) / group)) {
    rows = int8a8::quantize(x.data_ptr<at::BFloat16>(), x.size(0), x.size(1), x.stride(0),
                            smooth, group, q.data(), scale.data(), sum.data());
  }
};
#endif

// int8_linear_a8(x [m, k] bfloat16 (rows may be strided), packed, scales, group) -> [m, n]
// float32: int8_linear's product with x rounded to int8, one scale per `group` inputs of a row
// (0: the whole row; else dividing k, a multiple of 4), on int8 dot products (int8a8 above).
// packed is int8_linear's pairs (made quads on the way, every call), or the same weight kept in
// quads ([n / 16, k / 4, 16, 4] uint8, pack_int8_quads): the same sums, without that work.
// Only with AVX-512 VNNI and BF16 (has_int8_dot).
torch::Tensor int8_linear_a8(torch::Tensor x, torch::Tensor packed, torch::Tensor scales,
                             int64_t group) {
  TORCH_CHECK(has_int8_dot(), "int8_linear_a8 needs a CPU with AVX-512 VNNI and BF16");
  const bool quads = packed.scalar_type() == at::kByte;
  const int64_t n = check_int8_linear(x, packed, scales, quads), m = x.size(0), k = x.size(1);
  if (group == 0) group = k;
  TORCH_CHECK(group > 0 && group % 4 == 0 && k % group == 0, "group must be 0 (the whole row) "
              "or a multiple of 4 that divides the ", k, " inputs, not ", group);
  auto out = torch::empty({m, n}, x.options().dtype(at::kFloat));
#ifdef EMBER_INT8_DOT
  if (m > 0) {
    const Quantized xq(x, nullptr, group);
    if (quads && m <= int8a8::kStreamRows) {
      int8a8::matmul_stream(xq.rows, packed.data_ptr<uint8_t>(), scales.data_ptr<float>(), n, k,
                            out.data_ptr<float>());
    } else if (quads) {
      int8a8::matmul<int8a8::Out::kFloat>(xq.rows, packed.data_ptr<uint8_t>(),
                                          scales.data_ptr<float>(), n, k, out.data_ptr());
    } else {
      int8a8::matmul_pairs(xq.rows, packed.data_ptr<int8_t>(), scales.data_ptr<float>(), n, k,
                           out.data_ptr<float>());
    }
  }
#endif
  return out;
}

// int4_linear(x [m, k] bfloat16 (rows may be strided), q [n / 16, k / 32, 8, 32] uint8,
// scale_min [n / 16, k / 32, 2, 16] bfloat16) -> [m, n] bfloat16 = x w^T, w as int4w's above.
// Meant for a few rows (decode); correct for any. Only with AVX-512 BF16.
torch::Tensor int4_linear(torch::Tensor x, torch::Tensor q, torch::Tensor scale_min) {
  TORCH_CHECK(has_bf16_dot(), "int4_linear needs a CPU with AVX-512 BF16");
  check_bf16_rows(x);
  check_int4_panels(q, scale_min);
  const int64_t m = x.size(0), k = x.size(1), n = q.size(0) * 16;
  TORCH_CHECK(q.size(1) * 32 == k, "x has ", k, " inputs, the weight ", q.size(1) * 32);
  auto out = torch::empty({m, n}, x.options());
#ifdef EMBER_BF16_DOT
  if (m > 0) {
    int4w::matmul(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), m,
                  x.stride(0), q.data_ptr<uint8_t>(),
                  reinterpret_cast<const uint16_t*>(scale_min.data_ptr<at::BFloat16>()), n, k,
                  reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()));
  }
#endif
  return out;
}

// w8a8_linear(x [m, k] bfloat16 (rows may be strided), w, w_scale [n] float32, smooth [k]
// float32, swiglu, group) -> [m, n] bfloat16 = (x * smooth) w^T with w[r] = q[r] * w_scale[r]
// and x * smooth rounded to int8 per row, with one scale per `group` inputs (0: the whole row;
// else dividing k; smooth divides the weight's columns where it was made, SmoothQuant); with
// swiglu, the product is [gate | up] and the result [m, n / 2] is silu(gate) * up. w is
// either q [n, k] int8, on oneDNN's int8 GEMM (one per group; w8a8 above), or q in quads
// [n / 16, k / 4, 16, 4] uint8 (pack_int8_quads: q + 128), on int8a8's tiles (AVX-512 VNNI;
// group a multiple of 4, and n / 2 a multiple of 16 with swiglu). The same sums either way,
// and the same arithmetic after them. Only with AVX-512 BF16.
torch::Tensor w8a8_linear(torch::Tensor x, torch::Tensor w, torch::Tensor w_scale,
                          torch::Tensor smooth, bool swiglu, int64_t group) {
  TORCH_CHECK(has_bf16_dot(), "w8a8_linear needs a CPU with AVX-512 BF16");
  check_bf16_rows(x);
  const bool quads = w.dim() == 4;
  if (quads) {
    TORCH_CHECK(has_int8_dot(), "w8a8_linear on quads needs a CPU with AVX-512 VNNI");
    check_int8_quads(w, "w");
  } else {
    TORCH_CHECK(w.scalar_type() == at::kChar && w.dim() == 2 && w.is_contiguous(),
                "w must be contiguous [n, k] int8, or quads [n / 16, k / 4, 16, 4] uint8");
  }
  const int64_t m = x.size(0), k = x.size(1), n = quads ? w.size(0) * 16 : w.size(0);
  TORCH_CHECK((quads ? w.size(1) * 4 : w.size(1)) == k, "x has ", k, " inputs, the weight ",
              quads ? w.size(1) * 4 : w.size(1));
  TORCH_CHECK(w_scale.scalar_type() == at::kFloat && w_scale.is_contiguous() &&
                  w_scale.numel() == n,
              "w_scale must be [n] contiguous float32");
  TORCH_CHECK(smooth.scalar_type() == at::kFloat && smooth.is_contiguous() &&
                  smooth.numel() == k,
              "smooth must be [k] contiguous float32");
  TORCH_CHECK(!swiglu || n % (quads ? 32 : 2) == 0, "swiglu needs [gate | up] outputs, ",
              quads ? "each half a multiple of 16" : "an even number");
  if (group == 0) group = k;
  TORCH_CHECK(group > 0 && k % group == 0 && (!quads || group % 4 == 0), "group must be 0 "
              "(the whole row) or divide the ", k, " inputs", quads ? " (a multiple of 4)" : "",
              ", not ", group);
  auto out = torch::empty({m, swiglu ? n / 2 : n}, x.options());
#ifdef EMBER_BF16_DOT
  if (m > 0 && quads) {
#ifdef EMBER_INT8_DOT
    const Quantized xq(x, smooth.data_ptr<float>(), group);
    const auto* wq = w.data_ptr<uint8_t>();
    const float* ws = w_scale.data_ptr<float>();
    if (swiglu) {
      int8a8::matmul<int8a8::Out::kSwiglu>(xq.rows, wq, ws, n, k, out.data_ptr());
    } else {
      int8a8::matmul<int8a8::Out::kBfloat16>(xq.rows, wq, ws, n, k, out.data_ptr());
    }
#endif
  } else if (m > 0) {
    const int64_t groups = k / group;
    auto q = torch::empty({groups, m, group}, x.options().dtype(at::kChar));
    auto row_scale = torch::empty({m, groups}, x.options().dtype(at::kFloat));
    w8a8::quantize_rows(x.data_ptr<at::BFloat16>(), m, k, x.stride(0), smooth.data_ptr<float>(),
                        group, q.data_ptr<int8_t>(), row_scale.data_ptr<float>());
    auto acc = torch::empty({groups, m, n}, x.options().dtype(at::kInt));
    const auto wt = w.t();
    for (int64_t g = 0; g < groups; ++g) {  // oneDNN's int8 GEMM
      auto part = acc.select(0, g);
      at::_int_mm_out(part, q.select(0, g), wt.narrow(0, g * group, group));
    }
    w8a8::dequantize(acc.data_ptr<int32_t>(), groups, m, n, row_scale.data_ptr<float>(),
                     w_scale.data_ptr<float>(), swiglu, out.data_ptr<at::BFloat16>());
  }
#endif
  return out;
}

// int8_rows(ids [t] int64, packed, scales) -> [t, k] bfloat16: rows ids of w (as above), e.g.
// a tied embedding read from its output projection's int8 weight; packed as int8_linear's
// pairs, or as int8_linear_a8's quads (uint8, each value q + 128).
torch::Tensor int8_rows(torch::Tensor ids, torch::Tensor packed, torch::Tensor scales) {
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1 && ids.is_contiguous(),
              "ids must be [t] contiguous int64");
  const bool quads = packed.scalar_type() == at::kByte;
  if (quads) {
    check_int8_quads(packed, "packed");
  } else {
    check_int8_panels(packed);
  }
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.numel() == packed.size(0) * 16,
              "scales must be [n] float32");
  // a row's values come `per` at a time, one run every 64 bytes (16 rows x per inputs)
  const int64_t per = quads ? 4 : 2, runs = packed.size(1), n = packed.size(0) * 16;
  const int64_t k = runs * per;
  const int64_t* id = ids.data_ptr<int64_t>();
  const int64_t t = ids.size(0);
  for (int64_t i = 0; i < t; ++i) {
    TORCH_CHECK(id[i] >= 0 && id[i] < n, "token id ", id[i], " is outside the vocabulary (",
                n, ")");
  }
  auto out = torch::empty({t, k}, scales.options().dtype(at::kBFloat16));
  const auto* base = static_cast<const uint8_t*>(packed.data_ptr());
  const float* s = scales.data_ptr<float>();
  auto* o = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, t, 8, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const uint8_t* row = base + (id[i] / 16) * runs * 16 * per + (id[i] % 16) * per;
      const float scale = s[id[i]];
      for (int64_t c = 0; c < runs; ++c) {
        for (int64_t j = 0; j < per; ++j) {
          const uint8_t byte = row[c * 16 * per + j];   // quads hold q + 128 (unsigned)
          const int value = quads ? byte - 128 : static_cast<int8_t>(byte);
          o[i * k + c * per + j] = static_cast<float>(value) * scale;
        }
      }
    }
  });
  return out;
}

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
  DecodeStack(std::vector<torch::Tensor> weights, torch::Tensor final_norm, int64_t heads,
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

  // From now on, steps of more than `max_packed_rows` rows run every projection on int8 dot
  // products (w8a8_linear's arithmetic: x rounded to int8 per row or group, times smooth):
  // per layer, for qkv, o, gate_up and down in turn, the weight in quads (pack_int8_quads),
  // its scales [n] and smooth [k] float32 (12 tensors), and `groups` their activation groups
  // (4 per layer; 0: a whole row). Only with AVX-512 VNNI.
  void use_int8(std::vector<torch::Tensor> tensors, std::vector<int64_t> groups,
                int64_t max_packed_rows) {
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
    int8_ = true;
  }

  // x [T, hidden] (the embeddings), cos, sin [T, 1, d], kv: each layer's cache [2, kv_heads,
  // blocks, block_size, d], slots [T], block_tables [T, max_blocks], seq_lens [T] (int64; the
  // new token included) -> the final norm's output [T, hidden]. All bfloat16.
  // With kv_scales (one per layer, [2, kv_heads, blocks, block_size] float16), the caches are
  // int8 (ember/models/attention.py PagedKV); empty: bfloat16.
  // With positions [T] (int64), cos and sin are tables [P, 1, d] (every position below P) and
  // row t takes row positions[t] of each, instead of two torch index ops before the call (in a
  // batch-1 decode step, where the caches are cold: model.forward's glue 69-104 -> 44-67 us).
  torch::Tensor forward(torch::Tensor x, torch::Tensor cos, torch::Tensor sin,
                        const std::vector<torch::Tensor>& kv,
                        const std::vector<torch::Tensor>& kv_scales, torch::Tensor slots,
                        torch::Tensor block_tables, torch::Tensor seq_lens,
                        c10::optional<torch::Tensor> positions) const {
    std::tie(cos, sin) = rope_rows(cos, sin, positions, x.size(0));
    check_inputs(x, cos, sin, kv, kv_scales, slots);
    check_decodes(block_tables, seq_lens, x.size(0), kv[0].size(3));
    return run(x, cos, sin, kv, kv_scales, slots,
               Plan{0, x.size(0), block_tables.data_ptr<int64_t>(), block_tables.size(1),
                    seq_lens.data_ptr<int64_t>(), {}});
  }

  // A step with prompt chunks: the same arguments as forward, but the decodes are rows
  // decode_first .. decode_first + D - 1 (block_tables [D, max_blocks], seq_lens [D]; D may be
  // 0), and chunk_info [C, 4] int64 gives each prompt chunk's first row, new tokens, seq_len
  // (its context after this step, the new tokens included) and whether it is fresh (the
  // prompt's first chunk: with an int8 cache it attends over its own k and v as computed,
  // not as rounded into the cache, as the layers do), chunk_tables[c] its block table [>=
  // ceil(seq_len / block_size)]. Every row is a decode or in one chunk. positions: as forward.
  torch::Tensor forward_mixed(torch::Tensor x, torch::Tensor cos, torch::Tensor sin,
                              const std::vector<torch::Tensor>& kv,
                              const std::vector<torch::Tensor>& kv_scales, torch::Tensor slots,
                              int64_t decode_first, torch::Tensor block_tables,
                              torch::Tensor seq_lens, torch::Tensor chunk_info,
                              const std::vector<torch::Tensor>& chunk_tables,
                              c10::optional<torch::Tensor> positions) const {
    std::tie(cos, sin) = rope_rows(cos, sin, positions, x.size(0));
    check_inputs(x, cos, sin, kv, kv_scales, slots);
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
              seq_lens.data_ptr<int64_t>(), {}};
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
  };

  torch::Tensor run(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                    const std::vector<torch::Tensor>& kv,
                    const std::vector<torch::Tensor>& kv_scales, const torch::Tensor& slots,
                    const Plan& plan) const {
    const bool int8 = !kv_scales.empty();
    const int64_t t = x.size(0), qkv_n = layers_[0].qkv.n, inter = layers_[0].down.k;
    if (plan.chunks.empty() && t <= kOneRegionRows && !(int8_ && t > max_packed_rows_)) {
      return run_decodes(x, cos, sin, kv, kv_scales, slots, plan);
    }
    const auto opts = x.options();
    auto residual = x.clone();
    auto h = torch::empty({t, hidden_}, opts), out = torch::empty({t, hidden_}, opts);
    auto qkv = torch::empty({t, qkv_n}, opts), q = torch::empty({t, heads_, d_}, opts);
    const bool a8 = int8_ && t > max_packed_rows_;
    auto att = torch::empty({t, heads_, d_}, opts), act = torch::empty({t, inter}, opts);
    // int8 steps write silu(gate) * up straight into act: no [gate | up] buffer
    auto gate_up = a8 ? torch::Tensor() : torch::empty({t, 2 * inter}, opts);
    Int8Rows scratch;
    if (a8) {   // the widest input is the down projection's
      scratch.q.resize(t * inter);
      scratch.scale.resize(t * inter / 4);
      scratch.sum.resize(t * inter / 4);
    }
    // a fresh chunk over an int8 cache attends over its own k (rotated, before its rounding)
    // and v, copied per chunk into a one-block bfloat16 cache [2, kv_heads, 1, n, d]
    const bool own = int8 && std::any_of(plan.chunks.begin(), plan.chunks.end(),
                                         [](const Chunk& c) { return c.fresh; });
    auto k_out = own ? torch::empty({t, kv_heads_, d_}, opts) : torch::Tensor();
    std::vector<uint16_t> own_kv;
    auto* r = residual.data_ptr<at::BFloat16>();
    auto* hp = h.data_ptr<at::BFloat16>();
    auto* op = out.data_ptr<at::BFloat16>();
    rms_norm_rows(r, static_cast<at::BFloat16*>(nullptr),
                  layers_[0].in_norm.data_ptr<at::BFloat16>(), hp, t, hidden_, eps_);
    for (size_t l = 0; l < layers_.size(); ++l) {
      const Layer& layer = layers_[l];
      if (l > 0) rms_norm_rows(op, r, layer.in_norm.data_ptr<at::BFloat16>(), hp, t, hidden_, eps_);
      if (a8) {
        linear8(layer.qkv8, h, qkv, scratch);
      } else {
        linear(layer.qkv, h, qkv, &layer.o);
      }
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
      if (a8) {
        linear8(layer.o8, att.view({t, heads_ * d_}), out, scratch);
        rms_norm_rows(op, r, layer.post_norm.data_ptr<at::BFloat16>(), hp, t, hidden_, eps_);
        linear8(layer.gate_up8, h, act, scratch, true);
        linear8(layer.down8, act, out, scratch);
        continue;
      }
      linear(layer.o, att.view({t, heads_ * d_}), out, &layer.gate_up);
      rms_norm_rows(op, r, layer.post_norm.data_ptr<at::BFloat16>(), hp, t, hidden_, eps_);
      linear(layer.gate_up, h, gate_up, &layer.down);
      silu_and_mul_impl(gate_up.data_ptr<at::BFloat16>(), act.data_ptr<at::BFloat16>(), t, inter);
      linear(layer.down, act, out, l + 1 < layers_.size() ? &layers_[l + 1].qkv : nullptr);
    }
    rms_norm_rows(op, r, final_norm_.data_ptr<at::BFloat16>(), hp, t, hidden_, eps_);
    return h;
  }

  // Row `row`'s RoPE and cache write for KV head `kvh` (its query heads into q, its key and
  // value into the cache at slots[row]): what rope_write_impl / rope_write_i8 do per head.
  void rope_write_head(const at::BFloat16* qkv, const at::BFloat16* cos, const at::BFloat16* sin,
                       const torch::Tensor& cache, at::Half* kv_scale, const int64_t* slots,
                       at::BFloat16* q, int64_t row, int64_t kvh) const {
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

  // Steps of up to this many decodes (on the int4 weights) run in one parallel region
  static constexpr int64_t kOneRegionRows = 8;

  // run() for a step of decodes only, on the int4 weights: every op in one parallel region,
  // a barrier after each whose output the threads share out (a matmul: each thread its panels,
  // split as matmul's parallel_for splits them; attention: a task per request and KV head as
  // threads come free, each doing its heads' RoPE and cache write first). A region per op
  // cost its fork and join, ~2.5 us a matmul at a 320 ns round trip between the vCPUs
  // (docs/benchmarks.md, session 22: the stack at one row 0.94x the time, paired). The norms
  // and SwiGLU's activation (a few rows) run in every thread, on its own copy of the residual
  // stream and of their outputs, so that no barrier precedes a matmul. The same arithmetic as
  // run(): the same output, bit for bit.
  torch::Tensor run_decodes(const torch::Tensor& x, const torch::Tensor& cos,
                            const torch::Tensor& sin, const std::vector<torch::Tensor>& kv,
                            const std::vector<torch::Tensor>& kv_scales,
                            const torch::Tensor& slots, const Plan& plan) const {
    const bool int8 = !kv_scales.empty();
    const int64_t t = x.size(0), qkv_n = layers_[0].qkv.n, inter = layers_[0].down.k;
    const int threads = at::get_num_threads();
    const auto opts = x.options();
    auto qkv = torch::empty({t, qkv_n}, opts), q = torch::empty({t, heads_, d_}, opts);
    auto att = torch::empty({t, heads_, d_}, opts), out = torch::empty({t, hidden_}, opts);
    auto gate_up = torch::empty({t, 2 * inter}, opts), final = torch::empty({t, hidden_}, opts);
    // per thread: the residual stream, the norms' output, SwiGLU's activation
    auto residual = x.unsqueeze(0).repeat({threads, 1, 1});
    auto h = torch::empty({threads, t, hidden_}, opts);
    auto act = torch::empty({threads, t, inter}, opts);
    using BF = at::BFloat16;
    BF* const op = out.data_ptr<BF>();
    BF* const gp = gate_up.data_ptr<BF>();
    const int64_t row = heads_ * d_;
    auto attend_decodes = d_ == 64 ? decode::decode_attention_team<64>
                                   : decode::decode_attention_team<128>;
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
                       scale_, &fetch_o, &rope_write);
#pragma omp barrier
        linear(layer.o, att.data_ptr<BF>(), row, op, &layer.gate_up);
        rms_norm_rows(op, r, layer.post_norm.data_ptr<BF>(), hp, t, hidden_, eps_);
        linear(layer.gate_up, hp, hidden_, gp, &layer.down);
        silu_and_mul_impl(static_cast<const BF*>(gp), ap, t, inter);
        linear(layer.down, ap, inter, op, l + 1 < layers_.size() ? &layers_[l + 1].qkv : nullptr);
      }
      if (tid == 0) {
        rms_norm_rows(op, r, final_norm_.data_ptr<BF>(), final.data_ptr<BF>(), t, hidden_, eps_);
      }
    }
    return final;
  }

  struct Int4 {
    torch::Tensor q, scale_min;
    int64_t n, k;
  };
  struct Int8 {
    torch::Tensor quads, scale, smooth;
    int64_t n = 0, k = 0, group = 0;
  };
  struct Layer {
    torch::Tensor in_norm, post_norm;
    Int4 qkv, o, gate_up, down;
    Int8 qkv8, o8, gate_up8, down8;   // set by use_int8
  };
  // Scratch for x rounded to int8 (int8a8's operand), sized for a step's widest input
  struct Int8Rows {
    std::vector<int8_t> q;
    std::vector<float> scale;
    std::vector<int32_t> sum;
  };

  // att = attention of q over the cache, as the plan splits the rows: the decodes on the decode
  // kernel (each of its threads calling `after` once out of work), each chunk on the prefill
  // kernel (a fresh one over an int8 cache: over its own k from k_out and v from qkv)
  void attend(const Plan& plan, const torch::Tensor& q, const torch::Tensor& qkv,
              const torch::Tensor& k_out, std::vector<uint16_t>& own_kv,
              const torch::Tensor& cache, const at::Half* kv_scale, torch::Tensor& att,
              const std::function<void()>* after = nullptr) const {
    const int64_t blocks = cache.size(2), block_size = cache.size(3), row = heads_ * d_;
    if (plan.decodes > 0) {
      auto decode = d_ == 64 ? decode::decode_attention_bf16<64>
                             : decode::decode_attention_bf16<128>;
      decode(bits(q) + plan.decode_first * row, row, d_, cache.data_ptr(), kv_scale,
             plan.tables, plan.seq_lens, bits(att) + plan.decode_first * row, plan.decodes,
             heads_, kv_heads_, blocks, block_size, plan.max_blocks, scale_, after);
    }
    auto prefill = d_ == 64 ? prefill::prefill_attention_impl<64>
                            : prefill::prefill_attention_impl<128>;
    for (const Chunk& c : plan.chunks) {
      const uint16_t* qc = bits(q) + c.first * row;
      uint16_t* oc = bits(att) + c.first * row;
      if (kv_scale == nullptr || !c.fresh) {
        prefill(qc, row, cache.data_ptr(), kv_scale, c.table, c.seq_len, oc, c.n, heads_,
                kv_heads_, blocks, block_size, scale_);
        continue;
      }
      own_kv.resize(2 * kv_heads_ * c.n * d_);
      const uint16_t* k = bits(k_out) + c.first * kv_heads_ * d_;
      const uint16_t* v = bits(qkv) + c.first * qkv.size(1) + (heads_ + kv_heads_) * d_;
      for (int64_t h = 0; h < kv_heads_; ++h) {
        for (int64_t j = 0; j < c.n; ++j) {
          std::memcpy(own_kv.data() + (h * c.n + j) * d_, k + (j * kv_heads_ + h) * d_,
                      d_ * sizeof(uint16_t));
          std::memcpy(own_kv.data() + ((kv_heads_ + h) * c.n + j) * d_,
                      v + j * qkv.size(1) + h * d_, d_ * sizeof(uint16_t));
        }
      }
      static const int64_t kOneBlock[1] = {0};
      prefill(qc, row, own_kv.data(), nullptr, kOneBlock, c.n, oc, c.n, heads_, kv_heads_, 1,
              c.n, scale_);
    }
  }

  // out = x w^T on int8 dot products (bfloat16), or with `swiglu` silu(gate) * up of it
  static void linear8(const Int8& w, const torch::Tensor& x, torch::Tensor& out,
                      Int8Rows& scratch, bool swiglu = false) {
#ifdef EMBER_INT8_DOT
    const auto rows = int8a8::quantize(x.data_ptr<at::BFloat16>(), x.size(0), w.k, x.stride(0),
                                       w.smooth.data_ptr<float>(), w.group, scratch.q.data(),
                                       scratch.scale.data(), scratch.sum.data());
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

  static Int4 int4(torch::Tensor q, torch::Tensor scale_min) {
    check_int4_panels(q, scale_min);
    return Int4{q, scale_min, q.size(0) * 16, q.size(1) * 32};
  }

  static const uint16_t* bits(const torch::Tensor& t) {
    return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>());
  }
  static uint16_t* bits(torch::Tensor& t) {
    return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>());
  }

  // w as the int4 kernels take a weight to fetch ahead of its matmul
  static int4w::Next next_of(const Int4& w) {
    return int4w::Next{w.q.data_ptr<uint8_t>(), bits(w.scale_min), w.n, w.k};
  }

  // out = x w^T; the first panels of `next` (what runs after it) are fetched meanwhile
  static void linear(const Int4& w, const torch::Tensor& x, torch::Tensor& out,
                     const Int4* next) {
    int4w::matmul(bits(x), x.size(0), x.stride(0), w.q.data_ptr<uint8_t>(), bits(w.scale_min),
                  w.n, w.k, bits(out), next != nullptr ? next_of(*next) : int4w::Next{});
  }

  // cos and sin as given, or with positions [t] their rows at those positions (tables [P, 1,
  // d] contiguous bfloat16, every position in [0, P))
  std::pair<torch::Tensor, torch::Tensor> rope_rows(
      const torch::Tensor& cos, const torch::Tensor& sin,
      const c10::optional<torch::Tensor>& positions, int64_t t) const {
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
    auto rows = [&](const torch::Tensor& table) {
      auto out = torch::empty({t, 1, d_}, table.options());
      const auto* src = table.data_ptr<at::BFloat16>();
      auto* dst = out.data_ptr<at::BFloat16>();
      for (int64_t i = 0; i < t; ++i) {
        std::memcpy(dst + i * d_, src + p[i] * d_, d_ * sizeof(at::BFloat16));
      }
      return out;
    };
    return {rows(cos), rows(sin)};
  }

  void check_inputs(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                    const std::vector<torch::Tensor>& kv,
                    const std::vector<torch::Tensor>& kv_scales,
                    const torch::Tensor& slots) const {
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
  static void check_decodes(const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
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

  std::vector<Layer> layers_;
  bool int8_ = false;           // use_int8 was called
  int64_t max_packed_rows_ = 0;
  torch::Tensor final_norm_;
  int64_t heads_, kv_heads_, d_, hidden_;
  float eps_, scale_;
};
#endif  // EMBER_BF16_DOT

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // the GIL is released while a kernel runs, as torch's own ops do, so that the server's
  // event loop can serve HTTP meanwhile (the engine steps in a thread of its own)
  const auto no_gil = py::call_guard<py::gil_scoped_release>();
  m.def("rope_write", &rope_write, "RoPE on q and k, k and v written into the paged cache",
        py::arg("qkv"), py::arg("cos"), py::arg("sin"), py::arg("kv"), py::arg("slots"),
        py::arg("heads"), py::arg("kv_heads"), py::arg("kv_scale") = py::none(),
        py::arg("k_out") = py::none(), no_gil);
  m.def("silu_and_mul", &silu_and_mul, "SwiGLU's activation: silu(gate) * up", no_gil);
  m.def("argmax_rows", &argmax_rows, "each row's first index of its largest value", no_gil);
  m.def("rms_norm", &rms_norm, "RMSNorm, optionally after a fused residual add", no_gil);
  m.def("decode_attention", &decode_attention, "one query per request over the paged cache",
        py::arg("q"), py::arg("kv"), py::arg("block_tables"), py::arg("seq_lens"),
        py::arg("scale"), py::arg("kv_scale") = py::none(), no_gil);
  m.def("has_bf16_dot", &has_bf16_dot,
        "whether the AVX-512 BF16 kernels (prefill attention, int8 and int4 linear) are built");
  m.def("prefill_attention", &prefill_attention, "a prompt chunk over its paged context",
        py::arg("q"), py::arg("kv"), py::arg("block_table"), py::arg("seq_len"),
        py::arg("scale"), py::arg("kv_scale") = py::none(), no_gil);
  m.def("int8_linear", &int8_linear, "x w^T with w int8 in 16-row VNNI panels", no_gil);
  m.def("int8_linear_a8", &int8_linear_a8, "int8_linear with x rounded to int8 per group",
        no_gil);
  m.def("has_int8_dot", &has_int8_dot, "whether this build has AVX-512 VNNI int8 kernels");
  m.def("thread_sync_ns", &thread_sync_ns,
        "ns per round trip of a cache line between two threads, and per empty parallel region",
        no_gil);
  m.def("w8a8_linear", &w8a8_linear, "x w^T on int8 dot products, x quantized per row (or group)",
        no_gil);
  m.def("int8_rows", &int8_rows, "rows of an int8 weight in 16-row VNNI panels", no_gil);
  m.def("int4_linear", &int4_linear, "x w^T with w int4 (groups of 32) in 16-row panels",
        no_gil);
#ifdef EMBER_BF16_DOT
  // module_local: two builds may share a process (an A/B of two sources loads both)
  py::class_<DecodeStack>(m, "DecodeStack", py::module_local())
      .def(py::init<std::vector<torch::Tensor>, torch::Tensor, int64_t, int64_t, int64_t, double,
                    double>())
      .def("forward", &DecodeStack::forward, "a decode step through every layer",
           py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("kv"), py::arg("kv_scales"),
           py::arg("slots"), py::arg("block_tables"), py::arg("seq_lens"),
           py::arg("positions") = py::none(), no_gil)
      .def("forward_mixed", &DecodeStack::forward_mixed,
           "a step with prompt chunks through every layer", py::arg("x"), py::arg("cos"),
           py::arg("sin"), py::arg("kv"), py::arg("kv_scales"), py::arg("slots"),
           py::arg("decode_first"), py::arg("block_tables"), py::arg("seq_lens"),
           py::arg("chunk_info"), py::arg("chunk_tables"), py::arg("positions") = py::none(),
           no_gil)
      .def("use_int8", &DecodeStack::use_int8, "steps above max_packed_rows on int8 quads");
#endif
}

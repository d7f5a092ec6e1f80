// SIMD and scalar helpers shared by every kernel file: loads and stores of float32 and
// bfloat16 (as float32), exp for softmax's non-positive arguments, SiLU, and, with AVX-512
// BF16, their 16-lane forms and the operand helpers of the dot-product instructions.
// Layout: none of its own; bfloat16 is c10's (the high 16 bits of a float32).
// Reference: torch's float32 arithmetic (exp, sigmoid) within the errors stated below; the
// kernels that use these helpers state what they must equal.
// Everything here is inline: the kernels call these in their inner loops, in every file.
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512VNNI__)  // every CPU with AVX-512 BF16 has VNNI (int8 decode attention)
#include <immintrin.h>
#define EMBER_BF16_DOT 1  // attention on bfloat16 dot products (vdpbf16ps), 16-lane loops
#endif
#if defined(EMBER_BF16_DOT) && defined(__AVX512VNNI__)
#define EMBER_INT8_DOT 1  // linears on int8 activations (vpdpbusd)
#endif

namespace ember {

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
// AVX-512 helpers: 16 float32 lanes; bfloat16 pairs for the dot-product instruction.
namespace simd {

inline __m512bh as_bh(__m512i x) { return reinterpret_cast<__m512bh>(x); }
inline __m512bh pair_of(const uint16_t* p) {  // broadcast two bfloat16 values to all lanes
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return as_bh(_mm512_set1_epi32(v));
}

// exp_nonpositive on 16 lanes (same series; scalef builds 2^n). A smaller Degree cuts e^r's
// series short: to r^4 the relative error is below 5e-5, enough where the result is rounded
// to bfloat16 next.
template <int Degree = 6>
inline __m512 exp_nonpositive16(__m512 x) {
  static_assert(2 <= Degree && Degree <= 6, "e^r to r^2 .. r^6");
  constexpr float kInverseFactorial[] = {1.f, 1.f, 0.5f, 1.f / 6, 1.f / 24, 1.f / 120,
                                         1.f / 720};
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
  __m512 p = _mm512_set1_ps(kInverseFactorial[Degree]);
  for (int k = Degree - 1; k >= 0; --k) {
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kInverseFactorial[k]));
  }
  return _mm512_scalef_ps(p, n);
}

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline void store16(float* p, __m512 x) { _mm512_storeu_ps(p, x); }
inline void store16(c10::BFloat16* p, __m512 x) {  // round to nearest even, as c10 does
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x)));
}

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

}  // namespace simd

// silu(g) = g * sigmoid(g) on 16 lanes, from e = exp(-|g|) <= 1 (no overflow either side)
inline __m512 silu16(__m512 g) {
  const __m512 e = simd::exp_nonpositive16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
  const __m512 num = _mm512_mask_blend_ps(
      _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_GE_OQ), e, _mm512_set1_ps(1.f));
  return _mm512_mul_ps(g, _mm512_div_ps(num, _mm512_add_ps(_mm512_set1_ps(1.f), e)));
}
#endif  // EMBER_BF16_DOT

}  // namespace ember

// One token's rows in the paged KV cache: how the attention kernels walk a request's cached
// rows through its block table (bfloat16, or int8 with a float16 scale per row), and how a
// token's rotated key and its value are written into it (RoPE fused with the write).
// Layout: kv [2, kv_heads, blocks, block_size, d] (K then V), kv_scale [2, kv_heads, blocks,
// block_size] float16 for an int8 cache; a token's slot is block * block_size + offset.
// Reference: ember/models/layers.py apply_rope and ember/models/attention.py PagedKV (write,
// quantize_int8), bit for bit.
// Inline: the attention tasks of the decode stack write their heads with these, as rope_write
// does for a whole step.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "common.h"
#include "vec.h"

namespace ember {

#ifdef EMBER_BF16_DOT
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
      return _mm512_maskz_mov_ps(simd::first_lanes(len - j0), _mm512_cvtph_ps(h));
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
      simd::store16(reinterpret_cast<c10::BFloat16*>(buf + i),
                    _mm512_mul_ps(_mm512_cvtepi32_ps(wide), s));
    }
    return buf;
  }
};
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
#endif  // EMBER_BF16_DOT

}  // namespace ember

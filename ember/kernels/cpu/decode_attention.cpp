// Attention of one new token per request (a decode step) over the paged KV cache, read in
// place through each request's block table (no gathered copy): a scalar kernel for any dtype
// and head size, and with AVX-512 BF16 the dot-product kernels for heads of 64 and 128 over a
// bfloat16 cache or an int8 one (a float16 scale per row).
// Layout: q [B, heads, d] (rows and heads may be strided), kv [2, kv_heads, blocks,
// block_size, d] (kv_cache.h), block_tables [B, max_blocks], seq_lens [B] (the new token's
// own row included: written first). The query heads of a KV head are contiguous (GQA).
// Reference: ember/models/attention.py's gathered matmul attention (_matmul_attention) over
// PagedKV's rows (an int8 cache's dequantized).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <type_traits>
#include <vector>

#include "common.h"
#include "kv_cache.h"
#include "vec.h"

namespace ember {
namespace {

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

}  // namespace

#ifdef EMBER_BF16_DOT
// Decode attention on bfloat16 dot products: one new token per request, its G query heads per
// KV head over the request's cached keys, read in place from their blocks. Each score is two
// (D = 64) dot-product instructions on a key row as stored, whose 16 partial sums per key are
// then folded, 16 keys at once, into one vector of 16 scores (sum16). Softmax in float32; the
// weighted sum of V rows in float32 FMAs.
namespace decode {

using namespace simd;

namespace {

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

}  // namespace

// decode_attention_team and decode_attention_bf16: common.h says what they compute
template <int D>
void decode_attention_team(const uint16_t* q, int64_t q_stride_m, int64_t q_stride_h,
                           const void* kv, const at::Half* kv_scale,
                           const int64_t* block_tables, const int64_t* seq_lens, uint16_t* out,
                           int64_t members, int64_t heads, int64_t kv_heads,
                           int64_t num_blocks, int64_t block_size, int64_t max_blocks,
                           float scale, const std::function<void()>* after,
                           const std::function<void(int64_t, int64_t)>* before,
                           const int64_t* skip) {
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
      if (skip != nullptr && (skip[m] >> h & 1)) {
        zero_skipped_heads(out + m * heads * D, 0, 1, int64_t{1} << h, heads, kv_heads,
                           D * sizeof(uint16_t));
        continue;
      }
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

template <int D>
void decode_attention_bf16(const uint16_t* q, int64_t q_stride_m, int64_t q_stride_h,
                           const void* kv, const at::Half* kv_scale,
                           const int64_t* block_tables, const int64_t* seq_lens, uint16_t* out,
                           int64_t members, int64_t heads, int64_t kv_heads,
                           int64_t num_blocks, int64_t block_size, int64_t max_blocks,
                           float scale, const std::function<void()>* after,
                           const int64_t* skip) {
#pragma omp parallel num_threads(at::get_num_threads())
  decode_attention_team<D>(q, q_stride_m, q_stride_h, kv, kv_scale, block_tables, seq_lens, out,
                           members, heads, kv_heads, num_blocks, block_size, max_blocks, scale,
                           after, nullptr, skip);
}

#define EMBER_DECODE_ATTENTION(D)                                                             \
  template void decode_attention_team<D>(                                                     \
      const uint16_t*, int64_t, int64_t, const void*, const at::Half*, const int64_t*,        \
      const int64_t*, uint16_t*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float, \
      const std::function<void()>*, const std::function<void(int64_t, int64_t)>*,             \
      const int64_t*);                                                                        \
  template void decode_attention_bf16<D>(                                                     \
      const uint16_t*, int64_t, int64_t, const void*, const at::Half*, const int64_t*,        \
      const int64_t*, uint16_t*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float, \
      const std::function<void()>*, const int64_t*);
EMBER_DECODE_ATTENTION(64)
EMBER_DECODE_ATTENTION(128)
#undef EMBER_DECODE_ATTENTION

}  // namespace decode
#endif  // EMBER_BF16_DOT

// decode_attention(q [B, heads, d] (rows and heads may be strided),
// kv [2, kv_heads, blocks, block_size, d], block_tables [B, max_blocks] int64,
// seq_lens [B] int64, scale) -> [B, heads, d]: each request's one new token attends over its
// first seq_lens[b] cached tokens (its own included: write it first).
at::Tensor decode_attention(at::Tensor q, at::Tensor kv, at::Tensor block_tables,
                            at::Tensor seq_lens, double scale,
                            c10::optional<at::Tensor> kv_scale,
                            c10::optional<at::Tensor> skip) {
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
  const int64_t* skips = nullptr;
  if (skip.has_value()) {
    TORCH_CHECK(skip->scalar_type() == at::kLong && skip->is_contiguous() &&
                    skip->numel() == members,
                "skip must be [B] contiguous int64, a bit per KV head");
    skips = skip->data_ptr<int64_t>();
  }
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  for (int64_t m = 0; m < members; ++m) {  // a loop, not min()/max(): two ops cost more
    TORCH_CHECK(lens[m] >= 1 && lens[m] <= block_tables.size(1) * block_size,
                "seq_lens must be in [1, max_blocks * block_size]");
  }
  auto out = at::empty({members, heads, d}, q.options());
#ifdef EMBER_BF16_DOT
  if (q.scalar_type() == at::kBFloat16 && (d == 64 || d == 128) && q.stride(1) == d) {
    auto run = [&](auto impl) {
      impl(reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>()), q.stride(0),
           q.stride(1), kv.data_ptr(),
           kv_scale.has_value() ? kv_scale->data_ptr<at::Half>() : nullptr,
           block_tables.data_ptr<int64_t>(), lens,
           reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), members, heads,
           kv_heads, num_blocks, block_size, block_tables.size(1), static_cast<float>(scale),
           nullptr, skips);
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
  if (skips != nullptr) {   // (the scalar kernels attend every head; rare: no AVX-512 BF16)
    const int64_t head_bytes = d * out.element_size();
    for (int64_t m = 0; m < members; ++m) {
      zero_skipped_heads(static_cast<char*>(out.data_ptr()) + m * heads * head_bytes, 0, 1,
                         skips[m], heads, kv_heads, head_bytes);
    }
  }
  return out;
}

}  // namespace ember

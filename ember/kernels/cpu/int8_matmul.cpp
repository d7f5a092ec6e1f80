// Linears on int8 weights with one float32 scale per output row: on bfloat16 dot products
// (int8_linear: the output projection; int8_rows: a tied embedding's rows read from it), and
// on int8 dot products for activations rounded to int8 per row or group ("W8A8": w8a8_linear
// on oneDNN's int8 GEMM or on ember's tiles over quads, int8_linear_a8 on the output
// projection; AVX-512 VNNI).
// Layout: x [m, k] bfloat16 (rows may be strided); weights as pack_int8_panels (pairs,
// [n / 16, k / 2, 16, 2] int8) or pack_int8_quads (quads, [n / 16, k / 4, 16, 4] uint8,
// q + 128) make them, or q [n, k] int8 for oneDNN.
// Reference: x @ (q * scale[:, None]).T in float32 (int8_linear), and w8a8_linear's torch
// form: x * smooth rounded to int8 per row or group (max / 127), int32 sums times the two
// scales (ember/quant/packed.py; tests/reference/test_packed_weights.py).
#include <ATen/Parallel.h>
#include <ATen/ops/_int_mm.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common.h"
#include "vec.h"

namespace ember {

#ifdef EMBER_BF16_DOT
namespace {

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

}  // namespace

// int8 dot products on the VNNI instruction (vpdpbusd: four int8 products per lane, where
// bfloat16 does two), for rows of x rounded to int8 (w8a8::quantize_rows), one scale per
// `group` inputs. The weight's operand is unsigned: "quads", 16 output rows x 4 inputs per 64
// bytes, each value q + 128 ([n / 16, k / 4, 16, 4] uint8, pack_int8_quads); the 128 * sum(x)
// that adds is taken off per row and group. The int4 formats' dense weights are kept so
// (w8a8_linear: prompt chunks and decode steps above 8 rows); the output projection's int8
// panels (pairs, for bfloat16 dot products) become quads by a 16-bit permute, kTilePanels
// panels at a time, once per call (int8_linear_a8).
#ifdef EMBER_INT8_DOT
namespace int8a8 {

using int8w::kPanel;
using simd::store16;

// (Out and Rows: common.h)
namespace {

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
  const int64_t skip = x.from / 4, take = x.to > 0 ? (x.to - x.from) / 4 : per;   // a window
  for (int64_t g = 0; g < x.groups; ++g) {
    __m512i acc[R][P];
    dot_quads<R, P>(x.q + (g * x.m + first) * x.group + 4 * skip, x.group, w, g * per + skip,
                    take, &acc[0][0]);
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

}  // namespace

// matmul and quantize: common.h says what they compute
template <Out O>
void matmul(const Rows& x, const uint8_t* quads, const float* scales, int64_t n, int64_t k,
            void* out, int64_t out_stride) {
  TORCH_CHECK(x.to == 0 || (x.groups == 1 && x.from % 4 == 0 && x.to % 4 == 0 &&
                            0 <= x.from && x.from < x.to && x.to <= k),
              "int8a8::matmul: a window must lie in one group, in quads");
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
      tiles<O>(x, r0, r1, O == Out::kSwiglu ? 2 * count : count, w, ws, out,
               out_stride > 0 ? out_stride : width, first * kPanel);
    }
  });
}

namespace {

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
// apart, although the call alone after a flush was 6-10% faster without such a prefetch:
// the step is what counts.
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
  TORCH_CHECK(x.to == 0, "a window of inputs is matmul's alone");
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
  TORCH_CHECK(x.to == 0, "a window of inputs is matmul's alone");
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

}  // namespace

Rows quantize(const c10::BFloat16* x, int64_t m, int64_t k, int64_t stride,
              const float* smooth, int64_t group, int8_t* q, float* scale, int32_t* sum) {
  w8a8::quantize_rows(x, m, k, stride, smooth, group, q, scale, sum);
  return Rows{q, scale, sum, m, group, k / group};
}

Rows pick(const Rows& x, const int64_t* rows, int64_t count, int8_t* q, float* scale,
          int32_t* sum) {
  for (int64_t g = 0; g < x.groups; ++g) {
    for (int64_t i = 0; i < count; ++i) {
      std::memcpy(q + (g * count + i) * x.group, x.q + (g * x.m + rows[i]) * x.group, x.group);
    }
  }
  for (int64_t i = 0; i < count; ++i) {
    std::memcpy(scale + i * x.groups, x.scale + rows[i] * x.groups, x.groups * sizeof(float));
    std::memcpy(sum + i * x.groups, x.sum + rows[i] * x.groups, x.groups * sizeof(int32_t));
  }
  return Rows{q, scale, sum, count, x.group, x.groups, x.from, x.to};
}

template void matmul<Out::kBfloat16>(const Rows&, const uint8_t*, const float*, int64_t,
                                     int64_t, void*, int64_t);
template void matmul<Out::kSwiglu>(const Rows&, const uint8_t*, const float*, int64_t,
                                   int64_t, void*, int64_t);

}  // namespace int8a8
#endif  // EMBER_INT8_DOT
#endif  // EMBER_BF16_DOT

// int8 weights in quads [n / 16, k / 4, 16, 4] uint8 (pack_int8_quads); `name` as the caller
// calls the argument
static void check_int8_quads(const at::Tensor& w, const char* name) {
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 4 && w.size(2) == 16 &&
                  w.size(3) == 4 && w.is_contiguous(),
              name, " in quads must be contiguous [n / 16, k / 4, 16, 4] uint8");
}

static void check_int8_panels(const at::Tensor& packed) {
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.dim() == 4 && packed.size(2) == 16 &&
                  packed.size(3) == 2 && packed.is_contiguous(),
              "packed must be contiguous [n / 16, k / 2, 16, 2] int8");
}

// x, packed and scales as int8_linear takes them (below), or with the weight in quads
// (int8_linear_a8 takes either); returns n, the outputs.
static int64_t check_int8_linear(const at::Tensor& x, const at::Tensor& packed,
                                 const at::Tensor& scales, bool quads = false) {
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
at::Tensor int8_linear(at::Tensor x, at::Tensor packed, at::Tensor scales) {
  TORCH_CHECK(has_bf16_dot(), "int8_linear needs a CPU with AVX-512 BF16");
  const int64_t n = check_int8_linear(x, packed, scales), m = x.size(0), k = x.size(1);
  auto out = at::empty({m, n}, x.options().dtype(at::kFloat));
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
namespace {

// x [m, k] bfloat16 rounded to int8 (times smooth, nullptr: 1), one scale per `group` inputs,
// in buffers of its own (three fewer tensor allocations a call): an op's int8a8 operand
struct Quantized {
  std::vector<int8_t> q;      // [k / group, m, group]
  std::vector<float> scale;   // [m, k / group]
  std::vector<int32_t> sum;   // [m, k / group]
  int8a8::Rows rows;   // points into the buffers above
  Quantized(const Quantized&) = delete;
  Quantized(const at::Tensor& x, const float* smooth, int64_t group)
      : q(x.size(0) * x.size(1)), scale(x.size(0) * (x.size(1) / group)),
        sum(x.size(0) * (x.size(1) / group)) {
    rows = int8a8::quantize(x.data_ptr<at::BFloat16>(), x.size(0), x.size(1), x.stride(0),
                            smooth, group, q.data(), scale.data(), sum.data());
  }
};

}  // namespace
#endif

// int8_linear_a8(x [m, k] bfloat16 (rows may be strided), packed, scales, group) -> [m, n]
// float32: int8_linear's product with x rounded to int8, one scale per `group` inputs of a row
// (0: the whole row; else dividing k, a multiple of 4), on int8 dot products (int8a8 above).
// packed is int8_linear's pairs (made quads on the way, every call), or the same weight kept in
// quads ([n / 16, k / 4, 16, 4] uint8, pack_int8_quads): the same sums, without that work.
// Only with AVX-512 VNNI and BF16 (has_int8_dot).
at::Tensor int8_linear_a8(at::Tensor x, at::Tensor packed, at::Tensor scales,
                          int64_t group) {
  TORCH_CHECK(has_int8_dot(), "int8_linear_a8 needs a CPU with AVX-512 VNNI and BF16");
  const bool quads = packed.scalar_type() == at::kByte;
  const int64_t n = check_int8_linear(x, packed, scales, quads), m = x.size(0), k = x.size(1);
  if (group == 0) group = k;
  TORCH_CHECK(group > 0 && group % 4 == 0 && k % group == 0, "group must be 0 (the whole row) "
              "or a multiple of 4 that divides the ", k, " inputs, not ", group);
  auto out = at::empty({m, n}, x.options().dtype(at::kFloat));
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

// w8a8_linear(x [m, k] bfloat16 (rows may be strided), w, w_scale [n] float32, smooth [k]
// float32, swiglu, group) -> [m, n] bfloat16 = (x * smooth) w^T with w[r] = q[r] * w_scale[r]
// and x * smooth rounded to int8 per row, with one scale per `group` inputs (0: the whole row;
// else dividing k; smooth divides the weight's columns where it was made, SmoothQuant); with
// swiglu, the product is [gate | up] and the result [m, n / 2] is silu(gate) * up. w is
// either q [n, k] int8, on oneDNN's int8 GEMM (one per group; w8a8 above), or q in quads
// [n / 16, k / 4, 16, 4] uint8 (pack_int8_quads: q + 128), on int8a8's tiles (AVX-512 VNNI;
// group a multiple of 4, and n / 2 a multiple of 16 with swiglu). The same sums either way,
// and the same arithmetic after them. Only with AVX-512 BF16.
at::Tensor w8a8_linear(at::Tensor x, at::Tensor w, at::Tensor w_scale,
                       at::Tensor smooth, bool swiglu, int64_t group) {
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
  auto out = at::empty({m, swiglu ? n / 2 : n}, x.options());
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
    auto q = at::empty({groups, m, group}, x.options().dtype(at::kChar));
    auto row_scale = at::empty({m, groups}, x.options().dtype(at::kFloat));
    w8a8::quantize_rows(x.data_ptr<at::BFloat16>(), m, k, x.stride(0), smooth.data_ptr<float>(),
                        group, q.data_ptr<int8_t>(), row_scale.data_ptr<float>());
    auto acc = at::empty({groups, m, n}, x.options().dtype(at::kInt));
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
at::Tensor int8_rows(at::Tensor ids, at::Tensor packed, at::Tensor scales) {
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
  auto out = at::empty({t, k}, scales.options().dtype(at::kBFloat16));
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

}  // namespace ember

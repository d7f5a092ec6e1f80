// LoRA adapters of a mixed batch, in place: for each adapter g of the step and its rows
//   y[rows_g] += (x[rows_g] @ A[g]^T) @ B[g]
// the gathered low-rank matmuls of punica / S-LoRA, with no padding rows and no copy of x;
// rows of the base model are not touched. x and y bfloat16. Both halves run on int8 dot
// products, which halve the factors' bytes (read from memory each step: a few adapters'
// factors do not stay in cache beside the weights) and their multiply-adds against bfloat16:
// the shrink, t = x A^T, with x rounded to int8 per row and A int8 per rank, in quads of
// inputs [G, ceil(in / 4), R, 4] (R a multiple of 16, zero ranks past the adapters'; a quad
// of one row's inputs, broadcast, meets 16 ranks in one instruction; a_scales [G, 2, R]
// float32: per rank its scale and the sum of its int8 values); the expand, t B, with t
// rounded to int8 per row and B per column.
// Layout: rows [N] lists the rows of adapter 0, then of adapter 1, ...; starts [G + 1] is
// where each adapter's rows begin in it. B is kept in blocks of 16 columns, and of each
// block only the ranks that may be nonzero there (qkv's q ranks only write q's columns):
// ranges [ceil(out / 16), 3] int32 gives per block its ranks [begin, end) and where its
// quads start in b [G, Q, 64] int8; a block's data is its ranks by quads, [quads, 16, 4]
// (the dot-product instruction's operand; zero ranks complete the last quad; zeros past
// out). b_scales [G, 2, out] float32: per column its scale and the sum of its int8 values.
// A fused projection so costs its modules' sizes, and a block is one sequential read.
// Reference: y + (x A^T) B in float64, rounded to bfloat16, within one unit of its last
// place plus the roundings of x, A, t and B to int8 (half a step of each one's scale, times
// the other operand's magnitudes); ember/lora/batch.py LoraLayer.add_'s torch form (gathered
// bmm in float32) within the same bound (tests/reference/test_lora.py).
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "common.h"
#include "vec.h"

namespace ember {

#ifdef EMBER_INT8_DOT
namespace {

constexpr int64_t kShrinkRows = 8;   // rows of one shrink tile (A's quads read once for them)
constexpr int64_t kShrinkAhead = 64;  // input quads of A fetched ahead of their use
constexpr int64_t kExpandRows = 8;   // rows of one expand tile (a B row read once for them)
constexpr int64_t kExpandAhead = 8;   // spans of blocks fetched ahead of their use

// t_i[16 v, 16 v + 16) = (xq_i . A's ranks - 128 as) xs_i sa for NR rows and NV vectors of
// 16 ranks, on int8 dot products: xq_i a row of x rounded to int8 plus 128 (padded with 128s,
// i.e. zeros), scale xs_i; a the first of the ranks' quads, [quads, R, 4] (a row of R ranks
// by 4 inputs per quad of inputs), their scales sa and sums as (128 times the sum is what the
// + 128 added)
template <int NR, int NV>
void shrink_tile(const uint8_t* const* xq, const float* xs, const int8_t* a, int64_t quads,
                 int64_t ranks, const float* sa, const float* as, float* t, int64_t ld) {
  __m512i acc[NR][NV];
  for (auto& row : acc) {
    for (auto& v : row) v = _mm512_setzero_si512();
  }
  for (int64_t k = 0; k < quads; ++k) {
    // factors come from memory, and a call's streams are too short for the hardware
    // prefetcher to ramp up
    for (int v = 0; v < NV; ++v) {
      _mm_prefetch(reinterpret_cast<const char*>(a + ((k + kShrinkAhead) * ranks + 16 * v) * 4),
                   _MM_HINT_T0);
    }
    __m512i av[NV];
    for (int v = 0; v < NV; ++v) av[v] = _mm512_loadu_si512(a + (k * ranks + 16 * v) * 4);
    for (int i = 0; i < NR; ++i) {
      int32_t quad;
      std::memcpy(&quad, xq[i] + 4 * k, sizeof(quad));
      const __m512i xk = _mm512_set1_epi32(quad);
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_dpbusd_epi32(acc[i][v], xk, av[v]);
    }
  }
  for (int v = 0; v < NV; ++v) {
    const __m512 scale = _mm512_loadu_ps(sa + 16 * v);
    const __m512 offset = _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(as + 16 * v),
                                                      _mm512_set1_ps(128.f)), scale);
    for (int i = 0; i < NR; ++i) {
      const __m512 dot = _mm512_fmsub_ps(_mm512_cvtepi32_ps(acc[i][v]), scale, offset);
      _mm512_storeu_ps(t + i * ld + 16 * v, _mm512_mul_ps(dot, _mm512_set1_ps(xs[i])));
    }
  }
}

// The first n of 32 lanes (none where n <= 0)
inline __mmask32 first32(int64_t n) {
  return n >= 32 ? ~__mmask32(0) : n <= 0 ? __mmask32(0) : (__mmask32(1) << n) - 1;
}

// Row x [n] bfloat16 rounded to int8 with one scale (its largest magnitude / 127), plus 128,
// into q [ceil(n / 64) * 64] (the padding 128: zero); returns the scale. 32 inputs a step:
// a bfloat16's magnitude orders as its bits do, and a 32-bit lane's two inputs are floats
// once shifted or masked.
float quantize_x(const uint16_t* x, int64_t n, uint8_t* q) {
  __m512i top = _mm512_setzero_si512();
  for (int64_t k = 0; k < n; k += 32) {
    const __m512i v = _mm512_maskz_loadu_epi16(first32(n - k), x + k);
    top = _mm512_max_epu16(top, _mm512_and_si512(v, _mm512_set1_epi16(0x7FFF)));
  }
  const uint32_t bits = std::max(
      _mm512_reduce_max_epu32(_mm512_and_si512(top, _mm512_set1_epi32(0xFFFF))),
      _mm512_reduce_max_epu32(_mm512_srli_epi32(top, 16)));
  float most;
  const uint32_t as_float = bits << 16;
  std::memcpy(&most, &as_float, sizeof(most));
  const __m512 inv = _mm512_set1_ps(most > 0.f ? 127.f / most : 0.f);
  const __m512 half = _mm512_set1_ps(128.f);   // round(v) + 128 = round(v + 128): 128 is even
  const int64_t padded = (n + 63) / 64 * 64;
  for (int64_t k = 0; k < padded; k += 32) {
    const __m512i v = _mm512_maskz_loadu_epi16(first32(n - k), x + k);
    const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    const __m512 odd = _mm512_castsi512_ps(
        _mm512_and_si512(v, _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
    const __m512i qe = _mm512_cvtps_epi32(_mm512_fmadd_ps(even, inv, half));
    const __m512i qo = _mm512_cvtps_epi32(_mm512_fmadd_ps(odd, inv, half));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + k),   // in [1, 255]: a byte each
                        _mm512_cvtepi32_epi16(_mm512_or_si512(qe, _mm512_slli_epi32(qo, 8))));
  }
  return most > 0.f ? most / 127.f : 1.f;
}

// 16 columns of B for the expand's epilogue: y + (dot - 128 sum) scale t_scale, the int8 dot
// product of a row's t + 128 with the columns less what the + 128 added, as dot scale - offset
struct Columns {
  __m512 scale, offset;
  __mmask16 m;
  Columns(const float* bs, int64_t c, int64_t out, __mmask16 mask) : m(mask) {
    scale = _mm512_maskz_loadu_ps(m, bs + c);
    offset = _mm512_mul_ps(
        _mm512_mul_ps(_mm512_maskz_loadu_ps(m, bs + out + c), _mm512_set1_ps(128.f)), scale);
  }
  // y[0, 16) (bfloat16 bits, the first m of them) plus acc's update, rounded to bfloat16
  __m256i added(__m512i acc, float t_scale, const uint16_t* y) const {
    const __m512 delta = _mm512_fmsub_ps(_mm512_cvtepi32_ps(acc), scale, offset);
    const __m256i old = _mm256_maskz_loadu_epi16(m, y);
    const __m512 sum = _mm512_fmadd_ps(
        delta, _mm512_set1_ps(t_scale),
        _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(old), 16)));
    return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(sum));
  }
};

// y_i[c0, c0 + 16 NB) += sum_r t_i[r] B[r, c0 ..] for NR rows and NB blocks that share
// their ranks, over `quads` quads of them, on int8 dot products: tq [NR rows, ld] is t_i
// rounded to int8 (scale ts[i]) plus 128, from the blocks' first rank; bc the blocks' rows
// by quads, NB x [quads, 16, 4] int8 one after the other; bs [2, out] the columns' scales
// and their int8 sums (128 times the sum is what the + 128 added). Two blocks per tile:
// each broadcast of t feeds two dot products.
template <int NR, int NB>
void expand_tile(uint16_t* const* ys, const uint8_t* tq, int64_t ld, const float* ts,
                 const int8_t* bc, int64_t quads, const float* bs, int64_t c0, int64_t out) {
  __m512i acc[NR][NB];
  for (auto& row : acc) {
    for (auto& v : row) v = _mm512_setzero_si512();
  }
  for (int64_t k = 0; k < quads; ++k) {
    __m512i bv[NB];
    for (int j = 0; j < NB; ++j) bv[j] = _mm512_loadu_si512(bc + (j * quads + k) * 64);
    for (int i = 0; i < NR; ++i) {
      int32_t quad;
      std::memcpy(&quad, tq + i * ld + 4 * k, sizeof(quad));
      const __m512i tk = _mm512_set1_epi32(quad);
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], tk, bv[j]);
    }
  }
  for (int j = 0; j < NB; ++j) {
    const int64_t c = c0 + 16 * j;
    const __mmask16 m = simd::first_lanes(out - c);
    const Columns cols(bs, c, out, m);
    for (int i = 0; i < NR; ++i) {
      uint16_t* p = ys[i] + c;
      _mm256_mask_storeu_epi16(p, m, cols.added(acc[i][j], ts[i], p));
    }
  }
}

// Row i of t [n, ld] (float, its first `ranks`) rounded to int8 with one scale per row,
// plus 128: tq [n, ld] (128 past ranks: zero), ts [n]
void quantize_t(const float* t, int64_t ld, int64_t ranks, int64_t i, uint8_t* tq, float* ts) {
  const float* row = t + i * ld;
  __m512 top = _mm512_setzero_ps();
  for (int64_t r = 0; r < ranks; r += 16) {
    top = _mm512_max_ps(top, _mm512_abs_ps(_mm512_maskz_loadu_ps(simd::first_lanes(ranks - r),
                                                                 row + r)));
  }
  const float most = _mm512_reduce_max_ps(top);
  ts[i] = most > 0.f ? most / 127.f : 1.f;
  const __m512 inv = _mm512_set1_ps(most > 0.f ? 127.f / most : 0.f);
  for (int64_t r = 0; r < ld; r += 16) {
    const __m512 v = _mm512_maskz_loadu_ps(r < ranks ? simd::first_lanes(ranks - r) : 0, row + r);
    const __m512i q = _mm512_cvtps_epi32(_mm512_fmadd_ps(v, inv, _mm512_set1_ps(128.f)));
    _mm512_mask_cvtepi32_storeu_epi8(tq + i * ld + r, simd::first_lanes(ld - r), q);
  }
}

// One or two column blocks that share their ranks [r0, r0 + 4 quads), at quad `offset` of b
struct Span {
  int64_t c0, blocks, r0, quads, offset;
};

std::vector<Span> spans_of(const int32_t* ranges, int64_t blocks) {
  std::vector<Span> spans;
  for (int64_t c = 0; c < blocks; ++c) {
    const int32_t* r = ranges + 3 * c;
    if (r[0] >= r[1]) continue;
    const bool pair = c + 1 < blocks && r[3] == r[0] && r[4] == r[1];
    spans.push_back({16 * c, pair ? 2 : 1, r[0], (r[1] - r[0] + 3) / 4, r[2]});
    if (pair) ++c;
  }
  return spans;
}

struct Tile {
  int64_t g, first, n;   // adapter, first of its entries in rows, rows in the tile
};

std::vector<Tile> tiles_of(const int64_t* starts, int64_t groups, int64_t size) {
  std::vector<Tile> tiles;
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t i = starts[g]; i < starts[g + 1]; i += size) {
      tiles.push_back({g, i, std::min(size, starts[g + 1] - i)});
    }
  }
  return tiles;
}

}  // namespace

void lora_add_impl(uint16_t* y, int64_t y_stride, const uint16_t* x, int64_t x_stride,
                   const int64_t* rows, const int64_t* starts, int64_t groups,
                   const int8_t* a, const float* a_scales, const int8_t* b,
                   const float* b_scales, const int32_t* ranges, int64_t ranks, int64_t in,
                   int64_t out) {
  const int64_t n = starts[groups];
  if (n == 0 || ranks == 0) return;
  // t [n, ld] in float, then rounded to int8 + 128 for the expand: ld >= ranks + 3, so that a
  // block's last quad may reach past the ranks (its B is zero there)
  const int64_t ld = ranks + 4;
  // (none read before written: no zero fill, which cost a prompt step's memset per call)
  std::unique_ptr<float[]> t(new float[n * ld]);
  std::unique_ptr<uint8_t[]> tq(new uint8_t[n * ld]);
  std::unique_ptr<float[]> ts(new float[n]);
  // x's rows of the step rounded to int8 (+ 128), each by the thread of its shrink tile
  const int64_t in_padded = (in + 63) / 64 * 64;
  std::unique_ptr<uint8_t[]> xq(new uint8_t[n * in_padded]);
  std::unique_ptr<float[]> xs(new float[n]);
  const auto shrink = tiles_of(starts, groups, kShrinkRows);
  const auto expand = tiles_of(starts, groups, kExpandRows);
  const int64_t blocks = (out + 15) / 16;
  const int64_t per_adapter = ranges[3 * blocks - 1] +
                              (ranges[3 * blocks - 2] - ranges[3 * blocks - 3] + 3) / 4;
  const int64_t shrink_items = static_cast<int64_t>(shrink.size());
  const auto spans = spans_of(ranges, blocks);
  const int64_t nspans = static_cast<int64_t>(spans.size());
  const int64_t expand_items = static_cast<int64_t>(expand.size()) * nspans;
  // a shrink item is a tile's rows over every rank, so that the thread that computed a row's
  // t rounds it for the expand at once: one barrier per call
  const auto shrink_item = [&](int64_t w) {
    const Tile& tile = shrink[w];
    const uint8_t* xr[kShrinkRows];
    for (int64_t i = 0; i < tile.n; ++i) {
      const int64_t e = tile.first + i;
      xs[e] = quantize_x(x + rows[e] * x_stride, in, xq.get() + e * in_padded);
      xr[i] = xq.get() + e * in_padded;
    }
    const int64_t quads = (in + 3) / 4;
    for (int64_t r0 = 0; r0 < ranks; r0 += 32) {   // two vectors of ranks at a time
      const int8_t* ag = a + (tile.g * quads * ranks + r0) * 4;
      const float* sa = a_scales + tile.g * 2 * ranks + r0;
      float* tt = t.get() + tile.first * ld + r0;
      with_rows<kShrinkRows>(tile.n, [&](auto nr) {
        constexpr int NR = decltype(nr)::value;
        if (ranks - r0 >= 32) {
          shrink_tile<NR, 2>(xr, xs.get() + tile.first, ag, quads, ranks, sa, sa + ranks, tt,
                             ld);
        } else {
          shrink_tile<NR, 1>(xr, xs.get() + tile.first, ag, quads, ranks, sa, sa + ranks, tt,
                             ld);
        }
      });
    }
    for (int64_t i = tile.first; i < tile.first + tile.n; ++i) {
      quantize_t(t.get(), ld, ranks, i, tq.get(), ts.get());
    }
  };
  const auto expand_item = [&](int64_t w) {
    const Tile& tile = expand[w / nspans];
    const Span& span = spans[w % nspans];
    if (w + kExpandAhead < expand_items) {
      const Span& next = spans[(w + kExpandAhead) % nspans];
      const int64_t g = expand[(w + kExpandAhead) / nspans].g;
      simd::prefetch_bytes(b + (g * per_adapter + next.offset) * 64,
                           next.blocks * next.quads * 64);
    }
    uint16_t* ys[kExpandRows];
    for (int64_t i = 0; i < tile.n; ++i) ys[i] = y + rows[tile.first + i] * y_stride;
    const uint8_t* tt = tq.get() + tile.first * ld + span.r0;
    const float* tscale = ts.get() + tile.first;
    const int8_t* bc = b + (tile.g * per_adapter + span.offset) * 64;
    const float* bs = b_scales + tile.g * 2 * out;
    with_rows<kExpandRows>(tile.n, [&](auto nr) {
      constexpr int NR = decltype(nr)::value;
      if (span.blocks == 2) {
        expand_tile<NR, 2>(ys, tt, ld, tscale, bc, span.quads, bs, span.c0, out);
      } else {
        expand_tile<NR, 1>(ys, tt, ld, tscale, bc, span.quads, bs, span.c0, out);
      }
    });
  };
#pragma omp parallel num_threads(at::get_num_threads())
  {
#pragma omp for schedule(static)
    for (int64_t w = 0; w < shrink_items; ++w) shrink_item(w);
#pragma omp for schedule(static)
    for (int64_t w = 0; w < expand_items; ++w) expand_item(w);
  }
}

void check_lora_factors(const at::Tensor& rows, const at::Tensor& starts, const at::Tensor& a,
                        const at::Tensor& a_scales, const at::Tensor& b,
                        const at::Tensor& b_scales, const at::Tensor& ranges, int64_t out) {
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.is_contiguous(),
              "lora: rows must be contiguous 1-D int64");
  TORCH_CHECK(starts.scalar_type() == at::kLong && starts.dim() == 1 && starts.is_contiguous()
                  && starts.numel() >= 1,
              "lora: starts must be contiguous 1-D int64 [adapters + 1]");
  const int64_t groups = starts.numel() - 1;
  TORCH_CHECK(starts.data_ptr<int64_t>()[groups] == rows.numel(),
              "lora: starts must end at the number of rows");
  TORCH_CHECK(a.scalar_type() == at::kChar && a.dim() == 4 && a.is_contiguous() &&
                  a.size(0) == groups && a.size(2) % 16 == 0 && a.size(3) == 4,
              "lora: A must be contiguous [adapters, ceil(in / 4), R, 4] int8, R % 16 == 0");
  TORCH_CHECK(a_scales.scalar_type() == at::kFloat && a_scales.is_contiguous() &&
                  a_scales.numel() == groups * 2 * a.size(2),
              "lora: A's scales must be contiguous [adapters, 2, R] float32");
  const int64_t blocks = (out + 15) / 16;
  TORCH_CHECK(ranges.scalar_type() == at::kInt && ranges.is_contiguous() &&
                  ranges.numel() == 3 * blocks,
              "lora: ranges must be contiguous [ceil(out / 16), 3] int32");
  const int32_t* r = ranges.data_ptr<int32_t>();
  int64_t quads = 0;
  for (int64_t c = 0; c < blocks; ++c) {
    TORCH_CHECK(0 <= r[3 * c] && r[3 * c] <= r[3 * c + 1] && r[3 * c + 1] <= a.size(2) &&
                    r[3 * c + 2] == quads,
                "lora: block ", c, "'s ranks must lie in R and its quads follow the last's");
    quads += (r[3 * c + 1] - r[3 * c] + 3) / 4;
  }
  TORCH_CHECK(b.scalar_type() == at::kChar && b.dim() == 3 && b.is_contiguous() &&
                  b.size(0) == groups && b.size(1) == quads && b.size(2) == 64,
              "lora: B must be contiguous [adapters, Q, 64] int8, Q the blocks' quads of ranks");
  TORCH_CHECK(b_scales.scalar_type() == at::kFloat && b_scales.is_contiguous() &&
                  b_scales.numel() == groups * 2 * out,
              "lora: B's scales must be contiguous [adapters, 2, out] float32");
}
#endif  // EMBER_INT8_DOT

void lora_add(at::Tensor& y, const at::Tensor& x, const at::Tensor& rows,
              const at::Tensor& starts, const at::Tensor& a, const at::Tensor& a_scales,
              const at::Tensor& b, const at::Tensor& b_scales, const at::Tensor& ranges) {
#ifdef EMBER_INT8_DOT
  check_bf16_rows(x);
  check_bf16_rows(y);
  check_lora_factors(rows, starts, a, a_scales, b, b_scales, ranges, y.size(1));
  TORCH_CHECK((x.size(1) + 3) / 4 == a.size(1) && x.size(0) == y.size(0),
              "lora: x [T, in] and y [T, out] must fit A [G, ceil(in / 4), R, 4]");
  const int64_t* r = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows.numel(); ++i) {
    TORCH_CHECK(r[i] >= 0 && r[i] < x.size(0), "lora: a row is outside x");
  }
  lora_add_impl(reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()), y.stride(0),
                reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), x.stride(0), r,
                starts.data_ptr<int64_t>(), starts.numel() - 1,
                a.data_ptr<int8_t>(), a_scales.data_ptr<float>(), b.data_ptr<int8_t>(),
                b_scales.data_ptr<float>(), ranges.data_ptr<int32_t>(), a.size(2), x.size(1),
                y.size(1));
#else
  TORCH_CHECK(false, "lora_add needs the AVX-512 VNNI kernels; use the torch path");
#endif
}

}  // namespace ember

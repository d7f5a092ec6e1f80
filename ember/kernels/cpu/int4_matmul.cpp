// Linears on int4 weights (GGUF's Q4_1: a scale and a minimum per group of 32 inputs) for
// decode-sized batches, on AVX-512 BF16 dot products: the step is bound by reading the
// weights, and each thread streams its share of the panels, asking for the next ones (and
// for the weight multiplied next) ahead of their use.
// Layout: x [m, k] bfloat16 (rows may be strided); the weight as pack_int4_panels makes it,
// q [n / 16, k / 32, 8, 32] uint8 and scale_min [n / 16, k / 32, 2, 16] float16 (below).
// Reference: x @ (q * scale + min).T in float32, rounded to bfloat16 (ember/quant, the int4
// formats' dequantized weight; tests/reference/test_cpu_kernels.py).
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "common.h"
#include "vec.h"

namespace ember {

#ifdef EMBER_BF16_DOT
// int4 weights in groups of 32 inputs, w[n, k] = q[n, k] * scale[n, g] + min[n, g] with
// q in 0..15 and g = k / 32 (GGUF's Q4_1), for decode-sized batches (a few input rows: the
// step is bound by reading the weights, 4.5 bits each here). Per panel of 16 rows and group:
//   q: 8 x 32 bytes; byte i of chunk c holds operand 2c's lane i (low nibble) and operand
//      2c + 1's (high nibble), operand t being rows x inputs 2t, 2t + 1 pair-interleaved;
//   scale, min: 16 float16 each (GGUF's own precision for them: Q4_0 and Q4_1 stay exact).
// A nibble q becomes the bfloat16 operand 128 + q by two bitwise ops (exact), the group's sum
// of x . (128 + q) is taken on bfloat16 dot products, and scale and min are applied once per
// group:
//   y[n] = sum_g scale[n, g] * (x_g . (128 + q[n, g])) + (min[n, g] - 128 scale[n, g]) sum(x_g).
namespace int4w {

// (kPanel, kGroupK, kAhead and Next: common.h)
namespace {

// R input rows against one panel: 4 chains of dot products per row (each operand half's
// products over the group's even and odd chunks apart), enough to hide the instruction's
// latency even at one row. Every row is summed in the same order whatever R is, so a row's
// output does not depend on the rows beside it: a step that verifies speculative drafts
// (several rows of one request) computes each row as a one-row decode step would, bit for bit.
// While they run, `ahead` panels at pf_q / pf_sm are prefetched, a group's share per group:
// the weights stream from DRAM (they do not fit in cache), and the hardware prefetcher alone
// leaves a step's weight reads at ~30 GB/s where a plain read reaches ~50-70. Into L2 (T1),
// not L1 (32 KB here; the decode stack at one row 0.97x the time, paired, docs/benchmarks.md).
template <int R>
void panel_rows(const uint16_t* x, int64_t x_stride, const float* xsum, int64_t groups,
                const uint8_t* q, const uint16_t* sm, uint16_t* out, int64_t out_stride,
                const char* pf_q, const char* pf_sm, int64_t ahead) {
  // bfloat16 0x4300 | q is exactly 128 + q (7 mantissa bits, exponent 7): two bitwise ops
  // make an operand, and the group's 128 * sum(x) comes off with the minimum below
  const __m512i low = _mm512_set1_epi16(0x0F), bias = _mm512_set1_epi16(0x4300);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t i = 0; i < ahead * 4; ++i) {
      _mm_prefetch(pf_q + (g * ahead * 4 + i) * 64, _MM_HINT_T1);
    }
    for (int64_t i = 0; i < ahead; ++i) _mm_prefetch(pf_sm + (g * ahead + i) * 64, _MM_HINT_T1);
    // chains: the even chunks' and the odd chunks' products, per operand half
    __m512 even0[R], even1[R], odd0[R], odd1[R];
    for (int r = 0; r < R; ++r) {
      even0[r] = even1[r] = odd0[r] = odd1[r] = _mm512_setzero_ps();
    }
    auto chunk = [&](int c, __m512* even, __m512* odd) __attribute__((always_inline)) {
      const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(q + (g * 8 + c) * 32)));
      // (w & low) | bias, and (w >> 4) | bias
      const __m512bh b0 = simd::as_bh(_mm512_ternarylogic_epi32(w, low, bias, 0xEA));
      const __m512bh b1 = simd::as_bh(_mm512_or_si512(_mm512_srli_epi16(w, 4), bias));
      for (int r = 0; r < R; ++r) {
        const uint16_t* xr = x + r * x_stride + g * kGroupK + 4 * c;
        even[r] = _mm512_dpbf16_ps(even[r], simd::pair_of(xr), b0);
        odd[r] = _mm512_dpbf16_ps(odd[r], simd::pair_of(xr + 2), b1);
      }
    };
    for (int c = 0; c < 8; c += 2) {
      chunk(c, even0, odd0);
      chunk(c + 1, even1, odd1);
    }
    const c10::Half* group_sm = reinterpret_cast<const c10::Half*>(sm + g * 2 * kPanel);
    const __m512 scale = simd::load16(group_sm);
    const __m512 min = _mm512_fnmadd_ps(_mm512_set1_ps(128.f), scale,  // min - 128 scale
                                        simd::load16(group_sm + kPanel));
    for (int r = 0; r < R; ++r) {
      const __m512 sum = _mm512_add_ps(_mm512_add_ps(even0[r], even1[r]),
                                       _mm512_add_ps(odd0[r], odd1[r]));
      acc[r] = _mm512_fmadd_ps(sum, scale, acc[r]);
      acc[r] = _mm512_fmadd_ps(min, _mm512_set1_ps(xsum[r * groups + g]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    simd::store16(reinterpret_cast<c10::BFloat16*>(out + r * out_stride), acc[r]);
  }
}

// Rows at once: R x 4 chains and R accumulators, 27 of the 32 vector registers at 4 rows
constexpr int kTileRows = 4;

// Every row of x against panels [begin, end): per panel, its rows kTileRows at a time, so
// the panel is read from memory once and from L1 for the other tiles. A thread reads its
// panels as one stream (four panels side by side made four short streams that DRAM served
// at ~0.8x the rate: a batch-1 decode step 0.83x the time with one; docs/benchmarks.md).
void run_panels(const uint16_t* x, int64_t m, int64_t x_stride, const float* xsum,
                int64_t groups, const uint8_t* q, const uint16_t* sm, int64_t begin,
                int64_t end, uint16_t* out, int64_t n) {
  const int64_t panel_q = groups * 8 * 32, panel_sm = groups * 2 * kPanel;
  const int64_t first = std::min(kAhead, end - begin);  // nothing before them fetched these
  simd::prefetch_bytes(q + begin * panel_q, first * panel_q);
  simd::prefetch_bytes(sm + begin * panel_sm, first * panel_sm * 2);
  for (int64_t p = begin; p < end; ++p) {
    const int64_t ahead = p + kAhead < end ? 1 : 0;
    const char* pf_q = reinterpret_cast<const char*>(q + (p + kAhead) * panel_q);
    const char* pf_sm = reinterpret_cast<const char*>(sm + (p + kAhead) * panel_sm);
    for (int64_t r = 0; r < m; r += kTileRows) {
      with_rows<kTileRows>(m - r, [&](auto rows) {
        panel_rows<decltype(rows)::value>(x + r * x_stride, x_stride, xsum + r * groups,
                                          groups, q + p * panel_q, sm + p * panel_sm,
                                          out + r * n + p * kPanel, n, pf_q, pf_sm,
                                          r == 0 ? ahead : 0);
      });
    }
  }
}

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

}  // namespace

// prefetch_next_share, matmul and matmul_share: common.h says what they compute
void prefetch_next_share(const Next& next, int64_t from, int64_t upto, int thread,
                         int threads) {
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

namespace {

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

}  // namespace

void matmul(const uint16_t* x, int64_t m, int64_t x_stride, const uint8_t* q,
            const uint16_t* sm, int64_t n, int64_t k, uint16_t* out, const Next& next) {
  const auto xsum = group_sums(x, m, x_stride, k / kGroupK);
  at::parallel_for(0, n / kPanel, kGrain, [&](int64_t begin, int64_t end) {
    run_panels(x, m, x_stride, xsum.data(), k / kGroupK, q, sm, begin, end, out, n);
    if (next.q != nullptr) prefetch_next_share(next);
  });
}

void matmul_share(const uint16_t* x, int64_t m, int64_t x_stride, const uint8_t* q,
                  const uint16_t* sm, int64_t n, int64_t k, uint16_t* out, const Next& next,
                  int thread, int threads) {
  const auto [begin, end] = share_of(n / kPanel, threads, thread);
  if (begin < end) {
    const auto xsum = group_sums(x, m, x_stride, k / kGroupK);
    run_panels(x, m, x_stride, xsum.data(), k / kGroupK, q, sm, begin, end, out, n);
  }
  if (next.q != nullptr) prefetch_next_share(next, 0, kAhead, thread, threads);
}

}  // namespace int4w
#endif  // EMBER_BF16_DOT

// int4_linear(x [m, k] bfloat16 (rows may be strided), q [n / 16, k / 32, 8, 32] uint8,
// scale_min [n / 16, k / 32, 2, 16] float16) -> [m, n] bfloat16 = x w^T, w as int4w's above.
// Meant for a few rows (decode); correct for any. Only with AVX-512 BF16.
at::Tensor int4_linear(at::Tensor x, at::Tensor q, at::Tensor scale_min) {
  TORCH_CHECK(has_bf16_dot(), "int4_linear needs a CPU with AVX-512 BF16");
  check_bf16_rows(x);
  check_int4_panels(q, scale_min);
  const int64_t m = x.size(0), k = x.size(1), n = q.size(0) * 16;
  TORCH_CHECK(q.size(1) * 32 == k, "x has ", k, " inputs, the weight ", q.size(1) * 32);
  auto out = at::empty({m, n}, x.options());
#ifdef EMBER_BF16_DOT
  if (m > 0) {
    int4w::matmul(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), m,
                  x.stride(0), q.data_ptr<uint8_t>(),
                  reinterpret_cast<const uint16_t*>(scale_min.data_ptr<at::Half>()), n, k,
                  reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()));
  }
#endif
  return out;
}

}  // namespace ember

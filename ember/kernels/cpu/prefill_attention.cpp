// Attention of a prompt chunk (the last n of a request's seq_len cached tokens, written
// first) over its context in the paged KV cache, causal, flash-attention style on AVX-512
// BF16 dot products, for heads of 64 and 128; over a bfloat16 cache or an int8 one (its rows
// made bfloat16, value * scale, as they are read).
// Layout: q [n, heads, d] (rows may be strided, each row's heads contiguous), kv [2,
// kv_heads, blocks, block_size, d] (kv_cache.h), block_table [>= ceil(seq_len / block_size)].
// Reference: ember/models/attention.py's gathered matmul attention (_matmul_attention) with
// its causal mask, over PagedKV's rows.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common.h"
#include "kv_cache.h"
#include "vec.h"

namespace ember {

#ifdef EMBER_BF16_DOT
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

namespace {

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

}  // namespace

// prefill_attention_impl: common.h says what it computes
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

template void prefill_attention_impl<64>(const uint16_t*, int64_t, const void*, const at::Half*,
                                         const int64_t*, int64_t, uint16_t*, int64_t, int64_t,
                                         int64_t, int64_t, int64_t, float);
template void prefill_attention_impl<128>(const uint16_t*, int64_t, const void*,
                                          const at::Half*, const int64_t*, int64_t, uint16_t*,
                                          int64_t, int64_t, int64_t, int64_t, int64_t, float);

}  // namespace prefill
#endif  // EMBER_BF16_DOT

// prefill_attention(q [n, heads, d] bfloat16 (rows may be strided), kv [2, kv_heads, blocks,
// block_size, d] bfloat16, block_table [>= ceil(seq_len / block_size)] int64, seq_len, scale)
// -> [n, heads, d]: the request's n new tokens, the last n of its seq_len cached tokens (write
// them first), attend causally over its context. d is 64 or 128; only with AVX-512 BF16.
at::Tensor prefill_attention(at::Tensor q, at::Tensor kv, at::Tensor block_table,
                             int64_t seq_len, double scale,
                             c10::optional<at::Tensor> kv_scale) {
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
  auto out = at::empty({n, heads, d}, q.options());
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

}  // namespace ember

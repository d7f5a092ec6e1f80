// Attention of a prompt chunk (the last n of a request's seq_len cached tokens, written
// first) over its context in the paged KV cache, causal, flash-attention style on AVX-512
// BF16 dot products, for heads of 64 and 128; over a bfloat16 cache or an int8 one (its rows
// made bfloat16, value * scale, as they are read).
// Layout: q [n, heads, d] (rows may be strided, each row's heads contiguous), kv [2,
// kv_heads, blocks, block_size, d] (kv_cache.h), block_table [>= ceil(seq_len / block_size)].
// Several chunks of one step attend in one call (prefill_chunks_impl); chunks whose block
// tables begin with the same cached blocks (a prefix-cache hit on one prompt prefix) read
// those keys from one packed copy, laid out once for all of them, instead of one each.
// Reference: ember/models/attention.py's gathered matmul attention (_matmul_attention) with
// its causal mask, over PagedKV's rows; a chunk's output does not depend on the chunks
// beside it (the same arithmetic, bit for bit, as it alone).
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
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

// Copy one KV head's keys from..len-1 (K or V, as `rows` walks) out of their blocks,
// zero-padded to `len_pad`, into the layouts above (from and len_pad multiples of
// kKeyBlock; key `from` lands at dst).
// (An int8 cache's rows are made bfloat16 on the way: `Walk` is RowWalk or ScaledWalk.)
template <class Walk>
void pack_keys(Walk rows, int64_t from, int64_t len, int64_t len_pad, uint16_t* dst) {
  const int64_t d = rows.d, pairs = d / 2;
  alignas(64) uint16_t buf[kMaxHeadDim];
  for (int64_t j = from; j < len_pad; ++j) {
    const int64_t at = j - from;
    uint32_t* col = reinterpret_cast<uint32_t*>(dst + (at / 16) * d * 16) + at % 16;
    if (j < len) {
      const uint16_t* k = rows.bf16_row(j, buf);
      for (int64_t t = 0; t < pairs; ++t) std::memcpy(col + t * 16, k + 2 * t, 4);
    } else {
      for (int64_t t = 0; t < pairs; ++t) col[t * 16] = 0;
    }
  }
}

template <class Walk>
void pack_values(Walk rows, int64_t from, int64_t len, int64_t len_pad, uint16_t* dst) {
  const int64_t d = rows.d;
  alignas(64) uint16_t buf[kMaxHeadDim];
  for (int64_t j = from; j < len_pad; ++j) {
    const int64_t at = j - from;
    uint16_t* out = dst + (at / 2) * 2 * d + at % 2;
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

// One KV head's packed keys and values: keys 0 .. split - 1 from (k0, v0), the rest from
// (k1, v1), key `split` at their start (split a multiple of kKeyBlock; 0: all from k1, v1).
struct PackedKeys {
  const uint16_t *k0, *v0;
  int64_t split;
  const uint16_t *k1, *v1;
  // both layouts hold D values per key: key j of a run starts at j * D
  const uint16_t* k(int64_t key, int64_t d) const {
    return key < split ? k0 + key * d : k1 + (key - split) * d;
  }
  const uint16_t* v(int64_t key, int64_t d) const {
    return key < split ? v0 + key * d : v1 + (key - split) * d;
  }
};

// R query rows (q: [R][D] bfloat16) over packed K/V; row r sees keys [0, visible[r]).
// Writes the normalised outputs, float32, to o [R][D].
template <int R, int D>
void attend_rows(const uint16_t* q, const int64_t* visible, const PackedKeys& keys,
                 float scale, float* o) {
  constexpr int DV = D / 16;
  float m[R], l[R];
  alignas(64) float corr[16];
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
    score_block<R, D>(q, keys.k(k0, D), s);
    const bool masked = k0 + kKeyBlock > kmin;
    alignas(64) float shift[16] = {};   // per row: old max - new max (0 past R)
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
      shift[r] = k0 == 0 ? 0.f : m[r] - m_new;   // (the first block rescales nothing)
      m[r] = m_new;
    }
    // the rows' rescaling of earlier sums, exp(old max - new max), in one vector
    _mm512_store_ps(corr, exp_nonpositive16(_mm512_load_ps(shift)));
    for (int r = 0; r < R; ++r) {
      __m512 sum = _mm512_setzero_ps();
      for (int c = 0; c < 4; ++c) {
        s[r][c] = exp_nonpositive16<4>(   // the probabilities are rounded to bfloat16
            _mm512_sub_ps(s[r][c], _mm512_set1_ps(m[r])));
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
    const uint16_t* vb = keys.v(k0, D);  // k0 / 2 pairs of 2 * D values
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

// Chunks whose tables begin with the same cached blocks of one cache: each group's shared
// keys (a multiple of kKeyBlock), packed once for its members. A chunk joins the first group
// whose leader's table starts as its own, where they share at least kKeyBlock keys of
// context (keys cached before the step); the group then keeps the blocks all its members
// share.
struct SharedPrefixes {
  std::vector<int64_t> group_of;  // per chunk: its group, or -1 (no shared keys)
  std::vector<int64_t> leader;    // per group: the chunk whose table and cache it reads
  std::vector<int64_t> keys;      // per group: its shared keys
};

SharedPrefixes share_prefixes(const ChunkRef* chunks, int64_t count) {
  SharedPrefixes out{std::vector<int64_t>(count, -1), {}, {}};
  std::vector<int64_t> blocks, members;
  for (int64_t c = 0; c < count; ++c) {
    const ChunkRef& x = chunks[c];
    const int64_t context = (x.seq_len - x.n) / x.block_size;  // whole cached blocks
    for (size_t g = 0; g < blocks.size() && context > 0; ++g) {
      const ChunkRef& lead = chunks[out.leader[g]];
      if (lead.kv != x.kv || lead.kv_scale != x.kv_scale || lead.block_size != x.block_size ||
          lead.table[0] != x.table[0]) {
        continue;
      }
      int64_t common = 0;
      const int64_t most = std::min(blocks[g], context);
      while (common < most && lead.table[common] == x.table[common]) ++common;
      if (common * x.block_size < kKeyBlock) continue;
      blocks[g] = common;
      members[g] += 1;
      out.group_of[c] = static_cast<int64_t>(g);
      break;
    }
    if (out.group_of[c] < 0 && context > 0) {   // a group of its own, shared if others join
      out.group_of[c] = static_cast<int64_t>(blocks.size());
      out.leader.push_back(c);
      blocks.push_back(context);
      members.push_back(1);
    }
  }
  for (size_t g = 0; g < blocks.size(); ++g) {
    const int64_t keys = blocks[g] * chunks[out.leader[g]].block_size / kKeyBlock * kKeyBlock;
    out.keys.push_back(members[g] > 1 ? keys : 0);
  }
  return out;
}

// Copying keys from..len-1 of one KV head's K or V (padded to len_pad) into dst
struct PackTask {
  const ChunkRef* chunk;
  int64_t head, from, len, len_pad;
  bool values;
  uint16_t* dst;
};

template <int D>
void run_pack(const PackTask& t, int64_t kv_heads) {
  const ChunkRef& c = *t.chunk;
  const int64_t head_stride = c.num_blocks * c.block_size * D;
  const int64_t which = t.values ? 1 : 0;
  const int64_t offset = (which * kv_heads + t.head) * head_stride;
  auto pack = [&](auto rows) {
    if (t.values) {
      pack_values(rows, t.from, t.len, t.len_pad, t.dst);
    } else {
      pack_keys(rows, t.from, t.len, t.len_pad, t.dst);
    }
  };
  if (c.kv_scale != nullptr) {
    pack(ScaledWalk{static_cast<const int8_t*>(c.kv) + offset,
                    c.kv_scale + (which * kv_heads + t.head) * c.num_blocks * c.block_size,
                    c.table, c.block_size, D});
  } else {
    pack(RowWalk{static_cast<const uint16_t*>(c.kv) + offset, c.table, c.block_size, D});
  }
}

// Tiles tile .. tile + kTilesPerTask - 1 of one chunk's rows of KV head `head`
struct AttendTask {
  int64_t chunk, head, tile, cost;
};
constexpr int64_t kTilesPerTask = 4;

template <int D>
void run_attend(const AttendTask& t, const ChunkRef& c, const PackedKeys& keys,
                int64_t heads, int64_t kv_heads, float scale) {
  constexpr int R = kTileRows<D>;
  const int64_t per_kv = heads / kv_heads, rows = c.n * per_kv;
  const int64_t tiles = (rows + R - 1) / R;
  alignas(64) uint16_t qt[R * D];
  alignas(64) float ot[R * D];
  int64_t visible[R];
  for (int64_t tile = t.tile; tile < std::min(tiles, t.tile + kTilesPerTask); ++tile) {
    const int64_t r0 = tile * R;   // per KV head: row = token * per_kv + member
    const int count = static_cast<int>(std::min<int64_t>(R, rows - r0));
    for (int r = 0; r < count; ++r) {
      const int64_t token = (r0 + r) / per_kv, head = t.head * per_kv + (r0 + r) % per_kv;
      std::memcpy(qt + r * D, c.q + token * c.q_stride + head * D, D * sizeof(uint16_t));
      visible[r] = c.seq_len - c.n + token + 1;
    }
    with_rows<R>(count, [&](auto rows) {
      attend_rows<decltype(rows)::value, D>(qt, visible, keys, scale, ot);
    });
    for (int r = 0; r < count; ++r) {
      const int64_t token = (r0 + r) / per_kv, head = t.head * per_kv + (r0 + r) % per_kv;
      auto* dst = reinterpret_cast<c10::BFloat16*>(c.out + (token * heads + head) * D);
      for (int i = 0; i < D; i += 16) store16(dst + i, _mm512_loadu_ps(ot + r * D + i));
    }
  }
}

int64_t padded(int64_t keys) { return (keys + kKeyBlock - 1) / kKeyBlock * kKeyBlock; }

// the most packed K and V one call holds at once, unless a single chunk needs more
constexpr int64_t kMaxPackedBytes = 64 << 20;

}  // namespace

// prefill_chunks_impl: common.h says what it computes. Two parallel regions for the whole
// step: the packing (each shared prefix once, then each chunk's keys past it), then the
// attention, a task per chunk, KV head and kTilesPerTask tiles, the costliest first.
template <int D>
void prefill_chunks_impl(const ChunkRef* chunks, int64_t count, int64_t heads,
                         int64_t kv_heads, float scale) {
  constexpr int R = kTileRows<D>;
  // the packed copies of all the chunks live at once: many long contexts go in halves
  int64_t bytes = 0;
  for (int64_t c = 0; c < count; ++c) bytes += 4 * kv_heads * padded(chunks[c].seq_len) * D;
  if (count > 1 && bytes > kMaxPackedBytes) {
    prefill_chunks_impl<D>(chunks, count / 2, heads, kv_heads, scale);
    prefill_chunks_impl<D>(chunks + count / 2, count - count / 2, heads, kv_heads, scale);
    return;
  }
  const SharedPrefixes shared = share_prefixes(chunks, count);
  auto shared_keys = [&](int64_t c) {
    return shared.group_of[c] < 0 ? 0 : shared.keys[shared.group_of[c]];
  };
  // one buffer: per shared group its keys, then per chunk its own, K and V for each KV head
  std::vector<int64_t> group_at(shared.keys.size()), chunk_at(count);
  int64_t total = 0;
  for (size_t g = 0; g < shared.keys.size(); ++g) {
    group_at[g] = total;
    total += 2 * kv_heads * shared.keys[g] * D;
  }
  for (int64_t c = 0; c < count; ++c) {
    chunk_at[c] = total;
    total += 2 * kv_heads * (padded(chunks[c].seq_len) - shared_keys(c)) * D;
  }
  std::unique_ptr<uint16_t[]> buffer(new uint16_t[total]);   // every element is written
  std::vector<PackTask> packs;
  for (int64_t h = 0; h < kv_heads; ++h) {
    for (const bool values : {false, true}) {
      for (size_t g = 0; g < shared.keys.size(); ++g) {
        const int64_t keys = shared.keys[g];
        if (keys == 0) continue;
        packs.push_back({&chunks[shared.leader[g]], h, 0, keys, keys, values,
                         buffer.get() + group_at[g] + ((values ? kv_heads : 0) + h) * keys * D});
      }
      for (int64_t c = 0; c < count; ++c) {
        const int64_t from = shared_keys(c), len_pad = padded(chunks[c].seq_len);
        packs.push_back({&chunks[c], h, from, chunks[c].seq_len, len_pad, values,
                         buffer.get() + chunk_at[c] +
                             ((values ? kv_heads : 0) + h) * (len_pad - from) * D});
      }
    }
  }
  std::stable_sort(packs.begin(), packs.end(), [](const PackTask& a, const PackTask& b) {
    return a.len_pad - a.from > b.len_pad - b.from;
  });
  const int threads = at::get_num_threads();
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (size_t i = 0; i < packs.size(); ++i) run_pack<D>(packs[i], kv_heads);

  std::vector<AttendTask> tasks;
  const int64_t per_kv = heads / kv_heads;
  for (int64_t c = 0; c < count; ++c) {
    const int64_t tiles = (chunks[c].n * per_kv + R - 1) / R;
    for (int64_t tile = 0; tile < tiles; tile += kTilesPerTask) {
      // keys seen by its last token, times its tiles
      const int64_t last = std::min(chunks[c].n - 1, (tile + kTilesPerTask) * R / per_kv);
      const int64_t cost = (chunks[c].seq_len - chunks[c].n + last + 1) *
                           std::min(kTilesPerTask, tiles - tile);
      for (int64_t h = 0; h < kv_heads; ++h) {
        if (!(chunks[c].skip >> h & 1)) tasks.push_back({c, h, tile, cost});
      }
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(),
                   [](const AttendTask& a, const AttendTask& b) { return a.cost > b.cost; });
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (size_t i = 0; i < tasks.size(); ++i) {
    const AttendTask& t = tasks[i];
    const int64_t split = shared_keys(t.chunk);
    const int64_t own = padded(chunks[t.chunk].seq_len) - split;
    const uint16_t* mine = buffer.get() + chunk_at[t.chunk];
    PackedKeys keys{nullptr, nullptr, split, mine + t.head * own * D,
                    mine + (kv_heads + t.head) * own * D};
    if (split > 0) {
      const uint16_t* group = buffer.get() + group_at[shared.group_of[t.chunk]];
      keys.k0 = group + t.head * split * D;
      keys.v0 = group + (kv_heads + t.head) * split * D;
    }
    run_attend<D>(t, chunks[t.chunk], keys, heads, kv_heads, scale);
  }
  for (int64_t c = 0; c < count; ++c) {   // the heads left to another rank: no tasks above
    zero_skipped_heads(chunks[c].out, heads * D * sizeof(uint16_t), chunks[c].n,
                       chunks[c].skip, heads, kv_heads, D * sizeof(uint16_t));
  }
}

template void prefill_chunks_impl<64>(const ChunkRef*, int64_t, int64_t, int64_t, float);
template void prefill_chunks_impl<128>(const ChunkRef*, int64_t, int64_t, int64_t, float);


}  // namespace prefill
#endif  // EMBER_BF16_DOT

namespace {

// The checks both bindings make of q [T, heads, d] and the cache
void check_prefill_inputs(const at::Tensor& q, const at::Tensor& kv,
                          const c10::optional<at::Tensor>& kv_scale) {
  TORCH_CHECK(has_bf16_dot(), "prefill_attention needs a CPU with AVX-512 BF16");
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 3 && q.stride(2) == 1 &&
                  q.stride(1) == q.size(2),
              "q must be [n, heads, d] on the CPU, each row's heads contiguous");
  if (kv_scale.has_value()) check_int8_cache(kv, *kv_scale);
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 &&
                  (kv_scale.has_value() || kv.scalar_type() == at::kBFloat16),
              "prefill_attention runs on bfloat16 q and a bfloat16 (or int8) kv");
  TORCH_CHECK(kv.dim() == 5 && kv.is_contiguous(), "kv must be a contiguous 5-D cache");
  const int64_t heads = q.size(1), d = q.size(2);
  TORCH_CHECK(kv.size(4) == d && heads % kv.size(1) == 0 && (d == 64 || d == 128),
              "head sizes do not match (or head_dim is not 64 or 128)");
}

// One chunk's block table, checked against its seq_len and n new tokens
const int64_t* checked_table(const at::Tensor& block_table, int64_t seq_len, int64_t n,
                             const at::Tensor& kv) {
  const int64_t num_blocks = kv.size(2), block_size = kv.size(3);
  TORCH_CHECK(block_table.scalar_type() == at::kLong && block_table.is_contiguous() &&
                  block_table.dim() == 1,
              "block_table must be [blocks] contiguous int64");
  TORCH_CHECK(seq_len >= n && n >= 1 && seq_len <= block_table.size(0) * block_size,
              "seq_len must cover the new tokens and fit the block table");
  const int64_t* table = block_table.data_ptr<int64_t>();
  check_block_ids(table, seq_len, block_size, num_blocks);
  return table;
}

#ifdef EMBER_BF16_DOT
void run_chunks(const std::vector<prefill::ChunkRef>& chunks, const at::Tensor& q,
                const at::Tensor& kv, double scale) {
  const auto impl = q.size(2) == 64 ? prefill::prefill_chunks_impl<64>
                                    : prefill::prefill_chunks_impl<128>;
  impl(chunks.data(), static_cast<int64_t>(chunks.size()), q.size(1), kv.size(1),
       static_cast<float>(scale));
}
#endif

}  // namespace

// prefill_attention(q [n, heads, d] bfloat16 (rows may be strided), kv [2, kv_heads, blocks,
// block_size, d] bfloat16, block_table [>= ceil(seq_len / block_size)] int64, seq_len, scale)
// -> [n, heads, d]: the request's n new tokens, the last n of its seq_len cached tokens (write
// them first), attend causally over its context. d is 64 or 128; only with AVX-512 BF16.
at::Tensor prefill_attention(at::Tensor q, at::Tensor kv, at::Tensor block_table,
                             int64_t seq_len, double scale,
                             c10::optional<at::Tensor> kv_scale) {
  check_prefill_inputs(q, kv, kv_scale);
  const int64_t n = q.size(0);
  const int64_t* table = checked_table(block_table, seq_len, n, kv);
  auto out = at::empty({n, q.size(1), q.size(2)}, q.options());
#ifdef EMBER_BF16_DOT
  run_chunks({prefill::ChunkRef{
                 reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>()), q.stride(0),
                 reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), n, seq_len,
                 kv.data_ptr(), kv_scale.has_value() ? kv_scale->data_ptr<at::Half>() : nullptr,
                 table, kv.size(2), kv.size(3)}},
             q, kv, scale);
#endif
  return out;
}

// prefill_attention_chunks(q [T, heads, d], kv, chunk_info [C, 3] int64 (each chunk's first
// row, new tokens, seq_len), block_tables [C] of [blocks] int64, scale, kv_scale, out [T,
// heads, d] contiguous): prefill_attention of each chunk (q rows first .. first + n - 1)
// into the same rows of out, in one call; chunks whose tables begin with the same blocks
// read those keys from one packed copy. Rows in no chunk are left as they are.
void prefill_attention_chunks(at::Tensor q, at::Tensor kv, at::Tensor chunk_info,
                              std::vector<at::Tensor> block_tables, double scale,
                              c10::optional<at::Tensor> kv_scale, at::Tensor out) {
  check_prefill_inputs(q, kv, kv_scale);
  TORCH_CHECK(out.sizes() == q.sizes() && out.is_contiguous() &&
                  out.scalar_type() == at::kBFloat16,
              "out must be contiguous bfloat16 of q's shape");
  TORCH_CHECK(chunk_info.scalar_type() == at::kLong && chunk_info.is_contiguous() &&
                  chunk_info.dim() == 2 && chunk_info.size(1) == 3 &&
                  chunk_info.size(0) == static_cast<int64_t>(block_tables.size()),
              "chunk_info must be [C, 3] contiguous int64, one row per block table");
#ifdef EMBER_BF16_DOT
  const int64_t* info = chunk_info.data_ptr<int64_t>();
  const int64_t rows = q.size(0), row = q.size(1) * q.size(2);
  std::vector<int> covered(rows, 0);
  std::vector<prefill::ChunkRef> chunks;
  for (size_t c = 0; c < block_tables.size(); ++c) {
    const int64_t first = info[3 * c], n = info[3 * c + 1], seq_len = info[3 * c + 2];
    TORCH_CHECK(first >= 0 && n >= 1 && first + n <= rows, "chunk ", c,
                ": its rows must lie in q");
    for (int64_t i = first; i < first + n; ++i) {
      TORCH_CHECK(++covered[i] == 1, "row ", i, " is in two chunks");
    }
    chunks.push_back(prefill::ChunkRef{
        reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>()) + first * q.stride(0),
        q.stride(0), reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()) + first * row,
        n, seq_len, kv.data_ptr(),
        kv_scale.has_value() ? kv_scale->data_ptr<at::Half>() : nullptr,
        checked_table(block_tables[c], seq_len, n, kv), kv.size(2), kv.size(3)});
  }
  run_chunks(chunks, q, kv, scale);
#endif
}

}  // namespace ember

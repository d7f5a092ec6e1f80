// Copies KV blocks between two caches of one layout (their block counts aside): for each
// tensor pair (src[t], dst[t]) and each run (s, d, n), dst[t][:, :, d:d+n] = src[t][:, :,
// s:s+n], as raw bytes. A cache's tensors are [2, kv_heads, blocks, ...] (bfloat16 values,
// or int8 values with float16 scales), so one block of one tensor is 2 * kv_heads pieces
// of a few dozen to a few thousand bytes; scattered blocks mean tens of thousands of small
// pieces per pull, which torch pays an op's dispatch for (or a gathered second pass), and
// here cost one memcpy each, with the GIL released.
// Layout: each tensor's block dim (2) and the dims after it packed (a run of blocks is one
// span of bytes per (dim 0, dim 1) index); dims 0 and 1 at any strides. Anything else is
// refused. One thread: a pull runs beside the engine's steps.
// Reference: ember/kv_transfer/blocks.py copy_blocks on the torch path, byte for byte
// (tests/unit/test_kv_blocks.py).
#include "kv_copy.h"

#include <ATen/MemoryOverlap.h>

#include <algorithm>
#include <cstring>

namespace ember {
namespace {

// Bytes of one block's piece at one (dim 0, dim 1) index; refuses a layout whose block dim
// and the dims after it are not packed.
int64_t piece_bytes(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() >= 3, name,
              " must be a CPU tensor [2, kv_heads, blocks, ...]");
  int64_t inner = 1;   // elements of one piece: the dims after the block dim, packed
  for (int64_t k = t.dim() - 1; k >= 2; --k) {
    TORCH_CHECK(t.size(k) == 1 || t.stride(k) == inner, name,
                "'s block dim and the dims after it must be packed (a cache's own tensors "
                "are; copy a view of one on the torch path)");
    if (k > 2) inner *= t.size(k);
  }
  return inner * static_cast<int64_t>(t.element_size());
}

void check_pair(const at::Tensor& s, const at::Tensor& d) {
  TORCH_CHECK(s.scalar_type() == d.scalar_type() && s.dim() == d.dim(),
              "src and dst tensors must pair up in dtype and rank");
  for (int64_t k = 0; k < s.dim(); ++k) {
    TORCH_CHECK(k == 2 || s.size(k) == d.size(k),
                "src and dst tensors must have one shape but for their block counts (dim 2)");
  }
  at::assert_no_internal_overlap(d);
  at::assert_no_overlap(d, s);
}

void check_runs(const int64_t* r, int64_t num_runs, int64_t src_blocks, int64_t dst_blocks) {
  for (int64_t i = 0; i < num_runs; ++i) {
    const int64_t s = r[3 * i], d = r[3 * i + 1], n = r[3 * i + 2];
    TORCH_CHECK(n >= 0 && s >= 0 && d >= 0 && s + n <= src_blocks && d + n <= dst_blocks,
                "a run of blocks (", s, ", ", d, ", ", n, ") is outside the caches (",
                src_blocks, " and ", dst_blocks, " blocks)");
  }
}

struct Piece {
  const char* from;
  char* to;
  int64_t bytes;
};

// Every run of one tensor pair as pieces, in order: per (dim 0, dim 1) index, one per run.
void list_pieces(const at::Tensor& s, const at::Tensor& d, const int64_t* r, int64_t num_runs,
                 int64_t piece, std::vector<Piece>& out) {
  const auto* src = static_cast<const char*>(s.data_ptr());
  auto* dst = static_cast<char*>(d.data_ptr());
  const int64_t size = s.element_size();
  out.clear();
  for (int64_t i = 0; i < s.size(0); ++i) {
    for (int64_t j = 0; j < s.size(1); ++j) {
      const char* from = src + (i * s.stride(0) + j * s.stride(1)) * size;
      char* to = dst + (i * d.stride(0) + j * d.stride(1)) * size;
      for (int64_t k = 0; k < num_runs; ++k) {
        out.push_back({from + r[3 * k] * piece, to + r[3 * k + 1] * piece, r[3 * k + 2] * piece});
      }
    }
  }
}

constexpr int64_t kLine = 64;
// How far the prefetches run ahead of the copy: scattered pieces are each a jump the
// hardware prefetcher does not follow (and, on 4 KiB pages, a TLB miss), so without them
// one core waits out a memory latency per piece (measured: every block scattered, ~1.3x
// faster with them; deeper than 8 KiB gained nothing)
constexpr int64_t kAheadBytes = 8192;

// The lines the prefetches have reached: piece `idx`, `offset` bytes into it.
struct Cursor {
  size_t idx = 0;
  int64_t offset = 0;
  int64_t total = 0;   // bytes prefetched so far
};

// Prefetch (source for reading, destination for writing) until `until` bytes are covered.
void prefetch_until(const std::vector<Piece>& pieces, Cursor& c, int64_t until) {
  while (c.idx < pieces.size() && c.total < until) {
    const Piece& p = pieces[c.idx];
    if (c.offset < p.bytes) {
      __builtin_prefetch(p.from + c.offset, 0);
      __builtin_prefetch(p.to + c.offset, 1);
    }
    c.offset += kLine;
    c.total += kLine;
    if (c.offset >= p.bytes) {
      // the piece's last line, where it ends past the lines stepped through
      if (p.bytes > 0) {
        __builtin_prefetch(p.from + p.bytes - 1, 0);
        __builtin_prefetch(p.to + p.bytes - 1, 1);
      }
      ++c.idx;
      c.offset = 0;
    }
  }
}

void copy_pieces(const std::vector<Piece>& pieces) {
  Cursor ahead;
  int64_t done = 0;
  for (const Piece& p : pieces) {
    prefetch_until(pieces, ahead, done + kAheadBytes);
    std::memcpy(p.to, p.from, p.bytes);
    done += std::max<int64_t>(p.bytes, kLine);
  }
}

}  // namespace

int64_t copy_kv_blocks(const std::vector<at::Tensor>& src, const std::vector<at::Tensor>& dst,
                       const at::Tensor& runs) {
  TORCH_CHECK(src.size() == dst.size(), "src and dst must list as many tensors");
  TORCH_CHECK(runs.device().is_cpu() && runs.scalar_type() == at::kLong && runs.dim() == 2 && runs.size(1) == 3 &&
                  runs.is_contiguous(),
              "runs must be contiguous int64 [n, 3]: (src start, dst start, length)");
  const int64_t* r = runs.data_ptr<int64_t>();
  const int64_t num_runs = runs.size(0);
  int64_t num_blocks = 0;
  for (int64_t k = 0; k < num_runs; ++k) num_blocks += r[3 * k + 2];
  std::vector<int64_t> pieces;
  int64_t block_bytes = 0;
  for (size_t t = 0; t < src.size(); ++t) {   // every check before the first byte moves
    check_pair(src[t], dst[t]);
    pieces.push_back(piece_bytes(src[t], "src"));
    TORCH_CHECK(piece_bytes(dst[t], "dst") == pieces.back(), "src and dst blocks differ");
    check_runs(r, num_runs, src[t].size(2), dst[t].size(2));
    block_bytes += src[t].size(0) * src[t].size(1) * pieces.back();
  }
  std::vector<Piece> list;
  for (size_t t = 0; t < src.size(); ++t) {
    list_pieces(src[t], dst[t], r, num_runs, pieces[t], list);
    copy_pieces(list);
  }
  return num_blocks * block_bytes;
}

}  // namespace ember

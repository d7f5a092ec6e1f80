// bfloat16 linears on ATen's batch-reduce GEMM (at::native::cpublas::brgemm, which ships inside
// torch): y = x w^T for prompt rows, the candidate `--prefill-matmul auto` calls
// "bfloat16-brgemm" (ember/engine/prefill_choice.py). Where oneDNN's brgemm ukernel runs
// (x86 with AMX: cpublas::could_pack(bfloat16)), each call is a tile-unit microkernel over a
// weight block packed once into the pairs it reads; elsewhere torch's brgemm falls back to a
// plain GEMM per block (correct, and no faster than oneDNN's whole matmul: it is then never
// offered as a candidate, only tested).
// Layout: x [m, k] bfloat16 (rows may be strided); w [n, k] bfloat16 with n % 32 == 0 and k
// even, made by brgemm_bf16_pack into blocks of kBlockN outputs: packed [n / 32, k, 32]
// (block j holds w[32 j : 32 j + 32, :]^T, as rows of k; re-laid in the ukernel's pairs of k
// where vnni). y [m, n] bfloat16, summed in float32.
// Reference: torch.nn.functional.linear(x.float(), w.float()).bfloat16()
// (tests/reference/test_cpu_kernels.py).
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "common.h"

namespace ember {
namespace {

constexpr int64_t kBlockN = 32;   // outputs per weight block (two AMX tiles' columns)
constexpr int64_t kBlockM = 32;   // rows per brgemm call

void check_packed(const at::Tensor& packed) {
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 3 &&
                  packed.size(2) == kBlockN && packed.is_contiguous(),
              "packed must be brgemm_bf16_pack's [n / 32, k, 32] bfloat16");
}

}  // namespace

bool brgemm_bf16_vnni() { return at::native::cpublas::could_pack(at::kBFloat16); }

at::Tensor brgemm_bf16_pack(at::Tensor w, bool vnni) {
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.dim() == 2 && w.is_contiguous(),
              "w must be contiguous [n, k] bfloat16");
  const int64_t n = w.size(0), k = w.size(1);
  TORCH_CHECK(n % kBlockN == 0 && k % 2 == 0, "brgemm needs outputs in 32s and even inputs, "
              "not [", n, ", ", k, "]");
  // block j as rows of k: [n / 32, k, 32]
  at::Tensor blocks = w.view({n / kBlockN, kBlockN, k}).transpose(1, 2).contiguous();
  if (!vnni) return blocks;
  TORCH_CHECK(brgemm_bf16_vnni(), "this CPU's brgemm takes no packed weights; pack with "
              "vnni=False");
  at::Tensor packed = at::empty_like(blocks);
  at::parallel_for(0, n / kBlockN, 1, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      at::native::cpublas::pack(k, kBlockN, kBlockN, kBlockN, at::kBFloat16, at::kBFloat16,
                                blocks[j].data_ptr(), packed[j].data_ptr());
    }
  });
  return packed;
}

at::Tensor brgemm_bf16_linear(at::Tensor x, at::Tensor packed, bool vnni) {
  check_packed(packed);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.stride(1) == 1 &&
                  x.size(1) == packed.size(1),
              "x must be [m, k] bfloat16 with unit column stride, k = the weight's");
  const int64_t m = x.size(0), k = x.size(1), blocks = packed.size(0);
  const int64_t ld_x = x.stride(0), n = blocks * kBlockN;
  at::Tensor y = at::empty({m, n}, x.options());
  const auto* xp = x.data_ptr<at::BFloat16>();
  const auto* wp = packed.data_ptr<at::BFloat16>();
  auto* yp = y.data_ptr<at::BFloat16>();
  // each task one weight block, every row block against it: the block is read from memory
  // once and stays in cache for the rows
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> sums(kBlockM * kBlockN);
    for (int64_t j = begin; j < end; ++j) {
      const at::BFloat16* block = wp + j * k * kBlockN;
      for (int64_t r0 = 0; r0 < m; r0 += kBlockM) {
        const int64_t rows = std::min(kBlockM, m - r0);
        at::native::cpublas::brgemm(rows, kBlockN, k, ld_x, kBlockN, kBlockN, false,
                                    xp + r0 * ld_x, block, sums.data(), vnni);
        for (int64_t r = 0; r < rows; ++r) {
          at::BFloat16* out = yp + (r0 + r) * n + j * kBlockN;
          for (int64_t c = 0; c < kBlockN; ++c) out[c] = sums[r * kBlockN + c];
        }
      }
    }
    at::native::cpublas::brgemm_release(vnni);   // the tile unit's state, per thread
  });
  return y;
}

}  // namespace ember

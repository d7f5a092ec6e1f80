// The KV block copy's interface (kv_copy.cpp), bound by bindings.cpp as copy_kv_blocks.
// Layout and reference: as kv_copy.cpp states.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace ember {

// Blocks of src[t] -> dst[t] for every tensor t, run by run: runs int64 [n, 3] of (src
// start, dst start, length). Returns the bytes copied.
int64_t copy_kv_blocks(const std::vector<at::Tensor>& src, const std::vector<at::Tensor>& dst,
                       const at::Tensor& runs);

}  // namespace ember

// The Python bindings of the kernels (one extension, torch.utils.cpp_extension.load over every
// .cpp of this folder: ember/kernels/__init__.py build_cpu_ops). Nothing but bindings: each op
// is defined, with its layout and reference, in the file of its family (common.h lists them).
// pybind11 with torch's tensor casters: what the bindings use of torch/extension.h, which
// adds the C++ frontend (a third of a clean build's time here, compiling its headers)
#include <torch/csrc/utils/pybind.h>

#include "common.h"
#include "decode_stack.h"
#include "kv_copy.h"
#include "shm_allreduce.h"

using namespace ember;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // the GIL is released while a kernel runs, as torch's own ops do, so that the server's
  // event loop can serve HTTP meanwhile (the engine steps in a thread of its own)
  const auto no_gil = py::call_guard<py::gil_scoped_release>();
  m.def("rope_write", &rope_write, "RoPE on q and k, k and v written into the paged cache",
        py::arg("qkv"), py::arg("cos"), py::arg("sin"), py::arg("kv"), py::arg("slots"),
        py::arg("heads"), py::arg("kv_heads"), py::arg("kv_scale") = py::none(),
        py::arg("k_out") = py::none(), no_gil);
  m.def("silu_and_mul", &silu_and_mul, "SwiGLU's activation: silu(gate) * up", no_gil);
  m.def("argmax_rows", &argmax_rows, "each row's first index of its largest value", no_gil);
  m.def("rms_norm", &rms_norm, "RMSNorm, optionally after a fused residual add", no_gil);
  m.def("decode_attention", &decode_attention, "one query per request over the paged cache",
        py::arg("q"), py::arg("kv"), py::arg("block_tables"), py::arg("seq_lens"),
        py::arg("scale"), py::arg("kv_scale") = py::none(), py::arg("skip") = py::none(),
        no_gil);
  m.def("has_bf16_dot", &has_bf16_dot,
        "whether the AVX-512 BF16 kernels (prefill attention, int8 and int4 linear) are built");
  m.def("prefill_attention", &prefill_attention, "a prompt chunk over its paged context",
        py::arg("q"), py::arg("kv"), py::arg("block_table"), py::arg("seq_len"),
        py::arg("scale"), py::arg("kv_scale") = py::none(), no_gil);
  m.def("prefill_attention_chunks", &prefill_attention_chunks,
        "a step's prompt chunks over their paged contexts, shared prefixes packed once",
        py::arg("q"), py::arg("kv"), py::arg("chunk_info"), py::arg("block_tables"),
        py::arg("scale"), py::arg("kv_scale"), py::arg("out"), no_gil);
  m.def("int8_linear", &int8_linear, "x w^T with w int8 in 16-row VNNI panels", no_gil);
  m.def("int8_linear_a8", &int8_linear_a8, "int8_linear with x rounded to int8 per group",
        no_gil);
  m.def("has_int8_dot", &has_int8_dot, "whether this build has AVX-512 VNNI int8 kernels");
  m.def("thread_sync_ns", &thread_sync_ns,
        "ns per round trip of a cache line between two threads, and per empty parallel region",
        no_gil);
  m.def("w8a8_linear", &w8a8_linear, "x w^T on int8 dot products, x quantized per row (or group)",
        no_gil);
  m.def("int8_rows", &int8_rows, "rows of an int8 weight in 16-row VNNI panels", no_gil);
  m.def("int4_linear", &int4_linear, "x w^T with w int4 (groups of 32) in 16-row panels",
        no_gil);
  m.def("brgemm_bf16_vnni", &brgemm_bf16_vnni,
        "whether torch's brgemm runs oneDNN's ukernel on packed bfloat16 weights (AMX)");
  m.def("brgemm_bf16_pack", &brgemm_bf16_pack, "a bfloat16 weight in brgemm's blocks", no_gil);
  m.def("brgemm_bf16_linear", &brgemm_bf16_linear, "x w^T on torch's brgemm, bfloat16",
        no_gil);
  m.def("lora_add", &lora_add, "each adapter's low-rank update added to its rows of y",
        py::arg("y"), py::arg("x"), py::arg("rows"), py::arg("starts"), py::arg("a"),
        py::arg("a_scales"), py::arg("b"), py::arg("b_scales"), py::arg("ranges"), no_gil);
  m.def("copy_kv_blocks", &copy_kv_blocks, "runs of KV blocks from one cache into another",
        py::arg("src"), py::arg("dst"), py::arg("runs"), no_gil);
  // module_local: two builds may share a process (an A/B of two sources loads both)
  py::class_<ShmAllReduce>(m, "ShmAllReduce", py::module_local())
      .def(py::init<const std::string&, int64_t, int64_t, int64_t, bool>(), py::arg("name"),
           py::arg("rank"), py::arg("world_size"), py::arg("slot_bytes"), py::arg("create"))
      .def("all_reduce", &ShmAllReduce::all_reduce,
           "in place, the sum over the ranks, added in rank order", py::arg("x"),
           py::arg("timeout_s"), py::arg("spin_us"), no_gil)
      .def("broadcast", &ShmAllReduce::broadcast,
           "rank 0's bytes (uint8) to every rank: rank 0 passes them, the others get them",
           py::arg("data"), py::arg("timeout_s"), py::arg("spin_us"), no_gil)
      .def("gather", &ShmAllReduce::gather,
           "every rank's [N, w] side by side into rank 0's out [N, sum of w]", py::arg("local"),
           py::arg("out"), py::arg("widest"), py::arg("timeout_s"), py::arg("spin_us"), no_gil)
      .def("close", &ShmAllReduce::close, "leave the group: the others' waits on it raise")
      .def("segment_bytes", &ShmAllReduce::segment_bytes)
      .def_static("unlink", &ShmAllReduce::unlink, "remove a segment's name", py::arg("name"));
#ifdef EMBER_BF16_DOT
  // module_local: two builds may share a process (an A/B of two sources loads both)
  py::class_<DecodeStack>(m, "DecodeStack", py::module_local())
      .def(py::init<std::vector<at::Tensor>, at::Tensor, int64_t, int64_t, int64_t, double,
                    double>())
      .def("forward", &DecodeStack::forward, "a decode step through every layer",
           py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("kv"), py::arg("kv_scales"),
           py::arg("slots"), py::arg("block_tables"), py::arg("seq_lens"),
           py::arg("positions") = py::none(), py::arg("lora") = std::vector<at::Tensor>(),
           py::arg("skip") = py::none(), no_gil)
      .def("forward_mixed", &DecodeStack::forward_mixed,
           "a step with prompt chunks through every layer", py::arg("x"), py::arg("cos"),
           py::arg("sin"), py::arg("kv"), py::arg("kv_scales"), py::arg("slots"),
           py::arg("decode_first"), py::arg("block_tables"), py::arg("seq_lens"),
           py::arg("chunk_info"), py::arg("chunk_tables"), py::arg("positions") = py::none(),
           py::arg("lora") = std::vector<at::Tensor>(), py::arg("skip") = py::none(), no_gil)
      .def("use_all_reduce", &DecodeStack::use_all_reduce,
           "a tensor-parallel rank's stack: o's and down's outputs summed over the ranks",
           py::arg("all_reduce"), py::arg("timeout_s"), py::arg("spin_us"),
           py::keep_alive<1, 2>())
      .def("use_int8", &DecodeStack::use_int8,
           "steps above max_packed_rows (or by_kind: prompt steps) on int8 quads");
#endif
}

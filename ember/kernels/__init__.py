"""Compiled CPU kernels for the small ops that dominate a decode step in eager PyTorch.

The sources are the folder `cpu/`, one file per family: `norm_rope.cpp` (RMSNorm with the
residual add fused in, RoPE fused with the KV-cache write, SwiGLU's activation, a vector
argmax), `decode_attention.cpp` (one new token per request, read in place from the paged KV
cache, no gathered copy), `prefill_attention.cpp` (flash attention of a step's prompt chunks
over their paged contexts, a prefix that several chunks share packed once),
`int4_matmul.cpp` and `int8_matmul.cpp` (linears on int4 and int8 weights, and on int8
activations), `brgemm_matmul.cpp` (bfloat16 linears on torch's own brgemm: AMX's tile unit
where the CPU has one), `lora.cpp` (the LoRA adapters of a mixed batch, each adapter's
rows at once), `decode_stack.cpp` (every decoder layer of a step in one call),
`shm_allreduce.cpp` (the tensor-parallel all-reduce through shared memory), `kv_copy.cpp`
(KV blocks from one cache into another, for disaggregated serving's pulls), the
inline helpers they share (`vec.h` SIMD, `kv_cache.h` the cache's rows, `common.h` what one
file calls in another) and `bindings.cpp` (the Python bindings only). Most need a CPU with
AVX-512 BF16 (and VNNI, for the int8 activations); the rest run anywhere. They are built as
one extension with the machine's C++ compiler the first time an engine needs them (about a
minute; `-march=native`, so the build is keyed by the CPU's flags and by the checkout; ninja
compiles the files in parallel, and again those that include a file that changed, headers
too) and cached by torch.utils.cpp_extension under $TORCH_EXTENSIONS_DIR (default
~/.cache/torch_extensions). The torch code in ember/models is the reference and the fallback:
`--kernels torch` uses it alone, and `auto` falls back to it, with a warning, where the
kernels cannot be built.
"""
from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
from torch import Tensor

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu")   # the kernels' sources: a folder (or one .cpp)


@dataclass(frozen=True)
class CpuKernels:
    """The compiled ops, with the argument conventions of the torch code they replace."""

    ops: ModuleType

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float,
                 residual: Tensor | None = None) -> Tensor:
        """rms_norm(x) * weight; with `residual`, first residual += x (in place) and the sum
        is normalised. x [T, hidden] contiguous, everything in one dtype."""
        return self.ops.rms_norm(x, residual, weight, eps)

    def rope_write(self, qkv: Tensor, cos: Tensor, sin: Tensor, kv: Tensor, slots: Tensor,
                   heads: int, kv_heads: int, kv_scale: Tensor | None = None,
                   k_out: Tensor | None = None) -> Tensor:
        """qkv [T, (heads + 2 kv_heads) * d] -> q [T, heads, d] after RoPE; k (rotated) and v
        are written into kv [2, kv_heads, blocks, block_size, d] at `slots` [T]. With
        `kv_scale` the cache is int8 (PagedKV's): k and v are quantized as it does, and
        `k_out` [T, kv_heads, d] bfloat16, if given, receives the rotated k unrounded."""
        return self.ops.rope_write(qkv, cos, sin, kv, slots, heads, kv_heads, kv_scale, k_out)

    def argmax_rows(self, x: Tensor) -> Tensor:
        """x [B, V] float32 (contiguous rows) -> [B] long, each row's first index of its
        largest value, as x.argmax(-1) (a NaN counts as the largest), in one vector pass."""
        return self.ops.argmax_rows(x)

    def silu_and_mul(self, x: Tensor) -> Tensor:
        """x [T, 2n] -> silu(x[:, :n]) * x[:, n:]."""
        return self.ops.silu_and_mul(x)

    def decode_attention(self, q: Tensor, kv: Tensor, block_tables: Tensor, seq_lens: Tensor,
                         scale: float, kv_scale: Tensor | None = None,
                         skip: Tensor | None = None) -> Tensor:
        """q [B, heads, d], kv [2, kv_heads, blocks, block_size, d] -> [B, heads, d]; with
        `kv_scale` [2, kv_heads, blocks, block_size] float16, kv is int8 (has_bf16_dot).
        With `skip` [B] int64, request b attends no KV head h whose bit is set in skip[b]:
        those query heads' outputs are zeros (ember/models/parallel.py HeadShare)."""
        return self.ops.decode_attention(q, kv, block_tables, seq_lens, scale, kv_scale, skip)

    @functools.cached_property
    def has_bf16_dot(self) -> bool:
        """Whether the build has the AVX-512 BF16 kernels (prefill attention, int8 and int4
        linears, attention over an int8 cache); built where the CPU also has VNNI, as every
        CPU with AVX-512 BF16 does."""
        return self.ops.has_bf16_dot()   # the build says, once (asked every layer)

    @functools.cached_property
    def has_int8_dot(self) -> bool:
        """Whether the build also has the AVX-512 VNNI kernels (int8_linear_a8)."""
        return self.ops.has_int8_dot()

    def attends_head_dim(self, head_dim: int) -> bool:
        """Whether the AVX-512 attention kernels (prefill, and any over an int8 cache) are
        built here for heads of this size: 64 or 128."""
        return head_dim in PREFILL_HEAD_DIMS and self.has_bf16_dot

    def can_prefill(self, kv: Tensor) -> bool:
        """Whether prefill_attention (and, for int8, the other attention kernels) runs on
        this cache: a bfloat16 or int8 one with head_dim 64 or 128, on a CPU with AVX-512
        BF16."""
        return kv.dtype in (torch.bfloat16, torch.int8) and self.attends_head_dim(kv.shape[-1])

    def prefill_attention(self, q: Tensor, kv: Tensor, block_table: Tensor, seq_len: int,
                          scale: float, kv_scale: Tensor | None = None) -> Tensor:
        """q [n, heads, d]: the last n of a request's seq_len cached tokens (written first);
        they attend causally over its context, block_table [blocks] -> [n, heads, d]. An
        int8 cache's rows are made bfloat16 (value * scale) as they are read."""
        return self.ops.prefill_attention(q, kv, block_table, seq_len, scale, kv_scale)

    def int8_linear(self, x: Tensor, packed: Tensor, scales: Tensor) -> Tensor:
        """x [m, k] bfloat16 -> x w^T [m, n] float32, w[r] = q[r] * scales[r] with q int8 in
        16-row panels: packed [n / 16, k / 2, 16, 2] (pack_int8_panels)."""
        return self.ops.int8_linear(x, packed, scales)

    def int8_linear_a8(self, x: Tensor, packed: Tensor, scales: Tensor, group: int) -> Tensor:
        """int8_linear with x rounded to int8 first, one scale per `group` inputs of a row
        (0: the whole row), on int8 dot products (VNNI): twice the multiply-adds per
        instruction, so ~2x faster where the rows make it compute-bound (above ~8 rows)."""
        return self.ops.int8_linear_a8(x, packed, scales, group)

    def int4_linear(self, x: Tensor, q: Tensor, scale_min: Tensor) -> Tensor:
        """x [m, k] bfloat16 -> x w^T [m, n] bfloat16, w = q * scale + min per group of 32
        inputs, from pack_int4_panels; for decode-sized m."""
        return self.ops.int4_linear(x, q, scale_min)

    def w8a8_linear(self, x: Tensor, q: Tensor, scales: Tensor, smooth: Tensor,
                    swiglu: bool = False, group: int = 0) -> Tensor:
        """x [m, k] bfloat16 -> (x * smooth) w^T [m, n] bfloat16 with w = q * scales[:, None]
        (q int8 [n, k], scales and smooth float32 [n], [k]) and each row of x * smooth
        rounded to int8 with its own scale (max / 127); with `group` (dividing k), one scale
        per `group` inputs of a row; with `swiglu`, w is [gate | up] and the result
        [m, n / 2] is silu(gate) * up. q in rows runs on oneDNN's int8 GEMM (one per group);
        q in quads (pack_int8_quads; AVX-512 VNNI) on ember's int8 tiles, with the same
        result bit for bit. AVX-512 BF16 only."""
        return self.ops.w8a8_linear(x, q, scales, smooth, swiglu, group)

    @functools.cached_property
    def brgemm_vnni(self) -> bool:
        """Whether torch's brgemm runs oneDNN's ukernel here (x86 with AMX), on weights
        packed into its pairs; elsewhere it falls back to a plain GEMM per block."""
        return self.ops.brgemm_bf16_vnni()

    def brgemm_pack(self, w: Tensor) -> Tensor:
        """w [n, k] bfloat16 (n % 32 == 0, k even) -> [n / 32, k, 32], brgemm_linear's
        weight (in the ukernel's pairs where brgemm_vnni)."""
        return self.ops.brgemm_bf16_pack(w.contiguous(), self.brgemm_vnni)

    def brgemm_linear(self, x: Tensor, packed: Tensor) -> Tensor:
        """x [m, k] bfloat16 -> x w^T [m, n] bfloat16 (float32 sums) on torch's brgemm, w as
        brgemm_pack made it (ember/kernels/cpu/brgemm_matmul.cpp)."""
        return self.ops.brgemm_bf16_linear(x, packed, self.brgemm_vnni)

    def lora_add(self, y: Tensor, x: Tensor, rows: Tensor, starts: Tensor, a: Tensor,
                 a_scales: Tensor, b: Tensor, b_scales: Tensor, ranges: Tensor) -> None:
        """In place, y[rows_g] += (x[rows_g] @ A[g].T) @ B[g] for each adapter g: rows [N]
        int64 grouped by adapter, starts [G + 1] where each begins, a = A in int8 quads of
        inputs [G, ceil(in / 4), R, 4] (R a multiple of 16) with a_scales [G, 2, R], b,
        b_scales and ranges B in int8 column blocks (ember/lora/batch.py _row_ranks,
        _column_blocks); x [T, in] and y [T, out] bfloat16. x A and t B on int8 dot
        products (x and t rounded per row). AVX-512 VNNI only (ember/kernels/cpu/lora.cpp)."""
        self.ops.lora_add(y, x, rows, starts, a, a_scales, b, b_scales, ranges)

    def decode_stack(self, weights: list[Tensor], final_norm: Tensor, heads: int,
                     kv_heads: int, head_dim: int, eps: float, scale: float):
        """Every decoder layer of a decode step in one call (AVX-512 BF16 only): `weights`
        per layer, in order: input norm, qkv (q, scale_min), o (q, scale_min), post-attention
        norm, gate_up (q, scale_min), down (q, scale_min), the int4 ones from
        pack_int4_panels. Its forward(x, cos, sin, kv caches, kv scales (empty for bfloat16
        caches, one per layer for int8 ones), slots, block_tables, seq_lens) returns the final
        norm's output [T, hidden]; forward_mixed(x, cos, sin, kv caches, kv scales, slots,
        decode_first, block_tables, seq_lens, chunk_info, chunk_tables) the same for a step
        with prompt chunks (ember/models/attention.py PromptStep; after use_int8). On a
        tensor-parallel rank (its heads and MLP columns), use_all_reduce(handle, timeout_s,
        spin_us) with this rank's shm_all_reduce makes it sum the o and down projections'
        outputs over the ranks itself, as the layers' all-reduce would."""
        return self.ops.DecodeStack(weights, final_norm, heads, kv_heads, head_dim, eps, scale)

    def thread_sync_ns(self, rounds: int = 5) -> tuple[float, float]:
        """(ns per round trip of a cache line between two of torch's threads, NaN with one
        thread; ns per empty parallel region over all of them), best of `rounds` tries: what
        the ~150 parallel regions of a batch-1 decode step pay to hand work between cores."""
        round_trip, region = self.ops.thread_sync_ns(rounds)
        return round_trip, region

    def shm_all_reduce(self, name: str, rank: int, world_size: int, slot_bytes: int,
                       create: bool):
        """This rank's end of a shared-memory all-reduce among the processes of one host, on
        the POSIX segment `name` (rank 0 creates it, the others open it; shm_unlink it once
        all have). Its all_reduce(x, timeout_s, spin_us) makes x (float32 or bfloat16) the
        sum over the ranks, added in rank order in float32 (ember/distributed/allreduce.py
        sum_in_rank_order, bit for bit); close() leaves the group."""
        return self.ops.ShmAllReduce(name, rank, world_size, slot_bytes, create)

    def shm_unlink(self, name: str) -> None:
        """Remove a shared-memory segment's name (its memory lives on while mapped)."""
        self.ops.ShmAllReduce.unlink(name)

    def copy_kv_blocks(self, src: list[Tensor], dst: list[Tensor], runs: Tensor) -> int:
        """dst[t][:, :, d:d + n] = src[t][:, :, s:s + n] for every tensor pair and every run
        (s, d, n) of runs [r, 3] int64, one memcpy per run and (dim 0, dim 1) index; two
        caches of one layout, [2, kv_heads, blocks, ...] with the block dim and those after
        it packed. Returns the bytes copied (ember/kernels/cpu/kv_copy.cpp)."""
        return self.ops.copy_kv_blocks(src, dst, runs)

    def int8_rows(self, ids: Tensor, packed: Tensor, scales: Tensor) -> Tensor:
        """Rows `ids` [t] of that weight -> [t, k] bfloat16 (an embedding lookup)."""
        return self.ops.int8_rows(ids, packed, scales)


PREFILL_HEAD_DIMS = (64, 128)


def pack_int8_panels(q: Tensor) -> Tensor:
    """int8 [n, k] (n % 16 == 0, k % 4 == 0) -> [n / 16, k / 2, 16, 2], the layout of
    int8_linear: per 16 rows, each pair of inputs of all 16 rows together."""
    n, k = q.shape
    return q.view(n // 16, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def pack_int8_quads(q: Tensor) -> Tensor:
    """int8 [n, k] (n % 16 == 0, k % 4 == 0) -> [n / 16, k / 4, 16, 4] uint8, q + 128: the
    operand of the int8 dot-product instruction (unsigned) for 16 rows x 4 inputs, the
    layout w8a8_linear runs on its own tiles."""
    n, k = q.shape
    shifted = (q.to(torch.int16) + 128).to(torch.uint8)
    return shifted.view(n // 16, 16, k // 4, 4).permute(0, 2, 1, 3).contiguous()


def pack_int4_panels(q: Tensor, scale: Tensor, minimum: Tensor) -> tuple[Tensor, Tensor]:
    """q [n, k] in 0..15, scale and minimum [n, k / 32] (n % 16 == 0, k % 32 == 0) -> the
    layout of int4_linear: q [n / 16, k / 32, 8, 32] uint8, each byte two operands' nibbles
    (operand t: 16 rows x inputs 2t, 2t + 1 of the group, pair-interleaved), and scale_min
    [n / 16, k / 32, 2, 16] float16 (GGUF's precision for them, so Q4_0 and Q4_1 stay exact)."""
    n, k = q.shape
    groups = k // 32
    operands = q.view(n // 16, 16, groups, 16, 2).permute(0, 2, 3, 1, 4)
    operands = operands.reshape(n // 16, groups, 8, 2, 32)
    packed = (operands[..., 0, :] | (operands[..., 1, :] << 4)).to(torch.uint8).contiguous()
    per_panel = [t.reshape(n // 16, 16, groups).transpose(1, 2) for t in (scale, minimum)]
    return packed, torch.stack(per_panel, dim=2).to(torch.float16).contiguous()


def unpack_int4_panels(packed: Tensor, scale_min: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """pack_int4_panels undone: -> q [n, k] (0..15, uint8), scale and minimum [n, k / 32]
    (float32, as the kernel holds them: rounded to float16)."""
    panels, groups = packed.shape[:2]
    operands = torch.stack([packed & 0x0F, packed >> 4], dim=3)     # [P, G, 8, 2, 32]
    q = operands.reshape(panels, groups, 16, 16, 2).permute(0, 3, 1, 2, 4)
    per_panel = scale_min.float().transpose(2, 3)                    # [P, G, 16, 2]
    scale, minimum = (per_panel[..., i].transpose(1, 2).reshape(panels * 16, groups)
                      for i in (0, 1))
    return q.reshape(panels * 16, groups * 32), scale, minimum


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux reports them (/proc/cpuinfo's `flags` on x86,
    `Features` on ARM); none where it does not."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def has_amx(flags: frozenset[str]) -> bool:
    """Whether these CPU flags name AMX's tile unit with bfloat16 (Sapphire Rapids on)."""
    return "amx_bf16" in flags and "amx_tile" in flags


def _cpu_key() -> str:
    """The build depends on the CPU (-march=native): key it by the CPU's feature flags."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = line
                break
    except OSError:
        pass
    return hashlib.sha256((platform.machine() + flags).encode()).hexdigest()[:10]


def kernel_sources(source: Path) -> list[Path]:
    """The files compiled for `source`: a folder's .cpp files (its headers are included by
    them), or `source` itself, one .cpp file (as an older checkout has it)."""
    if source.is_dir():
        files = sorted(source.glob("*.cpp"))
        if not files:
            raise FileNotFoundError(f"no .cpp files in {source}")
        return files
    return [source]


CFLAGS = ["-O3", "-march=native", "-fopenmp"]
STAMP = "ember_sources.sha256"   # beside the build: the sources it was built from


def build_cpu_ops(verbose: bool = False, source: Path = SOURCE, name: str | None = None
                  ) -> ModuleType:
    """Compile (or load the cached build of) the kernels, or another `source` of them (a
    folder like cpu/, or one .cpp file) as extension `name` (benchmarks/kernel_ab.py builds
    two). A build whose stamp matches the sources is imported as it is (torch's own check
    runs ninja and takes ~0.7 s of a start); anything else goes through torch's build.
    Raises on a failed build."""
    from torch.utils.cpp_extension import _get_build_directory, load
    name = name or default_name(source)
    build_dir = Path(_get_build_directory(name, verbose=False))
    stamp = source_stamp(source)
    built = import_built(name, build_dir, stamp)
    if built is not None:
        return built
    _put_ninja_on_path()
    with build_lock(build_dir):
        clear_dead_build_lock(build_dir)
        built = import_built(name, build_dir, stamp)   # another process built it meanwhile
        if built is not None:
            return built
        ops = load(name=name, sources=[str(path) for path in kernel_sources(source)],
                   extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"], verbose=verbose)
        (build_dir / STAMP).write_text(stamp)
    return ops


def default_name(source: Path) -> str:
    """The extension's name, keyed by the CPU and the sources' folder: two checkouts never
    share a build folder, where ninja could keep one's objects for the other's sources (one
    checkout's edits still rebuild only what they touch)."""
    where = hashlib.sha256(str(source.resolve()).encode()).hexdigest()[:8]
    return f"ember_cpu_ops_{_cpu_key()}_{where}"


def source_stamp(source: Path) -> str:
    """A hash of every file of `source` (headers too), the flags and torch's version."""
    files = sorted(p for p in source.iterdir() if p.is_file()) if source.is_dir() else [source]
    digest = hashlib.sha256(f"{CFLAGS} {torch.__version__}".encode())
    for path in files:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def import_built(name: str, build_dir: Path, stamp: str) -> ModuleType | None:
    """The extension built in `build_dir` from the sources `stamp` names, imported; None if
    there is none, it is another build, or a build is under way."""
    library = build_dir / f"{name}.so"
    try:
        if (build_dir / "lock").exists() or (build_dir / STAMP).read_text() != stamp:
            return None
    except OSError:
        return None
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None or not library.is_file():
        return None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return module


BUILD_LOCK = "ember.build.lock"   # beside torch's own `lock`, in the build folder


@contextmanager
def build_lock(build_dir: Path) -> Iterator[None]:
    """Held while this process builds the kernels in `build_dir`: an flock, which the kernel
    drops when its holder dies, so a build killed mid-way never blocks the next one. Another
    process's build under way is waited for (logged)."""
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / BUILD_LOCK, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process's kernel build in %s", build_dir)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def clear_dead_build_lock(build_dir: Path) -> bool:
    """Called holding build_lock: torch's build waits, silently and forever, while its `lock`
    file exists, and a build that was killed leaves one behind. Every live build holds
    build_lock, so a `lock` seen here is a dead build's: removed, with a warning. Returns
    whether one was removed."""
    lock = build_dir / "lock"
    if not lock.exists():
        return False
    log.warning("removing %s, left by a kernel build that did not finish", lock)
    lock.unlink(missing_ok=True)
    return True


def _put_ninja_on_path() -> None:
    """torch's extension build runs `ninja` from PATH; the ninja package (a dependency) puts
    it beside this Python, which is not on PATH when a venv's python runs unactivated."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja
    except ImportError:
        return  # the build then fails, saying that ninja is required
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def load_kernels(choice: str, device: str) -> CpuKernels | None:
    """The kernels to run with (`choice` is EngineConfig.kernels): compiled CPU ones, or
    None for the torch path."""
    if choice == "torch" or torch.device(device).type != "cpu":
        return None
    try:
        return CpuKernels(build_cpu_ops())
    except Exception as e:  # noqa: BLE001 (no compiler, no headers: the torch path still runs)
        log.warning("the compiled CPU kernels could not be built (%s: %s); running the "
                    "slower torch path. Install a C++ compiler (g++) and the Python headers, "
                    "or pass --kernels torch to skip the attempt", type(e).__name__,
                    str(e).splitlines()[0] if str(e) else "")
        return None

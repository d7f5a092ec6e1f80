"""Weight-only int8 and int4 linears on PyTorch's own CPU packed-weight kernels, or ember's.

    int8  one scale per output row, symmetric:        w = q * s,      q in -127..127
          (aten._weight_int8pack_mm, as gpt-fast and torchao use it; the output projection
          runs on ember's int8_linear where the compiled kernels have AVX-512 BF16)
    int4  one scale and minimum per 32 inputs of a row: w = q * s + m,  q in 0..15
          (ember's int4_linear where the compiled kernels have AVX-512 BF16, 2-3x faster at
          decode sizes; elsewhere aten._weight_int4pack_mm_for_cpu, which takes (s, m + 8 s))

int4 with groups of 32 is GGUF's Q4_1 layout, and Q4_0's with the minimum at -8 steps; the
kernels keep scales and minima in float16 as GGUF does, so both convert without loss from
their values (quantize_int4 finds Q4_0's grid), and from the bfloat16 copies the loader
makes to within bfloat16's rounding. The torch fallback takes them in bfloat16.

Why two weights per layer: at a few rows (decode) a matmul is memory-bound and the packed
kernels read 2-4x fewer bytes than bfloat16; at many rows (prefill, large batches) it is
compute-bound and oneDNN's bfloat16 matmul is 3x faster than the packed kernels on this kind
of CPU. So a PackedLinear keeps a dense weight too, and picks by
the number of rows; `keep_dense=False` drops it to save memory at the cost of prefill speed.
The dense weight is either bfloat16, kept in oneDNN's own blocked layout where oneDNN runs the
matmul (the same bytes; it saves the reorder oneDNN would do on every call) or, after
`use_brgemm_dense`, in the blocks of torch's own brgemm (AMX's tile unit), or, after
`use_int8_dense`, int8 with a scale per output row for "W8A8" matmuls: each row of activations
is rounded to int8 on the fly and the product runs on int8 dot products (VNNI, twice
bfloat16's multiply-accumulates per instruction): 1.4-1.8x bfloat16's speed from 64 to 512
rows, at half the memory (w8a8_linear in ember/kernels). Where the CPU has VNNI the int8
weight is kept in "quads" (pack_int8_quads) for ember's own int8 tiles, which beat oneDNN's
int8 GEMM at every size (1.03-1.16x at 256-512 rows, 1.3-2.4x at 9-64: oneDNN reorders the
weight on every call), so decode steps of more than 8 rows run on it too (the decode stack,
ember/models/llama.py); elsewhere it stays in rows for oneDNN. Rounding
activations to 8 bits hurts where a few input channels are much larger than the rest, so the
int8 weight is made SmoothQuant's way: input channel j of the weight is multiplied by
s_j = max|x_j|^a / max|w_j|^(1 - a) (max|x_j| seen on a calibration prompt, a = 0.5) and the
activations are divided by s_j as they are rounded, which moves part of their range into
the weight, where it is rounded per output row.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ember.errors import ConfigError
from ember.kernels import (
    CpuKernels,
    pack_int4_panels,
    pack_int8_panels,
    pack_int8_quads,
    unpack_int4_panels,
)

GROUP = 32
METHODS = ("int8", "int4")
SMOOTH_ALPHA = 0.5  # SmoothQuant's migration strength: half the activations' range moves
# at this many rows or fewer the packed kernel beats dense bfloat16 (measured: equal near 8)
PACKED_MAX_ROWS = 8
# the output projection on int8 activations (int4 formats), at every batch size (2x faster
# than bfloat16 activations at 22-32 rows, where it is compute-bound; at one row, on the
# kernel's one-stream path, a batch-1 step 0.94-0.97x the time with the vCPUs far apart and
# the same close, where reading the weight bounds it), with one scale per
# this many inputs. Each row is rounded on its own, so a request's logits do not depend on
# its batch.
HEAD_ACT_GROUP = 64


@dataclass
class StepRows:
    """What the rows of the forward under way are, shared by a model's PackedLinears (the
    runner sets it per forward, rows_of_kind): prompt rows (True) take the dense weight
    (int8 or bfloat16) and decode rows (False) the packed one, whatever their number, so that
    a row's numerics do not depend on the rows beside it; None: by the number of rows (at
    most max_packed_rows on the packed weight)."""

    prompt: bool | None = None


def quantize_int8(weight: Tensor) -> tuple[Tensor, Tensor]:
    """[N, K] float -> (int8 [N, K], float32 scales [N]), symmetric per row."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-10)
    q = (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
    return q, scale


# values of a weight quantize_int4 takes at once (float32: 512 KB, some 6 MB of
# intermediates at its widest, the three candidate grids)
QUANTIZE_CHUNK = 1 << 17


def quantize_int4(weight: Tensor, group: int = GROUP, refits: int = 3
                  ) -> tuple[Tensor, Tensor, Tensor]:
    """[N, K] float -> (q int32 [N, K] in 0..15, scales [N, K/group], minima [N, K/group]).

    Each group starts from whichever grid reproduces it best of those that reach its values
    to within half a step: its min-max range in 15 steps, or the signed grid d * (q - 8)
    with the group's largest magnitude at q = 0 (GGUF's Q4_0), where that end alone sets
    the step, so a Q4_0 group whose codes stop short of 15 is not rounded a second time.
    Then `refits` rounds of least squares: the scale and minimum that best fit the codes,
    the codes that best fit them, kept where the error falls and every value stays within
    half a step (as llama.cpp's quantizers refine theirs). That cuts the error of 3-6 bit
    types packed as int4 by a tenth to a half; a GGUF Q4_0 or Q4_1 group handed over in
    bfloat16 comes back within about 1e-3 of its size, bfloat16's own rounding.

    Groups are independent, so the rows go through in chunks of QUANTIZE_CHUNK values whose
    intermediates stay in cache (~3x faster than whole tensors, which stream each of the
    dozens of steps through DRAM), with the same result."""
    rows = max(1, QUANTIZE_CHUNK // weight.shape[1])
    parts = [_quantize_int4_rows(chunk, group, refits) for chunk in weight.split(rows)]
    q, scale, minimum = (torch.cat(t) for t in zip(*parts))
    return q, scale, minimum


def _quantize_int4_rows(weight: Tensor, group: int, refits: int
                        ) -> tuple[Tensor, Tensor, Tensor]:
    """quantize_int4 of a few rows."""
    n, k = weight.shape
    w = weight.float().view(n, k // group, group)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    grids = _candidate_grids(lo, hi)
    scale, minimum = next(grids)   # the min-max grid spans its group by construction
    q = _codes(w, scale, minimum)
    fit = (q, scale, minimum, _group_error(w, q, scale, minimum))
    for s, m in grids:
        fit = _better_fit(w, lo, hi, fit, s, m)
    for _ in range(refits):
        fit = _better_fit(w, lo, hi, fit, *_least_squares_grid(w, *fit[:3]))
    q, scale, minimum, _ = fit
    return q.to(torch.int32).view(n, k), scale, minimum


def _better_fit(w: Tensor, lo: Tensor, hi: Tensor, fit: tuple[Tensor, Tensor, Tensor, Tensor],
                scale: Tensor, minimum: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """fit = (codes, scale, minimum, error) per group, with the grid (scale, minimum) taken
    where it reaches its group and fits it strictly better (ties keep the old grid)."""
    q, s, m, err = fit
    q_new = _codes(w, scale, minimum)
    e = _group_error(w, q_new, scale, minimum)
    better = (e < err) & _reaches(lo, hi, scale, minimum)
    return (torch.where(better[..., None], q_new, q), torch.where(better, scale, s),
            torch.where(better, minimum, m), torch.where(better, e, err))


def _candidate_grids(lo: Tensor, hi: Tensor) -> Iterator[tuple[Tensor, Tensor]]:
    """(scale, minimum) per group: its min-max range in 15 steps, then Q4_0's signed grid
    d * (q - 8) with the most negative value at q = 0, then with the largest at q = 15."""
    yield ((hi - lo) / 15.0).clamp(min=1e-10), lo
    yield (-lo / 8.0).clamp(min=1e-10), lo
    d = (hi / 8.0).clamp(min=1e-10)
    yield d, -7.0 * d


def _codes(w: Tensor, scale: Tensor, minimum: Tensor) -> Tensor:
    """The nearest of 16 levels minimum + q * scale per value of each group (float q)."""
    return ((w - minimum[..., None]) / scale[..., None]).round().clamp(0, 15)


def _group_error(w: Tensor, q: Tensor, scale: Tensor, minimum: Tensor) -> Tensor:
    """Per group, the squared error of the codes q on the grid (scale, minimum)."""
    return (q * scale[..., None] + minimum[..., None] - w).square().sum(dim=-1)


def _reaches(lo: Tensor, hi: Tensor, scale: Tensor, minimum: Tensor) -> Tensor:
    """Whether the grid puts every value of a group in [lo, hi] within half a step."""
    return (minimum - scale / 2 <= lo) & (minimum + 15.5 * scale >= hi)


def _least_squares_grid(w: Tensor, q: Tensor, scale: Tensor, minimum: Tensor
                        ) -> tuple[Tensor, Tensor]:
    """Per group of w [.., G, group], the (scale, minimum) minimising |q * scale + minimum -
    w|^2 for the codes q; groups whose codes are all equal keep theirs."""
    group = w.shape[-1]
    sq, sqq, sw, sqw = q.sum(-1), q.square().sum(-1), w.sum(-1), (q * w).sum(-1)
    det = group * sqq - sq * sq
    solvable = det > 0
    s = torch.where(solvable, (group * sqw - sq * sw) / det.clamp(min=1e-30), scale)
    s = s.clamp(min=1e-10)
    return s, torch.where(solvable, (sw - s * sq) / group, minimum)


def dequantize_int8(q: Tensor, scale: Tensor) -> Tensor:
    return q.float() * scale.float()[:, None]


def dequantize_int4(q: Tensor, scale: Tensor, lo: Tensor, group: int = GROUP) -> Tensor:
    n, k = q.shape
    w = q.float().view(n, k // group, group) * scale[..., None] + lo[..., None]
    return w.view(n, k)


def int8_quads_fit(kernels: CpuKernels, out_features: int, in_features: int,
                   act_group: int) -> bool:
    """Whether an int8 prompt weight can be kept in quads (pack_int8_quads) for ember's own
    int8 tiles: VNNI, and sizes that fit them (outputs in pairs of 16-row panels, inputs and
    groups in fours); else it stays in rows for oneDNN's int8 GEMM."""
    return (kernels.has_int8_dot and out_features % 32 == 0 and in_features % 4 == 0
            and act_group % 4 == 0)


class PackedLinear(nn.Module):
    """y = x W^T (+ b) with W stored int8 or int4; the dense weight (if kept) serves big batches.

    The packed kernels take bfloat16 activations; the model runs in bfloat16 with them.
    """

    # the kind of the forward's rows, shared by a model's linears (share_step_rows); None:
    # by their number. A class default, so that a module the weight cache builds has it too
    # (the cache keeps only plain settings; this name is private)
    _rows: StepRows | None = None
    # the kernels whose brgemm_linear runs prompt rows on the dense weight, kept in its blocks
    # (use_brgemm_dense); None: oneDNN's matmul. A class default for caches written before
    brgemm: CpuKernels | None = None

    def __init__(self, linear: nn.Linear, method: str, keep_dense: bool = True,
                 max_packed_rows: int = PACKED_MAX_ROWS, prepack_dense: bool = True,
                 kernels: CpuKernels | None = None) -> None:
        super().__init__()
        weight = linear.weight.detach()
        self.method, self.max_packed_rows = method, max_packed_rows
        # int4 on the compiled kernel (2-3x torch's at decode sizes) where it runs
        self.kernels = kernels if (method == "int4" and kernels is not None
                                   and kernels.has_bf16_dot and weight.shape[0] % 16 == 0
                                   ) else None
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.weight = weight if keep_dense else None
        self.w8a8: CpuKernels | None = None  # set by use_int8_dense
        self.act_group = 0  # inputs per activation scale in W8A8 matmuls (0: the whole row)
        self.int8_source: tuple[Tensor, Tensor] | None = None  # set by shrink_dense
        # the dense weight in oneDNN's blocked layout (same bytes), so that big batches skip
        # the reorder oneDNN otherwise does on every call: 10-45% faster from 9 to 512 rows
        self.prepacked = False
        if keep_dense and prepack_dense:
            self.weight, self.prepacked = prepack_for_onednn(weight)
        self.bias = linear.bias
        if method == "int8":
            q, scale = quantize_int8(weight)
            self.register_buffer("qweight", q)
            self.register_buffer("scales", scale.to(torch.bfloat16))
        elif method == "int4" and self.kernels is not None:
            q, scale, lo = quantize_int4(weight)
            packed, scale_min = pack_int4_panels(q, scale, lo)
            self.register_buffer("qweight", packed)
            self.register_buffer("scales", scale_min)
        elif method == "int4":
            q, scale, lo = quantize_int4(weight)
            self.register_buffer("qweight",
                                 torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
            # the kernel's per-group (scale, zero) with w = (q - 8) * scale + zero
            zeros = lo + 8 * scale
            self.register_buffer("scales", torch.stack([scale, zeros], dim=-1)
                                 .transpose(0, 1).contiguous().to(torch.bfloat16))
        else:
            raise ConfigError(f"weight quantization {method!r} is unknown; choose one of "
                              f"{', '.join(METHODS)} or none")

    def use_int8_dense(self, kernels: CpuKernels, input_amax: Tensor,
                       alpha: float = SMOOTH_ALPHA, act_group: int = 0,
                       max_over_ranks: Callable[[Tensor], None] | None = None) -> None:
        """Make the dense weight SmoothQuant int8 (module docstring), from the dense bfloat16
        weight if one is kept (it is freed), else its int8 copy (shrink_dense), else the
        packed weight: `input_amax` [in_features] is max |x| per input channel on a
        calibration prompt. Activations get one scale per row, or per `act_group` inputs of
        a row (dividing in_features). `max_over_ranks` (a column-parallel linear's: other
        ranks hold the other output rows) makes the weight's max |w| per input channel
        [in_features] the whole weight's, in place, so that every rank smooths as one
        process would. Needs the compiled kernels with AVX-512 BF16."""
        if not self.can_use_int8_dense(kernels):
            raise ConfigError("int8 prefill matmuls need int8 weights or int4 ones on the "
                              "compiled kernels, and AVX-512 BF16; use --prefill-matmul "
                              "bfloat16")
        if act_group < 0 or (act_group and self.in_features % act_group):
            raise ValueError(f"act_group {act_group} does not divide {self.in_features} inputs")
        if self.prepacked:  # oneDNN's blocked layout back to rows, once
            self.weight, self.prepacked = self.weight.to_dense(), False
        n = self.out_features
        chunks = [slice(start, start + 256) for start in range(0, n, 256)]  # float32 rows
        w_amax = torch.stack([self._float_rows(rows).abs().amax(dim=0)
                              for rows in chunks]).amax(dim=0)
        if max_over_ranks is not None:
            max_over_ranks(w_amax)
        smooth = (input_amax.float().clamp(min=1e-5) ** alpha
                  / w_amax.clamp(min=1e-5) ** (1 - alpha)).clamp(min=1e-5)
        q = torch.empty(n, self.in_features, dtype=torch.int8)
        scale = torch.empty(n)
        for rows in chunks:
            q[rows], scale[rows] = quantize_int8(self._float_rows(rows) * smooth)
        if self.quads_fit(kernels, act_group):  # ember's int8 tiles, else oneDNN's GEMM
            q = pack_int8_quads(q)
        self.register_buffer("dense_q", q)
        self.register_buffer("dense_scales", scale)
        self.register_buffer("smooth", (1 / smooth).contiguous())
        self.weight, self.prepacked, self.w8a8 = None, False, kernels
        self.int8_source, self.act_group = None, act_group

    def use_brgemm_dense(self, kernels: CpuKernels) -> bool:
        """Keep the dense bfloat16 weight in brgemm's blocks (CpuKernels.brgemm_pack) for
        prompt rows and big decode steps, where it has one and the sizes fit (outputs in
        32s, inputs even). Returns whether it does."""
        if self.weight is None or self.w8a8 is not None or self.out_features % 32 \
                or self.in_features % 2:
            return False
        dense = self.weight.to_dense() if self.prepacked else self.weight
        self.weight, self.prepacked, self.brgemm = kernels.brgemm_pack(dense), False, kernels
        return True

    def quads_fit(self, kernels: CpuKernels, act_group: int) -> bool:
        """Whether the int8 dense weight can be kept in quads (int8_quads_fit)."""
        return int8_quads_fit(kernels, self.out_features, self.in_features, act_group)

    @property
    def int8_quads(self) -> bool:
        """Whether the int8 dense weight is in quads (use_int8_dense)."""
        return self.w8a8 is not None and self.dense_q.dim() == 4

    def can_use_int8_dense(self, kernels: CpuKernels | None) -> bool:
        """Whether use_int8_dense can run: the kernels, and a weight to make the int8 from."""
        return (kernels is not None and kernels.has_bf16_dot
                and (self.weight is not None or self.int8_source is not None
                     or self.method == "int8" or self.kernels is not None))

    def shrink_dense(self) -> None:
        """Until use_int8_dense: keep the dense bfloat16 weight only as int8 per row (half the
        bytes; int8 weights already are that), and let the packed weight serve every batch
        size meanwhile. Made from this int8 copy, the smoothed int8 weight costs less than made
        from the packed int4 one: on the default model, prompt perplexity +0.47% vs +0.89%
        (straight from bfloat16: +0.49%)."""
        if self.weight is None or self.method == "int8":
            self.weight, self.prepacked = None, False
            return
        weight = self.weight.to_dense() if self.prepacked else self.weight
        q = torch.empty(weight.shape, dtype=torch.int8)
        scale = torch.empty(weight.shape[0])
        for start in range(0, weight.shape[0], 256):  # float32 temporaries of 256 rows only
            rows = slice(start, start + 256)
            q[rows], scale[rows] = quantize_int8(weight[rows])
        self.int8_source = (q, scale)
        self.weight, self.prepacked = None, False

    def _float_rows(self, rows: slice) -> Tensor:
        """Rows of the weight in float32: the dense one if kept, else its int8 copy
        (shrink_dense), else the packed one dequantized (rows in multiples of 16)."""
        if self.weight is not None:
            return self.weight[rows].float()
        if self.int8_source is not None:
            q, scale = self.int8_source
            return dequantize_int8(q[rows], scale[rows])
        if self.method == "int8":
            return dequantize_int8(self.qweight[rows], self.scales[rows])
        panels = slice(rows.start // 16, None if rows.stop is None else -(-rows.stop // 16))
        return dequantize_int4(*unpack_int4_panels(self.qweight[panels], self.scales[panels]))

    def packed_bytes(self) -> int:
        return self.qweight.numel() * self.qweight.element_size() + \
            self.scales.numel() * self.scales.element_size()

    def dense_bytes(self) -> int:
        """What a matmul over max_packed_rows reads (0: none kept, the packed weight serves)."""
        if self.w8a8 is not None:
            return self.dense_q.numel() + 4 * (self.dense_scales.numel() + self.smooth.numel())
        return 0 if self.weight is None else 2 * self.in_features * self.out_features

    def dense_rows(self, x: Tensor) -> bool:
        """Whether x's rows take the dense weight (StepRows)."""
        prompt = None if self._rows is None else self._rows.prompt
        return x.shape[0] > self.max_packed_rows if prompt is None else prompt

    def takes_swiglu(self, x: Tensor) -> bool:
        """Whether swiglu(x) runs here fused (the int8 dense path), for a gate | up layer."""
        return self.w8a8 is not None and self.bias is None and self.dense_rows(x)

    def swiglu(self, x: Tensor) -> Tensor:
        """silu(gate) * up of this [gate | up] projection in one pass over the int32 sums
        (where takes_swiglu)."""
        return self.w8a8.w8a8_linear(x, self.dense_q, self.dense_scales, self.smooth,
                                     swiglu=True, group=self.act_group)

    def forward(self, x: Tensor) -> Tensor:
        dense = self.dense_rows(x)
        if self.w8a8 is not None and dense:
            out = self.w8a8.w8a8_linear(x, self.dense_q, self.dense_scales, self.smooth,
                                        group=self.act_group)
            return out if self.bias is None else out + self.bias
        if self.weight is not None and dense:
            if self.brgemm is not None:
                out = self.brgemm.brgemm_linear(x, self.weight)
                return out if self.bias is None else out + self.bias
            if self.prepacked:
                return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none",
                                                          [], "")
            return F.linear(x, self.weight, self.bias)
        if self.method == "int8":
            out = torch.ops.aten._weight_int8pack_mm(x, self.qweight, self.scales)
        elif self.kernels is not None:
            out = self.kernels.int4_linear(x.contiguous(), self.qweight, self.scales)
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.qweight, GROUP,
                                                              self.scales)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        dense = ("int8" + (f"/{self.act_group}" if self.act_group else "")) \
            if self.w8a8 is not None else \
            "bfloat16 brgemm" if self.brgemm is not None else \
            "bfloat16" if self.weight is not None else "dropped"
        return f"in={self.in_features}, out={self.out_features}, {self.method}, dense={dense}"


class KernelInt8Linear(nn.Module):
    """y = x W^T in float32, W int8 with a float32 scale per output row, on the AVX-512 BF16
    kernel (int8_linear) at every batch size: the output projection, where it beats both the
    packed int8 kernel (2x at 1 row) and bfloat16 (at 8-64 rows, counting the reorder oneDNN
    does on a weight it cannot keep blocked), so no bfloat16 copy is kept for it.

    With `act_group` (not None), every batch rounds x to int8 first, one scale per
    `act_group` inputs (0: a row), and runs on int8 dot products (int8_linear_a8): at 22-32
    rows (a busy server's decode step) the projection is compute-bound and that halves it;
    at one row it is bound by reading the weight, and the kernel's one-stream path spends
    about a fifth of the bfloat16 kernel's vector instructions per weight byte, which shows
    where the vCPUs sit far apart. The int4
    weight formats use it (their budget allows the rounding; docs/benchmarks.md has the
    perplexity). The weight is then kept in quads only (`quads`; `packed`, the pairs, is
    None), 28 MB on the default model: making quads from the pairs on every call cost 15% of
    the projection at 16-32 rows. Without it, in pairs only."""

    def __init__(self, linear: nn.Linear, kernels: CpuKernels,
                 act_group: int | None = None) -> None:
        super().__init__()
        q, scale = quantize_int8(linear.weight.detach())
        self.in_features, self.out_features = q.shape[1], q.shape[0]
        if act_group is not None and (not kernels.has_int8_dot or act_group % 4
                                      or (act_group and self.in_features % act_group)):
            act_group = None   # no VNNI kernels here, or a group that does not fit
        self.kernels, self.act_group = kernels, act_group
        self.register_buffer("packed", pack_int8_panels(q) if act_group is None else None)
        self.register_buffer("quads", None if act_group is None else pack_int8_quads(q))
        self.register_buffer("scales", scale.float())

    @staticmethod
    def fits(linear: nn.Linear, kernels: CpuKernels | None) -> bool:
        n, k = linear.weight.shape
        return (kernels is not None and kernels.has_bf16_dot and linear.bias is None
                and n % 16 == 0 and k % 4 == 0)

    @property
    def weight_int8(self) -> Tensor:
        """The int8 weight as kept: the quads (int8 activations) or the pairs."""
        return self.quads if self.quads is not None else self.packed

    def packed_bytes(self) -> int:
        """The bytes a call reads: the weight as kept, plus the scales."""
        return self.weight_int8.numel() + self.scales.numel() * self.scales.element_size()

    def forward(self, x: Tensor) -> Tensor:
        x = x.contiguous()
        if self.quads is not None:
            return self.kernels.int8_linear_a8(x, self.quads, self.scales, self.act_group)
        return self.kernels.int8_linear(x, self.packed, self.scales)

    def extra_repr(self) -> str:
        kept = "int8 panels" if self.act_group is None else \
            f"int8 quads, int8 activations/{self.act_group}"
        return f"in={self.in_features}, out={self.out_features}, {kept}"


class Int8Embedding(nn.Module):
    """A tied embedding read from its output projection's int8 weight: the bfloat16 table
    (57 MB on the default model) is not kept."""

    def __init__(self, head: KernelInt8Linear) -> None:
        super().__init__()
        self.kernels = head.kernels
        # the same tensors, shared: the head's pairs or quads (int8_rows reads either)
        self.register_buffer("packed", head.weight_int8)
        self.register_buffer("scales", head.scales)

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.kernels.int8_rows(input_ids.contiguous(), self.packed, self.scales)


def step_weights(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """(module, buffer name) for the compact weights a decode step reads: every PackedLinear's
    packed int4/int8 weight and scales, and the int8 output projection's weight (pairs or
    quads: one is None) and scales (a tied Int8Embedding names the same tensors). Not the
    linears' int8 prompt weights (use_int8_dense): on huge pages too, a loaded server peaked
    20-30 MB higher and no step measured faster."""
    kinds = ((PackedLinear, ("qweight", "scales")),
             (KernelInt8Linear, ("packed", "quads", "scales")),
             (Int8Embedding, ("packed", "scales")))
    return [(m, name) for m in model.modules() for kind, names in kinds if isinstance(m, kind)
            for name in names]


def prepack_for_onednn(weight: Tensor) -> tuple[Tensor, bool]:
    """(weight reordered for oneDNN's CPU matmul, True), or (weight, False) where that is not
    available (not a CPU, not bfloat16, a build without oneDNN)."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 \
            or not torch.backends.mkldnn.is_available():
        return weight, False
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight, None), True
    except (RuntimeError, AttributeError):
        return weight, False


def linear_modules(model: nn.Module) -> Iterator[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute name, linear) for every nn.Linear below `model`."""
    for parent in model.modules():
        for name, child in parent.named_children():
            if isinstance(child, nn.Linear):
                yield parent, name, child


def check_method(method: str, dtype: torch.dtype, device: str,
                 in_features: Iterable[int]) -> None:
    """Whether `method` (an EngineConfig choice, already known) can run here, on linears with
    these input sizes; raised before the model loads."""
    if torch.device(device).type != "cpu":
        raise ConfigError(f"{method} weights run on PyTorch's CPU kernels; on {device} use "
                          "--quantization none")
    if dtype != torch.bfloat16:
        raise ConfigError(f"{method} weights need bfloat16 activations, not "
                          f"{str(dtype).removeprefix('torch.')}; use --dtype bfloat16 (or auto)")
    odd = sorted({k for k in in_features if k % GROUP})
    if method == "int4" and odd:
        raise ConfigError(f"int4 needs input sizes divisible by {GROUP}, the model has "
                          f"{', '.join(map(str, odd))}; use --quantization int8")


def quantize_linears(model: nn.Module, method: str, lm_head_method: str,
                     keep_dense: bool = True, kernels: CpuKernels | None = None) -> None:
    """Swap every nn.Linear for a PackedLinear, in place: `method` for the decoder layers,
    `lm_head_method` for the output projection (the most sensitive to rounding). An int8
    output projection runs on the compiled kernel where it can (KernelInt8Linear)."""
    for parent, name, linear in list(linear_modules(model)):
        head = name == "lm_head"
        if head and lm_head_method == "int8" and KernelInt8Linear.fits(linear, kernels):
            act_group = HEAD_ACT_GROUP if method == "int4" else None
            setattr(parent, name, KernelInt8Linear(linear, kernels, act_group))
            continue
        # the output projection's dense weight may be the embedding's: reordering it would
        # make a second copy, so it stays as it is
        setattr(parent, name, PackedLinear(linear, lm_head_method if head else method,
                                           keep_dense, prepack_dense=not head,
                                           kernels=kernels))


def use_brgemm_prefill(model: nn.Module, kernels: CpuKernels) -> int:
    """The decoder's projections (the PackedLinears whose dense weight oneDNN keeps
    prepacked; not an output projection, whose weight may be the embedding's) on
    brgemm_linear for prompt rows: the "bfloat16-brgemm" prefill matmuls. Returns how many."""
    return sum(m.use_brgemm_dense(kernels) for m in model.modules()
               if isinstance(m, PackedLinear) and m.prepacked)


def share_step_rows(model: nn.Module) -> StepRows:
    """One StepRows for every PackedLinear of the model, returned (rows_of_kind sets it): the
    first linear's, so that a model that both drafts and verifies keeps one."""
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    rows = (packed[0]._rows if packed else None) or StepRows()
    for module in packed:
        module._rows = rows
    return rows


@contextmanager
def rows_of_kind(rows: StepRows, prompt: bool | None) -> Iterator[None]:
    """The PackedLinears sharing `rows` (share_step_rows) take rows of this kind meanwhile."""
    saved, rows.prompt = rows.prompt, prompt
    try:
        yield
    finally:
        rows.prompt = saved


@contextmanager
def packed_everywhere(model: nn.Module) -> Iterator[None]:
    """Every batch size runs on the packed weights meanwhile: how a weight format's quality is
    measured (perplexity scores whole chunks, which would otherwise take the dense weight).
    A model whose compiled decode stack runs big steps on the int8 prompt weights
    (`int8_decode`) runs them through its layers meanwhile, where the packed weights serve."""
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    saved = [(m.max_packed_rows, m._rows) for m in packed]
    stack_int8 = getattr(model, "int8_decode", None)
    for module in packed:
        module.max_packed_rows, module._rows = 1 << 62, None
    if stack_int8:
        model.int8_decode = False
    try:
        yield
    finally:
        for module, (rows, kind) in zip(packed, saved):
            module.max_packed_rows, module._rows = rows, kind
        if stack_int8:
            model.int8_decode = stack_int8

"""One step's LoRA work: every adapter in the batch at once, in a few ops per projection.

For a projection with input x [T, in] and output y [T, out], each row with an adapter gets

    y[row] += (x[row] @ A) @ B          A [in, R], B [R, out]: its adapter's factors

for all adapters of the step at once: the gathered low-rank matmuls of punica / S-LoRA. No
weight is merged, no forward runs per adapter, rows of the base model cost nothing. Two forms:

- compiled (CPU, bfloat16 activations, AVX-512 BF16 and VNNI): one kernel call per
  projection (CpuKernels.lora_add) reads each adapter's factors once for all of its rows (A
  int8 per rank, B int8 per column: x A and t B on int8 dot products, x and t rounded per
  row), and skips the zero blocks of fused projections (q's ranks only write q's columns);
- torch: the rows of each adapter are gathered into a segment of its own, every segment
  padded to the longest, and y[rows] += bmm(bmm(x[rows], A), B) over the stacked factors
  (float32 on the CPU, the model's dtype elsewhere).

The stacks of a set of adapters are built once. The compiled form keeps one stack of every
adapter it has seen and not been told to forget (the registry bounds them): a step takes the
groups of its own, so requests coming and going never restack. The torch form keeps the
stacks of the few sets that ran last.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ember.kernels import CpuKernels
from ember.lora.adapter import PROJECTIONS, LoraAdapter

MAX_CACHED_SETS = 4


@dataclass(frozen=True)
class _Stacks:
    """Stacked factors of one ordered set of adapters, per layer and projection: (A [G, in, R],
    B [G, R, out]) for torch; for the kernel, (A in int8 quads and its scales: see
    _row_ranks, then B's nonzero blocks of 16 columns in int8, their scales and ranges: see
    _column_blocks)."""

    layers: list[dict[str, tuple[Tensor, ...]]]
    flat: list[Tensor]            # per layer, each projection's tensors; empty where none


@dataclass(frozen=True)
class _Rows:
    """Which rows each adapter takes. Kernel: rows [N] grouped by adapter, starts [G + 1].
    Torch: gather [G * L] (segments padded to the longest, L, with a repeat of a real row),
    pad [G * L, 1] (0 on padding rows) or None where every segment is full."""

    gather: Tensor
    pad: Tensor | None
    groups: int
    starts: Tensor | None = None


class LoraLayer:
    """One layer's view of the step: add_(projection, y, x) adds the rows' adapters to y."""

    __slots__ = ("factors", "rows", "kernels")

    def __init__(self, factors: dict[str, tuple[Tensor, ...]], rows: _Rows,
                 kernels: CpuKernels | None) -> None:
        self.factors = factors
        self.rows = rows
        self.kernels = kernels

    def add_(self, projection: str, y: Tensor, x: Tensor) -> Tensor:
        """y[row] += (x[row] @ A) @ B for each row's adapter on this layer's `projection`;
        returns y."""
        factors = self.factors.get(projection)
        if factors is None:
            return y
        rows = self.rows
        if self.kernels is not None:
            self.kernels.lora_add(y, x, rows.gather, rows.starts, *factors)
            return y
        a, b = factors
        xs = x.index_select(0, rows.gather).to(a.dtype)
        if rows.pad is not None:
            xs.mul_(rows.pad)
        delta = torch.bmm(torch.bmm(xs.view(rows.groups, -1, xs.shape[1]), a), b)
        return y.index_add_(0, rows.gather, delta.view(-1, delta.shape[2]).to(y.dtype))


class LoraStep:
    """The adapters of one step: layer(i) is what layer i applies."""

    def __init__(self, stacks: _Stacks, rows: _Rows, kernels: CpuKernels | None) -> None:
        self._stacks = stacks
        self._rows = rows
        self._kernels = kernels

    def layer(self, index: int) -> LoraLayer:
        return LoraLayer(self._stacks.layers[index], self._rows, self._kernels)

    def stack_tensors(self) -> list[Tensor]:
        """What the compiled decode stack takes (kernel form only): the rows grouped by
        adapter and their starts, then each layer's A, A's scales, B, B's scales and ranges
        per projection (empty tensors where none)."""
        if self._kernels is None:
            raise ValueError("the decode stack takes the kernel form of a LoRA step")
        return [self._rows.gather, self._rows.starts] + self._stacks.flat


class LoraStepBuilder:
    """Builds each step's LoraStep from the rows' adapters; keeps the stacks of recent sets
    (compiled form: one stack of every adapter it has seen and not forgotten)."""

    def __init__(self, dtype: torch.dtype, device: torch.device,
                 kernels: CpuKernels | None = None,
                 place: Callable[[list[Tensor]], list[Tensor]] | None = None) -> None:
        """`place`: copies the compiled form's stacked factors where a step reads them fastest
        (the engine's huge_page_copies); None keeps them where they are made."""
        # the compiled form where it runs (bfloat16 on AVX-512 BF16 + VNNI); else torch's, whose
        # factors are float32 on the CPU (twice the bfloat16 matmul rate there)
        self.kernels = kernels if kernels is not None and kernels.has_int8_dot \
            and dtype == torch.bfloat16 and device.type == "cpu" else None
        self.dtype = torch.bfloat16 if self.kernels is not None \
            else torch.float32 if device.type == "cpu" else dtype
        self.device = device
        self._sets: OrderedDict[tuple[int, ...], _Stacks] = OrderedDict()
        self._known: dict[int, LoraAdapter] = {}   # the compiled form's stacked adapters
        self._place = place

    def build(self, rows: list[tuple[LoraAdapter | None, int]]) -> LoraStep | None:
        """`rows`: (adapter or None for the base, number of rows) per request, in batch order.
        None where no row has an adapter (the base model's own fast paths then run)."""
        segments: dict[int, list[int]] = {}
        adapters: dict[int, LoraAdapter] = {}
        row = 0
        for adapter, n in rows:
            if adapter is not None:
                adapters.setdefault(adapter.uid, adapter)
                segments.setdefault(adapter.uid, []).extend(range(row, row + n))
            row += n
        if not adapters:
            return None
        if self.kernels is not None:
            # one stack of every adapter seen and not forgotten: a step takes the groups of
            # its own adapters (the others' are empty and cost nothing), so the set running can
            # change as requests come and go without restacking (~80 ms an adapter, on the
            # engine's thread)
            self._known.update(adapters)
            ordered = sorted(self._known.values(), key=lambda a: a.uid)
            stacks = self._stacks(ordered)
            grouped, starts = [], [0]
            for a in ordered:
                grouped += segments.get(a.uid, [])
                starts.append(len(grouped))
            return LoraStep(stacks, _Rows(torch.tensor(grouped), None, len(ordered),
                                          torch.tensor(starts)), self.kernels)
        ordered = sorted(adapters.values(), key=lambda a: a.uid)
        stacks = self._stacks(ordered)
        longest = max(len(s) for s in segments.values())
        gather, pad = [], []
        for a in ordered:
            seg = segments[a.uid]
            gather += seg + [seg[0]] * (longest - len(seg))
            pad += [1.0] * len(seg) + [0.0] * (longest - len(seg))
        padded = len(gather) > sum(len(s) for s in segments.values())
        return LoraStep(stacks, _Rows(
            torch.tensor(gather, device=self.device),
            torch.tensor(pad, dtype=self.dtype, device=self.device)[:, None] if padded
            else None, len(ordered)), None)

    def forget(self, uid: int) -> None:
        """Drop cached stacks that hold adapter `uid` (it was unloaded or evicted)."""
        self._known.pop(uid, None)
        for key in [k for k in self._sets if uid in k]:
            del self._sets[key]

    def _stacks(self, adapters: list[LoraAdapter]) -> _Stacks:
        key = tuple(a.uid for a in adapters)
        if key in self._sets:
            self._sets.move_to_end(key)
            return self._sets[key]
        stacks = _stack(adapters, self.dtype, self.device, self.kernels is not None,
                        self._place)
        self._sets[key] = stacks
        # the compiled form's one stack replaces the last (it holds all of its adapters)
        while len(self._sets) > (1 if self.kernels is not None else MAX_CACHED_SETS):
            self._sets.popitem(last=False)
        return stacks


def _stack(adapters: list[LoraAdapter], dtype: torch.dtype, device: torch.device,
           compiled: bool, place: Callable[[list[Tensor]], list[Tensor]] | None = None
           ) -> _Stacks:
    """Each layer's and projection's factors stacked over the adapters, each padded with
    zeros to the widest R (an adapter without the projection: all zeros); in the kernel's
    form (`compiled`: A in int8 quads, _row_ranks; B in column blocks, _column_blocks; then
    `place`d) or torch's."""
    widths = {p: max(a.width(p) for a in adapters) for p in PROJECTIONS}
    layers: list[dict[str, tuple[Tensor, ...]]] = []
    empty = torch.empty(0, dtype=dtype, device=device)
    none = (empty,) * 5 if compiled else (empty, empty)
    for i in range(len(adapters[0].factors)):
        layer = {}
        for p, width in widths.items():
            if width == 0:
                continue
            shapes = next(a.factors[i][p] for a in adapters if p in a.factors[i])
            a_stack = torch.zeros(len(adapters), shapes[0].shape[0], width)
            b_stack = torch.zeros(len(adapters), width, shapes[1].shape[1])
            for g, adapter in enumerate(adapters):
                if p in adapter.factors[i]:
                    a, b = adapter.factors[i][p]
                    a_stack[g, :, :a.shape[1]] = a
                    b_stack[g, :b.shape[0]] = b
            if compiled:
                layer[p] = (*_row_ranks(a_stack.transpose(1, 2)), *_column_blocks(b_stack))
            else:
                layer[p] = (a_stack.to(dtype=dtype, device=device),
                            b_stack.to(dtype=dtype, device=device))
        layers.append(layer)
    if compiled and place is not None:   # read every step, mostly from memory
        kept = iter(place([t for layer in layers for f in layer.values() for t in f]))
        layers = [{p: tuple(next(kept) for _ in f) for p, f in layer.items()} for layer in layers]
    flat = [t for layer in layers for p in PROJECTIONS for t in layer.get(p, none)]
    return _Stacks(layers, flat)


def _row_ranks(a: Tensor) -> tuple[Tensor, Tensor]:
    """A [G, R, in] float32 -> the kernel's (a [G, ceil(in / 4), R16, 4] int8, scales [G, 2,
    R16] float32), R16 = R rounded up to 16 (zero ranks): each rank's row rounded to int8
    (scale: its largest magnitude / 127), laid out by quads of inputs, a quad of every rank
    in turn (the dot-product instruction's operand against a quad of x broadcast); scales
    holds per rank that scale and the sum of its int8 values."""
    g, r, n = a.shape
    scale = a.abs().amax(2) / 127                                   # [G, R]
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(a / scale[:, :, None]).to(torch.int8)
    r16, quads = -(-r // 16) * 16, -(-n // 4)
    scales = torch.stack([scale, q.sum(2, dtype=torch.int32).float()], 1)
    scales = torch.nn.functional.pad(scales, (0, r16 - r), value=1.0)
    scales[:, 1, r:] = 0.0
    q = torch.nn.functional.pad(q, (0, 4 * quads - n, 0, r16 - r))  # [G, R16, 4 quads]
    return q.view(g, r16, quads, 4).transpose(1, 2).contiguous(), scales.contiguous()


def _column_blocks(b: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """B [G, R, out] float32 -> the kernel's (b [G, Q, 64] int8, scales [G, 2, out] float32,
    ranges [ceil(out / 16), 3] int32). B is rounded to int8 per column (scale: its largest
    magnitude / 127); scales holds per column that scale and the sum of its int8 values.
    Per block of 16 columns, ranges gives the ranks [begin, end) holding any adapter's
    nonzero values there and where the block's quads start in b; b holds just those ranks of
    each block, in block order, by quads ([quads, 16, 4]: the dot-product instruction's
    operand; zero ranks complete the last quad; zeros past out). A block is so one
    sequential read, and the zero blocks of a fused projection (q's ranks in k's columns)
    are neither stored nor read."""
    g, r, out = b.shape
    scale = b.abs().amax(1) / 127                                   # [G, out]
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(b / scale[:, None]).to(torch.int8)
    scales = torch.stack([scale, q.sum(1, dtype=torch.int32).float()], 1).contiguous()
    blocks = (out + 15) // 16
    padded = torch.nn.functional.pad(q, (0, blocks * 16 - out, 0, 3))  # 3 zero ranks
    blocked = padded.view(g, r + 3, blocks, 16).permute(0, 2, 1, 3)    # [G, blocks, R + 3, 16]
    nonzero = (blocked[:, :, :r] != 0).any(3).any(0)                  # [blocks, R]
    ranks = torch.arange(r)
    begin = torch.where(nonzero, ranks, r).min(1).values
    end = torch.where(nonzero, ranks + 1, 0).max(1).values
    begin = torch.minimum(begin, end)
    parts, offsets, offset = [], [], 0
    for c in range(blocks):
        lo, quads = int(begin[c]), (int(end[c] - begin[c]) + 3) // 4
        rows = blocked[:, c, lo:lo + 4 * quads]
        if rows.shape[1] < 4 * quads:  # the last quad past R + 3: zeros
            rows = torch.nn.functional.pad(rows, (0, 0, 0, 4 * quads - rows.shape[1]))
        # [G, 4 quads, 16] -> [G, quads, 16, 4] -> flat as [G, quads, 64]
        parts.append(rows.reshape(g, quads, 4, 16).transpose(2, 3).reshape(g, quads, 64))
        offsets.append(offset)
        offset += quads
    ranges = torch.stack([begin, end, torch.tensor(offsets)], 1).to(torch.int32).contiguous()
    return torch.cat(parts, 1).contiguous(), scales, ranges

"""One step's LoRA work: every adapter in the batch at once, in a few ops per projection.

For a projection with input x [T, in] and output y [T, out], the rows of each adapter in the
step (g = 0 .. G-1) are gathered into a segment of its own, every segment padded to the
longest, L rows (a padding row repeats a real one and is zeroed), and

    y[rows] += bmm(bmm(x[rows], A), B)      A [G, in, R], B [G, R, out] stacked per adapter

adds to each row its own adapter's update: the gathered low-rank matmuls of punica / S-LoRA,
as two batched matmuls whatever the number of adapters. Rows of the base model are not
gathered at all. No weight is merged, no forward runs per adapter. On the CPU the factors are
float32 (its float32 matmuls run at twice its bfloat16 rate). The stacks of a set of adapters
are built once and kept while the same set keeps running (a few sets, least recently used
out).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import Tensor

from ember.lora.adapter import PROJECTIONS, LoraAdapter

MAX_CACHED_SETS = 4


@dataclass(frozen=True)
class _Stacks:
    """Stacked factors of one ordered set of adapters, per layer and projection."""

    layers: list[dict[str, tuple[Tensor, Tensor]]]
    flat: list[Tensor]            # per layer, (A, B) per projection; empty where none


@dataclass(frozen=True)
class _Rows:
    """Which rows each adapter's segment gathers: gather [G * L], and pad [G * L, 1] (0 on
    padding rows) or None where every segment is full."""

    gather: Tensor
    pad: Tensor | None
    groups: int


class LoraLayer:
    """One layer's view of the step: add_(projection, y, x) adds the rows' adapters to y."""

    __slots__ = ("factors", "rows")

    def __init__(self, factors: dict[str, tuple[Tensor, Tensor]], rows: _Rows) -> None:
        self.factors = factors
        self.rows = rows

    def add_(self, projection: str, y: Tensor, x: Tensor) -> Tensor:
        """y[rows] += bmm(bmm(x[rows], A), B) for this layer's `projection`; returns y."""
        pair = self.factors.get(projection)
        if pair is None:
            return y
        a, b = pair
        rows = self.rows
        xs = x.index_select(0, rows.gather).to(a.dtype)
        if rows.pad is not None:
            xs.mul_(rows.pad)
        delta = torch.bmm(torch.bmm(xs.view(rows.groups, -1, xs.shape[1]), a), b)
        return y.index_add_(0, rows.gather, delta.view(-1, delta.shape[2]).to(y.dtype))


class LoraStep:
    """The adapters of one step: layer(i) is what layer i applies."""

    def __init__(self, stacks: _Stacks, rows: _Rows) -> None:
        self._stacks = stacks
        self._rows = rows

    def layer(self, index: int) -> LoraLayer:
        return LoraLayer(self._stacks.layers[index], self._rows)

    def stack_tensors(self) -> list[Tensor]:
        """What the compiled decode stack takes: the gather index and the padding mask (an
        empty tensor where none), then each layer's (A, B) per projection (empty where none)."""
        rows = self._rows
        pad = rows.pad if rows.pad is not None else rows.gather.new_empty(0, dtype=torch.float)
        return [rows.gather, pad] + self._stacks.flat


class LoraStepBuilder:
    """Builds each step's LoraStep from the rows' adapters; keeps the stacks of recent sets."""

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        # the factors' dtype: float32 on the CPU (twice the bfloat16 matmul rate there)
        self.dtype = torch.float32 if device.type == "cpu" else dtype
        self.device = device
        self._sets: OrderedDict[tuple[int, ...], _Stacks] = OrderedDict()

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
        ordered = sorted(adapters.values(), key=lambda a: a.uid)
        longest = max(len(s) for s in segments.values())
        gather, pad = [], []
        for a in ordered:
            seg = segments[a.uid]
            gather += seg + [seg[0]] * (longest - len(seg))
            pad += [1.0] * len(seg) + [0.0] * (longest - len(seg))
        padded = len(gather) > sum(len(s) for s in segments.values())
        return LoraStep(self._stacks(ordered), _Rows(
            torch.tensor(gather, device=self.device),
            torch.tensor(pad, dtype=self.dtype, device=self.device)[:, None] if padded
            else None, len(ordered)))

    def forget(self, uid: int) -> None:
        """Drop cached stacks that hold adapter `uid` (it was unloaded or evicted)."""
        for key in [k for k in self._sets if uid in k]:
            del self._sets[key]

    def _stacks(self, adapters: list[LoraAdapter]) -> _Stacks:
        key = tuple(a.uid for a in adapters)
        if key in self._sets:
            self._sets.move_to_end(key)
            return self._sets[key]
        stacks = _stack(adapters, self.dtype, self.device)
        self._sets[key] = stacks
        while len(self._sets) > MAX_CACHED_SETS:
            self._sets.popitem(last=False)
        return stacks


def _stack(adapters: list[LoraAdapter], dtype: torch.dtype, device: torch.device) -> _Stacks:
    """A [G, in, R] and B [G, R, out] per layer and projection, each adapter's factors padded
    with zeros to the widest R (an adapter without the projection: all zeros)."""
    widths = {p: max(a.width(p) for a in adapters) for p in PROJECTIONS}
    layers, flat = [], []
    empty = torch.empty(0, dtype=dtype, device=device)
    for i in range(len(adapters[0].factors)):
        layer = {}
        for p, width in widths.items():
            if width == 0:
                continue
            shapes = next(a.factors[i][p] for a in adapters if p in a.factors[i])
            a_stack = torch.zeros(len(adapters), shapes[0].shape[0], width, dtype=dtype)
            b_stack = torch.zeros(len(adapters), width, shapes[1].shape[1], dtype=dtype)
            for g, adapter in enumerate(adapters):
                if p in adapter.factors[i]:
                    a, b = adapter.factors[i][p]
                    a_stack[g, :, :a.shape[1]] = a
                    b_stack[g, :b.shape[0]] = b
            layer[p] = (a_stack.to(device), b_stack.to(device))
        layers.append(layer)
        flat += [t for p in PROJECTIONS for t in layer.get(p, (empty, empty))]
    return _Stacks(layers, flat)

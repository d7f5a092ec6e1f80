"""One step's LoRA work: every adapter in the batch at once, for every row, in three ops.

For a projection with output y [T, out] and input x [T, in], the adapters of the step (a, b, ...)
are stacked side by side: A = [A_a | A_b | ...] [in, R], B = [B_a; B_b; ...] [R, out]. Then

    y += ((x @ A) * mask) @ B        mask[t, j] = 1 where column j belongs to row t's adapter

is each row's own adapter applied to it (rows of the base model have an all-zero mask row).
That is the gathered low-rank matmul of punica / S-LoRA done with dense ops: two thin matmuls
and a multiply per projection whatever the number of adapters, no Python loop over adapters or
rows, and never a forward per adapter. The stacks of a set of adapters are built once and kept
while the same set keeps running (a few sets, least recently used first out).
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
    """Stacked factors of one ordered set of adapters, per layer and projection, and which
    adapter (its position in the set) owns each stacked column."""

    layers: list[dict[str, tuple[Tensor, Tensor]]]
    owners: dict[str, Tensor]     # projection -> [R] long
    flat: list[Tensor]            # per layer, (A, B) per projection; empty where none


class LoraLayer:
    """One layer's view of the step: add_(projection, y, x) adds the rows' adapters to y."""

    __slots__ = ("factors", "masks")

    def __init__(self, factors: dict[str, tuple[Tensor, Tensor]], masks: dict[str, Tensor]):
        self.factors = factors
        self.masks = masks

    def add_(self, projection: str, y: Tensor, x: Tensor) -> Tensor:
        """y += ((x @ A) * mask) @ B for this layer's `projection`; returns y."""
        pair = self.factors.get(projection)
        if pair is None:
            return y
        a, b = pair
        shrunk = torch.mm(x, a).mul_(self.masks[projection])
        if y.is_contiguous():
            return y.addmm_(shrunk, b)
        return y + torch.mm(shrunk, b)


class LoraStep:
    """The adapters of one step: layer(i) is what layer i applies."""

    def __init__(self, stacks: _Stacks, masks: dict[str, Tensor]) -> None:
        self._stacks = stacks
        self._masks = masks

    def layer(self, index: int) -> LoraLayer:
        return LoraLayer(self._stacks.layers[index], self._masks)

    def stack_tensors(self) -> list[Tensor]:
        """What the compiled decode stack takes: the 4 projections' masks, then each layer's
        (A, B) per projection, an empty tensor where there is none."""
        empty = self._stacks.flat[0].new_empty(0) if self._stacks.flat else torch.empty(0)
        return [self._masks.get(p, empty) for p in PROJECTIONS] + self._stacks.flat


class LoraStepBuilder:
    """Builds each step's LoraStep from the rows' adapters; keeps the stacks of recent sets."""

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        self.dtype = dtype
        self.device = device
        self._sets: OrderedDict[tuple[int, ...], _Stacks] = OrderedDict()

    def build(self, rows: list[tuple[LoraAdapter | None, int]]) -> LoraStep | None:
        """`rows`: (adapter or None for the base, number of rows) per request, in batch order.
        None where no row has an adapter (the base model's own fast paths then run)."""
        adapters: dict[int, LoraAdapter] = {}
        for adapter, _ in rows:
            if adapter is not None:
                adapters.setdefault(adapter.uid, adapter)
        if not adapters:
            return None
        ordered = sorted(adapters.values(), key=lambda a: a.uid)
        stacks = self._stacks(ordered)
        position = {a.uid: i for i, a in enumerate(ordered)}
        row_owner = torch.tensor([position[a.uid] if a is not None else -1
                                  for a, n in rows for _ in range(n)], device=self.device)
        masks = {p: (row_owner[:, None] == owners[None, :]).to(self.dtype)
                 for p, owners in stacks.owners.items()}
        return LoraStep(stacks, masks)

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
    owners = {}
    for p in PROJECTIONS:
        widths = [a.width(p) for a in adapters]
        if sum(widths):
            owners[p] = torch.repeat_interleave(torch.arange(len(adapters)),
                                                torch.tensor(widths)).to(device)
    layers, flat = [], []
    empty = torch.empty(0, dtype=dtype, device=device)
    for i in range(len(adapters[0].factors)):
        layer = {}
        for p in owners:
            pairs = [a.factors[i][p] for a in adapters if p in a.factors[i]]
            layer[p] = (torch.cat([a for a, _ in pairs], dim=1).to(device, dtype).contiguous(),
                        torch.cat([b for _, b in pairs], dim=0).to(device, dtype).contiguous())
        layers.append(layer)
        flat += [t for p in PROJECTIONS for t in layer.get(p, (empty, empty))]
    return _Stacks(layers, owners, flat)

"""The LoRA adapters of a model split over ranks: every rank holds its part of each adapter
its steps name (A split like its base weight's input, B like its output; its stage's
layers), and all ranks hold the same set.

The driver alone reads adapters (the registry); each step carries, with its plan, which
adapter uid each of its adapter names stands for, the uids to drop first (evicted or
unloaded since the last step) and the whole adapters no rank holds yet, from which each rank
cuts its part. Every rank applies them in step order, before the step's forward, so a load
at run time reaches the ranks with the first step that uses it. In one process this is the
same path with the whole adapter as the one rank's part.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ember.lora.adapter import LoraAdapter

# the part of a whole adapter one rank applies (identity in one process)
AdapterPart = Callable[[LoraAdapter], LoraAdapter]


@dataclass(frozen=True)
class StepAdapters:
    """One step's adapters as every rank resolves them: uids by adapter name, the uids to
    forget first, then the adapters to take in (whole; each rank keeps its part)."""

    uids: dict[str, int]
    forgets: tuple[int, ...] = ()
    loads: tuple[LoraAdapter, ...] = ()


class RankAdapters:
    """This rank's part of each adapter its steps have named, by uid."""

    def __init__(self, part: AdapterPart | None = None,
                 on_forget: Callable[[int], None] | None = None) -> None:
        self._part = part
        self._on_forget = on_forget   # told each uid dropped (its cached stacks go too)
        self._parts: dict[int, LoraAdapter] = {}

    def plan(self, adapters: dict[str, LoraAdapter], evicted: list[int]
             ) -> tuple[StepAdapters, list[int]]:
        """The driver's side: the StepAdapters of a step naming `adapters` (by name, as the
        registry has them now), given the uids evicted since the last step. An evicted uid
        the step still uses is held over to a later step (returned second), so that the
        step runs on the part every rank holds; an adapter whose files changed under the same
        uid (its digest differs) is loaded again."""
        uids = {name: a.uid for name, a in adapters.items()}
        used = set(uids.values())
        forgets = tuple(dict.fromkeys(u for u in evicted if u not in used))
        later = [u for u in evicted if u in used]
        loads = {}
        for adapter in adapters.values():
            held = self._parts.get(adapter.uid)
            if held is None or held.digest != adapter.digest:
                loads[adapter.uid] = adapter
        return StepAdapters(uids, forgets, tuple(loads.values())), later

    def apply(self, step: StepAdapters) -> None:
        """Forget, then take in, what the step says (every rank, before its forward)."""
        for uid in step.forgets:
            self._drop(uid)
        for adapter in step.loads:
            self._drop(adapter.uid)
            self._parts[adapter.uid] = adapter if self._part is None else self._part(adapter)

    def _drop(self, uid: int) -> None:
        if self._parts.pop(uid, None) is not None and self._on_forget is not None:
            self._on_forget(uid)

    def get(self, uid: int) -> LoraAdapter:
        return self._parts[uid]

    def __len__(self) -> int:
        return len(self._parts)

"""`--prefill-matmul auto`: the matmuls prompt rows run on, chosen by timing them here.

A prompt step is bound by its projections' multiply-adds, and which matmul does them fastest
depends on the CPU: on AVX-512 VNNI ember's int8 tiles (SmoothQuant int8 activations on int8
weights) beat oneDNN's bfloat16 matmul, while on a CPU with AMX oneDNN runs bfloat16 on the
tile unit, which the int8 tiles do not use. So the first load of a model on a machine times
every candidate that runs here (ember/engine/matmul_timing.py: one decoder layer's
projections at the model's shapes, PROMPT_ROWS rows, in alternating rounds) and keeps the
fastest whose outputs stay within MAX_ERROR of float32's. The incumbent, int8 wherever it
runs (the rule before measuring), gives way only to a candidate at least MARGIN times as
fast in every round, so that a busy machine's noise (other processes stalling a parallel
region can make a step several times slower, either candidate's) never turns into a switch.
A settled choice (every round agrees) and its timings are kept beside the weight cache
(ChoiceStore), keyed by what they depend on (choice_fields: another CPU, thread count,
model, weight format or kernel build measures again) and read back on later loads without
timing; an unsettled one keeps the incumbent and is measured again at the next load. On a
machine already busy (busy_cpus) nothing is timed: where other processes hold the cores a
parallel region waits for a descheduled thread, which on a shared 2-vCPU machine made both
candidates 20-40x slower and the int8 one consistently more so; the incumbent runs and a
later load measures.
Without a weight cache (`--no-weight-cache`, `LLM(...)` without weight_cache_dir) there is
nowhere to keep a choice, and auto keeps the rule rather than time every load.
`--prefill-matmul int8|bfloat16` skips all of it.

Only prompt rows are chosen here. Decode rows keep their paths (the packed weights up to 8
rows; beyond, the prompt rows' dense weights), so a row's kernel depends on its kind alone,
never on a step's row count (docs/architecture.md, "Same request, same answer").
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ember.config import ModelConfig
from ember.engine.matmul_timing import (PROMPT_ROWS, Timing, layer_projections,
                                        measure_candidates)
from ember.kernels import CpuKernels, cpu_flags
from ember.weights.cache import CHOICES
from ember.weights.loader import resolve_prefill_matmul

log = logging.getLogger(__name__)

BUSY_SLACK = 1.0    # load beyond the CPUs torch leaves free that still counts as idle
MARGIN = 1.1        # a challenger must take under 1 / MARGIN of the incumbent's time
# a projection's mean |error| against float32, as a share of its outputs' mean size: a guard
# against a path that computes something else (a layout or kernel broken on this CPU). On
# random values int8 activations cost 1-2%, bfloat16 0.2-0.4%; that those roundings stay
# within each weight format's perplexity budget (int8_act_group's rule) is tested on the
# default model (tests/reference/test_packed_weights.py)
MAX_ERROR = 0.05
FORMAT = 1          # raised when what a stored choice means changes
KEEP = 32           # stored choices kept (the most recently written)
Measure = Callable[[Sequence[str]], tuple[Timing, ...]]


@dataclass(frozen=True)
class PrefillChoice:
    """What prompt rows run on, and how that was decided."""

    prefill_matmul: str            # "int8" or "bfloat16"
    how: str                       # "measured", "measured before", "asked", ...
    timings: tuple[Timing, ...] = ()

    def describe(self) -> str:
        """E.g. "int8 (measured: int8 1.80 ms, bfloat16 3.50 ms a layer at 256 prompt
        rows)"."""
        each = ", ".join(f"{t.name} {t.seconds * 1e3:.2f} ms" +
                         (f" (off by {t.error:.1%})" if t.error > MAX_ERROR else "")
                         for t in self.timings)
        timed = f": {each} a layer at {PROMPT_ROWS} prompt rows" if each else ""
        return f"{self.prefill_matmul} ({self.how}{timed})"

    def as_dict(self) -> dict[str, Any]:
        return {"prefill_matmul": self.prefill_matmul, "how": self.how,
                "timings": [asdict(t) for t in self.timings]}


def resolve_prefill_choice(asked: str, method: str, kernels: CpuKernels | None,
                           config: ModelConfig, model_path: Path,
                           cache_dir: Path | None) -> PrefillChoice:
    """EngineConfig.prefill_matmul for this model and machine: an asked one checked
    (resolve_prefill_matmul), auto chosen (module docstring) with the choice kept in
    `cache_dir` (the weight cache's folder; None: nowhere)."""
    if asked != "auto":
        return PrefillChoice(resolve_prefill_matmul(asked, method, kernels), "asked")
    candidates = prefill_candidates(method, kernels)
    fields = choice_fields(cpu_flags(), torch.get_num_threads(), model_path, config, method,
                           candidates, kernels)
    store = None if cache_dir is None else ChoiceStore(cache_dir / CHOICES)
    projections = layer_projections(config)
    return choose_prefill_matmul(
        asked, candidates, fields, store,
        lambda names: measure_candidates(names, projections, method, kernels),
        busy=busy_cpus(_load_average(), os.cpu_count() or 1, torch.get_num_threads()))


def _load_average() -> float:
    """The 1-minute load average; 0 where the OS gives none."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0.0


def busy_cpus(load: float, cpus: int, threads: int, slack: float = BUSY_SLACK) -> str | None:
    """Why the machine is too busy to time matmuls on `threads` threads (its 1-minute load
    average is over the CPUs they leave free, plus `slack`), or None."""
    if load <= cpus - threads + slack:
        return None
    return f"load {load:.1f} on {cpus} CPUs"


def prefill_candidates(method: str, kernels: CpuKernels | None) -> list[str]:
    """The candidates that run here, the incumbent first: int8 where it runs (packed weights,
    the compiled kernels with AVX-512 BF16); bfloat16 (oneDNN); and bfloat16-brgemm where
    torch's brgemm runs oneDNN's ukernel (AMX: elsewhere it falls back to a GEMM per block,
    several times slower than oneDNN's). An AMX int8 path would join them; ember has none
    yet (torch's int8 brgemm runs only on AMX, where it could not be tested)."""
    names = ["int8", "bfloat16"] if resolve_prefill_matmul("auto", method, kernels) == "int8" \
        else ["bfloat16"]
    if method != "none" and kernels is not None and kernels.brgemm_vnni:
        names.append("bfloat16-brgemm")
    return names


def choose_prefill_matmul(asked: str, candidates: Sequence[str], fields: dict[str, Any],
                          store: ChoiceStore | None, measure: Measure,
                          busy: str | None = None) -> PrefillChoice:
    """`asked` as it is, or for "auto": the only candidate; the choice `store` keeps for
    `fields`; without a store, or on a machine `busy` (why), the incumbent (candidates[0]);
    else every candidate measured (`measure`), picked and, where settled, stored."""
    if asked != "auto":
        return PrefillChoice(asked, "asked")
    if len(candidates) == 1:
        return PrefillChoice(candidates[0], "the only candidate here")
    if store is None:
        return PrefillChoice(candidates[0], "not measured: no weight cache to keep it in")
    stored = store.read(fields)
    if stored is not None:
        return stored
    if busy is not None:
        return PrefillChoice(candidates[0], f"not measured: the machine is busy ({busy}); "
                                            "a later load measures")
    timings = measure(candidates)
    name, settled = pick(timings, candidates[0])
    if not settled:
        return PrefillChoice(name, "measured, unsettled: kept, to be measured again", timings)
    choice = PrefillChoice(name, "measured", timings)
    store.write(fields, choice)
    return choice


def pick(timings: Sequence[Timing], incumbent: str, margin: float = MARGIN,
         max_error: float = MAX_ERROR) -> tuple[str, bool]:
    """(the candidate to run, whether that is settled). Of the candidates within max_error,
    the fastest (by median) of those at least `margin` times as fast as the incumbent in
    every round (`rounds`, or `seconds` alone where a timing has none); else the incumbent,
    settled where it was faster than each of them in every round. Where the incumbent is
    not within max_error, the fastest of the rest; bfloat16 (the reference's own rounding)
    where none is."""
    fit = [t for t in timings if t.error <= max_error]
    held = next((t for t in fit if t.name == incumbent), None)
    if held is None:
        if not fit:
            log.warning("no prefill matmul came within %.0f%% of float32 (%s); using "
                        "bfloat16", 100 * max_error,
                        ", ".join(f"{t.name} {t.error:.1%}" for t in timings))
        return (min(fit, key=lambda t: t.seconds).name if fit else "bfloat16"), True
    others = [t for t in fit if t is not held]
    faster = [t for t in others if _every_round(t, held, margin)]
    if faster:
        return min(faster, key=lambda t: t.seconds).name, True
    return incumbent, all(_every_round(held, t, 1.0) for t in others)


def _every_round(fast: Timing, slow: Timing, margin: float) -> bool:
    """Whether `fast` took under 1 / margin of `slow`'s time in every round they share."""
    pairs = list(zip(fast.rounds, slow.rounds)) or [(fast.seconds, slow.seconds)]
    return all(a * margin < b for a, b in pairs)


def choice_fields(flags: frozenset[str], threads: int, model_path: Path,
                  config: ModelConfig, method: str, candidates: Sequence[str],
                  kernels: CpuKernels | None) -> dict[str, Any]:
    """Everything a measured choice depends on: the CPU's flags and torch's threads, the
    model (its path and the shapes timed), its weights' format (which projections take
    int8), the candidates, torch and the compiled kernels' build."""
    so = getattr(kernels.ops, "__file__", "") if kernels is not None else ""
    stat = os.stat(so) if so else None
    return {"format": FORMAT, "cpu_flags": sorted(flags), "threads": threads,
            "model": str(model_path.resolve()),
            "shapes": [asdict(p) for p in layer_projections(config)], "weights": method,
            "candidates": list(candidates), "rows": PROMPT_ROWS, "torch": torch.__version__,
            "kernels": [so, stat.st_size, stat.st_mtime_ns] if stat else None}


class ChoiceStore:
    """Measured choices on disk: one small JSON file per choice_fields, named by their hash
    and holding them, so a choice is only ever read back for the same fields."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def _path(self, fields: dict[str, Any]) -> Path:
        digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()
        return self.folder / f"{digest[:32]}.json"

    def read(self, fields: dict[str, Any]) -> PrefillChoice | None:
        """The choice kept for `fields`; None where there is none (or it does not read)."""
        try:
            stored = json.loads(self._path(fields).read_text())
            if stored["fields"] != json.loads(json.dumps(fields)):
                return None
            timings = tuple(Timing(**(t | {"rounds": tuple(t.get("rounds", ()))}))
                            for t in stored["timings"])
            return PrefillChoice(stored["prefill_matmul"], "measured before", timings)
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def write(self, fields: dict[str, Any], choice: PrefillChoice) -> None:
        """Atomically (a file renamed into place), then all but the KEEP newest removed; a
        failing disk only logs (the next load measures again)."""
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=self.folder, suffix=".partial",
                                             delete=False) as f:
                json.dump({"fields": fields} | choice.as_dict(), f)
            os.replace(f.name, self._path(fields))
            kept = sorted(self.folder.glob("*.json"), key=lambda p: p.stat().st_mtime,
                          reverse=True)
            for old in kept[KEEP:]:
                old.unlink(missing_ok=True)
        except OSError as e:
            log.warning("the prefill matmul choice could not be kept in %s (%s)",
                        self.folder, e)

"""Where a replica's start-up time goes, phase by phase, for /metrics (a fleet scales to zero
only if starting again is cheap, so each phase is reported on its own):

    process   interpreter start and imports, until the engine begins to load
    files     open the model files, read the tokenizer
    kernels   load (or build) the compiled CPU kernels
    weights   read, rename, fuse, cast and pack the weights (or map them from the weight
              cache, ember/weights/cache.py)
    kv_cache  plan and allocate the KV cache, build the scheduler and runner
    calibrate the int8 prompt matmuls' calibration prompt (none when the weights came from
              the cache, which holds its result)
    cache_write  save the weight cache (only on a start that missed it)
    warm_up   one short generation
"""
from __future__ import annotations

import os
import time


def process_age_s() -> float | None:
    """Seconds since this process started (Linux /proc; None elsewhere)."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime_s = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return max(0.0, uptime_s - start_ticks / os.sysconf("SC_CLK_TCK"))


class PhaseClock:
    """Seconds spent in each named phase, in order: `mark(name)` ends the phase `name`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = now - self._last
        self._last = now

"""A uvicorn server that stops cleanly on SIGTERM or SIGINT: `on_drain` runs first (readiness
turns 503), uvicorn stops accepting connections and lets in-flight requests finish within
`timeout_graceful_shutdown`, and the process exits 0. Plain Python and uvicorn (no torch), so
both `ember serve` and the `ember route` gateway use it."""
from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType

import uvicorn


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, on_drain: Callable[[], None]) -> None:
        super().__init__(config)
        self.on_drain = on_drain

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.on_drain()
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn re-raises the signal after shutting down, so the process dies of it (exit
        143 for SIGTERM); a drained stop is a clean one, so the process exits 0 instead."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit)
                    for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

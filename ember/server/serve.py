"""Run the app under uvicorn, draining on SIGTERM."""
from __future__ import annotations

import contextlib
import logging
import signal
import sys
import threading
import time
from collections.abc import Iterator
from types import FrameType

import uvicorn

from ember.config import EngineConfig, ServerConfig
from ember.engine.async_engine import AsyncEngine, EngineState
from ember.server.app import create_app
from ember.server.state import ServerState


log = logging.getLogger(__name__)

# A dead engine's process lingers this long, answering /health/live 503 (so a prober sees why),
# then exits 1 so its supervisor restarts it.
DEAD_EXIT_AFTER_S = 2.0


class DrainingServer(uvicorn.Server):
    """On SIGTERM or SIGINT, mark the app draining (readiness and new requests answer 503)
    before uvicorn stops accepting connections and lets in-flight requests finish within
    `timeout_graceful_shutdown`; then the engine stops and the process exits 0."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.ember_state = state
        self.engine_died_at: float | None = None

    async def on_tick(self, counter: int) -> bool:
        """uvicorn's ~10 Hz tick: also stop the server once the engine has died."""
        if self.ember_state.engine.state is EngineState.DEAD:
            now = time.monotonic()
            if self.engine_died_at is None:
                self.engine_died_at = now
                log.error("the engine died (%s); exiting in %.0f s so a supervisor restarts "
                          "the server", self.ember_state.engine.error, DEAD_EXIT_AFTER_S)
            elif now - self.engine_died_at >= DEAD_EXIT_AFTER_S:
                self.ember_state.draining = True
                return True
        return await super().on_tick(counter)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.ember_state.draining = True
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn re-raises the signal after shutting down, so the process dies of it; a
        drained SIGTERM is a clean stop, so ember exits 0 instead."""
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


def serve(engine_config: EngineConfig, config: ServerConfig) -> None:
    engine = AsyncEngine(engine_config, max_waiting=config.max_waiting,
                         request_timeout_s=config.request_timeout_s,
                         stall_timeout_s=config.stall_timeout_s)
    app = create_app(engine, config)
    uv_config = uvicorn.Config(app, host=config.host, port=config.port, log_level="info",
                               timeout_graceful_shutdown=config.drain_timeout_s,
                               access_log=False)
    print(f"ember: serving {app.state.ember.model_name} on http://{config.host}:{config.port} "
          "(chat page at /, readiness at /health/ready)", file=sys.stderr, flush=True)
    server = DrainingServer(uv_config, app.state.ember)
    server.run()
    if engine.state is EngineState.DEAD:
        sys.exit(1)

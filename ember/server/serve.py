"""Run the app under uvicorn, draining on SIGTERM."""
from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType

import uvicorn

from ember.config import EngineConfig, ServerConfig
from ember.engine.async_engine import AsyncEngine
from ember.server.app import create_app
from ember.server.state import ServerState


class DrainingServer(uvicorn.Server):
    """On SIGTERM or SIGINT, mark the app draining (readiness and new requests answer 503)
    before uvicorn stops accepting connections and lets in-flight requests finish within
    `timeout_graceful_shutdown`; then the engine stops and the process exits 0."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.ember_state = state

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
    DrainingServer(uv_config, app.state.ember).run()

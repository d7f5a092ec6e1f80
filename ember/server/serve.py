"""Run the app under uvicorn, draining on SIGTERM."""
from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections.abc import Iterator

import uvicorn

from ember.config import ServerConfig
from ember.engine.async_engine import AsyncEngine, EngineState
from ember.server.app import create_app
from ember.server.exit import GracefulServer
from ember.server.state import ServerState


log = logging.getLogger(__name__)

# A dead engine's process lingers this long, answering /health/live 503 (so a prober sees why),
# then exits 1 so its supervisor restarts it.
DEAD_EXIT_AFTER_S = 2.0


class DrainingServer(GracefulServer):
    """On SIGTERM or SIGINT, mark the app draining (readiness and new requests answer 503)
    before uvicorn stops accepting connections and lets in-flight requests finish within
    `timeout_graceful_shutdown`; then the engine stops and the process exits 0."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config, lambda: setattr(state, "draining", True))
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


def serve(engine: AsyncEngine, config: ServerConfig) -> None:
    """Serve `engine` (started already, or started here by the app) until SIGTERM."""
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


@contextlib.contextmanager
def serve_in_thread(engine: AsyncEngine, config: ServerConfig) -> Iterator[str]:
    """`engine` served as `ember serve` serves it, by uvicorn on a thread of this process (on
    `config.port`, 0 for a free one), until the block ends; yields the server's URL once it
    listens (the engine may still be loading: wait for /health/ready)."""
    app = create_app(engine, config)
    server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port,
                                           log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, name="ember-http", daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError(f"the server did not start on {config.host}:{config.port}")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://{config.host}:{port}"
    finally:
        server.should_exit = True
        thread.join(config.drain_timeout_s)

"""A real ember server on 127.0.0.1 (uvicorn in a thread), over the tiny random model."""
from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn

from ember.config import EngineConfig, ServerConfig
from ember.engine.async_engine import AsyncEngine
from ember.server.app import create_app


# a test server's KV cache: the tiny models' tokens are small, and an idle server pages
# its whole cache in (1 GiB: ~4 s of a core on a shared 2-core machine)
TEST_KV_GIB = 0.125


class ThreadedServer:
    """An ASGI app served by uvicorn in a daemon thread, on a free port of 127.0.0.1."""

    def __init__(self, app, log_level: str = "warning") -> None:
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0,
                                                    log_level=log_level, access_log=False))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)


class LiveServer(ThreadedServer):
    def __init__(self, model: Path | str, engine_options: dict | None = None,
                 wait_ready: bool = True, **server_options) -> None:
        self.config = ServerConfig(port=0, **server_options)
        options = {"kv_cache_gib": TEST_KV_GIB, "dtype": "float32", **(engine_options or {})}
        self.engine = AsyncEngine(EngineConfig.from_options(model=str(model), **options),
                                  max_waiting=self.config.max_waiting,
                                  request_timeout_s=self.config.request_timeout_s,
                                  stall_timeout_s=self.config.stall_timeout_s)
        self.app = create_app(self.engine, self.config)
        self.state = self.app.state.ember
        super().__init__(self.app)
        if wait_ready:
            self.wait_ready()

    def wait_ready(self, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while httpx.get(self.url + "/health/ready").status_code != 200:
            if time.monotonic() > deadline:
                raise RuntimeError("the test server never became ready")
            time.sleep(0.05)

    def delay_steps(self, seconds: float = 0.0, gate: threading.Event | None = None) -> None:
        """Make every engine step wait `seconds` (and for `gate`, if given) before it runs:
        slow phases become long enough to catch, a held gate looks like a stalled engine."""
        real_step = self.engine.core.step

        def delayed_step(only=None):
            if gate is not None:
                gate.wait(30)
            time.sleep(seconds)
            return real_step(only)
        self.engine.core.step = delayed_step

    @property
    def scheduler(self):
        return self.engine.core.scheduler

    def wait_idle(self, timeout_s: float = 10) -> None:
        """Until the engine has no request and every KV block is free again."""
        deadline = time.monotonic() + timeout_s
        while True:
            stats, kv = self.engine.stats, self.scheduler.kv
            if stats.num_running == stats.num_waiting == 0 and \
                    kv.num_free_blocks == kv.num_blocks and not self.scheduler.requests:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"engine not idle: {stats}, free blocks "
                                     f"{kv.num_free_blocks}/{kv.num_blocks}")
            time.sleep(0.01)

    def metric(self, name: str) -> float:
        """The value of one exposition line, e.g. 'ember_request_aborts_total{reason="x"}'."""
        for line in httpx.get(self.url + "/metrics").text.splitlines():
            if line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
        return 0.0


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    folder, _ = tiny_llama_dir
    live = LiveServer(folder, engine_options={"max_model_len": 512})
    yield live
    live.close()


@pytest.fixture(scope="module")
def client(server):
    import openai
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(folder, port: int, *extra: str, script: str | None = None) -> subprocess.Popen:
    """`ember serve` as a process on 127.0.0.1 (or `script` run with serve's arguments), with
    a test-sized KV cache unless `extra` sets one."""
    head = [sys.executable, "-c", script] if script else [sys.executable, "-m", "ember.cli"]
    kv = [] if "--kv-cache-gib" in extra else ["--kv-cache-gib", str(TEST_KV_GIB)]
    return subprocess.Popen([*head, "serve", "--model", str(folder), "--port", str(port), "-q",
                             *kv, *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def wait_ready(proc: subprocess.Popen, url: str, timeout_s: float = 120) -> None:
    """Until /health/ready answers 200; fails if the process exits first."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if httpx.get(url + "/health/ready").status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the server never became ready"
        time.sleep(0.2)

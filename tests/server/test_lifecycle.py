"""`ember serve` as a process: a dead engine exits non-zero; a drain is not held by open streams.

Each test runs a real server process on 127.0.0.1 over the tiny model. Waits are bounded
(generous, for slow machines); what is asserted is the outcome and its order, never a speed.
"""
from __future__ import annotations

import signal
import threading

import httpx

from tests.server.conftest import free_port, start_server, wait_ready

BREAK_THE_ENGINE = """
import sys
from ember.engine.async_engine import AsyncEngine

def broken(self, only=None):  # a fault of the engine itself, not of one request
    raise RuntimeError("injected: the engine broke")

AsyncEngine._step = broken
from ember.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_dead_engine_makes_the_process_exit_non_zero(tiny_llama_dir):
    folder, _ = tiny_llama_dir
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(folder, port, script=BREAK_THE_ENGINE)
    try:
        wait_ready(proc, url)
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4},
                       timeout=60)
        assert r.status_code == 503 and r.json()["error"]["type"] == "engine_dead_error"
        assert proc.wait(60) == 1, "a dead engine's server must exit non-zero"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_sigterm_closes_the_kv_event_stream_instead_of_waiting_for_it(tiny_llama_dir):
    """With a drain timeout longer than the test's own wait, an open /kv/events/stream that
    held the drain would make proc.wait time out."""
    folder, _ = tiny_llama_dir
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(folder, port, "--drain-timeout", "600")
    try:
        wait_ready(proc, url)
        opened, ended = threading.Event(), threading.Event()

        def listen() -> None:
            with httpx.stream("GET", url + "/kv/events/stream", timeout=None) as r:
                opened.set()
                for _ in r.iter_lines():
                    pass
            ended.set()

        thread = threading.Thread(target=listen, daemon=True)
        thread.start()
        assert opened.wait(30)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0
        assert ended.wait(10), "the event stream was cut, not ended"
    finally:
        if proc.poll() is None:
            proc.kill()

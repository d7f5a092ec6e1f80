"""`ember route --ray`: replicas as Ray actors on a local cluster (the one `ray start --head`
set up, else one started for the test), with the same routing and restarts as local ones."""
from __future__ import annotations

import os
import signal

import httpx
import pytest

from tests.router.test_route_processes import Route, ready_count

pytest.importorskip("ray")
pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def ray_route(tiny_llama_dir):
    folder, _ = tiny_llama_dir
    live = Route(folder, "--ray", "--replicas", "1")
    live.wait(lambda f: ready_count(f) == 1, "a Ray replica ready", 300)
    yield live
    live.close()


def test_a_ray_replica_answers_as_a_local_one(ray_route, replicas):
    ask = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    want = httpx.post(replicas[0].url + "/v1/completions", json=ask).json()
    got = httpx.post(ray_route.url + "/v1/completions", json=ask, timeout=60).json()
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    replica = ray_route.fleet()["replicas"][0]
    assert replica["url"].startswith("http://") and replica["pid"] > 0


def test_a_dead_ray_replica_is_restarted(ray_route):
    before = ray_route.fleet()["replicas"][0]
    os.kill(before["pid"], signal.SIGKILL)  # the actor's `ember serve`, on this machine
    after = ray_route.wait(lambda f: f["replicas"][0]["restarts"] >= 1 and
                           ready_count(f) == 1, "restarted", 300)["replicas"][0]
    assert after["pid"] != before["pid"]
    answer = httpx.post(ray_route.url + "/v1/completions",
                        json={"prompt": "again", "max_tokens": 4}, timeout=60)
    assert answer.status_code == 200

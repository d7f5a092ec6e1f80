"""Replicas as Ray actors, on a local Ray cluster of two CPUs started for these tests (each
replica's actor takes one): the same answers and routing as local replicas; the gateway keeps
an actor Ray restarts and starts a new one when its server dies, losing no request that had
not streamed; and it never waits on Ray, even for an actor the full cluster cannot place yet.
The reference for answers is a replica on its own."""
from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from ember.router.config import AutoscaleConfig
from tests.router.conftest import LiveGateway
from tests.router.test_route_processes import REPLICA_OPTIONS, Route, one_request, ready_count

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.ray

CLUSTER_CPUS = 2


@pytest.fixture(scope="module")
def cluster() -> str:
    """A new local Ray cluster (never one already running here); its address."""
    ray.init(address="local", num_cpus=CLUSTER_CPUS, include_dashboard=False,
             log_to_driver=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


def ray_gateway(folder, num_started: int = 0, **options) -> LiveGateway:
    from ember.router.ray_replicas import RayLauncher
    launcher = RayLauncher(["--model", str(folder), *REPLICA_OPTIONS])
    return LiveGateway({}, launchers={"primary": launcher}, num_started=num_started, **options)


def wait_fleet(gw: LiveGateway, predicate, what: str, timeout_s: float = 300) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        fleet = httpx.get(gw.url + "/fleet", timeout=60).json()
        if predicate(fleet):
            return fleet
        assert time.monotonic() < deadline, f"never {what}: {fleet}"
        time.sleep(0.2)


def replica(fleet: dict, replica_id: str) -> dict:
    return next(r for r in fleet["replicas"] if r["id"] == replica_id)


def served(gw: LiveGateway, replica_id: str) -> float:
    return gw.metric(f'ember_router_requests_total{{replica="{replica_id}",status="200",')


def short_answers(gw: LiveGateway, n: int) -> list[int]:
    return [httpx.post(gw.url + "/v1/completions", json={"prompt": f"short {i}",
                                                         "max_tokens": 4},
                       timeout=120).status_code for i in range(n)]


def test_a_ray_replica_answers_as_a_local_one(cluster, tiny_llama_dir, replicas):
    folder, _ = tiny_llama_dir
    route = Route(folder, "--ray", cluster, "--replicas", "1")
    try:
        route.wait(lambda f: ready_count(f) == 1, "a Ray replica ready", 300)
        ask = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
        want = httpx.post(replicas[0].url + "/v1/completions", json=ask).json()
        got = httpx.post(route.url + "/v1/completions", json=ask, timeout=60).json()
        assert got["choices"][0]["text"] == want["choices"][0]["text"]
        started = route.fleet()["replicas"][0]
        assert started["url"].startswith("http://") and started["pid"] > 0
    finally:
        route.close()


@ray.remote
class Hog:
    """Other work on the cluster, holding the CPUs it was placed with."""

    def ready(self) -> bool:
        return True


def test_a_replica_waiting_for_room_on_the_cluster_stalls_no_request(cluster, tiny_llama_dir):
    """A request to a cold fleet asks for a replica that the full cluster cannot place yet:
    the gateway holds it, and goes on answering everything else meanwhile."""
    folder, _ = tiny_llama_dir
    hog = Hog.options(num_cpus=ray.cluster_resources()["CPU"]).remote()
    ray.get(hog.ready.remote(), timeout=300)        # the cluster is full
    gw = ray_gateway(folder, hold_timeout_s=600, autoscale=AutoscaleConfig(
        min_replicas=0, max_replicas=1, scale_to_zero_after_s=600))
    try:
        with ThreadPoolExecutor(1) as pool:
            held = pool.submit(httpx.post, gw.url + "/v1/completions", timeout=600,
                               json={"prompt": "cold start", "max_tokens": 4})
            wait_fleet(gw, lambda f: f["replicas"], "asked for a replica", 60)
            lives = [httpx.get(gw.url + "/health/live", timeout=60).status_code
                     for _ in range(5)]
            fleet = httpx.get(gw.url + "/fleet", timeout=60).json()
            assert lives == [200] * 5
            # all the while its actor had not reported where it serves: not placed yet
            assert [(r["state"], r["url"]) for r in fleet["replicas"]] == [("starting", "")]
            assert not held.done()                  # held, not refused
            ray.kill(hog)                           # room: the replica starts
            assert held.result().status_code == 200
        assert replica(httpx.get(gw.url + "/fleet").json(), "p1")["url"].startswith("http://")
    finally:
        gw.close()
        ray.kill(hog)


@pytest.fixture(scope="module")
def ray_fleet(cluster, tiny_llama_dir):
    """Two Ray replicas, p1 and p2, filling the cluster; round-robin."""
    folder, _ = tiny_llama_dir
    gw = ray_gateway(folder, num_started=2, policy="round-robin", hold_timeout_s=300)
    gw.wait_ready(2, timeout_s=300)
    yield gw
    gw.close()


def assert_none_lost(results: list[dict]) -> None:
    """Every request answered, but a stream that had started may end with an error event."""
    lost = [r for r in results if (r["status"] != 200 or r["error"]) and not r["started"]]
    assert lost == []
    for r in results:
        if r["error"]:
            assert r["stream"] and r["started"] and r["error"]["code"] == 502


def kill_under_load(gw: LiveGateway, kill) -> tuple[list[dict], list[int]]:
    """12 long requests; `kill` p1 once 8 are in flight; then 4 short ones, sent once the
    gateway noticed, while p1 restarts. The long ones' results, and the short ones' statuses."""
    url = replica(httpx.get(gw.url + "/fleet").json(), "p1")["url"]
    with ThreadPoolExecutor(12) as pool:
        # long enough that the kill finds them running (~2 s for 160 tokens on 2 cores)
        futures = [pool.submit(one_request, gw.url, i, 400) for i in range(12)]
        wait_fleet(gw, lambda f: sum(r["in_flight"] for r in f["replicas"]) >= 8, "loaded",
                   60)
        kill()
        wait_fleet(gw, lambda f: replica(f, "p1")["state"] != "ready" or
                   replica(f, "p1")["url"] != url, "noticed", 60)
        during = short_answers(gw, 4)
        return [f.result() for f in futures], during


def test_an_actor_ray_restarts_under_load_keeps_its_replica(ray_fleet):
    gw = ray_fleet
    victim = gw.fleet.replicas["p1"]
    handle, before = victim.handle, replica(httpx.get(gw.url + "/fleet").json(), "p1")
    results, during = kill_under_load(
        gw, lambda: ray.kill(handle.actor, no_restart=False))   # Ray restarts it
    assert_none_lost(results)
    assert during == [200] * 4                      # routing went on, to p2
    after = replica(wait_fleet(gw, lambda f: replica(f, "p1")["state"] == "ready",
                               "ready again"), "p1")
    assert after["url"] != before["url"] and after["pid"] != before["pid"]
    assert after["restarts"] == before["restarts"] + 1
    assert gw.fleet.replicas["p1"].handle is handle    # the actor Ray restarted, kept
    routed = served(gw, "p1")
    assert short_answers(gw, 4) == [200] * 4
    assert served(gw, "p1") == routed + 2           # round-robin reaches it again


def test_a_ray_replicas_server_killed_under_load_comes_back_under_its_id(ray_fleet):
    gw = ray_fleet
    before = replica(wait_fleet(gw, lambda f: ready_count(f) == 2, "both ready"), "p1")
    retried = gw.metric("ember_router_retries_total")
    results, during = kill_under_load(gw, lambda: os.kill(before["pid"], signal.SIGKILL))
    assert_none_lost(results)
    assert gw.metric("ember_router_retries_total") - retried + \
        sum(r["error"] is not None for r in results) >= 1  # the kill did hit requests
    assert during == [200] * 4
    after = replica(wait_fleet(gw, lambda f: replica(f, "p1")["restarts"] > before["restarts"]
                               and replica(f, "p1")["state"] == "ready", "restarted"), "p1")
    assert after["url"] != before["url"] and after["pid"] != before["pid"]
    routed = served(gw, "p1")
    assert short_answers(gw, 4) == [200] * 4
    assert served(gw, "p1") == routed + 2


@pytest.mark.heavy
def test_an_actor_ray_gave_up_on_is_replaced_under_its_id(ray_fleet):
    gw = ray_fleet
    before = replica(wait_fleet(gw, lambda f: ready_count(f) == 2, "both ready"), "p2")
    handle = gw.fleet.replicas["p2"].handle
    ray.kill(handle.actor, no_restart=True)         # as Ray past the actor's restarts
    after = replica(wait_fleet(gw, lambda f: replica(f, "p2")["restarts"] > before["restarts"]
                               and replica(f, "p2")["state"] == "ready", "replaced"), "p2")
    assert after["url"] != before["url"]
    assert after["last_exit"]["log_tail"][0].startswith("Ray gave up on the actor")
    assert gw.fleet.replicas["p2"].handle is not handle     # a new actor
    assert short_answers(gw, 4) == [200] * 4

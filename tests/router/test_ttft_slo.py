"""--ttft-slo asks for a replica while the replicas answer slowly now: the time to first byte
is the replica's own (not a hold for a cold start), and only the look-back window's count."""
from __future__ import annotations

import asyncio
import threading
import time
import types

import httpx

from ember.router import proxy as proxy_module
from ember.router.autoscale import Autoscaler
from ember.router.config import AutoscaleConfig, RouterConfig
from ember.router.fleet import Fleet
from ember.router.replicas import RemoteHandle, Replica, ReplicaState
from tests.router.conftest import LiveGateway
from tests.router.fakes import FakeReplica

SLO = AutoscaleConfig(min_replicas=0, max_replicas=2, target_ongoing=4, look_back_s=5,
                      scale_down_delay_s=0, scale_to_zero_after_s=10, ttft_slo_s=0.5)


def test_an_old_slow_first_byte_does_not_keep_an_idle_fleet_from_zero():
    async def run() -> None:
        fleet = Fleet(RouterConfig(autoscale=SLO), {})
        replica = fleet.add(Replica("p1", RemoteHandle("http://127.0.0.1:1")))
        replica.state = ReplicaState.READY
        now = [0.0]
        scaler = Autoscaler(fleet, SLO, held=lambda: 0, clock=lambda: now[0])
        scaler.note_request(ttft_s=3.0)                  # one slow answer, long ago
        for t in range(1, 100):
            now[0] = float(t)
            scaler.step(now[0])
        assert replica.state is ReplicaState.DRAINING     # idle: down to zero
    asyncio.run(run())


class Launch:
    def __init__(self, url: str) -> None:
        self.url = url

    def start(self, replica_id: str) -> RemoteHandle:
        return RemoteHandle(self.url)


def test_the_ttft_is_the_replicas_not_the_hold_for_a_cold_start(monkeypatch):
    """The gateway's clock jumps 100 s while the request is held for a starting replica;
    the time to first byte it records leaves that out."""
    skew = [0.0]
    monkeypatch.setattr(proxy_module, "time", types.SimpleNamespace(
        monotonic=lambda: time.monotonic() + skew[0]))
    cold = FakeReplica("ok")
    cold.ready = False
    gw = LiveGateway({}, launchers={"primary": Launch(cold.url)}, hold_timeout_s=1000)
    ttfts: list[float] = []
    gw.gateway.proxy.on_first_byte = ttfts.append
    try:
        answer: list[httpx.Response] = []
        ask = threading.Thread(target=lambda: answer.append(httpx.post(
            gw.url + "/v1/completions", json={"prompt": "cold"}, timeout=60)))
        ask.start()
        deadline = time.monotonic() + 20
        while gw.gateway.proxy.held == 0:
            assert time.monotonic() < deadline, "the request was never held"
            time.sleep(0.02)
        skew[0] = 100.0                                   # a long cold start
        cold.ready = True
        ask.join(30)
        assert answer[0].status_code == 200
        assert len(ttfts) == 1 and ttfts[0] < 100
    finally:
        gw.close()
        cold.close()

"""The autoscaler's decisions over recorded load, and its loop over a fake launcher."""
from __future__ import annotations

import asyncio

from ember.router.autoscale import Autoscaler, Sample, decide
from ember.router.config import AutoscaleConfig, RouterConfig
from ember.router.fleet import Fleet
from ember.router.replicas import RemoteHandle, ReplicaState

CFG = AutoscaleConfig(min_replicas=1, max_replicas=4, target_ongoing=4, look_back_s=10)


def samples(*loads: float, start: float = 0.0) -> list[Sample]:
    return [Sample(start + i, load) for i, load in enumerate(loads)]


def test_desired_replicas_follow_mean_load_within_bounds():
    assert decide(samples(8, 8, 8), CFG, now=3, last_request_at=3) == 2
    assert decide(samples(9, 9), CFG, now=2, last_request_at=2) == 3
    assert decide(samples(100), CFG, now=1, last_request_at=1) == 4
    assert decide(samples(0, 0), CFG, now=2, last_request_at=2) == 1
    # only the look-back window counts
    assert decide(samples(40, 0, 0, start=0) + samples(0, start=20), CFG, now=21,
                  last_request_at=21) == 1


def test_zero_only_after_the_idle_time():
    cfg = AutoscaleConfig(min_replicas=0, max_replicas=2, scale_to_zero_after_s=30)
    assert decide(samples(0), cfg, now=100, last_request_at=80) == 1
    assert decide(samples(0), cfg, now=100, last_request_at=60) == 0


def test_ttft_over_the_slo_adds_a_replica():
    cfg = AutoscaleConfig(min_replicas=1, max_replicas=3, target_ongoing=4, ttft_slo_s=0.5)
    slow = [Sample(i, 4, ttft_s=0.9) for i in range(3)]
    assert decide(slow, cfg, now=3, last_request_at=3) == 2


class FakeLauncher:
    def __init__(self) -> None:
        self.started: list[str] = []

    def start(self, replica_id: str) -> RemoteHandle:
        self.started.append(replica_id)
        return RemoteHandle(f"http://127.0.0.1:1/{replica_id}")


def test_loop_scales_up_after_its_delay_and_drains_down_to_zero():
    async def run() -> None:
        cfg = AutoscaleConfig(min_replicas=0, max_replicas=3, target_ongoing=2,
                              look_back_s=1, scale_up_delay_s=2, scale_down_delay_s=5,
                              scale_to_zero_after_s=10)
        launcher = FakeLauncher()
        fleet = Fleet(RouterConfig(autoscale=cfg), {"primary": launcher})
        now = [0.0]
        scaler = Autoscaler(fleet, cfg, held=lambda: 0, clock=lambda: now[0])
        scaler.step(0.0)
        assert launcher.started == []                    # starts at zero, stays there
        scaler.on_demand("primary")                      # a request waits: one at once
        assert len(fleet.group("primary")) == 1
        replica = fleet.group("primary")[0]
        replica.state, replica.in_flight = ReplicaState.READY, 6
        scaler.step(1.0)                                 # wants 3, not for long enough yet
        assert len(launcher.started) == 1
        scaler.step(3.5)
        assert len(launcher.started) == 2                # one more after the delay
        for r in fleet.group("primary"):
            r.state, r.in_flight = ReplicaState.READY, 0
        now[0] = 4.0
        for t in (5.0, 6.0, 8.0, 10.5, 12.0):
            scaler.step(t)
        assert [r.state for r in fleet.group("primary")].count(ReplicaState.DRAINING) == 1
        scaler.step(30.0)                                # idle past scale_to_zero_after_s
        await asyncio.sleep(0.2)
        assert fleet.replicas == {}
        assert fleet.metrics.scale_events.labels("up")._value.get() == 2
        assert fleet.metrics.scale_events.labels("down")._value.get() == 2
    asyncio.run(run())


def test_each_role_scales_its_own_replicas():
    """A disaggregated fleet: each role's autoscaler counts only its replicas and the requests
    held for them, and starts replicas of its role only."""
    async def run() -> None:
        cfg = AutoscaleConfig(min_replicas=1, max_replicas=3, target_ongoing=2, look_back_s=1,
                              scale_up_delay_s=0, scale_down_delay_s=0)
        launchers = {"prefill": FakeLauncher(), "decode": FakeLauncher()}
        fleet = Fleet(RouterConfig(), launchers)
        for role in ("prefill", "decode"):
            fleet.start_replica("primary", role).state = ReplicaState.READY
        scalers = [Autoscaler(fleet, cfg, held=lambda role=role: fleet.held_roles[role],
                              role=role) for role in ("prefill", "decode")]
        fleet.group("primary", roles=("decode",))[0].in_flight = 4
        fleet.held_roles["decode"] = 2                   # waiting for a decode replica
        for scaler in scalers:
            scaler.step(1.0)
        assert (len(launchers["prefill"].started), len(launchers["decode"].started)) == (1, 2)
        assert sorted(r.role for r in fleet.replicas.values()) == \
            ["decode", "decode", "prefill"]
        scalers[0].on_demand("primary", ("decode", "both"))   # not its role: nothing
        assert len(launchers["prefill"].started) == 1
    asyncio.run(run())

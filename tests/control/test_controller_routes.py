"""The Controller's in-memory routing table follows every change routing depends on (a fleet
becoming ready, a plane down, the placement re-solved, a plane back), checked at each step
against views built afresh from what is stored in SQLite, and against the expected planes."""
from __future__ import annotations

import time

from ember.control.config import ControlConfig
from ember.control.controller import Controller, FleetReport, PlaneLive, _role
from ember.control.placement import Deployment, Plane
from ember.control.routing import PlaneView, candidates
from ember.control.state import State

CHAT = Deployment("chat", "m", replicas=1, regions=("eu",), mode="active-passive")
EU1, EU2, US1 = Plane("eu-1", "eu", 4, 8192), Plane("eu-2", "eu", 4, 8192), \
    Plane("us-1", "us", 4, 8192)


def stored_views(state: State, live: dict[str, PlaneLive], role: str) -> list[PlaneView]:
    """The reference: views read from SQLite on every call."""
    placement = state.placement()
    out = []
    for name, (plane, _, _) in state.planes().items():
        lv = live.get(name, PlaneLive())
        models = frozenset(f.model for f in lv.fleets.values()
                           if f.ready and _role(placement.get(f.deployment), name) == role)
        out.append(PlaneView(name, plane.region, plane.up, models, lv.in_flight))
    return out


def fleet(ready: bool) -> list[FleetReport]:
    return [FleetReport("chat", "m", "http://127.0.0.1:1", 1, ready)]


def routed(ctl: Controller, role: str) -> list[str]:
    """The planes a request for model m from an eu tenant would try, and the table checked
    against the reference."""
    assert ctl.views(role) == stored_views(ctl.state, ctl.live, role)
    got, why = candidates(ctl.views(role), "m", ("eu",), None)
    assert bool(why) == (not got)
    return [p.name for p in got]


def test_the_routing_table_follows_readiness_plane_failure_and_placement(tmp_path):
    ctl = Controller(ControlConfig(deployments=(CHAT,)), State(tmp_path / "c.db"),
                     down_after_s=60, solve_time_limit_s=5)
    for plane in (EU1, EU2, US1):
        ctl.heard(plane, [], 0.0)
    assert routed(ctl, "active") == routed(ctl, "standby") == []
    for plane in (EU1, EU2):              # fleets ready before any placement: all active
        ctl.heard(plane, fleet(True), 0.0)
    assert routed(ctl, "active") == ["eu-1", "eu-2"]

    ctl.resolve("start")                  # only the placement changes
    a = ctl.placement["chat"]
    [primary], standby = list(a.active), a.standby
    assert {primary, standby} == {"eu-1", "eu-2"}
    assert routed(ctl, "active") == [primary]
    assert routed(ctl, "standby") == [standby]

    for plane in (EU1, EU2):              # the fleets restart: not ready, then ready
        ctl.heard(plane, fleet(False), 0.0)
    assert routed(ctl, "active") == routed(ctl, "standby") == []
    for plane in (EU1, EU2):
        ctl.heard(plane, fleet(True), 0.0)
    assert routed(ctl, "active") == [primary]
    assert routed(ctl, "standby") == [standby]

    ctl.live[primary].in_flight = 3           # load is read per request, not cached
    assert ctl.views("active") == stored_views(ctl.state, ctl.live, "active")

    ctl.live[primary].last_seen = time.monotonic() - 120     # silent: marked down
    ctl.check()
    assert not ctl.planes[primary][0].up
    assert ctl.placement["chat"].active == {standby: 1}      # re-solved on the standby
    assert routed(ctl, "active") == [standby]
    assert routed(ctl, "standby") == []

    ctl.heard(EU1 if primary == "eu-1" else EU2, fleet(True), 0.0)   # back, fleet ready
    assert ctl.planes[primary][0].up
    ctl.check()                                # re-solves
    assert sorted(routed(ctl, "active") + routed(ctl, "standby")) == ["eu-1", "eu-2"]


def test_a_restarted_controller_routes_from_the_stored_placement(tmp_path):
    state = State(tmp_path / "c.db")
    ctl = Controller(ControlConfig(deployments=(CHAT,)), state, down_after_s=60)
    for plane in (EU1, EU2):
        ctl.heard(plane, [], 0.0)
    ctl.resolve("start")
    placed = ctl.placement
    again = Controller(ControlConfig(deployments=(CHAT,)), State(tmp_path / "c.db"))
    assert again.placement == placed and set(again.planes) == {"eu-1", "eu-2"}
    assert routed(again, "active") == []        # nothing heard yet: no fleet is ready
    for plane in (EU1, EU2):
        again.heard(plane, fleet(True), 0.0)
    assert routed(again, "active") == list(placed["chat"].active)
    assert routed(again, "standby") == [placed["chat"].standby]

"""State: what one State writes, a second State opened on the same file reads back whole
(a restarted control plane), checked field by field against what was written."""
from __future__ import annotations

from ember.control.placement import Assignment, Deployment, Plane
from ember.control.state import State


def test_state_survives_a_restart(tmp_path):
    path = tmp_path / "control.db"
    planes = [Plane("eu-1", "eu", 8, 16384, 0.9), Plane("us-1", "us", 4, 8192, 0.3, spot=True,
                                                        up=False)]
    deployments = (Deployment("chat", "smol", 2, 2, 2048, ("eu",), "active-active"),
                   Deployment("batch", "smol", 1, 1, 1024, (), "active-passive", True))
    placement = {"chat": Assignment({"eu-1": 2}), "batch": Assignment({"eu-1": 1}, "us-1")}
    first = State(path)
    for i, p in enumerate(planes):
        first.save_plane(p, f"http://127.0.0.1:{9000 + i}", 100.0 + i)
    first.save_deployments(deployments)
    first.save_placement(placement)
    for i in range(60):
        first.event("heartbeat", f"event {i}")
    first.close()

    again = State(path)
    assert again.planes() == {"eu-1": (planes[0], "http://127.0.0.1:9000", 100.0),
                              "us-1": (planes[1], "http://127.0.0.1:9001", 101.0)}
    assert set(again.deployments()) == set(deployments)
    assert again.placement() == placement
    events = again.events(limit=50)
    assert [e["message"] for e in events] == [f"event {i}" for i in range(10, 60)]


def test_a_new_placement_replaces_the_old_one(tmp_path):
    state = State(tmp_path / "c.db")
    state.save_placement({"chat": Assignment({"eu-1": 1, "eu-2": 1})})
    state.save_placement({"chat": Assignment({"eu-2": 2})})
    assert state.placement() == {"chat": Assignment({"eu-2": 2})}
    state.save_deployments((Deployment("a", "m", 2),))
    state.save_deployments((Deployment("b", "m", 1, mode="active-passive"),))
    assert [d.name for d in state.deployments()] == ["b"]

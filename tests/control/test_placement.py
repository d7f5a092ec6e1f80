"""place(): CP-SAT's placements hold every constraint (property-based), and score as low as
the best one an exhaustive search over every assignment finds (the reference)."""
from __future__ import annotations

import itertools
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from ember.control.placement import (Assignment, Deployment, Plane, Problem, num_moves, place,
                                     score, violations)

REGIONS = ("eu", "us")


@st.composite
def problems(draw, max_planes: int = 5, max_deployments: int = 4, max_replicas: int = 3
             ) -> Problem:
    planes = tuple(Plane(f"p{i}", draw(st.sampled_from(REGIONS)),
                         draw(st.integers(0, 8)), draw(st.integers(0, 8)) * 1024,
                         draw(st.sampled_from((0.5, 0.9, 1.3, 2.0))), draw(st.booleans()),
                         draw(st.booleans() | st.just(True)))
                   for i in range(draw(st.integers(1, max_planes))))
    modes = draw(st.lists(st.sampled_from(("active-active", "active-passive")), min_size=1,
                          max_size=max_deployments))
    deployments = tuple(Deployment(f"d{i}", "m",
                                   draw(st.integers(2 if mode == "active-active" else 1,
                                                    max_replicas)),
                                   draw(st.integers(1, 3)), draw(st.integers(1, 3)) * 1024,
                                   tuple(draw(st.sets(st.sampled_from(REGIONS)))), mode,
                                   draw(st.booleans()))
                        for i, mode in enumerate(modes))
    return Problem(planes, deployments)


def options(d: Deployment, problem: Problem) -> list[Assignment | None]:
    """Every assignment of `d` alone that holds its own constraints (any count from one to
    its replicas, with or without a standby), and None (unplaced)."""
    names = [p.name for p in problem.planes]
    out: list[Assignment | None] = [None]
    for counts in itertools.product(range(d.replicas + 1), repeat=len(names)):
        if not 1 <= sum(counts) <= d.replicas:
            continue
        active = {p: n for p, n in zip(names, counts) if n}
        standbys = [None] if d.mode == "active-active" else [None, *names]
        for standby in standbys:
            a = Assignment(active, standby)
            alone = Problem(problem.planes, (d,))
            if not violations(alone, {d.name: a}):
                out.append(a)
    return out


def exhaustive(problem: Problem) -> int:
    best = None
    names = [d.name for d in problem.deployments]
    for combo in itertools.product(*(options(d, problem) for d in problem.deployments)):
        chosen = {n: a for n, a in zip(names, combo) if a is not None}
        if violations(problem, chosen):
            continue
        s = score(problem, chosen)
        best = s if best is None else min(best, s)
    return best


@settings(max_examples=150, deadline=None)
@given(problems())
def test_placement_holds_every_constraint(problem):
    placed = place(problem)
    assert violations(problem, placed.assignments) == []
    assert set(placed.assignments) | set(placed.unplaced) == {d.name for d in problem.deployments}


@settings(max_examples=60, deadline=None)
@given(problems(max_planes=3, max_deployments=2, max_replicas=2))
def test_placement_scores_the_exhaustive_optimum(problem):
    placed = place(problem)
    assert placed.optimal
    best = exhaustive(problem)
    assert placed.score <= best * 1.01 and placed.score >= best


@settings(max_examples=40, deadline=None)
@given(problems(max_planes=3, max_deployments=2, max_replicas=2), st.data())
def test_resolve_after_a_plane_fails_scores_the_exhaustive_optimum(problem, data):
    """The re-solve starts from the previous placement as a hint and pays for moves; the
    exhaustive search scores the same moves, so the two optima must agree."""
    first = place(problem)
    down = data.draw(st.integers(0, len(problem.planes) - 1))
    planes = tuple(replace(p, up=False) if i == down else p
                   for i, p in enumerate(problem.planes))
    again = Problem(planes, problem.deployments, first.assignments)
    placed = place(again)
    assert violations(again, placed.assignments) == []
    best = exhaustive(again)
    assert best <= placed.score <= best * 1.01


def test_spread_standby_spot_and_cost():
    planes = (Plane("eu-1", "eu", 8, 16384, 0.9), Plane("eu-2", "eu", 8, 16384, 1.2),
              Plane("us-1", "us", 8, 16384, 0.5), Plane("us-spot", "us", 8, 16384, 0.1, spot=True))
    chat = Deployment("chat", "m", 2, 2, 2048, ("eu",), "active-active")
    batch = Deployment("batch", "m", 1, 2, 2048, (), "active-passive", allow_spot=True)
    placed = place(Problem(planes, (chat, batch)))
    assert placed.assignments["chat"].active == {"eu-1": 1, "eu-2": 1}   # eu only, 2 planes
    b = placed.assignments["batch"]
    # the cheapest plane (spot allowed) and, in another region, the cheaper of eu-1 and eu-2
    assert {*b.active, b.standby} == {"us-spot", "eu-1"} and b.standby not in b.active


def test_resolve_moves_only_the_lost_replicas():
    planes = [Plane(f"eu-{i}", "eu", 4, 8192, 1.0 + i / 10) for i in range(1, 4)]
    deployments = tuple(Deployment(f"d{i}", "m", 2, 1, 1024) for i in range(4))
    first = place(Problem(tuple(planes), deployments))
    planes.append(Plane("eu-cheap", "eu", 8, 16384, 0.1))      # cheaper, but moves cost more
    planes[0] = Plane("eu-1", "eu", 4, 8192, 1.1, up=False)     # and one plane fails
    problem = Problem(tuple(planes), deployments, first.assignments)
    second = place(problem)
    assert violations(problem, second.assignments) == []
    assert sum(num_moves(d, second.assignments[d.name], problem) for d in deployments) == 0
    for d in deployments:   # every replica that ran on a live plane stays
        for p, n in first.assignments[d.name].active.items():
            if p != "eu-1":
                assert second.assignments[d.name].active.get(p, 0) >= n
    assert all("eu-1" not in a.active for a in second.assignments.values())


def test_too_little_capacity_keeps_a_replica_of_each_deployment_not_overcommitted():
    planes = (Plane("a", "eu", 2, 4096), Plane("b", "eu", 2, 4096))
    deployments = tuple(Deployment(f"d{i}", "m", 2, 1, 1024) for i in range(3))
    placed = place(Problem(planes, deployments))
    assert placed.unplaced == ()
    counts = sorted(sum(a.active.values()) for a in placed.assignments.values())
    assert counts == [1, 1, 2]                     # four cores: one deployment whole
    assert violations(Problem(planes, deployments), placed.assignments) == []
    fewer = tuple(Deployment(f"d{i}", "m", 2, 1, 1024) for i in range(5))
    placed = place(Problem(planes, fewer))          # four cores, five deployments
    assert len(placed.unplaced) == 1 and len(placed.assignments) == 4
    assert violations(Problem(planes, fewer), placed.assignments) == []


def test_a_plane_failure_keeps_the_replicas_that_still_fit():
    planes = [Plane("a", "eu", 2, 4096), Plane("b", "eu", 2, 4096), Plane("c", "eu", 1, 4096)]
    chat = Deployment("chat", "m", 4, 1, 1024)
    first = place(Problem(tuple(planes), (chat,)))
    assert sum(first.assignments["chat"].active.values()) == 4
    planes[0] = Plane("a", "eu", 2, 4096, up=False)
    problem = Problem(tuple(planes), (chat,), first.assignments)
    second = place(problem)
    assert second.unplaced == () and violations(problem, second.assignments) == []
    assert second.assignments["chat"].active == {"b": 2, "c": 1}   # three fit, not none

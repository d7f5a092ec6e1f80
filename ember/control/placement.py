"""place(problem): every deployment's replicas onto workload planes, by OR-Tools CP-SAT.

Why CP-SAT: placement is an integer assignment (how many replicas of deployment d run on
plane p) under capacity (cores, memory per plane), eligibility (allowed regions, spot only
where allowed), spread (active-active on >= 2 planes) and standby (active-passive: one standby
on a plane holding none of the deployment's active replicas) constraints, minimising cost and,
on a re-solve, the replicas moved off where they run. That is a small integer program with
logical side constraints; CP-SAT solves it exactly (or to a proven gap within a time limit),
with parallel search, from a maintained package, where a hand-written search would be neither.

The objective, lexicographic by weight (`score` computes it for any placement, so an
exhaustive search can check the solver's answer):

    UNPLACED x deployments left without a placement (capacity ran out)
  + MOVE     x replicas taken off a plane that is up and still ran them
  + REGION   x regions short of two, for a deployment whose planes span two or more regions
  + cost     (milli-dollars per hour: each replica costs its share of its plane's price)
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from ortools.sat.python import cp_model

from ember.errors import ConfigError

MODES = ("active-active", "active-passive")
UNPLACED = 10**12
MOVE = 10**9
REGION = 10**7


@dataclass(frozen=True)
class Plane:
    name: str
    region: str
    cores: int
    memory_mib: int
    cost_per_hour: float = 1.0
    spot: bool = False
    up: bool = True

    def __post_init__(self) -> None:
        if self.cores < 0 or self.memory_mib < 0 or self.cost_per_hour < 0:
            raise ConfigError(f"plane {self.name}: cores, memory and cost must be >= 0")


@dataclass(frozen=True)
class Deployment:
    name: str
    model: str
    replicas: int = 1              # active replicas to place (the fleet's --min-replicas)
    cores: int = 1                 # one replica's
    memory_mib: int = 1024         # one replica's
    regions: tuple[str, ...] = ()  # empty: any region
    mode: str = "active-active"
    allow_spot: bool = False

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"deployment {self.name}: mode {self.mode!r} must be one of "
                              f"{', '.join(MODES)}")
        if self.replicas < 1 or self.cores < 1 or self.memory_mib < 1:
            raise ConfigError(f"deployment {self.name}: replicas, cores and memory must be "
                              ">= 1")
        if self.mode == "active-active" and self.replicas < 2:
            raise ConfigError(f"deployment {self.name}: active-active spreads replicas over "
                              "two planes; give replicas >= 2, or mode = \"active-passive\"")

    def allows(self, plane: Plane) -> bool:
        return plane.up and (not self.regions or plane.region in self.regions) \
            and (self.allow_spot or not plane.spot) \
            and self.cores <= plane.cores and self.memory_mib <= plane.memory_mib


@dataclass(frozen=True)
class Assignment:
    active: dict[str, int] = field(default_factory=dict)   # plane -> replicas
    standby: str | None = None                              # plane (active-passive)


@dataclass(frozen=True)
class Problem:
    planes: tuple[Plane, ...]
    deployments: tuple[Deployment, ...]
    previous: dict[str, Assignment] = field(default_factory=dict)


@dataclass(frozen=True)
class Placement:
    assignments: dict[str, Assignment]   # placed deployments only
    unplaced: tuple[str, ...]
    score: int
    optimal: bool
    bound: float = 0.0    # CP-SAT's lower bound on the score: (score - bound) / score is the gap


def replica_cost(d: Deployment, p: Plane) -> int:
    """Milli-dollars an hour: the replica's share of its plane's cores, at the plane's price."""
    return round(1000 * p.cost_per_hour * d.cores / max(p.cores, 1))


def num_moves(d: Deployment, a: Assignment | None, problem: Problem) -> int:
    """Replicas the previous placement ran on a plane that is still up, and `a` no longer
    does (a standby counts as one). Replicas on a plane that went down are lost, not moved."""
    prev = problem.previous.get(d.name)
    if prev is None:
        return 0
    up = {p.name for p in problem.planes if p.up}
    a = a or Assignment()
    moved = sum(max(0, n - a.active.get(p, 0)) for p, n in prev.active.items() if p in up)
    return moved + int(prev.standby in up and prev.standby != a.standby)


def region_target(d: Deployment, problem: Problem) -> int:
    return min(2, len({p.region for p in problem.planes if d.allows(p)}))


def score(problem: Problem, assignments: dict[str, Assignment]) -> int:
    planes = {p.name: p for p in problem.planes}
    total = 0
    for d in problem.deployments:
        a = assignments.get(d.name)
        total += MOVE * num_moves(d, a, problem)
        if a is None:
            total += UNPLACED
            continue
        used = [*a.active] + ([a.standby] if a.standby else [])
        total += REGION * max(0, region_target(d, problem) - len({planes[p].region for p in used}))
        total += sum(n * replica_cost(d, planes[p]) for p, n in a.active.items())
        total += replica_cost(d, planes[a.standby]) if a.standby else 0
    return total


def violations(problem: Problem, assignments: dict[str, Assignment]) -> list[str]:
    """Every hard constraint `assignments` breaks, in words (empty: a valid placement)."""
    planes = {p.name: p for p in problem.planes}
    out: list[str] = []
    cores = dict.fromkeys(planes, 0)
    memory = dict.fromkeys(planes, 0)
    for d in problem.deployments:
        a = assignments.get(d.name)
        if a is None:
            continue
        used = {p: n for p, n in a.active.items() if n > 0}
        if sum(used.values()) != d.replicas:
            out.append(f"{d.name}: {sum(used.values())} replicas, wants {d.replicas}")
        eligible = [p for p in problem.planes if d.allows(p)]
        if d.mode == "active-active" and len(used) < min(2, len(eligible)):
            out.append(f"{d.name}: active-active on {len(used)} plane(s)")
        if d.mode == "active-passive" and (a.standby is None or a.standby in used):
            out.append(f"{d.name}: active-passive without a standby on another plane")
        for p in [*used] + ([a.standby] if a.standby else []):
            if p not in planes or not d.allows(planes[p]):
                out.append(f"{d.name}: plane {p} is not allowed")
                continue
            n = used.get(p, 0) + (p == a.standby)
            cores[p] += n * d.cores
            memory[p] += n * d.memory_mib
    for name, p in planes.items():
        if cores[name] > p.cores or memory[name] > p.memory_mib:
            out.append(f"plane {name}: over capacity")
    return out


def place(problem: Problem, time_limit_s: float = 10.0, workers: int = 2,
          gap: float = 0.005) -> Placement:
    """The best placement CP-SAT finds within `time_limit_s` (per try) to a relative `gap`.
    It first tries with every deployment placed and spread over two regions where its planes
    span two (hard constraints propagate fast); only if that is infeasible does it solve
    the model where both are paid for in the objective instead."""
    for strict in (True, False):
        model = cp_model.CpModel()
        v = _Vars(model, problem, strict)
        _capacity(model, problem, v)
        model.minimize(v.objective)
        solver = cp_model.CpSolver()
        solver.parameters.max_time_in_seconds = time_limit_s
        solver.parameters.num_workers = workers
        solver.parameters.relative_gap_limit = gap
        status = solver.solve(model)
        if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            break
    else:
        raise ConfigError(f"CP-SAT found no placement in {time_limit_s} s "
                          f"({solver.status_name(status)}); raise the time limit")
    assignments = v.read(solver)
    return Placement(assignments, tuple(d.name for d in problem.deployments
                                        if d.name not in assignments),
                     score(problem, assignments), status == cp_model.OPTIMAL,
                     solver.best_objective_bound)


class _Vars:
    """The model's variables and objective, per deployment over its eligible planes:
    x[d,p] active replicas, y[d,p] x > 0, s[d,p] its standby is there, placed[d]."""

    def __init__(self, m: cp_model.CpModel, problem: Problem, strict: bool) -> None:
        self.problem, self.strict = problem, strict
        self.x: dict[tuple[str, str], cp_model.IntVar] = {}
        self.s: dict[tuple[str, str], cp_model.IntVar] = {}
        self.placed: dict[str, cp_model.IntVar] = {}
        terms = []
        for d in problem.deployments:
            terms += self._deployment(m, d)
        self.objective = sum(terms)

    def _deployment(self, m: cp_model.CpModel, d: Deployment) -> list:
        eligible = [p for p in self.problem.planes if d.allows(p)]
        placed = self.placed[d.name] = m.new_bool_var(f"placed[{d.name}]")
        if self.strict:
            m.add(placed == 1)
        terms: list = [UNPLACED * (1 - placed)]
        ys, by_region = [], {}
        prev = self.problem.previous.get(d.name)   # a re-solve starts from what runs
        for p in eligible:
            x = self.x[d.name, p.name] = m.new_int_var(0, d.replicas, f"x[{d.name},{p.name}]")
            if prev is not None:
                m.add_hint(x, min(prev.active.get(p.name, 0), d.replicas))
            y = m.new_bool_var("")
            m.add(x >= 1).only_enforce_if(y)
            m.add(x == 0).only_enforce_if(~y)
            ys.append(y)
            terms.append(replica_cost(d, p) * x)
            on = y
            if d.mode == "active-passive":
                s = self.s[d.name, p.name] = m.new_bool_var(f"s[{d.name},{p.name}]")
                if prev is not None:
                    m.add_hint(s, prev.standby == p.name)
                m.add(s + y <= 1)
                terms.append(replica_cost(d, p) * s)
                on = m.new_bool_var("")
                m.add_max_equality(on, [y, s])
            by_region.setdefault(p.region, []).append(on)
        m.add(sum(self.x[d.name, p.name] for p in eligible) == d.replicas * placed)
        if d.mode == "active-active":
            m.add(sum(ys) >= min(2, len(eligible)) * placed)
        else:
            m.add(sum(self.s[d.name, p.name] for p in eligible) == placed)
        terms += self._region_shortfall(m, d, by_region, placed)
        terms += self._moves(m, d, eligible)
        return terms

    def _region_shortfall(self, m: cp_model.CpModel, d: Deployment,
                          by_region: dict[str, list], placed: cp_model.IntVar) -> list:
        target = region_target(d, self.problem)
        if target < 2:
            return []
        regions = []
        for ons in by_region.values():
            r = m.new_bool_var("")
            m.add_max_equality(r, ons)
            regions.append(r)
        if self.strict:   # first try: spread over two regions, every deployment placed
            m.add(sum(regions) >= target)
            return []
        short = m.new_int_var(0, target, "")
        m.add(short >= target * placed - sum(regions))
        return [REGION * short]

    def _moves(self, m: cp_model.CpModel, d: Deployment, eligible: list[Plane]) -> list:
        prev = self.problem.previous.get(d.name)
        if prev is None:
            return []
        up = {p.name for p in self.problem.planes if p.up}
        terms: list = []
        for p, n in prev.active.items():
            if p not in up:
                continue
            x = self.x.get((d.name, p))
            if x is None:
                terms.append(MOVE * n)          # no longer allowed there: all move
                continue
            moved = m.new_int_var(0, n, "")
            m.add(moved >= n - x)
            terms.append(MOVE * moved)
        if prev.standby in up:
            s = self.s.get((d.name, prev.standby))
            terms.append(MOVE * (1 - s) if s is not None else MOVE)
        return terms

    def read(self, solver: cp_model.CpSolver) -> dict[str, Assignment]:
        out: dict[str, Assignment] = {}
        for d in self.problem.deployments:
            if not solver.value(self.placed[d.name]):
                continue
            active = {p: solver.value(x) for (dn, p), x in self.x.items()
                      if dn == d.name and solver.value(x) > 0}
            standby = next((p for (dn, p), s in self.s.items()
                            if dn == d.name and solver.value(s)), None)
            out[d.name] = Assignment(active, standby)
        return out


def _capacity(m: cp_model.CpModel, problem: Problem, v: _Vars) -> None:
    deployments = {d.name: d for d in problem.deployments}
    for p in problem.planes:
        cores, memory = [], []
        for (dn, pn), x in itertools.chain(v.x.items(), v.s.items()):
            if pn == p.name:
                cores.append(deployments[dn].cores * x)
                memory.append(deployments[dn].memory_mib * x)
        if cores:
            m.add(sum(cores) <= p.cores)
            m.add(sum(memory) <= p.memory_mib)

"""place(problem): every deployment's replicas onto workload planes, by OR-Tools CP-SAT.

Why CP-SAT: placement is an integer assignment (how many replicas of deployment d run on
plane p) under capacity (cores, memory per plane), eligibility (allowed regions, spot only
where allowed), spread (active-active on >= 2 planes) and standby (active-passive: one standby
on a plane holding none of the deployment's active replicas) constraints, minimising cost and,
on a re-solve, the replicas moved off where they run. That is a small integer program with
logical side constraints; CP-SAT solves it exactly (or to a proven gap within a time limit),
bounded by its LP relaxation, from a maintained package, where a hand-written search would
be neither.

The objective, lexicographic by weight (`score` computes it for any placement, so an
exhaustive search can check the solver's answer):

    UNPLACED x deployments left without a single replica (capacity ran out)
  + SHORT    x replicas (and standbys) short of what a placed deployment wants: a deployment
             that no longer fits whole keeps as many replicas as fit, never fewer than one
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
UNPLACED = 10**15
SHORT = 10**12
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
        total += SHORT * (d.replicas - sum(a.active.values()))
        total += SHORT * (d.mode == "active-passive" and a.standby is None)
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
        count = sum(used.values())
        if not 1 <= count <= d.replicas:
            out.append(f"{d.name}: {count} replicas, wants 1 to {d.replicas}")
        eligible = [p for p in problem.planes if d.allows(p)]
        if d.mode == "active-active" and len(used) < min(2, count, len(eligible)):
            out.append(f"{d.name}: active-active on {len(used)} plane(s)")
        if a.standby is not None and (d.mode == "active-active" or a.standby in used):
            out.append(f"{d.name}: a standby on a plane with its active replicas")
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


def place(problem: Problem, time_limit_s: float = 10.0, workers: int = 1,
          gap: float = 0.005) -> Placement:
    """The best placement CP-SAT finds within `time_limit_s` (per try) to a relative `gap`.
    One worker with the full LP relaxation: on these assignment problems the LP's bound and
    its dive meet within a second, while a multi-worker portfolio spends the cores on local
    search and proves little. It first tries with every deployment placed whole and spread
    over two regions where its planes span two (hard constraints propagate fast); only if
    that is infeasible does it solve the model where replicas short, standbys and regions
    are paid for instead."""
    start = greedy(problem)
    for strict in (True, False):
        model = cp_model.CpModel()
        v = _Vars(model, problem, strict, start)
        if problem.previous:    # a fresh greedy start only delays CP-SAT's own LP dive
            v.hint(model)
        _capacity(model, problem, v)
        model.minimize(v.objective)
        solver = cp_model.CpSolver()
        solver.parameters.max_time_in_seconds = time_limit_s
        solver.parameters.num_workers = workers
        solver.parameters.relative_gap_limit = gap
        solver.parameters.linearization_level = 2
        status = solver.solve(model)
        if status != cp_model.INFEASIBLE:    # out of time is no reason to relax the model
            break
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise ConfigError(f"CP-SAT found no placement in {time_limit_s} s "
                          f"({solver.status_name(status)}); raise the time limit")
    assignments = v.read(solver)
    return Placement(assignments, tuple(d.name for d in problem.deployments
                                        if d.name not in assignments),
                     score(problem, assignments), status == cp_model.OPTIMAL,
                     solver.best_objective_bound)


class _Vars:
    """The model's variables, objective and a complete hint, per deployment d over its
    eligible planes p: x[d,p] active replicas, s[d,p] its standby is there (active-passive),
    r[d,g] some replica or standby runs in region g.

    No indicator "x > 0" is needed: a standby excludes actives by x <= cap * (1 - s), and a
    region counts by r <= sum of x and s in it, both of which are as tight in the LP
    relaxation as an indicator would be. Spread is a domain, not a count: an active-active
    replica count on one plane is at most replicas - 1, which with sum x = replicas forces a
    second plane. Every variable gets a hint value from `start`, so CP-SAT begins from a
    complete solution rather than searching for one."""

    def __init__(self, m: cp_model.CpModel, problem: Problem, strict: bool,
                 start: dict[str, Assignment]) -> None:
        self.problem, self.strict = problem, strict
        self.x: dict[tuple[str, str], cp_model.IntVar] = {}
        self.s: dict[tuple[str, str], cp_model.IntVar] = {}
        self.hints: list[tuple[cp_model.IntVar, int]] = []
        terms = []
        for d in problem.deployments:
            terms += self._deployment(m, d, start.get(d.name))
        self.objective = cp_model.LinearExpr.sum(terms)

    def _var(self, m: cp_model.CpModel, hi: int, hint: int, name: str = ""
             ) -> cp_model.IntVar:
        var = m.new_bool_var(name) if hi == 1 else m.new_int_var(0, hi, name)
        self.hints.append((var, hint))
        return var

    def _deployment(self, m: cp_model.CpModel, d: Deployment, a: Assignment | None) -> list:
        eligible = [p for p in self.problem.planes if d.allows(p)]
        spread = d.mode == "active-active" and len(eligible) >= 2
        cap = d.replicas - 1 if spread else d.replicas
        start = a or Assignment()
        xs, standbys, terms, by_region = [], [], [], {}
        for p in eligible:
            x = self.x[d.name, p.name] = self._var(m, cap, start.active.get(p.name, 0),
                                                   f"x[{d.name},{p.name}]")
            xs.append(x)
            terms.append(replica_cost(d, p) * x)
            by_region.setdefault(p.region, []).append(x)
            if d.mode == "active-passive":
                s = self.s[d.name, p.name] = self._var(m, 1, start.standby == p.name,
                                                       f"s[{d.name},{p.name}]")
                m.add(x + cap * s <= cap)
                standbys.append(s)
                terms.append(replica_cost(d, p) * s)
                by_region[p.region].append(s)
        count = sum(start.active.values())
        if self.strict:
            placed = 1
            m.add(cp_model.LinearExpr.sum(xs) == d.replicas)
            if standbys:
                m.add(cp_model.LinearExpr.sum(standbys) == 1)
        else:
            placed = self._var(m, 1, a is not None)
            n = self._var(m, d.replicas, count)
            m.add(cp_model.LinearExpr.sum(xs) == n)
            m.add(n >= placed)
            m.add(n <= d.replicas * placed)
            terms += [UNPLACED * (1 - placed), SHORT * (d.replicas - n)]
            if standbys:
                m.add(cp_model.LinearExpr.sum(standbys) <= placed)
                terms.append(SHORT * (placed - cp_model.LinearExpr.sum(standbys)))
            if spread and d.replicas > 2:
                self._spread_short(m, d, xs, n, count)
        terms += self._region_shortfall(m, d, by_region, placed, start)
        terms += self._moves(m, d, start)
        return terms

    def _spread_short(self, m: cp_model.CpModel, d: Deployment, xs: list, n, count: int
                      ) -> None:
        """Fewer than `d.replicas` active-active replicas still spread once there are two:
        no plane holds more than n - 1 unless n <= 1."""
        one = self._var(m, 1, count <= 1)
        m.add(n <= 1 + (d.replicas - 1) * (1 - one))
        for x in xs:
            m.add(x <= n - 1 + one)

    def _region_shortfall(self, m: cp_model.CpModel, d: Deployment,
                          by_region: dict[str, list], placed, start: Assignment) -> list:
        target = region_target(d, self.problem)
        if target < 2:
            return []
        planes = {p.name: p for p in self.problem.planes}
        used = {planes[p].region for p in [*start.active, start.standby] if p in planes}
        regions = []
        for region, ons in by_region.items():
            r = self._var(m, 1, region in used)
            m.add(r <= cp_model.LinearExpr.sum(ons))
            regions.append(r)
        if self.strict:   # first try: spread over two regions, every deployment placed
            m.add(cp_model.LinearExpr.sum(regions) >= target)
            return []
        short = self._var(m, target, max(0, target * bool(start.active) - len(used)))
        m.add(short >= target * placed - cp_model.LinearExpr.sum(regions))
        return [REGION * short]

    def _moves(self, m: cp_model.CpModel, d: Deployment, start: Assignment) -> list:
        prev = self.problem.previous.get(d.name)
        if prev is None:
            return []
        up = {p.name for p in self.problem.planes if p.up}
        terms: list = []
        for p, k in prev.active.items():
            if p not in up:
                continue
            x = self.x.get((d.name, p))
            if x is None:
                terms.append(MOVE * k)          # no longer allowed there: all move
                continue
            moved = self._var(m, k, max(0, k - start.active.get(p, 0)))
            m.add(moved >= k - x)
            terms.append(MOVE * moved)
        if prev.standby in up:
            s = self.s.get((d.name, prev.standby))
            terms.append(MOVE * (1 - s) if s is not None else MOVE)
        return terms

    def hint(self, m: cp_model.CpModel) -> None:
        for var, value in self.hints:
            m.add_hint(var, int(value))

    def read(self, solver: cp_model.CpSolver) -> dict[str, Assignment]:
        active: dict[str, dict[str, int]] = {}
        for (dn, p), x in self.x.items():
            if k := solver.value(x):
                active.setdefault(dn, {})[p] = k
        standby = {dn: p for (dn, p), s in self.s.items() if solver.value(s)}
        return {d: Assignment(a, standby.get(d)) for d, a in active.items()}


def greedy(problem: Problem) -> dict[str, Assignment]:
    """A placement to start the solver from: what runs keeps running where its plane is up
    and allowed; every other deployment takes, replica by replica, the cheapest plane that
    has room and keeps its constraints. Deployments it cannot fit whole are left out."""
    free = {p.name: [p.cores, p.memory_mib] for p in problem.planes}
    out: dict[str, Assignment] = {}
    for name, a in problem.previous.items():
        d = next((d for d in problem.deployments if d.name == name), None)
        kept = _kept(d, a, problem) if d is not None else None
        if kept is not None and _take(free, d, kept):
            out[name] = kept
    for d in sorted(problem.deployments, key=lambda d: -d.cores * d.replicas):
        if d.name in out:
            continue
        a = _cheapest(d, problem, free)
        if a is not None and _take(free, d, a):
            out[d.name] = a
    return out


def _kept(d: Deployment, a: Assignment, problem: Problem) -> Assignment | None:
    ok = {p.name for p in problem.planes if d.allows(p)}
    kept = Assignment({p: n for p, n in a.active.items() if p in ok},
                      a.standby if a.standby in ok else None)
    return kept if kept == a else None


def _take(free: dict[str, list[int]], d: Deployment, a: Assignment) -> bool:
    use = dict(a.active)
    if a.standby:
        use[a.standby] = use.get(a.standby, 0) + 1
    if any(free[p][0] < n * d.cores or free[p][1] < n * d.memory_mib for p, n in use.items()):
        return False
    for p, n in use.items():
        free[p][0] -= n * d.cores
        free[p][1] -= n * d.memory_mib
    return True


def _cheapest(d: Deployment, problem: Problem, free: dict[str, list[int]]
              ) -> Assignment | None:
    eligible = sorted((p for p in problem.planes if d.allows(p)),
                      key=lambda p: (replica_cost(d, p), p.name))
    cap = d.replicas - 1 if d.mode == "active-active" and len(eligible) >= 2 else d.replicas
    target = region_target(d, problem)
    room = {p.name: list(free[p.name]) for p in eligible}
    active: dict[str, int] = {}
    regions: set[str] = set()
    units = d.replicas + (d.mode == "active-passive")
    for i in range(units):
        standby = i == d.replicas
        last_chance = units - i == 1 and len(regions) < target
        p = next((p for p in eligible
                  if room[p.name][0] >= d.cores and room[p.name][1] >= d.memory_mib
                  and (active.get(p.name, 0) < cap if not standby else p.name not in active)
                  and not (last_chance and p.region in regions)), None)
        if p is None:
            return None
        room[p.name][0] -= d.cores
        room[p.name][1] -= d.memory_mib
        regions.add(p.region)
        if standby:
            return Assignment(active, p.name)
        active[p.name] = active.get(p.name, 0) + 1
    return Assignment(active)


def _capacity(m: cp_model.CpModel, problem: Problem, v: _Vars) -> None:
    deployments = {d.name: d for d in problem.deployments}
    cores: dict[str, tuple[list, list]] = {p.name: ([], []) for p in problem.planes}
    memory: dict[str, tuple[list, list]] = {p.name: ([], []) for p in problem.planes}
    for (dn, pn), x in itertools.chain(v.x.items(), v.s.items()):
        cores[pn][0].append(x)
        cores[pn][1].append(deployments[dn].cores)
        memory[pn][0].append(x)
        memory[pn][1].append(deployments[dn].memory_mib)
    for p in problem.planes:
        if cores[p.name][0]:
            m.add(cp_model.LinearExpr.weighted_sum(*cores[p.name]) <= p.cores)
            m.add(cp_model.LinearExpr.weighted_sum(*memory[p.name]) <= p.memory_mib)

"""The control plane's decisions, without HTTP: which planes are up, where each deployment
runs (the placement, in SQLite), what each plane should run, and which plane may serve a
request.

    plane heartbeat -> heard(): joined, came back or changed -> re-solve; reply: its fleets
    check() every tick: a plane silent for `down_after_s` -> down, event; re-solve if due
    views(): planes as routing.py sees them, from what the planes report running

The Controller is the State's only writer, so it keeps what it stored (planes, placement) in
memory, and the routing table built from them and the planes' ready fleets is rebuilt only
when one of those changes: a request reads no SQLite.

Planes pull their work: the heartbeat's reply is the plane's desired fleets. A restarted
control plane reads the same placement back, so its replies ask for what already runs, and
no healthy fleet restarts; with no placement stored it places from what the planes report
running (re-adoption), moving as little as the solver must.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from ember.control.config import ControlConfig
from ember.control.placement import Assignment, Placement, Plane, Problem, place
from ember.control.routing import PlaneView
from ember.control.state import State


@dataclass(frozen=True)
class FleetReport:
    """One `ember route` fleet a plane runs, as the plane reports it."""

    deployment: str
    model: str
    url: str
    replicas: int
    ready: bool


@dataclass
class PlaneLive:
    """What the control plane knows of a plane from its heartbeats (not stored: a restarted
    control plane learns it again from the next heartbeat)."""

    fleets: dict[str, FleetReport] = field(default_factory=dict)
    load: float = 0.0
    last_seen: float = 0.0          # time.monotonic()
    in_flight: int = 0              # the global endpoint's requests on it


class Controller:
    def __init__(self, config: ControlConfig, state: State, down_after_s: float = 3.0,
                 solve_time_limit_s: float = 5.0) -> None:
        self.config, self.state = config, state
        self.down_after_s, self.solve_time_limit_s = down_after_s, solve_time_limit_s
        now = time.monotonic()
        self.planes = state.planes()         # what is stored, kept in step by each write
        self.placement = state.placement()
        self.version = 0                     # bumped by every change the routes depend on
        self.routes: dict[str, list[PlaneView]] = {}
        self.routes_version = -1
        # a restart gives every known plane a full `down_after_s` to be heard from again
        self.live = {name: PlaneLive(last_seen=now) for name in self.planes}
        self.served: dict[tuple[str, str], int] = {}   # (tenant, plane) -> requests sent
        self.pending = ""            # why a re-solve is due ("": none)
        self.first_heard = 0.0       # monotonic: the first heartbeat since start
        changed = set(state.deployments()) != set(config.deployments)
        state.save_deployments(config.deployments)
        if changed and self.live:
            self.resolve("the deployments changed")

    def heard(self, plane: Plane, fleets: list[FleetReport], load: float) -> list[dict]:
        """A plane's heartbeat (its first one registers it); returns its desired fleets."""
        known = self.planes.get(plane.name)
        live = self.live.setdefault(plane.name, PlaneLive())
        reported = {f.deployment: f for f in fleets}
        if reported != live.fleets:
            live.fleets = reported
            self.version += 1
        live.load, live.last_seen = load, time.monotonic()
        plane = replace(plane, up=True)
        if known is None or known[0] != plane:
            self.save_plane(plane, "", time.time())
            if known is None:
                self.state.event("plane_joined", f"{plane.name} joined ({plane.region}, "
                                 f"{plane.cores} cores, {plane.memory_mib} MiB)")
            elif not known[0].up:
                self.state.event("plane_up", f"{plane.name} is heard from again")
            else:
                self.state.event("plane_changed", f"{plane.name} reports a new capacity")
            self.pending = self.pending or f"plane {plane.name} joined or changed"
            self.first_heard = self.first_heard or live.last_seen
        return self.desired(plane.name)

    def check(self) -> None:
        """Mark down every up plane not heard from for `down_after_s`, and re-solve."""
        why = self.due()
        if why:
            self.resolve(why)

    def due(self) -> str:
        """Mark down every up plane not heard from for `down_after_s`; return why a re-solve
        is due ("": none), which the caller then owes."""
        now = time.monotonic()
        lost = []
        for name, (plane, url, _) in list(self.planes.items()):
            live = self.live.setdefault(name, PlaneLive(last_seen=now))
            if plane.up and now - live.last_seen > self.down_after_s:
                live.fleets = {}
                self.save_plane(replace(plane, up=False), url, time.time())
                self.state.event("plane_down", f"{name}: no heartbeat for "
                                 f"{now - live.last_seen:.1f} s; marked down")
                lost.append(name)
        if lost:
            self.pending = f"plane(s) {', '.join(lost)} went down"
        # with nothing placed yet, planes starting together get `down_after_s` to join, so
        # the first placement is not undone as each one registers
        settling = not self.placement and now - self.first_heard < self.down_after_s
        if not self.pending or settling:
            return ""
        why, self.pending = self.pending, ""
        return why

    def problem(self) -> Problem:
        """What a re-solve places: the stored planes, the deployments, and what runs now."""
        planes = tuple(p for p, _, _ in self.planes.values())
        return Problem(planes, self.config.deployments, self.placement or self.reported())

    def resolve(self, why: str) -> None:
        self.apply(place(self.problem(), time_limit_s=self.solve_time_limit_s), why)

    def apply(self, result: Placement, why: str) -> None:
        """Store a solved placement (planes learn it from their next heartbeat's reply)."""
        self.state.save_placement(result.assignments)
        self.placement = self.state.placement()
        self.version += 1
        where = "; ".join(f"{d}: " + ", ".join(f"{p}x{n}" for p, n in a.active.items())
                          + (f" (standby {a.standby})" if a.standby else "")
                          for d, a in result.assignments.items())
        unplaced = f"; unplaced: {', '.join(result.unplaced)}" if result.unplaced else ""
        short = [f"{d.name} ({n} of {d.replicas})" for d in self.config.deployments
                 if (a := result.assignments.get(d.name))
                 and (n := sum(a.active.values())) < d.replicas]
        short_text = f"; short of replicas: {', '.join(short)}" if short else ""
        self.state.event("placed", f"{why}: {where or 'nothing placed'}{unplaced}{short_text}")

    def save_plane(self, plane: Plane, url: str, last_seen: float) -> None:
        self.state.save_plane(plane, url, last_seen)
        self.planes = self.state.planes()
        self.version += 1

    def reported(self) -> dict[str, Assignment]:
        """The placement the planes' reported fleets amount to (for re-adoption)."""
        active: dict[str, dict[str, int]] = {}
        for name, live in self.live.items():
            for f in live.fleets.values():
                active.setdefault(f.deployment, {})[name] = f.replicas
        return {d: Assignment(a) for d, a in active.items()}

    def desired(self, plane_name: str) -> list[dict]:
        """The fleets `plane_name` should run: one per deployment placed on it."""
        deployments = {d.name: d for d in self.config.deployments}
        region = self.planes[plane_name][0].region
        out = []
        for name, a in self.placement.items():
            n = a.active.get(plane_name, 0) or int(a.standby == plane_name)
            if not n or name not in deployments:
                continue
            out.append({"deployment": name, "model": deployments[name].model, "replicas": n,
                        "role": "active" if a.active.get(plane_name) else "standby",
                        "serve_args": list(self.config.serve_args.get(name, ())),
                        "api_keys": self.keys_for(region)})
        return out

    def keys_for(self, region: str) -> list[str]:
        """`--api-keys` lines for a fleet in `region`: only the tenants allowed there, so a
        plane outside a tenant's regions refuses its key even if a request reached it."""
        allowed = {t.name for t in self.config.tenants.values()
                   if not t.regions or region in t.regions}
        return [f"{k.key} {k.tenant}" for k in self.config.keys if k.tenant in allowed]

    def views(self, role: str) -> list[PlaneView]:
        """Planes for routing.candidates, each serving the models of its ready fleets whose
        deployment places `role` ("active" or "standby") there, with its requests now."""
        if self.routes_version != self.version:
            self.routes = {r: self._route_table(r) for r in ("active", "standby")}
            self.routes_version = self.version
        return [PlaneView(v.name, v.region, v.up, v.models,
                          self.live.get(v.name, PlaneLive()).in_flight)
                for v in self.routes[role]]

    def _route_table(self, role: str) -> list[PlaneView]:
        out = []
        for name, (plane, _, _) in self.planes.items():
            live = self.live.get(name, PlaneLive())
            models = frozenset(f.model for f in live.fleets.values() if f.ready and
                               _role(self.placement.get(f.deployment), name) == role)
            out.append(PlaneView(name, plane.region, plane.up, models, 0))
        return out

    def fleet_url(self, plane_name: str, model: str) -> str | None:
        for f in self.live.get(plane_name, PlaneLive()).fleets.values():
            if f.ready and f.model == model:
                return f.url
        return None

    def snapshot(self) -> dict:
        """GET /control."""
        placement = self.placement
        deployments = [{"name": d.name, "model": d.model, "replicas": d.replicas,
                        "mode": d.mode, "regions": list(d.regions),
                        "placement": ({"active": a.active, "standby": a.standby}
                                      if (a := placement.get(d.name)) else None),
                        "state": _deployment_state(d.name, a, self.live)}
                       for d in self.config.deployments]
        served: dict[str, dict[str, int]] = {}
        for (tenant, plane), n in sorted(self.served.items()):
            served.setdefault(tenant, {})[plane] = n
        return {"planes": [self._plane_view(p, placement) for p, _, _ in
                           self.planes.values()],
                "deployments": deployments, "served": served, "events": self.state.events()}

    def _plane_view(self, plane: Plane, placement: dict[str, Assignment]) -> dict:
        deployments = {d.name: d for d in self.config.deployments}
        used = [(deployments[d], a.active.get(plane.name, 0) + int(a.standby == plane.name))
                for d, a in placement.items() if d in deployments]
        live = self.live.get(plane.name, PlaneLive())
        return {"name": plane.name, "region": plane.region, "spot": plane.spot,
                "health": "up" if plane.up else "down",
                "cost_per_hour": plane.cost_per_hour,
                "capacity": {"cores": plane.cores, "memory_mib": plane.memory_mib},
                "use": {"cores": sum(d.cores * n for d, n in used),
                        "memory_mib": sum(d.memory_mib * n for d, n in used)},
                "load": live.load, "in_flight": live.in_flight,
                "requests": sum(n for (_, p), n in self.served.items() if p == plane.name),
                "replicas": _placed_on(plane.name, placement, live),
                "fleets": [vars(f) for f in live.fleets.values()]}


def _placed_on(plane_name: str, placement: dict[str, Assignment], live: PlaneLive
               ) -> list[dict]:
    """The replicas the placement puts on `plane_name`, by deployment, and whether the plane
    reports that deployment's fleet ready."""
    out = []
    for name, a in placement.items():
        n = a.active.get(plane_name, 0) or int(a.standby == plane_name)
        if n:
            f = live.fleets.get(name)
            out.append({"deployment": name, "count": n,
                        "role": "active" if a.active.get(plane_name) else "standby",
                        "ready": f is not None and f.ready})
    return out


def _role(a: Assignment | None, plane_name: str) -> str:
    """A fleet no longer placed on its plane serves as active until the plane stops it."""
    return "standby" if a is not None and a.standby == plane_name else "active"


def _deployment_state(name: str, a: Assignment | None, live: dict[str, PlaneLive]) -> str:
    if a is None:
        return "unplaced"
    ready = [p for p in a.active if (f := live.get(p, PlaneLive()).fleets.get(name))
             and f.ready]
    return "ready" if len(ready) == len(a.active) else "partly ready" if ready else "starting"

"""`ember plane`: a workload plane's agent. It heartbeats the control plane with its capacity,
load and fleets, and drives its local `ember route` fleets toward the fleets the reply asks
for (it pulls its work: the control plane never calls it).

    reply lists a deployment that does not run here  -> start its fleet (a free port)
    ... with another replica count, options or keys    -> start the new fleet, stop the old
                                                          one once the new one is ready
    a fleet runs here that the reply does not list     -> stop it (SIGTERM: it drains)
    a fleet's process exited                            -> forgotten; started again if listed

A plane keeps nothing across a restart; its fleets die with it (their parent-death signal).
In front of a Ray cluster (`ray`), each fleet is `ember route --ray ADDRESS`: its gateway runs
here and its replicas are Ray actors, and the plane's capacity is re-read from the cluster
on each heartbeat (`capacity`).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import aiohttp

from ember.control.placement import Plane
from ember.router.replicas import ProcessHandle, die_with_parent, free_port

log = logging.getLogger(__name__)


@dataclass
class LocalFleet:
    spec: dict                      # the desired fleet the control plane sent
    handle: ProcessHandle
    ready: bool = False

    def report(self) -> dict:
        return {"deployment": self.spec["deployment"], "model": self.spec["model"],
                "url": self.handle.url, "replicas": self.spec["replicas"], "ready": self.ready}


def same_fleet(a: dict, b: dict) -> bool:
    keys = ("model", "replicas", "serve_args", "api_keys")
    return all(a.get(k) == b.get(k) for k in keys)


@dataclass
class PlaneAgent:
    plane: Plane
    control_url: str
    heartbeat_s: float = 1.0
    host: str = "127.0.0.1"
    token: str | None = None        # the control plane's plane token, sent as a bearer
    ray: str | None = None          # the Ray cluster (GCS address) its fleets' replicas join
    capacity: Callable[[], tuple[int, int]] | None = None   # (cores, memory MiB) now
    log_dir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="ember-plane-"))
    fleets: dict[str, LocalFleet] = field(default_factory=dict)
    replacing: dict[str, LocalFleet] = field(default_factory=dict)   # the next, starting

    def heartbeat_body(self) -> dict:
        p = self.plane
        return {"name": p.name, "region": p.region, "cores": p.cores,
                "memory_mib": p.memory_mib, "cost_per_hour": p.cost_per_hour, "spot": p.spot,
                "load": os.getloadavg()[0],
                "fleets": [f.report() for f in self.fleets.values()]}

    async def run(self) -> None:
        async with aiohttp.ClientSession() as session:
            try:
                while True:
                    await self.tick(session)
                    await asyncio.sleep(self.heartbeat_s)
            finally:
                await self.stop_all()

    async def tick(self, session: aiohttp.ClientSession) -> None:
        await self.probe(session)
        if self.capacity is not None:
            await self.refresh_capacity()
        try:
            async with session.post(self.control_url + "/control/planes",
                                    json=self.heartbeat_body(), headers=self.auth(),
                                    timeout=aiohttp.ClientTimeout(total=10)) as resp:
                reply = await resp.json()
                if resp.status != 200:
                    log.warning("the control plane refused the heartbeat (%d): %s",
                                resp.status, reply.get("error", {}).get("message", reply))
                    return
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as e:
            # fleets keep serving while the control plane is away
            log.warning("no answer from the control plane at %s (%s); retrying",
                        self.control_url, e)
            return
        await self.reconcile(reply["fleets"])

    async def refresh_capacity(self) -> None:
        try:
            cores, memory_mib = await asyncio.to_thread(self.capacity)
        except Exception as e:   # Ray's errors share no base class; keep the last
            log.warning("could not read the Ray cluster's capacity (%s); reporting the last",
                        e)
            return
        self.plane = replace(self.plane, cores=cores, memory_mib=memory_mib)

    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    async def reconcile(self, desired: list[dict]) -> None:
        wanted = {d["deployment"]: d for d in desired}
        for name, spec in wanted.items():
            running = self.fleets.get(name)
            if running is None:
                self.fleets[name] = self.start(spec)
            elif not same_fleet(running.spec, spec) and not (
                    name in self.replacing and same_fleet(self.replacing[name].spec, spec)):
                if name in self.replacing:
                    await self.replacing.pop(name).handle.stop()
                self.replacing[name] = self.start(spec)
        for name in [n for n in self.fleets if n not in wanted]:
            log.info("stopping fleet %s: no longer placed here", name)
            await self.fleets.pop(name).handle.stop()
            if name in self.replacing:
                await self.replacing.pop(name).handle.stop()

    async def probe(self, session: aiohttp.ClientSession) -> None:
        """Each fleet's readiness; a started replacement takes over once ready."""
        for table in (self.fleets, self.replacing):
            for name, fleet in list(table.items()):
                if not await fleet.handle.alive():
                    log.warning("fleet %s exited: %s", name, fleet.handle.exit_report())
                    del table[name]
                    continue
                fleet.ready = await _ready(session, fleet.handle.url)
        for name, fleet in list(self.replacing.items()):
            if fleet.ready:
                old = self.fleets.get(name)
                self.fleets[name] = self.replacing.pop(name)
                if old is not None:
                    await old.handle.stop()

    def start(self, spec: dict) -> LocalFleet:
        """`ember route` on a free port with the deployment's options. Started on the
        agent's main thread, so the parent-death signal ties the fleet to the agent."""
        port = free_port(self.host)
        name = spec["deployment"]
        keys_path = None
        if spec.get("api_keys"):
            keys_path = os.path.join(self.log_dir, f"{name}-{port}.keys")
            with open(os.open(keys_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600),
                      "w") as f:
                f.write("\n".join(spec["api_keys"]) + "\n")
        argv = fleet_argv(spec, self.host, port, self.ray, keys_path)
        log_path = os.path.join(self.log_dir, f"{name}-{port}.log")
        with open(log_path, "ab") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True,
                                    preexec_fn=die_with_parent(os.getpid()))
        log.info("started fleet %s (%d replicas) on port %d", name, spec["replicas"], port)
        return LocalFleet(spec, ProcessHandle(proc, f"http://{self.host}:{port}", log_path))

    async def stop_all(self) -> None:
        fleets = [*self.fleets.values(), *self.replacing.values()]
        for f in fleets:
            await f.handle.stop()
        for f in fleets:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(f.handle.proc.wait, 30)


def fleet_argv(spec: dict, host: str, port: int, ray: str | None, keys_path: str | None
               ) -> list[str]:
    """The `ember route` command of one desired fleet: on `ray`, its replicas are actors
    there (each `ember serve SERVE_ARGS`), else local processes."""
    argv = [sys.executable, "-m", "ember.cli", "route", "--host", host, "--port", str(port),
            "--replicas", str(spec["replicas"])]
    if ray is not None:
        argv += ["--ray", ray]
    argv += spec["serve_args"]
    if keys_path is not None:
        argv += ["--api-keys", keys_path]
    return argv


async def _ready(session: aiohttp.ClientSession, url: str) -> bool:
    try:
        async with session.get(url + "/health/ready",
                               timeout=aiohttp.ClientTimeout(total=2)) as resp:
            return resp.status == 200
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
        return False

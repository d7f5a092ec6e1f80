"""Replicas: what the gateway knows of each, and how one is started and stopped.

A replica is one HTTP entry point that serves the OpenAI API (an `ember serve`, or any
compatible server). The gateway only ever talks to `handle.url`; how the replica runs is the
handle's business: a local process, a Ray actor, or a server started elsewhere. A later
prefill/decode pair is two replicas of the one group, each with its role (disagg.py).

    states:  starting -> ready <-> (ejected while failing) -> draining -> stopped
                  \\-> dead (exited; a local or Ray replica is restarted with backoff)
                        \\-> failed (exited before it was ready, a few times in a row:
                                   not restarted; its last log lines say why)
"""
from __future__ import annotations

import asyncio
import ctypes
import enum
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol


class ReplicaState(str, enum.Enum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    STOPPED = "stopped"
    DEAD = "dead"
    FAILED = "failed"


class ReplicaHandle(Protocol):
    """A running replica: where it answers, and how to end it. Its methods are coroutines
    because a remote one (a Ray actor) answers over the network, and the gateway's event loop
    must never wait on that."""

    url: str            # "" until known; a handle may move it (a Ray actor that Ray restarted)
    pid: int | None

    async def alive(self) -> bool:
        """False once it exited for good; True while it runs or cannot be told (then the
        probes keep it out of routing). It may update `url` first."""

    async def stop(self) -> None:
        """Ask it to drain and exit (SIGTERM for a process)."""

    async def kill(self) -> None: ...

    def exit_report(self) -> dict:
        """Once it has exited: {"code": its exit status or None, "log_tail": its last log
        lines} (empty where the gateway cannot see its output)."""


class Launcher(Protocol):
    """Starts replicas; `None` from `start` means this launcher cannot add any."""

    def start(self, replica_id: str) -> ReplicaHandle | None: ...


@dataclass
class PromptBacklog:
    """Uncached prompt tokens the gateway has outstanding on one side (a prefill replica's
    prefill stages, or the prompts kept on decode replicas), and the rate it computes them
    at: tokens finished over the seconds it had any outstanding, a queue's service rate,
    which its backlog drains at. Times are arguments: the caller's clock."""

    tokens: int = 0
    num_requests: int = 0
    tokens_done: int = 0
    busy_s: float = 0.0                 # finished busy periods
    busy_since: float | None = None     # the current one's start

    def add(self, tokens: int, now: float) -> None:
        if self.num_requests == 0:
            self.busy_since = now
        self.num_requests += 1
        self.tokens += tokens

    def remove(self, tokens: int, now: float, computed: bool) -> None:
        """One request's prompt left the backlog: `computed` (its first token came), or
        failed."""
        self.num_requests = max(0, self.num_requests - 1)
        self.tokens = max(0, self.tokens - tokens)
        self.tokens_done += tokens if computed else 0
        if self.num_requests == 0 and self.busy_since is not None:
            self.busy_s += now - self.busy_since
            self.busy_since = None

    def rate(self, now: float) -> float | None:
        """Prompt tokens a second, measured; None before any was computed."""
        busy_s = self.busy_s + (now - self.busy_since if self.busy_since is not None else 0)
        return self.tokens_done / busy_s if self.tokens_done and busy_s > 0 else None


@dataclass
class Replica:
    id: str
    handle: ReplicaHandle
    group: str = "primary"          # primary | canary | shadow
    role: str = "both"              # both | prefill | decode (disaggregated serving)
    state: ReplicaState = ReplicaState.STARTING
    started_at: float = field(default_factory=time.monotonic)
    ready_at: float | None = None
    running: int = 0                # the replica's own gauges, from its /metrics
    waiting: int = 0
    kv_usage: float = 0.0
    in_flight: int = 0              # the gateway's requests on it, raised at decision time
    # the prefill stages the gateway has outstanding on it (a prefill replica's backlog: how
    # long a new prompt would wait there)
    backlog: PromptBacklog = field(default_factory=PromptBacklog)
    ejected_until: float = 0.0      # passive ejection: no new request before this
    busy_until: float = 0.0         # it answered 429 (full, not broken): skipped till then
    restarts: int = 0
    supports_events: bool = True    # False once /kv/events answered 404: text tree instead
    first_byte_at: float | None = None  # the first answer's first byte since (re)start
    load_phases: dict[str, float] = field(default_factory=dict)  # its own start-up report
    model_name: str | None = None   # the model its gauges name
    pooling: str | None = None      # how its /v1/embeddings pools (its /v1/models says)
    adapters: dict[str, str] = field(default_factory=dict)  # LoRA name -> digest of its files
    early_deaths: int = 0           # exits in a row before it was ready
    last_exit: dict | None = None   # the last exit's status and log lines (exit_report)

    @property
    def url(self) -> str:
        return self.handle.url

    def up(self, now: float) -> bool:
        """Ready and not ejected: it serves, though it may be busy."""
        return self.state is ReplicaState.READY and now >= self.ejected_until

    def routable(self, now: float) -> bool:
        return self.up(now) and now >= self.busy_until

    def view(self) -> dict:
        """This replica in GET /fleet."""
        return {"id": self.id, "url": self.url, "pid": self.handle.pid, "group": self.group,
                "role": self.role, "model": self.model_name, "state": self.state.value,
                "running": self.running, "waiting": self.waiting, "kv_usage": self.kv_usage,
                "in_flight": self.in_flight, "prompt_backlog": self.backlog.tokens,
                "prompt_tokens_per_s": _rounded(self.backlog.rate(time.monotonic())),
                "busy": time.monotonic() < self.busy_until,
                "restarts": self.restarts, "cold_start": self.cold_start(),
                "last_exit": self.last_exit}

    def cold_start(self) -> dict:
        """Seconds from the launch to ready and to the first byte, and the replica's own
        phases (process, files, kernels, weights, kv_cache, warm_up)."""
        def since(t: float | None) -> float | None:
            return round(t - self.started_at, 3) if t is not None else None
        return {"ready_s": since(self.ready_at), "first_byte_s": since(self.first_byte_at),
                "phases": {k: round(v, 3) for k, v in self.load_phases.items()}}


def _rounded(rate: float | None) -> float | None:
    return round(rate, 1) if rate is not None else None


@dataclass
class RemoteHandle:
    """A server started elsewhere (--replica-url): the gateway neither starts nor stops it."""

    url: str
    pid: int | None = None
    stopped: bool = False   # the gateway stopped using it; the server itself runs on

    async def alive(self) -> bool:
        return not self.stopped

    async def stop(self) -> None:
        self.stopped = True

    async def kill(self) -> None:
        pass

    def exit_report(self) -> dict:
        return {"code": None, "log_tail": []}


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class ProcessHandle:
    """A local `ember serve` subprocess in its own process group."""

    proc: subprocess.Popen
    url: str
    log_path: str

    @property
    def pid(self) -> int | None:
        return self.proc.pid

    async def alive(self) -> bool:
        return self.proc.poll() is None

    async def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    async def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        try:   # reaped in a thread: the loop goes on meanwhile
            await asyncio.to_thread(self.proc.wait, 5)
        except subprocess.TimeoutExpired:
            pass

    def exit_report(self, num_lines: int = 20) -> dict:
        return {"code": self.proc.poll(), "log_tail": log_tail(self.log_path, num_lines)}


def log_tail(path: str, num_lines: int, max_bytes: int = 16384) -> list[str]:
    """The last `num_lines` lines of the file at `path` (read from its last `max_bytes`)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - max_bytes))
            text = f.read().decode(errors="replace")
    except OSError:
        return []
    return [line for line in text.splitlines() if line.strip()][-num_lines:]


def replica_environment(environ: Mapping[str, str], local_replicas: int
                        ) -> dict[str, str] | None:
    """The environment of a local replica when `local_replicas` may run at once on this
    machine: the gateway's own (None), except that torch's threads wait passively when
    several replicas share the cores (each one's threads default to all of them, and a
    spinning thread keeps a core from a peer that a parallel region is waiting for: two
    replicas on 2 cores served the multi-tenant benchmark in 171 s spinning, 35 s passive).
    A wait policy the user set is kept."""
    if local_replicas < 2 or "OMP_WAIT_POLICY" in environ:
        return None
    return {**environ, "OMP_WAIT_POLICY": "passive"}


def replica_cpu_binds(available: list[int], num_replicas: int, num_ranks: int
                      ) -> list[str] | None:
    """Each local replica slot's `--cpu-bind` where a replica is `num_ranks` processes
    (tensor x pipeline parallel): `available` cores split evenly among `num_replicas`
    replicas, each replica's share among its ranks (e.g. 8 cores, 2 replicas of 2 ranks:
    '0,1|2,3' and '4,5|6,7'), so that replicas do not pile their ranks onto the same cores;
    None where there are fewer cores than ranks in all (the ranks' own split then applies)."""
    if num_replicas < 1 or num_ranks < 2 or len(available) < num_replicas * num_ranks:
        return None
    per_replica = len(available) // num_replicas
    per_rank = per_replica // num_ranks
    binds = []
    for replica in range(num_replicas):
        first = replica * per_replica
        ranks = [available[first + r * per_rank:first + (r + 1) * per_rank]
                 for r in range(num_ranks)]
        binds.append("|".join(",".join(map(str, cores)) for cores in ranks))
    return binds


PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int, cpus: tuple[int, ...] | None = None
                    ) -> Callable[[], None]:
    """For Popen's preexec_fn: the child gets SIGTERM when the process that started it dies,
    even of SIGKILL, so a gateway's replicas never outlive it as orphans holding their KV
    cache and cores (Linux's parent-death signal; elsewhere nothing). The signal follows the
    thread that started the child: replicas are started on the gateway's main thread, which
    lives as long as the process. `cpus`: the cores the child may run on (its torch threads
    follow its affinity)."""
    def arm() -> None:
        if cpus and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, cpus)
        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        except (OSError, AttributeError):   # no prctl here
            return
        if os.getppid() != parent_pid:      # the parent died before the signal was armed
            os.kill(os.getpid(), signal.SIGTERM)
    return arm


class LocalLauncher:
    """`ember serve` subprocesses on free ports of `host`, each with `serve_args` and `env`
    (None: the gateway's environment; the fleet sets it once it knows how many local
    replicas share the machine), and, where a replica is several ranks, the `--cpu-bind` of
    a slot of cores no running replica holds (`cpu_binds`, set by the fleet too). Their
    output goes to a log file per replica in `log_dir` (by default a temporary folder, made
    when the first replica starts)."""

    def __init__(self, serve_args: list[str], host: str = "127.0.0.1",
                 log_dir: str | None = None, cpus: tuple[int, ...] | None = None) -> None:
        self.serve_args = list(serve_args)
        self.host = host
        self._log_dir = log_dir
        self.env: dict[str, str] | None = None
        self.cpus = cpus        # the cores its replicas run on (None: the gateway's)
        self.cpu_binds: list[str] | None = None
        self._slots: dict[int, subprocess.Popen] = {}   # cpu_binds index -> its replica

    def command(self, port: int) -> list[str]:
        return [sys.executable, "-m", "ember.cli", "serve", "--host", self.host,
                "--port", str(port), *self.serve_args]

    @property
    def log_dir(self) -> str:
        if self._log_dir is None:
            self._log_dir = tempfile.mkdtemp(prefix="ember-fleet-")
        return self._log_dir

    def start(self, replica_id: str) -> ProcessHandle:
        port = free_port(self.host)
        log_path = os.path.join(self.log_dir, f"{replica_id}.log")
        slot = self._free_slot()
        bind = [] if slot is None else ["--cpu-bind", self.cpu_binds[slot]]
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(self.command(port) + bind, stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, env=self.env,
                                    preexec_fn=die_with_parent(os.getpid(), self.cpus))
        if slot is not None:
            self._slots[slot] = proc
        return ProcessHandle(proc, f"http://{self.host}:{port}", log_path)

    def _free_slot(self) -> int | None:
        """The first slot of cores whose replica has exited (or that never had one); None
        without slots, or where every one is held (the ranks then split all cores)."""
        for slot in range(len(self.cpu_binds or ())):
            holder = self._slots.get(slot)
            if holder is None or holder.poll() is not None:
                return slot
        return None

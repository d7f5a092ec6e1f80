"""Replicas as Ray actors: one actor per replica, each running `ember serve` on its node.

Ray places the actors, restarts one whose process dies (`max_restarts`), and carries the
calls; the gateway still reaches each replica over HTTP at the URL its actor reports, so the
router, the probes and the autoscaler are the same code as for local processes.

    actor restarted by Ray  -> a new server on a new port: the handle reports the new URL
                               and the fleet keeps the replica (same id, probed anew)
    its server exited       -> alive() is False: the fleet ends the actor, starts another
    Ray gave up on it       -> alive() is False (past max_restarts): likewise

Every call is awaited with a timeout, never waited on with `ray.get`: the gateway's event
loop serves requests meanwhile. An actor that is slow to answer (still placed, restarting,
or busy) is alive but unknown; the probes decide whether it takes requests.

Import this module only when --ray is given: `import ray` is slow and ray is optional.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ember.distributed.ray_cluster import connect, forwarded_env, ray
from ember.errors import ConfigError
from ember.router.replicas import die_with_parent

ACTOR_RESTARTS = 3
CALL_TIMEOUT_S = 2.0     # the longest a check waits for the call it makes
# files a replica reads that exist only where the gateway runs (an `ember plane` writes its
# tenants' keys there): their text travels with the actor, which writes it on its own node
SHIPPED_FILES = ("--api-keys",)


@ray.remote(num_cpus=1, max_restarts=ACTOR_RESTARTS, max_task_retries=0)
class ReplicaActor:
    """Runs one `ember serve` on this node, on a free port, for as long as it lives."""

    def __init__(self, serve_args: list[str], files: dict[str, str]) -> None:
        host = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        self.url = f"http://{host}:{port}"
        self.folder = tempfile.mkdtemp(prefix="ember-replica-")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ember.cli", "serve", "--host", "0.0.0.0", "--port",
             str(port), *serve_args, *write_files(files, self.folder)],
            stdin=subprocess.DEVNULL, preexec_fn=die_with_parent(os.getpid()))

    def info(self) -> tuple[str, int, int | None]:
        """Its server's URL, pid, and exit status (None while it runs)."""
        return self.url, self.proc.pid, self.proc.poll()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        shutil.rmtree(self.folder, ignore_errors=True)   # the server read them at its start


@dataclass
class RayHandle:
    """A replica in a `ReplicaActor`. `url` is "" until the actor first reports it."""

    actor: ray.actor.ActorHandle
    url: str = ""
    pid: int | None = None
    exit_code: int | None = None
    failure: str | None = None      # why Ray gave up on the actor, once it has
    # one info call in flight at a time: a check waits for a call it makes, up to
    # CALL_TIMEOUT_S, and takes an older, slower one's answer only once it has come
    _info: asyncio.Future | None = field(default=None, repr=False)

    async def alive(self) -> bool:
        info, wait_s = self._info, 0.0
        if info is None:
            info, wait_s = self.actor.info.remote().as_future(), CALL_TIMEOUT_S
            self._info = info
        done, _ = await asyncio.wait({info}, timeout=wait_s)
        if not done:
            return True             # not placed yet, or slow: unknown, so the probes decide
        if self._info is info:
            self._info = None
        try:
            self.url, self.pid, self.exit_code = info.result()
        except ray.exceptions.ActorUnavailableError:
            return True             # Ray is restarting it
        except ray.exceptions.RayError as e:   # past max_restarts, or it never started
            self.failure = f"Ray gave up on the actor: {type(e).__name__}: " + \
                str(e).strip().partition("\n")[0]
            return False
        return self.exit_code is None

    async def stop(self) -> None:
        try:
            await asyncio.wait_for(self.actor.stop.remote(), CALL_TIMEOUT_S)
        except (ray.exceptions.RayError, asyncio.TimeoutError):
            pass                    # gone or unreachable: kill() ends it

    async def kill(self) -> None:
        ray.kill(self.actor, no_restart=True)   # only sends the request: it does not wait

    def exit_report(self) -> dict:
        # its server's output is in the Ray node's logs
        return {"code": self.exit_code, "log_tail": [self.failure] if self.failure else []}


class RayLauncher:
    """Starts each replica as a `ReplicaActor` on the Ray cluster at `address` (None: the
    one `ray start` set up on this machine, else a new local one). A replica of several
    ranks (`num_ranks`: T x P) places its other ranks on the same cluster
    (ray_rank_args)."""

    def __init__(self, serve_args: list[str], address: str | None = None,
                 num_ranks: int = 1) -> None:
        self.serve_args, self.files = ship_files(serve_args)
        self.serve_args = ray_rank_args(self.serve_args, num_ranks, connect(address))

    def start(self, replica_id: str) -> RayHandle:
        """The actor is asked for; Ray places and starts it in the background (minutes, on a
        full cluster), and the handle learns its URL from its first answer."""
        return RayHandle(ReplicaActor.options(runtime_env={"env_vars": forwarded_env()}).remote(
            self.serve_args, self.files))


def ray_rank_args(serve_args: list[str], num_ranks: int, cluster: str) -> list[str]:
    """`serve_args` for a replica of `num_ranks` ranks on the cluster at `cluster`: its ranks
    as Ray actors on that cluster (`--distributed-executor ray --ray-address CLUSTER`),
    unless the args choose local processes (mp) or another address themselves; as they
    are for a replica of one rank."""
    executor = option_value(serve_args, "--distributed-executor")
    if num_ranks == 1 or executor == "mp":
        return serve_args
    args = serve_args if executor else [*serve_args, "--distributed-executor", "ray"]
    return args if option_value(args, "--ray-address") else [*args, "--ray-address", cluster]


def option_value(args: list[str], option: str) -> str | None:
    """The value `args` give `option` (`--option VALUE` or `--option=VALUE`), or None."""
    for i, token in enumerate(args):
        name, eq, value = token.partition("=")
        if name == option:
            return value if eq else (args[i + 1] if i + 1 < len(args) else None)
    return None


def ship_files(serve_args: list[str]) -> tuple[list[str], dict[str, str]]:
    """`serve_args` without the SHIPPED_FILES options, and those files' text by option."""
    args: list[str] = []
    files: dict[str, str] = {}
    tokens = iter(serve_args)
    for token in tokens:
        option, eq, value = token.partition("=")
        if option not in SHIPPED_FILES:
            args.append(token)
            continue
        path = value if eq else next(tokens, None)
        if not path:
            raise ConfigError(f"{option} needs a file")
        try:
            files[option] = Path(path).read_text()
        except OSError as e:
            raise ConfigError(f"{option} {path}: {e.strerror}; give a readable file") from None
    return args, files


def write_files(files: dict[str, str], folder: str) -> list[str]:
    """Each shipped file written into `folder` (only its owner may read it); the options
    that name them."""
    argv: list[str] = []
    for option, text in files.items():
        path = os.path.join(folder, option.lstrip("-"))
        with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            f.write(text)
        argv += [option, path]
    return argv


def cluster_capacity() -> tuple[int, int]:
    """The joined cluster's CPUs and memory for tasks (MiB), as Ray counts them now (nodes
    join and leave)."""
    total = ray.cluster_resources()
    return int(total.get("CPU", 0)), int(total.get("memory", 0)) // 2**20

"""Replicas as Ray actors: one actor per replica, each running `ember serve` on its node.

Ray places the actors, restarts one whose process dies (`max_restarts`), and carries the
calls; the gateway still reaches each replica over HTTP at the URL its actor reports, so the
router, the probes and the autoscaler are the same code as for local processes. A restarted
actor starts a new server on a new port: its handle notices the URL changed and reports the
old replica dead, and the fleet takes the new one through its usual restart path.

Import this module only when --ray is given: `import ray` is slow and ray is optional.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass

import ray

from ember.router.replicas import die_with_parent

ACTOR_RESTARTS = 3
# what a replica needs from the gateway's environment to run the same ember the same way
FORWARDED_ENV = ("PYTHONPATH", "TORCH_EXTENSIONS_DIR", "EMBER_MODEL", "EMBER_API_KEY")
CALL_TIMEOUT_S = 10.0


@ray.remote(num_cpus=1, max_restarts=ACTOR_RESTARTS, max_task_retries=0)
class ReplicaActor:
    """Runs one `ember serve` on this node, on a free port, for as long as it lives."""

    def __init__(self, serve_args: list[str]) -> None:
        host = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        self.url = f"http://{host}:{port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ember.cli", "serve", "--host", "0.0.0.0", "--port",
             str(port), *serve_args], stdin=subprocess.DEVNULL,
            preexec_fn=die_with_parent(os.getpid()))

    def info(self) -> tuple[str, int, bool]:
        return self.url, self.proc.pid, self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)


@dataclass
class RayHandle:
    actor: object
    url: str
    pid: int | None

    def alive(self) -> bool:
        try:
            url, _, running = ray.get(self.actor.info.remote(), timeout=CALL_TIMEOUT_S)
        except (ray.exceptions.RayError, TimeoutError):
            return False
        return running and url == self.url

    def stop(self) -> None:
        try:
            ray.get(self.actor.stop.remote(), timeout=CALL_TIMEOUT_S)
        except (ray.exceptions.RayError, TimeoutError):
            pass

    def kill(self) -> None:
        ray.kill(self.actor, no_restart=True)

    def exit_report(self) -> dict:
        return {"code": None, "log_tail": []}   # its output is in the Ray node's logs


class RayLauncher:
    """Starts each replica as a `ReplicaActor` on the Ray cluster at `address` (None: the
    one `ray start` set up on this machine, else a new local one)."""

    def __init__(self, serve_args: list[str], address: str | None = None) -> None:
        self.serve_args = list(serve_args)
        if not ray.is_initialized():
            ray.init(address=address, ignore_reinit_error=True, log_to_driver=False)

    def start(self, replica_id: str) -> RayHandle:
        env = {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ}
        actor = ReplicaActor.options(runtime_env={"env_vars": env}).remote(self.serve_args)
        url, pid, _ = ray.get(actor.info.remote(), timeout=120)
        return RayHandle(actor, url, pid)

"""A gateway's local replicas end with it, even when it is SIGKILLed: none lives on as an
orphan holding its KV cache and cores."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

GATEWAY = """
import sys, time
from ember.router.replicas import LocalLauncher
launcher = LocalLauncher([], log_dir=sys.argv[1])
launcher.command = lambda port: [sys.executable, "-c", "import time; time.sleep(300)"]
print(launcher.start("p1").pid, flush=True)
time.sleep(300)
"""


def running(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie waiting for its reaper is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def test_local_replicas_die_with_a_sigkilled_gateway(tmp_path):
    gateway = subprocess.Popen([sys.executable, "-c", GATEWAY, str(tmp_path)],
                               stdout=subprocess.PIPE, text=True)
    replica_pid = None
    try:
        replica_pid = int(gateway.stdout.readline())
        assert running(replica_pid)
        os.kill(gateway.pid, signal.SIGKILL)
        gateway.wait(10)
        deadline = time.monotonic() + 10
        while running(replica_pid):
            assert time.monotonic() < deadline, "the replica outlived its gateway"
            time.sleep(0.05)
    finally:
        gateway.kill()
        if replica_pid is not None and running(replica_pid):
            os.kill(replica_pid, signal.SIGKILL)

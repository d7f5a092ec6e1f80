"""Local replicas that share the machine's cores get passive threads; one alone, or a wait
policy the user chose, keeps the environment as it is."""
from __future__ import annotations

import pytest

from ember.cli import build_parser, server_config
from ember.router.cli import router_config
from ember.router.main import local_replicas
from ember.router.replicas import LocalLauncher, replica_environment


def route_args(*argv: str) -> tuple[object, int]:
    args = build_parser().parse_args(["route", "--model", "m.gguf", *argv])
    return args, local_replicas(args, router_config(args, server_config(args)))


@pytest.mark.parametrize("argv, expected", [
    ((), 1),
    (("--replicas", "2"), 2),
    (("--replicas", "1", "--max-replicas", "3"), 3),            # autoscaling's largest
    (("--replicas", "0", "--min-replicas", "0", "--max-replicas", "2",
      "--scale-to-zero-after", "30"), 2),
    (("--canary", "new.gguf:10"), 2),                            # a local candidate
    (("--shadow", "http://10.0.0.9:8000:5"), 1),                 # a remote one runs elsewhere
    (("--replica-url", "http://10.0.0.8:8000"), 0),
    (("--replicas", "2", "--ray"), 0),                           # Ray places its actors
    (("--replica-url", "http://10.0.0.8:8000", "--canary", "new.gguf:10"), 1),
])
def test_local_replicas_counts_what_may_run_on_this_machine_at_once(argv, expected):
    assert route_args(*argv)[1] == expected


def test_replicas_sharing_the_cores_wait_passively():
    environ = {"PATH": "/usr/bin", "EMBER_MODEL": "m.gguf"}
    assert replica_environment(environ, 0) is None
    assert replica_environment(environ, 1) is None
    shared = replica_environment(environ, 2)
    assert shared == {**environ, "OMP_WAIT_POLICY": "passive"}
    assert "OMP_WAIT_POLICY" not in environ                      # a copy, not the gateway's
    assert replica_environment({**environ, "OMP_WAIT_POLICY": "active"}, 4) is None


def test_a_local_launcher_starts_its_replicas_with_that_environment(tmp_path):
    launcher = LocalLauncher(["--help"], log_dir=str(tmp_path),
                             env={"PATH": "/usr/bin", "OMP_WAIT_POLICY": "passive"})
    launcher.command = lambda port: ["/usr/bin/env"]             # prints the environment
    handle = launcher.start("p1")
    handle.proc.wait(timeout=30)
    printed = (tmp_path / "p1.log").read_text().splitlines()
    assert "OMP_WAIT_POLICY=passive" in printed
    assert LocalLauncher(["--help"], log_dir=str(tmp_path)).env is None

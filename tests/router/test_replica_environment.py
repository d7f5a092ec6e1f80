"""Local replicas that share the machine's cores get passive threads; one alone, or a wait
policy the user chose, keeps the environment as it is. Replicas of several ranks (tensor x
pipeline parallel) each get a slot of cores of their own, one list per rank."""
from __future__ import annotations

import sys
import time

import pytest

from ember.cli import build_parser, server_config
from ember.router.cli import router_config, serve_argv
from ember.router.main import build_fleet, local_replicas
from ember.router.replicas import (LocalLauncher, log_tail, replica_cpu_binds,
                                  replica_environment)


def route_fleet(*argv: str):
    tokens = ["--model", "m.gguf", *argv]
    args = build_parser().parse_args(["route", *tokens])
    config = router_config(args, server_config(args))
    fleet, _ = build_fleet(args, serve_argv(tokens, args.route_only), config)
    return fleet, local_replicas(fleet.launchers,
                                 max(args.replicas, config.autoscale.max_replicas))


@pytest.mark.parametrize("argv, expected", [
    ((), 1),
    (("--replicas", "2"), 2),
    (("--replicas", "1", "--max-replicas", "3"), 3),            # autoscaling's largest
    (("--replicas", "0", "--min-replicas", "0", "--max-replicas", "2",
      "--scale-to-zero-after", "30"), 2),
    (("--canary", "new.gguf:10"), 2),                            # a local candidate
    (("--shadow", "http://10.0.0.9:8000:5"), 1),                 # a remote one runs elsewhere
    (("--replica-url", "http://10.0.0.8:8000"), 0),
    (("--replica-url", "http://10.0.0.8:8000", "--canary", "new.gguf:10"), 1),
])
def test_local_replicas_counts_what_may_run_on_this_machine_at_once(argv, expected, monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    fleet, count = route_fleet(*argv)
    assert count == expected
    passive = {"OMP_WAIT_POLICY": "passive"}.items()
    for launcher in fleet.launchers.values():                  # what each local one starts with
        assert (launcher.env is not None and passive <= launcher.env.items()) == (expected >= 2)


def test_replicas_placed_by_ray_are_not_local():
    class RayLike:                                              # any launcher but a local one
        def start(self, replica_id):
            raise AssertionError("not started here")
    assert local_replicas({"primary": RayLike()}, 4) == 0
    assert local_replicas({"primary": RayLike(),
                           "canary": LocalLauncher([], log_dir="unused")}, 4) == 1


def test_replicas_sharing_the_cores_wait_passively():
    environ = {"PATH": "/usr/bin", "EMBER_MODEL": "m.gguf"}
    assert replica_environment(environ, 0) is None
    assert replica_environment(environ, 1) is None
    shared = replica_environment(environ, 2)
    assert shared == {**environ, "OMP_WAIT_POLICY": "passive"}
    assert "OMP_WAIT_POLICY" not in environ                      # a copy, not the gateway's
    assert replica_environment({**environ, "OMP_WAIT_POLICY": "active"}, 4) is None


def test_a_local_launcher_starts_its_replicas_with_that_environment(tmp_path):
    launcher = LocalLauncher(["--help"], log_dir=str(tmp_path))
    launcher.env = {"PATH": "/usr/bin", "OMP_WAIT_POLICY": "passive"}
    launcher.command = lambda port: ["/usr/bin/env"]             # prints the environment
    handle = launcher.start("p1")
    handle.proc.wait(timeout=30)
    printed = (tmp_path / "p1.log").read_text().splitlines()
    assert "OMP_WAIT_POLICY=passive" in printed
    assert LocalLauncher(["--help"], log_dir=str(tmp_path)).env is None


def test_a_disaggregated_fleet_starts_each_role_on_its_own_cores(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3})
    fleet, _ = route_fleet("--prefill-replicas", "1", "--decode-replicas", "3")
    prefill, decode = fleet.launchers["prefill"], fleet.launchers["decode"]
    assert set(fleet.launchers) == {"prefill", "decode"}
    assert prefill.serve_args == ["--model", "m.gguf", "--role", "prefill"]
    assert decode.serve_args == ["--model", "m.gguf", "--role", "decode"]
    assert (prefill.cpus, decode.cpus) == ((0,), (1, 2, 3))
    assert all(launcher.env["OMP_WAIT_POLICY"] == "passive" for launcher in (prefill, decode))
    fleet, _ = route_fleet("--prefill-replicas", "1", "--decode-replicas", "1",
                           "--cpu-bind", "2")                  # the user's binding is kept
    assert fleet.launchers["prefill"].cpus is None


def test_replicas_of_several_ranks_get_slots_of_cores_one_list_per_rank():
    assert replica_cpu_binds(list(range(8)), 2, 2) == ["0,1|2,3", "4,5|6,7"]
    assert replica_cpu_binds([0, 1, 2, 3, 4], 1, 4) == ["0|1|2|3"]   # T x P = 4
    assert replica_cpu_binds([0, 1], 2, 2) is None      # fewer cores than ranks in all
    assert replica_cpu_binds(list(range(8)), 2, 1) is None   # one process each: no binding


@pytest.mark.parametrize("argv, binds", [
    (("--tensor-parallel-size", "2", "--pipeline-parallel-size", "2"), ["0|1|2|3"]),
    (("--tensor-parallel-size", "2", "--replicas", "2"), ["0|1", "2|3"]),
    (("--tensor-parallel-size", "2", "--cpu-bind", "3|2"), None),     # the user's own
    (("--pipeline-parallel-size", "2", "--oversubscribe-cpus"), None),
    ((), None),
])
def test_the_fleet_binds_each_local_replicas_ranks(argv, binds, monkeypatch):
    monkeypatch.setattr("ember.router.main.os.sched_getaffinity", lambda pid: {0, 1, 2, 3})
    fleet, _ = route_fleet(*argv)
    assert fleet.launchers["primary"].cpu_binds == binds


def test_expert_parallel_reaches_each_replica_as_a_serve_option(monkeypatch):
    monkeypatch.setattr("ember.router.main.os.sched_getaffinity", lambda pid: {0, 1, 2, 3})
    fleet, _ = route_fleet("--tensor-parallel-size", "2", "--expert-parallel")
    launcher = fleet.launchers["primary"]
    assert launcher.serve_args == ["--model", "m.gguf", "--tensor-parallel-size", "2",
                                   "--expert-parallel"]
    assert launcher.cpu_binds == ["0,1|2,3"]


def test_a_replica_takes_a_slot_no_running_replica_holds(tmp_path):
    launcher = LocalLauncher([], log_dir=str(tmp_path))
    launcher.cpu_binds = ["0|1", "2|3"]
    launcher.command = lambda port: [sys.executable, "-c", "import sys, time; "
                                     "print(sys.argv[1:], flush=True); time.sleep(60)"]
    handles = [launcher.start(f"r{i}") for i in range(3)]   # the third finds no free slot
    handles[0].proc.kill()
    handles[0].proc.wait()
    handles.append(launcher.start("r3"))                   # takes the first one's slot
    try:
        for handle, args in zip(handles, ([["--cpu-bind", "0|1"], ["--cpu-bind", "2|3"], [],
                                           ["--cpu-bind", "0|1"]])):
            deadline = time.monotonic() + 30
            while not log_tail(handle.log_path, 1) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert log_tail(handle.log_path, 1) == [repr(args)]
    finally:
        for handle in handles:
            handle.proc.kill()
            handle.proc.wait()

"""`ember plane --ray ADDRESS`: each fleet is `ember route --ray ADDRESS` (its replicas Ray
actors) and the plane reports the Ray cluster's capacity unless its flags say otherwise.

The command line is checked against ember's own parser; with ray installed, a plane in front
of a local Ray cluster of three CPUs registers that capacity, runs its fleet's two replicas as
actors there (the cluster's free CPUs drop by two) and serves through the control endpoint."""
from __future__ import annotations

import sys
import time

import httpx
import pytest

from ember.cli import build_parser
from ember.control.agent import fleet_argv
from ember.control.main import given_capacity
from ember.errors import ConfigError
from ember.router.cli import serve_argv

SPEC = {"deployment": "chat", "model": "m", "replicas": 2,
        "serve_args": ["--simulate", "profile.json", "--kv-cache-gib", "0.1"]}


def parsed(argv: list[str]):
    assert argv[:3] == [sys.executable, "-m", "ember.cli"]
    args = build_parser().parse_args(argv[3:])
    return args, serve_argv(argv[4:], args.route_only)


@pytest.mark.parametrize("ray", [None, "10.0.0.7:6379"])
def test_the_fleet_command_runs_its_replicas_where_the_plane_says(ray):
    args, replica_argv = parsed(fleet_argv(SPEC, "127.0.0.1", 8123, ray, "/keys"))
    assert args.ray == ray
    assert (args.host, args.port, args.replicas) == ("127.0.0.1", 8123, 2)
    assert args.simulate == "profile.json" and args.api_keys == "/keys"
    # what each replica (a process, or an actor's `ember serve`) is started with
    assert replica_argv == ["--simulate", "profile.json", "--kv-cache-gib", "0.1",
                            "--api-keys", "/keys"]
    args, _ = parsed(fleet_argv(SPEC, "0.0.0.0", 8124, ray, None))
    assert args.api_keys is None


def test_capacity_is_the_flags_else_the_clusters():
    assert given_capacity(None, None, (16, 65536)) == (16, 65536)
    assert given_capacity(4, None, (16, 65536)) == (4, 65536)
    assert given_capacity(None, 2.5, (16, 65536)) == (16, 2560)
    assert given_capacity(4, 2.0, None) == (4, 2048)
    for cores, memory_gib in ((None, 2.0), (4, None), (None, None)):
        with pytest.raises(ConfigError, match="--ray"):
            given_capacity(cores, memory_gib, None)


CONFIG = """
[[deployment]]
name = "chat"
model = "{model}"
replicas = 2
cores = 1
memory_gib = 1
serve_args = ["--simulate", "{profile}", "--kv-cache-gib", "{kv}"]

[[tenant]]
name = "acme"
keys = ["sk-acme"]
"""


@pytest.mark.ray
@pytest.mark.heavy
@pytest.mark.slow      # a Ray cluster, a plane and a fleet whose replica is an actor
def test_a_plane_in_front_of_a_ray_cluster(tmp_path, smollm_path):
    ray = pytest.importorskip("ray")
    from ember.router.prompts import load_tokenizer
    from tests.control.test_control_processes import Proc, ready
    from tests.plan.conftest import make_profile
    from tests.server.conftest import TEST_KV_GIB, free_port
    profile = make_profile(smollm_path, load_tokenizer(str(smollm_path)))
    profile.save(tmp_path / "profile.json")
    config = tmp_path / "deployments.toml"
    config.write_text(CONFIG.format(model=profile.model_name, profile=tmp_path / "profile.json",
                                    kv=TEST_KV_GIB))
    ray.init(address="local", num_cpus=3, include_dashboard=False, log_to_driver=False)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    control = Proc("control", "--config", str(config), "--state", str(tmp_path / "c.db"),
                   "--port", str(port))
    plane = Proc("plane", "--name", "ray-1", "--region", "eu", "--control", url,
                 "--heartbeat", "0.3", "--ray", ray.get_runtime_context().gcs_address)
    try:
        deadline = time.monotonic() + 240
        while True:
            assert plane.proc.poll() is None, plane.output()
            assert control.proc.poll() is None, control.output()
            try:
                snap = httpx.get(url + "/control", timeout=10).json()
                if ready(snap, "chat"):
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, plane.output()
            time.sleep(0.5)
        [reported] = snap["planes"]
        capacity = reported["capacity"]                         # the cluster's: no flags
        assert capacity["cores"] == 3
        assert capacity["memory_mib"] == int(ray.cluster_resources()["memory"]) // 2**20
        assert ray.available_resources().get("CPU", 0) == 1    # 2 replicas' actors
        # the fleet's replicas got the plane's keys file as text (shipped with the actor)
        r = httpx.post(url + "/v1/completions", timeout=60, headers={
            "Authorization": "Bearer sk-acme"}, json={
            "model": profile.model_name, "prompt": "Hello", "max_tokens": 4})
        assert r.status_code == 200, r.text
    finally:
        plane.end()
        control.end()
        ray.shutdown()

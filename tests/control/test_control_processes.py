"""`ember control` with three `ember plane` agents (eu-1, eu-2, us-1) as real local processes,
each running `ember route` fleets of simulated replicas (`--simulate PROFILE`: no weights).

An eu-only tenant is served only in eu, checked from each plane's own gateway counters (the
`tenant` label on ember_router_tenant_requests_total), before and after eu-1 is killed; its
traffic moves to eu-2; a restarted control plane keeps its state and restarts no fleet."""
from __future__ import annotations

import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from tests.plan.conftest import make_profile
from tests.server.conftest import TEST_KV_GIB, free_port
from tests.waiting import wait_for

ACME = {"Authorization": "Bearer sk-acme"}       # eu only
GLOBEX = {"Authorization": "Bearer sk-globex"}   # anywhere

CONFIG = """
[[deployment]]
name = "chat-eu"
model = "{model}"
replicas = 2
cores = 1
memory_gib = 1
regions = ["eu"]
serve_args = ["--simulate", "{profile}", "--kv-cache-gib", "{kv}"]

[[deployment]]
name = "chat-us"
model = "{model}"
replicas = 2
cores = 1
memory_gib = 1
regions = ["us"]
serve_args = ["--simulate", "{profile}", "--kv-cache-gib", "{kv}"]

[[tenant]]
name = "acme"
keys = ["sk-acme"]
regions = ["eu"]

[[tenant]]
name = "globex"
keys = ["sk-globex"]
"""


class Proc:
    """An ember command as a process, its output in a file (a pipe nobody reads blocks)."""

    def __init__(self, *argv: str) -> None:
        self.log = tempfile.NamedTemporaryFile("w+", prefix="ember-control-", suffix=".log")
        self.proc = subprocess.Popen([sys.executable, "-m", "ember.cli", *argv],
                                     stdout=self.log, stderr=subprocess.STDOUT)

    def output(self) -> str:
        return Path(self.log.name).read_text(errors="replace")[-6000:]

    def end(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(60)


class Cluster:
    def __init__(self, folder: Path, profile_path: Path, model: str, template: str = CONFIG
                 ) -> None:
        config = folder / "deployments.toml"
        config.write_text(template.format(model=model, profile=profile_path, kv=TEST_KV_GIB))
        self.state = folder / "control.db"
        self.token_file = folder / "plane.token"     # planes must hold it to register
        self.token_file.write_text("b8f3d0c2a1e94f6b\n")
        self.config, self.port = config, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = model
        self.control = self.start_control()
        self.planes = {name: self.start_plane(name, region)
                       for name, region in (("eu-1", "eu"), ("eu-2", "eu"), ("us-1", "us"))}

    def start_plane(self, name: str, region: str) -> Proc:
        return Proc("plane", "--name", name, "--region", region, "--cores", "2",
                    "--memory-gib", "4", "--control", self.url, "--heartbeat", "0.3",
                    "--token-file", str(self.token_file))

    def start_control(self) -> Proc:
        return Proc("control", "--config", str(self.config), "--state", str(self.state),
                    "--port", str(self.port), "--down-after", "2",
                    "--plane-token-file", str(self.token_file))

    def snapshot(self) -> dict:
        return httpx.get(self.url + "/control", timeout=10).json()

    def wait(self, predicate, what: str, timeout_s: float = 240) -> dict:
        """/control once `predicate` holds of it; the control plane must stay up meanwhile."""
        def snapshot_if_holds() -> dict | None:
            assert self.control.proc.poll() is None, self.control.output()
            try:
                snap = self.snapshot()
            except httpx.TransportError:
                return None
            return snap if predicate(snap) else None
        return wait_for(snapshot_if_holds, what, timeout_s, every_s=0.3)

    def ask(self, headers: dict, stream: bool = False) -> httpx.Response:
        return httpx.post(self.url + "/v1/completions", headers=headers, timeout=60,
                          json={"model": self.model, "prompt": "Hello", "max_tokens": 4,
                                "stream": stream})

    def close(self) -> None:
        for p in self.planes.values():
            p.end()
        self.control.end()


def ready(snap: dict, name: str) -> bool:
    return any(d["name"] == name and d["state"] == "ready" for d in snap["deployments"])


def fleets(snap: dict) -> dict[str, list[str]]:
    """plane -> its fleets' URLs."""
    return {p["name"]: sorted(f["url"] for f in p["fleets"]) for p in snap["planes"]}


def tenant_count(fleet_url: str, tenant: str) -> float:
    text = httpx.get(fleet_url + "/metrics", timeout=10).text
    m = re.search(rf'ember_router_tenant_requests_total{{tenant="{tenant}"}} (\S+)', text)
    return float(m.group(1)) if m else 0.0


def start_cluster(folder: Path, smollm_path: Path, template: str = CONFIG) -> Cluster:
    from ember.router.prompts import load_tokenizer
    profile = make_profile(smollm_path, load_tokenizer(str(smollm_path)))
    profile.save(folder / "profile.json")
    return Cluster(folder, folder / "profile.json", profile.model_name, template)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, smollm_path):
    c = start_cluster(tmp_path_factory.mktemp("control"), smollm_path)
    yield c
    c.close()


PASSIVE = """
[[deployment]]
name = "chat"
model = "{model}"
replicas = 1
cores = 1
memory_gib = 1
regions = ["eu"]
mode = "active-passive"
serve_args = ["--simulate", "{profile}", "--kv-cache-gib", "{kv}"]

[[tenant]]
name = "acme"
keys = ["sk-acme"]
regions = ["eu"]
"""


def test_active_passive_the_standby_serves_once_the_primary_dies(tmp_path, smollm_path):
    c = start_cluster(tmp_path, smollm_path, PASSIVE)
    try:
        snap = c.wait(lambda s: ready(s, "chat") and all(
            p["fleets"] and p["fleets"][0]["ready"] for p in s["planes"]
            if p["name"] in ("eu-1", "eu-2")), "primary and standby ready")
        where = snap["deployments"][0]["placement"]
        [primary], standby = list(where["active"]), where["standby"]
        assert {primary, standby} == {"eu-1", "eu-2"}
        for _ in range(3):
            assert c.ask(ACME, stream=True).status_code == 200
        assert set(c.snapshot()["served"]["acme"]) == {primary}   # the standby is idle
        c.planes[primary].end(signal.SIGKILL)
        statuses = []     # the primary's fleets may answer a last request as they die
        while c.snapshot()["served"]["acme"].get(standby, 0) < 4:
            statuses.append(c.ask(ACME, stream=bool(len(statuses) % 2)).status_code)
            assert len(statuses) < 200, statuses
        assert set(statuses) == {200}          # retried on the standby before a first byte
        snap = c.wait(lambda s: s["deployments"][0]["placement"]["active"] == {standby: 1},
                      "the standby promoted")
        assert next(p for p in snap["planes"] if p["name"] == primary)["health"] == "down"
        assert c.ask(ACME).status_code == 200
        assert "us-1" not in c.snapshot()["served"]["acme"]
    finally:
        c.close()


def test_an_eu_tenant_stays_in_eu_through_a_plane_failure(cluster):
    c = cluster
    snap = c.wait(lambda s: ready(s, "chat-eu") and ready(s, "chat-us"), "both ready")
    placement = {d["name"]: d["placement"]["active"] for d in snap["deployments"]}
    assert sorted(placement["chat-eu"]) == ["eu-1", "eu-2"]
    assert sorted(placement["chat-us"]) == ["us-1"]
    for i in range(6):
        assert c.ask(ACME, stream=bool(i % 2)).status_code == 200
        assert c.ask(GLOBEX).status_code == 200
    urls = fleets(c.snapshot())
    assert tenant_count(urls["us-1"][0], "acme") == 0
    assert sum(tenant_count(urls[p][0], "acme") for p in ("eu-1", "eu-2")) == 6
    with httpx.stream("POST", c.url + "/v1/completions", headers=ACME, timeout=60,
                      json={"model": c.model, "prompt": "Hello", "max_tokens": 64,
                            "stream": True}) as r:
        next(r.iter_bytes())                 # the client leaves after the first chunk
    c.wait(lambda s: all(p["in_flight"] == 0 for p in s["planes"]),
           "every request's in-flight count dropped", timeout_s=60)

    on_eu2 = c.snapshot()["served"]["acme"].get("eu-2", 0)
    c.planes["eu-1"].end(signal.SIGKILL)      # its fleets die with it
    statuses = []
    deadline = time.monotonic() + 120
    while c.snapshot()["served"]["acme"].get("eu-2", 0) < on_eu2 + 4:
        statuses.append(c.ask(ACME).status_code)
        assert time.monotonic() < deadline, statuses
    assert set(statuses) <= {200, 503}
    snap = c.wait(lambda s: ready(s, "chat-eu") and next(
        d for d in s["deployments"] if d["name"] == "chat-eu")["placement"]["active"]
        == {"eu-2": 2}, "chat-eu re-placed on eu-2")
    assert next(p for p in snap["planes"] if p["name"] == "eu-1")["health"] == "down"
    assert any(e["kind"] == "plane_down" and "eu-1" in e["message"] for e in snap["events"])
    for _ in range(4):
        assert c.ask(ACME).status_code == 200
    assert set(c.snapshot()["served"]["acme"]) <= {"eu-1", "eu-2"}
    urls = fleets(c.snapshot())
    assert tenant_count(urls["us-1"][0], "acme") == 0
    assert tenant_count(urls["eu-2"][0], "acme") >= 4


def test_a_restarted_control_plane_keeps_its_state_and_restarts_no_fleet(cluster):
    c = cluster
    before = c.wait(lambda s: ready(s, "chat-eu") and ready(s, "chat-us"), "ready")
    c.control.end()
    c.control = c.start_control()
    after = c.wait(lambda s: ready(s, "chat-eu") and ready(s, "chat-us")
                   and all(p["fleets"] for p in s["planes"] if p["health"] == "up"),
                   "ready again")
    assert fleets(after) == fleets(before)          # the same processes, on the same ports
    assert [d["placement"] for d in after["deployments"]] == \
        [d["placement"] for d in before["deployments"]]
    assert before["events"][-1] in after["events"]
    assert c.ask(GLOBEX).status_code == 200


def test_a_tenant_with_no_healthy_allowed_plane_gets_503_naming_why(cluster):
    c = cluster
    c.wait(lambda s: ready(s, "chat-eu"), "chat-eu ready")
    c.planes["eu-2"].end(signal.SIGKILL)
    c.wait(lambda s: all(p["health"] == "down" for p in s["planes"]
                         if p["region"] == "eu"), "eu down")
    r = c.ask(ACME)
    assert r.status_code == 503 and r.headers["Retry-After"]
    assert "regions eu" in r.json()["error"]["message"]
    assert c.ask(GLOBEX).status_code == 200
    assert "us-1" not in c.snapshot()["served"].get("acme", {})
    assert tenant_count(fleets(c.snapshot())["us-1"][0], "acme") == 0


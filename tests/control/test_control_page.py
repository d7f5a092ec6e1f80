"""The /control/ page in a real headless Chromium (the `browser` fixture), driven by Playwright.

A control app runs in-process; the test plays three planes' agents (heartbeats that report
running, ready, whatever the control plane asks for), their fleets one in-process
`ember serve --simulate` (the real server over a core that loads no weights).
Reference: GET /control, which the page must draw: a box per plane with its replicas and
requests, and the same after a plane stops heartbeating and is re-placed.
"""
from __future__ import annotations

import threading
import time

import httpx
import pytest

from ember.control.app import create_control_app
from ember.control.config import ControlConfig
from ember.control.controller import Controller
from ember.control.placement import Deployment
from ember.control.state import State
from ember.router.prompts import load_tokenizer
from tests.plan.conftest import SimulatedServer, make_profile
from tests.server.conftest import ThreadedServer
from tests.waiting import wait_for

PLANES = [  # name, region, cost per hour, spot
    ("eu-1", "eu", 1.0, False), ("eu-2", "eu", 1.2, False), ("us-1", "us", 0.3, True)]


class FakeAgents:
    """Heartbeats for each plane in `alive`, every `every_s`, reporting as running and ready
    the fleets the previous reply asked for, all served at `fleet_url`."""

    def __init__(self, control_url: str, fleet_url: str, every_s: float = 0.2) -> None:
        self.control_url, self.fleet_url, self.every_s = control_url, fleet_url, every_s
        self.alive = {name for name, *_ in PLANES}
        self.fleets: dict[str, list[dict]] = {name: [] for name, *_ in PLANES}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        with httpx.Client(timeout=5) as http:
            while not self.stop.wait(self.every_s):
                for name, region, cost, spot in PLANES:
                    if name in self.alive:
                        self.beat(http, name, region, cost, spot)

    def beat(self, http: httpx.Client, name: str, region: str, cost: float, spot: bool) -> None:
        fleets = [{"deployment": f["deployment"], "model": f["model"], "url": self.fleet_url,
                   "replicas": f["replicas"], "ready": True} for f in self.fleets[name]]
        reply = http.post(self.control_url + "/control/planes", json={
            "name": name, "region": region, "cores": 4, "memory_mib": 8192,
            "cost_per_hour": cost, "spot": spot, "fleets": fleets, "load": 0.0})
        self.fleets[name] = reply.json()["fleets"]

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)


@pytest.fixture(scope="module")
def control(smollm_path, tmp_path_factory):
    fleet = SimulatedServer(make_profile(smollm_path, load_tokenizer(str(smollm_path))))
    model = fleet.state.model_name
    config = ControlConfig(deployments=(
        Deployment("chat", model, 2, 1, 1024, ("eu",)),
        Deployment("batch", model, 1, 1, 1024, (), "active-passive", allow_spot=True)))
    state = State(tmp_path_factory.mktemp("control") / "control.db")
    app = ThreadedServer(create_control_app(Controller(config, state, down_after_s=1.0),
                                            check_every_s=0.2))
    agents = FakeAgents(app.url, fleet.url)
    app.model, app.agents = model, agents
    yield app
    agents.close()
    app.close()
    state.close()
    fleet.close()


def snapshot(control) -> dict:
    return httpx.get(control.url + "/control", timeout=10).json()



def drawn(page) -> dict[str, dict]:
    """What the page shows per plane box: health, spot, replicas and requests."""
    return page.evaluate("""() => Object.fromEntries(
        [...document.querySelectorAll('#planes .plane')].map(box => [box.dataset.name, {
            health: box.querySelector('.health').textContent,
            spot: box.classList.contains('spot'),
            replicas: [...box.querySelectorAll('.replica')].map(r =>
                r.dataset.deployment + (r.classList.contains('standby') ? ' standby' : '')
                ).sort(),
            requests: Number(box.querySelector('.requests').textContent)}]))""")


def expected(snap: dict) -> dict[str, dict]:
    """The same, from GET /control (the reference)."""
    return {p["name"]: {"health": p["health"], "spot": p["spot"],
                        "replicas": sorted(r["deployment"] + (" standby" if r["role"] ==
                                                              "standby" else "")
                                           for r in p["replicas"] for _ in range(r["count"])),
                        "requests": p["requests"]} for p in snap["planes"]}


def matching(page, control, timeout_s: float = 10) -> dict[str, dict]:
    """The page's drawing once it matches GET /control (the page polls every second, so
    it may lag one poll behind)."""
    deadline = time.monotonic() + timeout_s
    while (shown := drawn(page)) != (want := expected(snapshot(control))):
        assert time.monotonic() < deadline, f"the page shows {shown}, /control says {want}"
        time.sleep(0.2)
    return shown


def ready_snapshot(control) -> dict | None:
    """GET /control once every deployment is placed and its fleets ready, else None."""
    snap = snapshot(control)
    return snap if all(d["state"] == "ready" for d in snap["deployments"]) else None


def test_planes_replicas_and_traffic_drawn_and_updated(browser, control):
    snap = wait_for(lambda: ready_snapshot(control), "all ready")
    page = browser.new_page()
    page.goto(control.url + "/control/")
    page.wait_for_function("document.getElementById('status').textContent === 'live'")
    page.wait_for_function("document.querySelectorAll('#planes .plane').length === 3")
    shown = matching(page, control)
    # chat spreads over eu; batch runs on the cheap spot plane, its standby in another region
    assert shown["eu-1"]["replicas"] == ["batch standby", "chat"]
    assert shown["eu-2"]["replicas"] == ["chat"]
    assert shown["us-1"] == {"health": "up", "spot": True, "replicas": ["batch"],
                             "requests": 0}
    assert page.text_content('#deployments tr[data-name="chat"] .state') == "ready"

    for _ in range(4):   # traffic through the global endpoint, counted per plane
        r = httpx.post(control.url + "/v1/completions", timeout=30, json={
            "model": control.model, "prompt": "Hello", "max_tokens": 2})
        assert r.status_code == 200, r.text
    page.wait_for_function("""() => [...document.querySelectorAll('#planes .requests')]
        .reduce((n, e) => n + Number(e.textContent), 0) === 4""")
    assert sum(box["requests"] for box in matching(page, control).values()) == 4
    assert page.text_content('#planes .plane[data-name="eu-1"] .rate').endswith("/s")

    control.agents.alive.discard("eu-1")     # eu-1 stops heartbeating: down, re-placed
    page.wait_for_function("""() => {
        const box = document.querySelector('#planes .plane[data-name="eu-1"]');
        return box && box.classList.contains('down')
            && box.querySelectorAll('.replica').length === 0}""", timeout=30000)
    snap = wait_for(lambda: ready_snapshot(control), "ready again after eu-1 went down")
    page.wait_for_function("""() => document.querySelector(
        '#deployments tr[data-name="chat"] .placement').textContent === 'eu-2×2'""")
    assert snap["deployments"][0]["placement"]["active"] == {"eu-2": 2}
    shown = matching(page, control)
    assert shown["eu-1"]["health"] == "down" and shown["eu-2"]["replicas"].count("chat") == 2
    events = page.text_content("#events")
    assert "eu-1: no heartbeat" in events and "joined" in events
    page.close()

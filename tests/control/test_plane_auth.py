"""Planes and the control plane share a secret: a heartbeat (whose reply carries tenants' API
keys) without it, or with another, is refused with a 401 that says how to fix it and
registers nothing; with it, the plane joins. The control app runs in this process on a real
port and the real `PlaneAgent` heartbeats it."""
from __future__ import annotations

import asyncio

import aiohttp
import httpx
import pytest

from ember.control.agent import PlaneAgent
from ember.control.app import create_control_app
from ember.control.config import ControlConfig
from ember.control.controller import Controller
from ember.control.main import plane_token, read_token
from ember.control.placement import Plane
from ember.control.state import State
from ember.errors import ConfigError
from tests.server.conftest import ThreadedServer

TOKEN = "3f1c9e0a7b5d42e8a6c1f0b9d8e7a6c5"


@pytest.fixture
def control(tmp_path):
    ctl = Controller(ControlConfig(deployments=()), State(tmp_path / "control.db"))
    server = ThreadedServer(create_control_app(ctl, plane_token=TOKEN))
    yield server
    server.close()


def heartbeat(control: ThreadedServer, name: str, token: str | None) -> None:
    agent = PlaneAgent(Plane(name, "eu", 2, 4096), control.url, token=token)

    async def once() -> None:
        async with aiohttp.ClientSession() as session:
            await agent.tick(session)
    asyncio.run(once())


def plane_names(control: ThreadedServer) -> set[str]:
    return {p["name"] for p in httpx.get(control.url + "/control").json()["planes"]}


def test_only_a_plane_with_the_token_registers(control):
    heartbeat(control, "intruder", "not-the-token")
    heartbeat(control, "anonymous", None)
    assert plane_names(control) == set()
    heartbeat(control, "eu-1", TOKEN)
    assert plane_names(control) == {"eu-1"}


@pytest.mark.parametrize("authorization", [None, "Bearer wrong", f"Basic {TOKEN}",
                                           f"Bearer {TOKEN}x", "Bearer"])
def test_a_heartbeat_without_the_token_gets_401_naming_the_fix(control, authorization):
    headers = {"Authorization": authorization} if authorization else {}
    r = httpx.post(control.url + "/control/planes", headers=headers,
                   json={"name": "eu-1", "region": "eu", "cores": 2, "memory_mib": 4096,
                         "fleets": []})
    assert r.status_code == 401
    assert r.headers["WWW-Authenticate"] == "Bearer"
    assert "--token-file" in r.json()["error"]["message"]
    assert "fleets" not in r.json()
    assert plane_names(control) == set()


def test_without_a_token_any_plane_registers(tmp_path):
    ctl = Controller(ControlConfig(deployments=()), State(tmp_path / "control.db"))
    server = ThreadedServer(create_control_app(ctl))
    try:
        heartbeat(server, "eu-1", None)
        heartbeat(server, "eu-2", "any")
        assert plane_names(server) == {"eu-1", "eu-2"}
    finally:
        server.close()


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_no_token_is_allowed_only_on_loopback(host):
    assert plane_token(host, None) is None


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.0.0.5", "control.example.com"])
def test_no_token_on_a_reachable_address_is_an_error(host):
    with pytest.raises(ConfigError, match="--plane-token-file"):
        plane_token(host, None)


def test_the_token_comes_from_its_file(tmp_path):
    path = tmp_path / "plane.token"
    path.write_text(TOKEN + "\n")
    assert plane_token("0.0.0.0", str(path)) == TOKEN
    assert read_token(str(path), "--token-file") == TOKEN
    for bad in ("", "\n", "two words\n"):
        path.write_text(bad)
        with pytest.raises(ConfigError, match="one secret"):
            read_token(str(path), "--token-file")
    with pytest.raises(ConfigError, match="readable"):
        read_token(str(tmp_path / "missing"), "--plane-token-file")

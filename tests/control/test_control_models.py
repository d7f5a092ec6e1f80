"""The control endpoint's /v1/models, read with the OpenAI client: each tenant sees the
models of the deployments allowed in one of its regions, and only with its key. A completion
it cannot route gets a 4xx naming what is wrong with the body, or a 503 naming why."""
from __future__ import annotations

import httpx
import openai
import pytest

from ember.control.app import create_control_app
from ember.control.config import load_config
from ember.control.controller import Controller
from ember.control.state import State
from tests.server.conftest import ThreadedServer

CONFIG = """
[[deployment]]
name = "chat-eu"
model = "small"
regions = ["eu"]
replicas = 2

[[deployment]]
name = "chat-us"
model = "small"
regions = ["us"]
replicas = 2

[[deployment]]
name = "big-us"
model = "big"
regions = ["us"]
replicas = 2

[[deployment]]
name = "tiny-anywhere"
model = "tiny"
replicas = 2

[[tenant]]
name = "acme"
keys = ["sk-acme"]
regions = ["eu"]

[[tenant]]
name = "globex"
keys = ["sk-globex"]
"""


@pytest.fixture(scope="module")
def control(tmp_path_factory):
    folder = tmp_path_factory.mktemp("models")
    (folder / "deployments.toml").write_text(CONFIG)
    ctl = Controller(load_config(folder / "deployments.toml"), State(folder / "control.db"))
    server = ThreadedServer(create_control_app(ctl))
    yield server
    server.close()


def client(control: ThreadedServer, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=control.url + "/v1", api_key=key, max_retries=0)


@pytest.mark.parametrize("key,models", [("sk-acme", ["small", "tiny"]),
                                        ("sk-globex", ["big", "small", "tiny"])])
def test_a_tenant_lists_the_models_it_may_be_served(control, key, models):
    listed = client(control, key).models.list().data
    assert [m.id for m in listed] == models
    assert {(m.object, m.owned_by) for m in listed} == {("model", "ember")}
    assert all(isinstance(m.created, int) for m in listed)
    assert client(control, key).models.retrieve(models[0]).id == models[0]


def test_a_model_outside_the_tenants_regions_is_not_found(control):
    with pytest.raises(openai.NotFoundError, match="see /v1/models"):
        client(control, "sk-acme").models.retrieve("big")
    assert client(control, "sk-globex").models.retrieve("big").id == "big"


def test_models_need_a_key(control):
    with pytest.raises(openai.AuthenticationError):
        client(control, "sk-nobody").models.list()


@pytest.mark.parametrize("body,status,says", [
    (b"{", 400, "not valid JSON"),
    (b"[1, 2]", 400, "must be a JSON object"),
    (b'{"model": 3, "messages": []}', 400, "model must be a string"),
    (b'{"messages": [{"role": "user", "content": "hi"}]}', 400,
     "give a model: one of big, small, tiny"),
    (b'{"model": "small", "messages": [{"role": "user", "content": "hi"}]}', 503,
     "no plane in regions eu"),
])
def test_a_completion_that_cannot_be_routed_says_why(control, body, status, says):
    r = httpx.post(control.url + "/v1/chat/completions", content=body,
                   headers={"Authorization": "Bearer sk-acme",
                            "Content-Type": "application/json"})
    assert r.status_code == status
    assert says in r.json()["error"]["message"]
    assert (r.headers.get("Retry-After") is not None) == (status == 503)

"""A gateway in this process (uvicorn in a thread) over replicas given by URL."""
from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from ember.router.config import RouterConfig
from ember.router.fleet import Fleet
from ember.router.gateway import create_gateway
from ember.router.main import assemble, route_tokenizer
from ember.router.replicas import Launcher, RemoteHandle, Replica
from ember.router.rollout import Rollout
from tests.server.conftest import LiveServer, ThreadedServer

FAST = dict(probe_interval_s=0.1, events_interval_s=0.05, backoff_s=0.01)


class LiveGateway(ThreadedServer):
    def __init__(self, urls: dict[str, str], model: str | None = None,
                 launchers: dict[str, Launcher] | None = None, rollout: Rollout | None = None,
                 tokenizer: str | None = None, default_tokenizer: bool = False,
                 num_started: int = 0, roles: dict[str, str] | None = None,
                 clock: Callable[[], float] = time.monotonic, **options) -> None:
        """`model`, `tokenizer`: as `ember route --model/--tokenizer` (neither: no tokenizer,
        unless `default_tokenizer`, which loads the default model's as `ember route` does).
        `num_started` primary replicas are started by the launcher before the gateway serves,
        as `ember route --replicas N` does. `roles`: replica id -> its role, as
        `--replica-url URL#prefill` gives it (default: both). `clock` times disaggregation's
        stepping aside."""
        self.config = RouterConfig(**(FAST | options))
        self.fleet = Fleet(self.config, launchers or {})
        for replica_id, url in urls.items():
            group = "primary" if replica_id.startswith("r") else replica_id.rstrip("0123456789")
            self.fleet.add(Replica(replica_id, RemoteHandle(url), group,
                                   (roles or {}).get(replica_id, "both")))
        for _ in range(num_started):
            self.fleet.start_replica("primary")
        hashing = route_tokenizer(model, tokenizer, None) \
            if model or tokenizer or default_tokenizer else (None, None)
        self.gateway = assemble(self.fleet, rollout or Rollout(), self.config, *hashing,
                                clock=clock)
        self.app = create_gateway(self.gateway)
        super().__init__(self.app)

    def wait_ready(self, count: int | None = None, timeout_s: float = 60) -> None:
        """Until `count` replicas (default: all) are ready and routable."""
        deadline = time.monotonic() + timeout_s
        while True:
            fleet = httpx.get(self.url + "/fleet", headers=self.fleet.auth).json()
            ready = [r for r in fleet["replicas"] if r["state"] == "ready"]
            if len(ready) >= (count or len(self.fleet.replicas)):
                return
            assert time.monotonic() < deadline, fleet
            time.sleep(0.05)

    def metric(self, name: str) -> float:
        """The sum of every exposition line of `name` whose labels include `labels`."""
        total = 0.0
        for line in httpx.get(self.url + "/metrics").text.splitlines():
            if line.startswith(name):
                total += float(line.rsplit(" ", 1)[1])
        return total


@pytest.fixture(scope="module")
def replicas(tiny_llama_dir):
    """Two in-process `ember serve` apps over the tiny model: the fleet's replicas."""
    folder, _ = tiny_llama_dir
    live = [LiveServer(folder, engine_options={"max_model_len": 512, "kernels": "torch"})
            for _ in range(2)]
    yield live
    for server in live:
        server.close()


@pytest.fixture(scope="module")
def adapter(tiny_llama_dir, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A PEFT LoRA adapter folder for the tiny model (random factors that change its greedy
    tokens)."""
    pytest.importorskip("peft")
    from tests.reference.test_lora import make_adapter
    _, base = tiny_llama_dir
    path = tmp_path_factory.mktemp("adapter_alpha")
    make_adapter(base, path, 8, 16, False, ["q_proj", "v_proj"], 0)
    return path

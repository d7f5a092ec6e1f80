"""The gateway counts each request under the tenant its key named (anonymous without
--api-keys), on the request counters a plane's own /metrics shows: where each tenant's inputs
were processed, read from the plane rather than from whoever routed to it."""
from __future__ import annotations

import httpx

from ember.config import ServerConfig, parse_api_keys
from tests.router.conftest import LiveGateway
from tests.router.fakes import FakeReplica

KEYS = parse_api_keys("sk-acme acme\nsk-globex globex\n")


def ask(gw: LiveGateway, key: str | None, stream: bool = False) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(gw.url + "/v1/completions", headers=headers, timeout=30, json={
        "prompt": "hello", "max_tokens": 2, "stream": stream}).status_code


def test_requests_are_counted_under_the_tenant_their_key_names():
    replica = FakeReplica("ok")
    gw = LiveGateway({"r1": replica.url}, server=ServerConfig(api_keys=KEYS))
    try:
        gw.wait_ready()
        statuses = [ask(gw, key) for key in ("sk-acme", "sk-globex", "sk-acme", "sk-acme")]
        assert statuses == [200] * 4
        assert ask(gw, "sk-nobody") == 401 and ask(gw, None) == 401
        assert gw.metric('ember_router_rejected_total{reason="unauthorized"}') == 2
        assert replica.hits == 4
        for tenant, count in (("acme", 3), ("globex", 1)):
            assert gw.metric(f'ember_router_requests_total{{replica="r1",status="200",'
                             f'tenant="{tenant}"}}') == count
            assert gw.metric(f'ember_router_tenant_requests_total{{tenant="{tenant}"}}') \
                == count
        assert gw.metric('ember_router_requests_total{replica="r1",status="200"') == 4
        assert gw.metric('ember_router_tenant_requests_total{tenant="anonymous"}') == 0
    finally:
        gw.close()
        replica.close()


def test_without_keys_requests_are_anonymous_also_when_every_replica_fails():
    broken = FakeReplica("status_500")
    gw = LiveGateway({"r1": broken.url}, eject_s=0.01, max_tries=2)
    try:
        gw.wait_ready()
        assert ask(gw, None) == 500
        assert broken.hits == 2
        assert gw.metric('ember_router_requests_total{replica="none",status="500",'
                         'tenant="anonymous"}') == 1
        assert gw.metric('ember_router_tenant_requests_total{tenant="anonymous"}') == 1
    finally:
        gw.close()
        broken.close()

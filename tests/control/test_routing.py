"""The global endpoint's plane choice: never outside the tenant's regions (checked against a
plain filter over every combination of planes down), the client's region first, then load."""
from __future__ import annotations

import itertools

import pytest

from ember.control.config import load_config
from ember.control.routing import PlaneView, candidates
from ember.errors import ConfigError

REGION = {"eu-1": "eu", "eu-2": "eu", "us-1": "us"}


def views(down: set[str], load: dict[str, int] | None = None) -> list[PlaneView]:
    return [PlaneView(n, r, n not in down, frozenset({"smol"}), (load or {}).get(n, 0))
            for n, r in REGION.items()]


@pytest.mark.parametrize("regions", [("eu",), ("us",), ("eu", "us"), ()])
def test_never_outside_the_tenants_regions_whatever_is_down(regions):
    for k in range(len(REGION) + 1):
        for down in itertools.combinations(REGION, k):
            got, why = candidates(views(set(down)), "smol", regions, "us")
            want = {n for n, r in REGION.items() if n not in down and (not regions or
                                                                       r in regions)}
            assert {p.name for p in got} == want
            assert bool(why) == (not want)


def test_the_clients_region_first_then_the_less_loaded_plane():
    got, _ = candidates(views(set(), {"eu-1": 3, "eu-2": 1, "us-1": 0}), "smol", (), "eu")
    assert [p.name for p in got] == ["eu-2", "eu-1", "us-1"]
    got, _ = candidates(views(set(), {"eu-1": 3, "eu-2": 1, "us-1": 0}), "smol", (), None)
    assert [p.name for p in got] == ["us-1", "eu-2", "eu-1"]


def test_the_503_reason_names_the_regions_and_the_down_planes():
    _, why = candidates(views({"eu-1", "eu-2"}), "smol", ("eu",), None)
    assert "eu-1, eu-2" in why and "is down" in why and "regions eu" in why
    _, why = candidates(views(set()), "other", ("eu",), None)
    assert "no plane serving model 'other'" in why


def test_config_reads_deployments_and_tenants(tmp_path):
    path = tmp_path / "deployments.toml"
    path.write_text('[[deployment]]\nname = "chat"\nmodel = "smol"\nreplicas = 2\n'
                    'memory_gib = 1.5\nregions = ["eu"]\nserve_args = ["--simulate", "p.json"]\n'
                    '[[tenant]]\nname = "acme"\nkeys = ["k1", "k2"]\nregions = ["eu"]\n')
    config = load_config(path)
    (chat,) = config.deployments
    assert (chat.replicas, chat.memory_mib, chat.regions) == (2, 1536, ("eu",))
    assert config.serve_args["chat"] == ("--simulate", "p.json")
    assert [(k.key, k.tenant) for k in config.keys] == [("k1", "acme"), ("k2", "acme")]
    assert config.tenants["acme"].regions == ("eu",)
    path.write_text('[[deployment]]\nname = "chat"\nmodel = "smol"\nreplica = 2\n')
    with pytest.raises(ConfigError, match="unknown key.*replica"):
        load_config(path)

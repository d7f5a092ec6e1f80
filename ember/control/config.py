"""deployments.toml: the deployments `ember control` places, and the tenants it serves.

    [[deployment]]
    name = "chat"
    model = "SmolLM2-135M-Instruct-Q4_1"   # the served model name clients send
    replicas = 2                           # active replicas (--min-replicas of its fleet)
    max_replicas = 4                       # its fleet may scale to (default: replicas)
    cores = 2                              # one replica's
    memory_gib = 2
    regions = ["eu"]                       # default: any
    mode = "active-active"                 # or "active-passive"
    allow_spot = false
    serve_args = ["--simulate", "profile.json"]   # `ember route`'s replica options

    [[tenant]]
    name = "acme"
    keys = ["sk-acme-1"]                   # as in --api-keys
    regions = ["eu"]                       # where its inputs may be processed
"""
from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from ember.config import ApiKey
from ember.control.placement import Deployment
from ember.errors import ConfigError

DEPLOYMENT_KEYS = {"name", "model", "replicas", "max_replicas", "cores", "memory_gib",
                   "regions", "mode", "allow_spot", "serve_args"}
TENANT_KEYS = {"name", "keys", "regions"}


@dataclass(frozen=True)
class Tenant:
    name: str
    regions: tuple[str, ...]     # empty: any region


@dataclass(frozen=True)
class ControlConfig:
    deployments: tuple[Deployment, ...]
    max_replicas: dict[str, int] = field(default_factory=dict)
    serve_args: dict[str, tuple[str, ...]] = field(default_factory=dict)
    keys: tuple[ApiKey, ...] = ()
    tenants: dict[str, Tenant] = field(default_factory=dict)


def load_config(path: str | Path) -> ControlConfig:
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"--config {path}: {e}; give a readable deployments.toml") from None
    _only(data, {"deployment", "tenant"}, f"{path}")
    deployments, max_replicas, serve_args = [], {}, {}
    for i, d in enumerate(data.get("deployment", [])):
        _only(d, DEPLOYMENT_KEYS, f"{path} deployment {i + 1}")
        if "name" not in d or "model" not in d:
            raise ConfigError(f"{path} deployment {i + 1} needs a name and a model")
        dep = Deployment(d["name"], d["model"], d.get("replicas", 1), d.get("cores", 1),
                         round(1024 * d.get("memory_gib", 1)), tuple(d.get("regions", ())),
                         d.get("mode", "active-active"), d.get("allow_spot", False))
        deployments.append(dep)
        max_replicas[dep.name] = max(dep.replicas, d.get("max_replicas", dep.replicas))
        serve_args[dep.name] = tuple(d.get("serve_args", ()))
    if len({d.name for d in deployments}) != len(deployments):
        raise ConfigError(f"{path}: two deployments share a name; give each its own")
    keys, tenants = [], {}
    for i, t in enumerate(data.get("tenant", [])):
        _only(t, TENANT_KEYS, f"{path} tenant {i + 1}")
        if "name" not in t or not t.get("keys"):
            raise ConfigError(f"{path} tenant {i + 1} needs a name and at least one key")
        tenants[t["name"]] = Tenant(t["name"], tuple(t.get("regions", ())))
        keys += [ApiKey(k, t["name"]) for k in t["keys"]]
    return ControlConfig(tuple(deployments), max_replicas, serve_args, tuple(keys), tenants)


def _only(table: dict, allowed: set[str], where: str) -> None:
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; the keys are "
                          f"{', '.join(sorted(allowed))}")

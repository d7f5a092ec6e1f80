"""`ember route`: build the fleet the options describe, and serve the gateway."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import uvicorn

from ember.config import ApiKey, ServerConfig
from ember.errors import ConfigError
from ember.router.autoscale import Autoscaler
from ember.router.cli import check_remote_fleet, router_config, serve_argv, with_model
from ember.router.config import RouterConfig
from ember.router.fleet import Fleet
from ember.router.gateway import Gateway, create_gateway
from ember.router.prompts import PromptKeys, load_tokenizer
from ember.router.proxy import Proxy
from ember.router.replicas import (Launcher, LocalLauncher, RemoteHandle, Replica,
                                  replica_cpu_binds, replica_environment)
from ember.router.rollout import Rollout, parse_spec
from ember.server.exit import GracefulServer
from ember.tokenizer.tokenizer import Tokenizer
from ember.weights.paths import served_model_name


def make_launcher(args: argparse.Namespace, argv: list[str]) -> Launcher:
    if args.ray is not None:
        from ember.router.ray_replicas import RayLauncher  # ray loads only when asked for
        return RayLauncher(argv, None if args.ray == "auto" else args.ray)
    return LocalLauncher(argv)


def local_replicas(launchers: dict[str, Launcher], primary_replicas: int) -> int:
    """How many replicas the local launchers may run at once on this machine: the primary
    set at its largest, and a local canary and shadow (one each)."""
    return sum(primary_replicas if group == "primary" else 1
               for group, launcher in launchers.items() if isinstance(launcher, LocalLauncher))


def build_fleet(args: argparse.Namespace, argv: list[str], config: RouterConfig
                ) -> tuple[Fleet, Rollout]:
    launchers: dict[str, Launcher] = {}
    if not args.replica_url:
        launchers["primary"] = make_launcher(args, argv)
    fleet = Fleet(config, launchers)
    for i, url in enumerate(args.replica_url):
        fleet.add(Replica(f"r{i + 1}", RemoteHandle(url.rstrip("/"))))
    rollout = Rollout()
    for option, group in ((args.canary, "canary"), (args.shadow, "shadow")):
        if option is None:
            continue
        spec, percent = parse_spec(option, f"--{group}")
        if spec.startswith(("http://", "https://")):
            fleet.add(Replica(f"{group}1", RemoteHandle(spec.rstrip("/")), group))
        else:
            launchers[group] = LocalLauncher(with_model(argv, spec))
        setattr(rollout, f"{group}_percent", percent)
    num_local = local_replicas(launchers, max(args.replicas, config.autoscale.max_replicas))
    env = replica_environment(os.environ, num_local)
    binds = rank_cpu_binds(args, argv, num_local)
    for launcher in launchers.values():
        if isinstance(launcher, LocalLauncher):
            launcher.env, launcher.cpu_binds = env, binds
    return fleet, rollout


def rank_cpu_binds(args: argparse.Namespace, argv: list[str], num_local: int
                   ) -> list[str] | None:
    """The local replicas' slots of cores where each is several ranks (T x P), unless the
    user bound them (--cpu-bind) or let them share cores (--oversubscribe-cpus)."""
    if "--cpu-bind" in argv or any(t.startswith("--cpu-bind=") for t in argv) or \
            args.oversubscribe_cpus:
        return None
    ranks = args.tensor_parallel_size * args.pipeline_parallel_size
    return replica_cpu_binds(sorted(os.sched_getaffinity(0)), num_local, ranks)


def cmd_route(args: argparse.Namespace, server: ServerConfig, tokens: list[str]) -> None:
    """`tokens`: `ember route`'s own, as typed after the command."""
    check_remote_fleet(tokens)
    if args.replicas < 0 or (args.replicas == 0 and not args.scale_to_zero_after):
        raise ConfigError("--replicas must be at least 1 (0 needs --scale-to-zero-after)")
    argv = serve_argv(tokens, args.route_only)
    config = router_config(args, server)
    fleet, rollout = build_fleet(args, argv, config)
    initial = 0 if args.replica_url else args.replicas
    for _ in range(initial):
        fleet.start_replica("primary")
    for group in ("canary", "shadow"):
        if group in fleet.launchers:
            fleet.start_replica(group)
    if args.simulate:   # the replicas tokenize with the profile's tokenizer
        from ember.plan.profile import load_profile   # (only a simulated fleet reads one)
        profile = load_profile(args.simulate)
        tokenizer, model_name = profile.load_tokenizer(), profile.model_name
    else:
        tokenizer, model_name = route_tokenizer(args.model, args.tokenizer,
                                                args.served_model_name)
    gateway = assemble(fleet, rollout, config, tokenizer, model_name)
    app = create_gateway(gateway)
    print(f"ember: routing on http://{server.host}:{server.port} over "
          f"{len(fleet.replicas)} replicas ({config.policy}); see /fleet", file=sys.stderr,
          flush=True)
    uv_config = uvicorn.Config(app, host=server.host, port=server.port, log_level="warning",
                               timeout_graceful_shutdown=server.drain_timeout_s,
                               access_log=False)
    # on SIGTERM: not ready, in-flight requests finish, replicas stop, exit 0
    GracefulServer(uv_config, lambda: setattr(gateway, "draining", True)).run()


def route_tokenizer(model: str | None, tokenizer: str | None, served_name: str | None
                    ) -> tuple[Tokenizer | None, str | None]:
    """The tokenizer the gateway hashes prompts with (`tokenizer`'s, else `model`'s, else the
    default model's), and the served model name it is for: `served_name`, else the name
    `ember serve` gives `model` (else `tokenizer`): a .gguf file's stem, a folder's name.
    (None, None) when there is no default model to fall back on."""
    if tokenizer is not None and not Path(tokenizer).expanduser().exists():
        raise ConfigError(f"--tokenizer {tokenizer}: no such file or folder; give the "
                          "replicas' model's .gguf file or Hugging Face folder")
    try:
        name = served_name or served_model_name(model if model is not None else tokenizer)
    except ConfigError:  # no default model here: the replicas may run anything
        return None, None
    return load_tokenizer(tokenizer if tokenizer is not None else model), name


def assemble(fleet: Fleet, rollout: Rollout, config: RouterConfig,
             tokenizer: Tokenizer | None, tokenizer_model: str | None = None) -> Gateway:
    """The gateway over `fleet`: its proxy, autoscaler (if the bounds allow scaling) and
    prompt hashing, on block keys for the replicas that serve `tokenizer_model` (the served
    name `tokenizer` is for), on text for the others."""
    autoscaler: Autoscaler | None = None
    proxy = Proxy(fleet, lambda group: None)
    if config.autoscale.enabled and "primary" in fleet.launchers:
        autoscaler = Autoscaler(fleet, config.autoscale, lambda: proxy.held)
        proxy.on_demand = autoscaler.on_demand
        proxy.on_first_byte = autoscaler.note_request
    else:
        proxy.on_demand = lambda group: _start_missing(fleet, group)
    keys = config.server.tenant_keys() or (
        (ApiKey(config.server.api_key, "default"),) if config.server.api_key else ())
    prompts = PromptKeys(tokenizer, config.server.tenant_keys(), config.prefix.text_chunk_chars,
                         config.session_header)
    fleet.hash_model = tokenizer_model if tokenizer is not None else None
    return Gateway(fleet, proxy, prompts, rollout, autoscaler, keys,
                   tenants=bool(config.server.api_keys))


def _start_missing(fleet: Fleet, group: str) -> None:
    if group in fleet.launchers and not fleet.group(group):
        fleet.start_replica(group)

"""`ember route`: build the fleet the options describe, and serve the gateway."""
from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import uvicorn

from ember.config import ApiKey, ServerConfig
from ember.errors import ConfigError
from ember.router.autoscale import Autoscaler
from ember.router.cli import (check_remote_fleet, check_roles, role_urls, router_config,
                              serve_argv, target_ongoing, with_model)
from ember.router.config import RouterConfig
from ember.router.disagg import Aside
from ember.router.fleet import Fleet, launcher_name
from ember.router.gateway import Gateway, create_gateway
from ember.router.metrics import AsideCollector
from ember.router.prompts import PromptKeys, load_tokenizer
from ember.router.proxy import Proxy
from ember.router.replicas import (Launcher, LocalLauncher, RemoteHandle, Replica,
                                  replica_cpu_binds, replica_environment)
from ember.router.rollout import Rollout, parse_spec
from ember.server.exit import GracefulServer
from ember.tokenizer.tokenizer import Tokenizer
from ember.weights.paths import served_model_name


def make_launcher(args: argparse.Namespace, argv: list[str],
                  cpus: tuple[int, ...] | None = None) -> Launcher:
    if args.ray is not None:
        from ember.router.ray_replicas import RayLauncher  # ray loads only when asked for
        return RayLauncher(argv, None if args.ray == "auto" else args.ray,
                           args.tensor_parallel_size * args.pipeline_parallel_size)
    return LocalLauncher(argv, cpus=cpus)


def role_cpus(available: list[int], num_prefill: int, num_decode: int
              ) -> dict[str, tuple[int, ...] | None]:
    """Each role's cores, in proportion to its replicas (at least one each), so that decode
    steps never wait for a prompt computed beside them; None (share them all) where there
    are not two cores to split."""
    if len(available) < 2:
        return {"prefill": None, "decode": None}
    k = round(len(available) * num_prefill / (num_prefill + num_decode))
    k = min(max(k, 1), len(available) - 1)
    return {"prefill": tuple(available[:k]), "decode": tuple(available[k:])}


def role_launchers(args: argparse.Namespace, argv: list[str], config: RouterConfig
                   ) -> dict[str, Launcher]:
    """A launcher per role: `ember serve --role ROLE`, on the role's cores unless the
    options bind them (--cpu-bind) or the replicas run on Ray."""
    sizes = {role: max(getattr(args, f"{role}_replicas"), cfg.max_replicas)
             for role, cfg in (("prefill", config.prefill_autoscale),
                               ("decode", config.decode_autoscale))}
    bound = args.ray is not None or any(t.partition("=")[0] == "--cpu-bind" for t in argv)
    cpus = role_cpus([] if bound else sorted(os.sched_getaffinity(0)), sizes["prefill"],
                     sizes["decode"])
    for role, mine in cpus.items():
        if mine is not None:
            print(f"ember: {role} replicas run on CPUs {','.join(map(str, mine))}",
                  file=sys.stderr, flush=True)
    return {role: make_launcher(args, argv + ["--role", role], cpus[role])
            for role in ("prefill", "decode")}


def local_replicas(launchers: dict[str, Launcher], primary_replicas: int) -> int:
    """How many replicas the local launchers may run at once on this machine: the primary
    set at its largest (both roles of a disaggregated fleet), and a local canary and shadow
    (one each)."""
    primary = any(isinstance(launchers.get(name), LocalLauncher)
                  for name in ("primary", "prefill", "decode"))
    sides = sum(isinstance(launchers.get(group), LocalLauncher)
                for group in ("canary", "shadow"))
    return primary_replicas * primary + sides


def build_fleet(args: argparse.Namespace, argv: list[str], config: RouterConfig
                ) -> tuple[Fleet, Rollout]:
    launchers: dict[str, Launcher] = {}
    split = config.prefill_autoscale is not None
    if split:
        launchers.update(role_launchers(args, argv, config))
    elif not args.replica_url:
        launchers["primary"] = make_launcher(args, argv)
    fleet = Fleet(config, launchers)
    for i, (url, role) in enumerate(role_urls(args.replica_url)):
        fleet.add(Replica(f"r{i + 1}", RemoteHandle(url), role=role))
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
    most = max(args.replicas, config.autoscale.max_replicas) if not split else \
        max(args.prefill_replicas, config.prefill_autoscale.max_replicas) + \
        max(args.decode_replicas, config.decode_autoscale.max_replicas)
    num_local = local_replicas(launchers, most)
    env = replica_environment(os.environ, num_local)
    # a role's replicas already run on that role's cores (their ranks share them)
    binds = None if split else rank_cpu_binds(args, argv, num_local)
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
    split = check_roles(args, tokens)
    if args.replicas < 0 or (args.replicas == 0 and not args.scale_to_zero_after):
        raise ConfigError("--replicas must be at least 1 (0 needs --scale-to-zero-after)")
    argv = serve_argv(tokens, args.route_only)
    target, source = target_ongoing(args)
    config = router_config(args, server, target)
    fleet, rollout = build_fleet(args, argv, config)
    if args.disagg_min_tokens and not fleet.disaggregated:
        raise ConfigError("--disagg-min-tokens needs a disaggregated fleet: --prefill-replicas "
                          "P --decode-replicas D, or --replica-url URL#prefill and URL#decode")
    initial = {"both": 0 if args.replica_url or split else args.replicas,
               "prefill": args.prefill_replicas if split else 0,
               "decode": args.decode_replicas if split else 0}
    for role, count in initial.items():
        for _ in range(count):
            fleet.start_replica("primary", role)
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
    if config.autoscale.enabled or args.plan:
        aim = f"{target:g} ongoing requests per replica ({source})"
        print("ember: autoscaling to " + aim if config.autoscale.enabled else
              "ember: not autoscaling (--min-replicas = --max-replicas); the target is " + aim,
              file=sys.stderr, flush=True)
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
             tokenizer: Tokenizer | None, tokenizer_model: str | None = None,
             clock: Callable[[], float] = time.monotonic) -> Gateway:
    """The gateway over `fleet`: its proxy, autoscaler (if the bounds allow scaling) and
    prompt hashing, on block keys for the replicas that serve `tokenizer_model` (the served
    name `tokenizer` is for), on text for the others. `clock` times disaggregation's
    stepping aside."""
    proxy = Proxy(fleet, lambda group, roles: None)
    bounds = (("both", config.autoscale), ("prefill", config.prefill_autoscale),
              ("decode", config.decode_autoscale))
    autoscalers = tuple(Autoscaler(fleet, cfg, held_for(fleet, role), role=role)
                        for role, cfg in bounds if cfg is not None and cfg.enabled
                        and launcher_name("primary", role) in fleet.launchers)
    if autoscalers:
        def on_demand(group: str, roles: tuple[str, ...] | None) -> None:
            for autoscaler in autoscalers:
                autoscaler.on_demand(group, roles)

        def on_first_byte(ttft_s: float) -> None:
            for autoscaler in autoscalers:
                autoscaler.note_request(ttft_s)
        proxy.on_demand, proxy.on_first_byte = on_demand, on_first_byte
    else:
        proxy.on_demand = lambda group, roles: _start_missing(fleet, group, roles)
    keys = config.server.tenant_keys() or (
        (ApiKey(config.server.api_key, "default"),) if config.server.api_key else ())
    prompts = PromptKeys(tokenizer, config.server.tenant_keys(), config.prefix.text_chunk_chars,
                         config.session_header)
    fleet.hash_model = tokenizer_model if tokenizer is not None else None
    aside = Aside(config.disagg_idle_s, clock)
    if fleet.disaggregated:
        fleet.metrics.registry.register(AsideCollector(aside.view))
    return Gateway(fleet, proxy, prompts, rollout, autoscalers, keys, aside,
                   tenants=bool(config.server.api_keys))


def held_for(fleet: Fleet, role: str) -> Callable[[], int]:
    """The held requests an autoscaler counts: those waiting for its role's replicas (all of
    them, in an ordinary fleet)."""
    if role == "both":
        return lambda: fleet.held
    return lambda: fleet.held_roles[role]


def _start_missing(fleet: Fleet, group: str, roles: tuple[str, ...] | None) -> None:
    for role in roles or ("both",):
        if launcher_name(group, role) in fleet.launchers and \
                not fleet.group(group, roles=None if role == "both" else (role,)):
            fleet.start_replica(group, role)
            return

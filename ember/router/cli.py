"""`ember route`'s options (light imports: the parser is built for every ember command).

Every `ember serve` option given to `ember route` (engine and server options other than
--host and --port) is passed on to each local replica; --api-key and --api-keys also guard
the gateway itself.
"""
from __future__ import annotations

import argparse
from dataclasses import replace

from ember.config import ServerConfig
from ember.errors import ConfigError
from ember.router.config import POLICIES, AutoscaleConfig, RouterConfig

GATEWAY_ONLY = {"--host": 1, "--port": 1, "-h": 0, "--help": 0}   # serve options it keeps
# the gateway waits this much longer than the replicas' --request-timeout, so that a slow
# request ends with the replica's own 504 (the request's outcome), not a gateway timeout
REPLICA_TIMEOUT_SLACK_S = 30.0


class _Recorded:
    """An argument group that keeps the actions added to it."""

    def __init__(self, group: argparse._ArgumentGroup, actions: list[argparse.Action]) -> None:
        self.group, self.actions = group, actions

    def add_argument(self, *args, **kwargs) -> argparse.Action:
        action = self.group.add_argument(*args, **kwargs)
        self.actions.append(action)
        return action


def add_route_args(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """Add the gateway's own options; returns them (they are not passed on to replicas)."""
    actions: list[argparse.Action] = []
    g = _Recorded(parser.add_argument_group("fleet"), actions)
    g.add_argument("--replicas", type=int, default=1,
                   help="local `ember serve` replicas to start (on free ports)")
    g.add_argument("--replica-url", action="append", default=[], metavar="URL",
                   help="route over a server started elsewhere (repeatable); no local ones. "
                        "URL#prefill or URL#decode: a replica started with that --role")
    g.add_argument("--prefill-replicas", type=int, default=None, metavar="P",
                   help="disaggregated serving: P local prefill replicas (with "
                        "--decode-replicas, instead of --replicas)")
    g.add_argument("--decode-replicas", type=int, default=None, metavar="D",
                   help="disaggregated serving: D local decode replicas")
    g.add_argument("--role", dest="route_role", default=None,
                   help=argparse.SUPPRESS)   # refused: check_roles
    g.add_argument("--disagg-min-tokens", type=int, default=0, metavar="N",
                   help="a prompt whose uncached part is shorter than N tokens is computed "
                        "whole on a decode replica (default 0: every prompt is split)")
    g.add_argument("--disagg-max-prefill-backlog", type=int,
                   default=RouterConfig.disagg_max_prefill_backlog, metavar="TOKENS",
                   help="while every prefill replica has at least TOKENS uncached prompt "
                        "tokens outstanding, a prompt worth splitting is computed whole on a "
                        "decode replica if it would be computed sooner there, at each side's "
                        "measured rate (0: never; default %(default)d)")
    g.add_argument("--disagg-idle-s", type=float, default=RouterConfig.disagg_idle_s,
                   metavar="SECONDS",
                   help="after this long without a prompt worth splitting, whole requests "
                        "may go to prefill replicas too, as on an ordinary fleet (0: never; "
                        "default %(default)g)")
    g.add_argument("--ray", nargs="?", const="auto", default=None, metavar="ADDRESS",
                   help="run replicas as Ray actors on the cluster at ADDRESS (default: "
                        "the one `ray start` set up, else a local one)")
    g.add_argument("--policy", default="prefix", choices=list(POLICIES))
    g.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="hash prompts with this tokenizer (a .gguf file or a Hugging Face "
                        "folder; default: --model's), for the replicas serving the model "
                        "named --served-model-name, else after --model, else after PATH")
    g.add_argument("--session-header", default=RouterConfig.session_header,
                   help="the session policy's key (else the body's `user`)")
    g.add_argument("--max-tries", type=int, default=RouterConfig.max_tries,
                   help="replicas one request may be tried on before its first byte")
    g.add_argument("--max-queue", type=int, default=RouterConfig.max_queue,
                   help="requests held while no replica is ready, then 503")
    g.add_argument("--hold-timeout", type=float, default=RouterConfig.hold_timeout_s,
                   help="seconds a held request waits for a replica, then 503")
    a = _Recorded(parser.add_argument_group("autoscaling"), actions)
    a.add_argument("--min-replicas", type=int, default=None, help="default: --replicas")
    a.add_argument("--max-replicas", type=int, default=None, help="default: --replicas")
    for role in ("prefill", "decode"):
        for bound in ("min", "max"):
            a.add_argument(f"--{bound}-{role}-replicas", type=int, default=None,
                           help=f"default: --{role}-replicas")
    a.add_argument("--target-ongoing", type=float, default=None,
                   help="in-flight + queued requests per replica to aim for (default: the "
                        f"--plan profile's knee, else {AutoscaleConfig.target_ongoing:g})")
    a.add_argument("--plan", default=None, metavar="PROFILE",
                   help="an `ember plan profile` of the replicas: --target-ongoing defaults "
                        "to its knee (docs/plan.md)")
    a.add_argument("--scale-up-delay", type=float, default=AutoscaleConfig.scale_up_delay_s)
    a.add_argument("--scale-down-delay", type=float,
                   default=AutoscaleConfig.scale_down_delay_s)
    a.add_argument("--look-back", type=float, default=AutoscaleConfig.look_back_s,
                   help="seconds of load the autoscaler averages")
    a.add_argument("--scale-to-zero-after", type=float, default=None, metavar="S",
                   help="with --min-replicas 0: stop every replica after S idle seconds")
    a.add_argument("--ttft-slo", type=float, default=None, metavar="S",
                   help="add a replica while the median time to first byte is above S")
    r = _Recorded(parser.add_argument_group("rollouts"), actions)
    r.add_argument("--canary", default=None, metavar="SPEC:PERCENT",
                   help="send PERCENT of requests to a replica of SPEC (a model path, or a "
                        "replica URL); POST /fleet/promote or /fleet/rollback ends it")
    r.add_argument("--shadow", default=None, metavar="SPEC:PERCENT",
                   help="mirror PERCENT of requests to SPEC; its answers are discarded, "
                        "its latency and greedy agreement are recorded in /metrics")
    return actions


def serve_argv(tokens: list[str], route_only: dict[str, int | str]) -> list[str]:
    """The user's own `ember serve` tokens among `ember route`'s (`tokens`, after the command),
    verbatim and in order: every token but the gateway's own options and their values.
    `route_only` maps each gateway option string to its argument count (an int, or "?" for
    an optional one). `ember route` takes no abbreviated options, so every token is exact."""
    argv: list[str] = []
    i = 0
    while i < len(tokens):
        token = tokens[i]
        i += 1
        flag, has_value, _ = token.partition("=")
        nargs = route_only.get(flag) if flag.startswith("-") else None
        if nargs is None:
            argv.append(token)
        elif has_value:
            continue                            # --port=8000: the value came with it
        elif nargs == "?":
            if i < len(tokens) and not tokens[i].startswith("-"):
                i += 1
        else:
            i += int(nargs)
    return argv


# what --replica-url makes meaningless: the gateway neither starts nor scales those servers
ROLE_FLEET_OPTIONS = ("--prefill-replicas", "--decode-replicas", "--min-prefill-replicas",
                      "--max-prefill-replicas", "--min-decode-replicas",
                      "--max-decode-replicas")
LOCAL_FLEET_OPTIONS = ("--replicas", "--ray", "--min-replicas", "--max-replicas",
                       "--target-ongoing", "--plan", "--scale-up-delay", "--scale-down-delay",
                       "--look-back", "--scale-to-zero-after", "--ttft-slo",
                       *ROLE_FLEET_OPTIONS)


def check_remote_fleet(tokens: list[str]) -> None:
    """With --replica-url, a local fleet's options would be ignored: refuse them instead."""
    typed = {token.partition("=")[0] for token in tokens if token.startswith("--")}
    ignored = [option for option in LOCAL_FLEET_OPTIONS if option in typed]
    if "--replica-url" in typed and ignored:
        raise ConfigError(f"--replica-url routes over servers started elsewhere, which the "
                          f"gateway neither starts nor scales, so {', '.join(ignored)} would "
                          "be ignored; drop them, or drop --replica-url to start replicas here")


def check_roles(args: argparse.Namespace, tokens: list[str]) -> bool:
    """Whether the options describe a local disaggregated fleet; refuse mixed ones."""
    if args.route_role is not None:
        raise ConfigError("ember route gives its replicas their roles, so --role is not one of "
                          "its options: use --prefill-replicas P --decode-replicas D, or "
                          "--replica-url URL#prefill and URL#decode")
    typed = {token.partition("=")[0] for token in tokens if token.startswith("--")}
    roles = [option for option in ROLE_FLEET_OPTIONS if option in typed]
    if not roles:
        return False
    mixed = [option for option in ("--replicas", "--min-replicas", "--max-replicas")
             if option in typed]
    if mixed:
        raise ConfigError(f"{', '.join(mixed)} and {', '.join(roles)} both size the fleet; a "
                          "disaggregated fleet takes --prefill-replicas P --decode-replicas D "
                          "(and --min-/--max-prefill-replicas, --min-/--max-decode-replicas)")
    if args.prefill_replicas is None or args.decode_replicas is None:
        raise ConfigError("a disaggregated fleet needs both --prefill-replicas P and "
                          "--decode-replicas D")
    if args.prefill_replicas < 1 or args.decode_replicas < 1:
        raise ConfigError("--prefill-replicas and --decode-replicas must be at least 1")
    return True


def role_urls(urls: list[str]) -> list[tuple[str, str]]:
    """--replica-url values -> (url, role): URL#prefill, URL#decode, or a plain URL (both)."""
    out = []
    for url in urls:
        base, _, role = url.partition("#")
        if role not in ("", "prefill", "decode", "both"):
            raise ConfigError(f"--replica-url {url}: #{role} is not a role; use URL#prefill, "
                              "URL#decode, or a plain URL")
        out.append((base.rstrip("/"), role or "both"))
    roles = {role for _, role in out}
    if "prefill" in roles and not roles & {"decode"}:
        raise ConfigError("a prefill replica needs a decode replica to go on from its answer; "
                          "add --replica-url URL#decode")
    return out


def role_autoscale(args: argparse.Namespace, role: str, scale: AutoscaleConfig
                   ) -> AutoscaleConfig:
    """One role's bounds: its --min-/--max-ROLE-replicas, by default its count."""
    n = getattr(args, f"{role}_replicas")
    low = getattr(args, f"min_{role}_replicas")
    high = getattr(args, f"max_{role}_replicas")
    low = n if low is None else low
    return replace(scale, min_replicas=low, max_replicas=max(n, low) if high is None else high)


def route_only_options(actions: list[argparse.Action]) -> dict[str, int | str]:
    """Each option string of `actions` and of GATEWAY_ONLY (the options that are the
    gateway's alone) -> its argument count."""
    out: dict[str, int | str] = dict(GATEWAY_ONLY)
    for action in actions:
        nargs = action.nargs if action.nargs is not None else 1
        for option in action.option_strings:
            out[option] = nargs
    return out


def target_ongoing(args: argparse.Namespace) -> tuple[float, str]:
    """The autoscaler's --target-ongoing and where it came from: as given, else the --plan
    profile's knee, else the default."""
    if args.target_ongoing is not None:
        return args.target_ongoing, "--target-ongoing"
    if args.plan is not None:
        from ember.plan.knee import profile_knee   # (only --plan reads a profile)
        from ember.plan.profile import load_profile
        return float(profile_knee(load_profile(args.plan))), f"the knee of {args.plan}"
    return AutoscaleConfig.target_ongoing, "the default"


def router_config(args: argparse.Namespace, server: ServerConfig,
                  target: float | None = None) -> RouterConfig:
    """`target`: the autoscaler's target_ongoing (default: target_ongoing(args)'s)."""
    n = args.replicas
    low = n if args.min_replicas is None else args.min_replicas
    high = max(n, low) if args.max_replicas is None else args.max_replicas
    scale = AutoscaleConfig(min_replicas=low, max_replicas=high,
                            target_ongoing=target_ongoing(args)[0] if target is None
                            else target, look_back_s=args.look_back,
                            scale_up_delay_s=args.scale_up_delay,
                            scale_down_delay_s=args.scale_down_delay,
                            scale_to_zero_after_s=args.scale_to_zero_after,
                            ttft_slo_s=args.ttft_slo)
    limit = server.request_timeout_s
    split = args.prefill_replicas is not None
    return RouterConfig(policy=args.policy, session_header=args.session_header.lower(),
                        max_tries=args.max_tries, max_queue=args.max_queue,
                        hold_timeout_s=args.hold_timeout, server=server, autoscale=scale,
                        replica_timeout_s=limit + REPLICA_TIMEOUT_SLACK_S if limit else None,
                        prefill_autoscale=role_autoscale(args, "prefill", scale)
                        if split else None,
                        decode_autoscale=role_autoscale(args, "decode", scale)
                        if split else None,
                        disagg_min_tokens=args.disagg_min_tokens,
                        disagg_max_prefill_backlog=args.disagg_max_prefill_backlog,
                        disagg_idle_s=args.disagg_idle_s)


def with_model(argv: list[str], model: str) -> list[str]:
    """`argv` serving `model` instead of the model it names, if any."""
    return serve_argv(argv, {"--model": 1}) + ["--model", model]

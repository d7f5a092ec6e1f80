"""`ember control` and `ember plane`: options -> the control plane's app, or a plane's agent."""
from __future__ import annotations

import argparse
import asyncio
import ipaddress
import sys
from collections.abc import Callable
from pathlib import Path

from ember.errors import ConfigError


def add_control_parsers(sub: argparse._SubParsersAction) -> None:
    control = sub.add_parser("control", help="the control plane: places deployments on "
                             "workload planes and serves the global OpenAI endpoint")
    control.add_argument("--config", required=True, help="deployments.toml (docs/fleet.md)")
    control.add_argument("--state", default="control.db", help="its SQLite state file")
    control.add_argument("--host", default="127.0.0.1")
    control.add_argument("--port", type=int, default=8000)
    control.add_argument("--down-after", type=float, default=3.0, metavar="S",
                         help="a plane not heard from for S seconds is marked down")
    control.add_argument("--plane-token-file", metavar="FILE",
                         help="a secret every `ember plane --token-file` must hold "
                              "(required unless --host is a loopback address)")
    control.set_defaults(func=cmd_control)
    plane = sub.add_parser("plane", help="a workload plane's agent: registers with the "
                           "control plane and runs the `ember route` fleets it assigns")
    plane.add_argument("--name", required=True)
    plane.add_argument("--region", required=True)
    plane.add_argument("--cores", type=int,
                       help="cores its fleets may use (with --ray: default the cluster's)")
    plane.add_argument("--memory-gib", type=float,
                       help="memory its fleets may use (with --ray: default the cluster's)")
    plane.add_argument("--ray", nargs="?", const="auto", default=None, metavar="ADDRESS",
                       help="run its fleets' replicas as actors on the Ray cluster at "
                            "ADDRESS (default: the one `ray start` set up, else a local "
                            "one), and report that cluster's capacity")
    plane.add_argument("--cost-per-hour", type=float, default=1.0)
    plane.add_argument("--spot", action="store_true",
                       help="capacity that can be taken back: only deployments with "
                            "allow_spot run here")
    plane.add_argument("--control", required=True, metavar="URL",
                       help="the control plane, e.g. http://127.0.0.1:8000")
    plane.add_argument("--host", default="127.0.0.1", help="where its fleets listen")
    plane.add_argument("--heartbeat", type=float, default=1.0, metavar="S")
    plane.add_argument("--token-file", metavar="FILE",
                       help="the secret in `ember control --plane-token-file`")
    plane.set_defaults(func=cmd_plane)


def cmd_control(args: argparse.Namespace) -> None:
    import uvicorn

    from ember.control.app import create_control_app
    from ember.control.config import load_config
    from ember.control.controller import Controller
    from ember.control.state import State
    token = plane_token(args.host, args.plane_token_file)
    ctl = Controller(load_config(args.config), State(args.state), args.down_after)
    app = create_control_app(ctl, check_every_s=min(0.5, args.down_after / 4),
                             plane_token=token)
    print(f"ember: control plane on http://{args.host}:{args.port}; see /control",
          file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False)


def cmd_plane(args: argparse.Namespace) -> None:
    from ember.control.agent import PlaneAgent
    from ember.control.placement import Plane
    if args.heartbeat <= 0:
        raise ConfigError("--heartbeat must be > 0 seconds; try 1")
    ray_address, capacity = None, None
    if args.ray is not None:    # ray loads only when asked for
        from ember.router.ray_replicas import connect
        ray_address = connect(None if args.ray == "auto" else args.ray)
        capacity = ray_capacity(args.cores, args.memory_gib)
    cores, memory_mib = capacity() if capacity else given_capacity(args.cores,
                                                                   args.memory_gib, None)
    plane = Plane(args.name, args.region, cores, memory_mib, args.cost_per_hour, args.spot)
    token = read_token(args.token_file, "--token-file") if args.token_file else None
    agent = PlaneAgent(plane, args.control.rstrip("/"), args.heartbeat, args.host,
                       token=token, ray=ray_address, capacity=capacity)
    print(f"ember: plane {plane.name} ({plane.region}) reporting to {agent.control_url}; "
          f"fleet logs in {agent.log_dir}", file=sys.stderr, flush=True)
    asyncio.run(agent.run())


def given_capacity(cores: int | None, memory_gib: float | None,
                   cluster: tuple[int, int] | None) -> tuple[int, int]:
    """(cores, memory MiB): the flags where given, else the Ray cluster's (cores, MiB)."""
    if cluster is None and (cores is None or memory_gib is None):
        raise ConfigError("give the plane's --cores and --memory-gib, or --ray ADDRESS to "
                          "read them from a Ray cluster")
    return (cores if cores is not None else cluster[0],
            round(1024 * memory_gib) if memory_gib is not None else cluster[1])


def ray_capacity(cores: int | None, memory_gib: float | None
                 ) -> Callable[[], tuple[int, int]]:
    """The plane's capacity as the joined Ray cluster has it now, the flags given winning."""
    from ember.router.ray_replicas import cluster_capacity
    return lambda: given_capacity(cores, memory_gib, cluster_capacity())


def plane_token(host: str, token_file: str | None) -> str | None:
    """The secret planes must send. None (any plane is let in) only on a loopback address:
    a heartbeat's reply carries tenants' API keys, so on any other address no token is an
    error rather than an open door."""
    if token_file is not None:
        return read_token(token_file, "--plane-token-file")
    if not is_loopback(host):
        raise ConfigError(f"--host {host} lets other machines register planes and receive "
                          "tenants' API keys; give --plane-token-file FILE (a secret, e.g. "
                          "`openssl rand -hex 32 > FILE`) and the same file to each "
                          "`ember plane --token-file`")
    return None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:          # a host name: it may resolve to anything
        return False


def read_token(path: str, option: str) -> str:
    """A secret from a file (not argv, which `ps` shows to every user)."""
    try:
        token = Path(path).read_text().strip()
    except OSError as e:
        raise ConfigError(f"{option} {path}: {e}; give a readable file holding the "
                          "secret") from None
    if not token or any(c.isspace() for c in token):
        raise ConfigError(f"{option} {path} must hold one secret with no spaces (e.g. "
                          "`openssl rand -hex 32`)")
    return token

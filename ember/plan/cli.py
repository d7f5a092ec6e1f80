"""`ember plan` and `ember plan profile`: the arguments (the commands: commands.py, imported
when one runs). The workload and arrival options are `ember bench`'s own."""
from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from pathlib import Path

from ember.bench.cli import add_arrival_args, add_workload_args
from ember.config import EVICTION_POLICIES
from ember.router.config import POLICIES

DEFAULT_NUM_REQUESTS = 1000   # bench's 32 say nothing of a p99


def _command(name: str) -> Callable[[argparse.Namespace], None]:
    def run(args: argparse.Namespace) -> None:
        func = getattr(importlib.import_module("ember.plan.commands"), name)
        try:
            func(args)
        except (ValueError, FileNotFoundError) as e:
            raise SystemExit(f"error: {e}") from None
    return run


def add_plan_parser(sub: argparse._SubParsersAction, out_dir: Path,
                    engine_args: Callable[[argparse.ArgumentParser], None],
                    profile_command: Callable[[argparse.Namespace], None]) -> None:
    """`engine_args` adds `ember serve`'s engine options (for `plan profile`), whose command
    `profile_command` loads the engine (ember/cli.py owns both)."""
    plan = sub.add_parser("plan", help="capacity planning: replicas for a rate within an SLO, "
                          "from a measured profile and a simulated fleet (docs/plan.md)")
    what = plan.add_subparsers(dest="plan_command")
    prof = what.add_parser("profile", help="measure this machine's step times with a model "
                           "and fit the step-time model")
    engine_args(prof)
    prof.add_argument("--out", default=str(out_dir / "profile.json"),
                      help="the profile (default: %(default)s)")
    prof.add_argument("--max-seconds", type=float, default=90.0,
                      help="stop starting new measurements after this long")
    prof.add_argument("--no-serve", action="store_true",
                      help="do not serve the model to measure the server's own time per step "
                           "and per streamed token (the profile then adds none)")
    prof.add_argument("--serve-gateway", action="store_true",
                      help="also stream through `ember route` on the same cores, to measure "
                           "what a gateway that shares the replicas' cores adds (`ember plan "
                           "--gateway-shares-cores`)")
    prof.set_defaults(func=profile_command)
    _simulation_args(plan, out_dir)
    plan.set_defaults(func=_command("cmd_plan"))


def _simulation_args(plan: argparse.ArgumentParser, out_dir: Path) -> None:
    plan.add_argument("--profile", default=None, help="from `ember plan profile` (required)")
    add_workload_args(plan)
    plan.set_defaults(num_requests=DEFAULT_NUM_REQUESTS)
    g = plan.add_argument_group("load (as `ember bench serve` sends it)")
    add_arrival_args(g)
    g.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    q = plan.add_argument_group("question")
    q.add_argument("--slo", default=None, help="ttft_p99=1s,itl_p99=100ms (percentiles of the "
                   "run) and/or ttft=500ms,tpot=50ms (every request, see --slo-attainment)")
    q.add_argument("--slo-attainment", type=float, default=0.9,
                   help="share of requests that must meet the per-request limits")
    q.add_argument("--replicas", type=int, default=None,
                   help="simulate this fleet at --rate or --concurrency and report it as "
                        "`ember bench serve` would (no search)")
    q.add_argument("--rates", default=None, help="e.g. 1,2,4: the replicas each rate needs "
                   "(the capacity curve)")
    q.add_argument("--at-replicas", type=int, default=None,
                   help="the highest rate this many replicas hold within the SLO")
    q.add_argument("--max-replicas", type=int, default=64, help="search no larger fleet")
    q.add_argument("--cost-per-hour", type=float, default=None,
                   help="one replica's cost per hour: gives the cost per million output tokens")
    f = plan.add_argument_group("the fleet (default: as profiled)")
    f.add_argument("--policy", default="prefix", choices=list(POLICIES),
                   help="`ember route`'s routing policy")
    f.add_argument("--kv-cache-gib", type=float, default=None)
    f.add_argument("--max-num-seqs", type=int, default=None)
    f.add_argument("--max-num-batched-tokens", type=int, default=None)
    f.add_argument("--prefill-tokens-with-decodes", type=int, default=None)
    f.add_argument("--no-prefix-caching", action="store_true")
    f.add_argument("--eviction-policy", default=None, choices=list(EVICTION_POLICIES))
    f.add_argument("--max-waiting", type=int, default=256,
                   help="requests a replica queues before it answers 429")
    f.add_argument("--gateway-shares-cores", action="store_true",
                   help="the gateway runs on the replicas' cores: add the gateway overhead "
                        "the profile measured (`ember plan profile --serve-gateway`)")
    f.add_argument("--no-spread", action="store_true",
                   help="every step lasts exactly its prediction (by default steps scatter "
                        "around it as the profile's served steps did, which sets the tails)")
    plan.add_argument("--out", default=str(out_dir / "plan.json"),
                      help="the answer and every simulated point; the plot beside it "
                           "(default: %(default)s)")

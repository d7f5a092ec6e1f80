"""`ember plan`: load the profile, build the workload, ask the question, report."""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from ember.bench import report as bench_report
from ember.bench.metrics import parse_slo
from ember.config import SchedulerConfig
from ember.errors import ConfigError
from ember.plan.knee import profile_knee
from ember.plan.profile import Profile, load_profile
from ember.plan.report import curve_data, describe_point, plot
from ember.plan.search import Planner, Point, Slo
from ember.plan.simulate import ReplicaConfig
from ember.plan.stepmodel import ServingOverhead
from ember.plan.workload import bench_load, plan_requests

CURVE_FRACTIONS = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5)   # of the asked rate, for the plot


def replica_config(profile: Profile, args: argparse.Namespace) -> ReplicaConfig:
    """A replica as profiled, with the options the user changed."""
    base = profile.scheduler
    scheduler = SchedulerConfig(
        max_num_seqs=args.max_num_seqs or base.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens or base.max_num_batched_tokens,
        prefill_tokens_with_decodes=args.prefill_tokens_with_decodes
        or base.prefill_tokens_with_decodes, fair_share=base.fair_share)
    tokenizer_eos = frozenset(profile.tokenizer.get("eos_ids", ()))
    serving = profile.serving
    if args.gateway_shares_cores:
        if not profile.gateway.measured:
            raise ConfigError("--gateway-shares-cores needs a profile that measured the "
                              "gateway: make one with `ember plan profile --serve-gateway`")
        serving = serving.plus(profile.gateway)
    if args.no_spread:
        serving = replace(serving, spread=())
    return ReplicaConfig(
        step_model=profile.step_model, num_blocks=profile.num_blocks(args.kv_cache_gib),
        serving=serving,
        block_size=profile.block_size, max_model_len=profile.max_model_len,
        scheduler=scheduler,
        enable_prefix_caching=not args.no_prefix_caching
        and profile.engine.get("enable_prefix_caching", True),
        eviction_policy=args.eviction_policy or profile.engine.get("eviction_policy", "lru"),
        max_waiting=args.max_waiting, eos_token_ids=tokenizer_eos)


def _question(args: argparse.Namespace) -> str:
    asked = [name for name, given in (("replicas", args.replicas is not None),
                                      ("rates", args.rates is not None),
                                      ("at_replicas", args.at_replicas is not None)) if given]
    if len(asked) > 1:
        raise ConfigError("ask one question: --replicas, --rates or --at-replicas (or none: "
                          "the replicas --rate needs)")
    question = asked[0] if asked else "rate"
    if question != "replicas" and not args.slo:
        raise ConfigError("--slo is needed to plan, e.g. --slo ttft_p99=1s,itl_p99=100ms (or "
                          "--replicas N to simulate one fleet)")
    if question in ("replicas", "rate") and args.rate is None and args.concurrency is None:
        raise ConfigError("give the load: --rate R (requests/s) or --concurrency C")
    return question


def cmd_plan(args: argparse.Namespace) -> None:
    if args.profile is None:
        raise ConfigError("--profile PATH is needed (make one with `ember plan profile`)")
    question = _question(args)
    profile = load_profile(args.profile)
    config = replica_config(profile, args)
    tokenizer = profile.load_tokenizer()
    requests = plan_requests(args, tokenizer, config.block_size)
    slo = Slo(parse_slo(args.slo), args.slo_attainment) if args.slo else None
    token_ids = [i for i in range(tokenizer.vocab_size) if i not in config.eos_token_ids]
    planner = Planner(config, requests, lambda rate: bench_load(args, len(requests), rate),
                      slo, args.policy, token_ids, args.seed)
    print(_profile_text(profile))
    print(f"workload: {args.workload}, {len(requests)} requests, "
          f"{_load_text(args)}; policy {args.policy}"
          + (f"; SLO {args.slo}" if args.slo else ""))
    out = Path(args.out)
    began = time.perf_counter()
    answer = {"replicas": _simulate_one, "rate": _replicas_for_rate, "rates": _capacity_curve,
              "at_replicas": _rate_for_replicas}[question](planner, args, out)
    print(f"simulated {len(planner.points)} fleet(s) of {len(requests)} requests in "
          f"{time.perf_counter() - began:.1f} s")
    data = {"profile": str(args.profile), "question": question, "answer": answer,
            "options": {k: v for k, v in vars(args).items() if k != "func"},
            "points": [p.to_json() for p in planner.points.values()]}
    if question != "replicas":
        chosen = planner.points.get(tuple(answer["chosen"])) if answer.get("chosen") else None
        data["curve"] = curve_data(list(_curve_points(planner, answer)),
                                   slo.limits if slo else {}, chosen)
        png = plot(data["curve"], out.with_suffix(".png"), f"{profile.model_name}: "
                   f"{args.workload}, SLO {args.slo}")
        print(f"plot: {png}" if png else "plot: not drawn (matplotlib is not installed); its "
              f"data is under \"curve\" in {out}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1, default=str))
    print(f"wrote {out}")


def _profile_text(profile: Profile) -> str:
    m = profile.machine
    text = (f"profile: {profile.model_name} on {m.get('cpu', '?')} ({m.get('cpus', '?')} "
            f"CPUs); step model within "
            f"{profile.residuals.get('all', {}).get('median_abs', float('nan')) * 100:.0f}% "
            "(median) of the measured steps; its knee is "
            f"{profile_knee(profile)} requests at once (`ember route --plan`'s target)")
    text += "\n  " + serving_text(profile)
    load = max(m.get("load_average_before", 0.0), m.get("load_average_after", 0.0))
    disturbed = m.get("disturbed_steps", 0) / max(len(profile.steps), 1)
    # (the profile's own engine threads keep the load average near the CPU count)
    if disturbed > 0.1 or load > 1.5 * m.get("cpus", 1):
        text += (f"\n  (measured on a busy machine: load average up to {load:.1f}, "
                 f"{m.get('disturbed_steps', 0)} of {len(profile.steps)} steps disturbed; "
                 "profile again with the machine to itself)")
    return text


def serving_text(profile: Profile) -> str:
    """What the simulation adds to each step for the server's own work, or that it adds
    nothing."""
    serving = profile.serving
    if not serving.measured:
        return ("served overhead: none in this profile (it was made without serving the "
                "model), so simulated steps last what the engine's in-process steps do and a "
                "served replica's gaps between tokens are longer; profile again with `ember "
                "plan profile` to measure it")
    text = "served overhead: " + _overhead_text(serving) + ", added to each step"
    if profile.gateway.measured:
        text += ("\n  gateway overhead (`ember route` on the replica's cores; added with "
                 "--gateway-shares-cores): " + _overhead_text(profile.gateway))
    return text


def _overhead_text(overhead: ServingOverhead) -> str:
    fit = overhead.residuals.get("with", {})
    return (f"{overhead.per_step_s * 1e3:.2f} ms a step + {overhead.per_token_s * 1e3:.3f} ms "
            f"a streamed token (within {fit.get('median_abs', float('nan')) * 100:.0f}% "
            f"(median) of {fit.get('steps', 0)} served step intervals)")


def _load_text(args: argparse.Namespace) -> str:
    if args.rates:
        return f"rates {args.rates} req/s"
    if args.rate is not None:
        return f"{args.rate:g} req/s" + ("" if args.burstiness == 1.0 else
                                         f" (burstiness {args.burstiness:g})")
    if args.concurrency is not None:
        return f"concurrency {args.concurrency}"
    return "rate searched"


def _simulate_one(planner: Planner, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """One fleet, reported as `ember bench serve` reports a run (and written in its format,
    so `ember bench compare` puts it beside a measured one)."""
    point = planner.simulate(args.replicas, args.rate)
    summary = point.summary | {"label": f"simulated {args.replicas} replica(s)",
                               "config": {"simulated": True, "replicas": args.replicas,
                                          "rate": args.rate, "concurrency": args.concurrency,
                                          "workload": args.workload, "seed": args.seed,
                                          "command": " ".join(sys.argv)}}
    print(bench_report.table(summary))
    print("\n".join(describe_point(point, args.cost_per_hour)))
    run = out.with_name(out.stem + "-run.json")
    bench_report.write_results(run, summary, [])
    print(f"wrote {run} (`ember bench compare` reads it)")
    return {"replicas": args.replicas, "rate": args.rate}


def _replicas_for_rate(planner: Planner, args: argparse.Namespace, out: Path
                       ) -> dict[str, Any]:
    point = planner.replicas_needed(args.rate, args.max_replicas)
    if point is None:
        print(f"no fleet of up to {args.max_replicas} replicas meets the SLO at this load; "
              "raise --max-replicas, or check the per-request limits against one request "
              "alone")
        return {"replicas": None}
    print(f"replicas needed: {point.replicas}")
    print("\n".join(describe_point(point, args.cost_per_hour)))
    fewer = planner.points.get((point.replicas - 1, args.rate))
    if fewer is not None:
        print(f"with {fewer.replicas}:")
        print("\n".join(describe_point(fewer, None)))
    if args.rate is not None:
        planner.curve(point.replicas, [args.rate * f for f in CURVE_FRACTIONS])
    return {"replicas": point.replicas, "chosen": [point.replicas, args.rate]}


def _capacity_curve(planner: Planner, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    rows = []
    for rate in (float(v) for v in args.rates.split(",")):
        point = planner.replicas_needed(rate, args.max_replicas)
        rows.append({"rate": rate, "replicas": point.replicas if point else None})
        print(f"{rate:g} req/s: " + (f"{point.replicas} replicas" if point else
                                      f"more than {args.max_replicas} replicas"))
        if point is not None:
            print("\n".join(describe_point(point, args.cost_per_hour)))
    return {"curve": rows}


def _rate_for_replicas(planner: Planner, args: argparse.Namespace, out: Path
                       ) -> dict[str, Any]:
    start = args.rate if args.rate is not None else float(args.at_replicas)
    point = planner.max_rate(args.at_replicas, start)
    if point is None:
        print(f"{args.at_replicas} replicas miss the SLO even at a trickle of requests")
        return {"rate": None}
    print(f"{args.at_replicas} replicas hold {point.rate:.3g} req/s within the SLO")
    print("\n".join(describe_point(point, args.cost_per_hour)))
    return {"rate": point.rate, "chosen": [args.at_replicas, point.rate]}


def _curve_points(planner: Planner, answer: dict[str, Any]) -> list[Point]:
    """The points the plot shows: those of the chosen fleet size, or each rate's answer."""
    if "curve" in answer:
        return [planner.points[(r["replicas"], r["rate"])] for r in answer["curve"]
                if r["replicas"] is not None]
    if not answer.get("chosen"):
        return []
    replicas = answer["chosen"][0]
    return [p for (n, _), p in planner.points.items() if n == replicas]


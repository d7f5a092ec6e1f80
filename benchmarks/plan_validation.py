"""The fleet simulator against the real thing: `ember plan`'s figures beside measured ones.

    PYTHONPATH=. python benchmarks/plan_validation.py [--profile profile.json] [--quick]
        [--replicas 1,2] [--num-requests 60] [--slo ttft_p99=1s,itl_p99=300ms] [--seed 100]
        [--one-core-each] [--recommend-only]

For the default model (a profile is measured first unless --profile gives one):
1. At three rates per replica, low, near the knee and past it (0.35x, 1x and 1.5x the rate a
   replica completes at its knee concurrency, simulated; ember/plan/knee.py), for each fleet
   size: `ember bench serve` against `ember route --replicas N` (real replicas) and `ember plan
   --replicas N` with the same workload, rate and seed (256-token prompts, 64 output tokens).
   Printed: TTFT and ITL (the gap between streamed chunks) p50 and p99 and output tok/s,
   measured / simulated and their ratio, each against its limit (p50 within 20%, p99 within
   35%, tok/s within 10%).
2. The recommendation: the replicas `ember plan --rate R --slo SLO` says R (twice the rate
   one replica completes at its knee: one replica is overloaded there) needs, run for real,
   meet the SLO, and one fewer do not.
3. A simulated replica (`ember route --simulate`) against a real one behind `ember route`:
   TTFT p50 at concurrency 8, within 20%.

Each fleet is warmed up with a few requests first, and each run uses its own seed (a prompt
repeated from an earlier run would hit the real fleet's prefix cache). The profile is
measured with `--serve-gateway`; with --one-core-each, a fleet whose replicas hold every core
shares them with the gateway, and is simulated with `--gateway-shares-cores` (when the
profile measured the gateway). --quick: a smoke run
(a 10 s profile, 8 requests a run, a fleet of 1) that checks the script, not the simulator.
Every JSON goes to --out-dir. Measure with nothing else running: the profile and the
replicas must have the cores to themselves.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from ember.bench.metrics import summarize
from ember.plan.cli import add_plan_parser
from ember.plan.commands import replica_config
from ember.plan.knee import profile_knee
from ember.plan.profile import Profile, load_profile
from ember.plan.simulate import FleetSim, Load
from ember.plan.workload import plan_requests
from ember.weights.paths import default_model_path
from tests.server.conftest import free_port

WORKLOAD = ["--input-len", "fixed:256", "--output-len", "fixed:64"]
RATE_FACTORS = (("low", 0.35), ("knee", 1.0), ("past", 1.5))
RECOMMEND_FACTOR = 2.0   # the recommendation's rate, in knee rates
# (name, summary keys, allowed |sim / real - 1|)
METRICS = (("TTFT p50 ms", ("ttft_s", "p50"), 0.20), ("TTFT p99 ms", ("ttft_s", "p99"), 0.35),
           ("ITL p50 ms", ("chunk_gap_s", "p50"), 0.20),
           ("ITL p99 ms", ("chunk_gap_s", "p99"), 0.35),
           ("output tok/s", ("output_tok_per_s",), 0.10))


def ember(*argv: str, log: Path, prefix: tuple[str, ...] = ()) -> None:
    """Run one `ember` command to its end, its output to `log`."""
    with open(log, "w") as out:
        done = subprocess.run([*prefix, sys.executable, "-m", "ember.cli", *argv], stdout=out,
                              stderr=subprocess.STDOUT)
    if done.returncode:
        raise SystemExit(f"`ember {' '.join(argv)}` failed:\n{log.read_text()[-3000:]}")


class Route:
    """`ember route OPTIONS` on a free port, until close(). With `one_core_each`, its
    replicas are `ember serve` processes, replica I held to core I (taskset), given to the
    gateway by URL."""

    def __init__(self, options: list[str], replicas: int, log_dir: Path,
                 one_core_each: bool = False) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log_dir / f"route-{self.port}.log"
        self.replicas: list[subprocess.Popen] = []
        fleet = ["--replicas", str(replicas)]
        if one_core_each:
            fleet = []
            for core in range(replicas):
                port = free_port()
                self.replicas.append(subprocess.Popen(
                    ["taskset", "-c", str(core), sys.executable, "-m", "ember.cli", "serve",
                     "--port", str(port), "-q", *options],
                    stdout=open(log_dir / f"serve-{port}.log", "w"), stderr=subprocess.STDOUT))
                fleet += ["--replica-url", f"http://127.0.0.1:{port}"]
            options = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ember.cli", "route", "--port", str(self.port), "-q",
             *fleet, *options],
            stdout=open(self.log, "w"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while not self._ready(replicas):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"ember route never got ready:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.5)
        # the first requests of a fresh replica are slower (lazy imports, first kernels):
        # a few, on prompts no run repeats, before anything is measured
        ember("bench", "serve", "--base-url", self.url + "/v1", "--tokenizer",
              str(default_model_path()), *WORKLOAD, "--concurrency", str(2 * replicas),
              "--num-requests", str(4 * replicas), "--seed", "1", "--out",
              str(log_dir / f"warmup-{self.port}.json"), log=log_dir / f"warmup-{self.port}.log")

    def _ready(self, replicas: int) -> bool:
        try:
            fleet = httpx.get(self.url + "/fleet", timeout=10).json()
        except (httpx.HTTPError, ValueError):
            return False
        return sum(r["state"] == "ready" for r in fleet["replicas"]) >= replicas

    def close(self) -> None:
        for proc in (self.proc, *self.replicas):
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


def bench(route: Route, load: list[str], num: int, seed: int, out: Path,
          slo: str | None = None) -> dict[str, Any]:
    ember("bench", "serve", "--base-url", route.url + "/v1",
          "--tokenizer", str(default_model_path()), *WORKLOAD, *load,
          "--num-requests", str(num), "--seed", str(seed), "--out", str(out),
          *(["--slo", slo] if slo else []), log=out.with_suffix(".log"))
    return json.loads(out.read_text())


def simulate(profile: Path, replicas: int, rate: float, num: int, seed: int,
             out: Path, gateway_shares_cores: bool = False) -> dict[str, Any]:
    ember("plan", "--profile", str(profile), "--replicas", str(replicas), "--rate", f"{rate}",
          *WORKLOAD, "--num-requests", str(num), "--seed", str(seed), "--out", str(out),
          *(["--gateway-shares-cores"] if gateway_shares_cores else []),
          log=out.with_suffix(".log"))
    return json.loads(out.with_name(out.stem + "-run.json").read_text())


def knee_rate(profile: Profile, num: int) -> tuple[int, float]:
    """The knee concurrency, and the rate one simulated replica completes requests at with
    that many clients (the workload above)."""
    parser = argparse.ArgumentParser()
    add_plan_parser(parser.add_subparsers(), Path(), lambda p: None, lambda a: None)
    options = parser.parse_args(["plan", *WORKLOAD, "--num-requests", str(max(num, 64))])
    config = replica_config(profile, options)
    tokenizer = profile.load_tokenizer()
    requests = plan_requests(options, tokenizer, config.block_size)
    token_ids = [i for i in range(tokenizer.vocab_size) if i not in config.eos_token_ids]
    knee = profile_knee(profile)
    records = FleetSim(config, 1, "prefix", token_ids).run(requests, Load(concurrency=knee))
    return knee, summarize(records)["requests_per_s"]


def value(summary: dict[str, Any], keys: tuple[str, ...]) -> float:
    v: Any = summary
    for k in keys:
        v = v[k]
    return float(v) * (1000 if keys[0] != "output_tok_per_s" else 1)


def compare_rows(label: str, real: dict[str, Any], sim: dict[str, Any]) -> list[str]:
    rows = []
    for name, keys, limit in METRICS:
        r, s = value(real, keys), value(sim, keys)
        ratio = s / r if r else float("nan")
        ok = abs(ratio - 1) <= limit
        rows.append(f"| {label} | {name} | {r:.1f} | {s:.1f} | {ratio:.2f}x | "
                    f"{'pass' if ok else 'FAIL'} (±{limit:.0%}) |")
    return rows


def slo_met(summary: dict[str, Any]) -> bool:
    targets = summary.get("slo_percentiles") or {}
    return bool(targets) and all(t["met"] for t in targets.values()) and \
        summary["completed"] == summary["num_requests"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--profile", default=None, help="default: measure one first")
    parser.add_argument("--replicas", default=None, help="fleet sizes (default 1,2)")
    parser.add_argument("--num-requests", type=int, default=None, help="per run (default 60)")
    parser.add_argument("--slo", default="ttft_p99=1s,itl_p99=300ms")
    parser.add_argument("--seed", type=int, default=100)
    parser.add_argument("--quick", action="store_true", help="a smoke run of the script")
    parser.add_argument("--out-dir", default=None)
    parser.add_argument("--one-core-each", action="store_true",
                        help="profile on core 0 and run each real replica on a core of its "
                             "own, so that a fleet of N does not share the cores the profile "
                             "measured one replica on")
    parser.add_argument("--recommend-only", action="store_true",
                        help="only the recommendation check (with --profile, a few minutes)")
    args = parser.parse_args()
    out = Path(args.out_dir or tempfile.mkdtemp(prefix="ember-plan-validation-"))
    out.mkdir(parents=True, exist_ok=True)
    sizes = [int(n) for n in (args.replicas or ("1" if args.quick else "1,2")).split(",")]
    num = args.num_requests or (8 if args.quick else 60)
    with open("/proc/loadavg") as f:
        print(f"results in {out}; load average at start: {f.read().split()[0]}")
    profile_path = Path(args.profile) if args.profile else out / "profile.json"
    if not args.profile:
        print("measuring the profile ...", flush=True)
        ember("plan", "profile", "--out", str(profile_path), "--max-seconds",
              "10" if args.quick else "90", "--serve-gateway",
              log=out / "profile.log", prefix=("taskset", "-c", "0") if args.one_core_each
              else ())
    profile = load_profile(profile_path)
    knee, rate = knee_rate(profile, num)
    print(f"knee: {knee} requests at once; one replica completes {rate:.2f} req/s there")
    seed = args.seed
    rec_rate = rate * RECOMMEND_FACTOR
    ember("plan", "--profile", str(profile_path), "--rate", f"{rec_rate}", "--slo", args.slo,
          *WORKLOAD, "--num-requests", str(num), "--seed", str(seed), "--max-replicas", "8",
          "--out", str(out / "recommend.json"), log=out / "recommend.log")
    recommended = json.loads((out / "recommend.json").read_text())["answer"]["replicas"]
    print(f"ember plan: {rec_rate:.2f} req/s within {args.slo} needs {recommended} replica(s)")

    table = ["| fleet, rate | metric | measured | simulated | sim/real | within |",
             "|---|---|---:|---:|---:|---|"]
    verdicts: dict[int, bool] = {}
    real_c8 = None
    for n in sizes:
        shares = args.one_core_each and n >= (os.cpu_count() or 1) and profile.gateway.measured
        if shares:
            print(f"fleet of {n}: the gateway shares the replicas' cores "
                  "(simulated with --gateway-shares-cores)")
        route = Route([], n, out, args.one_core_each)
        try:
            for name, factor in () if args.recommend_only else RATE_FACTORS:
                seed += 1
                r = rate * factor * n
                real = bench(route, ["--rate", f"{r}"], num, seed, out / f"real-{n}-{name}.json")
                sim = simulate(profile_path, n, r, num, seed, out / f"sim-{n}-{name}.json",
                               shares)
                table += compare_rows(f"{n} x, {r:.2f} req/s ({name})", real, sim)
            if recommended is not None and n in (recommended, recommended - 1):
                seed += 1
                verdicts[n] = slo_met(bench(route, ["--rate", f"{rec_rate}"], num, seed,
                                            out / f"recommend-{n}.json", args.slo))
            if n == 1 and not args.recommend_only:
                seed += 1
                real_c8 = bench(route, ["--concurrency", "8"], num, seed, out / "real-c8.json")
        finally:
            route.close()
    print("\n".join(table))

    if recommended is None:
        print("recommendation: none within 8 replicas")
    for n in (recommended, (recommended or 0) - 1):
        if n in verdicts:
            print(f"recommendation: {n} replica(s) at {rec_rate:.2f} req/s "
                  f"{'meet' if verdicts[n] else 'miss'} {args.slo} for real")
    if recommended in verdicts and recommended - 1 in verdicts:
        good = verdicts[recommended] and not verdicts[recommended - 1]
        print(f"recommendation check: {'pass' if good else 'FAIL'}")
    elif recommended is not None:
        print(f"recommendation check: not run (needs fleets of {recommended} and "
              f"{recommended - 1} in --replicas)")

    if real_c8 is not None:
        route = Route(["--simulate", str(profile_path)], 1, out, args.one_core_each)
        try:
            sim_c8 = bench(route, ["--concurrency", "8"], num, seed, out / "simulated-c8.json")
        finally:
            route.close()
        r, s = value(real_c8, ("ttft_s", "p50")), value(sim_c8, ("ttft_s", "p50"))
        print(f"concurrency 8 behind ember route, TTFT p50: real {r:.1f} ms, simulated replica "
              f"{s:.1f} ms ({s / r:.2f}x): {'pass' if abs(s / r - 1) <= 0.2 else 'FAIL'} "
              "(±20%)")
    with open("/proc/loadavg") as f:
        print(f"load average at the end: {f.read().split()[0]}")


if __name__ == "__main__":
    main()

"""How long `ember plan` takes to simulate one fleet: 10,000 requests over 8 replicas by default.

    .venv/bin/python benchmarks/plan_simulate.py [--rate 30] [--replicas 8] [--profile P]
        [--cprofile] [--step-by-step]

The requests are `ember plan`'s own (bench's random workload, 256-token prompts, 64 output
tokens, the default model's tokenizer); the replica is the default model's, with a fixed step
model unless --profile gives a measured one. Reported: the seconds spent building the
workload and simulating the fleet (wall and CPU), the simulated steps and the simulated run's
length. With --cprofile, the 25 functions that took the most time follow. --step-by-step
plans every step with the scheduler (FleetSim(decode_ahead=False)), for the shortcut's gain.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import time

from ember.plan.cli import add_plan_parser
from ember.plan.commands import replica_config
from ember.plan.profile import Profile, load_profile
from ember.plan.simulate import FleetSim
from ember.plan.stepmodel import StepModel
from ember.plan.workload import bench_load, plan_requests
from ember.router.prompts import load_tokenizer
from ember.weights.paths import default_model_path

# seconds: prompt forward 4 ms + 0.12 ms a row; decode forward 3 ms + 0.6 ms a row, 0.2 ms
# more a row past 8, 0.2 us a key read (about the default model on a 2-vCPU machine)
STEP_MODEL = StepModel((4e-3, 1.2e-4, 2e-9, 3e-3, 6e-4, 8e-4, 2e-7), 1e-3)


def fixed_profile() -> Profile:
    """The default model's facts and tokenizer, with STEP_MODEL as its step times."""
    path = default_model_path()
    tokenizer = load_tokenizer(str(path))
    return Profile(model_path=str(path), model_name=path.stem, tokenizer=tokenizer.to_dict(),
                   vocab_size=49152, hidden_size=576, max_model_len=8192, block_size=16,
                   kv_bytes_per_token=11520, kv_cache_dtype="int8", step_model=STEP_MODEL,
                   cold_start_s=2.0)


def plan_args(argv: list[str]) -> argparse.Namespace:
    """`ember plan`'s options, parsed by its own parser."""
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    add_plan_parser(sub, default_model_path().parent, lambda p: None, lambda a: None)
    return parser.parse_args(["plan", *argv])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rate", type=float, default=30.0)
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--num-requests", type=int, default=10_000)
    parser.add_argument("--policy", default="prefix")
    parser.add_argument("--profile", default=None, help="a measured profile (default: the "
                        "default model with a fixed step model)")
    parser.add_argument("--cprofile", action="store_true")
    parser.add_argument("--step-by-step", action="store_true", help="plan every step with the "
                        "scheduler (no decode-ahead shortcut): the reference's cost")
    args = parser.parse_args()
    profile = load_profile(args.profile) if args.profile else fixed_profile()
    options = plan_args(["--num-requests", str(args.num_requests), "--input-len", "fixed:256",
                         "--output-len", "fixed:64", "--rate", str(args.rate)])
    config = replica_config(profile, options)
    began = time.perf_counter()
    tokenizer = profile.load_tokenizer()
    requests = plan_requests(options, tokenizer, config.block_size)
    load = bench_load(options, len(requests), args.rate)
    token_ids = [i for i in range(tokenizer.vocab_size) if i not in config.eos_token_ids]
    built = time.perf_counter() - began
    sim = FleetSim(config, args.replicas, args.policy, token_ids,
                   decode_ahead=not args.step_by_step)
    profiler = cProfile.Profile() if args.cprofile else None
    wall, cpu = time.perf_counter(), time.process_time()
    if profiler:
        profiler.enable()
    records = sim.run(requests, load)
    if profiler:
        profiler.disable()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    stats = sim.stats()
    done = sum(1 for r in records if r.error is None)
    print(f"{len(requests)} requests at {args.rate:g} req/s over {args.replicas} replicas "
          f"({args.policy}): {done} completed, {sum(stats.num_steps)} steps "
          f"({sum(r.num_steps_ahead for r in sim.replicas)} decoded ahead), "
          f"{stats.duration_s:.0f} s simulated")
    print(f"workload built in {built:.1f} s; simulated in {wall:.2f} s ({cpu:.2f} s CPU)")
    with open("/proc/loadavg") as f:
        print(f"load average: {f.read().split()[0]}")
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()

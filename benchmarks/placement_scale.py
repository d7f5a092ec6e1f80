"""Time CP-SAT placement of N deployments on M planes (default 200 on 50), fresh and re-solved
after a plane fails; writes JSON. Not a test: `python benchmarks/placement_scale.py`."""
from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import replace

from ember.control.placement import Deployment, Plane, Problem, place, violations


def make_problem(num_deployments: int, num_planes: int, seed: int) -> Problem:
    rng = random.Random(seed)
    regions = ("eu", "us", "ap")
    planes = tuple(Plane(f"p{i}", regions[i % 3], rng.choice((16, 32, 64)),
                         rng.choice((32, 64, 128)) * 1024, rng.choice((0.4, 0.9, 1.5, 2.5)),
                         spot=rng.random() < 0.2) for i in range(num_planes))
    modes = [rng.choice(("active-active", "active-passive")) for _ in range(num_deployments)]
    deployments = tuple(Deployment(f"d{i}", f"m{i % 7}",
                                   rng.randint(2 if mode == "active-active" else 1, 3),
                                   rng.choice((1, 2)), rng.choice((1, 2, 4)) * 1024,
                                   tuple(rng.sample(regions, rng.randint(1, 3))), mode,
                                   rng.random() < 0.3) for i, mode in enumerate(modes))
    return Problem(planes, deployments)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--deployments", type=int, default=200)
    ap.add_argument("--planes", type=int, default=50)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time-limit", type=float, default=10.0, help="seconds per solve")
    ap.add_argument("--out", default="placement_scale.json")
    args = ap.parse_args()
    problem = make_problem(args.deployments, args.planes, args.seed)
    t0 = time.perf_counter()
    first = place(problem, args.time_limit, args.workers)
    fresh_s = time.perf_counter() - t0
    planes = (replace(problem.planes[0], up=False),) + problem.planes[1:]
    again = Problem(planes, problem.deployments, first.assignments)
    t0 = time.perf_counter()
    second = place(again, args.time_limit, args.workers)
    resolve_s = time.perf_counter() - t0
    result = {"deployments": args.deployments, "planes": args.planes, "workers": args.workers,
              "fresh_s": round(fresh_s, 3), "fresh_optimal": first.optimal,
              "fresh_gap": round(1 - first.bound / first.score, 4),
              "fresh_unplaced": len(first.unplaced),
              "resolve_s": round(resolve_s, 3), "resolve_optimal": second.optimal,
              "resolve_gap": round(1 - second.bound / max(second.score, 1), 4),
              "violations": len(violations(problem, first.assignments))
              + len(violations(again, second.assignments))}
    print(json.dumps(result))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

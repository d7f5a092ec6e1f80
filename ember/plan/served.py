"""What serving adds to a step: the profiled engine served briefly, its step intervals against
the in-process step model.

`ember plan profile` times the engine's steps in-process (measure.py). A served replica's
steps also pay for the server's own work: the inbox of new requests, the event loop's
wake-up for each step's outputs, each streamed token's SSE chunk (its JSON, the socket
write), and the GIL that work takes from the engine thread. Here the engine the profile just
measured is served by the real app (`serve`, from cli.py: `ember serve`'s app under uvicorn,
in this process, so on the same cores), and `ember bench serve`, in a process of its own as a
client would be, streams short runs at a few concurrencies through it. The engine thread's
runner notes when each step began, its shape, and how many tokens it streamed:

    step k begins ... schedule, forward, update, detokenize, outputs to the loop ... step k+1
    |<------------------------ interval of step k (start to start) ------------------>|

Step k+1 follows step k at once when some request is in both (the engine waits for new
requests only when it has none), so that interval is one served step. The overhead is fitted
against the step model's prediction for step k (stepmodel.fit_overhead): seconds per step
and per streamed token.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path

import httpx

from ember.engine.async_engine import AsyncEngine
from ember.engine.core import EngineCore
from ember.router.replicas import free_port
from ember.plan.stepmodel import ServingOverhead, StepModel, StepShape, fit_overhead, step_shape
from ember.scheduler.output import RunnerOutput, SchedulerOutput

CONCURRENCIES = (1, 2, 4, 8, 16)   # streamed requests at once, a run each
PROMPT_TOKENS, OUTPUT_TOKENS = 64, 32
WAVES = 3                          # requests per run: WAVES x its concurrency
INTERFERENCE = 1.5                 # as measure.py's: an interval this far over is disturbed

# serve(engine) -> a context that serves it and yields its URL (server/serve.py's
# serve_in_thread with a free port: the plan package does not import the server)
Serve = Callable[[AsyncEngine], AbstractContextManager[str]]


@dataclass(frozen=True)
class ServedStep:
    began: float                  # perf_counter when the runner got the step
    shape: StepShape
    num_tokens: int               # tokens it streams (requests that sample)
    request_ids: frozenset[str]


class StepClock:
    """Stands in for the runner while serving: notes each step, then hands it on."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.steps: list[ServedStep] = []

    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        if plan.scheduled:
            self.steps.append(ServedStep(
                time.perf_counter(), step_shape(plan),
                sum(1 for item in plan.scheduled if item.samples),
                frozenset(item.request.request_id for item in plan.scheduled)))
        return self.runner.execute(plan)


def step_intervals(steps: list[ServedStep]) -> list[tuple[int, float]]:
    """(index, interval) of each step the next one followed at once (they share a
    request)."""
    return [(k, b.began - a.began) for k, (a, b) in enumerate(zip(steps, steps[1:]))
            if a.request_ids & b.request_ids]


@dataclass(frozen=True)
class Run:
    """One served run: its concurrency, whether it went through a gateway, what the client
    reported, and its steps (indexes [first, end) of the clock's)."""

    concurrency: int
    through_gateway: bool
    summary: dict
    first: int
    end: int


def measure_served(core: EngineCore, model: StepModel, serve: Serve,
                   progress: Callable[[str], None] = lambda _: None,
                   through_gateway: bool = False
                   ) -> tuple[ServingOverhead, ServingOverhead]:
    """Serve `core` (loaded, its runner its own), stream the runs, fit the overhead; with
    `through_gateway`, each run is repeated through `ember route` (a process on the same
    cores) and what the gateway adds on top is fitted too (else it is zero). The core is
    closed afterwards (the server's engine stops it)."""
    clock = StepClock(core.runner)
    core.runner = clock
    engine = AsyncEngine(core.config, core_factory=lambda _: core)
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="ember-plan-served-") as tmp, \
            serve(engine) as url, \
            (gateway(url) if through_gateway else nullcontext(None)) as gateway_url:
        _wait_ready(url)
        targets = [(False, url)] + ([(True, gateway_url)] if gateway_url else [])
        for via, target in targets:   # (the first requests of each path are slower)
            _bench(target, core.model_path, 2, 2, 0, Path(tmp) / f"warm-up-{via}.json")
        for concurrency in CONCURRENCIES:
            for via, target in targets:
                first, seed = len(clock.steps), 1000 * via + concurrency   # (no prefix hits)
                summary = _bench(target, core.model_path, concurrency, WAVES * concurrency,
                                 seed, Path(tmp) / f"run-{seed}.json")
                runs.append(Run(concurrency, via, summary, first, len(clock.steps)))
                progress(f"served at concurrency {concurrency}"
                         f"{' through ember route' if via else ''}: "
                         f"{len(clock.steps) - first} steps")
    direct = _fit(clock.steps, [r for r in runs if not r.through_gateway], model)
    relayed = [r for r in runs if r.through_gateway]
    return direct, _fit(clock.steps, relayed, model, direct) if relayed else ServingOverhead()


def _fit(steps: list[ServedStep], runs: list[Run], model: StepModel,
         base: ServingOverhead | None = None) -> ServingOverhead:
    """The overhead over `model` (and `base`) that the runs' step intervals show."""
    timed = [(k, t) for k, t in step_intervals(steps)
             if any(r.first <= k < r.end for r in runs)]
    shapes = [steps[k].shape for k, _ in timed]
    tokens = [steps[k].num_tokens for k, _ in timed]
    overhead = fit_overhead(model, shapes, tokens, [t for _, t in timed],
                            interference=INTERFERENCE, base=base)
    base = base or ServingOverhead()
    records = [_run_record(r, [(steps[k], t) for k, t in timed if r.first <= k < r.end],
                           lambda step: model.predict(step.shape) + base.seconds(
                               step.num_tokens), overhead) for r in runs]
    return replace(overhead, runs=records)


def _run_record(run: Run, timed: list[tuple[ServedStep, float]],
                predict: Callable[[ServedStep], float], overhead: ServingOverhead
                ) -> dict[str, float]:
    """One run as the profile keeps it: what the client saw, the served steps' median, and
    the medians predicted for them without and with the overhead."""
    def median(values: list[float]) -> float:
        return statistics.median(values) if values else float("nan")
    gaps = run.summary.get("chunk_gap_s") or {}
    return {"concurrency": run.concurrency,
            "client_chunk_gap_p50_s": gaps.get("p50", float("nan")),
            "steps": len(timed),
            "served_step_p50_s": median([t for _, t in timed]),
            "without_p50_s": median([predict(s) for s, _ in timed]),
            "with_p50_s": median([predict(s) + overhead.seconds(s.num_tokens)
                                  for s, _ in timed])}


@contextmanager
def gateway(replica_url: str, timeout_s: float = 120.0) -> Iterator[str]:
    """`ember route` in front of the replica at `replica_url`, as a process of its own on
    this process's cores; yields its URL once it routes to the replica."""
    port = free_port()
    log = tempfile.TemporaryFile("w+")   # (a pipe nobody reads could fill and stall it)
    proc = subprocess.Popen([sys.executable, "-m", "ember.cli", "route", "--replica-url",
                             replica_url, "--port", str(port), "-q"],
                            stdout=subprocess.DEVNULL, stderr=log, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while not _routes(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                raise RuntimeError("ember route did not start (profile without it: leave "
                                   f"out --serve-gateway):\n{log.read()[-2000:]}")
            time.sleep(0.2)
        yield url
    finally:
        log.close()
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _routes(url: str) -> bool:
    try:
        fleet = httpx.get(url + "/fleet", timeout=5).json()
    except (httpx.HTTPError, ValueError):
        return False
    return any(r.get("state") == "ready" for r in fleet.get("replicas", []))


def _wait_ready(url: str, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health/ready", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"the served engine was not ready within {timeout_s:.0f} s; "
                       "`ember plan profile --no-serve` profiles without serving")


def _bench(url: str, model_path: Path, concurrency: int, num_requests: int, seed: int,
           out: Path) -> dict:
    """`ember bench serve` against `url`, in a process of its own that may use every core
    (a client is not the replica's work, even when the profile is held to some cores)."""
    command = [sys.executable, "-m", "ember.cli", "bench", "serve", "--base-url", url + "/v1",
               "--tokenizer", str(model_path), "--input-len", f"fixed:{PROMPT_TOKENS}",
               "--output-len", f"fixed:{OUTPUT_TOKENS}", "--concurrency", str(concurrency),
               "--num-requests", str(num_requests), "--seed", str(seed),
               "--out", str(out)]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    if hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(proc.pid, range(os.cpu_count() or 1))
        except OSError:   # (it may have ended already, or the cores may be fenced off)
            pass
    _, err = proc.communicate()
    if proc.returncode:
        raise RuntimeError(f"`{' '.join(command[2:])}` failed (`ember plan profile "
                           f"--no-serve` profiles without serving):\n{err[-2000:]}")
    return json.loads(out.read_text())

"""`ember plan profile`: time the engine's steps on this machine, as it serves, and fit.

The engine runs as `ember serve` runs it: the AsyncEngine thread behind the HTTP server, its
answers streamed. A load generator in a process of its own (mixes.py) sends request mixes
chosen to spread the step shapes the model needs. Each step is recorded with the shape the
scheduler planned and the time until the engine thread's next step began: the forward and
sampling, the detokenizing and streaming hand-off, and whatever the server's other threads
and the machine took from it meanwhile. (The last step before the engine idles counts its
own time.) So the step model prices a step as a served replica spends it.
"""
from __future__ import annotations

import os
import platform
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import httpx
import uvicorn

from ember.config import EngineConfig, ServerConfig
from ember.engine.async_engine import AsyncEngine
from ember.engine.cold_start import process_age_s
from ember.engine.core import EngineCore
from ember.plan.profile import Profile, step_record
from ember.plan.stepmodel import StepShape, fit, interfered, residuals, step_shape
from ember.scheduler.output import RunnerOutput, SchedulerOutput
from ember.server.app import create_app
from ember.weights.paths import served_model_name

INTERFERENCE = 1.5   # a step this much over the first fit had its cores taken: refit without


class _PlanTap:
    """Stands in for the runner while profiling: hands each plan on and keeps the last."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.plan: SchedulerOutput | None = None

    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        self.plan = plan
        return self.runner.execute(plan)


class StepRecorder:
    """Builds the engine core (AsyncEngine's core_factory, with `build`) and times its
    steps, start to start, while `recording`."""

    def __init__(self, build: Callable[[EngineConfig], EngineCore] = EngineCore) -> None:
        self._build = build
        self.recording = False
        self.shapes: list[StepShape] = []
        self.seconds: list[float] = []
        self.core: EngineCore | None = None
        self._open: tuple[StepShape, float] | None = None   # a step whose period runs on

    def build(self, config: EngineConfig) -> EngineCore:
        core = self._build(config)
        tap = _PlanTap(core.runner)
        core.runner = tap
        step = core.step

        def timed_step(only: frozenset[str] | None = None) -> list:
            began = time.perf_counter()
            if self._open is not None:
                self._add(self._open[0], began - self._open[1])
                self._open = None
            tap.plan = None
            advanced = step(only)
            if self.recording and tap.plan is not None and tap.plan.scheduled:
                shape = step_shape(tap.plan)
                if core.has_unfinished():
                    self._open = (shape, began)
                else:   # the engine idles now: the step's own time
                    self._add(shape, time.perf_counter() - began)
            return advanced
        core.step = timed_step
        self.core = core
        return core

    def _add(self, shape: StepShape, seconds: float) -> None:
        self.shapes.append(shape)
        self.seconds.append(seconds)


class _Server:
    """The app on uvicorn in a thread, on a free port of 127.0.0.1."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.server = uvicorn.Server(uvicorn.Config(create_app(engine, ServerConfig(port=0)),
                                                    host="127.0.0.1", port=0,
                                                    log_level="warning", access_log=False))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the profiling server did not start")
            time.sleep(0.05)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    def wait_ready(self, engine: AsyncEngine) -> None:
        while httpx.get(self.url + "/health/ready").status_code != 200:
            if engine.error is not None:
                raise RuntimeError(f"the engine failed to start: {engine.error}")
            time.sleep(0.1)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(60)


def _send_mixes(url: str, vocab: int, budget_s: float, warm_up: bool,
                progress: Callable[[str], None]) -> None:
    """The load generator, as its own process (mixes.py)."""
    argv = [sys.executable, "-m", "ember.plan.mixes", "--url", url, "--vocab", str(vocab),
            "--max-seconds", str(budget_s)] + (["--warm-up"] if warm_up else [])
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True) as proc:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            progress(line.rstrip())
        if proc.wait() != 0:
            raise RuntimeError("the profile's load generator failed:\n" + "".join(lines[-20:]))


def measure(config: EngineConfig, budget_s: float = 90.0,
            progress: Callable[[str], None] = lambda _: None) -> Profile:
    """Serve the engine, send the mixes (until `budget_s` have passed), fit."""
    load_before = os.getloadavg()[0]
    recorder = StepRecorder()
    engine = AsyncEngine(config, core_factory=recorder.build)
    server = _Server(engine)
    try:
        server.wait_ready(engine)
        cold_start_s = process_age_s() or 0.0
        core = recorder.core
        _send_mixes(server.url, core.tokenizer.vocab_size, budget_s, True, lambda _: None)
        recorder.recording = True
        _send_mixes(server.url, core.tokenizer.vocab_size, budget_s, False, progress)
        recorder.recording = False
    finally:
        server.close()
    return _profile(config, core, recorder, cold_start_s, load_before)


def _profile(config: EngineConfig, core: EngineCore, recorder: StepRecorder,
             cold_start_s: float, load_before: float) -> Profile:
    shapes, seconds = recorder.shapes, recorder.seconds
    model = fit(shapes, seconds, interference=INTERFERENCE)
    disturbed = [interfered(model, s, t, INTERFERENCE) for s, t in zip(shapes, seconds)]
    kept = [(s, t) for s, t, d in zip(shapes, seconds, disturbed) if not d]
    return Profile(
        model_path=str(core.model_path), model_name=served_model_name(config.model),
        tokenizer=core.tokenizer.to_dict(), vocab_size=core.model_config.vocab_size,
        hidden_size=core.model_config.hidden_size,
        max_model_len=core.model_config.context_limit() if config.max_model_len is None
        else config.max_model_len,
        block_size=core.cache_info.block_size,
        kv_bytes_per_token=core.cache_info.bytes_per_token, kv_cache_dtype=core.cache_info.dtype,
        step_model=model, cold_start_s=cold_start_s, scheduler=config.scheduler,
        kv_cache_gib=config.cache.kv_cache_gib,
        engine={"dtype": str(core.dtype).removeprefix("torch."),
                "quantization": core.quantization, "prefill_matmul": core.prefill_matmul,
                "kernels": "compiled CPU" if core.kernels is not None else "torch",
                "device": config.device, "load_phases": core.load_phases.seconds,
                "enable_prefix_caching": config.cache.enable_prefix_caching,
                "eviction_policy": config.cache.eviction_policy},
        machine=machine(load_before) | {"disturbed_steps": sum(disturbed)},
        residuals=residuals(model, [s for s, _ in kept], [t for _, t in kept]),
        steps=[step_record(s, t, model.predict(s)) | {"disturbed": d}
               for s, t, d in zip(shapes, seconds, disturbed)])


def machine(load_before: float) -> dict[str, object]:
    """Where the profile was measured, and how busy the machine was."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"cpu": cpu, "cpus": os.cpu_count(), "load_average_before": load_before,
            "load_average_after": os.getloadavg()[0], "measured": time.strftime("%Y-%m-%d")}

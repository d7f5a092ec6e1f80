"""`ember plan profile`: time the engine's own steps on this machine and fit the step model.

The engine runs a fixed series of request mixes chosen to spread the step shapes the model
needs (stepmodel.py): lone prompts of many lengths at contexts from 0 (a cached prefix gives
a prompt its context without computing it), chunked long prompts, several prompts in one
step, decode batches from 1 to 64 at short and long contexts, and decodes beside a prompt
chunk. Each step is timed as the serving engine's thread spends it: schedule, forward and
sample, update, then the detokenizing of its new tokens. Steps are recorded with the shape
the scheduler planned, so the fit learns from exactly what the scheduler asks of the runner.
Then, given a way to serve it, the same engine is served briefly and what the server adds to
a step is fitted (served.py).
"""
from __future__ import annotations

import itertools
import os
import platform
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from ember.config import EngineConfig
from ember.engine.cold_start import process_age_s
from ember.engine.core import EngineCore
from ember.engine.output import SequenceText
from ember.plan.profile import Profile, step_record
from ember.plan.served import Serve, measure_served
from ember.plan.stepmodel import StepShape, fit, interfered, residuals, step_shape
from ember.request import SamplingParams
from ember.scheduler.output import RunnerOutput, SchedulerOutput
from ember.weights.paths import served_model_name

INTERFERENCE = 1.5   # a step this much over the first fit had its cores taken: refit without


class _PlanTap:
    """Stands in for the runner during profiling: hands each plan on and keeps the last."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.plan: SchedulerOutput | None = None

    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        self.plan = plan
        return self.runner.execute(plan)


@dataclass(frozen=True)
class Mix:
    """Requests added together (and `late` ones added after `late_after` steps)."""

    name: str
    prompt_lens: tuple[int, ...]
    max_tokens: int
    cached_prefix: int = 0           # tokens every prompt shares, cached before the mix runs
    late_prompt_lens: tuple[int, ...] = ()
    late_after: int = 0


def mixes() -> list[Mix]:
    """The series, most informative first (a time budget may cut its tail)."""
    out = [Mix(f"decode b{b} c64", (64,) * b, 12) for b in (1, 4, 8, 16, 32)]
    out += [Mix(f"prompt n{n} c{c}", (c + n,), 1, cached_prefix=c)
            for c in (0, 512, 1536) for n in (16, 64, 128, 256, 512)]
    out += [Mix(f"decode b{b} c512", (512,) * b, 12) for b in (1, 8, 24)]
    out += [Mix(f"mixed b{b}", (128,) * b, 24, late_prompt_lens=(700,), late_after=3)
            for b in (1, 4, 16)]
    out += [Mix("prompts 4x96", (96,) * 4, 1), Mix("prompt 1500", (1500,), 1)]
    out += [Mix(f"decode b{b} c256", (256,) * b, 12) for b in (2, 12, 48, 64)]
    out += [Mix(f"decode b{b} c1024", (1024,) * b, 12) for b in (4, 16)]
    return out


class Profiler:
    """Runs mixes through one engine and keeps every step's shape and seconds."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.tap = _PlanTap(core.runner)
        core.runner = self.tap
        self.shapes: list[StepShape] = []
        self.seconds: list[float] = []
        self._ids = itertools.count()
        self._rng = random.Random(0)   # prompts of random ids: no accidental cache hits
        self._texts: dict[str, SequenceText] = {}

    def run(self, mix: Mix, record: bool = True) -> None:
        prefix = self._tokens(mix.cached_prefix)
        if prefix:   # one request computes the prefix's blocks; the mix then finds them
            self._add(prefix + self._tokens(1), 1)
            self._drain(record=False)
        for n in mix.prompt_lens:
            self._add(prefix + self._tokens(n - len(prefix)), mix.max_tokens)
        for k in itertools.count():
            if k == mix.late_after:
                for n in mix.late_prompt_lens:
                    self._add(self._tokens(n), 1)
            if not self.core.has_unfinished():
                break
            self._step(record)

    def _tokens(self, n: int) -> list[int]:
        vocab = self.core.tokenizer.vocab_size
        return [self._rng.randrange(1000, vocab) for _ in range(n)]

    def _add(self, prompt_ids: list[int], max_tokens: int) -> None:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        request = self.core.add_request(f"p{next(self._ids)}", prompt_ids, params)
        self._texts[request.request_id] = SequenceText(self.core.tokenizer, request, 0)

    def _drain(self, record: bool) -> None:
        while self.core.has_unfinished():
            self._step(record)

    def _step(self, record: bool) -> None:
        """One engine step and its detokenizing, timed as the serving thread spends it."""
        start = time.perf_counter()
        for request in self.core.step():
            text = self._texts[request.request_id]
            text.update()
            text.take_delta()
            if request.is_finished:
                del self._texts[request.request_id]
        seconds = time.perf_counter() - start
        if record and self.tap.plan is not None and self.tap.plan.scheduled:
            self.shapes.append(step_shape(self.tap.plan))
            self.seconds.append(seconds)


def measure(config: EngineConfig, budget_s: float = 120.0,
            progress: Callable[[str], None] = lambda _: None, serve: Serve | None = None,
            through_gateway: bool = False) -> Profile:
    """Load the engine, run the mixes (until `budget_s` of measuring has passed), fit;
    with `serve`, serve the engine briefly and fit the serving overhead (else it is zero),
    and with `through_gateway` what `ember route` adds too (served.py)."""
    load_before = os.getloadavg()[0]
    core = EngineCore(config)
    profiler = Profiler(core)
    profiler.run(Mix("warm-up", (64, 600), 4), record=False)
    cold_start_s = process_age_s() or sum(core.load_phases.seconds.values())
    began = time.monotonic()
    for mix in mixes():
        if time.monotonic() - began > budget_s:
            progress(f"time budget spent; skipped {mix.name} and the mixes after it")
            break
        profiler.run(mix)
        progress(f"{mix.name}: {len(profiler.seconds)} steps so far")
    model = fit(profiler.shapes, profiler.seconds, interference=INTERFERENCE)
    disturbed = [interfered(model, s, t, INTERFERENCE)
                 for s, t in zip(profiler.shapes, profiler.seconds)]
    kept = [(s, t) for (s, t, d) in zip(profiler.shapes, profiler.seconds, disturbed) if not d]
    profile = Profile(
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
               for s, t, d in zip(profiler.shapes, profiler.seconds, disturbed)])
    if serve is None:
        return profile
    core.runner = profiler.tap.runner
    serving, gateway = measure_served(core, model, serve, progress, through_gateway)
    return replace(profile, serving=serving, gateway=gateway)


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


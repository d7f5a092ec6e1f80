"""Two builds of the kernels' sources in one process, call against call.

    .venv/bin/python benchmarks/kernel_ab.py --old-source OLD [--new-source NEW]
        [--rows 32] [--prompt-tokens 250 350] [--steps 120] [--out FILE]

A source is a folder of the kernels' files (ember/kernels/cpu: its .cpp files and headers)
or one .cpp file (ember/kernels/cpu_ops.cpp, where a commit has the kernels in one file):
`git archive HEAD~1 ember/kernels | tar -x -C OLD` gives the previous commit's under
OLD/ember/kernels (its cpu/ folder, or its cpu_ops.cpp). This machine's speed drifts by
10-30% from hour to hour, so two processes run one after the other compare the hours as much
as the code. Here both sources are built as extensions of their own, one engine on the
default model serves both, and each decode step alternates between the two
builds' decode stacks (the order flips every step), `--rows` requests of U(LO, HI)-token
prompts decoding. Reported per build: the decode stack's time per step and the output
projection's (int8_linear_a8 on the model's head as the engine runs it, on the quads,
`--rows` rows, right after each step), with the median and
quartiles of the paired ratios new / old, and per round the threads' hand-off (a cache
line's round trip between the two vCPUs, which the VM moves: at ~60-140 ns and at ~300 ns
the weights stream at different rates and patterns) with that round's ratios. The engine's
other kernels come from NEW (the installed source by default).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from types import ModuleType

import torch

from ember.bench.workloads import default_corpus
from ember.config import EngineConfig
from ember.engine.core import EngineCore
from ember.engine.roofline import hand_off_probe
from ember.kernels import SOURCE, CpuKernels, build_cpu_ops, kernel_sources
from ember.models.llama import _build_decode_stack
from ember.request import RequestOptions, SamplingParams

GLOBAL_CLASS = 'py::class_<DecodeStack>(m, "DecodeStack")'


def read_source(source: Path) -> dict[str, str]:
    """The files of `source` (a folder: its .cpp files and headers; or one .cpp file), name ->
    text."""
    paths = sorted(source.glob("*.h")) + kernel_sources(source) if source.is_dir() else [source]
    return {path.name: path.read_text() for path in paths}


def write_source(files: dict[str, str], dest: Path) -> Path:
    """`files` (as read_source gives them) written into the new folder `dest`; -> what to build:
    the folder, or its one file."""
    dest.mkdir(parents=True)
    for name, text in files.items():
        (dest / name).write_text(text)
    return dest / next(iter(files)) if len(files) == 1 else dest


def build(name: str, source: Path, folder: Path) -> ModuleType:
    """`source` built as extension `name`. Sources older than the change that made the
    DecodeStack class module-local are copied into `folder` with it made so: two builds
    registering the class globally cannot share a process."""
    files = read_source(source)
    if any(GLOBAL_CLASS in text for text in files.values()):
        local = GLOBAL_CLASS[:-1] + ", py::module_local())"
        source = write_source({file: text.replace(GLOBAL_CLASS, local)
                               for file, text in files.items()}, folder / name)
    return build_cpu_ops(source=source, name=name)


class TimedStack:
    """A decode stack whose forward times itself into `times` while `on[0]`."""

    def __init__(self, stack, times: list[float], on: list[bool]) -> None:
        self.stack, self.times, self.on = stack, times, on

    def forward(self, *args):
        start = time.perf_counter()
        out = self.stack.forward(*args)
        if self.on[0]:
            self.times.append(time.perf_counter() - start)
        return out

    def __getattr__(self, name: str):
        return getattr(self.stack, name)   # forward_mixed (prompt steps): untimed


def summary(old: list[float], new: list[float]) -> dict:
    ratios = sorted(b / a for a, b in zip(old, new))
    quartile = lambda f: ratios[round(f * (len(ratios) - 1))]  # noqa: E731
    return {"old_ms_median": statistics.median(old) * 1e3,
            "new_ms_median": statistics.median(new) * 1e3,
            "old_ms_mean": statistics.mean(old) * 1e3, "new_ms_mean": statistics.mean(new) * 1e3,
            "new_over_old_p25": quartile(0.25), "new_over_old_p50": quartile(0.5),
            "new_over_old_p75": quartile(0.75), "pairs": len(ratios)}


def decode_stack_of(model, ops: ModuleType):
    """The model's decode stack on build `ops` (set as the model's, its int8 path ready)."""
    model.decode_stack = _build_decode_stack(model, CpuKernels(ops))
    if model.decode_stack is None:
        raise SystemExit("no decode stack here (it needs AVX-512 BF16 and int4 weights)")
    model.use_int8_decode()
    return model.decode_stack


def report(result: dict, out: Path | None) -> None:
    """Print a benchmark's result as JSON, and write it to `out` too (if given)."""
    print(json.dumps(result, indent=1))
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old-source", type=Path, required=True)
    ap.add_argument("--new-source", type=Path, default=SOURCE)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, nargs=2, default=(250, 350),
                    metavar=("LO", "HI"), help="each request's prompt: U(LO, HI) tokens")
    ap.add_argument("--steps", type=int, default=120, help="pairs of steps per round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        builds = {"old": build("ember_ab_old", args.old_source, Path(folder)),
                  "new": build("ember_ab_new", args.new_source, Path(folder))}
    core = EngineCore(EngineConfig.from_options())
    model = core.runner.model
    times: dict[str, list[float]] = {"old": [], "new": []}
    head_times: dict[str, list[float]] = {"old": [], "new": []}
    on = [False]
    stacks = {}
    for name, ops in builds.items():
        stacks[name] = TimedStack(decode_stack_of(model, ops), times[name], on)
    head = model.lm_head
    x = torch.randn(args.rows, head.in_features, dtype=torch.bfloat16)
    ids = core.tokenizer.encode(default_corpus())
    rng = random.Random(0)
    hand_off = hand_off_probe(CpuKernels(builds["new"]))
    per_round = []
    for round_ in range(args.rounds):
        requests = []
        for i in range(args.rows):
            n = rng.randint(*args.prompt_tokens)
            start = rng.randrange(0, len(ids) - n)
            requests.append(core.add_request(
                f"r{round_}-{i}", ids[start:start + n],
                SamplingParams(temperature=0, max_tokens=2 * args.steps + 20, ignore_eos=True),
                RequestOptions(prefix_cache=False)))
        while not all(r.output_token_ids for r in requests):
            core.step()
        on[0] = True
        first = len(times["old"])
        placement = hand_off()
        for step in range(args.steps):
            for name in ("old", "new") if step % 2 == 0 else ("new", "old"):
                model.decode_stack = stacks[name]
                core.step()
                if head.act_group is not None:
                    start = time.perf_counter()
                    builds[name].int8_linear_a8(x, head.quads, head.scales, head.act_group)
                    head_times[name].append(time.perf_counter() - start)
        on[0] = False
        per_round.append({"round_trip_ns": [placement["round_trip_ns"],
                                            hand_off()["round_trip_ns"]],
                          "decode_stack": summary(times["old"][first:], times["new"][first:])})
        while core.has_unfinished():
            core.step()
    result = {"rows": args.rows, "prompt_tokens": list(args.prompt_tokens),
              "old_source": str(args.old_source), "new_source": str(args.new_source),
              "decode_stack": summary(times["old"], times["new"]), "rounds": per_round}
    if head_times["old"]:
        result["output_projection"] = summary(head_times["old"], head_times["new"])
    report(result, args.out)


if __name__ == "__main__":
    main()

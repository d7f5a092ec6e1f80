"""Where a decode stack step goes, op by op: timers built into a copy of the kernels' source.

    .venv/bin/python benchmarks/stack_phases.py [--old-source OLD] [--new-source NEW]
        [--rows 1] [--prompt-tokens 300] [--steps 200] [--out FILE]

The source (the installed one by default; a folder like ember/kernels/cpu or one .cpp file,
as kernel_ab.py takes them) is copied with a steady_clock tick after each op of
DecodeStack's layer loop (the input norm, the qkv matmul, RoPE and the cache write,
attention, o, the post-attention norm, gate_up, SwiGLU's activation, down) and built as an
extension of its own; the engine's decode stack is swapped for it. Where the source runs a
step of decodes in one parallel region (run_decodes), thread 0 ticks there, and an op's time
runs to the barrier after it. `--rows` requests of
`--prompt-tokens` tokens decode `--steps` steps; per op, the median over steps of its time
summed over the layers, and the whole engine step's. With `--old-source`, a second build
takes every other step (the order flips each step) and each op's paired ratio new / old is
reported too, as `kernel_ab.py` does for the stack as a whole. With `--cache-fed`, NEW's
stack runs every layer on layer 0's weights (2.2 MB on the default model: they stay in
cache), the same ops on the same caches otherwise: what a step would cost if the weights
came for free (pair it with `--old-source` naming the same source). The threads' round trip
(`ember roofline`'s hand-off probe) is recorded before and after the steps: ~100 ns where the
two vCPUs sit close, ~300 ns where they sit far apart, and the figures differ between the two.
The ~300 ticks a step cost a few microseconds. If the layer loop's code changes, the tick
points below stop matching and the script says which.
"""
from __future__ import annotations

import argparse
import random
import re
import statistics
import tempfile
import time
from pathlib import Path
from types import ModuleType

from kernel_ab import build, decode_stack_of, read_source, report, write_source

from ember.bench.workloads import default_corpus
from ember.config import EngineConfig
from ember.engine.core import EngineCore
from ember.engine.roofline import hand_off_probe
from ember.kernels import SOURCE, CpuKernels
from ember.models.llama import decode_stack_weights
from ember.request import RequestOptions, SamplingParams

OPS = ["norm", "qkv", "rope_write", "attention", "o", "post_norm", "gate_up", "silu",
       "down"]
HEADER = """#include <chrono>
inline double g_phase_ns[16];
#define TICK(i) { auto now_ = std::chrono::steady_clock::now(); \\
  g_phase_ns[i] += std::chrono::duration<double, std::nano>(now_ - last_).count(); last_ = now_; }
"""
# Code in DecodeStack::run's layer loop, "@@" where a line goes in, and that line (at the
# indentation of the class-body layout; a source that defines the methods outside the class
# has them 2 columns to the left, and the line moves with them). TICK(i) ends op i.
START = "auto last_ = std::chrono::steady_clock::now();"
TICKS = [
    (("                  layers_[0].in_norm.data_ptr<at::BFloat16>(), hp, t, hidden_, eps_);\n"
     "@@\n    for (size_t l = 0; l < layers_.size(); ++l) {\n"), "    " + START),
    (("      if (l > 0) rms_norm_rows(op, r, layer.in_norm.data_ptr<at::BFloat16>(), hp, t, "
     "hidden_, eps_);\n@@\n"), "      TICK(0);"),
    ("        linear(layer.qkv, h, qkv, &layer.o);\n      }\n@@\n", "      TICK(1);"),
    ("                        kv_heads_, d_, blocks * block_size);\n      }\n@@\n",
     "      TICK(2);"),
    (("      attend(plan, q, qkv, k_out, own_kv, cache, kv_scale, att, a8 ? nullptr : "
     "&fetch_o);\n@@\n"), "      TICK(3);"),
    ("      linear(layer.o, att.view({t, heads_ * d_}), out, &layer.gate_up);\n@@\n",
     "      TICK(4);"),
    (("      rms_norm_rows(op, r, layer.post_norm.data_ptr<at::BFloat16>(), hp, t, hidden_, "
     "eps_);\n@@\n      linear(layer.gate_up, h, gate_up, &layer.down);\n"), "      TICK(5);"),
    ("      linear(layer.gate_up, h, gate_up, &layer.down);\n@@\n", "      TICK(6);"),
    (("      silu_and_mul_impl(gate_up.data_ptr<at::BFloat16>(), act.data_ptr<at::BFloat16>(), "
     "t, inter);\n@@\n"), "      TICK(7);"),
    (("      linear(layer.down, act, out, l + 1 < layers_.size() ? &layers_[l + 1].qkv : "
     "nullptr);\n@@\n"), "      TICK(8);"),
]
# The same for run_decodes (a step of up to 8 decodes in one parallel region, in sources
# that have it): thread 0 ticks, each op ending where the barrier after it lets thread 0 on.
# There RoPE and the cache write run inside attention's tasks: "attention" holds them, and
# "rope_write" stays 0.
REGION_TICKS = [
    (("                    hidden_, eps_);\n@@\n      for (size_t l = 0; l < layers_.size(); "
     "++l) {\n"), "      " + START),
] + [(code + "@@\n", f"        if (tid == 0) TICK({i});") for code, i in [
    (("        if (l > 0) rms_norm_rows(op, r, layer.in_norm.data_ptr<BF>(), hp, t, hidden_, "
     "eps_);\n"), 0),
    ("        linear(layer.qkv, hp, hidden_, qkv.data_ptr<BF>(), &layer.o);\n", 1),
    ("                       scale_, &fetch_o, &rope_write);\n#pragma omp barrier\n", 3),
    ("        linear(layer.o, att.data_ptr<BF>(), row, op, &layer.gate_up);\n", 4),
    ("        rms_norm_rows(op, r, layer.post_norm.data_ptr<BF>(), hp, t, hidden_, eps_);\n", 5),
    ("        linear(layer.gate_up, hp, hidden_, gp, &layer.down);\n", 6),
    ("        silu_and_mul_impl(static_cast<const BF*>(gp), ap, t, inter);\n", 7),
    (("        linear(layer.down, ap, inter, op, l + 1 < layers_.size() ? &layers_[l + 1].qkv : "
     "nullptr);\n"), 8),
]]
MODULE = "PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {\n@@\n"
EXPORT = ('  m.def("phases", [] { std::vector<double> v(g_phase_ns, g_phase_ns + 16); '
          "std::fill(g_phase_ns, g_phase_ns + 16, 0.0); return v; });")


def code_pattern(code: str) -> re.Pattern:
    """`code` ("@@" marking a point) as a pattern that lets each line's indentation differ;
    group 1 is the first line's indentation, group "at" the point."""
    lines = []
    for i, line in enumerate(code.splitlines()):
        if line == "@@":
            lines.append("(?P<at>)")
            continue
        space = "([ \\t]*)" if i == 0 else "[ \\t]*"
        lines.append("^" + space + re.escape(line.lstrip(" ")) + "\\n")
    return re.compile("".join(lines), re.MULTILINE)


def with_ticks(files: dict[str, str]) -> dict[str, str]:
    """The kernels' files (name -> text, as kernel_ab.read_source gives them) with the
    timers; SystemExit naming the code it no longer finds."""
    files = dict(files)
    ticked = set()

    def once(code: str, line: str) -> None:
        hits = [(name, hit) for name, text in files.items()
                for hit in code_pattern(code).finditer(text)]
        if len(hits) != 1:
            raise SystemExit(f"stack_phases.py: this code is not in the source once: {code!r}")
        name, hit = hits[0]
        shift = len(hit.group(1)) - (len(code) - len(code.lstrip(" ")))
        indent = len(line) - len(line.lstrip(" ")) + shift
        text = files[name]
        files[name] = (text[:hit.start("at")] + " " * indent + line.lstrip(" ") + "\n" +
                       text[hit.start("at"):])
        ticked.add(name)

    for code, line in TICKS:
        once(code, line)
    if any("run_decodes(" in text for text in files.values()):
        for code, line in REGION_TICKS:
            once(code, line)
    once(MODULE, EXPORT)
    return {name: HEADER + text if name in ticked else text for name, text in files.items()}


def cache_fed_stack(model, ops: ModuleType):
    """A decode stack on build `ops` whose every layer has layer 0's weights."""
    config = model.config
    weights = decode_stack_weights(model.model.layers[0])
    return CpuKernels(ops).decode_stack(weights * config.num_layers, model.model.norm.weight,
                                        config.num_heads, config.num_kv_heads, config.head_dim,
                                        config.rms_norm_eps, config.head_dim ** -0.5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old-source", type=Path)
    ap.add_argument("--new-source", type=Path, default=SOURCE)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--prompt-tokens", type=int, default=300)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--cache-fed", action="store_true",
                    help="NEW's stack on layer 0's weights in every layer")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if not 1 <= args.rows <= 8:
        raise SystemExit("--rows must be 1-8: above 8 rows the stack runs its int8 path, whose "
                         "ops after attention the ticks do not mark")
    sources = {"new": args.new_source} | ({"old": args.old_source} if args.old_source else {})
    with tempfile.TemporaryDirectory() as folder:
        builds = {}
        for name, source in sources.items():
            timed = write_source(with_ticks(read_source(source)), Path(folder) / name)
            builds[name] = build(f"ember_phases_{name}", timed, Path(folder))
    core = EngineCore(EngineConfig.from_options())
    model = core.runner.model
    stacks = {name: decode_stack_of(model, ops) for name, ops in builds.items()}
    if args.cache_fed:
        stacks["new"] = cache_fed_stack(model, builds["new"])
    ids = core.tokenizer.encode(default_corpus())
    rng = random.Random(0)
    requests = []
    for i in range(args.rows):
        start = rng.randrange(0, len(ids) - args.prompt_tokens)
        requests.append(core.add_request(
            f"r{i}", ids[start:start + args.prompt_tokens],
            SamplingParams(temperature=0, max_tokens=len(builds) * args.steps + 20,
                           ignore_eos=True), RequestOptions(prefix_cache=False)))
    while not all(r.output_token_ids for r in requests):
        core.step()
    for ops in builds.values():
        ops.phases()   # the prompt steps' ticks cleared
    phases: dict[str, list[list[float]]] = {name: [] for name in builds}
    steps: dict[str, list[float]] = {name: [] for name in builds}
    hand_off = hand_off_probe(CpuKernels(builds["new"]))
    round_trips = [hand_off()["round_trip_ns"]]   # the threads' placement, before and after
    for step in range(args.steps):
        for name in sorted(builds, reverse=step % 2 == 1):
            model.decode_stack = stacks[name]
            start = time.perf_counter()
            core.step()
            steps[name].append(time.perf_counter() - start)
            phases[name].append(builds[name].phases()[:len(OPS)])
    round_trips.append(hand_off()["round_trip_ns"])
    result = {"rows": args.rows, "prompt_tokens": args.prompt_tokens, "steps": args.steps,
              "sources": {name: str(path) for name, path in sources.items()},
              "cache_fed": args.cache_fed, "round_trip_ns": round_trips}
    for name in builds:
        result[name] = {"step_us": statistics.median(steps[name]) * 1e6,
                        "op_us": {op: statistics.median(p[i] for p in phases[name]) / 1e3
                                  for i, op in enumerate(OPS)}}
    if "old" in builds:
        result["new_over_old"] = {
            op: statistics.median(n[i] / o[i] for n, o in zip(phases["new"], phases["old"]))
            for i, op in enumerate(OPS)
            if all(o[i] > 0 and n[i] > 0 for n, o in zip(phases["new"], phases["old"]))}
    report(result, args.out)


if __name__ == "__main__":
    main()

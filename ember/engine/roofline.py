"""`ember roofline`: this machine's limits, the loaded model's cost per token, and how close
ember runs to them.

Machine (measured here, with torch's threads):
  bandwidth   reading a buffer over and over (a sum): once as big as DRAM-only data
              (1 GiB) and once as big as the model's decode weights (which may stay in
              cache: the report says whether they fit the L3 the OS reports); each buffer in
              huge pages where the OS gives them, as the weights are
  matmul      peak GFLOP/s of a 1024^3 matmul in float32 and in bfloat16, and GOP/s in int8
              (torch._int_mm: oneDNN's int8 GEMM); on a CPU with AMX the bfloat16 and int8
              peaks again with oneDNN held to AVX-512 (ONEDNN_MAX_CPU_ISA, in a child
              process: oneDNN reads it once, at its first use), which is what the prompt
              path reaches where it does not use the tile unit
  hand-off    with the compiled kernels: a cache line's round trip between two threads and
              an empty parallel region (CpuKernels.thread_sync_ns). Not a limit, but a
              batch-1 decode step opens ~150 parallel regions, and on a VM both figures
              change when the vCPUs move (a 57-64 ns round trip in one stretch, 306-318 in
              another): the report says which machine it measured

Model, per token (weights as a step reads them: the packed ones where the model is quantized
and the batch is small, or at any batch where the decode stack runs, else the dense ones):
  bytes       weight bytes / batch + KV bytes of the token's context
  FLOPs       2 x parameters used (the embedding is a lookup) + attention 4 x context x q_size
              per layer

Limits: a step of B tokens takes at least max(bytes / bandwidth, FLOPs / peak); decode tok/s
limit = B / that. Prefill uses the dense weights' compute peak (int8's for the linears whose
prompt matmuls run on int8 activations, bfloat16's or float32's for the rest), and on a CPU
with AMX also the AVX-512 peaks: how close prompt steps run to each. ember's own
figures come from running the engine (decode at batch 1 and at --batch, one 1024-token
prefill), and each is reported as a percentage of its limit. The read bandwidths and the
decode runs alternate over three rounds and each figure is its best: the machine's speed
drifts, and a bandwidth and the decode it bounds are then taken from the same stretch of
time (best_of_rounds). The weights-fit-in-cache bandwidth gives the tighter (higher) limit;
both are reported. Batch 1 is then measured paired as well (paired_rounds): five more decode
runs, each between two reads of each buffer, each against the limit of its own moment; the
median and range of the five percentages are reported beside the best-of figures, and
each round's hand-off figures with them.
"""
from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ember.engine.memory import huge_page_zeros
from ember.kernels import cpu_flags, has_amx
from ember.engine.matmul_timing import Timing
from ember.engine.prefill_choice import PrefillChoice
from ember.models.moe import SparseMoE
from ember.quant.packed import PACKED_MAX_ROWS, KernelInt8Linear, PackedLinear
from ember.request import RequestOptions, SamplingParams

GIB = 1 << 30


@dataclass(frozen=True)
class Machine:
    threads: int
    dram_gb_s: float          # reading 1 GiB, repeatedly
    cached_gb_s: float        # reading a buffer the size of the decode weights
    cached_bytes: int
    fp32_gflops: float
    bf16_gflops: float
    l3_bytes: int | None = None  # the last-level cache the OS reports (None: unknown)
    int8_gops: float = 0.0       # torch._int_mm (0: not measured, no int8 prefill here)
    round_trip_ns: float | None = None       # hand-off (None: not measured: no kernels;
    parallel_region_ns: float | None = None  # the round trip also with one thread)
    amx: bool = False            # the CPU has AMX: the peaks above use its tile unit
    bf16_gflops_avx512: float | None = None  # with oneDNN held to AVX-512 (None: no AMX,
    int8_gops_avx512: float | None = None    # the peaks above are AVX-512's already)


def l3_cache_bytes() -> int | None:
    """The largest CPU cache the OS reports (Linux sysfs), in bytes; None elsewhere."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    sizes = []
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = path.read_text().strip()
        try:
            sizes.append(int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
        except (ValueError, IndexError):
            continue
    return max(sizes) if sizes else None


def _best_time(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def bandwidth_probe(num_bytes: int, repeats: int = 5) -> Callable[[], float]:
    """A function that measures GB/s of summing a float32 buffer of `num_bytes` (reading it
    once per pass, best of `repeats`); the buffer is made once. Random values: pages of one
    repeated value may be merged by the host and read from cache. In huge pages where the OS
    gives them, as ember's weights are (move_to_huge_pages): in 4 KiB pages the same reads miss
    the TLB and measured up to ~13% slower, which flattered every
    percentage of the limit."""
    buf = huge_page_zeros((max(num_bytes // 4, 1024),), torch.float32, "cpu").uniform_()
    passes = max(1, (1 << 30) // num_bytes)

    def read() -> float:
        seconds = _best_time(lambda: [buf.sum() for _ in range(passes)], repeats)
        return buf.numel() * 4 * passes / seconds / 1e9
    return read


def matmul_gflops(dtype: torch.dtype, n: int = 1024, repeats: int = 5) -> float:
    if dtype == torch.int8:  # int8 x int8 -> int32, as int8 prefill matmuls run
        a = torch.randint(-127, 128, (n, n), dtype=torch.int8)
        b = torch.randint(-127, 128, (n, n), dtype=torch.int8)
        return 2 * n ** 3 / _best_time(lambda: torch._int_mm(a, b), repeats) / 1e9
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    return 2 * n ** 3 / _best_time(lambda: a @ b, repeats) / 1e9


AVX512_ISA = "AVX512_CORE_BF16"   # oneDNN's ISA cap: AVX-512 with BF16 and VNNI, no AMX


def peaks_held_to(isa: str, threads: int) -> tuple[float, float]:
    """(bfloat16 GFLOP/s, int8 GOP/s) of matmul_gflops with oneDNN held to `isa`, measured in
    a child process on `threads` threads: oneDNN reads ONEDNN_MAX_CPU_ISA once, at its first
    use, so it is set there before torch is imported."""
    code = ("import os, json\n"
            f"os.environ['ONEDNN_MAX_CPU_ISA'] = os.environ['DNNL_MAX_CPU_ISA'] = {isa!r}\n"
            "import torch\n"
            "from ember.engine.roofline import matmul_gflops\n"
            f"torch.set_num_threads({threads})\n"
            "print(json.dumps([matmul_gflops(torch.bfloat16), matmul_gflops(torch.int8)]))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, timeout=600)
    bf16, int8 = json.loads(done.stdout.strip().splitlines()[-1])
    return bf16, int8


def measure_machine(weight_bytes: int, int8: bool, dram_gb_s: float, cached_gb_s: float,
                    hand_off: Callable[[], dict[str, float | None]] | None = None,
                    amx: bool | None = None,
                    held_peaks: Callable[[str, int], tuple[float, float]] = peaks_held_to
                    ) -> Machine:
    """The matmul peaks (and with `hand_off`, hand_off_probe's figures) measured here, beside
    the two read bandwidths (measured alongside ember's decode by roofline_report); where the
    CPU has AMX (`amx`; None: its flags say), the bfloat16 and int8 peaks also without it
    (`held_peaks`)."""
    amx = has_amx(cpu_flags()) if amx is None else amx
    threads = torch.get_num_threads()
    bf16_avx512, int8_avx512 = held_peaks(AVX512_ISA, threads) if amx else (None, None)
    return Machine(threads=threads, dram_gb_s=dram_gb_s,
                   cached_gb_s=cached_gb_s, cached_bytes=weight_bytes,
                   fp32_gflops=matmul_gflops(torch.float32),
                   bf16_gflops=matmul_gflops(torch.bfloat16), l3_bytes=l3_cache_bytes(),
                   int8_gops=matmul_gflops(torch.int8) if int8 or amx else 0.0,
                   **(hand_off() if hand_off is not None else {}), amx=amx,
                   bf16_gflops_avx512=bf16_avx512, int8_gops_avx512=int8_avx512)


def hand_off_probe(kernels) -> Callable[[], dict[str, float | None]] | None:
    """A function measuring the threads' hand-off (Machine's round_trip_ns and
    parallel_region_ns) on the compiled kernels; None without them."""
    if kernels is None:
        return None

    def probe() -> dict[str, float | None]:
        round_trip, region = kernels.thread_sync_ns()
        return {"round_trip_ns": None if math.isnan(round_trip) else round_trip,
                "parallel_region_ns": region}
    return probe


def best_of_rounds(probes: dict[str, Callable[[], float]], rounds: int) -> dict[str, float]:
    """Each probe's best over `rounds` rounds that run every probe in turn. This machine's
    speed drifts 10-20% (at times more) over seconds to minutes: a bandwidth and the decode it
    bounds, each the best of runs taken in the same stretch of time, compare like with like
    (one measured in a fast moment and the other in a slow one would not)."""
    best = dict.fromkeys(probes, 0.0)
    for _ in range(rounds):
        for name, probe in probes.items():
            best[name] = max(best[name], probe())
    return best


def paired_rounds(reads: dict[str, Callable[[], float]], decode: Callable[[], float],
                  rounds: int,
                  after_decode: Callable[[], dict[str, float | None]] | None = None
                  ) -> list[dict[str, float | None]]:
    """`rounds` times: each read, decode, each read again in reverse order; per round each
    read's mean beside the decode's figure (key "decode"), and with `after_decode` its
    figures, taken between the decode and the second reads (hand_off_probe's: which machine
    the round ran on). best_of_rounds compares maxima, which may come from different moments
    (a read takes ~0.1 s, a decode run ~0.5); a ratio taken round by round compares what the
    machine gave both at the same time."""
    pairs = []
    for _ in range(rounds):
        before = {name: read() for name, read in reads.items()}
        value = decode()
        extra = after_decode() if after_decode is not None else {}
        after = {name: read() for name, read in reversed(reads.items())}
        pairs.append({name: (before[name] + after[name]) / 2 for name in reads} |
                     {"decode": value} | extra)
    return pairs


@dataclass(frozen=True)
class ModelCost:
    decode_weight_bytes: int   # read once per decode step (packed where quantized)
    dense_weight_bytes: int    # what prefill reads
    kv_bytes_per_token: int    # in the cache, all layers
    params: int                # multiply-accumulates per token in the linears
    attn_flops_per_context_token: int
    packed_max_rows: int = PACKED_MAX_ROWS  # decode steps up to this batch read the packed
    #                                         weights (a decode stack without int8 weights:
    #                                         every batch)
    int8_prefill_params: int = 0  # of params, those whose prompt matmuls run on int8


def model_cost(model: torch.nn.Module, kv_bytes_per_token: int) -> ModelCost:
    """Per token: a mixture of experts' token reads and multiplies k of its E experts, so
    their weights count k / E (active parameters, not total); prefill reads them all."""
    decode = dense = params = int8_params = 0
    share = _expert_shares(model)
    for module in model.modules():
        part = share.get(id(module), 1.0)
        if isinstance(module, PackedLinear):
            decode += int(part * module.packed_bytes())
            dense += module.dense_bytes() or module.packed_bytes()
            params += int(part * module.in_features * module.out_features)
            if module.w8a8 is not None:
                int8_params += int(part * module.in_features * module.out_features)
        elif isinstance(module, KernelInt8Linear):  # int8 at every batch size
            decode, dense = decode + module.packed_bytes(), dense + module.packed_bytes()
            params += module.in_features * module.out_features
        elif isinstance(module, torch.nn.Linear):
            size = module.weight.numel() * module.weight.element_size()
            decode, dense = decode + int(part * size), dense + size
            params += int(part * module.weight.numel())
    config = model.config
    # the decode stack runs every batch on the packed weights, unless it has the int8 ones
    stacked = getattr(model, "decode_stack", None) is not None and \
        not getattr(model, "int8_decode", False)
    return ModelCost(decode, dense, kv_bytes_per_token, params,
                     4 * config.q_size * config.num_layers,
                     packed_max_rows=1 << 30 if stacked else PACKED_MAX_ROWS,
                     int8_prefill_params=int8_params)


def _expert_shares(model: torch.nn.Module) -> dict[int, float]:
    """id of each linear inside a mixture's experts -> top-k / number of experts."""
    shares = {}
    for module in model.modules():
        if isinstance(module, SparseMoE):
            share = module.top_k / module.num_experts
            shares |= {id(m): share for expert in module.experts for m in expert.modules()}
    return shares


def decode_limit(cost: ModelCost, bandwidth_gb_s: float, batch: int, context: int,
                 peak_gflops: float, int8_gops: float = 0.0) -> float:
    """tok/s at most for `batch` sequences of `context` tokens each decoding one token
    (batches above cost.packed_max_rows read the dense weights, as ember does then, and run
    the int8 ones, cost.int8_prefill_params, at the int8 peak where it is given)."""
    dense = batch > cost.packed_max_rows
    weights = cost.dense_weight_bytes if dense else cost.decode_weight_bytes
    step_bytes = weights + batch * context * cost.kv_bytes_per_token
    int8_params = cost.int8_prefill_params if dense and int8_gops else 0
    compute = batch * (2 * (cost.params - int8_params)
                       + context * cost.attn_flops_per_context_token) / (peak_gflops * 1e9)
    if int8_params:
        compute += batch * 2 * int8_params / (int8_gops * 1e9)
    return batch / max(step_bytes / (bandwidth_gb_s * 1e9), compute)


def prefill_limit(cost: ModelCost, peak_gflops: float, prompt: int,
                  int8_gops: float = 0.0) -> float:
    """tok/s at most for one prompt: its FLOPs at the dense peak, the int8 linears' share
    (cost.int8_prefill_params) at the int8 peak."""
    flops = (prompt * 2 * (cost.params - cost.int8_prefill_params)
             + cost.attn_flops_per_context_token * prompt * prompt / 2)
    seconds = flops / (peak_gflops * 1e9)
    if cost.int8_prefill_params:
        seconds += prompt * 2 * cost.int8_prefill_params / (int8_gops * 1e9)
    return prompt / seconds


def decode_probe(llm, batch: int, context: int = 128, tokens: int = 64
                 ) -> Callable[[int], float]:
    """A function of n <= batch: decode tok/s of n sequences with `context`-token prompts."""
    cold = RequestOptions(prefix_cache=False)
    prompts = [[100 + (i * 7 + j) % 20000 for j in range(context)] for i in range(batch)]
    llm.generate(prompts[:1], _greedy(4), cold)

    def decode(n: int) -> float:
        """The same prompts for 1 and for tokens + 1 tokens: the difference is decode."""
        start = time.perf_counter()
        llm.generate(prompts[:n], _greedy(1), cold)
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        llm.generate(prompts[:n], _greedy(tokens + 1), cold)
        return n * tokens / max(time.perf_counter() - start - prefill, 1e-9)

    return decode


def prefill_tok_s(llm, repeats: int = 2) -> tuple[float, int]:
    """tok/s of one prompt of 1024 tokens (or max_model_len - 1), best of `repeats`."""
    long = [100 + j % 20000 for j in range(min(1024, llm.engine.max_model_len - 1))]
    seconds = _best_time(lambda: llm.generate([long], _greedy(1),
                                              RequestOptions(prefix_cache=False)), repeats)
    return len(long) / seconds, len(long)


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def roofline_report(llm, batch: int, context: int = 128, rounds: int = 3,
                    paired: int = 5) -> dict[str, Any]:
    engine = llm.engine
    cost = model_cost(engine.runner.model, engine.cache_info.bytes_per_token)
    decode = decode_probe(llm, batch, context)
    reads = {"dram": bandwidth_probe(GIB), "cached": bandwidth_probe(cost.decode_weight_bytes)}
    best = best_of_rounds(reads | {"decode_batch1_tok_s": lambda: decode(1),
                                   f"decode_batch{batch}_tok_s": lambda: decode(batch)}, rounds)
    hand_off = hand_off_probe(engine.kernels)
    machine = measure_machine(cost.decode_weight_bytes, int8=cost.int8_prefill_params > 0,
                              dram_gb_s=best.pop("dram"), cached_gb_s=best.pop("cached"),
                              hand_off=hand_off)
    dense_peak = machine.bf16_gflops if engine.dtype == torch.bfloat16 else machine.fp32_gflops
    pairs = paired_rounds(reads, lambda: decode(1), paired, hand_off)
    paired_percent = {name: [100 * p["decode"] / decode_limit(cost, p[name], 1, context,
                                                              dense_peak, machine.int8_gops)
                             for p in pairs] for name in reads}
    prefill, prompt = prefill_tok_s(llm)
    measured = best | {"prefill_tok_s": prefill, "prefill_tokens": prompt}
    limits: dict[str, float] = {}
    for name, bw in (("cached", machine.cached_gb_s), ("dram", machine.dram_gb_s)):
        for b in (1, batch):
            limits[f"decode_batch{b}_{name}_tok_s"] = decode_limit(cost, bw, b, context,
                                                                   dense_peak,
                                                                   machine.int8_gops)
    limits["prefill_tok_s"] = prefill_limit(cost, dense_peak, prompt, machine.int8_gops)
    if machine.amx and machine.bf16_gflops_avx512 and engine.dtype == torch.bfloat16:
        limits["prefill_avx512_tok_s"] = prefill_limit(cost, machine.bf16_gflops_avx512,
                                                       prompt, machine.int8_gops_avx512 or 0.0)
    percent = {f"decode_batch{b}_of_{name}_limit": 100 * measured[f"decode_batch{b}_tok_s"]
               / limits[f"decode_batch{b}_{name}_tok_s"]
               for b in (1, batch) for name in ("cached", "dram")}
    percent["prefill_of_limit"] = 100 * measured["prefill_tok_s"] / limits["prefill_tok_s"]
    if "prefill_avx512_tok_s" in limits:
        percent["prefill_of_avx512_limit"] = 100 * measured["prefill_tok_s"] / \
            limits["prefill_avx512_tok_s"]
    for name, values in paired_percent.items():
        percent[f"decode_batch1_of_{name}_limit_paired"] = statistics.median(values)
    return {"machine": asdict(machine), "model": asdict(cost) | {
                "dtype": str(engine.dtype).removeprefix("torch."),
                "weights": engine.quantization, "prefill_matmul": engine.prefill_matmul,
                "prefill_choice": engine.prefill_choice.as_dict(),
                "decode_context": context, "rounds": rounds,
                "flops_per_token": 2 * cost.params},
            "limits": limits, "measured": measured, "percent_of_limit": percent,
            "paired": {"rounds": pairs, "percent_of_limit": paired_percent}}


def format_report(report: dict[str, Any]) -> str:
    m, c = report["machine"], report["model"]
    l3 = m.get("l3_bytes")
    fits = l3 is not None and m["cached_bytes"] <= l3
    l3_note = "" if l3 is None else (f"; L3 {l3 / 2**20:.0f} MiB: the weights "
                                     f"{'fit' if fits else 'do not fit'}")
    # the second probe reads a buffer the size of the weights: "cached" only where it fits
    cached_label = "cached weights" if fits else "weight-size read"
    kinds = {"cached": cached_label, "dram": "dram weights"}
    lines = [(f"machine  {m['threads']} threads; read bandwidth {m['dram_gb_s']:.1f} GB/s "
              f"(1 GiB), {m['cached_gb_s']:.1f} GB/s ({m['cached_bytes'] / 1e6:.0f} MB, the "
              f"decode weights{l3_note}); matmul {m['fp32_gflops']:.0f} GFLOP/s fp32, "
              f"{m['bf16_gflops']:.0f} bf16"
              + (f", {m['int8_gops']:.0f} GOP/s int8" if m.get("int8_gops") else "")
              + _hand_off_text(m)),
             (f"model    {c['dtype']}, weights {c['weights']}, prefill matmuls "
              f"{c.get('prefill_matmul', c['dtype'])}: decode reads "
              f"{c['decode_weight_bytes'] / 1e6:.1f} MB of weights per step, prefill "
              f"{c['dense_weight_bytes'] / 1e6:.1f} MB; {c['kv_bytes_per_token']} KV bytes per "
              f"context token; {c['flops_per_token'] / 1e6:.0f} MFLOP per token"),
             *_matmul_lines(report),
             f"{'':40}{'ember':>10}{'limit':>10}{'% of it':>9}"]
    for key, value in report["measured"].items():
        if key == "prefill_tokens":
            continue
        base = key.removesuffix("_tok_s")
        for name in (("cached", "dram") if base.startswith("decode") else
                     ("", "avx512") if "prefill_avx512_tok_s" in report["limits"] else ("",)):
            limit_key = f"{base}_{name}_tok_s" if name else key
            pct_key = f"{base}_of_{name}_limit" if name else "prefill_of_limit"
            kind = kinds.get(name) or ("" if "prefill_avx512_tok_s" not in report["limits"]
                                       else "AVX-512 peaks" if name else "AMX peaks")
            label = f"{base} tok/s" + (f" ({kind})" if kind else "")
            lines.append(f"{label:40}{value:10.1f}{report['limits'][limit_key]:10.1f}"
                         f"{report['percent_of_limit'][pct_key]:8.0f}%")
    paired = report.get("paired")
    if paired:  # reports written before the paired rounds have none
        for name, values in paired["percent_of_limit"].items():
            lines.append(f"{'decode_batch1 (' + kinds[name] + '), paired':60}"
                         f"{statistics.median(values):8.0f}%  median of {len(values)} rounds "
                         f"({min(values):.0f}-{max(values):.0f}%)")
        trips = [r["round_trip_ns"] for r in paired["rounds"]
                 if r.get("round_trip_ns") is not None]
        if trips:
            lines.append(f"{'':60}{'':9}  round trips in those rounds "
                         f"{min(trips):.0f}-{max(trips):.0f} ns")
    return "\n".join(lines)


def _matmul_lines(report: dict[str, Any]) -> list[str]:
    """The matmul peaks with AMX and without, and what prompt rows run on (reports written
    before these were measured have neither)."""
    m, lines = report["machine"], []
    if "amx" in m and not m["amx"]:
        lines.append("matmuls  no AMX on this CPU: the peaks above are AVX-512's (the same "
                     "with oneDNN held to it), and the prefill limit is theirs")
    elif m.get("amx"):
        lines.append(f"matmuls  AMX: {m['bf16_gflops']:.0f} GFLOP/s bf16, "
                     f"{m['int8_gops']:.0f} GOP/s int8; AVX-512 only ({AVX512_ISA}): "
                     f"{m['bf16_gflops_avx512']:.0f} GFLOP/s bf16, "
                     f"{m['int8_gops_avx512']:.0f} GOP/s int8")
    choice = report["model"].get("prefill_choice")
    if choice:
        described = PrefillChoice(choice["prefill_matmul"], choice["how"],
                                  tuple(Timing(t["name"], t["seconds"], t["error"])
                                        for t in choice["timings"])).describe()
        lines.append(f"prefill  prompt rows on {described}; decode rows as before")
    return lines


def _hand_off_text(machine: dict[str, Any]) -> str:
    """The machine line's hand-off part ("" where it was not measured)."""
    region = machine.get("parallel_region_ns")
    if region is None:
        return ""
    trip = machine.get("round_trip_ns")
    trip_text = "" if trip is None else f"{trip:.0f} ns a round trip, "
    return f"; threads' hand-off {trip_text}{region / 1e3:.1f} us a parallel region"

"""`ember roofline` arithmetic: bytes and FLOPs per token, and the limits they set."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from ember.engine.roofline import (ModelCost, best_of_rounds, decode_limit, format_report,
                                   hand_off_probe, measure_machine, model_cost, paired_rounds,
                                   prefill_limit)
from ember.quant.packed import PackedLinear


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.config = type("C", (), {"q_size": 64, "num_layers": 2})()
        self.a = PackedLinear(torch.nn.Linear(64, 96, bias=False).to(torch.bfloat16), "int4")
        self.b = torch.nn.Linear(96, 64, bias=False).to(torch.bfloat16)


def test_model_cost_counts_packed_and_dense_bytes():
    cost = model_cost(_Model(), kv_bytes_per_token=100)
    # int4: half a byte a weight + (scale, zero) in bf16 per 32 weights; dense: 2 bytes each
    packed = 96 * 64 // 2 + (64 // 32) * 96 * 2 * 2
    assert cost.decode_weight_bytes == packed + 96 * 64 * 2
    assert cost.dense_weight_bytes == 2 * 96 * 64 * 2
    assert cost.params == 2 * 96 * 64 and cost.attn_flops_per_context_token == 4 * 64 * 2


def test_limits_are_the_slower_of_bandwidth_and_compute():
    cost = ModelCost(decode_weight_bytes=10**8, dense_weight_bytes=4 * 10**8,
                     kv_bytes_per_token=0, params=10**8, attn_flops_per_context_token=0)
    # batch 1: 0.1 GB at 50 GB/s = 2 ms (compute 0.2 GFLOP at 1000 GFLOP/s = 0.2 ms)
    assert decode_limit(cost, 50, 1, 0, 1000) == pytest.approx(500)
    # batch 16 reads the dense weights: 0.4 GB -> 8 ms; compute 3.2 GFLOP -> 3.2 ms
    assert decode_limit(cost, 50, 16, 0, 1000) == pytest.approx(2000)
    assert prefill_limit(cost, 1000, 100) == pytest.approx(5000)


def test_the_prefill_limit_runs_int8_linears_at_the_int8_peak():
    cost = ModelCost(decode_weight_bytes=10**8, dense_weight_bytes=4 * 10**8,
                     kv_bytes_per_token=0, params=10**8, attn_flops_per_context_token=0,
                     int8_prefill_params=6 * 10**7)
    # 100 tokens: 8 GFLOP at 1000 GFLOP/s (8 ms) + 12 GOP at 2000 GOP/s (6 ms)
    assert prefill_limit(cost, 1000, 100, int8_gops=2000) == pytest.approx(100 / 0.014)


def test_with_the_decode_stack_every_decode_batch_reads_the_packed_weights():
    model = _Model()
    assert model_cost(model, 100).packed_max_rows == 8     # bigger batches: the dense copies
    model.decode_stack = object()                          # (what use_kernels sets)
    cost = model_cost(model, 100)
    assert decode_limit(cost, 50, 16, 0, 10**9) == pytest.approx(
        16 / (cost.decode_weight_bytes / 50e9))
    model.int8_decode = True                               # (what use_int8_decode sets)
    assert model_cost(model, 100).packed_max_rows == 8     # big batches on the int8 copies


def test_big_decode_batches_run_the_int8_linears_at_the_int8_peak():
    cost = ModelCost(decode_weight_bytes=10**8, dense_weight_bytes=10**8,
                     kv_bytes_per_token=0, params=10**8, attn_flops_per_context_token=0,
                     int8_prefill_params=6 * 10**7)
    # batch 64: 5.12 GFLOP at 1000 GFLOP/s (5.12 ms) + 7.68 GOP at 2000 GOP/s (3.84 ms);
    # the 0.1 GB read at 50 GB/s takes 2 ms
    assert decode_limit(cost, 50, 64, 0, 1000, int8_gops=2000) == pytest.approx(64 / 0.00896)
    assert decode_limit(cost, 50, 64, 0, 1000) == pytest.approx(64 / 0.0128)  # no int8 peak
    assert decode_limit(cost, 50, 8, 0, 1000, int8_gops=2000) == pytest.approx(8 / 0.002)


def _report(l3: int) -> dict:
    """A batch-1 report as roofline_report writes it (95 MB of weights), for format_report."""
    return {
        "machine": {"threads": 2, "dram_gb_s": 40.0, "cached_gb_s": 60.0,
                    "cached_bytes": 95_000_000, "fp32_gflops": 200.0, "bf16_gflops": 900.0,
                    "l3_bytes": l3},
        "model": {"dtype": "bfloat16", "weights": "int4", "decode_weight_bytes": 95_000_000,
                  "dense_weight_bytes": 240_000_000, "kv_bytes_per_token": 23040,
                  "flops_per_token": 269_000_000},
        "measured": {"decode_batch1_tok_s": 300.0},
        "limits": {"decode_batch1_cached_tok_s": 600.0, "decode_batch1_dram_tok_s": 400.0},
        "percent_of_limit": {"decode_batch1_of_cached_limit": 50.0,
                             "decode_batch1_of_dram_limit": 75.0}}


@pytest.mark.parametrize(("l3", "label"), [(32 << 20, "weight-size read"),
                                           (128 << 20, "cached weights")])
def test_the_report_calls_weights_cached_only_where_they_fit_the_l3(l3, label):
    report = _report(l3)
    text = format_report(report)
    assert f"decode_batch1 tok/s ({label})" in text
    assert "do not fit" in text if l3 < 95_000_000 else "the weights fit" in text


def _probe(calls: list[str], name: str, value: float, speeds=None):
    """A probe that records its call in `calls` and returns value (times the next of
    `speeds`: the machine's speed that moment, where given)."""
    def run() -> float:
        calls.append(name)
        return value * (next(speeds) if speeds is not None else 1.0)
    return run


def test_best_of_rounds_runs_every_probe_each_round_and_keeps_each_best():
    """A machine that slows down between rounds: each probe's best comes from the same
    (fast) round, as the probes alternate."""
    calls: list[str] = []
    speed = iter([1.0, 1.0, 0.6, 0.6, 0.8, 0.8])

    def probe(name: str, value: float):
        return _probe(calls, name, value, speed)

    best = best_of_rounds({"bandwidth": probe("bandwidth", 50.0),
                           "decode": probe("decode", 300.0)}, rounds=3)
    assert calls == ["bandwidth", "decode"] * 3
    assert best == {"bandwidth": 50.0, "decode": 300.0}


def test_paired_rounds_put_each_decode_between_two_reads_and_pair_it_with_their_mean():
    """Each round reads, decodes, reads again (in reverse order), so a decode is paired with
    the bandwidth of its own moment, however the machine drifts between rounds."""
    calls: list[str] = []
    speeds = iter([1.0, 1.0, 0.8, 1.0, 1.0,     # round 1: dram, cached, decode, cached, dram
                   0.5, 0.6, 0.55, 0.6, 0.7])   # round 2, a slower stretch

    def probe(name: str, value: float):
        return _probe(calls, name, value, speeds)

    pairs = paired_rounds({"dram": probe("dram", 40.0), "cached": probe("cached", 50.0)},
                          probe("decode", 300.0), rounds=2)
    assert calls == ["dram", "cached", "decode", "cached", "dram"] * 2
    assert pairs == [pytest.approx({"dram": 40.0, "cached": 50.0, "decode": 240.0}),
                     pytest.approx({"dram": 24.0, "cached": 30.0, "decode": 165.0})]


def test_the_report_shows_the_paired_median_and_range_where_there_are_rounds():
    report = _report(32 << 20)
    assert "paired" not in format_report(report)   # a report from before the paired rounds
    report["paired"] = {"rounds": [], "percent_of_limit": {"dram": [70.0, 81.0, 76.0],
                                                           "cached": [58.0, 61.0, 60.0]}}
    lines = format_report(report).splitlines()
    assert any("(weight-size read), paired" in line and " 60%" in line and "(58-61%)" in line
               for line in lines)
    assert any("(dram weights), paired" in line and " 76%" in line and "(70-81%)" in line
               for line in lines)


def test_paired_rounds_take_the_hand_off_between_the_decode_and_the_second_reads():
    calls: list[str] = []
    trips = iter([60.0, 310.0])

    def hand_off() -> dict[str, float]:
        calls.append("hand_off")
        return {"round_trip_ns": next(trips), "parallel_region_ns": 700.0}

    pairs = paired_rounds({"dram": _probe(calls, "dram", 40.0)},
                          _probe(calls, "decode", 300.0), rounds=2, after_decode=hand_off)
    assert calls == ["dram", "decode", "hand_off", "dram"] * 2
    assert [p["round_trip_ns"] for p in pairs] == [60.0, 310.0]
    assert pairs[0]["decode"] == 300.0 and pairs[0]["parallel_region_ns"] == 700.0


def test_the_report_gives_the_hand_off_where_it_was_measured():
    report = _report(32 << 20)
    assert "hand-off" not in format_report(report)   # no kernels: not measured
    report["machine"] |= {"round_trip_ns": 118.4, "parallel_region_ns": 705.0}
    assert "threads' hand-off 118 ns a round trip, 0.7 us a parallel region" in \
        format_report(report)
    report["machine"]["round_trip_ns"] = None   # one thread: nothing to bounce against
    assert "threads' hand-off 0.7 us a parallel region" in format_report(report)
    report["paired"] = {"rounds": [{"decode": 250.0, "round_trip_ns": t} for t in (64.0, 312.0)],
                        "percent_of_limit": {"dram": [70.0, 60.0]}}
    assert "round trips in those rounds 64-312 ns" in format_report(report)


def test_the_hand_off_probe_needs_the_kernels_and_a_second_thread_for_its_round_trip():
    assert hand_off_probe(None) is None   # the torch path: nothing to time it with
    two = hand_off_probe(SimpleNamespace(thread_sync_ns=lambda: (121.5, 650.0)))
    assert two() == {"round_trip_ns": 121.5, "parallel_region_ns": 650.0}
    one = hand_off_probe(SimpleNamespace(thread_sync_ns=lambda: (math.nan, 400.0)))
    assert one() == {"round_trip_ns": None, "parallel_region_ns": 400.0}   # JSON-safe


def _prefill_report(amx: bool) -> dict:
    """A report with a prefill row, as roofline_report writes it with or without AMX."""
    report = _report(32 << 20)
    report["machine"] |= {"amx": amx, "int8_gops": 2400.0,
                          "bf16_gflops_avx512": 900.0 if amx else None,
                          "int8_gops_avx512": 1800.0 if amx else None}
    report["model"]["prefill_choice"] = {
        "prefill_matmul": "int8", "how": "measured",
        "timings": [{"name": "int8", "seconds": 0.0018, "error": 0.017},
                    {"name": "bfloat16", "seconds": 0.0035, "error": 0.003}]}
    report["measured"]["prefill_tok_s"] = 4000.0
    report["limits"]["prefill_tok_s"] = 5000.0
    report["percent_of_limit"]["prefill_of_limit"] = 80.0
    if amx:
        report["machine"]["bf16_gflops"] = 2500.0
        report["limits"]["prefill_avx512_tok_s"] = 2000.0
        report["percent_of_limit"]["prefill_of_avx512_limit"] = 200.0
    return report


def test_without_amx_the_report_says_so_instead_of_a_second_column_of_peaks():
    text = format_report(_prefill_report(amx=False))
    assert "no AMX on this CPU" in text and "AVX-512 only" not in text
    assert "AVX-512 peaks" not in text
    assert "prompt rows on int8 (measured: int8 1.80 ms, bfloat16 3.50 ms" in text
    assert "no AMX" not in format_report(_report(32 << 20))   # an older report: neither


def test_with_amx_the_report_gives_both_peaks_and_the_prefill_against_each():
    lines = format_report(_prefill_report(amx=True)).splitlines()
    assert any("AMX: 2500 GFLOP/s bf16, 2400 GOP/s int8; AVX-512 only (AVX512_CORE_BF16): "
               "900 GFLOP/s bf16, 1800 GOP/s int8" in line for line in lines)
    [own] = [line for line in lines if line.startswith("prefill tok/s (AMX peaks)")]
    [held] = [line for line in lines if line.startswith("prefill tok/s (AVX-512 peaks)")]
    assert own.split()[-3:] == ["4000.0", "5000.0", "80%"]
    assert held.split()[-3:] == ["4000.0", "2000.0", "200%"]


@pytest.mark.parametrize("amx", [False, True])
def test_the_peaks_without_amx_are_measured_only_where_the_cpu_has_it(amx):
    calls = []

    def held(isa: str, threads: int) -> tuple[float, float]:
        calls.append((isa, threads))
        return 900.0, 1800.0

    machine = measure_machine(1 << 20, int8=False, dram_gb_s=40.0, cached_gb_s=60.0,
                              amx=amx, held_peaks=held)
    assert machine.amx == amx
    assert calls == ([("AVX512_CORE_BF16", torch.get_num_threads())] if amx else [])
    assert (machine.bf16_gflops_avx512, machine.int8_gops_avx512) == \
        ((900.0, 1800.0) if amx else (None, None))
    assert (machine.int8_gops > 0) == amx   # both int8 peaks where there are two to compare

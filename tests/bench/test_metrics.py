"""The benchmark's arithmetic on hand-written records (references: the formulas in
ember/bench/metrics.py, worked by hand here)."""
from __future__ import annotations

import math
import random
import statistics

import pytest

from ember.bench.client import arrival_times
from ember.bench.metrics import (RequestRecord, describe, metric_deltas, parse_prometheus,
                                 parse_slo, summarize)


def record(index, start, ttft, gaps, tokens, prompt=10, **kw) -> RequestRecord:
    times = [ttft]
    for g in gaps:
        times.append(times[-1] + g)
    return RequestRecord(index=index, start=start, ttft=ttft, e2e=times[-1], chunk_times=times,
                         prompt_tokens=prompt, output_tokens=tokens, usage_reported=True, **kw)


def test_describe_uses_linear_percentiles_and_population_std():
    d = describe([1.0, 2.0, 3.0, 4.0])
    assert d["mean"] == 2.5 and d["min"] == 1.0 and d["max"] == 4.0
    assert d["std"] == pytest.approx(math.sqrt(1.25))
    assert d["p50"] == 2.5 and d["p90"] == pytest.approx(3.7) and d["p99"] == pytest.approx(3.97)
    assert describe([]) is None


def test_summary_figures_by_hand():
    records = [
        record(0, 0.0, 0.1, [0.02, 0.04], 3),           # e2e 0.16, tpot (0.16-0.1)/2 = 0.03
        record(1, 0.5, 0.3, [0.05], 2, prompt=20),       # e2e 0.35, tpot 0.05
        RequestRecord(2, 0.2, error="http_429", e2e=0.01, output_tokens=0),
        record(3, 0.1, 0.2, [0.01], 2, cancelled=True),  # counted only as cancelled
    ]
    s = summarize(records, parse_slo("ttft=250ms,tpot=40ms"))
    assert s["duration_s"] == pytest.approx(0.85)        # 0.0 -> 0.5 + 0.35
    assert (s["completed"], s["failed"], s["cancelled"]) == (2, 1, 1)
    assert s["errors"] == {"http_429": 1}
    assert s["output_tokens"] == 5 and s["prompt_tokens"] == 30
    assert s["requests_per_s"] == pytest.approx(2 / 0.85)
    assert s["output_tok_per_s"] == pytest.approx(5 / 0.85)
    assert s["total_tok_per_s"] == pytest.approx(35 / 0.85)
    assert s["ttft_s"]["mean"] == pytest.approx(0.2)
    assert s["tpot_s"]["p50"] == pytest.approx(0.04)
    assert sorted(round(g, 6) for g in [0.02, 0.04, 0.05]) == \
        [round(s["chunk_gap_s"][k], 6) for k in ("min", "p50", "max")]
    assert s["e2e_s"]["max"] == pytest.approx(0.35)
    # only request 0 meets ttft <= 250 ms and tpot <= 40 ms
    assert s["goodput"]["requests_per_s"] == pytest.approx(1 / 0.85)
    assert s["goodput"]["fraction"] == pytest.approx(1 / 4)


def test_slo_parsing():
    assert parse_slo("ttft=500ms, tpot=50ms,e2e=2s") == {"ttft": 0.5, "tpot": 0.05, "e2e": 2.0}
    with pytest.raises(ValueError, match="unknown SLO"):
        parse_slo("speed=1")
    with pytest.raises(ValueError, match="needs a time"):
        parse_slo("ttft=fast")


def test_percentile_targets_are_the_runs_and_leave_goodput_to_per_request_limits():
    assert parse_slo("ttft_p99=1s, itl_p50=20ms,tpot=50ms") == \
        {"ttft_p99": 1.0, "itl_p50": 0.02, "tpot": 0.05}
    with pytest.raises(ValueError, match="unknown SLO"):
        parse_slo("ttft_p0=1s")
    records = [record(i, 0.1 * i, ttft, [0.01, 0.03], 3)
               for i, ttft in enumerate([0.1, 0.2, 0.3, 0.4, 0.9])]
    s = summarize(records, parse_slo("ttft_p50=300ms,ttft_p90=500ms,itl_p50=20ms"))
    assert "goodput" not in s   # no per-request limit
    targets = s["slo_percentiles"]
    assert targets["ttft_p50"] == {"limit_s": 0.3, "value_s": pytest.approx(0.3), "met": True}
    assert targets["ttft_p90"]["value_s"] == pytest.approx(0.7)   # 0.4 + 0.75 x 0.5
    assert not targets["ttft_p90"]["met"]
    assert targets["itl_p50"]["value_s"] == pytest.approx(0.02)   # of 0.01 x 5, 0.03 x 5
    mixed = summarize(records, parse_slo("ttft=350ms,ttft_p90=1s"))
    assert mixed["goodput"]["fraction"] == pytest.approx(3 / 5)
    assert mixed["goodput"]["slo_s"] == {"ttft": 0.35}
    assert mixed["slo_percentiles"]["ttft_p90"]["met"]


def test_server_metric_deltas_keep_the_counters_that_matter():
    before = parse_prometheus('# HELP x\nember_num_preemptions_total{model_name="m"} 2.0\n'
                              'vllm:prefix_cache_hits_total 10\nember_kv_cache_usage_perc 0.5\n'
                              'ember_request_success_created{finish_reason="stop"} 17.0\n')
    after = parse_prometheus('ember_num_preemptions_total{model_name="m"} 5.0\n'
                             'vllm:prefix_cache_hits_total 30\nember_kv_cache_usage_perc 0.9\n'
                             'ember_request_success_created{finish_reason="stop"} 99.0\n')
    assert metric_deltas(before, after) == {'ember_num_preemptions_total{model_name="m"}': 3.0,
                                            "vllm:prefix_cache_hits_total": 20.0}


def test_poisson_arrivals_have_the_asked_rate_and_gamma_is_burstier():
    """20k gaps: mean within 3% of 1/rate; coefficient of variation ~1 for Poisson, ~2 for
    gamma shape 0.25 (CV = 1/sqrt(shape))."""
    def gaps(burstiness):
        t = arrival_times(20000, rate=4.0, burstiness=burstiness, ramp_up_s=0,
                          rng=random.Random(1))
        return [b - a for a, b in zip(t, t[1:])]
    poisson, bursty = gaps(1.0), gaps(0.25)
    assert statistics.mean(poisson) == pytest.approx(0.25, rel=0.03)
    assert statistics.mean(bursty) == pytest.approx(0.25, rel=0.05)
    assert statistics.stdev(poisson) / statistics.mean(poisson) == pytest.approx(1.0, rel=0.05)
    assert statistics.stdev(bursty) / statistics.mean(bursty) == pytest.approx(2.0, rel=0.08)


def test_ramp_up_starts_slow():
    t = arrival_times(200, rate=10.0, burstiness=1.0, ramp_up_s=10.0, rng=random.Random(2))
    early = sum(1 for x in t if x < 2.0)
    late = sum(1 for x in t if 10.0 <= x < 12.0)
    assert early < late / 2

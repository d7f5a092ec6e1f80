"""What a benchmark run measured, as pure functions of its per-request records.

Definitions (times in seconds; "content chunk" = an SSE chunk that carries generated text):
  TTFT         first content chunk's arrival - request sent
  E2E          last byte of the response - request sent
  TPOT         per request: (E2E - TTFT) / (output tokens - 1), for requests with > 1 token
  chunk gap    time between consecutive content chunks of one request, pooled over all
               requests (what vLLM's benchmark calls ITL; a chunk may carry several tokens)
  duration     first request sent -> last response ended (the run's wall time)
  requests/s   completed requests / duration;  output tok/s = output tokens / duration;
  total tok/s  (prompt + output tokens) / duration
  goodput      completed requests that meet every SLO / duration
  inputs/s     texts embedded / duration (the embeddings workload; its E2E is per request)
Output and prompt tokens are the server's usage counts where it reports them. Each latency is
summarised by mean, population std, min, max and percentiles with linear interpolation.
Cancelled requests (cancelled on purpose) and failed ones count only in their own totals.
"""
from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 95, 99)


@dataclass
class RequestRecord:
    index: int
    start: float                      # seconds since the run began
    ttft: float | None = None
    e2e: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # content chunk arrivals, from start
    prompt_tokens: int | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, if sent
    output_tokens: int | None = None
    usage_reported: bool = False      # False: output_tokens counted from chunks
    target_prompt_tokens: int | None = None
    target_output_tokens: int | None = None
    error: str | None = None          # kind: http_429, http_500, timeout, connection, protocol
    error_message: str | None = None
    cancelled: bool = False
    session: int | None = None
    turn: int | None = None
    num_inputs: int | None = None     # /v1/embeddings: texts embedded by this request
    kind: str | None = None           # its part in a mixed workload

    @property
    def ok(self) -> bool:
        return self.error is None and not self.cancelled

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or not self.output_tokens or \
                self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    def to_json(self) -> dict[str, Any]:
        return asdict(self) | {"tpot": self.tpot}


def describe(values: list[float]) -> dict[str, float] | None:
    """mean, std (population), min, max and p50/p90/p95/p99 (linear interpolation)."""
    if not values:
        return None
    a = np.asarray(values, dtype=np.float64)
    out = {"mean": float(a.mean()), "std": float(a.std()), "min": float(a.min()),
           "max": float(a.max())}
    for p in PERCENTILES:
        out[f"p{p}"] = float(np.percentile(a, p))
    return out


SLO_METRICS = ("ttft", "tpot", "itl", "e2e")
_SLO_NAME = re.compile(r"(ttft|tpot|itl|e2e)(?:_p(\d+(?:\.\d+)?))?")


def parse_slo(text: str | None) -> dict[str, float]:
    """'ttft=500ms,tpot=50ms,ttft_p99=1s' -> {'ttft': 0.5, 'tpot': 0.05, 'ttft_p99': 1.0}.

    A bare name is a limit for every request (goodput counts the requests that meet all of
    them); NAME_pQ is a limit on the run's Q-th percentile of that latency (for itl, of all
    chunk gaps pooled; for ttft, tpot and e2e, of the requests' values)."""
    if not text:
        return {}
    slo = {}
    for part in text.split(","):
        name, _, value = part.partition("=")
        name = name.strip().lower()
        match = _SLO_NAME.fullmatch(name)
        if not match or (match.group(2) is not None and not 0 < float(match.group(2)) <= 100):
            raise ValueError(f"unknown SLO {name!r}; use ttft, tpot, itl or e2e, for every "
                             "request, or with _pQ (ttft_p99) for a percentile of the run")
        match = re.fullmatch(r"\s*([0-9.]+)\s*(ms|s)?\s*", value)
        if not match:
            raise ValueError(f"SLO {part!r} needs a time like 500ms or 2s")
        number = float(match.group(1))
        slo[name] = number / 1000 if match.group(2) == "ms" else number
    return slo


def per_request(slo: dict[str, float]) -> dict[str, float]:
    """The SLO's limits for every request (its bare names)."""
    return {name: limit for name, limit in slo.items() if name in SLO_METRICS}


def meets(record: RequestRecord, slo: dict[str, float]) -> bool:
    """Whether the request meets every per-request limit of `slo` (percentile targets are
    the run's, not a request's)."""
    checks = {"ttft": record.ttft, "tpot": record.tpot, "e2e": record.e2e,
              "itl": max(record.gaps, default=0.0)}
    for name, limit in per_request(slo).items():
        value = checks[name]
        if name == "tpot" and value is None:  # a one-token answer has no TPOT to miss
            continue
        if value is None or value > limit:
            return False
    return True


def percentile_targets(records: list[RequestRecord], slo: dict[str, float]
                       ) -> dict[str, dict[str, Any]]:
    """Each NAME_pQ target of `slo`: its limit, the run's value, and whether it is met (a run
    with no value, every request failed, misses it)."""
    values = {"ttft": [r.ttft for r in records if r.ttft is not None],
              "tpot": [r.tpot for r in records if r.tpot is not None],
              "e2e": [r.e2e for r in records if r.e2e is not None],
              "itl": [g for r in records for g in r.gaps]}
    out = {}
    for name, limit in slo.items():
        if name in SLO_METRICS:
            continue
        metric, _, q = name.partition("_p")
        value = float(np.percentile(values[metric], float(q))) if values[metric] else math.nan
        out[name] = {"limit_s": limit, "value_s": value, "met": value <= limit}
    return out


def summarize(records: list[RequestRecord], slo: dict[str, float] | None = None
              ) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    ends = [r.start + r.e2e for r in records if r.e2e is not None]
    duration = (max(ends) - min(r.start for r in records)) if ends else 0.0
    rate = (lambda n: n / duration) if duration > 0 else (lambda n: math.nan)
    output = sum(r.output_tokens or 0 for r in ok)
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    summary: dict[str, Any] = {
        "num_requests": len(records), "completed": len(ok),
        "failed": sum(r.error is not None for r in records),
        "cancelled": sum(r.cancelled for r in records),
        "errors": dict(Counter(r.error for r in records if r.error)),
        "duration_s": duration,
        "requests_per_s": rate(len(ok)), "output_tok_per_s": rate(output),
        "total_tok_per_s": rate(prompt + output),
        "output_tokens": output, "prompt_tokens": prompt,
        "cached_prompt_tokens": sum(r.cached_tokens or 0 for r in ok),
        "usage_reported": all(r.usage_reported for r in ok) if ok else None,
        "ttft_s": describe([r.ttft for r in ok if r.ttft is not None]),
        "tpot_s": describe([r.tpot for r in ok if r.tpot is not None]),
        "chunk_gap_s": describe([g for r in ok for g in r.gaps]),
        "e2e_s": describe([r.e2e for r in ok if r.e2e is not None]),
    }
    if any(r.num_inputs is not None for r in ok):
        summary["embedded_inputs"] = sum(r.num_inputs or 0 for r in ok)
        summary["inputs_per_s"] = rate(summary["embedded_inputs"])
    if per_request(slo or {}):
        good = sum(meets(r, slo) for r in ok)
        summary["goodput"] = {"slo_s": per_request(slo), "requests_per_s": rate(good),
                              "fraction": good / len(records) if records else math.nan}
    kinds = sorted({r.kind for r in records if r.kind is not None})
    if kinds:   # a mixed workload: each part's latencies apart (the streams' gaps, say)
        summary["by_kind"] = {kind: kind_summary([r for r in ok if r.kind == kind])
                              for kind in kinds}
    targets = percentile_targets(ok, slo or {})
    if targets:
        summary["slo_percentiles"] = targets
    return summary


def kind_summary(ok: list[RequestRecord]) -> dict[str, Any]:
    return {"completed": len(ok), "output_tokens": sum(r.output_tokens or 0 for r in ok),
            "ttft_s": describe([r.ttft for r in ok if r.ttft is not None]),
            "chunk_gap_s": describe([g for r in ok for g in r.gaps]),
            "e2e_s": describe([r.e2e for r in ok if r.e2e is not None])}


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([^\s]+)")
INTERESTING = re.compile(r"preempt|prefix_cache|cache_hit|cache_quer|prompt_tokens_total|"
                         r"generation_tokens_total|request_success|aborts|spec_decode_num")


def parse_prometheus(text: str) -> dict[str, float]:
    """'name{labels}' -> value for every sample in an exposition text."""
    samples = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match and not line.startswith("#"):
            try:
                samples[match.group(1) + (match.group(2) or "")] = float(match.group(3))
            except ValueError:
                continue
    return samples


def spec_decode_summary(deltas: dict[str, float]) -> dict[str, float] | None:
    """Speculative decoding over the run, from the server's vllm:spec_decode_* counters:
    drafted and accepted tokens, acceptance rate, mean accepted length (per verification,
    the accepted drafts plus the target's own token); None if nothing was drafted."""
    def total(name: str) -> float:
        return sum(v for k, v in deltas.items() if k.split("{")[0] == name)
    drafts = total("vllm:spec_decode_num_drafts_total")
    drafted = total("vllm:spec_decode_num_draft_tokens_total")
    accepted = total("vllm:spec_decode_num_accepted_tokens_total")
    if not drafts or not drafted:
        return None
    return {"num_drafts": drafts, "draft_tokens": drafted, "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted, "mean_accepted_length": 1 + accepted / drafts}


def metric_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Changes of the server-side counters a reader cares about (preemptions, cache hits)."""
    return {name: after[name] - before.get(name, 0.0) for name in sorted(after)
            if INTERESTING.search(name) and not name.split("{")[0].endswith("_created")
            and after[name] != before.get(name, 0.0)}

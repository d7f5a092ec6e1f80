"""What `ember plan` prints and writes: a fleet's figures as text, and the plot of latency
percentiles against rate with the SLO's limits and the chosen point (matplotlib, when it is
installed; the plot's data is in the JSON either way)."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ember.plan.search import Point, cost_per_million

CURVE_METRICS = (("ttft_s", "TTFT"), ("chunk_gap_s", "ITL"))


def _ms(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{value * 1000:.0f} ms"


def describe_point(point: Point, cost_per_hour: float | None) -> list[str]:
    """A fleet's figures, a line each."""
    s, js = point.summary, point.to_json()
    ttft, gap = s.get("ttft_s") or {}, s.get("chunk_gap_s") or {}
    lines = [f"  TTFT p50 {_ms(ttft.get('p50'))}, p99 {_ms(ttft.get('p99'))};  "
             f"ITL p50 {_ms(gap.get('p50'))}, p99 {_ms(gap.get('p99'))}"]
    good = s.get("goodput")
    lines.append(f"  {s['requests_per_s']:.2f} req/s, {s['output_tok_per_s']:.1f} output tok/s"
                 + (f"; goodput {good['requests_per_s']:.2f} req/s "
                    f"({good['fraction'] * 100:.1f}% of requests)" if good else "")
                 + (f"; {s['failed']} refused" if s["failed"] else ""))
    for name, t in (s.get("slo_percentiles") or {}).items():
        lines.append(f"  {name} {_ms(t['value_s'])} (limit {_ms(t['limit_s'])}): "
                     + ("met" if t["met"] else "missed"))
    lines.append(f"  replicas busy {js['utilisation'] * 100:.0f}% of the time, "
                 f"{js['mean_batch']:.1f} requests a step; KV cache in use "
                 f"{js['kv_usage_mean'] * 100:.0f}% mean, {js['kv_usage_peak'] * 100:.0f}% peak, "
                 f"{js['preemptions']} preemptions, prefix hit rate "
                 f"{js['prefix_hit_rate'] * 100:.1f}%")
    if cost_per_hour is not None:
        lines.append(f"  {cost_per_million(point, cost_per_hour):.2f} per million output "
                     f"tokens ({point.replicas} x {cost_per_hour:g} per replica-hour)")
    return lines


def curve_data(points: list[Point], slo: dict[str, float], chosen: Point | None
               ) -> dict[str, Any]:
    """The plot's data: each point's latency percentiles, the SLO's limits, the choice."""
    rows = []
    for p in sorted(points, key=lambda p: (p.rate or 0.0, p.replicas)):
        row: dict[str, Any] = {"rate": p.rate, "replicas": p.replicas, "meets_slo": p.meets}
        for key, name in CURVE_METRICS:
            d = p.summary.get(key) or {}
            row |= {f"{name.lower()}_p50_s": d.get("p50"), f"{name.lower()}_p99_s": d.get("p99")}
        rows.append(row)
    return {"points": rows, "slo_s": slo,
            "chosen": None if chosen is None else {"rate": chosen.rate,
                                                   "replicas": chosen.replicas}}


def plot(data: dict[str, Any], out: Path, title: str) -> Path | None:
    """PNG of curve_data(); None where matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in data["points"] if r["rate"] is not None]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, (_, name) in zip(axes, CURVE_METRICS):
        low = name.lower()
        for q, style in (("p50", "o-"), ("p99", "s--")):
            ax.plot([r["rate"] for r in rows], [_val_ms(r[f"{low}_{q}_s"]) for r in rows],
                    style, label=f"{name} {q}")
        for slo_name, limit in data["slo_s"].items():
            if slo_name.split("_p")[0] == low:
                ax.axhline(limit * 1000, color="red", linewidth=1, label=f"SLO {slo_name}")
        chosen = data["chosen"]
        if chosen and chosen["rate"] is not None:
            ax.axvline(chosen["rate"], color="green", linestyle=":",
                       label=f"chosen: {chosen['replicas']} replicas")
        ax.set(title=f"{name} vs rate", xlabel="requests/s", ylabel="ms", yscale="log")
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _val_ms(value: float | None) -> float:
    return math.nan if value is None else value * 1000

"""Results out: the console table, JSON and JSONL files, side-by-side comparison, PNG plots."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from ember.bench.metrics import RequestRecord

LATENCIES = (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("chunk_gap_s", "chunk gap"),
             ("e2e_s", "E2E"))


def _ms(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{value * 1000:.1f}"


def table(summary: dict[str, Any], title: str = "") -> str:
    lines = [f"== {title or summary.get('label', 'benchmark')} =="] if title or \
        summary.get("label") else []
    lines.append(f"requests   {summary['completed']} completed, {summary['failed']} failed, "
                 f"{summary['cancelled']} cancelled in {summary['duration_s']:.2f} s")
    if summary["errors"]:
        lines.append("errors     " + ", ".join(f"{k}: {v}" for k, v in
                                                sorted(summary["errors"].items())))
    lines.append(f"throughput {summary['requests_per_s']:.2f} req/s, "
                 f"{summary['output_tok_per_s']:.1f} output tok/s, "
                 f"{summary['total_tok_per_s']:.1f} total tok/s"
                 + ("" if summary.get("usage_reported", True) is not False
                    else "  (tokens counted from chunks: the server sent no usage)"))
    if "inputs_per_s" in summary:
        lines.append(f"embeddings {summary['inputs_per_s']:.1f} inputs/s "
                     f"({summary['embedded_inputs']} inputs)")
    if summary.get("cached_prompt_tokens"):
        share = summary["cached_prompt_tokens"] / max(summary["prompt_tokens"], 1)
        lines.append(f"cache      {summary['cached_prompt_tokens']} of "
                     f"{summary['prompt_tokens']} prompt tokens cached ({share * 100:.1f}%)")
    if "goodput" in summary:
        g = summary["goodput"]
        slo = ", ".join(f"{k}<={v * 1000:g}ms" for k, v in g["slo_s"].items())
        lines.append(f"goodput    {g['requests_per_s']:.2f} req/s meet {slo} "
                     f"({g['fraction'] * 100:.1f}% of requests)")
    for name, t in (summary.get("slo_percentiles") or {}).items():
        lines.append(f"slo        {name} {_ms(t['value_s'])} ms, limit {_ms(t['limit_s'])} ms: "
                     + ("met" if t["met"] else "MISSED"))
    if "spec_decode" in summary:
        sd = summary["spec_decode"]
        lines.append(f"spec       {sd['draft_tokens']:g} drafted, {sd['accepted_tokens']:g} "
                     f"accepted ({sd['acceptance_rate'] * 100:.1f}%), mean accepted length "
                     f"{sd['mean_accepted_length']:.2f}")
    lines.append(f"{'ms':12}{'mean':>9}{'std':>9}{'p50':>9}{'p90':>9}{'p95':>9}{'p99':>9}")
    for key, name in LATENCIES:
        s = summary.get(key)
        if s:
            lines.append(f"{name:12}" + "".join(f"{_ms(s[k]):>9}" for k in
                                                 ("mean", "std", "p50", "p90", "p95", "p99")))
    for name, delta in (summary.get("server_metrics_delta") or {}).items():
        lines.append(f"server     {name} +{delta:g}")
    return "\n".join(lines)


def write_results(out: Path, summary: dict[str, Any], records: list[RequestRecord]) -> Path:
    """out.json (the summary) and out.jsonl (one line per request). Returns the JSONL path."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2))
    jsonl = out.with_suffix(".jsonl")
    jsonl.write_text("".join(json.dumps(r.to_json()) + "\n" for r in records))
    return jsonl


COMPARE_ROWS = (("output tok/s", ("output_tok_per_s",), True),
                ("inputs/s", ("inputs_per_s",), True),
                ("requests/s", ("requests_per_s",), True),
                ("TTFT p50 ms", ("ttft_s", "p50"), False),
                ("TTFT p99 ms", ("ttft_s", "p99"), False),
                ("TPOT p50 ms", ("tpot_s", "p50"), False),
                ("TPOT p99 ms", ("tpot_s", "p99"), False),
                ("chunk gap p99 ms", ("chunk_gap_s", "p99"), False),
                ("E2E p50 ms", ("e2e_s", "p50"), False), ("goodput req/s", ("goodput",
                                                                           "requests_per_s"), True))


def _get(summary: dict[str, Any], path: tuple[str, ...]) -> float | None:
    value: Any = summary
    for key in path:
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return value


def compare(summaries: list[tuple[str, dict[str, Any]]]) -> str:
    """Side by side; each column after the first also shows its ratio to the first."""
    rows = []
    for label, path, _ in COMPARE_ROWS:
        values = [_get(s, path) for _, s in summaries]
        if all(v is None for v in values):
            continue
        scale = 1000 if label.endswith("ms") else 1
        cells = []
        for i, v in enumerate(values):
            cell = "-" if v is None else f"{v * scale:.1f}"
            if v is not None and i and values[0]:
                cell += f" ({v / values[0]:.2f}x)"
            cells.append(cell)
        rows.append((label, cells))
    names = [n for n, _ in summaries]
    width = 2 + max(len(c) for c in names + [c for _, cells in rows for c in cells])
    lines = [f"{'':18}" + "".join(f"{n:>{width}}" for n in names)]
    lines += [f"{label:18}" + "".join(f"{c:>{width}}" for c in cells) for label, cells in rows]
    return "\n".join(lines)


def plot(inputs: list[Path], out: Path) -> Path:
    """PNG: latency-throughput curve (from sweep or run summaries) and the TTFT and TPOT
    distributions (from the runs' JSONL files)."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("ember bench plot needs matplotlib: pip install 'ember[bench]' "
                         "(or pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points, records = [], []
    for path in inputs:
        data = json.loads(path.read_text())
        runs = data.get("points") or [data]
        for run in runs:
            points.append((run.get("label") or path.stem, run))
            jsonl = Path(run.get("jsonl") or path.with_suffix(".jsonl"))
            if jsonl.exists():
                records.append((run.get("label") or path.stem,
                                [json.loads(line) for line in jsonl.read_text().splitlines()]))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    points.sort(key=lambda p: p[1]["output_tok_per_s"])
    xs = [run["output_tok_per_s"] for _, run in points]
    for key, name in (("tpot_s", "TPOT p50"), ("e2e_s", "E2E p50"), ("ttft_s", "TTFT p50")):
        ys = [(run.get(key) or {}).get("p50", math.nan) * 1000 for _, run in points]
        axes[0].plot(xs, ys, marker="o", label=name)
    for (label, run), x in zip(points, xs):
        y = (run.get("tpot_s") or {}).get("p50", math.nan) * 1000
        axes[0].annotate(label, (x, y), fontsize=7, textcoords="offset points", xytext=(3, 3))
    axes[0].set(title="latency vs throughput", xlabel="output tok/s", ylabel="ms")
    axes[0].legend()
    for ax, field, title in ((axes[1], "ttft", "TTFT"), (axes[2], "tpot", "TPOT")):
        for label, rows in records:
            values = [r[field] * 1000 for r in rows if r.get(field) is not None
                      and r.get("error") is None and not r.get("cancelled")]
            if values:
                ax.hist(values, bins=30, alpha=0.6, label=label)
        ax.set(title=f"{title} distribution", xlabel="ms", ylabel="requests")
        if records:
            ax.legend(fontsize=7)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out

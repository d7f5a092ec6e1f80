"""The `ember bench` commands (their arguments: ember/bench/cli.py)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from ember.bench import report
from ember.bench.drive import build_requests, run_once, server_model


def cmd_serve(args: argparse.Namespace) -> None:
    model = args.model or server_model(args.base_url, args.api_key)
    requests = build_requests(args, args.base_url, model)
    summary, records = run_once(args, args.base_url, requests, model)
    out = Path(args.out)
    summary["jsonl"] = str(out.with_suffix(".jsonl"))
    report.write_results(out, summary, records)
    print(report.table(summary))
    print(f"wrote {out} and {summary['jsonl']}")


def cmd_sweep(args: argparse.Namespace) -> None:
    if bool(args.concurrencies) == bool(args.rates):
        raise SystemExit("give exactly one of --concurrencies and --rates")
    model = args.model or server_model(args.base_url, args.api_key)
    requests = build_requests(args, args.base_url, model)
    out = Path(args.out)
    points = []
    steps = [("concurrency", int(v)) for v in args.concurrencies.split(",")] if \
        args.concurrencies else [("rate", float(v)) for v in args.rates.split(",")]
    for key, value in steps:
        overrides = {"concurrency": value, "rate": None} if key == "concurrency" else \
            {"concurrency": None, "rate": value}
        summary, records = run_once(args, args.base_url, requests, model,
                                    label=f"{key}={value:g}", overrides=overrides)
        point_out = out.with_name(f"{out.stem}-{key}{value:g}.json")
        summary["jsonl"] = str(point_out.with_suffix(".jsonl"))
        report.write_results(point_out, summary, records)
        print(report.table(summary))
        points.append(summary)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"sweep": steps[0][0], "points": points}, indent=2))
    print(f"wrote {out}")


def cmd_compare(args: argparse.Namespace) -> None:
    summaries = []
    for path in args.files:
        data = json.loads(Path(path).read_text())
        for point in data.get("points") or [data]:
            summaries.append((point.get("label") or Path(path).stem, point))
    print(report.compare(summaries))


def cmd_plot(args: argparse.Namespace) -> None:
    print(f"wrote {report.plot([Path(f) for f in args.files], Path(args.out))}")


def cmd_offline(args: argparse.Namespace) -> None:
    from ember import LLM
    from ember.bench.offline import offline_workload, run_offline
    llm = LLM(args.model, dtype=args.dtype, quantization=args.quantization,
              kv_cache_dtype=args.kv_cache_dtype)
    workload = offline_workload(lambda t: llm.tokenizer.encode(t, add_special_tokens=False),
                                args.batch_size, args.seed, max_len=llm.engine.max_model_len)
    result = run_offline(llm, workload, repeats=args.repeats)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    for key, value in result.items():
        print(f"{key:34} {value:.3f}" if isinstance(value, float) else f"{key:34} {value}")
    print(f"wrote {args.out}")


def cmd_peers(args: argparse.Namespace) -> None:
    from ember.bench.peers import run_peers
    run_peers(args)

"""`ember bench serve | sweep | compare | plot | offline | peers`."""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from pathlib import Path
from typing import Any

import httpx

from ember.bench import report
from ember.bench.client import LoadConfig, Runner, print_progress
from ember.bench.metrics import metric_deltas, parse_prometheus, parse_slo, summarize
from ember.bench.workloads import (BenchRequest, LengthDist, PromptMaker, chat_sessions,
                                   default_corpus, from_jsonl, local_tokenizer, server_tokenizer,
                                   shared_prefix, synthetic)

WORKLOADS = ("random", "shared-prefix", "chat-sessions", "jsonl")


def add_workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload (seeded: the same seed sends the same requests)")
    g.add_argument("--workload", choices=WORKLOADS, default="random")
    g.add_argument("--num-requests", type=int, default=32)
    g.add_argument("--input-len", default="fixed:128", help="fixed:N, uniform:LO,HI, "
                   "normal:MEAN,STD or lognormal:MEDIAN,SIGMA (tokens)")
    g.add_argument("--output-len", default="fixed:64", help="as --input-len")
    g.add_argument("--groups", type=int, default=4, help="shared-prefix: prefix groups")
    g.add_argument("--per-group", type=int, default=8, help="shared-prefix: requests per group")
    g.add_argument("--prefix-len", type=int, default=600)
    g.add_argument("--suffix-len", type=int, default=20)
    g.add_argument("--sessions", type=int, default=8, help="chat-sessions: conversations")
    g.add_argument("--turns", type=int, default=4, help="chat-sessions: turns each")
    g.add_argument("--dataset", default=None, help="jsonl: a file of {prompt|messages, "
                   "max_tokens?} lines")
    g.add_argument("--corpus", default=None, help="text to cut prompts from (default: a "
                   "public-domain Shakespeare excerpt shipped with ember)")
    g.add_argument("--tokenizer", default=None, help="a .gguf or HF folder whose tokenizer "
                   "sizes the prompts (default: the server's /tokenize)")
    g.add_argument("--seed", type=int, default=0)


def add_load_args(p: argparse.ArgumentParser, base_url: bool = True) -> None:
    g = p.add_argument_group("target and load")
    if base_url:
        g.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    g.add_argument("--model", default=None, help="model name (default: the server's first)")
    g.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    g.add_argument("--api-key", default=None)
    g.add_argument("--concurrency", type=int, default=None, help="fixed concurrency (default 1 "
                   "unless --rate is given)")
    g.add_argument("--rate", type=float, default=None, help="requests/s, Poisson arrivals")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrival "
                   "gaps: < 1 is burstier than Poisson")
    g.add_argument("--ramp-up", type=float, default=0.0, help="seconds to reach full load")
    g.add_argument("--duration", type=float, default=None, help="stop sending after S s")
    g.add_argument("--timeout", type=float, default=600.0, help="per-request limit, s")
    g.add_argument("--cancel-fraction", type=float, default=0.0,
                   help="cancel this fraction of requests after their first chunk")
    g.add_argument("--no-force-output", action="store_true", help="do not send ignore_eos / "
                   "min_tokens (for servers that refuse them)")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--extra-body", default=None, help="JSON merged into every request")
    g.add_argument("--slo", default=None, help="e.g. ttft=500ms,tpot=50ms: goodput counts "
                   "requests that meet all")
    g.add_argument("--label", default=None)


def add_output_args(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument("--out", default=default, help="summary JSON (per-request JSONL beside it)")


def load_config(args: argparse.Namespace, base_url: str, model: str | None) -> LoadConfig:
    concurrency = args.concurrency if args.concurrency is not None else \
        (None if args.rate else 1)
    return LoadConfig(
        base_url=base_url, model=model, endpoint="chat" if args.workload == "chat-sessions"
        else args.endpoint, concurrency=concurrency, rate=args.rate,
        burstiness=args.burstiness, ramp_up_s=args.ramp_up, duration_s=args.duration,
        timeout_s=args.timeout, cancel_fraction=args.cancel_fraction,
        force_output=not args.no_force_output, temperature=args.temperature,
        api_key=args.api_key, seed=args.seed,
        extra_body=json.loads(args.extra_body) if args.extra_body else {})


def server_model(base_url: str, api_key: str | None) -> str | None:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(base_url.rstrip("/") + "/models", headers=headers, timeout=30)
        r.raise_for_status()
        return r.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError):
        return None


def build_requests(args: argparse.Namespace, base_url: str, model: str | None
                   ) -> list[BenchRequest]:
    rng = random.Random(args.seed)
    output_len = LengthDist.parse(args.output_len)
    chat = args.endpoint == "chat"
    if args.workload == "jsonl":
        if not args.dataset:
            raise SystemExit("--workload jsonl needs --dataset FILE")
        return from_jsonl(Path(args.dataset), output_len, rng, chat)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    encode, decode = local_tokenizer(args.tokenizer) if args.tokenizer else \
        server_tokenizer(base_url, model, headers)
    corpus = Path(args.corpus).read_text() if args.corpus else default_corpus()
    maker = PromptMaker(corpus, encode, decode, rng)
    if args.workload == "shared-prefix":
        return shared_prefix(maker, args.groups, args.per_group, args.prefix_len,
                             args.suffix_len, output_len, rng, chat)
    if args.workload == "chat-sessions":
        return chat_sessions(maker, args.sessions, args.turns, LengthDist.parse(args.input_len),
                             output_len, rng)
    return synthetic(maker, args.num_requests, LengthDist.parse(args.input_len), output_len,
                     rng, chat)


def scrape(base_url: str, headers: dict[str, str]) -> dict[str, float] | None:
    root = base_url.rstrip("/").removesuffix("/v1")
    try:
        r = httpx.get(root + "/metrics", headers=headers, timeout=10)
        return parse_prometheus(r.text) if r.status_code == 200 else None
    except httpx.HTTPError:
        return None


def run_once(args: argparse.Namespace, base_url: str, requests: list[BenchRequest],
             model: str | None, label: str | None = None,
             overrides: dict[str, Any] | None = None) -> tuple[dict[str, Any], list]:
    cfg = load_config(args, base_url, model)
    for key, value in (overrides or {}).items():
        setattr(cfg, key, value)
    if cfg.num_requests is None and args.workload != "chat-sessions":
        cfg.num_requests = len(requests)
    before = scrape(base_url, cfg.headers)
    total = (cfg.num_requests or len(requests)) * (args.turns if args.workload ==
                                                    "chat-sessions" else 1)
    runner = Runner(cfg, progress=print_progress(total))
    records = asyncio.run(runner.run(requests))
    summary = summarize(records, parse_slo(args.slo))
    after = scrape(base_url, cfg.headers)
    if before is not None and after is not None:
        summary["server_metrics_delta"] = metric_deltas(before, after)
    summary["label"] = label or args.label or f"{model or 'server'}"
    summary["config"] = {"base_url": base_url, "model": model, "endpoint": cfg.endpoint,
                         "workload": args.workload, "concurrency": cfg.concurrency,
                         "rate": cfg.rate, "burstiness": cfg.burstiness,
                         "input_len": args.input_len, "output_len": args.output_len,
                         "seed": args.seed, "num_requests": len(records),
                         "command": " ".join(sys.argv)}
    return summary, records


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


def _explained(func):
    """Turn the mistakes a user can fix into one clear line instead of a traceback."""
    def run(args: argparse.Namespace) -> None:
        try:
            func(args)
        except httpx.HTTPStatusError as e:
            raise SystemExit(f"error: {e.request.url} answered {e.response.status_code}: "
                             f"{e.response.text[:300]}") from None
        except httpx.HTTPError as e:
            raise SystemExit(f"error: could not reach the server ({e!r}); is it running, and "
                             "is --base-url right (it ends in /v1)?") from None
        except (ValueError, FileNotFoundError) as e:
            raise SystemExit(f"error: {e}") from None
    return run


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmark any OpenAI-compatible server")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    serve = bsub.add_parser("serve", help="drive a running server with a workload")
    add_load_args(serve)
    add_workload_args(serve)
    add_output_args(serve, "results/bench.json")
    serve.set_defaults(func=_explained(cmd_serve))
    sweep = bsub.add_parser("sweep", help="a series of concurrencies or rates")
    add_load_args(sweep)
    add_workload_args(sweep)
    sweep.add_argument("--concurrencies", default=None, help="e.g. 1,2,4,8")
    sweep.add_argument("--rates", default=None, help="e.g. 0.5,1,2 (requests/s)")
    add_output_args(sweep, "results/sweep.json")
    sweep.set_defaults(func=_explained(cmd_sweep))
    comp = bsub.add_parser("compare", help="summaries side by side, with ratios to the first")
    comp.add_argument("files", nargs="+")
    comp.set_defaults(func=_explained(cmd_compare))
    plot = bsub.add_parser("plot", help="PNG: latency-throughput curve, TTFT and TPOT "
                           "distributions")
    plot.add_argument("files", nargs="+")
    plot.add_argument("--out", default="results/bench.png")
    plot.set_defaults(func=_explained(cmd_plot))
    off = bsub.add_parser("offline", help="the engine in-process: decode, prefill, batch")
    off.add_argument("--model", default=None)
    off.add_argument("--dtype", default="auto")
    off.add_argument("--quantization", default="auto", choices=["auto", "none", "int8", "int4"])
    off.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"])
    off.add_argument("--repeats", type=int, default=3)
    off.add_argument("--batch-size", type=int, default=32)
    off.add_argument("--seed", type=int, default=0)
    add_output_args(off, "results/offline.json")
    off.set_defaults(func=_explained(cmd_offline))
    peers = bsub.add_parser("peers", help="ember serve beside a peer server, same workloads "
                            "alternately, with ratios")
    peers.add_argument("--peer-cmd", action="append", default=[], required=True,
                       help="NAME=COMMAND; {port} and {model} are filled in (repeatable)")
    peers.add_argument("--model-file", default=None, help="the model both serve (default: "
                       "ember's default model)")
    peers.add_argument("--ember-args", default="", help="extra `ember serve` arguments")
    peers.add_argument("--repeats", type=int, default=1)
    peers.add_argument("--ready-timeout", type=float, default=300.0)
    add_load_args(peers, base_url=False)
    add_workload_args(peers)
    add_output_args(peers, "results/peers.json")
    peers.set_defaults(func=_explained(cmd_peers))

"""One load run against one server: the requests a workload makes and their measured summary.

`ember bench` commands (commands.py) and the peer runner (peers.py) both drive servers through
these, so neither imports the other.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from pathlib import Path
from typing import Any

import httpx

from ember.bench.client import LoadConfig, Runner, print_progress
from ember.bench.metrics import (metric_deltas, parse_prometheus, parse_slo,
                                 spec_decode_summary, summarize)
from ember.bench.workloads import (BenchRequest, Decode, Encode, LengthDist, PromptMaker,
                                   chat_sessions, default_corpus, embedding_batches,
                                   from_jsonl, grounded, local_tokenizer, mixed,
                                   multi_tenant, server_tokenizer, shared_prefix, synthetic)


def load_config(args: argparse.Namespace, base_url: str, model: str | None) -> LoadConfig:
    concurrency = args.concurrency if args.concurrency is not None else \
        (None if args.rate else 1)
    endpoint = {"chat-sessions": "chat", "embeddings": "embeddings",
                "mixed": "chat"}.get(args.workload, args.endpoint)
    return LoadConfig(
        base_url=base_url, model=model, endpoint=endpoint, concurrency=concurrency, rate=args.rate,
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


def build_requests(args: argparse.Namespace, base_url: str, model: str | None,
                   codec: tuple[Encode, Decode] | None = None) -> list[BenchRequest]:
    """The workload's requests; prompts sized with `codec` if given, else with --tokenizer's
    files, else with the server's /tokenize."""
    rng = random.Random(args.seed)
    output_len = LengthDist.parse(args.output_len)
    chat = args.endpoint == "chat"
    if args.workload == "jsonl":
        if not args.dataset:
            raise SystemExit("--workload jsonl needs --dataset FILE")
        return from_jsonl(Path(args.dataset), output_len, rng, chat)
    encode, decode = codec or _codec(args, base_url, model)
    corpus = Path(args.corpus).read_text() if args.corpus else default_corpus()
    maker = PromptMaker(corpus, encode, decode, rng)
    if args.workload == "shared-prefix":
        return shared_prefix(maker, args.groups, args.per_group, args.prefix_len,
                             args.suffix_len, output_len, rng, chat)
    if args.workload == "grounded":
        return grounded(maker, args.num_requests, LengthDist.parse(args.input_len), output_len,
                        rng, chat)
    if args.workload == "multi-tenant":
        return multi_tenant(maker, args.tenants, args.num_requests, args.prefix_len,
                            args.suffix_len, output_len, rng, chat)
    if args.workload == "embeddings":
        return embedding_batches(maker, args.num_requests, args.inputs_per_request,
                                 LengthDist.parse(args.input_len), rng)
    if args.workload == "mixed":
        return mixed(maker, args.streams, LengthDist.parse(args.input_len),
                     args.stream_output_len, args.long_prompts, args.long_len,
                     args.long_every, args.long_output_len, rng, chat=True)
    if args.workload == "chat-sessions":
        return chat_sessions(maker, args.sessions, args.turns, LengthDist.parse(args.input_len),
                             output_len, rng)
    return synthetic(maker, args.num_requests, LengthDist.parse(args.input_len), output_len,
                     rng, chat)


def _codec(args: argparse.Namespace, base_url: str, model: str | None
           ) -> tuple[Encode, Decode]:
    if args.tokenizer:
        return local_tokenizer(args.tokenizer)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    return server_tokenizer(base_url, model.split(",")[0] if model else None, headers)


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
        spec = spec_decode_summary(summary["server_metrics_delta"])
        if spec is not None:
            summary["spec_decode"] = spec
    summary["label"] = label or args.label or f"{model or 'server'}"
    summary["config"] = {"base_url": base_url, "model": model, "endpoint": cfg.endpoint,
                         "workload": args.workload, "concurrency": cfg.concurrency,
                         "rate": cfg.rate, "burstiness": cfg.burstiness,
                         "input_len": args.input_len, "output_len": args.output_len,
                         "seed": args.seed, "num_requests": len(records),
                         "inputs_per_request": args.inputs_per_request
                         if args.workload == "embeddings" else None,
                         "command": " ".join(sys.argv)}
    return summary, records

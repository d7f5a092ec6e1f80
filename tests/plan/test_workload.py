"""`ember plan`'s requests are `ember bench`'s, tokenized as a replica and keyed as the
gateway would (references: bench's build_requests and the gateway's PromptKeys)."""
from __future__ import annotations

import argparse
import random

import pytest

from ember.bench.cli import add_arrival_args, add_workload_args
from ember.bench.client import arrival_times
from ember.bench.drive import build_requests
from ember.errors import ConfigError
from ember.plan.simulate import FleetSim, ReplicaConfig
from ember.plan.workload import bench_load, bench_requests, plan_requests, sim_requests
from ember.router.prompts import PromptKeys
from ember.server.protocol import ChatCompletionRequest, CompletionRequest
from tests.plan.conftest import STEP_MODEL


def options(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_workload_args(parser)
    add_arrival_args(parser.add_argument_group())
    parser.add_argument("--endpoint", default="completions")
    return parser.parse_args(list(argv))


def test_the_requests_are_the_ones_bench_sends(smollm_tokenizer, smollm_path):
    args = options("--workload", "multi-tenant", "--tenants", "3", "--num-requests", "12",
                   "--prefix-len", "64", "--suffix-len", "8", "--seed", "9",
                   "--endpoint", "chat")
    ours = bench_requests(args, smollm_tokenizer)
    args.tokenizer, args.api_key = str(smollm_path), None
    theirs = build_requests(args, "", None)
    assert [(r.messages, r.max_tokens) for r in ours] == \
        [(r.messages, r.max_tokens) for r in theirs]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_prompt_keys_are_the_gateways(smollm_tokenizer, endpoint):
    args = options("--workload", "shared-prefix", "--groups", "2", "--per-group", "3",
                   "--prefix-len", "80", "--suffix-len", "10", "--endpoint", endpoint)
    bench = bench_requests(args, smollm_tokenizer)
    sims = sim_requests(bench, smollm_tokenizer, 16)
    gateway = PromptKeys(smollm_tokenizer, (), 64, "x-session-id")
    for req, sim in zip(bench, sims):
        body = ChatCompletionRequest(messages=req.messages) if req.messages else \
            CompletionRequest(prompt=req.prompt)
        assert sim.block_keys == gateway.block_keys(body, 16, None)
        assert len(sim.block_keys) == len(sim.prompt_ids) // 16 >= 5


@pytest.mark.parametrize("workload", ["random", "shared-prefix"])
def test_prompts_sized_once_are_tokenized_as_a_replica_tokenizes_them(smollm_tokenizer,
                                                                      workload):
    """plan_requests reuses the ids that sized each prompt: they are the ones the replica's
    own tokenizing (sim_requests, from the text) makes."""
    args = options("--workload", workload, "--num-requests", "12", "--input-len",
                   "uniform:20,90", "--groups", "2", "--per-group", "3", "--seed", "3")
    want = sim_requests(bench_requests(args, smollm_tokenizer), smollm_tokenizer, 16)
    assert smollm_tokenizer.num_special_tokens_added == 0   # (else nothing is reused)
    assert plan_requests(args, smollm_tokenizer, 16) == want


def test_arrivals_are_the_bench_clients_schedule(smollm_tokenizer):
    """The simulated requests start when `ember bench serve --rate` sends them: its
    arrival_times, from the generator its client seeds with seed + 1."""
    args = options("--num-requests", "20", "--input-len", "fixed:32", "--output-len",
                   "fixed:4", "--seed", "5", "--burstiness", "0.5")
    sims = sim_requests(bench_requests(args, smollm_tokenizer), smollm_tokenizer, 16)
    load = bench_load(args, len(sims), rate=3.0)
    schedule = arrival_times(20, 3.0, 0.5, 0.0, random.Random(5 + 1))
    assert list(load.arrival_times) == schedule
    records = FleetSim(ReplicaConfig(STEP_MODEL, num_blocks=4096), 2, "prefix",
                       range(1000, 2000)).run(sims, load)
    assert sorted(r.start for r in records) == pytest.approx(schedule)


def test_workloads_that_quote_real_replies_are_refused(smollm_tokenizer):
    with pytest.raises(ConfigError, match="chat-sessions cannot be simulated"):
        bench_requests(options("--workload", "chat-sessions"), smollm_tokenizer)

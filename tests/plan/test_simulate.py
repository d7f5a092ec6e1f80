"""The fleet simulator: ember's scheduler, KV pool, prefix cache and router policy on a
virtual clock. References: the scheduler's own plans priced by the step model (worked here
step by step), and ordering facts of the real engine and gateway. No model, no tokenizer:
prompts are token ids."""
from __future__ import annotations

import random

import pytest

from ember.bench.metrics import parse_slo, summarize
from ember.config import SchedulerConfig
from ember.kv.prefix_cache import extend_keys
from ember.plan.search import Planner, Slo
from ember.plan.simulate import FleetSim, Load, ReplicaConfig, SimRequest
from ember.plan.stepmodel import ServingOverhead, StepShape
from tests.plan.conftest import STEP_MODEL

TOKENS = range(1000, 2000)


def config(num_blocks: int = 4096, serving: ServingOverhead = ServingOverhead(),
           **scheduler) -> ReplicaConfig:
    return ReplicaConfig(STEP_MODEL, num_blocks=num_blocks, serving=serving,
                         scheduler=SchedulerConfig(**scheduler))


def request(index: int, prompt: list[int], max_tokens: int) -> SimRequest:
    return SimRequest(index, prompt, max_tokens, extend_keys([], prompt, 16))


def own_prompt(index: int, n: int) -> list[int]:
    return [10_000 + 1000 * index + i for i in range(n)]


def random_requests(num: int, prompt_len: int, max_tokens: int, seed: int = 0
                    ) -> list[SimRequest]:
    rng = random.Random(seed)
    return [request(i, [rng.randrange(3, 40_000) for _ in range(prompt_len)], max_tokens)
            for i in range(num)]


def poisson(num: int, rate: float, seed: int = 1) -> Load:
    rng, t, times = random.Random(seed), 0.0, []
    for _ in range(num):
        times.append(t)
        t += rng.expovariate(rate)
    return Load(tuple(times))


def run(requests, load, replicas=1, cfg=None, policy="prefix"):
    sim = FleetSim(cfg or config(), replicas, policy, TOKENS)
    return sim.run(requests, load), sim


def test_one_request_takes_the_schedulers_chunks_at_the_models_times():
    """A 1000-token prompt under a 512-token budget: the scheduler computes it in chunks of
    512 and 488, then decodes; each step lasts what the step model says for its shape."""
    records, _ = run([request(0, own_prompt(0, 1000), 3)], Load((0.0,)),
                     cfg=config(max_num_batched_tokens=512))
    (r,) = records
    keys = lambda a, b: sum(p + 1 for p in range(a, b))  # noqa: E731
    chunk1 = STEP_MODEL.predict(StepShape(512, keys(0, 512)))
    chunk2 = STEP_MODEL.predict(StepShape(488, keys(512, 1000)))
    assert r.ttft == pytest.approx(chunk1 + chunk2)
    decode = [STEP_MODEL.predict(StepShape(decode_rows=1, decode_keys=p + 1))
              for p in (1000, 1001)]
    assert r.gaps == pytest.approx(decode)
    assert (r.output_tokens, r.prompt_tokens, r.cached_tokens) == (3, 1000, 0)


def test_a_prefix_hit_shortens_ttft():
    """B repeats A's 512-token prefix and arrives after A ended: it is served from the
    cache (whole blocks), and its first token comes sooner than that of C, as long but
    new."""
    prefix = own_prompt(0, 512)
    reqs = [request(0, prefix + own_prompt(1, 40), 4), request(1, prefix + own_prompt(2, 40), 4),
            request(2, own_prompt(3, 552), 4)]
    records, _ = run(reqs, Load((0.0, 5.0, 10.0)))
    a, b, c = records
    assert (a.cached_tokens, b.cached_tokens, c.cached_tokens) == (0, 512, 0)
    assert b.ttft < c.ttft
    assert c.ttft == pytest.approx(a.ttft)


def test_preemption_when_the_kv_cache_is_small():
    """Eight requests that each grow to 264 tokens, in 40 blocks of 16: the scheduler
    preempts and recomputes, and every request still gets all its tokens; with room for all,
    nothing is preempted."""
    reqs = random_requests(8, 64, 200)
    records, sim = run(reqs, Load((0.0,) * 8), cfg=config(num_blocks=40))
    assert sum(sim.stats().preemptions) > 0
    assert [r.output_tokens for r in records] == [200] * 8 and not any(r.error for r in records)
    records_big, sim_big = run(reqs, Load((0.0,) * 8), cfg=config(num_blocks=4096))
    assert sum(sim_big.stats().preemptions) == 0
    assert max(r.e2e for r in records_big) < max(r.e2e for r in records)


def test_more_replicas_lower_ttft_p99_at_the_same_rate():
    reqs = random_requests(300, 256, 32)
    load = poisson(300, rate=12.0)
    p99 = []
    for n in (1, 2, 4):
        records, _ = run(reqs, load, replicas=n)
        p99.append(summarize(records)["ttft_s"]["p99"])
    assert p99[0] > p99[1] > p99[2]


def test_the_prefix_policy_keeps_a_group_on_the_replica_that_holds_its_prefix():
    """Eight 400-token prefixes over two replicas whose caches hold about five each:
    round-robin sends every group to both, so each cache churns; `prefix` routing keeps a
    group where its blocks are, and finds more of the prompts cached (the fleet doc's
    multi-tenant result, in miniature)."""
    rng = random.Random(5)
    prefixes = [own_prompt(g, 400) for g in range(8)]
    reqs = [request(i, prefixes[rng.randrange(8)] + own_prompt(100 + i, 16), 8)
            for i in range(200)]
    load = poisson(200, rate=6.0)
    hits = {}
    for policy in ("prefix", "round-robin"):
        _, sim = run(reqs, load, replicas=2, policy=policy, cfg=config(num_blocks=160))
        stats = sim.stats()
        hits[policy] = stats.prefix_hit_tokens / stats.prefix_query_tokens
    assert hits["prefix"] > hits["round-robin"] + 0.05


def _planner(reqs, rate_loads=None) -> Planner:
    slo = Slo(parse_slo("ttft_p99=300ms,itl_p99=60ms"))
    return Planner(config(), reqs, lambda rate: poisson(len(reqs), rate), slo, "prefix",
                   TOKENS)


def test_at_replicas_is_monotone_and_replicas_needed_is_the_least_that_meets():
    planner = _planner(random_requests(200, 200, 24))
    rates = [planner.max_rate(n, start=4.0).rate for n in (1, 2, 3)]
    assert rates[0] <= rates[1] <= rates[2]
    assert rates[0] < rates[2]
    point = planner.replicas_needed(rates[1] * 1.3, max_replicas=16)
    assert point is not None and point.meets
    assert not planner.simulate(point.replicas - 1, rates[1] * 1.3).meets


def test_a_closed_loop_client_sends_its_next_request_when_the_last_ends():
    """--concurrency 1: each request starts exactly when the one before it ended (as the
    bench client's worker does)."""
    reqs = random_requests(5, 64, 8)
    records, _ = run(reqs, Load(concurrency=1))
    for before, after in zip(records, records[1:]):
        assert after.start == pytest.approx(before.start + before.e2e)


def test_a_run_is_a_function_of_its_inputs():
    reqs, load = random_requests(60, 128, 16), poisson(60, rate=20.0)
    first, _ = run(reqs, load, replicas=3)
    second, _ = run(reqs, load, replicas=3)
    assert [(r.start, r.ttft, r.e2e, r.chunk_times) for r in first] == \
        [(r.start, r.ttft, r.e2e, r.chunk_times) for r in second]


def test_refusals_are_the_replicas_own():
    """A prompt past the context is a 400; past --max-waiting, a full replica answers 429
    (after the gateway tried every replica)."""
    too_long = request(0, own_prompt(0, 200), 4)
    records, _ = run([too_long], Load((0.0,)), cfg=ReplicaConfig(STEP_MODEL, num_blocks=8))
    assert records[0].error == "http_400"
    cfg = ReplicaConfig(STEP_MODEL, num_blocks=4096, max_waiting=1,
                        scheduler=SchedulerConfig(max_num_seqs=1))
    records, _ = run(random_requests(6, 32, 50), Load((0.0,) * 6), replicas=2, cfg=cfg)
    errors = [r.error for r in records]
    assert errors.count("http_429") == 2 and errors.count(None) == 4


def _outcome(records, sim):
    """Everything a run reports: each request's times and counts, and the fleet's stats."""
    return ([(r.index, r.start, r.ttft, r.e2e, r.chunk_times, r.output_tokens, r.cached_tokens,
              r.error) for r in records], sim.stats(),
            [r.scheduler.kv.pool.next_event_seq for r in sim.replicas])


@pytest.mark.parametrize("case", ["light", "busy", "preempting", "shared-prefix", "clients",
                                  "clients-ramp"])
def test_decoding_ahead_changes_nothing(case):
    """The shortcut over plain decode steps against planning every step: the same records
    (to the float), stats and KV events, light load to past capacity, with preemption, with
    prefix hits, and with closed-loop clients (started together, their steps end at the same
    instants on both replicas: the order of events that tie must hold too)."""
    rng = random.Random(7)
    prefixes = [own_prompt(g, 200) for g in range(4)]
    reqs, load, cfg = {
        "light": (random_requests(80, 100, 40), poisson(80, rate=4.0), config()),
        "busy": (random_requests(150, 60, 50), poisson(150, rate=60.0), config()),
        "preempting": (random_requests(40, 64, 120), poisson(40, rate=30.0),
                       config(num_blocks=60)),
        "shared-prefix": ([request(i, prefixes[rng.randrange(4)] + own_prompt(50 + i, 23), 37)
                           for i in range(120)], poisson(120, rate=25.0), config(num_blocks=200)),
        "clients": (random_requests(60, 48, 30), Load(concurrency=6), config()),
        "clients-ramp": (random_requests(60, 80, 45), Load(concurrency=5, ramp_up_s=0.3),
                         config(num_blocks=80)),
    }[case]
    outcomes, ahead_steps = [], []
    for ahead in (False, True):
        sim = FleetSim(cfg, 2, "prefix", TOKENS, decode_ahead=ahead)
        outcomes.append(_outcome(sim.run(reqs, load), sim))
        ahead_steps.append(sum(r.num_steps_ahead for r in sim.replicas))
    assert outcomes[0] == outcomes[1]
    assert ahead_steps[0] == 0 and ahead_steps[1] > 0


def test_a_request_sent_as_a_step_ends_joins_the_queue_before_that_end():
    """A tie: the second request is sent at the very instant one of the first's decode steps
    ends (a step the shortcut applies at once). The event queue handles a send before a step
    end at the same instant, so the step planned then computes the new prompt beside the
    first request's next token; the shortcut keeps that order."""
    first = request(0, own_prompt(0, 64), 40)
    alone, _ = run([first], Load((0.0,)))
    tie = alone[0].chunk_times[5]   # past the prompt and the step that took a new block
    reqs, load = [first, request(1, own_prompt(1, 64), 8)], Load((0.0, tie))
    outcomes = []
    for ahead in (False, True):
        sim = FleetSim(config(), 1, "prefix", TOKENS, decode_ahead=ahead)
        outcomes.append(_outcome(sim.run(reqs, load), sim))
    assert outcomes[0] == outcomes[1]
    ttft = outcomes[1][0][1][2]
    # the first request has computed 64 + 5 tokens: its next row reads 70 keys
    assert ttft == pytest.approx(STEP_MODEL.predict(StepShape(64, 64 * 65 // 2, 1, 70)))


SERVING = ServingOverhead(per_step_s=1.5e-3, per_token_s=0.25e-3, measured=True)


def test_the_serving_overhead_lengthens_each_step_by_exactly_its_term():
    """Three requests sent together: the first's prompt runs alone (one token streamed),
    the other two prompts beside its first decode (three), then decodes of three rows until
    the first ends, and one of two. Each step lasts per_step + per_token x the tokens it
    streams longer than without the overhead, so each request's TTFT and gaps grow by the
    sum over the steps they span."""
    reqs = [request(i, own_prompt(i, 100), 6) for i in range(3)]
    plain, _ = run(reqs, Load((0.0,) * 3))
    served, _ = run(reqs, Load((0.0,) * 3), cfg=config(serving=SERVING))
    step = SERVING.seconds   # (tokens streamed) -> the step's extra seconds
    extra_ttft = [step(1), step(1) + step(3), step(1) + step(3)]
    extra_gaps = [[step(3)] * 5, [step(3)] * 4 + [step(2)], [step(3)] * 4 + [step(2)]]
    for p, s, ttft, gaps in zip(plain, served, extra_ttft, extra_gaps):
        assert s.ttft == pytest.approx(p.ttft + ttft, abs=1e-12)
        assert s.gaps == pytest.approx([g + e for g, e in zip(p.gaps, gaps)], abs=1e-12)
        assert len(s.gaps) == len(p.gaps) == 5


def test_a_step_that_streams_nothing_pays_only_the_per_step_term():
    """A 1000-token prompt in two chunks: the first streams no token."""
    lone = [request(0, own_prompt(0, 1000), 2)]
    plain, _ = run(lone, Load((0.0,)), cfg=config(max_num_batched_tokens=512))
    served, _ = run(lone, Load((0.0,)), cfg=config(serving=SERVING, max_num_batched_tokens=512))
    one = SERVING.seconds(1)
    assert served[0].ttft == pytest.approx(plain[0].ttft + SERVING.per_step_s + one, abs=1e-12)
    assert served[0].gaps == pytest.approx([g + one for g in plain[0].gaps], abs=1e-12)


def test_decoding_ahead_adds_the_overhead_as_planning_each_step_does():
    reqs, load = random_requests(80, 64, 40), poisson(80, rate=12.0)
    cfg = config(serving=SERVING)
    outcomes = []
    for ahead in (False, True):
        sim = FleetSim(cfg, 2, "prefix", TOKENS, decode_ahead=ahead)
        outcomes.append(_outcome(sim.run(reqs, load), sim))
    assert outcomes[0] == outcomes[1]


# served intervals that scatter: a median of 1, a tenth over 1.5x, the slowest 3x
SPREAD = tuple(0.8 + 0.2 * q / 50 if q <= 50 else 1.0 + 0.5 * (q - 50) / 40 if q <= 90 else
               1.5 + 0.15 * (q - 90) for q in range(101))
SCATTERED = ServingOverhead(per_step_s=1.5e-3, per_token_s=0.25e-3, measured=True,
                            spread=SPREAD)


def test_decoding_ahead_scatters_as_planning_each_step_does():
    """A step's factor depends on its index on its replica alone, so steps priced ahead and
    cut by an arrival get what planning each would have given them."""
    reqs, load = random_requests(80, 64, 40), poisson(80, rate=12.0)
    outcomes, ahead_steps = [], []
    for ahead in (False, True):
        sim = FleetSim(config(serving=SCATTERED), 2, "prefix", TOKENS, decode_ahead=ahead)
        outcomes.append(_outcome(sim.run(reqs, load), sim))
        ahead_steps.append(sum(r.num_steps_ahead for r in sim.replicas))
    assert outcomes[0] == outcomes[1]
    assert ahead_steps[1] > 0


def test_a_spread_widens_the_tail_and_keeps_the_middle():
    """The same light run with steps scattered and without: the gaps' median moves by at
    most a tenth (the factors' median is 1), their 99th percentile by about the
    spread's (x1.5 or more), and each run is a function of its seed."""
    reqs, load = random_requests(60, 64, 40), poisson(60, rate=2.0)
    exact, _ = run(reqs, load, replicas=2, cfg=config(serving=SERVING))
    scattered, _ = run(reqs, load, replicas=2, cfg=config(serving=SCATTERED))
    again, _ = run(reqs, load, replicas=2, cfg=config(serving=SCATTERED))
    plain, wide = summarize(exact)["chunk_gap_s"], summarize(scattered)["chunk_gap_s"]
    assert wide["p50"] == pytest.approx(plain["p50"], rel=0.1)
    assert wide["p99"] > 1.4 * plain["p99"]
    assert [r.chunk_times for r in again] == [r.chunk_times for r in scattered]
    assert summarize(scattered)["output_tokens"] == summarize(exact)["output_tokens"]

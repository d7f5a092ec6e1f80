"""A fleet on a virtual clock: ember's own scheduler, KV pool, prefix cache and router policy,
with step durations from a profile's fitted step-time model instead of a model's forward.

    arrival --route (Picker, BlockIndex)--> replica: Scheduler.add
    replica step: Scheduler.schedule -> SimRunner.execute (tokens drawn, duration predicted:
                  the step model's, plus what serving adds per step and per streamed token,
                  scattered as the profile's served steps scattered)
                  ... the clock moves to the step's end ... -> Scheduler.update

Everything but the forward is the engine's and the gateway's own code, so chunked prefill,
the token budget, preemption, prefix hits, partial-block reuse, eviction and routing behave
as they do in `ember serve` and `ember route`. No torch: a replica is plain Python over ints.
What each request saw is written as `ember bench`'s RequestRecord, so a simulated run is
summarised (and compared) exactly as a measured one.

One shortcut, exact: a replica whose every request is decoding steps the same plan again and
again (each request one token, no block to allocate, cache or free, no request finishing)
until a request arrives for it. Those steps are planned at once and applied as the
scheduler would apply them, without planning each (SimReplica.plan_ahead); a request routed
to the replica meanwhile cuts them where it arrives, and the step then running is planned
by the scheduler. Nothing the gateway reads changes during them, so routing is unchanged.
FleetSim(decode_ahead=False) plans every step, and a test holds the two runs equal. Most of
a long run's steps are such steps.
"""
from __future__ import annotations

import heapq
import itertools
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from ember.bench.metrics import RequestRecord
from ember.config import SchedulerConfig
from ember.kv.block_pool import BlockPool, KVEvent
from ember.kv.kv_manager import KVCacheManager
from ember.plan.stepmodel import ServingOverhead, StepModel, StepShape, StepSpread, step_shape
from ember.request import Request, SamplingParams
from ember.router.config import PrefixConfig
from ember.router.kv_index import BlockIndex
from ember.router.policies import Candidate, Picker
from ember.scheduler.output import RunnerOutput, SchedulerOutput
from ember.scheduler.scheduler import Scheduler

EVENTS_INTERVAL_S = 0.25  # the gateway polls each replica's /kv/events this often
PROBE_INTERVAL_S = 1.0    # and reads its /metrics (waiting, KV usage) this often
SPREAD_SEED = 1 << 20     # step factors' seeds, apart from the token sources'


class TokenSource:
    """Output token ids from a seeded generator, drawn from `token_ids` (a simulated replica
    gives ids that decode to visible text, so every streamed step carries content, as a
    model's usually does). A cycle of POOL draws: a simulation takes one per token."""

    POOL = 4096

    def __init__(self, token_ids: Sequence[int], seed: int) -> None:
        if not token_ids:
            raise ValueError("a token source needs at least one token id")
        rng = random.Random(seed)
        drawn = [token_ids[rng.randrange(len(token_ids))] for _ in range(self.POOL)]
        self.next = itertools.cycle(drawn).__next__   # () -> the next token id


class SimRunner:
    """The runner's place in the step with no model: each request that reaches its newest
    token gets one drawn token, and the step lasts what the step model predicts for it plus
    the serving overhead of a step streaming that many tokens, times the step's factor from
    `spread` (none: exactly the prediction)."""

    def __init__(self, model: StepModel, tokens: TokenSource,
                 serving: ServingOverhead = ServingOverhead(),
                 spread: StepSpread | None = None) -> None:
        self.model = model
        self.tokens = tokens
        self.serving = serving
        self.spread = spread
        self.num_steps = 0   # steps priced so far: the next one's index
        self.last_duration_s = 0.0

    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        draw = self.tokens.next
        sampled = {item.request.request_id: [draw()] for item in plan.scheduled
                   if item.samples}
        self.last_duration_s = self.scattered(
            self.model.predict(step_shape(plan)) + self.serving.seconds(len(sampled)),
            self.num_steps)
        self.num_steps += 1
        return RunnerOutput(sampled)

    def scattered(self, seconds: float, step: int) -> float:
        """`seconds` as step number `step` lasts."""
        return seconds if self.spread is None else seconds * self.spread.factor(step)


@dataclass(frozen=True)
class ReplicaConfig:
    """One simulated replica's engine: its KV blocks and scheduler, as `ember serve` builds
    them from the same options."""

    step_model: StepModel
    num_blocks: int
    serving: ServingOverhead = field(default_factory=ServingOverhead)   # added to each step
    block_size: int = 16
    max_model_len: int = 8192
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    enable_prefix_caching: bool = True
    eviction_policy: str = "lru"
    max_waiting: int = 256           # queued requests before a 429, as --max-waiting
    eos_token_ids: frozenset[int] = frozenset()

    @property
    def context_limit(self) -> int:
        return min(self.max_model_len, self.num_blocks * self.block_size)


@dataclass(frozen=True)
class SimRequest:
    """One workload request, tokenized as a replica would tokenize it."""

    index: int
    prompt_ids: list[int]
    max_tokens: int
    block_keys: list[int] = field(default_factory=list)  # for the prefix policy


class SimReplica:
    """A replica's engine on the virtual clock: the real Scheduler and KVCacheManager."""

    def __init__(self, replica_id: str, config: ReplicaConfig, tokens: TokenSource,
                 spread: StepSpread | None = None) -> None:
        self.id = replica_id
        self.config = config
        kv = KVCacheManager(config.num_blocks, config.block_size, config.enable_prefix_caching,
                            config.eviction_policy, share_generated=False)
        # (the engine's longest sequence is cut to what its KV cache holds, as here)
        self.scheduler = Scheduler(config.scheduler, kv, config.context_limit)
        self.runner = SimRunner(config.step_model, tokens, config.serving, spread)
        self.plan: SchedulerOutput | None = None   # the step running now
        self.result: RunnerOutput | None = None
        self.busy_s = 0.0
        self.kv_usage_s = 0.0   # KV usage integrated over busy time
        self.batch_s = 0.0      # requests in the step, integrated over busy time
        self.peak_kv_usage = 0.0
        self.num_steps = 0
        self.num_steps_ahead = 0   # of them, those apply_ahead applied
        self.ahead: list[tuple[float, float]] = []   # planned steps' (end, duration)
        self.ahead_start = 0.0

    @property
    def busy(self) -> bool:
        return self.plan is not None or bool(self.ahead)

    def start_step(self) -> float | None:
        """Plan and 'run' the next step; its duration, or None when there is nothing to do."""
        plan = self.scheduler.schedule()
        if not plan.scheduled:
            return None
        self.plan, self.result = plan, self.runner.execute(plan)
        duration = self.runner.last_duration_s
        usage = self.scheduler.kv.usage()
        self.busy_s += duration
        self.kv_usage_s += usage * duration
        self.batch_s += len(plan.scheduled) * duration
        self.peak_kv_usage = max(self.peak_kv_usage, usage)
        self.num_steps += 1
        return duration

    def end_step(self) -> list[Request]:
        """Apply the running step's tokens; the requests that advanced."""
        plan, result, self.plan, self.result = self.plan, self.result, None, None
        return self.scheduler.update(plan, result)

    def plan_ahead(self, now: float) -> float | None:
        """Plan the steps from `now` on that are plain decodes of every running request which
        the scheduler would plan and apply alike: no request waits or drafts, and each one's
        next tokens fit the blocks it holds (nothing to allocate; nor to cache, as the
        engine caches no generated block) and end nothing. Priced by the step model;
        applied by apply_ahead. When the last of them ends, or None if the next step is not
        one."""
        room = self._decode_room()
        if room <= 0:
            return None
        running = self.scheduler.running
        num_rows = len(running)
        keys = sum(r.num_computed_tokens for r in running)
        runner = self.runner
        predict = runner.model.predict
        serving = runner.serving.seconds(num_rows)   # (every row streams a token)
        spread = runner.spread
        self.ahead_start, end = now, now
        for k in range(runner.num_steps, runner.num_steps + room):
            keys += num_rows   # each row at position p reads p + 1 keys
            duration = predict(StepShape(decode_rows=num_rows, decode_keys=keys)) + serving
            if spread is not None:   # (runner.scattered, without a call per step when off)
                duration *= spread.factor(k)
            end += duration
            self.ahead.append((end, duration))
        return end

    def apply_ahead(self, until: float, inclusive: bool) -> list[float]:
        """Apply the planned steps that end before `until` (or at it, if `inclusive`) as
        update() would: a drawn token each, one more computed token; forget the rest.
        Returns the applied steps' end times."""
        running, draw = self.scheduler.running, self.runner.tokens.next
        usage = self.scheduler.kv.usage()
        ends = []
        for end, duration in self.ahead:
            if end > until or (end == until and not inclusive):
                break
            for request in running:
                request.append_output(draw())
                request.num_computed_tokens += 1
            self.busy_s += duration
            self.kv_usage_s += usage * duration
            self.batch_s += len(running) * duration
            ends.append(end)
        self.ahead.clear()
        self.num_steps += len(ends)
        self.num_steps_ahead += len(ends)
        self.runner.num_steps += len(ends)
        return ends

    def _decode_room(self) -> int:
        """How many next steps are plain decodes of all running requests (plan_ahead)."""
        sched, bs = self.scheduler, self.config.block_size
        if not sched.running or sched.waiting or sched.held or sched.loading or \
                sched.spec.drafts_with_a_model or \
                len(sched.running) > sched.config.max_num_batched_tokens:
            return 0
        room = math.inf
        for r in sched.running:
            computed, params = r.num_computed_tokens, r.params
            if r.num_tokens - computed != 1 or computed < r.num_prompt_tokens or \
                    r.draft_token_ids or r.grammar is not None or not params.ignore_eos or \
                    params.stop_token_ids:
                return 0
            covered = len(sched.kv.block_table(r.request_id)) * bs
            if sched.kv.share_generated:   # (a generated block is cached once it fills)
                covered = min(covered, (computed // bs + 1) * bs - 1)
            room = min(room, covered - computed,
                       r.max_tokens - len(r.output_token_ids) - 1,
                       sched.max_model_len - computed - 2)
        return int(room)


@dataclass
class _Flight:
    """A request between its arrival and its last token."""

    sim: SimRequest
    arrival: float
    replica: int
    record: RequestRecord


class SimGateway:
    """`ember route`'s choice of replica, on the virtual clock: the gateway's own Picker and
    per-replica BlockIndex, fed by the replicas' KV events every EVENTS_INTERVAL_S and by
    what was just routed, with waiting and KV usage as of the last probe."""

    def __init__(self, replicas: list[SimReplica], policy: str,
                 prefix: PrefixConfig = PrefixConfig()) -> None:
        self.replicas = replicas
        self.policy = policy
        self.prefix = prefix
        self.picker = Picker(policy, prefix)
        self.indexes = [BlockIndex() for _ in replicas]
        for index, replica in zip(self.indexes, replicas):
            index.block_size = replica.config.block_size
        self.in_flight = [0] * len(replicas)
        self.gauges = [(0, 0.0)] * len(replicas)   # (waiting, kv usage) from the last probe
        self.next_probe = 0.0
        self.next_poll = 0.0

    def route(self, request: SimRequest, now: float, exclude: set[int]) -> int | None:
        """The replica for `request` (its in-flight count raised at once), or None if every
        replica is excluded."""
        self._refresh(now)
        cands = []
        for i in range(len(self.replicas)):
            if i in exclude:
                continue
            waiting, usage = self.gauges[i]
            matched = self.indexes[i].matched(request.block_keys, now) \
                if self.policy == "prefix" else 0
            cands.append(Candidate(self.replicas[i].id, self.in_flight[i], waiting, usage,
                                   matched))
        if not cands:
            return None
        decision = self.picker.pick(cands, len(request.block_keys))
        chosen = next(i for i, r in enumerate(self.replicas) if r.id == decision.replica_id)
        self.in_flight[chosen] += 1
        self.indexes[chosen].note_routed(request.block_keys, now + self.prefix.routed_ttl_s)
        return chosen

    def release(self, replica: int) -> None:
        self.in_flight[replica] -= 1

    def _refresh(self, now: float) -> None:
        if now >= self.next_probe:
            self.gauges = [(r.scheduler.num_waiting, r.scheduler.kv.usage())
                           for r in self.replicas]
            self.next_probe = now + PROBE_INTERVAL_S
        if self.policy == "prefix" and now >= self.next_poll:
            for index, replica in zip(self.indexes, self.replicas):
                poll_events(index, replica.scheduler.kv)
                index.expire(now)
            self.next_poll = now + EVENTS_INTERVAL_S


def poll_events(index: BlockIndex, kv: KVCacheManager) -> None:
    """What the gateway's poll of /kv/events does, without HTTP: the events after the index's
    cursor, applied; a gap means a resync from the start of the log."""
    if kv.pool.next_event_seq - 1 == index.cursor:
        return   # nothing new (an empty answer changes nothing)
    for _ in range(2):
        events, dropped = _events_after(kv.pool, index.cursor)
        payload = {"dropped": dropped, "events": [
            {"seq": e.seq, "type": e.kind, "block_hash": e.block_key} for e in events]}
        if index.apply(payload):
            return


def _events_after(pool: BlockPool, seq: int) -> tuple[list[KVEvent], bool]:
    """pool.events_after(seq), reading only the log's new tail: that one copies the whole
    log (up to 10,000 events) to be safe from the engine thread, and a simulation, one
    thread, polls it thousands of times."""
    log = pool.events
    if not log:
        return [], False
    num_new = min(pool.next_event_seq - 1 - seq, len(log))
    return [log[k] for k in range(len(log) - num_new, len(log))], log[0].seq > seq + 1


@dataclass(frozen=True)
class Load:
    """How requests arrive: at given times (open loop, as `--rate`), or `concurrency`
    clients each sending the next request when the last ends (`--concurrency`)."""

    arrival_times: tuple[float, ...] = ()
    concurrency: int | None = None
    ramp_up_s: float = 0.0
    duration_s: float | None = None   # no request is sent after this


@dataclass
class FleetStats:
    """What the replicas did over the run."""

    duration_s: float
    busy_s: list[float]
    mean_kv_usage: list[float]      # over each replica's busy time
    mean_batch: list[float]         # requests per step, over each replica's busy time
    peak_kv_usage: list[float]
    num_steps: list[int]
    preemptions: list[int]
    prefix_hit_tokens: int
    prefix_query_tokens: int
    requests_per_replica: list[int]

    @property
    def utilisation(self) -> float:
        """Mean share of the run each replica spent stepping (a replica steps whenever it
        holds a request, so mean_batch says how full those steps were)."""
        if self.duration_s <= 0:
            return 0.0
        return sum(self.busy_s) / (len(self.busy_s) * self.duration_s)


class FleetSim:
    """Replays a workload through `num_replicas` simulated replicas behind a gateway (once:
    the replicas keep what the run left in their caches)."""

    ARRIVAL, STEP_END = 0, 1   # event kinds
    SENT, CLIENT = -1, -2      # an arrival's payload: set at the start, or a client's next

    def __init__(self, config: ReplicaConfig, num_replicas: int, policy: str,
                 token_ids: Sequence[int], seed: int = 0,
                 prefix: PrefixConfig = PrefixConfig(), max_tries: int = 3,
                 decode_ahead: bool = True) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas={num_replicas} must be at least 1")
        self.config = config
        spread = config.serving.spread   # (each replica's steps scatter on their own)
        self.replicas = [SimReplica(f"r{i + 1}", config, TokenSource(token_ids, seed + i),
                                    StepSpread(spread, SPREAD_SEED + seed + i) if spread
                                    else None)
                         for i in range(num_replicas)]
        self.gateway = SimGateway(self.replicas, policy, prefix)
        self.max_tries = max_tries
        self.decode_ahead = decode_ahead
        self._params: dict[int, SamplingParams] = {}
        self._events: list[tuple[float, int, int, int]] = []   # (time, seq, kind, payload)
        self._seq = 0
        self._flights: dict[str, _Flight] = {}
        self.records: list[RequestRecord] = []
        self._routed = [0] * num_replicas
        self._num_admitted = 0
        self._requests: list[SimRequest] = []
        self._load = Load()
        self._next = 0   # the next request to send
        self._step_seq = [0] * num_replicas   # each replica's pending step-end event

    def run(self, requests: Sequence[SimRequest], load: Load) -> list[RequestRecord]:
        """Every request's record, ordered by start time (as `ember bench` orders them)."""
        if self._seq:
            raise RuntimeError("a FleetSim runs once; make another for another run")
        self._requests, self._load = list(requests), load
        if load.concurrency is None:
            for t in load.arrival_times[:len(self._requests)]:
                self._push(t, self.ARRIVAL, self.SENT)
        else:
            width = min(load.concurrency, len(self._requests)) or 1
            for k in range(width):
                self._push(load.ramp_up_s * k / width, self.ARRIVAL, self.SENT)
        now = 0.0
        while self._events:
            now, seq, kind, payload = heapq.heappop(self._events)
            if kind == self.ARRIVAL:
                self._arrive(now, payload == self.CLIENT)
            elif seq == self._step_seq[payload]:   # (else a cut plan_ahead's end)
                self._step_end(now, payload)
        for flight in self._flights.values():   # a request the engine could never finish
            flight.record.error, flight.record.error_message = "timeout", "never finished"
            flight.record.e2e = now - flight.arrival
            self.records.append(flight.record)
        self._flights.clear()
        self.records.sort(key=lambda r: (r.start, r.index))
        return self.records

    def stats(self) -> FleetStats:
        ends = [r.start + r.e2e for r in self.records if r.e2e is not None]
        duration = max(ends) - min(r.start for r in self.records) if ends else 0.0
        kvs = [r.scheduler.kv for r in self.replicas]
        return FleetStats(
            duration_s=duration, busy_s=[r.busy_s for r in self.replicas],
            mean_kv_usage=[r.kv_usage_s / r.busy_s if r.busy_s else 0.0 for r in self.replicas],
            mean_batch=[r.batch_s / r.busy_s if r.busy_s else 0.0 for r in self.replicas],
            peak_kv_usage=[r.peak_kv_usage for r in self.replicas],
            num_steps=[r.num_steps for r in self.replicas],
            preemptions=[r.scheduler.num_preemptions for r in self.replicas],
            prefix_hit_tokens=sum(kv.num_hit_tokens for kv in kvs),
            prefix_query_tokens=sum(kv.num_queried_tokens for kv in kvs),
            requests_per_replica=list(self._routed))

    # -- events ----------------------------------------------------------------------------

    def _push(self, t: float, kind: int, payload: int) -> None:
        self._seq += 1
        if kind == self.STEP_END:
            self._step_seq[payload] = self._seq
        heapq.heappush(self._events, (t, self._seq, kind, payload))

    def _arrive(self, now: float, late: bool) -> None:
        """A request is sent at `now`; `late`: by a client whose last request ended then (its
        event comes after the step ends due then, as the heap orders them: see _cut_ahead)."""
        if self._next >= len(self._requests) or \
                (self._load.duration_s is not None and now >= self._load.duration_s):
            return
        sim = self._requests[self._next]
        self._next += 1
        record = RequestRecord(index=sim.index, start=now,
                               target_prompt_tokens=len(sim.prompt_ids),
                               target_output_tokens=sim.max_tokens)
        error = self._admit(sim, now, record, late)
        if error is not None:
            record.error, record.error_message, record.e2e = error[0], error[1], 0.0
            self.records.append(record)
            self._next_client(now)

    def _admit(self, sim: SimRequest, now: float, record: RequestRecord, late: bool
               ) -> tuple[str, str] | None:
        """Route and queue the request (a full replica's 429 is retried on another, as the
        gateway does); the error a client would get, or None."""
        limit = self.config.context_limit
        if len(sim.prompt_ids) >= limit:
            return "http_400", f"prompt of {len(sim.prompt_ids)} tokens; the context holds {limit}"
        max_tokens = min(sim.max_tokens, limit - len(sim.prompt_ids))
        tried: set[int] = set()
        while len(tried) < self.max_tries:
            i = self.gateway.route(sim, now, tried)
            if i is None:
                break
            replica = self.replicas[i]
            if replica.scheduler.num_waiting + 1 > self.config.max_waiting:
                self.gateway.release(i)
                tried.add(i)
                continue
            self._cut_ahead(i, now, late)
            self._num_admitted += 1
            request_id = f"{sim.index}-{self._num_admitted}"
            replica.scheduler.add(Request(request_id, sim.prompt_ids, self._sampling(max_tokens),
                                          self.config.eos_token_ids, max_tokens,
                                          arrival_time=now))
            self._flights[request_id] = _Flight(sim, now, i, record)
            self._routed[i] += 1
            if not replica.busy:
                self._start(i, now)
            return None
        return "http_429", "every replica tried had a full queue"

    def _sampling(self, max_tokens: int) -> SamplingParams:
        """`ember bench`'s forced output: exactly max_tokens tokens (ignore_eos, min_tokens)."""
        params = self._params.get(max_tokens)
        if params is None:
            params = self._params[max_tokens] = SamplingParams(
                max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        return params

    def _start(self, i: int, now: float) -> None:
        replica = self.replicas[i]
        end = replica.plan_ahead(now) if self.decode_ahead else None
        if end is None:
            duration = replica.start_step()
            end = None if duration is None else now + duration
        if end is not None:
            self._push(end, self.STEP_END, i)

    def _step_end(self, now: float, i: int) -> None:
        replica = self.replicas[i]
        if replica.ahead:
            self._note_ahead(i, replica.apply_ahead(now, inclusive=True))
        else:
            for request in replica.end_step():
                flight = self._flights[request.request_id]
                record = flight.record
                since = now - flight.arrival
                record.chunk_times.append(since)
                if record.ttft is None:
                    record.ttft = since
                if request.is_finished:
                    self._finish(request, flight, now)
        self._start(i, now)

    def _cut_ahead(self, i: int, now: float, late: bool) -> None:
        """A request routed to replica i at `now` joins its queue: of the steps planned
        ahead, those that ended first are applied, and the step running at `now` is planned
        by the scheduler (as it was when it began: nothing changed on the replica since).
        A step ending exactly at `now` ended first if its event was queued first: always,
        for a `late` request, never for one sent at the start."""
        replica = self.replicas[i]
        if not replica.ahead:
            return
        ends = replica.apply_ahead(now, inclusive=late)
        self._note_ahead(i, ends)
        began = ends[-1] if ends else replica.ahead_start
        self._step_seq[i] = -1   # the planned steps' end event no longer stands
        duration = replica.start_step()
        if duration is not None:
            self._push(began + duration, self.STEP_END, i)

    def _note_ahead(self, i: int, ends: list[float]) -> None:
        """The tokens of steps applied ahead, in their requests' records."""
        for request in self.replicas[i].scheduler.running:
            flight = self._flights[request.request_id]
            flight.record.chunk_times.extend(end - flight.arrival for end in ends)

    def _finish(self, request: Request, flight: _Flight, now: float) -> None:
        record = flight.record
        record.e2e = now - flight.arrival
        record.prompt_tokens = request.num_prompt_tokens
        record.output_tokens = len(request.output_token_ids)
        record.cached_tokens = request.num_cached_tokens
        record.usage_reported = True
        self.records.append(record)
        del self._flights[request.request_id]
        self.gateway.release(flight.replica)
        self._next_client(now)

    def _next_client(self, now: float) -> None:
        """A closed-loop client sends its next request when its last one ends."""
        if self._load.concurrency is not None and self._next < len(self._requests):
            self._push(now, self.ARRIVAL, self.CLIENT)

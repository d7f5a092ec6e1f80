"""One token-budget loop decides what every request computes in the next step.

There are no prefill and decode phases. Each request has `num_computed_tokens` and catches up
to `num_tokens`: a new prompt starts past its prefix-cache hit and catches up in chunks of at
most the step's token budget (chunked prefill; a smaller one while others decode, so that
their tokens keep coming), a running request catches up one token at a time (decode), and a
preempted request starts again from what the cache still holds (recompute). Continuous
batching falls out: every step mixes whatever requests have tokens to compute.

Order: `running` is kept sorted by (priority, arrival): the most important requests get the
budget first and the least important is the one preempted when blocks run out. A waiting
request that outranks a running one takes its seat (or its blocks) at the start of a step.
With fair share, the next waiting request admitted is the one whose user has the fewest
requests running, so one client's flood cannot starve the others.

Disaggregated serving (ember/kv_transfer/) adds two ends to a request's life. A request whose
first tokens' KV another replica computed is admitted into LOADING: it gets its blocks (its
prefix-cache hit, then fresh ones), the engine copies the rest in (take_loads), and
end_load() moves it on to decode, or, if the copy failed, to compute those tokens itself.
A request aborted while LOADING keeps its blocks until its copy has ended: a block a copy
still writes is never handed to anyone else. And a finished request with `keep_blocks`
hands its blocks over (take_kept) instead of freeing them, for another replica to copy.
"""
from __future__ import annotations

import bisect
import time
from collections.abc import Set as AbstractSet

from ember.config import SchedulerConfig, SpecConfig
from ember.errors import ContextTooLong, InvalidRequest
from ember.kv.kv_manager import KVCacheManager, PrefixHit, cdiv
from ember.request import FinishReason, Request, RequestStatus
from ember.scheduler.output import KVLoad, RunnerOutput, ScheduledRequest, SchedulerOutput


SPEC_PAUSE_STEPS = 16  # steps without drafts for a request whose drafts keep failing


class SpecStats:
    """Speculative decoding counters (for the metrics): verifications, drafted tokens, and
    drafted tokens the target accepted."""

    def __init__(self) -> None:
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    def add(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted


def rank(request: Request) -> tuple[int, float, str]:
    """Sort key: lower priority value first, then earlier arrival (then id, to be total)."""
    return (request.priority, request.arrival_time, request.request_id)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int,
                 spec: SpecConfig = SpecConfig(), whole_prompts: bool = False) -> None:
        self.config = config
        self.spec = spec
        self._lookahead = spec.drafts_with_a_model   # (read for every request of every step)
        self.spec_stats = SpecStats()
        self.whole_prompts = whole_prompts  # never split a prompt across steps (encoders)
        self.kv = kv
        self.max_model_len = max_model_len
        self.waiting: list[Request] = []
        self.running: list[Request] = []  # sorted by rank()
        self.requests: dict[str, Request] = {}
        self._freed_ids: set[str] = set()
        self._short_of_memory = False  # a running request lost its blocks in this step
        self.num_preemptions = 0
        # Requests kept out of the next steps while the engine finds which one makes a step
        # fail (they keep their blocks and their place).
        self.held: frozenset[str] = frozenset()
        self.loading: dict[str, Request] = {}    # LOADING, or aborted while LOADING
        self._loads: list[KVLoad] = []           # copies to start (take_loads)
        self._kept: list[tuple[Request, list[int]]] = []   # blocks handed over (take_kept)

    # -- admission and removal -------------------------------------------------------------

    def add(self, request: Request) -> None:
        """Queue a request, or refuse it now if it could never run to completion."""
        if request.request_id in self.requests:
            raise InvalidRequest(f"request id {request.request_id!r} is already in use; "
                                 "give each request a unique id", param="request_id")
        total = request.num_prompt_tokens + request.max_tokens
        if total > self.max_model_len:
            raise ContextTooLong(request.num_prompt_tokens, request.max_tokens,
                                 self.max_model_len)
        if total > self.kv.capacity_tokens:
            raise ContextTooLong(request.num_prompt_tokens, request.max_tokens,
                                 self.kv.capacity_tokens, what="the whole KV cache")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish(self, request_id: str, reason: FinishReason) -> Request | None:
        """End a request at any moment (abort, stop string) and free its blocks."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status is RequestStatus.LOADING:
            # its blocks stay held until its copy ends (end_load frees them)
            request.status = RequestStatus.FINISHED
            request.finish_reason = reason
            self._freed_ids.add(request.request_id)
            return request
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._retire(request, reason)
        return request

    def has_unfinished(self) -> bool:
        return bool(self.requests) or bool(self.loading)

    # -- copies from and to other replicas --------------------------------------------------

    def take_loads(self) -> list[KVLoad]:
        """The copies of other replicas' KV that the last schedule() started, and those it
        found wholly cached here (nothing to copy: the request went on at once); clears
        them."""
        loads, self._loads = self._loads, []
        return loads

    def take_kept(self) -> list[tuple[Request, list[int]]]:
        """Finished `keep_blocks` requests and their blocks, now the caller's to release
        (kv.release_blocks); clears them."""
        kept, self._kept = self._kept, []
        return kept

    def _start_load(self, request: Request) -> bool:
        """Admit a request whose first tokens' KV comes from another replica: its blocks now,
        LOADING until end_load(). False, changing nothing, when blocks are short."""
        hit = self.kv.allocate_external(request)
        if hit is None:
            return False
        self.waiting.remove(request)
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
            request.num_cached_tokens = hit.num_tokens
        request.num_computed_tokens = hit.num_tokens
        num_blocks = cdiv(request.num_external_tokens, self.kv.block_size)
        table = self.kv.block_table(request.request_id)
        self._loads.append(KVLoad(request.request_id, list(table[:num_blocks]),
                                  len(hit.blocks)))
        if len(hit.blocks) >= num_blocks:   # this replica's cache holds all of it
            self._end_external(request, loaded=True)
            return True
        request.status = RequestStatus.LOADING
        self.loading[request.request_id] = request
        return True

    def end_load(self, request_id: str, loaded: bool) -> None:
        """A copy ended (its writer is done with the blocks): the request decodes if it
        `loaded`, else computes what did not arrive; one aborted meanwhile frees its blocks."""
        request = self.loading.pop(request_id, None)
        if request is None:
            return
        if request.is_finished:
            self.kv.free(request)
            return
        self._end_external(request, loaded)

    def _end_external(self, request: Request, loaded: bool) -> None:
        if loaded:
            request.num_computed_tokens = request.num_external_tokens
            self.kv.cache_full_blocks(request)
        request.num_external_tokens = 0   # a later preemption recomputes, as for any request
        request.status = RequestStatus.RUNNING
        bisect.insort(self.running, request, key=rank)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # -- the step --------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        self._make_room_for_outranking()
        self._short_of_memory = False
        budget = self._budget()
        scheduled: list[ScheduledRequest] = []
        # rows the step may spend on drafts: a step of many rows gains nothing from them
        spec_room = self.spec.max_spec_rows - len(self.running)
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if request.request_id in self.held:
                i += 1
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if self.whole_prompts and num_new < request.num_tokens - request.num_computed_tokens:
                break
            drafts = self._drafts(request, num_new, budget, spec_room)
            num_new += len(drafts)
            if not self._allocate_or_preempt(request, num_new):
                break
            scheduled.append(self._plan(request, num_new, drafts))
            self._allocate_lookahead(scheduled[-1], spec_room)
            budget -= num_new
            spec_room -= len(drafts)
            i += 1
        # Admit waiting requests only if no running request lost its blocks this step: that
        # means memory is short, and admitting more would only preempt again.
        if not self._short_of_memory:
            self._admit_waiting(scheduled, budget)
        freed, self._freed_ids = frozenset(self._freed_ids), set()
        return SchedulerOutput(scheduled, freed, self.kv.take_copies())

    def unschedule(self, plan: SchedulerOutput) -> None:
        """A plan that never ran: its requests keep their computed tokens (update() was not
        applied), and the next plan carries its freed ids and block copies again."""
        self._freed_ids |= plan.finished_request_ids
        self.kv.return_copies(plan.block_copies)

    def _budget(self) -> int:
        """The step's tokens: all of max_num_batched_tokens, or, while requests are decoding,
        one per decode and at most prefill_tokens_with_decodes of prompts."""
        budget, cap = self.config.max_num_batched_tokens, self.config.prefill_tokens_with_decodes
        decoding = sum(1 for r in self.running if r.num_tokens - r.num_computed_tokens == 1)
        return budget if cap is None or decoding == 0 else min(budget, decoding + cap)

    def _next_waiting(self, passed: AbstractSet[str] = frozenset()) -> Request | None:
        skip = self.held | passed
        waiting = [r for r in self.waiting if r.request_id not in skip] \
            if skip else self.waiting
        if not waiting:
            return None
        if not self.config.fair_share:
            return min(waiting, key=rank)
        load: dict[str | None, int] = {}
        for r in self.running:
            load[r.user] = load.get(r.user, 0) + 1
        return min(waiting, key=lambda r: (r.priority, load.get(r.user, 0), rank(r)))

    def _blocks_to_admit(self, request: Request, budget: int) -> int:
        """Free blocks the request needs to start (ignoring cache hits: an upper bound)."""
        num_new = min(request.num_tokens - request.num_computed_tokens, budget)
        return cdiv(request.num_computed_tokens + num_new, self.kv.block_size)

    def _make_room_for_outranking(self) -> None:
        """A waiting request that outranks the lowest running one takes its seat, or its
        blocks, if it could not otherwise start."""
        while self.running:
            candidate = self._next_waiting()
            if candidate is None or candidate.priority >= self.running[-1].priority:
                return
            seats_full = len(self.running) >= self.config.max_num_seqs
            blocks_short = self._blocks_to_admit(
                candidate, self.config.max_num_batched_tokens) > self.kv.num_free_blocks
            if not (seats_full or blocks_short):
                return
            self._preempt(self.running.pop())

    def _admit_waiting(self, scheduled: list[ScheduledRequest], budget: int) -> None:
        if not self.waiting:
            return
        # a request that would compute a prefix block a running prompt is computing waits a
        # step for it to be cached; those behind it may start meanwhile
        computing = self.kv.computing_keys(
            r for r in self.running if r.request_id not in self.held)
        passed: set[str] = set()
        while budget > 0 and len(self.running) + len(self.loading) < self.config.max_num_seqs:
            request = self._next_waiting(passed)
            if request is None:
                return
            if request.num_external_tokens and not request.num_computed_tokens:
                if not self._start_load(request):
                    return
                continue
            if self.kv.next_block_computing(request, computing):
                passed.add(request.request_id)
                continue
            hit = self.kv.find_prefix(request) if request.num_computed_tokens == 0 \
                else PrefixHit()
            num_hit = hit.num_tokens
            num_new = min(request.num_tokens - num_hit, budget)
            if self.whole_prompts and num_new < request.num_tokens - num_hit:
                return  # it waits for a step with room for all of it
            if not self.kv.allocate_slots(request, num_hit + num_new, hit):
                return
            self.waiting.remove(request)
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
                request.num_cached_tokens = num_hit
            request.num_computed_tokens = num_hit
            request.status = RequestStatus.RUNNING
            bisect.insort(self.running, request, key=rank)
            computing |= self.kv.computing_keys([request])
            scheduled.append(self._plan(request, num_new))
            self._allocate_lookahead(scheduled[-1], self.spec.max_spec_rows - len(self.running))
            budget -= num_new

    def _allocate_lookahead(self, item: ScheduledRequest, spec_room: int) -> None:
        """Slots past the step's tokens for a model that drafts after it (it writes K and V
        of its drafts there): given where free blocks allow it, never at another request's
        expense. Lookahead blocks hold nothing the cache keeps; verification trims them."""
        request = item.request
        if not (self._lookahead and item.samples and spec_room > 0
                and request.grammar is None and request.spec_pause == 0):
            return
        if self.kv.num_free_blocks <= len(self.running):   # kept for the others' next tokens
            return
        num_tokens = min(item.end + self.spec.num_speculative_tokens, self.max_model_len)
        if self.kv.allocate_slots(request, num_tokens):
            # the plan's table is a copy: the drafter reads the slots from it
            item.block_ids[:] = self.kv.block_table(request.request_id)

    def _allocate_or_preempt(self, request: Request, num_new: int) -> bool:
        """Find blocks for `request`, preempting the lowest-ranked running requests if needed.

        Returns False when `request` itself had to be preempted.
        """
        while not self.kv.allocate_slots(request, request.num_computed_tokens + num_new):
            victim = self.running.pop()
            self._preempt(victim)
            self._short_of_memory = True
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        """Recompute preemption: drop the KV (cached blocks stay cached), keep the tokens,
        wait again with the same priority and arrival, so it resumes first among its peers."""
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.draft_token_ids = []
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.append(request)

    def _drafts(self, request: Request, num_new: int, budget: int,
                spec_room: int) -> tuple[int, ...]:
        """The request's drafted tokens this step may verify: none unless it decodes, and no
        more than the budget, the room for drafts, max_tokens or the context leave (the step
        adds the accepted drafts and one token of its own)."""
        if not request.draft_token_ids or num_new != 1 or \
                request.num_tokens - request.num_computed_tokens != 1:
            return ()
        room = min(budget - 1, spec_room,
                   request.max_tokens - len(request.output_token_ids) - 1,
                   self.max_model_len - request.num_tokens - 1)
        return tuple(request.draft_token_ids[:max(0, room)])

    def _plan(self, request: Request, num_new: int,
              drafts: tuple[int, ...] = ()) -> ScheduledRequest:
        start = request.num_computed_tokens
        return ScheduledRequest(request, start, num_new,
                                list(self.kv.block_table(request.request_id)),
                                samples=start + num_new - len(drafts) == request.num_tokens
                                and request.pooling is None,
                                draft_token_ids=drafts)

    def update(self, plan: SchedulerOutput, result: RunnerOutput) -> list[Request]:
        """Apply a step's results. Returns the requests that got new tokens (finished or not)."""
        advanced = []
        for item in plan.scheduled:
            request = item.request
            if request.is_finished:  # aborted while the step ran
                continue
            new_token_ids = result.sampled_token_ids.get(request.request_id, [])
            reason = self._append(request, new_token_ids,
                                  result.logprobs.get(request.request_id, []))
            num_drafts = len(item.draft_token_ids)
            # the KV of the accepted drafts is computed; that of the rejected ones is not
            num_accepted = max(0, len(new_token_ids) - 1) if num_drafts else 0
            request.num_computed_tokens = min(item.end - num_drafts + num_accepted,
                                              request.num_tokens)
            self.kv.cache_full_blocks(request)
            self.kv.release_outside_window(request)
            if num_drafts:
                self._count_drafts(request, num_drafts, num_accepted)
                self.kv.trim(request, request.num_tokens)   # rejected drafts' blocks
            embedding = result.pooled.get(request.request_id)
            if embedding is not None:  # an embedding request ends with its prompt
                request.embedding = embedding
                reason = FinishReason.STOP
            if reason is not None:
                self.finish(request.request_id, reason)
            else:
                self._take_drafts(request, result.draft_token_ids.get(request.request_id))
            if new_token_ids or embedding is not None:
                advanced.append(request)
        return advanced

    def _append(self, request: Request, token_ids: list[int],
                logprobs: list) -> FinishReason | None:
        """Append the step's tokens up to the first that ends the request; its reason."""
        for k, token_id in enumerate(token_ids):
            request.append_output(token_id)
            if logprobs:
                request.output_logprobs.append(logprobs[k])
            reason = self._stop_reason(request)
            if reason is not None:
                return reason
        return None

    def _count_drafts(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """Metrics, and the request's recent acceptance: one whose drafts keep failing stops
        drafting for a while (each verified draft costs a row of the step)."""
        self.spec_stats.add(num_drafts, num_accepted)
        rate = request.spec_acceptance = \
            0.7 * request.spec_acceptance + 0.3 * num_accepted / num_drafts
        if rate < self.spec.min_acceptance:
            request.spec_pause = SPEC_PAUSE_STEPS
            request.spec_acceptance = (1.0 + self.spec.min_acceptance) / 2

    @staticmethod
    def _take_drafts(request: Request, drafts: list[int] | None) -> None:
        if request.spec_pause > 0:
            request.spec_pause -= 1
            drafts = None
        request.draft_token_ids = drafts or []

    def stop_reason(self, request: Request) -> FinishReason | None:
        """Why the request's newest token ends it, or None."""
        return self._stop_reason(request)

    def _stop_reason(self, request: Request) -> FinishReason | None:
        params = request.params
        last = request.output_token_ids[-1]
        num_output = len(request.output_token_ids)
        if request.grammar is not None and last in request.eos_token_ids:
            return FinishReason.STOP  # the grammar is complete: ignore_eos cannot go on
        if num_output >= params.min_tokens and (
                (not params.ignore_eos and last in request.eos_token_ids)
                or last in params.stop_token_ids):
            return FinishReason.STOP
        if num_output >= request.max_tokens or request.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _retire(self, request: Request, reason: FinishReason) -> None:
        if request.keep_blocks and reason is FinishReason.LENGTH:
            self._kept.append((request, self.kv.detach(request)))
        else:
            self.kv.free(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self._freed_ids.add(request.request_id)

"""One token-budget loop decides what every request computes in the next step.

There are no prefill and decode phases. Each request has `num_computed_tokens` and catches up
to `num_tokens`: a new prompt catches up in chunks of at most the step's token budget (chunked
prefill), a running request catches up one token at a time (decode), and a preempted request
starts again from zero (recompute). Continuous batching falls out: every step mixes whatever
requests have tokens to compute.
"""
from __future__ import annotations

import time
from collections import deque

from ember.config import SchedulerConfig
from ember.errors import ContextTooLong, InvalidRequest
from ember.kv.kv_manager import KVCacheManager
from ember.request import FinishReason, Request, RequestStatus
from ember.scheduler.output import RunnerOutput, ScheduledRequest, SchedulerOutput


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int) -> None:
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the last is preempted first
        self.requests: dict[str, Request] = {}
        self._freed_ids: set[str] = set()
        self.num_preemptions = 0

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
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._retire(request, reason)
        return request

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # -- the step --------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        num_preemptions_before = self.num_preemptions
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._allocate_or_preempt(request, num_new):
                break
            scheduled.append(self._plan(request, num_new))
            budget -= num_new
            i += 1
        # Admit waiting requests only when nothing was preempted: a preemption means memory is
        # short, and admitting more would only preempt again.
        if self.num_preemptions == num_preemptions_before:
            self._admit_waiting(scheduled, budget)
        freed, self._freed_ids = frozenset(self._freed_ids), set()
        return SchedulerOutput(scheduled, freed)

    def _admit_waiting(self, scheduled: list[ScheduledRequest], budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self.kv.allocate_slots(request.request_id,
                                          request.num_computed_tokens + num_new):
                return
            self.waiting.popleft()
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(self._plan(request, num_new))
            budget -= num_new

    def _allocate_or_preempt(self, request: Request, num_new: int) -> bool:
        """Find blocks for `request`, preempting the newest running requests if needed.

        Returns False when `request` itself had to be preempted.
        """
        while not self.kv.allocate_slots(request.request_id,
                                         request.num_computed_tokens + num_new):
            victim = self.running.pop()
            self._preempt(victim)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        """Recompute preemption: drop the KV, keep the tokens, go back to the queue's front."""
        self.kv.free(request.request_id)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _plan(self, request: Request, num_new: int) -> ScheduledRequest:
        start = request.num_computed_tokens
        return ScheduledRequest(request, start, num_new, list(self.kv.block_table(request.request_id)),
                                samples=start + num_new == request.num_tokens)

    def update(self, plan: SchedulerOutput, result: RunnerOutput) -> list[Request]:
        """Apply a step's results. Returns the requests that got new tokens (finished or not)."""
        advanced = []
        for item in plan.scheduled:
            request = item.request
            if request.is_finished:  # aborted while the step ran
                continue
            request.num_computed_tokens = item.end
            new_token_ids = result.sampled_token_ids.get(request.request_id, [])
            new_logprobs = result.logprobs.get(request.request_id, [])
            for k, token_id in enumerate(new_token_ids):
                request.append_output(token_id)
                if new_logprobs:
                    request.output_logprobs.append(new_logprobs[k])
                reason = self._stop_reason(request)
                if reason is not None:
                    self.finish(request.request_id, reason)
                    break
            if new_token_ids:
                advanced.append(request)
        return advanced

    def _stop_reason(self, request: Request) -> FinishReason | None:
        params = request.params
        last = request.output_token_ids[-1]
        num_output = len(request.output_token_ids)
        if num_output >= params.min_tokens and (
                (not params.ignore_eos and last in request.eos_token_ids)
                or last in params.stop_token_ids):
            return FinishReason.STOP
        if num_output >= request.max_tokens or request.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _retire(self, request: Request, reason: FinishReason) -> None:
        self.kv.free(request.request_id)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self._freed_ids.add(request.request_id)
